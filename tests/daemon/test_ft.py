"""Fault-tolerant mode (issue 50): members on two nodes' services, one killed mid-step, a
replacement joins and receives the state, the job goes on.

Plain members (``ft_worker.py``, numpy only) check the protocol: the step a death hits fails
on every survivor and commits nowhere, the next quorum leaves the dead member out, a
replacement joins and receives the state from a live member, and every committed step
leaves the parameters bitwise equal on all members that committed it.  The soak (20
steps and one random kill by default; 100 steps and a kill every 10-20 with ``--full``)
checks the same over a chaos loop, and that the services' descriptors and memory stay flat.
The kills at each moment (``test_kill_at_each_moment``, the state's sender and receiver) make
the victim SIGKILL itself at a point of its step that no timing decides (``--die-where``).
"""

from __future__ import annotations

import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import pytest
from cluster import Served, have_mpiexec, serve

from conftest import full_run

HERE = Path(__file__).parent
WORKER = str(HERE / "ft_worker.py")

pytestmark = pytest.mark.skipif(not have_mpiexec(), reason="mpiexec missing (install mpich)")


class Member:
    """One member process, its output read line by line on a thread."""

    def __init__(
        self, served: Served, node: int, rid: str, steps: int, *args: str, spare: bool = False
    ) -> None:
        """``spare``: the process starts (its imports take seconds on a busy machine) and
        attaches only at :meth:`go`."""
        self.node, self.rid = node, rid
        self.flag = served.directory / f"go-{rid}"
        if spare:
            args = (*args, "--start-after", str(self.flag))
        env = dict(
            os.environ, PYTHONUNBUFFERED="1",
            TOTALREDUCE_FT_SOCKET=str(served.directory / f"ft{node}.sock"),
        )  # fmt: skip
        self.proc = subprocess.Popen(
            [sys.executable, WORKER, rid, str(steps), *args],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        self.lines: list[str] = []
        self.events: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            self.events.put(line)

    def wait_for(self, prefix: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.events.get(timeout=0.2)
            except queue.Empty:
                if self.proc.poll() is not None and self.events.empty():
                    break
                continue
            if line.startswith(prefix):
                return line
        raise AssertionError(f"{self.rid} never printed {prefix!r}:\n" + "\n".join(self.lines))

    def go(self) -> None:
        self.flag.touch()

    def committed(self) -> int:
        return max((int(x.split()[1]) for x in self.lines if x.startswith("COMMIT")), default=0)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def finish(self, timeout: float) -> None:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        time.sleep(0.1)  # the reader's last lines


def check_history(members: list[Member]) -> dict[int, set[int]]:
    """Every committed step equal on every member that committed it, no quorum committed on
    one member and rolled back on another; returns the members (sizes) per quorum."""
    shas: dict[int, set[str]] = defaultdict(set)
    fate: dict[int, set[str]] = defaultdict(set)
    sizes: dict[int, set[int]] = defaultdict(set)
    for m in members:
        for line in m.lines:
            w = line.split()
            if w[0] == "COMMIT":
                shas[int(w[1])].add(w[3])
                fate[int(w[2])].add("commit")
            elif w[0] == "ROLLBACK":
                fate[int(w[2])].add("rollback")
            elif w[0] == "QUORUM":
                sizes[int(w[1])].add(int(w[2]))
    text = "\n".join(f"--- {m.rid}:\n" + "\n".join(m.lines[-40:]) for m in members)
    assert all(len(s) == 1 for s in shas.values()), f"parameters differ after a step:\n{text}"
    assert all(len(f) == 1 for f in fate.values()), f"a quorum committed and rolled back:\n{text}"
    assert all(len(s) == 1 for s in sizes.values()), f"members disagree on a quorum:\n{text}"
    return sizes


def service_pids(served: Served) -> list[int]:
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if (
            len(cmd) > 3
            and cmd[1:4] == [b"-m", b"totalreduce.cli", b"serve"]
            and str(served.directory).encode() in cmd
        ):
            out.append(int(pid))
    return out


def usage(pid: int) -> tuple[int, int]:
    """(open descriptors, resident kB) of a process."""
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    rss = next(
        int(x.split()[1]) for x in Path(f"/proc/{pid}/status").read_text().splitlines()
        if x.startswith("VmRSS")
    )  # fmt: skip
    return fds, rss


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Served:
    d = tmp_path_factory.mktemp("ft")
    s = serve(2, 1, d, timeout=900, extra=("--fault-tolerant", "--join-timeout", "2"))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def served_one(tmp_path_factory: pytest.TempPathFactory) -> Served:
    d = tmp_path_factory.mktemp("ft1")
    s = serve(1, 1, d, timeout=900, extra=("--fault-tolerant", "--first-quorum", "3"))
    yield s
    s.stop()


@pytest.mark.parametrize("nodes", [pytest.param(1, marks=pytest.mark.full), 2])
def test_a_clean_leave_between_steps_fails_nothing(
    request: pytest.FixtureRequest, nodes: int
) -> None:
    """3 members (on one node, or 2 + 1 on two); b leaves cleanly (``Member.close()``) once
    step 3 committed, its vote having formed the next quorum with it.  Its service tells the
    others in the next round, before any op of step 4 can have ended, and the quorum is
    re-formed without it: step 4 commits on the two others (their allreduce, sent in the old
    quorum, goes again in the new one), nothing rolls back after the leave, and every
    committed step has equal parameters on its members."""
    served = request.getfixturevalue("served_one" if nodes == 1 else "served")
    k, steps = 3, 7
    least = ("--first-min", "3")  # (a late member would join behind: a quorum with state)
    a = Member(served, 0, f"a-leave{nodes}", steps, *least)
    b = Member(served, 0, f"b-leave{nodes}", steps, "--leave-at", str(k), *least)
    c = Member(served, nodes - 1, f"c-leave{nodes}", steps, *least)
    b.wait_for(f"LEFT {k}", 120)
    assert b.proc.wait(30) == 0
    for m in (a, c):
        m.finish(60)
        assert m.proc.returncode == 0 and m.lines[-1] == "DONE", "\n".join(m.lines[-20:])
        assert m.committed() == steps
        late = [x for x in m.lines if x.split()[0] in ("ROLLBACK", "FAIL")]
        assert not [x for x in late if int(x.split()[1]) > k], late
        again = [x.split() for x in m.lines if x.startswith("REFORMED")]
        assert [w[1] for w in again] == [str(k + 1)] and again[0][4] == "2", m.lines
    check_history([a, b, c])
    assert events(a)[-2 * (steps - k) :] == events(c)[-2 * (steps - k) :]


LARGE = """
import sys, numpy as np
from totalreduce.service.ft_member import Member
m = Member(sys.argv[1]); k = int(sys.argv[2]); step = 0
for n in (100_000, 300_000, 1000):  # through the memory shared with the service, grown, not
    q = m.start_quorum(step, min_replica_size=2, timeout=60)
    x = np.arange(n, dtype=np.float32) * (k + 1)
    avg = m.allreduce(x)
    want = np.arange(n, dtype=np.float32) * np.float32(1.5)
    assert avg.dtype == np.float32 and avg.shape == (n,) and np.array_equal(avg, want), n
    assert m.should_commit(True)
    step += 1
    if n == 300_000:
        print("MAPPED", flush=True)
        sys.stdin.readline()
m.close(); print("OK", flush=True)
"""


def test_large_averages_go_through_shared_memory(served: Served) -> None:
    """Averages of more than 64 KiB go through a memfd each member passes its service once
    (again when it grows): exact results on two nodes, and the services map the memory."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", LARGE, f"big{k}", str(k)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env=dict(os.environ, TOTALREDUCE_FT_SOCKET=str(served.directory / f"ft{k}.sock")),
        )
        for k in range(2)
    ]  # fmt: skip
    try:
        for p in procs:
            assert p.stdout is not None
            line = p.stdout.readline()
            assert line.startswith("MAPPED"), line + p.stdout.read()
        maps = [Path(f"/proc/{pid}/maps").read_text() for pid in service_pids(served)]
        assert all("memfd:totalreduce-ft" in m for m in maps), "a service did not map it"
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("\n")
            p.stdin.flush()
        outs = [p.communicate(timeout=60)[0] for p in procs]
        assert all(o.strip().endswith("OK") for o in outs), outs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_shared_memory_not_sealed_is_refused(served: Served) -> None:
    """A memfd that could shrink under the service's reads (no ``F_SEAL_SHRINK``) is
    refused with an error that says so, and the member is dropped; the service goes on."""
    from totalreduce.errors import TotalReduceError
    from totalreduce.service.ft_member import Member as Raw
    from totalreduce.transport import ft_frames as F

    m = Raw("unsealed", served.directory / "ft0.sock")
    fd = os.memfd_create("unsealed")
    try:
        os.ftruncate(fd, 1 << 16)
        with m._send_lock:
            F.send_fd(m._sock, {"kind": "shm", "size": 1 << 16}, fd)
        with pytest.raises(TotalReduceError, match="not sealed against shrinking"):
            m.start_quorum(0, timeout=10)
    finally:
        os.close(fd)
        m.close()
    wait_logged(served, "member unsealed", 10)
    ok = Raw("after-unsealed", served.directory / "ft0.sock")  # the service still serves
    ok.close()


@pytest.mark.parametrize("where", ["before", pytest.param("after", marks=pytest.mark.full)])
def test_kill_mid_step_then_replace(served: Served, where: str) -> None:
    """3 members on 2 nodes (2 + 1); one is killed in step 4 (before its allreduce: the
    survivors' allreduce fails; after it: their vote fails); the step commits nowhere,
    the next quorum has 2 members, a replacement joins, receives the state and trains on."""
    steps = 40
    slow = ("--sleep", "0.1")
    a = Member(served, 0, f"a-{where}", steps, *slow)
    victim = Member(served, 0, f"b-{where}", steps, "--pause-at", "4", "--pause-where", where)
    c = Member(served, 1, f"c-{where}", steps, *slow)
    joiner = Member(served, 0, f"b-{where}-new", steps, spare=True)
    victim.wait_for("PAUSE 4", 120)
    victim.kill()
    t_kill = time.monotonic()
    bad = a.wait_for("ROLLBACK 4", 60).split()
    assert c.wait_for("ROLLBACK 4", 60).split() == bad
    a.wait_for("COMMIT 4", 60)
    t_next = time.monotonic()
    joiner.go()
    joiner.wait_for("HEALED", 60)
    for m in (a, c, joiner):
        m.finish(120)
        assert m.proc.returncode == 0, "\n".join(m.lines[-20:]) + served.stderr()[-5000:]
        assert m.lines[-1] == "DONE"
    sizes = check_history([a, victim, c, joiner])
    qbad = int(bad[2])
    assert sizes[qbad] == {3}
    assert sizes[qbad + 1] == {2}, "the next quorum did not leave the dead member out"
    assert any(s == {3} for q, s in sizes.items() if q > qbad + 1), "the replacement never joined"
    fails = [x for x in a.lines + c.lines if x.startswith("FAIL")]
    if where == "before":
        assert len(fails) == 2 and all(x.split()[1] == "4" for x in fails), fails
        assert all("gone" in x for x in fails), fails
    healed = int(next(x for x in joiner.lines if x.startswith("HEALED")).split()[1])
    assert healed >= 4 and joiner.committed() == steps
    print(f"kill -> next commit {t_next - t_kill:.3f} s")


def events(m: Member) -> list[list[str]]:
    """A member's quorums (without its rank), commits and rollbacks, in order."""
    out = []
    for w in (x.split() for x in m.lines):
        if w[0] == "QUORUM":
            out.append(w[:3] + w[4:])
        elif w[0] in ("COMMIT", "ROLLBACK"):
            out.append(w)
    return out


def wait_logged(served: Served, text: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while text not in served.stderr():
        assert time.monotonic() < deadline, f"the services never logged {text!r}"
        time.sleep(0.02)


@pytest.mark.parametrize(
    "where",
    [
        "answered",
        "commit",
        pytest.param("quorum", marks=pytest.mark.full),
        pytest.param("allreduce", marks=pytest.mark.full),
    ],
)
def test_kill_at_each_moment(served: Served, where: str) -> None:
    """3 members on 2 nodes (2 + 1); one SIGKILLs itself at a moment of step K that no
    timing decides (ft_worker.py ``--die-where``):

    - ``quorum``: it asked for the quorum of step K, the quorum had not formed (the others
      hold their asks until the service logged the death): the quorum forms without it and
      step K commits on the survivors, nothing fails;
    - ``answered``: the quorum of step K formed with it (its answer arrived, unread): that
      step fails on both survivors (their allreduce raises: a member is gone) and commits
      nowhere; the next quorum leaves it out;
    - ``allreduce``: its part of step K's allreduce sent, the average not awaited: step K
      rolls back on both survivors (whether their allreduce ended or raised);
    - ``commit``: ``should_commit`` returned (yes) and it died before updating its
      parameters or asking again: step K stays committed on the survivors.

    Always: the survivors finish, every committed step has bitwise equal parameters on its
    members, no quorum committed on one member and rolled back on another, and every quorum
    after the death has the 2 survivors only."""
    k, steps = 3, 6
    hold = served.directory / f"hold-{where}"
    held = ("--hold-at", str(k), "--hold-file", str(hold)) if where == "quorum" else ()
    a = Member(served, 0, f"a-{where}", steps, *held)
    victim = Member(served, 0, f"b-{where}", steps, "--die-at", str(k), "--die-where", where)
    c = Member(served, 1, f"c-{where}", steps, *held)
    victim.wait_for(f"DIE {k} {where}", 120)
    assert victim.proc.wait(10) == -signal.SIGKILL
    if where == "quorum":
        wait_logged(served, f"member b-{where} (pid {victim.proc.pid}) died", 30)
        hold.touch()
    for m in (a, c):
        m.finish(60)
        assert m.proc.returncode == 0 and m.lines[-1] == "DONE", "\n".join(m.lines[-20:])
    check_history([a, victim, c])
    assert events(a) == events(c), "the survivors saw different quorums or decisions"
    ev = events(a)
    quorums = [(int(w[1]), int(w[2])) for w in ev if w[0] == "QUORUM"]
    sizes = [size for _, size in quorums]
    n3 = sizes.count(3)
    assert sizes == [3] * n3 + [2] * (len(sizes) - n3) and n3 < len(sizes), sizes
    last3 = quorums[n3 - 1][0]
    commits = {int(w[2]): int(w[1]) for w in ev if w[0] == "COMMIT"}
    rollbacks = {int(w[2]): int(w[1]) for w in ev if w[0] == "ROLLBACK"}
    fails = [x for x in a.lines + c.lines if x.startswith("FAIL")]
    if where in ("quorum", "commit"):
        assert not rollbacks and not fails, (rollbacks, fails)
        assert commits[last3] == (k if where == "commit" else k - 1)
    else:
        assert rollbacks == {last3: k}, rollbacks
        assert commits[last3 + 1] == k
    if where == "answered":
        assert len(fails) == 2 and all(x.split()[1:3] == [str(k), str(last3)] for x in fails)
        assert all("gone" in x for x in fails), fails
    assert victim.committed() == k - 1
    assert a.committed() == c.committed() == steps


@pytest.mark.full
@pytest.mark.parametrize("how", ["pause", "send"])
def test_kill_the_sender_of_the_state(served: Served, how: str) -> None:
    """The member that sends the state to a replacement is killed before it sends
    (``pause``: the test kills it while it pauses) or in the middle of the state's
    message (``send``: half of it written, then SIGKILL): the replacement's receive fails
    (and the step, everywhere), and it receives the state from the other survivor at the
    next quorum."""
    steps = 40
    if how == "pause":
        a = Member(served, 0, "a-send", steps, "--pause-where", "send")  # first by replica id
    else:
        a = Member(served, 0, "a-half", steps, "--die-where", "send")
    c = Member(served, 1, f"c-{how}", steps, "--sleep", "0.1")
    joiner = Member(served, 0, f"b-{how}", steps, spare=True)
    a.wait_for("COMMIT 3", 120)
    joiner.go()
    if how == "pause":
        a.wait_for("PAUSE", 60)
        a.kill()
    else:
        a.wait_for("DIE", 60)
        assert a.proc.wait(10) == -signal.SIGKILL
    joiner.wait_for("HEALED", 60)
    for m in (c, joiner):
        m.finish(120)
        assert m.proc.returncode == 0 and m.lines[-1] == "DONE", "\n".join(m.lines[-20:])
    assert any(x.startswith("FAIL") and "gone" in x for x in joiner.lines), joiner.lines[:10]
    check_history([a, c, joiner])


@pytest.mark.full
def test_kill_the_receiver_of_the_state(served: Served) -> None:
    """A replacement dies while it receives the state (its request sent, the state's first
    byte read): the step of the quorum it joined fails on both survivors, the next quorum
    leaves it out, and a second replacement receives the state and trains on."""
    steps = 30
    a = Member(served, 0, "a-recv", steps, "--sleep", "0.1")
    c = Member(served, 1, "c-recv", steps, "--sleep", "0.1")
    joiner = Member(served, 0, "b-recv", steps, "--die-where", "recv", spare=True)
    second = Member(served, 0, "b-recv-2", steps, spare=True)
    a.wait_for("COMMIT 3", 120)
    joiner.go()
    joiner.wait_for("DIE", 60)
    assert joiner.proc.wait(10) == -signal.SIGKILL
    a.wait_for("ROLLBACK", 60)
    a.wait_for("QUORUM", 60)  # without the dead joiner (the second must not join it)
    second.go()
    second.wait_for("HEALED", 60)
    for m in (a, c, second):
        m.finish(120)
        assert m.proc.returncode == 0 and m.lines[-1] == "DONE", "\n".join(m.lines[-20:])
    check_history([a, c, joiner, second])
    assert events(a) == events(c)
    ev = events(a)
    i = next(i for i, w in enumerate(ev) if w[0] == "ROLLBACK")
    assert ev[i - 1][:3] == ["QUORUM", ev[i][2], "3"], ev[: i + 1]  # the joiner's quorum
    assert ev[i + 1][:3] == ["QUORUM", str(int(ev[i][2]) + 1), "2"], ev[i : i + 3]
    assert sum(w[0] == "ROLLBACK" for w in ev) == 1
    assert second.committed() == steps


def test_a_hung_member_is_dropped_and_rejoins(served: Served) -> None:
    """A member stopped (SIGSTOP) mid-run, alive but silent: after its timeout (2 s) its
    service drops it; the step it was in fails on both survivors with an error naming it
    and the timeout, and they go on without it.  Continued (SIGCONT), its next call raises
    ``MemberDroppedError``; it attaches again as a new member and receives the state."""
    steps = 24
    slow = ("--sleep", "0.05")
    a = Member(served, 0, "a-hung", steps, *slow)
    victim = Member(served, 0, "b-hung", steps, *slow, "--timeout", "2", "--rejoin")
    c = Member(served, 1, "c-hung", steps, *slow)
    victim.wait_for("COMMIT 3", 120)
    victim.proc.send_signal(signal.SIGSTOP)
    t_stop = time.monotonic()
    try:
        bad = a.wait_for("ROLLBACK", 30)
        t_fail = time.monotonic()
        assert c.wait_for("ROLLBACK", 30).split()[:3] == bad.split()[:3]
        a.wait_for("COMMIT", 30)  # the survivors go on without it
    finally:
        victim.proc.send_signal(signal.SIGCONT)
    assert "b-hung stopped answering" in bad and "timeout of 2 s" in bad, bad
    assert 1.8 <= t_fail - t_stop < 15, t_fail - t_stop  # (its last heartbeat: 0.1 s before)
    victim.wait_for("DROPPED", 30)
    assert "was dropped" in victim.lines[-1] and "timeout of 2 s" in victim.lines[-1]
    victim.wait_for("HEALED", 60)
    for m in (a, c, victim):
        m.finish(120)
        assert m.proc.returncode == 0 and m.lines[-1] == "DONE", "\n".join(m.lines[-20:])
    check_history([a, victim, c])
    assert a.committed() == c.committed() == victim.committed() == steps
    wait_logged(served, f"member b-hung (pid {victim.proc.pid}) is silent", 5)


def soak(served: Served, steps: int, kills: int, seed: int) -> None:
    rng = random.Random(seed)
    base = [(0, "s0"), (0, "s1"), (1, "s2")]
    slow = ("--sleep", "0.1")
    live = [Member(served, n, f"{rid}-{seed}", steps, *slow) for n, rid in base]
    everyone = list(live)

    def spare(node: int, rid: str) -> Member:
        m = Member(served, node, rid, steps, *slow, spare=True)
        everyone.append(m)
        return m

    spares = {n: spare(n, f"spare{n}-{seed}+") for n in (0, 1)}
    pids = service_pids(served)
    assert len(pids) == 2, pids
    start = [usage(p) for p in pids]
    next_kill = rng.randint(10, 20) if kills > 1 else rng.randint(4, 8)
    done = 0
    deadline = time.monotonic() + 60 + steps * 3
    while done < kills and time.monotonic() < deadline:
        top = max(m.committed() for m in live)
        if top >= steps - 12:
            break
        if top >= next_kill:
            victim = live.pop(rng.randrange(len(live)))
            time.sleep(rng.random() * 0.05)  # any moment of a step
            victim.kill()
            done += 1
            new = spares[victim.node]
            new.go()
            live.append(new)
            spares[victim.node] = spare(victim.node, f"{new.rid}+")
            next_kill = top + rng.randint(10, 20)
        time.sleep(0.01)
    for m in spares.values():
        m.kill()  # never attached
    for m in live:
        m.finish(60 + steps * 2)
        assert m.proc.returncode == 0 and m.lines[-1] == "DONE", "\n".join(m.lines[-30:])
    check_history(everyone)
    assert done >= 1, "no member was killed"
    for m in live:
        if m.rid.endswith("+"):
            assert any(x.startswith("HEALED") for x in m.lines), "\n".join(m.lines[:10])
    for p in pids:
        assert os.path.exists(f"/proc/{p}"), "a service died"
    end = [usage(p) for p in pids]
    for (f0, r0), (f1, r1) in zip(start, end, strict=True):
        assert f1 <= f0 + 2, f"a service's descriptors grew: {f0} -> {f1}"
        assert r1 <= r0 + 64 * 1024, f"a service's memory grew: {r0} -> {r1} kB"


@pytest.mark.parametrize(
    "steps,kills",
    [(20, 1), pytest.param(100, 8, marks=pytest.mark.full)],
)
def test_soak(served: Served, steps: int, kills: int) -> None:
    """A chaos loop kills a random member at a random moment and starts a replacement."""
    if kills > 1 and not full_run():
        pytest.skip("--full")
    soak(served, steps, kills, seed=steps)

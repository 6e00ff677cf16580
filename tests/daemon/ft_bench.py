"""Fault-tolerant mode against plain daemon mode, no faults (issue 50's benchmark; never
asserted).  ``python tests/daemon/ft_bench.py [COUNT ...]``: two nodes of one client each,
a step per round of one float32 allreduce (average) of COUNT elements; in FT mode the step
is also a quorum and a vote.  Prints the median step of each, same machine, same run (FT:
also the median of each part, member side).  Then the same with a real step: a small MLP's
forward and backward (torch, one thread; ``MLP=0`` skips it) and its gradients averaged, so
that the overhead is a share of a realistic step.  ``FT_BENCH_STEPS`` (200): steps per
run.  Then the time from a SIGKILL of a member (one of three, two on node 0) to the
survivors' next committed step (``NOKILL=1``: skip), and the time a replacement takes to join
and hold the state, by state size (``NOJOIN=1``: skip); ``FT_BENCH_REPS`` (3) repetitions of
each, their median and range.  Members ask for the next quorum with their vote where the installed
``Member`` offers it (``ask_next``), so the same file measures an older tree too:
``FT_BENCH_BASE=DIR`` runs fault-tolerant mode with the tree in DIR first, in the same run
(``FT_BENCH_ENV=NAME=V,...``: this tree with those settings too)
(start the bench from a directory that holds no ``totalreduce``: ``python -c`` and
``python -m`` import from the current directory before ``PYTHONPATH``)."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from cluster import serve  # noqa: E402

STEPS = int(os.environ.get("FT_BENCH_STEPS", 200))

PLAIN = """
import sys, time, numpy as np, totalreduce as tr
tr.init()
n = int(sys.argv[1]); x = tr.empty(n, np.float32); x[:] = 1
ts = []
for i in range(NSTEPS):
    t = time.perf_counter(); tr.allreduce(x, name="g", op="avg", out=x)
    ts.append(time.perf_counter() - t)
print("TIMES", *ts[20:]); tr.shutdown()
""".replace("NSTEPS", str(STEPS))

FT = """
import inspect, sys, time, numpy as np
from totalreduce.service.ft_member import Member
m = Member("r" + sys.argv[2])
nxt = "ask_next" in inspect.signature(m.should_commit).parameters
n = int(sys.argv[1]); x = np.ones(n, np.float32); ts = []; ph = []
for i in range(NSTEPS):
    t = time.perf_counter()
    m.start_quorum(i); t1 = time.perf_counter()
    x = m.allreduce(x); t2 = time.perf_counter()
    more = {"ask_next": i} if nxt and i + 1 < NSTEPS else {}
    assert m.should_commit(True, **more); t3 = time.perf_counter()
    ts.append(t3 - t); ph.append((t1 - t, t2 - t1, t3 - t2))
ph = ph[20:]
print("PHASES", *(sorted(p[k] for p in ph)[len(ph) // 2] for k in range(3)))
print("TIMES", *ts[20:]); m.close()
""".replace("NSTEPS", str(STEPS))

#: A small MLP's step: forward, backward, the gradients flattened (one thread; a few ms).
MODEL = """
import torch
torch.set_num_threads(1); torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(784, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
xb, yb = torch.randn(128, 784), torch.randint(0, 10, (128,))
params = list(model.parameters())
def compute():
    for p in params: p.grad = None
    torch.nn.functional.cross_entropy(model(xb), yb).backward()
    return torch.cat([p.grad.reshape(-1) for p in params]).numpy()
def apply(avg):
    off = 0
    with torch.no_grad():
        for p in params:
            k = p.numel(); p -= 0.01 * torch.from_numpy(avg[off:off + k]).view_as(p); off += k
"""

PLAIN_MLP = (
    MODEL
    + """
import sys, time, numpy as np, totalreduce as tr
tr.init(); ts = []; cs = []
g = compute(); buf = tr.empty(g.size, np.float32)
for i in range(NSTEPS):
    t = time.perf_counter(); g = compute(); c = time.perf_counter(); buf[:] = g
    tr.allreduce(buf, name="g", op="avg", out=buf); apply(buf)
    ts.append(time.perf_counter() - t); cs.append(c - t)
print("COMPUTE", *cs[20:]); print("TIMES", *ts[20:]); tr.shutdown()
""".replace("NSTEPS", str(STEPS))
)

FT_MLP = (
    MODEL
    + """
import inspect, sys, time, numpy as np
from totalreduce.service.ft_member import Member
m = Member("r" + sys.argv[2]); ts = []; cs = []
nxt = "ask_next" in inspect.signature(m.should_commit).parameters
for i in range(NSTEPS):
    t = time.perf_counter(); m.start_quorum(i); g = compute(); c = time.perf_counter()
    avg = m.allreduce(g)
    more = {"ask_next": i} if nxt and i + 1 < NSTEPS else {}
    if m.should_commit(True, **more): apply(avg)
    ts.append(time.perf_counter() - t); cs.append(c - t)
print("COMPUTE", *cs[20:]); print("TIMES", *ts[20:]); m.close()
""".replace("NSTEPS", str(STEPS))
)

JOIN = """
import sys, time, numpy as np
from totalreduce.service.ft_member import Member
m = Member(sys.argv[2]); n = int(sys.argv[1]); step = 0
state = np.ones(n, np.uint8)
while step < 400:
    t = time.perf_counter(); q = m.start_quorum(step)
    if q.heal_from >= 0:
        state = m.recv_state(); step = q.step
        now = time.perf_counter()
        print("JOINED", now - float(sys.argv[3]), now - t, flush=True)
        m.close(); sys.exit(0)
    if q.heal_to: m.send_state(state)
    try:
        m.allreduce(np.ones(4, np.float32)); ok = True
    except Exception:
        ok = False
    step += m.should_commit(ok); time.sleep(0.01)
m.close()
"""


#: A member for the kill's figure: steps of one allreduce of COUNT float32 and a 5 ms pause
#: (its compute), each committed step's clock (CLOCK_MONOTONIC, the same in every process)
#: on a line.
KILLED = """
import sys, time, numpy as np
from totalreduce.service.ft_member import Member
m = Member(sys.argv[2]); x = np.ones(int(sys.argv[1]), np.float32); step = 0
while True:
    q = m.start_quorum(step)
    if q.heal_from >= 0:
        m.recv_state(); step = q.step
    if q.heal_to:
        m.send_state(b"state")
    try:
        m.allreduce(x); ok = True
    except Exception:
        ok = False
    if m.should_commit(ok, ask_next=step):
        step += 1
        print("C", time.monotonic(), flush=True)
    else:
        print("F", time.monotonic(), flush=True)
    time.sleep(0.005)
"""

REPS = int(os.environ.get("FT_BENCH_REPS", 3))


def spread(xs: list[float]) -> str:
    return (
        f"median {statistics.median(xs):.3f} s (range {min(xs):.3f}-{max(xs):.3f}, {len(xs)} runs)"
    )


def run(served, code: str, args: list[list[str]], env_of) -> list[str]:
    procs = [
        subprocess.Popen([sys.executable, "-c", code, *a], env=env_of(k), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
        for k, a in enumerate(args)
    ]  # fmt: skip
    return [p.communicate(timeout=300)[0] for p in procs]


def median_ms(outs: list[str], what: str = "TIMES") -> float:
    try:
        ts = [float(t) for o in outs for t in o.split(what)[1].split("\n")[0].split()]
    except IndexError:
        raise SystemExit("a member failed:\n" + "\n".join(outs)) from None
    return statistics.median(ts) * 1e3


ALTERNATE = int(os.environ.get("FT_BENCH_ALTERNATE", 1))


def main() -> None:
    """Every mode's services start once; then ``FT_BENCH_ALTERNATE`` (1) passes, each
    running every mode's steps in turn (plain daemon mode, the FT_BENCH_BASE tree, this
    tree), so that a busy machine's load falls on all alike; each line is a pass's median
    step, and with several passes a summary line per mode gives the median of the passes'
    medians and their range."""
    counts = [int(c) for c in sys.argv[1:]] or [1024, 1 << 20]
    mlp = os.environ.get("MLP", "1") != "0"
    with tempfile.TemporaryDirectory() as d:
        trees = [("", {})]
        if os.environ.get("FT_BENCH_BASE"):  # an older tree's fault-tolerant mode, same run
            trees.insert(0, (" (FT_BENCH_BASE)", {"PYTHONPATH": os.environ["FT_BENCH_BASE"]}))
        if os.environ.get("FT_BENCH_ENV"):  # this tree with settings (NAME=V,NAME=V)
            pairs = dict(kv.split("=", 1) for kv in os.environ["FT_BENCH_ENV"].split(","))
            trees.insert(-1, (f" ({os.environ['FT_BENCH_ENV']})", pairs))
        served = [serve(2, 1, Path(d) / "plain", timeout=3600)]
        try:
            for label, more in trees:
                served.append(serve(2, 1, Path(d) / f"ft{len(label)}", timeout=3600,
                                    start_timeout=900,
                                    extra=("--fault-tolerant", "--first-quorum", "2"),
                                    **more))  # fmt: skip
            plain = served[0]
            got: dict[str, list[float]] = {}
            for _ in range(ALTERNATE):
                for n in counts:
                    outs = run(plain, PLAIN, [[str(n)], [str(n)]], lambda k: plain.client_env(k))
                    what = f"plain daemon, {n * 4} B: step"
                    got.setdefault(what, []).append(median_ms(outs))
                    print(f"{what} {got[what][-1]:.3f} ms", flush=True)
                if mlp:
                    outs = run(plain, PLAIN_MLP, [[], []], lambda k: plain.client_env(k))
                    what = "plain daemon, MLP step"
                    got.setdefault(what, []).append(median_ms(outs))
                    print(f"{what} {got[what][-1]:.3f} ms (its compute "
                          f"{median_ms(outs, 'COMPUTE'):.3f} ms)", flush=True)  # fmt: skip
                for (label, more), ft in zip(trees, served[1:], strict=True):
                    ft_steps(ft, ft_env(ft, more), counts, mlp, label, got)
            if ALTERNATE > 1:
                for what, ms in got.items():
                    print(f"SUMMARY {what}: median {statistics.median(ms):.3f} ms "
                          f"(range {min(ms):.3f}-{max(ms):.3f}, {len(ms)} passes)")  # fmt: skip
            fenv = ft_env(served[-1], {})
            kills(fenv, Path(d))
            joins(fenv)
        finally:
            for s in served:
                s.stop()


def ft_env(ft, more: dict[str, str]):  # type: ignore[no-untyped-def]
    def fenv(k: int) -> dict[str, str]:
        sock = str(ft.directory / f"ft{k}.sock")
        return dict(os.environ, TOTALREDUCE_FT_SOCKET=sock, **more)

    return fenv


def ft_steps(ft, fenv, counts: list[int], mlp: bool, label: str, got) -> None:  # type: ignore[no-untyped-def]
    for n in counts:
        outs = run(ft, FT, [[str(n), "0"], [str(n), "1"]], fenv)
        ph = [float(v) * 1e3 for v in outs[0].split("PHASES")[1].split()[:3]]
        parts = f"quorum {ph[0]:.3f}, allreduce {ph[1]:.3f}, vote {ph[2]:.3f}"
        what = f"fault-tolerant{label}, {n * 4} B: step"
        got.setdefault(what, []).append(median_ms(outs))
        print(f"{what} {got[what][-1]:.3f} ms ({parts})", flush=True)
    if mlp:
        outs = run(ft, FT_MLP, [["x", "0"], ["x", "1"]], fenv)
        what = f"fault-tolerant{label}, MLP step"
        got.setdefault(what, []).append(median_ms(outs))
        print(f"{what} {got[what][-1]:.3f} ms (its compute "
              f"{median_ms(outs, 'COMPUTE'):.3f} ms)", flush=True)  # fmt: skip


def kills(fenv, d: Path) -> None:
    """Three members (a, b on node 0, c on node 1) step; once each committed 20 steps, b is
    SIGKILLed; the figure is the time until both survivors committed a step after it."""
    if os.environ.get("NOKILL"):
        return
    n = 1 << 18  # 1 MiB averaged a step
    got = []
    for rep in range(REPS):
        logs = [d / f"kill{rep}{k}.log" for k in range(3)]
        procs = [
            subprocess.Popen([sys.executable, "-c", KILLED, str(n), "abc"[k]], env=fenv(k // 2),
                             stdout=open(logs[k], "w"), stderr=subprocess.STDOUT)
            for k in range(3)
        ]  # fmt: skip
        try:
            end = time.monotonic() + 120
            while min(f.read_text().count("C ") for f in logs) < 20:
                if time.monotonic() > end or any(p.poll() is not None for p in procs):
                    raise SystemExit("kill bench: a member failed:\n" + logs[0].read_text())
                time.sleep(0.05)
            t0 = time.monotonic()
            procs[1].kill()
            time.sleep(3)
        finally:
            for p in procs:
                p.kill()
                p.wait()
        after = []
        for k in (0, 2):
            ts = [float(w.split()[1]) for w in logs[k].read_text().splitlines()
                  if w.startswith("C ") and float(w.split()[1]) > t0]  # fmt: skip
            if not ts:
                raise SystemExit(f"kill bench: survivor {k} committed nothing after the kill")
            after.append(ts[0] - t0)
        got.append(max(after))
        time.sleep(1)
    print(f"from a SIGKILL to the survivors' next committed step (1 MiB averaged a step, "
          f"5 ms of compute): {spread(got)}", flush=True)  # fmt: skip


def joins(fenv) -> None:
    for n in [] if os.environ.get("NOJOIN") else (1 << 20, 64 << 20):
        start, ask = [], []
        for _rep in range(REPS):
            base = [subprocess.Popen([sys.executable, "-c", JOIN, str(n), f"m{k}", "0"],
                                     env=fenv(k), stdout=subprocess.PIPE, text=True)
                    for k in range(2)]  # fmt: skip
            try:
                time.sleep(3)
                t0 = time.perf_counter()
                cmd = [sys.executable, "-c", JOIN, str(n), f"new{n}", str(t0)]
                j = subprocess.run(cmd, env=fenv(0), capture_output=True, text=True, timeout=300)
                w = j.stdout.split()
                start.append(float(w[1]))
                ask.append(float(w[2]))
            finally:
                for p in base:
                    p.kill()
                    p.wait()
            time.sleep(1)
        print(f"join with {n >> 20} MiB of state: from the start of its process "
              f"{spread(start)}; from its ask {spread(ask)}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()

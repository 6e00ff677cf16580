"""Daemon sessions that a death cannot poison: a client is killed (SIGKILL) at each moment
of its life, on one node and on two, and a new job on the same services then runs with
exact results (issue 49, item 4).

The moments: waiting in ``init()`` (the job's other clients not started: its session op
is the only one in), in the middle of an op, between ops, and while it leaves
(``shutdown()`` waiting for an op nobody else submitted).  The survivors of the killed
job fail naming the dead rank; the next job, started at once on the same services,
reuses the killed job's op names and checks every result.
"""

from __future__ import annotations

import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from cluster import Served, have_mpiexec, run_clients, serve

HERE = Path(__file__).parent
WORKER = str(HERE / "session_worker.py")

pytestmark = pytest.mark.skipif(not have_mpiexec(), reason="mpiexec missing (install mpich)")


class Client:
    """One client process of a test, its output read line by line on a thread."""

    def __init__(self, served: Served, rank: int, mode: str, **env: str) -> None:
        self.rank = rank
        self.proc = subprocess.Popen(
            [sys.executable, WORKER, mode],
            env=served.client_env(rank, **env),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        self._q: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._q.put(line)
        self._q.put(None)

    def wait_for(self, text: str, timeout: float = 90) -> str:
        """The first line (from now) that holds ``text``; fails after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._q.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                line = ""
            if line is None or time.monotonic() > deadline:
                self.kill()
                raise AssertionError(
                    f"client {self.rank} never said {text!r}:\n{''.join(self.lines)}"
                )
            self.lines.append(line)
            if text in line:
                return line

    def tell(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)

    def finish(self, timeout: float = 60) -> str:
        """Everything it printed, once it exited (killed after ``timeout`` s)."""
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
        while True:
            try:
                line = self._q.get(timeout=5)
            except queue.Empty:
                break
            if line is None:
                break
            self.lines.append(line)
        return "".join(self.lines)


def killed_in_init(served: Served, victim: int) -> None:
    """The victim alone: its init() waits for the job's other clients, and dies there."""
    c = Client(served, victim, "init", TOTALREDUCE_STALL_WARNING_S="1")
    try:
        c.wait_for("init() has waited")  # its session op is in, waiting for the others
    finally:
        c.kill()


def killed_mid_op(served: Served, victim: int) -> list[tuple[int, str]]:
    clients = [Client(served, r, "mid") for r in range(served.nodes * served.local_clients)]
    try:
        for c in clients:
            c.wait_for("READY")
        clients[victim].wait_for("FIRST DONE")
        time.sleep(0.05)  # in the middle of one of the next ops
        clients[victim].kill()
        return [(c.rank, c.finish()) for c in clients if c.rank != victim]
    finally:
        for c in clients:
            c.kill()


def killed_between_ops(served: Served, victim: int) -> list[tuple[int, str]]:
    clients = [Client(served, r, "between") for r in range(served.nodes * served.local_clients)]
    try:
        for c in clients:
            c.wait_for("IDLE")
        clients[victim].kill()
        for c in clients:
            if c.rank != victim:
                c.tell("GO")  # its next op needs the dead rank
        return [(c.rank, c.finish()) for c in clients if c.rank != victim]
    finally:
        for c in clients:
            c.kill()


def killed_while_leaving(served: Served, victim: int) -> list[tuple[int, str]]:
    size = served.nodes * served.local_clients
    clients = [Client(served, r, "leave" if r == victim else "between") for r in range(size)]
    try:
        clients[victim].wait_for("LEAVING")
        for c in clients:
            if c.rank != victim:
                c.wait_for("IDLE")
        time.sleep(0.3)  # in shutdown(), waiting for its op
        clients[victim].kill()
        for c in clients:
            if c.rank != victim:
                c.tell("GO")
        return [(c.rank, c.finish()) for c in clients if c.rank != victim]
    finally:
        for c in clients:
            c.kill()


MOMENTS = {
    "in-init": killed_in_init,
    "mid-op": killed_mid_op,
    "between-ops": killed_between_ops,
    "while-leaving": killed_while_leaving,
}


EVERY_MOMENT = [
    ("in-init", 0),
    ("in-init", 0),  # what the first left behind, if anything, meets this one
    ("in-init", -1),  # (-1: the last rank, on the other node where there are two)
    ("mid-op", 0),
    ("between-ops", -1),
    ("while-leaving", 0),
    ("mid-op", -1),
]
#: Each moment once, on the node it matters most (a default run's two-node case).
EACH_MOMENT = [("in-init", -1), ("mid-op", 0), ("between-ops", -1), ("while-leaving", 0)]


@pytest.mark.parametrize(
    "nodes,slots,plan",
    [
        (1, 2, EVERY_MOMENT),
        (2, 1, EACH_MOMENT),
        pytest.param(2, 1, EVERY_MOMENT, marks=pytest.mark.full),
        pytest.param(
            2, 2, [("in-init", 0), ("mid-op", 1), ("while-leaving", 2)], marks=pytest.mark.full
        ),
    ],
    ids=["1-node-2-clients", "2-nodes", "2-nodes-every-moment", "2x2"],
)
def test_a_client_killed_at_any_moment_ends_its_own_job_only(
    tmp_path: Path, nodes: int, slots: int, plan: list[tuple[str, int]]
) -> None:
    """On the same services, one after the other: a client killed in init (twice in a
    row, and then on the other node), mid-op, between ops and while leaving; after each,
    a new job at once, with the same op names, exact in every dtype.  Two nodes of two
    clients: the victim's node has survivors too."""
    size = nodes * slots
    served = serve(nodes, slots, tmp_path / "s")
    plan = [(moment, victim % size) for moment, victim in plan]
    try:
        for moment, victim in plan:
            survivors = MOMENTS[moment](served, victim)
            for r, out in survivors or []:
                assert f"rank {r}: ERROR" in out and f"rank {victim}" in out, (
                    f"{moment}, victim {victim}, survivor {r}:\n{out}\n{served.stderr()[-5000:]}"
                )
                assert "WRONG" not in out and "NO ERROR" not in out, out
            results = run_clients(served, [WORKER, "job"], timeout=180, check=False)
            for r, res in enumerate(results):
                assert f"rank {r}: JOB OK" in res.stdout, (
                    f"the job after a client was killed {moment} (victim {victim}): rank {r}"
                    f" exited {res.returncode}:\n{res.stdout}\n--- services:\n"
                    f"{served.stderr()[-8000:]}"
                )
    finally:
        status = served.stop()
    log = served.stderr()
    assert status == 0, log
    assert "died" in log and "Traceback" not in log, log

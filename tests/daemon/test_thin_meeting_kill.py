"""Groups' ops at a node's meeting place, with real processes (meeting_group_worker.py).

Three clients of one ``totalreduce serve``: ranks 0 and 1 run allreduces over the group
[0, 1] while rank 2 runs its own, all of them at the meeting (its count of ops run), exact;
then rank 1 is killed (SIGKILL) while rank 0 waits for it at the meeting: rank 0 raises
within seconds, naming the dead rank, and does not hang.  Two services of two clients: each
node's pair meets over its own group beside the world's ops, and a pair member killed while
its peer waits fails that peer only: the other node's pair goes on meeting.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from cluster import have_mpiexec, serve

HERE = Path(__file__).parent
WORKER = str(HERE / "meeting_group_worker.py")

pytestmark = pytest.mark.skipif(not have_mpiexec(), reason="mpiexec missing (install mpich)")


def test_a_member_killed_while_its_peer_waits_at_the_meeting(tmp_path: Path) -> None:
    served = serve(1, 3, tmp_path / "s", timeout=240)
    procs: list[subprocess.Popen[str]] = []
    try:
        for r in range(3):
            procs.append(
                subprocess.Popen(
                    [sys.executable, WORKER],
                    env=served.client_env(r),
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )

        def line_of(p: subprocess.Popen[str], text: str) -> str:
            assert p.stdout is not None
            seen = []
            for line in p.stdout:
                seen.append(line)
                assert "WRONG" not in line, line
                if text in line:
                    return line
            raise AssertionError(f"never said {text!r}:\n{''.join(seen)}")

        mets = [line_of(p, "MET ") for p in procs]
        for p in procs:
            line_of(p, "READY")
        line_of(procs[0], "WAITING")
        time.sleep(0.3)  # rank 0 waits at the meeting
        procs[1].kill()
        t0 = time.monotonic()
        raised = line_of(procs[0], "RAISED")
        assert time.monotonic() - t0 < 10, raised
        assert "rank 1" in raised and "died" in raised, raised
        assert all(int(m.split()[1]) >= 5 for m in mets), mets  # (each saw its 5 ops meet)
        procs[0].wait(30)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(10)
        served.stop()


@pytest.mark.full  # (14 s of processes; test_thin_meeting_nodes.py has it in-process)
def test_a_member_killed_on_two_nodes_fails_only_its_pair(tmp_path: Path) -> None:
    served = serve(2, 2, tmp_path / "s", timeout=240)
    procs: list[subprocess.Popen[str]] = []
    try:
        for r in range(4):
            procs.append(
                subprocess.Popen(
                    [sys.executable, WORKER, "nodes"],
                    env=served.client_env(r),
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
        mets = [_line_of(p, "MET ") for p in procs]
        for p in procs:
            _line_of(p, "READY")
        assert all(int(m.split()[1]) >= 5 for m in mets), mets  # (each node's pair met)
        _line_of(procs[0], "WAITING")
        time.sleep(0.3)  # rank 0 waits at node 0's meeting
        procs[1].kill()
        t0 = time.monotonic()
        raised = _line_of(procs[0], "RAISED")
        assert time.monotonic() - t0 < 10, raised
        assert "rank 1" in raised and "died" in raised, raised
        for p in procs[2:]:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        for p in procs[2:]:
            _line_of(p, "PAIR OK")
            assert int(_line_of(p, "MET ").split()[1]) >= 5
        for p in procs[::2]:
            p.wait(30)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(10)
        served.stop()


def _line_of(p: subprocess.Popen[str], text: str) -> str:
    assert p.stdout is not None
    seen = []
    for line in p.stdout:
        seen.append(line)
        assert "WRONG" not in line, line
        if text in line:
            return line
    raise AssertionError(f"never said {text!r}:\n{''.join(seen)}")

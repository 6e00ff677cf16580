"""The thin path of daemon mode (service/thin.py, daemon/thin.py): hierarchical ops
handed to the node's service through its arena.

The other daemon tests run every collective through it too (``daemon_worker.py
every``, the torch examples, tests/mpi against daemons); here: zero copy for arena
arrays, staging given back, every dtype and op, broadcast with mixed buffers, 2,000
ops in flight in random orders, callbacks without a waiter, ``totalreduce.torch.empty``,
a mismatch among one node's clients, pieces for ops (and windows) too large for the
arena, and backpressure when staged ops do not fit.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from cluster import have_mpiexec, run_clients, serve  # noqa: E402

pytestmark = pytest.mark.skipif(not have_mpiexec(), reason="mpiexec not found (mpich wheel)")
WORKER = str(HERE / "thin_worker.py")
ARENA_CHECKS = ("NO-ENGINE", "ZERO-COPY", "EXPRESS", "DTYPES", "BROADCAST", "IN-FLIGHT", "CALLBACK",
                "TORCH-EMPTY", "MISMATCH", "AFTER", "PAIRWISE")  # fmt: skip


def run_mode(where: Path, nodes: int, local: int, mode: str, checks: list[str], *extra: str) -> str:
    """Serve ``nodes`` x ``local``, run ``thin_worker.py mode`` on every client, and check
    that every rank reported every check OK and the services exited cleanly; their log."""
    served = serve(nodes, local, where, extra=extra)
    try:
        results = run_clients(served, [WORKER, mode], timeout=240)
    finally:
        status = served.stop()
    for r, res in enumerate(results):
        for check in checks:
            assert f"rank {r}: {check} OK" in res.stdout, res.stdout
    log = served.stderr()
    assert status == 0, log
    assert "Traceback" not in log, log
    return log


def test_thin_path_on_two_nodes_of_two_clients(tmp_path: Path) -> None:
    run_mode(tmp_path / "s", 2, 2, "arena", list(ARENA_CHECKS))


@pytest.mark.parametrize(
    "local", [2, pytest.param(4, marks=pytest.mark.full)], ids=lambda n: f"1x{n}"
)
def test_one_node_meets_in_the_arena(tmp_path: Path, local: int) -> None:
    """One node of 2 and 4 clients (4 processes on the 2-core machine: oversubscribed):
    the arena's checks, and the meeting's (every type and size, exact; repeats counted
    there, with no handle)."""
    run_mode(tmp_path / "s", 1, local, "meeting", ["MEET-DTYPES", "MEET-ROUTE"])
    run_mode(tmp_path / "a", 1, local, "arena", list(ARENA_CHECKS))


def test_reduce_scatter_allgather_and_groups_take_the_thin_path(tmp_path: Path) -> None:
    checks = ["REDUCE-SCATTER", "ALLGATHER", "GROUPS", "NEIGHBORS", "ROOTED", "NAMED-ALGORITHM",
              "WINDOWS", "STILL-NO-ENGINE"]  # fmt: skip
    run_mode(tmp_path / "s", 2, 2, "kinds", checks)


def test_malformed_descriptors_fail_alone_and_the_service_goes_on(tmp_path: Path) -> None:
    checks = [f"GARBAGE-{c}" for c in ("kind", "dtype", "count", "root", "place", "AFTER")]
    log = run_mode(tmp_path / "s", 2, 1, "garbage", checks, "--arena-bytes", str(8 << 20))
    assert "malformed descriptor" in log, log


@pytest.mark.parametrize(
    "nodes,local",
    [pytest.param(2, 1, marks=pytest.mark.full), pytest.param(2, 2, marks=pytest.mark.full),
     (1, 2)],
    ids=["2x1", "2x2", "1x2"],
)  # fmt: skip
def test_large_ops_and_backpressure_with_a_small_arena(
    tmp_path: Path, nodes: int, local: int
) -> None:
    """Ops too large for the arena run in pieces on the thin path (no engine starts); on one
    node the pieces of an allreduce meet in the arena."""
    checks = ["LARGE", "LARGE-PARTS", "LARGE-ALLTOALL", "BACKPRESSURE", "LARGE-WINDOW",
              "MISMATCH-PIECES", "AFTER-PIECES", "LARGE-NO-ENGINE"]  # fmt: skip
    arena = str((8 << 20) * local)
    run_mode(tmp_path / "s", nodes, local, "pressure", checks, "--arena-bytes", arena)


@pytest.mark.parametrize(
    "local", [1, pytest.param(2, marks=pytest.mark.full)], ids=lambda n: f"2x{n}"
)
def test_repeats_among_nodes_take_the_compiled_loop(tmp_path: Path, local: int) -> None:
    """Two nodes of one and two clients: repeats of an allreduce run in the service's
    compiled loop (counted there), exact in float16, float32, float64, int32 and int64, for
    sum, max and avg, of every size class (one element, 4 KB, 1.2 MB: segments in the lane)."""
    run_mode(tmp_path / "s", 2, local, "loop", ["LOOP-EXACT-ROUTE"])


@pytest.mark.full  # (the switch's fallback: the Python paths every other test also meets)
def test_the_compiled_loop_switched_off(tmp_path: Path) -> None:
    """``TOTALREDUCE_SERVICE_LOOP=0``: the same results, and the loop runs nothing."""
    served = serve(2, 1, tmp_path / "s", TOTALREDUCE_SERVICE_LOOP="0")
    try:
        results = run_clients(served, [WORKER, "loop"], timeout=240, TOTALREDUCE_SERVICE_LOOP="0")
    finally:
        status = served.stop()
    for r, res in enumerate(results):
        assert f"rank {r}: LOOP-EXACT-ROUTE OK" in res.stdout, res.stdout
    assert status == 0, served.stderr()


def _cpu_s(pids: list[int]) -> float:
    """User and system CPU seconds the processes ``pids`` used so far (all their threads)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / tick


@pytest.mark.parametrize(
    "nodes,local,mode",
    [(2, 1, "loop"), pytest.param(1, 2, "meeting", marks=pytest.mark.full)],
    ids=["compiled-loop", "meeting"],
)
def test_an_idle_service_costs_no_cpu_after_a_job(
    tmp_path: Path, nodes: int, local: int, mode: str
) -> None:
    """After a job of repeats (run in the service's compiled loop among two nodes, or at the
    one-node meeting place) the services, still running, sleep: under 2% of a core over 2 s
    (a loop that spun when idle would take a whole core)."""
    from test_daemon import service_pids

    served = serve(nodes, local, tmp_path / "s")
    try:
        results = run_clients(served, [WORKER, mode], timeout=240)
        assert all(r.returncode == 0 for r in results), [r.stdout + r.stderr for r in results]
        pids = service_pids(served)
        assert len(pids) == nodes, pids
        time.sleep(1.0)  # their idle backoff reaches its longest sleep
        before, t0 = _cpu_s(pids), time.monotonic()
        time.sleep(2.0)
        used = (_cpu_s(pids) - before) / (time.monotonic() - t0)
    finally:
        status = served.stop()
    assert status == 0, served.stderr()
    assert used < 0.02 * nodes, f"idle services used {used:.1%} of a core"


@pytest.mark.parametrize(
    "local", [1, pytest.param(2, marks=pytest.mark.full)], ids=lambda n: f"2x{n}"
)
def test_blocking_repeats_among_nodes_are_one_compiled_call(tmp_path: Path, local: int) -> None:
    """Two nodes: a blocking repeat on arrays of the arena (in place, or into another; or
    with ``out`` None, staged into a new array) is submitted and waited for in one
    compiled call (no handle; counted), exact in float16, float32, float64, int32 and
    int64; async forms keep their handles, whose wait honours its timeout; a repeat whose
    count another node changed raises as the Python path does (``out`` given or None, and
    a broadcast's).  A named barrier's repeat is one compiled call too, and waits for a
    late rank; so is a broadcast's in place from the first rank and the last, exact in
    float32, float64, int32 and int64."""
    checks = ["RING-EXACT-ROUTE", "RING-ASYNC-TIMEOUT", "RING-MISMATCH"]
    run_mode(tmp_path / "s", 2, local, "ring", checks)


@pytest.mark.parametrize(
    "nodes,local", [(2, 1), pytest.param(1, 2, marks=pytest.mark.full)], ids=["2x1", "1x2"]
)
def test_blocking_reduce_scatter_allgather_and_broadcast_repeats_are_one_call(
    tmp_path: Path, nodes: int, local: int
) -> None:
    """A blocking repeat of a reduce-scatter (balanced parts or given ones), of an
    all-gather given its counts, and (on a service of several nodes) of a broadcast into a
    new array or another, from the first rank and the last, is one compiled call with no
    handle, exact in float32 and int64; it waits for a rank 0.3 s late; a repeat whose
    count another rank changed raises what the handle's way raises."""
    checks = ["KINDS-EXACT-ROUTE", "KINDS-LATE", "KINDS-MISMATCH"]
    run_mode(tmp_path / "s", nodes, local, "ring-kinds", checks)


@pytest.mark.parametrize(
    "nodes,local",
    [(2, 2), pytest.param(1, 2, marks=pytest.mark.full),
     pytest.param(2, 1, marks=pytest.mark.full), pytest.param(1, 4, marks=pytest.mark.full)],
    ids=["2x2", "1x2", "2x1", "1x4"],
)  # fmt: skip
def test_blocking_group_and_sized_allgather_repeats_are_one_call(
    tmp_path: Path, nodes: int, local: int
) -> None:
    """A blocking repeat over a group (the world's ranks reversed; on four clients a pair
    across the nodes and a pair of neighbours) of an allreduce (in place, into another
    array of the arena, into a new one), a broadcast (in place, into a new array), a
    reduce-scatter, an all-gather given counts and a named barrier is one compiled call
    into the ring with no handle; an all-gather without counts (world and groups, its
    sizes changing every call) two (its sizes, then its data); on one node the world's
    broadcasts in place and into a new array meet in the arena with no ring call; all
    exact in float32 and int64.  A group repeat whose count another member changed raises
    what the handle's way raises."""
    run_mode(tmp_path / "s", nodes, local, "ring-groups", ["GROUPS-EXACT-ROUTE", "GROUPS-MISMATCH"])


@pytest.mark.parametrize(
    "nodes,local",
    [(2, 2), pytest.param(2, 1, marks=pytest.mark.full), pytest.param(1, 1, marks=pytest.mark.full),
     pytest.param(1, 3, marks=pytest.mark.full), pytest.param(2, 4, marks=pytest.mark.full)],
    ids=["2x2", "2x1", "1x1", "1x3", "2x4"],
)  # fmt: skip
def test_every_dtype_and_size_class_is_exact(tmp_path: Path, nodes: int, local: int) -> None:
    """Allreduce in every element type and op (bool, int8-int64, uint8, float16-float64,
    bfloat16 bit patterns), of 0, 1, 1024 elements and past 1 MiB, first calls and repeats,
    bit for bit, on one and two nodes of one to four clients (one node of two and four:
    the meeting's sweep, ``test_one_node_meets_in_the_arena``)."""
    run_mode(tmp_path / "s", nodes, local, "dtypes", ["EVERY-DTYPE"])


@pytest.mark.parametrize("kind", ["allreduce", pytest.param("rs", marks=pytest.mark.full)])
def test_a_service_that_dies_under_a_compiled_wait(tmp_path: Path, kind: str) -> None:
    """Node 0's service killed while its client waits in a compiled call (an
    allreduce's, a reduce-scatter's): the call raises ``TransportError`` within seconds,
    no hang."""
    served = serve(2, 1, tmp_path / "s")
    mode = "ring-death" if kind == "allreduce" else "ring-death-rs"
    try:
        results = run_clients(served, [WORKER, mode], timeout=120, check=False)
    finally:
        served.stop()
    assert "rank 0: RING-DEATH OK" in results[0].stdout, results[0].stdout

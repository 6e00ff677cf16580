"""The engine under real MPI: ``mpiexec -n P`` launched from pytest, each with a timeout.

Every test that takes ``service`` runs embedded (``mpiexec -n P`` training processes)
and against daemons (``mpiexec totalreduce serve`` on one or two simulated nodes, and
P client processes attached to them), with the same worker; ``sizes`` says at which P.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).parent
TIMEOUT = 90
sys.path.insert(0, str(HERE.parent / "daemon"))
from cluster import layout_for, run_clients, serve  # noqa: E402
from launch_modes import Launches, mpiexec  # noqa: E402

from totalreduce.launch import find_mpiexec  # noqa: E402

MPIEXEC = find_mpiexec()  # this Python's (the mpich wheel's, beside it), else PATH's

pytestmark = pytest.mark.skipif(
    MPIEXEC is None, reason="no mpiexec beside python or on PATH (install the mpich wheel)"
)


CHECK = str(HERE / "check_engine.py")


def _start(key: Any, modes: list[str], service: str) -> str:
    n = key[1]
    # "timeout" leaves an op in flight at its shutdown: it goes last
    modes = sorted(modes, key=lambda m: m == "timeout")
    if service == "embedded":
        return run(service, n, CHECK, ",".join(modes), timeout=60 + 15 * len(modes))
    # Against daemons one launch per mode: a client of the next mode that attaches while a
    # peer client of the last one is still attached joins that job's session (the node
    # cannot tell a rank's restart from the next job), and the peer's bye fails its ops.
    outs = []
    for mode in modes:
        where = Path(service) / mode
        where.mkdir()
        outs.append(run(str(where), n, CHECK, mode))
    return "".join(outs)


#: The tests of one size share one launch of check_engine.py embedded (a process start
#: costs more than most checks); against daemons, in the first test's directory, each mode
#: has a launch of its own.
LAUNCHES = Launches(_start)


def sizes(embedded: list[int], daemon: list[int], mode: str, full: tuple[int, ...] = ()) -> Any:
    """The (ranks, service) cases of a test of check_engine.py's ``mode``: every size that
    matters embedded, and against daemons the ones whose node layout adds something
    (``layout_for``: even sizes are two nodes, odd ones one), so the daemon half does not
    repeat what the embedded half shows.  The daemon sizes in ``full`` run with
    ``pytest --full`` only (a smaller daemon case of the mode runs by default)."""
    for n in embedded:
        LAUNCHES.plan(("embedded", n), mode)
    for n in daemon:
        LAUNCHES.plan(("daemon", n), mode)
    cases = [(n, "embedded") for n in embedded] + [
        pytest.param(n, "daemon", marks=pytest.mark.full) if n in full else (n, "daemon")
        for n in daemon
    ]
    return pytest.mark.parametrize(("n", "service"), cases, indirect=["service"])


def checked(service: str, n: int, mode: str) -> tuple[str, str]:
    """``mode``'s lines from the launch of every mode planned at (service, n), and that
    launch's whole output (for messages)."""
    return LAUNCHES.lines(("embedded" if service == "embedded" else "daemon", n), mode, service)


@pytest.fixture(params=["embedded", "daemon"])
def service(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    """How the workers get their engine: their own (embedded) or their node's service."""
    if request.param == "daemon":
        return str(tmp_path_factory.mktemp("daemon"))
    return "embedded"


#: The options check_engine.py passes to init(): a service must run with the same.
_WORKER_OPTIONS = {"TOTALREDUCE_SEGMENT_BYTES": "8192", "TOTALREDUCE_MICRO_BYTES": "1024"}


def run(service: str, n: int, *args: str, timeout: int = TIMEOUT, **env_vars: str) -> str:
    """``mpirun``, or the same workers against daemons when ``service`` is a directory."""
    if service == "embedded":
        return mpirun(n, *args, timeout=timeout, **env_vars)
    nodes, local = layout_for(n)
    env = dict(_WORKER_OPTIONS, **env_vars)
    served = serve(nodes, local, Path(service), timeout=timeout, **env)
    try:
        results = run_clients(served, list(args), timeout=timeout, **env)
    finally:
        status = served.stop()
    log = served.stderr()
    assert status == 0, f"totalreduce serve exited {status}:\n{log}"
    assert "job failed" not in log and "Traceback" not in log, log
    return "".join(r.stdout for r in results)


def mpirun(n: int, *args: str, timeout: int = TIMEOUT, **env_vars: str) -> str:
    return mpiexec(n, list(args), timeout, **env_vars)


@sizes([2, 3, 4], [4], "random", full=(4,))
def test_random_orders_over_mpi(n: int, service: str) -> None:
    out, whole = checked(service, n, "random")
    assert out.count("RANDOM OK") == n, whole


@sizes([2, 3], [2], "mismatch")
def test_size_mismatch_reported_on_every_rank(n: int, service: str) -> None:
    out, whole = checked(service, n, "mismatch")
    assert out.count("MISMATCH-REPORTED") == n, whole
    assert out.count("AFTER OK") == n, whole
    lines = [ln for ln in out.splitlines() if "MISMATCH-REPORTED" in ln]
    for ln in lines:
        secs = float(ln.split("after ")[1].split("s:")[0])
        assert secs < 5, ln
        assert "layer.mismatch" in ln and "generation 0" in ln, ln
        assert "count 12" in ln and "count 13" in ln, ln


@sizes([2], [2], "timeout")
def test_timeout_over_mpi(n: int, service: str) -> None:
    out, whole = checked(service, n, "timeout")
    assert "TIMEOUT-RAISED" in out, whole
    assert out.count("TIMEOUT-DONE") == n, whole


@sizes([3, 4], [4], "collectives", full=(4,))
def test_broadcast_and_barriers_over_mpi(n: int, service: str) -> None:
    out, whole = checked(service, n, "collectives")
    assert out.count("COLLECTIVES OK") == n, whole


@sizes([2, 3, 5], [4, 5], "algorithms", full=(4, 5))
def test_every_allreduce_algorithm_over_mpi(n: int, service: str) -> None:
    out, whole = checked(service, n, "algorithms")
    assert out.count("ALGORITHMS OK") == n, whole


@sizes([2, 5], [2, 4], "rs_ag", full=(4,))
def test_reduce_scatter_allgather_over_mpi(n: int, service: str) -> None:
    out, whole = checked(service, n, "rs_ag")
    assert out.count("RSAG OK") == n, whole


@sizes([4, 8], [8], "neighbor", full=(8,))
def test_neighbor_averaging_over_mpi(n: int, service: str) -> None:
    out, whole = checked(service, n, "neighbor")
    assert out.count("NEIGHBOR OK") == n, whole


@sizes([3], [], "user_traffic")
def test_user_mpi_traffic_does_not_mix(n: int, service: str) -> None:
    out, whole = checked(service, n, "user_traffic")
    assert out.count("USER-TRAFFIC OK") == n, whole


@sizes([2, 3, 4], [], "flow")
def test_reverse_blocking_order_small_pool_over_mpi(n: int, service: str) -> None:
    # the launch it shares gives it a pool of FLOW_POOL_BYTES, smaller than one of its ops
    out, whole = checked(service, n, "flow")
    assert out.count("FLOW OK") == n, whole


@pytest.mark.full  # (its embedded twin runs by default)
def test_reverse_blocking_order_small_pool_against_daemons(tmp_path: Path) -> None:
    # the services' engine among the nodes runs with the small pool (and their clients,
    # which share its options, take it from them): a launch of its own
    out = run(str(tmp_path), 4, CHECK, "flow", TOTALREDUCE_FLOATING_POOL_BYTES=str(16 << 10))
    assert out.count("FLOW OK") == 4, out


@sizes([2, 3], [3], "disagree")
def test_root_and_group_disagreements_over_mpi(n: int, service: str) -> None:
    out, whole = checked(service, n, "disagree")
    assert out.count("DISAGREE OK") == n, whole


@sizes([2, 3], [], "bcast_mismatch")
def test_broadcast_mismatch_raises_on_every_rank_over_mpi(n: int, service: str) -> None:
    out, whole = checked(service, n, "bcast_mismatch")
    assert out.count("BCAST-MISMATCH OK") == n, whole


@sizes([2, 3], [], "rooted")
def test_rooted_and_point_to_point_over_mpi(n: int, service: str) -> None:
    out, whole = checked(service, n, "rooted")
    assert out.count("ROOTED OK") == n, whole


def test_malformed_message_over_mpi() -> None:
    out = mpirun(2, str(HERE / "check_engine.py"), "garbage")
    assert "rank 0: GARBAGE OK" in out, out


def _reported(mode: str, marker: str, *flags: str) -> list[str]:
    """Run a mode where one rank of 3 ends badly (mpiexec may exit non-zero): the lines of
    the other ranks that report it, each checked to be within 5 s."""
    env = dict(os.environ, MPIEXEC_TIMEOUT="60", PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        [str(MPIEXEC), *flags, "-n", "3", sys.executable, str(HERE / "check_engine.py"), mode],
        capture_output=True,
        text=True,
        timeout=70,
        env=env,
    )
    out = proc.stdout + proc.stderr
    lines = [ln for ln in out.splitlines() if marker in ln]
    assert len(lines) == 2, out
    for ln in lines:
        assert float(ln.split("after ")[1].split("s:")[0]) < 5, ln
    return lines


def test_dead_peer_fails_its_ops_naming_it() -> None:
    for ln in _reported("dead", "DEAD-PEER-REPORTED", "-disable-auto-cleanup"):
        assert "rank 2" in ln, ln


def test_rank_dying_of_an_exception_ends_the_job_with_an_error() -> None:
    for ln in _reported("raise", "RAISE-REPORTED"):
        assert "rank 2 stopped" in ln, ln


@sizes([3], [], "reinit")
def test_engines_one_after_another_in_one_process(n: int, service: str) -> None:
    # a transport's last messages once stayed on its freed communicator, and MPI's next one
    # (the next init's) received them: a peer's old goodbye failed the new engine's ops
    out, whole = checked(service, n, "reinit")
    assert out.count("REINIT OK") == n, whole

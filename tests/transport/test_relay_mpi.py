"""Relays over MPI: ``mpiexec -n 2`` nodes of a relay and two shared-memory clients each."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
WORKER = str(HERE / "relay_mpi_worker.py")
MPIEXEC = Path(sys.executable).parent / "mpiexec"
TIMEOUT = 200

pytestmark = pytest.mark.skipif(
    not MPIEXEC.exists(), reason=f"no mpiexec next to {sys.executable} (install the mpich wheel)"
)


def test_every_client_and_relay_to_every_other_across_two_nodes() -> None:
    pytest.importorskip("mpi4py", reason="the relay transport needs mpi4py")
    root = str(HERE.parent.parent)
    env = dict(
        os.environ,
        MPIEXEC_TIMEOUT=str(TIMEOUT - 20),
        PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p),
        PYTHONUNBUFFERED="1",
    )
    proc = subprocess.run(
        [str(MPIEXEC), "-n", "2", sys.executable, WORKER],
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "OK 0" in out and "OK 1" in out, out[-4000:]

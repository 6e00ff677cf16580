"""Launch, honestly: torchrun-style scripts under mpiexec, and torchrun refused clearly.

Under ``mpiexec`` a script that reads RANK/LOCAL_RANK/WORLD_SIZE before initialising runs
unchanged (``import totalreduce.torch`` provides them; ``env://`` without MASTER_ADDR is
answered over MPI).  Under ``torchrun`` every process would be alone in its MPI world:
``init_process_group("totalreduce")`` and ``totalreduce.torch.init()`` raise an error
naming torchrun and the fix, and every process exits non-zero.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import import_torch
from totalreduce.launch import find_mpiexec

MPIEXEC = find_mpiexec()  # this Python's (the mpich wheel's, beside it), else PATH's

import_torch()

HERE = Path(__file__).parent
SCRIPT = str(HERE / "launch_script.py")
TIMEOUT = 180


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TOTALREDUCE_", "MASTER_"))}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        env.pop(k, None)
    env["MPIEXEC_TIMEOUT"] = str(TIMEOUT - 20)
    return env


@pytest.mark.skipif(
    MPIEXEC is None, reason="no mpiexec beside python or on PATH (install the mpich wheel)"
)
@pytest.mark.parametrize("backend", ["totalreduce", "gloo"])
def test_a_torchrun_style_script_runs_unchanged_under_mpiexec(backend: str) -> None:
    r = subprocess.run(
        [str(MPIEXEC), "-n", "2", sys.executable, SCRIPT, "torchrun_style", backend],
        env=_env(), capture_output=True, text=True, timeout=TIMEOUT,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert "OK 0" in r.stdout and "OK 1" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("how", [pytest.param("backend", marks=pytest.mark.full), "init"])
def test_torchrun_processes_alone_in_mpi_raise(how: str, tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", "0", "--log-dir", str(tmp_path), SCRIPT, how],
        env=_env(), capture_output=True, text=True, timeout=TIMEOUT,
    )  # fmt: skip
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    assert "NOT REFUSED" not in out
    assert "alone in its MPI world" in out and "torchrun" in out and "mpiexec -n 2" in out, out

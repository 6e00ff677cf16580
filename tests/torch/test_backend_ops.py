"""The "totalreduce" torch.distributed backend against gloo: ``mpiexec -n P check_backend_ops.py``.

One launch per size runs every check (importing torch is the slow part): every
op gloo provides on CPU for every dtype and ReduceOp gloo accepts, compared
exactly with gloo in the same job; DeviceMesh, DTensor and the functional
collectives; FSDP2 against FSDP2 on gloo; torch.distributed.checkpoint; a timeout naming its op.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import import_torch

torch = import_torch()

HERE = Path(__file__).parent
TIMEOUT = 300
CHECKS = ["ops", "mesh", "fsdp", "dcp", "timeout"]

pytestmark = pytest.mark.skipif(
    shutil.which("mpiexec") is None, reason="mpiexec not on PATH (install the mpich wheel)"
)


@pytest.mark.parametrize("n", [2, 3])
def test_backend_against_gloo(n: int) -> None:
    env = dict(os.environ, MPIEXEC_TIMEOUT=str(TIMEOUT - 20), PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        [
            "mpiexec",
            "-n",
            str(n),
            sys.executable,
            str(HERE / "check_backend_ops.py"),
            ",".join(CHECKS),
        ],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=env,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, (
        f"mpiexec -n {n} check_backend_ops.py exited {proc.returncode}:\n{out}"
    )
    for check in [*CHECKS, "ALL"]:
        for r in range(n):
            assert f"{check} OK rank {r}" in out, out

"""DistributedOptimizer's parameters equal DDP's after the same steps: ``check_optimizer_ddp.py``.

Bitwise at P=2, to 1e-12 at P=3 (see the script's docstring for why).
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
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch built without torch.distributed", allow_module_level=True)

HERE = Path(__file__).parent
TIMEOUT = 120

pytestmark = pytest.mark.skipif(
    shutil.which("mpiexec") is None, reason="mpiexec not on PATH (install the mpich wheel)"
)


@pytest.mark.parametrize("n", [2, 3])
def test_optimizer_equals_ddp(n: int) -> None:
    env = dict(os.environ, MPIEXEC_TIMEOUT=str(TIMEOUT - 10), PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        ["mpiexec", "-n", str(n), sys.executable, str(HERE / "check_optimizer_ddp.py")],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=env,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, (
        f"mpiexec -n {n} check_optimizer_ddp.py exited {proc.returncode}:\n{out}"
    )
    for r in range(n):
        assert f"OPTIMIZER-DDP OK rank {r}" in out, out

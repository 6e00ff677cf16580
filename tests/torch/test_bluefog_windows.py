"""BlueFog's window examples (push-sum consensus, put/get/accumulate/update,
``DistributedWinPutOptimizer``) with the import changed, at P=4 under ``mpiexec``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import import_torch

import_torch()

TIMEOUT = 240


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="mpiexec not on PATH (mpich wheel)")
def test_window_examples_run_at_p4() -> None:
    env = dict(os.environ, MPIEXEC_TIMEOUT=str(TIMEOUT - 20))
    script = str(Path(__file__).with_name("bluefog_windows.py"))
    r = subprocess.run(
        ["mpiexec", "-n", "4", sys.executable, script],
        env=env, capture_output=True, text=True, timeout=TIMEOUT,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    for rank in range(4):
        assert f"PUSH-SUM OK {rank}" in r.stdout, r.stdout + r.stderr
        assert f"WINDOWS OK {rank} of 4" in r.stdout, r.stdout + r.stderr
        assert f"WIN PUT OPTIMIZER OK {rank}" in r.stdout, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and "ERROR" not in r.stderr, r.stderr

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
needs_mpiexec = pytest.mark.skipif(
    shutil.which("mpiexec") is None, reason="mpiexec not on PATH (mpich wheel)"
)


def run_at_p4(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, MPIEXEC_TIMEOUT=str(TIMEOUT - 20))
    script = str(Path(__file__).with_name("bluefog_windows.py"))
    r = subprocess.run(
        ["mpiexec", "-n", "4", sys.executable, script, *args],
        env=env, capture_output=True, text=True, timeout=TIMEOUT,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    return r


@needs_mpiexec
def test_window_examples_run_at_p4_with_a_rank_stalled() -> None:
    """All three examples at P=4 (one run: each start of four torch processes on a small
    machine costs seconds).  Rank 3 sleeps 1.5 s before its asynchronous push-sum rounds (a
    descheduled process): the others run theirs without it, so x/p after them is off by up
    to ~0.9 (the check that CI once failed at 2.1e-6 would fail); mass is still kept exactly,
    and the synchronous rounds bring x/p within the bound that their number gives."""
    r = run_at_p4("--stall", "3:1.5")
    for rank in range(4):
        assert f"PUSH-SUM OK {rank}" in r.stdout, r.stdout + r.stderr
        assert f"WINDOWS OK {rank} of 4" in r.stdout, r.stdout + r.stderr
        assert f"WIN PUT OPTIMIZER OK {rank}" in r.stdout, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and "ERROR" not in r.stderr, r.stderr

"""BlueFog's snippets (set_topology, load_topology, neighbor ranks, the positional order,
the dynamic one-peer loop, ``allreduce(average=)``) and Decent-DP's registration run with
only their import lines changed, at P=4 under ``mpiexec``."""

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
def test_the_seed_snippets_run_with_the_import_changed() -> None:
    env = dict(os.environ, MPIEXEC_TIMEOUT=str(TIMEOUT - 20))
    script = str(Path(__file__).with_name("bluefog_seed.py"))
    r = subprocess.run(
        ["mpiexec", "-n", "4", sys.executable, script],
        env=env, capture_output=True, text=True, timeout=TIMEOUT,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    for rank in range(4):
        assert f"SEED OK {rank}" in r.stdout, r.stdout + r.stderr

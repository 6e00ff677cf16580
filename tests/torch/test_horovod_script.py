"""A Horovod synthetic-benchmark-style script runs with its import line changed (mpiexec -n 2):
Horovod's DistributedOptimizer order, broadcast_parameters(model.parameters()),
allreduce(average=), grouped_allreduce, alltoall (with splits), reducescatter, join."""

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

TIMEOUT = 240


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec beside python or on PATH (mpich wheel)")
def test_a_horovod_script_runs_with_the_import_changed() -> None:
    env = dict(os.environ, MPIEXEC_TIMEOUT=str(TIMEOUT - 20))
    script = str(Path(__file__).with_name("horovod_script.py"))
    r = subprocess.run(
        [str(MPIEXEC), "-n", "2", sys.executable, script],
        env=env, capture_output=True, text=True, timeout=TIMEOUT,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert "HOROVOD OK 0" in r.stdout and "HOROVOD OK 1" in r.stdout, r.stdout + r.stderr

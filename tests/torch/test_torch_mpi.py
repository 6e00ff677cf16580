"""totalreduce.torch under real MPI: ``mpiexec -n P`` running check_torch_mpi.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import import_torch

torch = import_torch()

from torch_launches import lines, plan  # noqa: E402

from totalreduce.launch import find_mpiexec  # noqa: E402

MPIEXEC = find_mpiexec()  # this Python's (the mpich wheel's, beside it), else PATH's

HERE = Path(__file__).parent
TIMEOUT = 120

pytestmark = pytest.mark.skipif(
    MPIEXEC is None, reason="no mpiexec beside python or on PATH (install the mpich wheel)"
)

# One launch per size for these and other modules' checks (torch_launches.py): importing
# torch is the slow part.
CHECKS = {
    2: ["layout", "optimizer", "ddp", "decentralized"],
    3: ["layout", "optimizer", "ddp", "decentralized"],
}


# The torch.distributed backend (check_process_group.py): (ranks, init method, checks).
BACKEND_CHECKS = [
    (2, "totalreduce://", ["collectives", "ddp"]),
    (3, "totalreduce://", ["collectives", "ddp"]),
    (2, "env://", ["collectives"]),
]


def _part(script: str, checks: list[str], *extra: str) -> str:
    return f"{script}:{','.join(checks)}{':' if extra else ''}{':'.join(extra)}"


for _n, _checks in CHECKS.items():
    plan(
        _n, _part("check_torch_mpi.py", _checks), "check_torch_mpi.py", [",".join(_checks)], TIMEOUT
    )
for _n, _method, _checks in BACKEND_CHECKS:
    plan(
        _n,
        _part("check_process_group.py", _checks, _method),
        "check_process_group.py",
        [",".join(_checks), _method],
        TIMEOUT,
    )


def run_checks(script: str, n: int, checks: list[str], *extra: str) -> None:
    """Every rank's ``CHECK OK`` line of ``script``'s part in the launch at ``n`` ranks."""
    out, whole = lines(n, _part(script, checks, *extra))
    for check in checks:
        for r in range(n):
            assert f"{check.upper()} OK rank {r}" in out, whole


@pytest.mark.parametrize(
    "n", [pytest.param(n, marks=pytest.mark.full) if n == 3 else n for n in sorted(CHECKS)]
)
def test_torch_over_mpi(n: int) -> None:
    run_checks("check_torch_mpi.py", n, CHECKS[n])


@pytest.mark.parametrize(
    ("n", "init_method", "checks"),
    # the launch at 3 ranks (every module's part at 3) runs with --full: 2 ranks by default
    [pytest.param(*c, marks=pytest.mark.full) if c[0] == 3 else c for c in BACKEND_CHECKS],
)
def test_torch_distributed_backend(n: int, init_method: str, checks: list[str]) -> None:
    run_checks("check_process_group.py", n, checks, init_method)


def test_bench_torch_runs() -> None:
    """``python -m totalreduce.torch.bench`` at P=2 on a tiny budget prints every method's row,
    and the compute-only ceiling's."""
    env = dict(os.environ, MPIEXEC_TIMEOUT=str(TIMEOUT - 10), PYTHONUNBUFFERED="1")
    args = ["--steps", "1", "--rounds", "1", "--batch-size", "2", "--image-size", "32"]
    proc = subprocess.run(
        [str(MPIEXEC), "-n", "2", sys.executable, "-m", "totalreduce.torch.bench", *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=env,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "resnet18 (62 parameter tensors" in out, out
    rows = ("totalreduce DistributedOptimizer", "DDP over gloo", "DDP over totalreduce")
    for row in (*rows, "compute only (no exchange)"):
        assert any(
            line.startswith(row) and float(line.split()[-2]) > 0 for line in out.splitlines()
        ), out

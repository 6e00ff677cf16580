"""The "totalreduce" torch.distributed backend against gloo: ``mpiexec -n P check_backend_ops.py``.

One launch per size runs every check, with other modules' (torch_launches.py): every
op gloo provides on CPU for every dtype and ReduceOp gloo accepts, compared
exactly with gloo in the same job; DeviceMesh, DTensor and the functional
collectives; FSDP2 against FSDP2 on gloo; torch.distributed.checkpoint; a timeout naming its op.
"""

from __future__ import annotations

import pytest

from conftest import import_torch

torch = import_torch()

from torch_launches import lines, plan  # noqa: E402

from totalreduce.launch import find_mpiexec  # noqa: E402

MPIEXEC = find_mpiexec()  # this Python's (the mpich wheel's, beside it), else PATH's

TIMEOUT = 300
CHECKS = ["ops", "mesh", "fsdp", "dcp", "timeout"]

pytestmark = pytest.mark.skipif(
    MPIEXEC is None, reason="no mpiexec beside python or on PATH (install the mpich wheel)"
)


for _n in (2, 3):
    plan(_n, "check_backend_ops.py", "check_backend_ops.py", [",".join(CHECKS)], TIMEOUT)


@pytest.mark.parametrize("n", [2, pytest.param(3, marks=pytest.mark.full)])
def test_backend_against_gloo(n: int) -> None:
    out, whole = lines(n, "check_backend_ops.py")
    for check in [*CHECKS, "ALL"]:
        for r in range(n):
            assert f"{check} OK rank {r}" in out, whole

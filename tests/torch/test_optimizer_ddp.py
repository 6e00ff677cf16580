"""DistributedOptimizer's parameters equal DDP's after the same steps: ``check_optimizer_ddp.py``.

Bitwise at P=2, to 1e-12 at P=3 (see the script's docstring for why).
"""

from __future__ import annotations

import pytest

from conftest import import_torch

torch = import_torch()

from torch_launches import lines, plan  # noqa: E402

from totalreduce.launch import find_mpiexec  # noqa: E402

MPIEXEC = find_mpiexec()  # this Python's (the mpich wheel's, beside it), else PATH's

dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch built without torch.distributed", allow_module_level=True)

TIMEOUT = 120

pytestmark = pytest.mark.skipif(
    MPIEXEC is None, reason="no mpiexec beside python or on PATH (install the mpich wheel)"
)


for _n in (2, 3):
    plan(_n, "check_optimizer_ddp.py", "check_optimizer_ddp.py", [], TIMEOUT)


@pytest.mark.parametrize("n", [2, pytest.param(3, marks=pytest.mark.full)])
def test_optimizer_equals_ddp(n: int) -> None:
    # in the launch at n ranks with other modules' checks (torch_launches.py)
    out, whole = lines(n, "check_optimizer_ddp.py")
    for r in range(n):
        assert f"OPTIMIZER-DDP OK rank {r}" in out, whole

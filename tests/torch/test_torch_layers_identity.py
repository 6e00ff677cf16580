"""ReduceScatter and AllGather along no partition dimension: a clone, forward and backward."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch not installed")
if not hasattr(torch, "Tensor"):  # tests/torch itself, seen as a namespace package
    pytest.skip("torch not installed", allow_module_level=True)

import totalreduce.torch as trt  # noqa: E402
from conftest import local_services, run_ranks  # noqa: E402
from totalreduce import Partition  # noqa: E402

torch.set_num_threads(1)


@pytest.mark.parametrize("layer", [trt.ReduceScatter, trt.AllGather])
def test_no_partition_dimension_returns_a_clone(layer) -> None:
    part = Partition((2, 2))

    def rank_main(s):
        x = (torch.arange(12.0, dtype=torch.float64).reshape(3, 4) + s.rank).requires_grad_()
        y = layer(part, (), name="id", service=s)(x)
        (y * 3).sum().backward()
        return x, y

    with local_services(4) as svcs:
        results = run_ranks(svcs, rank_main)
    for x, y in results:
        assert torch.equal(y.detach(), x.detach())
        assert y.data_ptr() != x.data_ptr()  # a clone, not the input itself
        assert torch.equal(x.grad, torch.full_like(x, 3.0))

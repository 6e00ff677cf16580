"""torch's TensorHandle satisfies the handle protocol the API relies on."""

from __future__ import annotations

from conftest import import_torch

torch = import_torch()

import totalreduce.torch as trt  # noqa: E402
from conftest import local_services, run_ranks  # noqa: E402
from totalreduce.service.handle import HandleLike, ServiceLike  # noqa: E402


def test_tensor_handle_satisfies_the_handle_protocol() -> None:
    def rank_main(svc):
        assert isinstance(svc, ServiceLike)
        h = trt.allreduce_async(torch.ones(3), name="proto", op="sum", service=svc)
        assert isinstance(h, trt.TensorHandle) and isinstance(h, HandleLike)
        assert h.name == "proto" and h.generation == 0
        return h.wait()

    with local_services(2) as svcs:
        results = run_ranks(svcs, rank_main)
    for r in results:
        assert torch.equal(r, torch.full((3,), 2.0))

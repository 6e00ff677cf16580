"""The DDP comm hooks on stand-in buckets over local ranks (real DDP: test_torch_mpi.py)."""

from __future__ import annotations

import inspect

import pytest

from conftest import import_torch

torch = import_torch()

import totalreduce.torch as trt  # noqa: E402
from conftest import local_services, run_ranks  # noqa: E402
from totalreduce.errors import InvalidArgumentError  # noqa: E402

torch.set_num_threads(1)
P = 3


class Bucket:
    """What a hook uses of DDP's GradBucket: its flat buffer and its index."""

    def __init__(self, buffer: torch.Tensor, index: int) -> None:
        self._buffer, self._index = buffer, index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def index(self) -> int:
        return self._index


def grads(rank: int, index: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10 * rank + index)
    return torch.randn(1000, generator=g)


@pytest.mark.parametrize(
    ("hook", "tol"),
    [
        (trt.allreduce_hook, 1e-6),
        (trt.fp16_compress_hook, 2e-3),
        (trt.bfloat16_compress_hook, 2e-2),
    ],
)
def test_hook_futures_carry_the_average(hook, tol: float) -> None:
    def rank(s):
        state = trt.CommHookState(service=s, prefix=f"{hook.__name__}.")
        out = []
        for step in range(3):
            # Buckets in a different order on every rank and step: names pair them.
            order = [(i + s.rank + step) % 4 for i in range(4)]
            futures = {}
            for i in order:
                bucket = Bucket(grads(s.rank, i), i)
                futures[i] = (bucket, hook(state, bucket))
            out.append({i: f.wait() for i, (b, f) in futures.items()})
            assert all(f.value() is b.buffer() for b, f in futures.values())
        assert state.calls == 12
        return out

    with local_services(P) as svcs:
        results = run_ranks(svcs, rank)
    for per_rank in results:
        for step in per_rank:
            for i, got in step.items():
                want = sum(grads(r, i) for r in range(P)) / P
                torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_hook_accepts_none_and_service_state_and_refuses_others() -> None:
    with local_services(1) as (s,):
        buf = torch.ones(5)
        assert torch.equal(trt.allreduce_hook(s, Bucket(buf, 0)).wait(), torch.ones(5))
        with pytest.raises(InvalidArgumentError, match="CommHookState"):
            trt.allreduce_hook("state", Bucket(buf, 0))


def test_hook_signatures_pass_ddp_checks() -> None:
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available():
        pytest.skip("torch built without torch.distributed")
    for hook in (trt.allreduce_hook, trt.fp16_compress_hook, trt.bfloat16_compress_hook):
        sig = inspect.signature(hook)
        assert sig.parameters["bucket"].annotation is dist.GradBucket
        assert sig.return_annotation == torch.futures.Future[torch.Tensor]

"""Fusion buckets: the plan, and fused results equal to unfused ones in any hook order."""

from __future__ import annotations

import copy
import random

import pytest

from conftest import import_torch

torch = import_torch()

import totalreduce.torch as trt  # noqa: E402
from conftest import local_services, run_ranks  # noqa: E402
from totalreduce.torch.buckets import plan_buckets  # noqa: E402
from totalreduce.torch.compression import Compression  # noqa: E402

torch.set_num_threads(1)
STEPS = 4


class Net(torch.nn.Module):
    """Branches of different widths, a float32 side branch, and a head some ranks skip.

    ``order`` (per rank) is the order the forward visits the branches, so the
    hooks fire in a different order on every rank; ``skip_head`` leaves the
    head unused on that rank; ``never`` is unused everywhere.
    """

    def __init__(self) -> None:
        super().__init__()
        self.branches = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(5, w), torch.nn.Tanh(), torch.nn.Linear(w, 3))
            for w in (3, 7, 2, 11)
        )
        self.head = torch.nn.Linear(5, 3)
        self.never = torch.nn.Linear(5, 3)
        self.order = [0, 1, 2, 3]
        self.skip_head = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.stack([self.branches[k](x) for k in self.order]).sum(0)
        return out if self.skip_head else out + self.head(x)


def template() -> Net:
    torch.manual_seed(5)
    return Net().double()


def batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return (
        torch.randn(6, 5, generator=g, dtype=torch.float64),
        torch.randn(6, 3, generator=g, dtype=torch.float64),
    )


def train(s, fusion_bytes: int, shuffle_seed: int, net: Net) -> dict[str, torch.Tensor]:
    model = copy.deepcopy(net)
    model.skip_head = s.rank == 1
    opt = trt.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        named_parameters=model.named_parameters(),
        fusion_bytes=fusion_bytes,
        prefix=f"f{fusion_bytes}.",
        service=s,
    )
    rng = random.Random(shuffle_seed * 31 + s.rank)
    x, y = batch(s.rank)
    for _ in range(STEPS):
        rng.shuffle(model.order)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    opt.remove_hooks()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def model_bytes(net: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in net.parameters())


@pytest.mark.parametrize("P", [2, 3])
def test_any_bucket_size_equals_no_fusion(P: int) -> None:
    net = template()
    total = model_bytes(net)
    rng = random.Random(P)
    # 0 (off), one byte (every parameter alone, but named as buckets), random sizes spread
    # log-uniformly, the whole model, and more than the model.
    spread = sorted(int(8 * (total / 8) ** rng.random()) for _ in range(4))
    sizes = [0, 1, *spread, total, 10 * total]

    def rank(s):
        return {fb: train(s, fb, seed, net) for seed, fb in enumerate(sizes)}

    with local_services(P) as svcs:
        results = run_ranks(svcs, rank)
    for per_rank in results:
        want = results[0][0]
        for fb, params in per_rank.items():
            for n, p in params.items():
                torch.testing.assert_close(p, want[n], rtol=0, atol=1e-12, msg=f"{fb} {n}")
    assert not torch.equal(results[0][0]["head.weight"], net.head.weight)  # it did train
    assert torch.equal(results[0][0]["never.weight"], net.never.weight)  # zero gradient


def test_plan_is_a_pure_function_of_the_parameters() -> None:
    a, b = template(), template()
    b.float()  # other values and dtype, same shapes: bytes differ, so plans differ by dtype only
    named = list(a.named_parameters())
    prio = list(range(len(named), 0, -1))
    plan1 = plan_buckets(named, prio, 700, Compression.none, "g.")
    plan2 = plan_buckets(
        list(copy.deepcopy(a).named_parameters()), prio, 700, Compression.none, "g."
    )
    assert [(p.name, [n for n, _ in p.members]) for p in plan1] == [
        (p.name, [n for n, _ in p.members]) for p in plan2
    ]
    assert [p.name for p in plan1] == [f"g.bucket.{i}" for i in range(len(plan1))]
    for p in plan1:
        nbytes = sum(t.numel() * 8 for _, t in p.members)
        assert nbytes <= 700 or len(p.members) == 1
        assert p.priority == max(prio[[n for n, _ in named].index(m)] for m, _ in p.members)
    # Reverse registration order: the last parameters (first out of backward) come first.
    assert plan1[0].members[0][0] == named[-1][0]
    # fp16 on the wire halves the bytes, so fewer buckets.
    half = plan_buckets(named, prio, 700, Compression.fp16, "g.")
    assert len(half) < len(plan1) and all(p.wire_dtype == torch.float16 for p in half)
    # One dtype per bucket.
    mixed = [("a", torch.zeros(3, dtype=torch.float64)), ("b", torch.zeros(3))]
    assert len(plan_buckets(mixed, [1, 1], 1 << 20, Compression.none, "")) == 2


@pytest.mark.parametrize("fusion_bytes", [0, 1 << 20])
def test_fp16_compression_is_close_to_float32(fusion_bytes: int) -> None:
    P = 2
    net = template().float()

    def rank(s, compression):
        model = copy.deepcopy(net)
        opt = trt.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.0),
            named_parameters=model.named_parameters(),
            fusion_bytes=fusion_bytes,
            compression=compression,
            prefix=f"{compression.__name__}.",
            service=s,
        )
        x, y = batch(s.rank)
        torch.nn.functional.mse_loss(model(x.float()), y.float()).backward()
        opt.step()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    with local_services(P) as svcs:
        exact = run_ranks(svcs, lambda s: rank(s, Compression.none))
        half = run_ranks(svcs, lambda s: rank(s, Compression.fp16))
    for n, g in exact[0].items():
        assert half[0][n].dtype == torch.float32
        torch.testing.assert_close(half[0][n], g, rtol=2e-3, atol=2e-3, msg=n)
        assert torch.equal(half[0][n], half[1][n])


@pytest.mark.parametrize("fusion_bytes", [0, 600])
def test_join_lets_ranks_with_fewer_batches_finish(fusion_bytes: int) -> None:
    P = 3
    net = template()
    steps = {0: 4, 1: 2, 2: 3}  # uneven inputs: rank 0 joins last

    def reference() -> dict[str, torch.Tensor]:
        # Joined ranks contribute zeros: the average is over all P ranks.
        model = copy.deepcopy(net)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for k in range(max(steps.values())):
            opt.zero_grad()
            grads: dict[str, torch.Tensor] = {}
            for r in range(P):
                if k >= steps[r]:
                    continue
                m = copy.deepcopy(model)
                x, y = batch(r)
                torch.nn.functional.mse_loss(m(x), y).backward()
                for n, p in m.named_parameters():
                    if p.grad is not None:
                        grads[n] = grads.get(n, 0) + p.grad
            for n, p in model.named_parameters():
                p.grad = grads[n] / P if n in grads else torch.zeros_like(p)
            opt.step()
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    def rank(s):
        model = copy.deepcopy(net)
        opt = trt.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            named_parameters=model.named_parameters(),
            fusion_bytes=fusion_bytes,
            service=s,
        )
        x, y = batch(s.rank)
        for _ in range(steps[s.rank]):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        last = opt.join()
        return last, {n: p.detach().clone() for n, p in model.named_parameters()}

    with local_services(P) as svcs:
        results = run_ranks(svcs, rank, timeout=60)
    assert [last for last, _ in results] == [0, 0, 0]
    want = reference()
    for n, p in results[0][1].items():
        torch.testing.assert_close(p, want[n], rtol=0, atol=1e-12, msg=n)

"""DistributedOptimizer: equivalence with single-process SGD, orders, unused parameters, rules."""

from __future__ import annotations

import copy
import random

import pytest

from conftest import import_torch

torch = import_torch()

import totalreduce.torch as trt  # noqa: E402
from conftest import local_services, run_ranks  # noqa: E402
from totalreduce.errors import InvalidArgumentError  # noqa: E402

torch.set_num_threads(1)
STEPS = 5
BATCH = 24  # divisible by every P tested, so shard means average to the batch mean


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 8)
        self.fc2 = torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class Branches(torch.nn.Module):
    """Independent branches summed; ``order`` is the order the forward visits them.

    The sum is the same function in any order, but autograd runs the branches'
    gradient nodes in reverse creation order, so each order makes the hooks
    fire in a different order.
    """

    def __init__(self, branches: int = 4) -> None:
        super().__init__()
        self.branches = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
            for _ in range(branches)
        )
        self.order = list(range(branches))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = [self.branches[k](x) for k in self.order]
        return torch.stack(out).sum(0)


_TEMPLATES: dict[str, torch.nn.Module] = {}


def make_model(kind: str) -> torch.nn.Module:
    """A fresh copy of one fixed initial model (ranks are threads: no shared seeding)."""
    if kind not in _TEMPLATES:
        torch.manual_seed(1234)
        _TEMPLATES[kind] = (MLP() if kind == "mlp" else Branches()).double()
    return copy.deepcopy(_TEMPLATES[kind])


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return (
        torch.randn(BATCH, 4, generator=g, dtype=torch.float64),
        torch.randn(BATCH, 3, generator=g, dtype=torch.float64),
    )


def sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def reference(kind: str) -> dict[str, torch.Tensor]:
    model = make_model(kind)
    opt = sgd(model)
    x, y = batch()
    for _ in range(STEPS):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("kind", ["mlp", "branches"])
@pytest.mark.parametrize("P", [2, 3, 4])
def test_matches_single_process_sgd(P: int, kind: str) -> None:
    want = reference(kind)
    x, y = batch()
    m = BATCH // P

    def rank(s):
        model = make_model(kind)
        fired: list[str] = []
        if kind == "branches":
            random.Random(s.rank).shuffle(model.order)
            for n, p in model.named_parameters():
                p.register_post_accumulate_grad_hook(lambda _p, n=n: fired.append(n))
        opt = trt.DistributedOptimizer(
            sgd(model), named_parameters=model.named_parameters(), service=s
        )
        xs, ys = x[s.rank * m : (s.rank + 1) * m], y[s.rank * m : (s.rank + 1) * m]
        for _ in range(STEPS):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(xs), ys).backward()
            opt.step()
        return {n: p.detach().clone() for n, p in model.named_parameters()}, fired[: len(want)]

    with local_services(P) as svcs:
        results = run_ranks(svcs, rank)
    for params, _ in results:
        for n, p in params.items():
            torch.testing.assert_close(p, want[n], rtol=0, atol=1e-10, msg=n)
    if kind == "branches":
        orders = {tuple(fired) for _, fired in results}
        assert len(orders) > 1, "every rank submitted its gradients in the same order"


class TwoHeads(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(3, 3)
        self.head_a = torch.nn.Linear(3, 1)
        self.head_b = torch.nn.Linear(3, 1)
        self.never = torch.nn.Linear(3, 1)
        self.use_b = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        out = self.head_a(h)
        return out + self.head_b(h) if self.use_b else out


def test_unused_parameter_on_one_rank_does_not_hang() -> None:
    """Ranks that skip a parameter count zeros in its average (Horovod's rule)."""
    P = 3
    x = torch.randn(6, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    heads = TwoHeads().double()

    def local_grads(r: int) -> dict[str, torch.Tensor]:
        model = copy.deepcopy(heads)
        model.use_b = r != 1
        model(x[2 * r : 2 * r + 2]).sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    local = [local_grads(r) for r in range(P)]

    def rank(s):
        model = copy.deepcopy(heads)
        model.use_b = s.rank != 1  # rank 1 never produces head_b's gradients
        opt = trt.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.0),
            named_parameters=model.named_parameters(),
            service=s,
        )
        model(x[2 * s.rank : 2 * s.rank + 2]).sum().backward()
        opt.step()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    with local_services(P) as svcs:
        results = run_ranks(svcs, rank, timeout=60)
    for grads in results:
        for n, g in grads.items():
            want = sum(loc[n] for loc in local if n in loc) / P if "never" not in n else 0 * g
            torch.testing.assert_close(g, want, rtol=0, atol=1e-12, msg=n)
        assert torch.all(grads["never.weight"] == 0)


def test_gradient_accumulation_and_misuse() -> None:
    P, kind = 2, "mlp"
    want = reference(kind)
    x, y = batch()
    m = BATCH // P

    def rank(s):
        model = make_model(kind)
        opt = trt.DistributedOptimizer(
            sgd(model),
            named_parameters=model.named_parameters(),
            backward_passes_per_step=2,
            service=s,
        )
        xs, ys = x[s.rank * m : (s.rank + 1) * m], y[s.rank * m : (s.rank + 1) * m]
        half = m // 2
        for _ in range(STEPS):
            opt.zero_grad()
            for k in range(2):
                sl = slice(k * half, (k + 1) * half)
                (torch.nn.functional.mse_loss(model(xs[sl]), ys[sl]) / 2).backward()
            opt.step()
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        # A third pass before step() is an error; so is zero_grad() while averaging.
        opt.zero_grad()
        for _ in range(2):
            model(xs).sum().backward()
        with pytest.raises(trt.GradientSyncError, match="backward_passes_per_step=2"):
            model(xs).sum().backward()
        with pytest.raises(trt.GradientSyncError, match="zero_grad"):
            opt.zero_grad()
        opt.step()
        return params

    with local_services(P) as svcs:
        results = run_ranks(svcs, rank)
    for params in results:
        for n, p in params.items():
            torch.testing.assert_close(p, want[n], rtol=0, atol=1e-10, msg=n)


def test_priorities_names_and_wrapping() -> None:
    with local_services(1) as (s,):
        model = make_model("mlp")
        base = sgd(model)
        fused = trt.DistributedOptimizer(
            sgd(model), named_parameters=model.named_parameters(), service=s
        )
        assert fused.buckets() == {
            "grad.bucket.0": ["fc2.bias", "fc2.weight", "fc1.bias", "fc1.weight"]
        }
        assert fused.gradient_names() == {"grad.bucket.0": 4}
        fused.remove_hooks()
        opt = trt.DistributedOptimizer(
            base, named_parameters=model.named_parameters(), fusion_bytes=0, service=s
        )
        assert isinstance(opt, torch.optim.SGD)
        assert opt.state is base.state and opt.param_groups is base.param_groups
        names = opt.gradient_names()
        assert list(names) == [
            "grad.fc1.weight",
            "grad.fc1.bias",
            "grad.fc2.weight",
            "grad.fc2.bias",
        ]
        assert list(names.values()) == [4, 3, 2, 1]
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        model(batch()[0]).sum().backward()
        opt.synchronize()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        with opt.skip_synchronize():
            opt.step()
        sched.step()
        assert opt.param_groups[0]["lr"] == pytest.approx(0.05)
        opt.zero_grad()
        opt.remove_hooks()

        by_call = trt.DistributedOptimizer(
            sgd(model),
            named_parameters=model.named_parameters(),
            priority=lambda name, p: p.numel(),
            prefix="g.",
            fusion_bytes=0,
            service=s,
        ).gradient_names()
        assert by_call == {"g.fc1.weight": 32, "g.fc2.weight": 24, "g.fc1.bias": 8, "g.fc2.bias": 3}
        by_map = trt.DistributedOptimizer(
            sgd(model),
            named_parameters=model.named_parameters(),
            priority={"fc2.bias": 9},
            fusion_bytes=0,
            service=s,
        ).gradient_names()
        assert by_map["grad.fc2.bias"] == 9 and by_map["grad.fc1.weight"] == 0
        unnamed = trt.DistributedOptimizer(sgd(model), fusion_bytes=0, service=s).gradient_names()
        assert list(unnamed) == ["grad.group0.0", "grad.group0.1", "grad.group0.2", "grad.group0.3"]

        with pytest.raises(InvalidArgumentError, match="not in named_parameters"):
            trt.DistributedOptimizer(
                sgd(model), named_parameters=list(model.named_parameters())[:2], service=s
            )
        with pytest.raises(InvalidArgumentError, match="twice"):
            trt.DistributedOptimizer(
                sgd(model),
                named_parameters=[("a", p) for p in model.parameters()],
                service=s,
            )
        with pytest.raises(InvalidArgumentError, match="backward_passes_per_step"):
            trt.DistributedOptimizer(sgd(model), backward_passes_per_step=0, service=s)
        with pytest.raises(InvalidArgumentError, match="fusion_bytes"):
            trt.DistributedOptimizer(sgd(model), fusion_bytes=-1, service=s)
        with pytest.raises(InvalidArgumentError, match="compression"):
            trt.DistributedOptimizer(sgd(model), compression="fp16", service=s)

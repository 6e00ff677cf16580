"""BlueFog's distributed optimizers with the import changed: one step of each, exactly
(test_bluefog_examples.py runs this in the shared launch of bluefog_launch.py: four ranks as
two machines of two).

Each rank trains ``Linear(3, 1, bias=False)`` on a least-squares problem of its own; the
expected parameters after a step are worked out here from every rank's starting weight and
gradient (all-gathered) and BlueFog's definition of the optimizer.  Prints
``OPTIMIZER <name> OK rank <r>`` per check.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

import totalreduce.torch as bf  # was: import bluefog.torch as bf
from totalreduce import topology as topology_util  # was: from bluefog.common import topology_util

LR = 0.1


def problem(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    X = torch.randn(5, 3, generator=g, dtype=torch.float64)
    y = torch.randn(5, 1, generator=g, dtype=torch.float64)
    return X, y


def fresh_model(rank: int) -> torch.nn.Linear:
    model = torch.nn.Linear(3, 1, bias=False).double()
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0 + rank, -0.5 * rank, 0.25 * rank * rank]]))
    return model


def loss_of(model: torch.nn.Module, rank: int) -> torch.Tensor:
    X, y = problem(rank)
    return torch.mean((model(X) - y) ** 2)


def gradient(w: torch.Tensor, rank: int) -> torch.Tensor:
    X, y = problem(rank)
    return 2.0 / len(X) * (X.T @ (X @ w.reshape(3, 1) - y)).reshape(1, 3)


def everyone(t: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's ``t`` (a ``(1, 3)`` row), in rank order."""
    rows = bf.allgather(t.detach().reshape(1, -1).clone())
    return [rows[r].reshape(t.shape) for r in range(bf.size())]


def ring(values: list[torch.Tensor], r: int) -> torch.Tensor:
    n = len(values)
    return (values[r] + values[(r - 1) % n] + values[(r + 1) % n]) / 3


def train_step(opt: torch.optim.Optimizer, model: torch.nn.Module, r: int) -> None:
    opt.zero_grad()
    loss_of(model, r).backward()
    opt.step()


Make = Callable[[torch.optim.Optimizer, torch.nn.Module], torch.optim.Optimizer]
Want = Callable[[list[torch.Tensor], list[torch.Tensor], int], torch.Tensor]


def check(name: str, make: Make, want: Want, steps: int = 1) -> None:
    """One optimizer: ``steps`` training steps, then the parameter against ``want(w0s, g0s,
    rank)`` (every rank's starting weights and gradients there)."""
    r = bf.rank()
    model = fresh_model(r)
    w0 = model.weight.detach().clone()
    opt = make(torch.optim.SGD(model.parameters(), lr=LR), model)
    assert isinstance(opt, torch.optim.SGD), type(opt).__mro__
    for _ in range(steps):
        train_step(opt, model, r)
    expected = want(everyone(w0), [gradient(w, j) for j, w in enumerate(everyone(w0))], r)
    got = model.weight.detach()
    assert torch.allclose(got, expected, rtol=0, atol=1e-12), (name, got, expected)
    print(f"OPTIMIZER {name} OK rank {r}", flush=True)


def main() -> None:
    bf.init()
    n, r = bf.size(), bf.rank()
    bf.set_topology(topology_util.RingGraph(n))
    bf.set_machine_topology(topology_util.RingGraph(bf.machine_size()))
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    CT = bf.CommunicationType

    check("adapt-with-combine", lambda o, m: bf.DistributedAdaptWithCombineOptimizer(o, model=m),
          lambda w, g, r: ring(w, r) - LR * g[r])  # fmt: skip
    check("neighbor-allreduce", bf.DistributedNeighborAllreduceOptimizer,
          lambda w, g, r: ring(w, r) - LR * g[r])  # fmt: skip
    check("allreduce", bf.DistributedAllreduceOptimizer, lambda w, g, r: mean(w) - LR * g[r])
    machines = bf.machine_size()
    local = bf.local_size()

    def hierarchical(w: list[torch.Tensor], g: list[torch.Tensor], r: int) -> torch.Tensor:
        avg = [mean(w[m * local : (m + 1) * local]) for m in range(machines)]
        me = r // local
        near = sorted({(me - 1) % machines, (me + 1) % machines} - {me})
        return (avg[me] + sum(avg[m] for m in near)) / (len(near) + 1) - LR * g[r]

    check("hierarchical", bf.DistributedHierarchicalNeighborAllreduceOptimizer, hierarchical)
    check("adapt-then-combine", lambda o, m: bf.DistributedAdaptThenCombineOptimizer(o, m),
          lambda w, g, r: ring([wj - LR * gj for wj, gj in zip(w, g, strict=True)], r))  # fmt: skip
    check("adapt-then-combine allreduce",
          lambda o, m: bf.DistributedAdaptThenCombineOptimizer(o, m, CT.allreduce),
          lambda w, g, r: mean([wj - LR * gj for wj, gj in zip(w, g, strict=True)]))  # fmt: skip
    check("gradient-allreduce", bf.DistributedGradientAllreduceOptimizer,
          lambda w, g, r: w[r] - LR * mean(g))  # fmt: skip
    check("empty", lambda o, m: bf.DistributedAdaptWithCombineOptimizer(o, m, CT.empty),
          lambda w, g, r: w[r] - LR * g[r])  # fmt: skip

    # every second forward pass communicates: a local step, then w2 = avg(w1) - lr g(w1)
    def two_steps(w: list[torch.Tensor], g: list[torch.Tensor], r: int) -> torch.Tensor:
        w1 = [wj - LR * gj for wj, gj in zip(w, g, strict=True)]
        return ring(w1, r) - LR * gradient(w1[r], r)

    check("every second step",
          lambda o, m: bf.DistributedAdaptWithCombineOptimizer(o, m, num_steps_per_communication=2),
          two_steps, steps=2)  # fmt: skip

    # the knobs, set as BlueFog's dynamic-topology scripts set them
    def dynamic(o: torch.optim.Optimizer, m: torch.nn.Module) -> torch.optim.Optimizer:
        opt = bf.DistributedNeighborAllreduceOptimizer(o, m)
        opt.self_weight, opt.src_weights = 0.5, {(r - 1) % n: 0.5}  # type: ignore[attr-defined]
        opt.dst_weights = [(r + 1) % n]  # type: ignore[attr-defined]
        return opt

    check("dynamic knobs", dynamic, lambda w, g, r: 0.5 * w[r] + 0.5 * w[(r - 1) % n] - LR * g[r])

    def own_step(o: torch.optim.Optimizer, m: torch.nn.Module) -> torch.optim.Optimizer:
        opt = bf.DistributedAdaptThenCombineOptimizer(o, m)

        def sgd_twice(self: torch.optim.Optimizer, p: torch.Tensor, grad: torch.Tensor,
                      group: dict) -> None:  # fmt: skip
            p.data.add_(grad, alpha=-2 * group["lr"])

        opt.register_step_function(sgd_twice)  # type: ignore[attr-defined]
        return opt

    check("registered step", own_step,
          lambda w, g, r: ring([wj - 2 * LR * gj for wj, gj in zip(w, g, strict=True)], r),
    )  # fmt: skip

    # adapt-then-combine around Adam: the average of every rank's own Adam step
    model = fresh_model(r)
    reference = fresh_model(r)
    opt = bf.DistributedAdaptThenCombineOptimizer(
        torch.optim.Adam(model.parameters(), lr=LR), model
    )
    assert isinstance(opt, torch.optim.Adam)
    train_step(opt, model, r)
    alone = torch.optim.Adam(reference.parameters(), lr=LR)
    alone.zero_grad()
    loss_of(reference, r).backward()
    alone.step()
    expected = ring(everyone(reference.weight.detach()), r)
    assert torch.allclose(model.weight.detach(), expected, rtol=0, atol=1e-12)
    print(f"OPTIMIZER adam adapt-then-combine OK rank {r}", flush=True)

    # BlueFog refuses zero_grad while gradients are being averaged
    model = fresh_model(r)
    opt = bf.DistributedGradientAllreduceOptimizer(
        torch.optim.SGD(model.parameters(), lr=LR), model
    )
    loss_of(model, r).backward()
    try:
        opt.zero_grad()
    except AssertionError as exc:
        assert "before optimizer.step()" in str(exc)
    else:
        raise AssertionError("zero_grad() with gradients in flight was not refused")
    opt.step()
    # a second forward before step() starts nothing more, and says so once
    model = fresh_model(r)
    opt = bf.DistributedAdaptWithCombineOptimizer(torch.optim.SGD(model.parameters(), lr=LR), model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss_of(model, r)
        loss_of(model, r)
    assert any("already being averaged" in str(w.message) for w in caught), caught
    opt.step()
    sgd = torch.optim.SGD(model.parameters(), lr=LR)
    for bad, says in (("neighbor", "bf.CommunicationType"), (opt, "already one of BlueFog's")):
        try:
            wrapped = bad if isinstance(bad, torch.optim.Optimizer) else sgd
            kind = bad if isinstance(bad, str) else bf.CommunicationType.allreduce
            bf.DistributedAdaptWithCombineOptimizer(wrapped, model, communication_type=kind)
        except ValueError as exc:
            assert says in str(exc), exc
        else:
            raise AssertionError(f"{bad!r} was taken")
    print(f"OPTIMIZER guards OK rank {r}", flush=True)
    bf.barrier()
    bf.shutdown()


if __name__ == "__main__":
    main()

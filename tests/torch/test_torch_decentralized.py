"""DecentralizedDataParallel: mixing as the topology's matrices say, rho, global average."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from conftest import import_torch

torch = import_torch()

import totalreduce.torch as trt  # noqa: E402
from conftest import local_services, run_ranks  # noqa: E402
from totalreduce.errors import InvalidArgumentError  # noqa: E402
from totalreduce.topology import get_topology, mixing_matrix, rho_period  # noqa: E402

torch.set_num_threads(1)


def net() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)
    ).double()


def flat(model: torch.nn.Module) -> np.ndarray:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().copy()


def spread(x: np.ndarray) -> float:
    return float(np.linalg.norm(x - x.mean(axis=0)))


def mix_with_lr_zero(p: int, topology: str, options: dict, steps: int) -> list[np.ndarray]:
    """Each rank starts from its own random parameters; returns [P x n] after every step."""
    inits = []
    for r in range(p):
        torch.manual_seed(100 + r)
        inits.append(net())
    x = torch.randn(5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))

    def rank(s):
        model = copy.deepcopy(inits[s.rank])
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        ddp = trt.DecentralizedDataParallel(
            model, opt, topology, sync_initial=False, service=s, **options
        )
        seen = [flat(model)]
        for _ in range(steps):
            opt.zero_grad()
            ddp(x).square().sum().backward()
            opt.step()
            ddp.synchronize()
            seen.append(flat(model))
        return seen

    with local_services(p) as svcs:
        per_rank = run_ranks(svcs, rank)
    return [np.stack([per_rank[r][t] for r in range(p)]) for t in range(steps + 1)]


@pytest.mark.parametrize(
    ("p", "topology", "options", "periods"),
    [
        (4, "exp", {}, 2),
        (4, "alternating-exp-ring", {"local_size": 2}, 2),
        (6, "alternating-exp-ring", {"local_size": 2}, 3),
        (6, "ring", {}, 3),
        (5, "exp", {}, 3),
        (6, "exponential-2", {}, 4),
    ],
)
def test_spread_shrinks_as_rho_predicts(p: int, topology: str, options: dict, periods: int):
    topo = get_topology(topology, p, **options)
    steps = topo.period * periods
    xs = mix_with_lr_zero(p, topology, options, steps)
    # Every step is exactly x <- W(t) x, with t counted from the first step.
    for t in range(steps):
        np.testing.assert_allclose(xs[t + 1], mixing_matrix(topo, t) @ xs[t], rtol=0, atol=1e-12)
    # The mean is kept; the spread contracts by rho per whole period.
    np.testing.assert_allclose(xs[-1].mean(axis=0), xs[0].mean(axis=0), rtol=0, atol=1e-12)
    rho = rho_period(topo)
    ends = [spread(xs[m * topo.period]) for m in range(periods + 1)]
    assert ends[1] < ends[0]
    for m in range(1, periods):
        assert ends[m + 1] <= rho * ends[m] * (1 + 1e-6) + 1e-12, (m, ends, rho)
    if rho == 0.0:  # exp and alternating-exp-ring on powers of two: exact after one period
        assert ends[1] < 1e-12


def test_complete_topology_equals_single_process_sgd() -> None:
    """With plain SGD, averaging the stepped parameters is averaging the gradients."""
    P, steps = 3, 4
    torch.manual_seed(0)
    template = net()
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(12, 3, generator=g, dtype=torch.float64), torch.randn(12, 2, generator=g)
    y = y.double()
    ref = copy.deepcopy(template)
    opt = torch.optim.SGD(ref.parameters(), lr=0.2)
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        opt.step()

    def rank(s):
        model = copy.deepcopy(template)
        opt = torch.optim.SGD(model.parameters(), lr=0.2)
        ddp = trt.DecentralizedDataParallel(model, opt, "complete", service=s)
        sl = slice(4 * s.rank, 4 * s.rank + 4)
        for _ in range(steps):
            opt.zero_grad()
            torch.nn.functional.mse_loss(ddp(x[sl]), y[sl]).backward()
            ddp.step()
        ddp.synchronize()
        return flat(model)

    with local_services(P) as svcs:
        for got in run_ranks(svcs, rank):
            np.testing.assert_allclose(got, flat(ref), rtol=0, atol=1e-10)


def test_global_average_and_initial_broadcast() -> None:
    P = 3
    inits = []
    for r in range(P):
        torch.manual_seed(10 + r)
        m = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.BatchNorm1d(3)).double()
        m[1].running_mean.fill_(float(r))
        inits.append(m)

    def rank(s):
        a = copy.deepcopy(inits[s.rank])
        ddp = trt.DecentralizedDataParallel(
            a, torch.optim.SGD(a.parameters(), lr=0.1), "ring", sync_initial=False, service=s
        )
        ddp.global_average()
        assert ddp.topology.name == "ring" and ddp.step_count == 0
        b = copy.deepcopy(inits[s.rank])
        trt.DecentralizedDataParallel(
            b, torch.optim.SGD(b.parameters(), lr=0.1), "exp", service=s, prefix="b."
        )
        return a.state_dict(), b.state_dict()

    with local_services(P) as svcs:
        results = run_ranks(svcs, rank)
    for averaged, synced in results:
        for k, v in averaged.items():
            if v.is_floating_point():
                want = sum(m.state_dict()[k] for m in inits) / P
                torch.testing.assert_close(v, want, rtol=0, atol=1e-12, msg=k)
        for k, v in synced.items():
            torch.testing.assert_close(v, inits[0].state_dict()[k], rtol=0, atol=0, msg=k)


def test_topology_needs_matching_local_size() -> None:
    with local_services(1) as (s,):
        m = net()
        with pytest.raises(InvalidArgumentError, match="local_size"):
            trt.DecentralizedDataParallel(
                m, torch.optim.SGD(m.parameters(), lr=0.1), local_size=2, service=s
            )
        ddp = trt.DecentralizedDataParallel(m, torch.optim.SGD(m.parameters(), lr=0.1), service=s)
        assert ddp.topology.world_size == 1

"""broadcast_parameters, broadcast_optimizer_state and broadcast_object over local ranks."""

from __future__ import annotations

import copy

import pytest

from conftest import import_torch

torch = import_torch()

import totalreduce.torch as trt  # noqa: E402
from conftest import local_services, run_ranks  # noqa: E402
from totalreduce.errors import InvalidArgumentError  # noqa: E402

torch.set_num_threads(1)
P = 3


def models() -> list[torch.nn.Module]:
    out = []
    for r in range(P):
        torch.manual_seed(r)
        m = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
        m[1].num_batches_tracked.fill_(10 * r)
        out.append(m)
    return out


def test_broadcast_parameters_from_any_root() -> None:
    inits = models()

    def rank(s):
        a, b, c = (copy.deepcopy(inits[s.rank]) for _ in range(3))
        trt.broadcast_parameters(a.state_dict(), root=1, service=s)
        trt.broadcast_parameters(b.named_parameters(), root=2, prefix="named.", service=s)
        trt.broadcast_parameters(c, root=0, prefix="module.", service=s)
        return a.state_dict(), dict(b.named_parameters()), c.state_dict()

    with local_services(P) as svcs:
        results = run_ranks(svcs, rank)
    for a, b, c in results:
        for k, v in a.items():
            assert torch.equal(v, inits[1].state_dict()[k]), k
        for k, v in b.items():
            assert torch.equal(v, dict(inits[2].named_parameters())[k]), k
        for k, v in c.items():
            assert torch.equal(v, inits[0].state_dict()[k]), k


def test_broadcast_optimizer_state_to_fresh_optimizers() -> None:
    inits = models()

    def rank(s):
        model = copy.deepcopy(inits[0])
        opt = torch.optim.Adam(model.parameters(), lr=0.01 * (s.rank + 1))
        if s.rank == 0:  # only the root has state, as after loading a checkpoint
            model(torch.randn(5, 3)).sum().backward()
            opt.step()
        trt.broadcast_optimizer_state(opt, root=0, service=s)
        return opt.state_dict()

    with local_services(P) as svcs:
        results = run_ranks(svcs, rank)
    root = results[0]
    for sd in results[1:]:
        assert sd["param_groups"] == root["param_groups"]
        assert sd["param_groups"][0]["lr"] == pytest.approx(0.01)
        assert sd["state"].keys() == root["state"].keys() and sd["state"]
        for i, st in sd["state"].items():
            for k, v in st.items():
                assert torch.equal(torch.as_tensor(v), torch.as_tensor(root["state"][i][k])), k


def test_broadcast_object_and_bad_input() -> None:
    def rank(s):
        got = trt.broadcast_object(
            {"epoch": 3, "rank": s.rank} if s.rank == 2 else None, 2, service=s
        )
        with pytest.raises(InvalidArgumentError, match="not a tensor"):
            trt.broadcast_parameters({"x": 1.0}, service=s)
        return got

    with local_services(P) as svcs:
        assert run_ranks(svcs, rank) == [{"epoch": 3, "rank": 2}] * P

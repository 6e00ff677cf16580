"""Horovod's names in totalreduce.torch: each alias, allgather's shapes, objects, node layout."""

from __future__ import annotations

import pytest

from conftest import import_torch

torch = import_torch()

import totalreduce.torch as trt  # noqa: E402
from conftest import local_services, run_ranks  # noqa: E402
from totalreduce.errors import InvalidArgumentError  # noqa: E402

torch.set_num_threads(1)
P = 3


@pytest.fixture(scope="module")
def services():
    with local_services(P) as svcs:
        yield svcs


def test_op_constants_reduce_as_named(services) -> None:
    def rank(s):
        x = torch.tensor([float(s.rank + 1), -float(s.rank)], dtype=torch.float64)
        return {
            c: trt.allreduce(x, f"const.{c}", op=c, service=s)
            for c in (trt.Average, trt.Sum, trt.Min, trt.Max)
        }

    for got in run_ranks(services, rank):
        assert got[trt.Sum].tolist() == [6.0, -3.0]
        assert got[trt.Average].tolist() == [2.0, -1.0]
        assert got[trt.Min].tolist() == [1.0, -2.0]
        assert got[trt.Max].tolist() == [3.0, 0.0]


def test_root_rank_is_root(services) -> None:
    def rank(s):
        t = torch.full((3,), float(s.rank))
        a = trt.broadcast(t, root_rank=2, name="rr.a", service=s)
        trt.broadcast_(t, name="rr.b", root_rank=1, service=s)
        obj = trt.broadcast_object({"from": s.rank}, root_rank=2, name="rr.obj", service=s)
        model = torch.nn.Linear(2, 2)
        with torch.no_grad():
            model.weight.fill_(s.rank)
        trt.broadcast_parameters(model.state_dict(), root_rank=1, prefix="rr.p.", service=s)
        return a, t, obj, model.weight.detach().clone()

    for a, b, obj, w in run_ranks(services, rank):
        assert a.tolist() == [2.0] * 3 and b.tolist() == [1.0] * 3
        assert obj == {"from": 2}
        assert torch.all(w == 1.0)
    with pytest.raises(InvalidArgumentError, match="disagree"):
        trt.broadcast(torch.ones(1), 1, root_rank=2, service=services[0])


def test_allgather_concatenates_along_dim0(services) -> None:
    def rank(s):
        rows = s.rank + 1  # 1, 2, 3 rows: ranks may differ in dimension 0
        x = torch.arange(rows * 4, dtype=torch.float32).reshape(rows, 2, 2) + 100 * s.rank
        joined = trt.allgather(x, "ag.dim0", service=s)
        flat = trt.allgather(x, "ag.flat", flat=True, service=s)
        scalar = trt.allgather(torch.tensor(float(s.rank)), "ag.scalar", service=s)
        vec = trt.allgather(torch.full((2,), s.rank), "ag.vec", service=s)
        return x, joined, flat, scalar, vec

    results = run_ranks(services, rank)
    want = torch.cat([x for x, *_ in results])
    for _, joined, flat, scalar, vec in results:
        assert joined.shape == (6, 2, 2) and torch.equal(joined, want)
        assert flat.shape == (24,) and torch.equal(flat, want.reshape(-1))
        assert scalar.shape == (P,) and scalar.tolist() == [0.0, 1.0, 2.0]
        assert vec.tolist() == [0, 0, 1, 1, 2, 2]


def test_allgather_refuses_rows_that_do_not_fit(services) -> None:
    def rank(s):
        x = torch.zeros(1, 3 if s.rank == 0 else 2)  # 3 + 2 + 2 = 7 elements: rows of neither
        with pytest.raises(InvalidArgumentError, match="differ beyond dimension 0"):
            trt.allgather(x, "ag.bad", service=s)
        return trt.allgather(x, "ag.bad.flat", flat=True, service=s).shape

    assert run_ranks(services, rank, timeout=60) == [(7,)] * P


def test_allgather_object_and_barrier(services) -> None:
    def rank(s):
        trt.barrier(service=s)
        got = trt.allgather_object({"rank": s.rank, "pad": "x" * (5 * s.rank)}, service=s)
        trt.barrier("named", service=s)
        return got

    want = [{"rank": r, "pad": "x" * (5 * r)} for r in range(P)]
    assert run_ranks(services, rank) == [want] * P


def test_node_layout_of_the_local_transport(services) -> None:
    for s in services:
        assert s.node_layout() == (s.rank, P, 0, 1)


def test_compression_names() -> None:
    t = torch.linspace(-1, 1, 7)
    wire, ctx = trt.Compression.fp16.compress(t)
    assert wire.dtype == torch.float16 and ctx == torch.float32
    assert trt.Compression.fp16.decompress(wire, ctx).dtype == torch.float32
    same, ctx = trt.Compression.none.compress(t)
    assert same.dtype == torch.float32 and torch.equal(same, t)
    assert trt.Compression.fp16.wire(torch.int64) == torch.int64

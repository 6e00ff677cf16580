"""The "totalreduce" torch.distributed backend's group on local ranks (MPI: test_torch_mpi.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from conftest import import_torch

torch = import_torch()
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch built without torch.distributed", allow_module_level=True)

import totalreduce.torch as trt  # noqa: E402
from conftest import local_services, run_ranks  # noqa: E402
from totalreduce.errors import InvalidArgumentError, TotalReduceError  # noqa: E402
from totalreduce.torch.process_group import create_process_group  # noqa: E402

torch.set_num_threads(1)
P = 3


def options(size: int, rank: int, ranks: list[int], gid: str = "0") -> SimpleNamespace:
    return SimpleNamespace(
        group_size=size, group_rank=rank, global_ranks_in_group=ranks, group_id=gid
    )


def test_backend_is_registered() -> None:
    assert "totalreduce" in dist.Backend.backend_list
    assert dist.Backend.TOTALREDUCE == "totalreduce"


def test_group_ops_and_futures() -> None:
    def rank(s):
        pg = create_process_group(options(P, s.rank, []), service=s)
        t = torch.full((4,), float(s.rank + 1))
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX
        work = pg.allreduce([t], opts)
        got = work.get_future().wait()
        assert got[0] is t and torch.all(t == P)
        b = torch.full((2,), float(s.rank))
        bo = dist.BroadcastOptions()
        bo.rootRank = 1
        pg.broadcast([b], bo).wait()
        out = torch.empty(2 * P)
        pg.all_gather_single(out, torch.full((2,), float(s.rank))).wait()
        part = torch.empty(2)
        pg.reduce_scatter_single(part, torch.arange(2.0 * P)).wait()
        pg.barrier().wait()
        # A subgroup of ranks 0 and 2, with its own ops.
        sub = None
        if s.rank != 1:
            sub = create_process_group(options(2, s.rank // 2, [0, 2], "7"), service=s)
            u = torch.ones(3)
            sub.allreduce([u]).wait()
            assert torch.all(u == 2) and sub.size() == 2
        with pytest.raises(InvalidArgumentError, match="all_to_all"):
            pg.alltoall([], [])
        with pytest.raises(trt.UnsupportedOpError, match="any source"):
            pg.recv_anysource([torch.ones(1)], 0)
        # The group keeps the name c10d gives it (DeviceMesh and funcol find groups by name).
        pg.setGroupName("named")
        assert pg.group_name == "named"
        return b, out, part

    with local_services(P) as svcs:
        results = run_ranks(svcs, rank, timeout=60)
    for r, (b, out, part) in enumerate(results):
        assert b.tolist() == [1.0, 1.0]
        assert out.tolist() == [float(v) for v in range(P) for _ in range(2)]
        assert part.tolist() == [P * 2.0 * r, P * (2.0 * r + 1)]


def test_staging_copies_reuse_their_buffers() -> None:
    def rank(s):
        pg = create_process_group(options(2, s.rank, []), service=s)
        pg.staging.pin = False  # pinned memory needs CUDA; the reuse is the same
        out = []
        for step in range(3):
            t = torch.arange(12, dtype=torch.float64).reshape(3, 4).t() * (s.rank + step)
            assert not t.is_contiguous()  # staged through a copy
            pg.allreduce([t]).wait()
            out.append(t.clone())
        return out, pg.staging.allocated

    with local_services(2) as svcs:
        results = run_ranks(svcs, rank, timeout=60)
    for out, allocated in results:
        assert allocated == 1  # one staging buffer for three calls
        for step, t in enumerate(out):
            want = torch.arange(12, dtype=torch.float64).reshape(3, 4).t() * (1 + 2 * step)
            assert torch.equal(t, want)


def test_a_group_that_is_not_the_mpi_world_is_refused() -> None:
    with local_services(1) as (s,):
        # What torchrun gives a process with world size 2 when MPI has a world of one.
        with pytest.raises(TotalReduceError, match="torchrun"):
            create_process_group(options(2, 1, []), service=s)
        with pytest.raises(TotalReduceError, match="MPI rank 0"):
            create_process_group(options(1, 1, [0]), service=s)

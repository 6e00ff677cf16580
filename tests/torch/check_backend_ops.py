"""Run under ``mpiexec -n P``: every op of the "totalreduce" backend against gloo in one job.

The default group is ``"totalreduce"``; a ``gloo`` group over the same ranks runs
each op beside it on the same inputs, and the results must be equal exactly
(bitwise for floating types, where the reduction order may differ only sums of
integer-valued inputs are used).  Then DeviceMesh, DTensor, the functional
collectives, FSDP2 (against FSDP2 on the gloo group) and torch.distributed.checkpoint run
on the totalreduce group.
Each rank prints ``ALL OK rank R`` at the end (see test_backend_ops.py).
"""

# ruff: noqa: B023  (each closure over the loop variables runs at once, inside its iteration)

from __future__ import annotations

import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import totalreduce.torch  # noqa: F401  (registers the backend)

torch.set_num_threads(1)
warnings.filterwarnings("ignore")

R = dist.ReduceOp
FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INTS = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64]
ALL = [*FLOATS, *INTS, torch.bool]


def data(dtype: torch.dtype, rank: int, n: int = 7, salt: int = 0) -> torch.Tensor:
    """Small integer values (exact in every dtype, and sums and products of 3 stay exact)."""
    base = torch.arange(n, dtype=torch.int64) + 3 * rank + salt
    if dtype == torch.bool:
        return (base % 2) == 0
    return (base % 5 + 1).to(dtype)


def same(what: str, a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, (what, a, b)
        assert torch.equal(a, b), f"{what}: gloo {a} totalreduce {b}"
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), what
        for x, y in zip(a, b, strict=True):
            same(what, x, y)
    else:
        assert a == b, f"{what}: gloo {a!r} totalreduce {b!r}"


COUNTS = {"compared": 0, "gloo refused": 0}


def compare(what: str, fn: Callable[[Any], Any], gloo: Any, tr: Any) -> None:
    try:
        want = fn(gloo)
    except Exception:  # gloo refuses this combination: nothing to compare
        COUNTS["gloo refused"] += 1
        return
    same(what, want, fn(tr))
    COUNTS["compared"] += 1


def check_ops(rank: int, size: int, gloo: Any, tr: Any) -> None:
    ops = [R.SUM, R.PRODUCT, R.MIN, R.MAX, R.BAND, R.BOR, R.BXOR, R.AVG]
    for dt in ALL:
        for op in ops:

            def allreduce(g: Any) -> torch.Tensor:
                t = data(dt, rank)
                dist.all_reduce(t, op=op, group=g)
                return t

            def reduce(g: Any) -> torch.Tensor:
                t = data(dt, rank)
                dist.reduce(t, dst=size - 1, op=op, group=g)
                return t if rank == size - 1 else None  # elsewhere torch leaves it undefined

            compare(f"all_reduce {dt} {op}", allreduce, gloo, tr)
            compare(f"reduce {dt} {op}", reduce, gloo, tr)

        def broadcast(g: Any) -> torch.Tensor:
            t = data(dt, rank)
            dist.broadcast(t, src=1, group=g)
            return t

        def all_gather(g: Any) -> list[torch.Tensor]:
            out = [torch.zeros(7, dtype=dt) for _ in range(size)]
            dist.all_gather(out, data(dt, rank), group=g)
            return out

        def all_gather_into(g: Any) -> torch.Tensor:
            out = torch.zeros(7 * size, dtype=dt)
            dist.all_gather_into_tensor(out, data(dt, rank), group=g)
            return out

        def gather(g: Any) -> list[torch.Tensor]:
            out = [torch.zeros(7, dtype=dt) for _ in range(size)] if rank == 0 else None
            dist.gather(data(dt, rank), out, dst=0, group=g)
            return out or []

        def scatter(g: Any) -> torch.Tensor:
            out = torch.zeros(7, dtype=dt)
            parts = [data(dt, r, salt=9) for r in range(size)] if rank == size - 1 else None
            dist.scatter(out, parts, src=size - 1, group=g)
            return out

        def reduce_scatter(g: Any) -> torch.Tensor:
            out = torch.zeros(7, dtype=dt)
            dist.reduce_scatter(out, [data(dt, rank, salt=r) for r in range(size)], group=g)
            return out

        def reduce_scatter_tensor(g: Any) -> torch.Tensor:
            out = torch.zeros(7, dtype=dt)
            dist.reduce_scatter_tensor(out, data(dt, rank, n=7 * size), group=g)
            return out

        def a2a_single(g: Any) -> torch.Tensor:
            out = torch.zeros(2 * size, dtype=dt)
            dist.all_to_all_single(out, data(dt, rank, n=2 * size), group=g)
            return out

        def a2a_uneven(g: Any) -> torch.Tensor:
            # rank r sends j+1 rows of 2 to rank j; receives r+1 rows from everyone
            ins = [j + 1 for j in range(size)]
            outs = [rank + 1] * size
            x = data(dt, rank, n=2 * sum(ins)).view(-1, 2)
            out = torch.zeros(sum(outs), 2, dtype=dt)
            dist.all_to_all_single(out, x, outs, ins, group=g)
            return out

        def a2a(g: Any) -> list[torch.Tensor]:
            ins = [data(dt, rank, n=j + 1, salt=j) for j in range(size)]
            outs = [torch.zeros(rank + 1, dtype=dt) for _ in range(size)]
            dist.all_to_all(outs, ins, group=g)
            return outs

        def p2p(g: Any) -> torch.Tensor:
            got = torch.zeros(7, dtype=dt)
            peer = (rank + 1) % size
            src = (rank - 1) % size
            reqs = [
                dist.isend(data(dt, rank), dist.get_global_rank(g, peer), group=g, tag=3),
                dist.irecv(got, dist.get_global_rank(g, src), group=g, tag=3),
            ]
            for r in reqs:
                r.wait()
            if rank == 0:
                dist.send(data(dt, 5), dist.get_global_rank(g, 1), group=g)
            elif rank == 1:
                extra = torch.zeros(7, dtype=dt)
                dist.recv(extra, dist.get_global_rank(g, 0), group=g)
                got = torch.cat([got, extra])
            return got

        for fn in (
            broadcast,
            all_gather,
            all_gather_into,
            gather,
            scatter,
            reduce_scatter,
            reduce_scatter_tensor,
            a2a_single,
            a2a_uneven,
            a2a,
            p2p,
        ):
            compare(f"{fn.__name__} {dt}", fn, gloo, tr)

    def coalesced(g: Any) -> list[torch.Tensor]:
        ts = [data(torch.float32, rank, n=3), data(torch.int32, rank, n=4)]
        dist.all_reduce_coalesced(ts, group=g)
        outs = [[torch.zeros(3) for _ in range(size)], [torch.zeros(2) for _ in range(size)]]
        dist.all_gather_coalesced(outs, [data(torch.float32, rank, n=3), torch.ones(2)], group=g)
        with dist._coalescing_manager(group=g, async_ops=True) as cm:
            a, b = torch.zeros(3 * size), torch.zeros(2 * size)
            dist.all_gather_into_tensor(a, data(torch.float32, rank, n=3), group=g)
            dist.all_gather_into_tensor(b, data(torch.float32, rank, n=2), group=g)
        cm.wait()
        return [*ts, *outs[0], *outs[1], a, b]

    compare("coalesced", coalesced, gloo, tr)
    for g in (gloo, tr):
        dist.barrier(group=g)

    def objects(g: Any) -> list[Any]:
        objs = [None] * size
        dist.all_gather_object(objs, {"rank": rank, "x": "y" * rank}, group=g)
        got = [None] * size if rank == 0 else None
        dist.gather_object(("g", rank), got, dst=0, group=g)
        lst = [rank, "a"] if rank == 1 else [None, None]
        dist.broadcast_object_list(lst, src=1, group=g)
        out = [None]
        dist.scatter_object_list(
            out, [f"s{r}" for r in range(size)] if rank == 0 else None, src=0, group=g
        )
        return [objs, got, lst, out]

    compare("objects", objects, gloo, tr)


def check_timeout(rank: int, size: int, tr: Any, gloo: Any) -> None:
    """An op some rank never joins fails on the others after opts.timeout, naming the op."""
    pg = tr
    if rank == 0:
        opts = dist.AllreduceOptions()
        opts.timeout = timedelta(seconds=2)
        work = pg.allreduce([torch.ones(3)], opts)
        try:
            work.wait()
        except Exception as exc:
            assert isinstance(exc, TimeoutError), exc
            assert "all_reduce" in str(exc) and "timeout" in str(exc), exc
        else:
            raise AssertionError("an allreduce only rank 0 joined completed")
    dist.barrier(group=gloo)  # the others stay until rank 0 timed out
    tr.monitored_barrier(timedelta(seconds=60))  # everyone comes: it returns
    # The op stayed in flight: once the others join, it completes.
    if rank == 0:
        (got,) = work.get_future().wait()
    else:
        got = torch.ones(3)
        pg.allreduce([got]).wait()
    assert torch.equal(got, torch.full((3,), float(size))), got
    # torch's own dist.monitored_barrier (it refuses other backends than gloo by name) on a
    # totalreduce group: on time it returns; with a late rank, rank 0 raises naming it.
    dist.monitored_barrier(group=tr, timeout=timedelta(seconds=60))
    late = size - 1
    if rank == late:
        time.sleep(3)
    if rank == 0:
        try:
            dist.monitored_barrier(group=tr, timeout=timedelta(seconds=1))
        except RuntimeError as exc:
            assert f"group ranks [{late}] did not pass it" in str(exc), exc
        else:
            raise AssertionError("monitored_barrier passed without the late rank")
    else:
        dist.monitored_barrier(group=tr, timeout=timedelta(seconds=60))
    dist.barrier(group=gloo)


def check_mesh(rank: int, size: int) -> None:
    import torch.distributed._functional_collectives as fc
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (size,))
    assert mesh.get_group().group_name == dist.group.WORLD.group_name
    t = torch.full((3,), float(rank + 1))
    got = fc.wait_tensor(fc.all_reduce(t, "sum", mesh))
    assert torch.equal(got, torch.full((3,), float(sum(range(1, size + 1))))), got
    full = torch.arange(4.0 * size * 3).view(4 * size, 3)
    d = distribute_tensor(full, mesh, [Shard(0)])
    assert torch.equal(d.to_local(), full[4 * rank : 4 * rank + 4])
    r = d.redistribute(mesh, [Replicate()])
    assert torch.equal(r.to_local(), full)


def check_fsdp(rank: int, size: int, gloo: Any) -> None:
    """FSDP2 (fully_shard) on a totalreduce mesh trains as on a gloo mesh over the same ranks."""
    import copy

    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    template = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)
    ).double()
    x = torch.randn(6, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    params = []
    for mesh in (DeviceMesh.from_group(gloo, "cpu"), init_device_mesh("cpu", (size,))):
        m = copy.deepcopy(template)
        fully_shard(m[0], mesh=mesh)
        fully_shard(m, mesh=mesh)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for _ in range(3):
            opt.zero_grad()
            m(x).square().mean().backward()
            opt.step()
        params.append([p.full_tensor().detach() for p in m.parameters()])
    for a, b in zip(*params, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def check_dcp(rank: int, size: int) -> None:
    import torch.distributed.checkpoint as dcp

    where = [tempfile.mkdtemp(prefix="tr-dcp-") if rank == 0 else None]
    dist.broadcast_object_list(where, src=0)
    state = {"w": torch.arange(6.0) + rank, "step": torch.tensor(7)}
    dcp.save(state, checkpoint_id=where[0])
    loaded = {"w": torch.zeros(6), "step": torch.tensor(0)}
    dcp.load(loaded, checkpoint_id=where[0])
    # Replicated tensors: DCP keeps rank 0's copy.
    assert torch.equal(loaded["w"], torch.arange(6.0)), loaded
    assert int(loaded["step"]) == 7


def main() -> None:
    dist.init_process_group("totalreduce", init_method="totalreduce://")
    rank, size = dist.get_rank(), dist.get_world_size()
    tr = dist.group.WORLD
    gloo = dist.new_group(backend="gloo")
    checks = (
        sys.argv[1].split(",") if len(sys.argv) > 1 else ["ops", "mesh", "fsdp", "dcp", "timeout"]
    )
    if "ops" in checks:
        check_ops(rank, size, gloo, tr)
        assert COUNTS["compared"] > 150, COUNTS  # gloo took most combinations
        print(f"ops OK rank {rank} {COUNTS}", flush=True)
    if "mesh" in checks:
        check_mesh(rank, size)
        print(f"mesh OK rank {rank}", flush=True)
    if "fsdp" in checks:
        check_fsdp(rank, size, gloo)
        print(f"fsdp OK rank {rank}", flush=True)
    if "dcp" in checks:
        check_dcp(rank, size)
        print(f"dcp OK rank {rank}", flush=True)
    if "timeout" in checks:
        check_timeout(rank, size, tr, gloo)
        print(f"timeout OK rank {rank}", flush=True)
    print(f"ALL OK rank {rank}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

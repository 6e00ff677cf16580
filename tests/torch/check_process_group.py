"""Run under ``mpiexec -n P``: the "totalreduce" torch.distributed backend (see test_torch_mpi.py).

Usage: ``check_process_group.py CHECK[,CHECK...] [INIT_METHOD]`` with checks
``collectives`` and ``ddp``; each rank prints ``<CHECK> OK rank R`` when its
check passed.  ``INIT_METHOD`` is ``totalreduce://`` (default) or ``env://``,
for which this script sets ``RANK``, ``WORLD_SIZE`` and ``MASTER_*`` from MPI
first, as a launcher would.
"""

from __future__ import annotations

import copy
import sys
import warnings

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import totalreduce.torch as trt

torch.set_num_threads(1)
# torch 2.13 renames all_gather_into_tensor and reduce_scatter_tensor; the old names are tested.
warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")


def check_collectives(rank: int, size: int) -> None:
    for op, want in [
        (dist.ReduceOp.SUM, sum(range(1, size + 1))),
        (dist.ReduceOp.AVG, sum(range(1, size + 1)) / size),
        (dist.ReduceOp.MIN, 1),
        (dist.ReduceOp.MAX, size),
    ]:
        t = torch.full((5,), float(rank + 1), dtype=torch.float64)
        dist.all_reduce(t, op=op)
        assert torch.all(t == want), (op, t)
    works = []
    for k in range(3):  # async, several in flight, futures
        t = torch.full((4, 3), float(rank * k), dtype=torch.float32)
        works.append((t, k, dist.all_reduce(t, async_op=True)))
    futs = [w.get_future() for _, _, w in works]
    torch.futures.wait_all(futs)
    for t, k, w in works:
        w.wait()
        assert torch.all(t == k * sum(range(size))), t
    b = torch.arange(6, dtype=torch.int64) * (rank + 1)
    dist.broadcast(b, src=size - 1)
    assert b.tolist() == [v * size for v in range(6)]
    x = torch.full((2, 3), float(rank))
    outs = [torch.empty(2, 3) for _ in range(size)]
    dist.all_gather(outs, x)
    assert [o[0, 0].item() for o in outs] == list(range(size))
    into = torch.empty(2 * size, 3)
    dist.all_gather_into_tensor(into, x)
    assert torch.equal(into, torch.cat([torch.full((2, 3), float(r)) for r in range(size)]))
    big = torch.arange(4 * size, dtype=torch.float64) + rank
    part = torch.empty(4, dtype=torch.float64)
    dist.reduce_scatter_tensor(part, big)
    full = sum(torch.arange(4 * size, dtype=torch.float64) + r for r in range(size))
    assert torch.equal(part, full[4 * rank : 4 * rank + 4]), (part, full)
    dist.reduce_scatter_tensor(part, big, op=dist.ReduceOp.AVG)
    torch.testing.assert_close(part, full[4 * rank : 4 * rank + 4] / size)
    dist.barrier()
    # A subgroup of the first two ranks; the others are not members.
    sub = dist.new_group([0, 1])
    if rank < 2:
        t = torch.ones(3)
        dist.all_reduce(t, group=sub)
        assert torch.all(t == 2)
        dist.barrier(group=sub)
    # Every op gloo has runs here (check_backend_ops.py compares them with gloo); what the
    # engine refuses is refused at the call, naming the op and the dtype.
    for refused, call in [
        ("band", lambda: dist.all_reduce(torch.ones(1), op=dist.ReduceOp.BAND)),
        ("avg", lambda: dist.all_reduce(torch.ones(1, dtype=torch.bool), op=dist.ReduceOp.AVG)),
    ]:
        try:
            call()
        except Exception as exc:  # torch may wrap it; the message must name the op
            assert refused in str(exc), str(exc)
        else:
            raise AssertionError(f"{refused} did not raise")
    assert dist.get_backend() == "totalreduce"


def check_ddp(rank: int, size: int, steps: int = 20) -> None:
    """Unchanged DDP on the totalreduce backend equals DDP on gloo, in float64."""
    gloo = dist.new_group(backend="gloo")
    torch.manual_seed(7)
    template = torch.nn.Sequential(
        torch.nn.Linear(6, 16),
        torch.nn.Tanh(),
        torch.nn.Linear(16, 16),
        torch.nn.Tanh(),
        torch.nn.Linear(16, 3),
    ).double()
    g = torch.Generator().manual_seed(100 + rank)
    xs = torch.randn(steps, 8, 6, generator=g, dtype=torch.float64)
    ys = torch.randn(steps, 8, 3, generator=g, dtype=torch.float64)

    def train(group) -> np.ndarray:
        net = copy.deepcopy(template)
        if rank == 1:  # DDP's initial broadcast must fix this
            with torch.no_grad():
                for p in net.parameters():
                    p.add_(1.0)
        ddp = DDP(net, process_group=group, bucket_cap_mb=0.001)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        for k in range(steps):
            opt.zero_grad()
            torch.nn.functional.mse_loss(ddp(xs[k]), ys[k]).backward()
            opt.step()
        return torch.cat([p.detach().reshape(-1) for p in net.parameters()]).numpy()

    ours = train(None)  # the default group: the totalreduce backend
    theirs = train(gloo)
    err = float(np.max(np.abs(ours - theirs)))
    assert err < 1e-12, f"DDP on totalreduce differs from DDP on gloo by {err}"
    assert not np.array_equal(
        ours, torch.cat([p.reshape(-1) for p in template.parameters()]).detach().numpy()
    )
    everyone = [torch.empty(ours.size, dtype=torch.float64) for _ in range(size)]
    dist.all_gather(everyone, torch.from_numpy(ours))
    assert all(torch.equal(everyone[0], e) for e in everyone)


CHECKS = {"collectives": check_collectives, "ddp": check_ddp}


def set_env_from_mpi() -> None:
    import os
    import socket

    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    port = 0
    if comm.rank == 0:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
    port = comm.bcast(port, root=0)
    os.environ.update(
        RANK=str(comm.rank),
        WORLD_SIZE=str(comm.size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )


def main() -> None:
    init_method = sys.argv[2] if len(sys.argv) > 2 else "totalreduce://"
    if init_method == "env://":
        set_env_from_mpi()
        dist.init_process_group(backend="totalreduce")  # env:// is torch's default
    else:
        dist.init_process_group(backend="totalreduce", init_method=init_method)
    rank, size = dist.get_rank(), dist.get_world_size()
    assert (rank, size) == (trt.rank(), trt.size())
    for name in sys.argv[1].split(","):
        CHECKS[name](rank, size)
        print(f"{name.upper()} OK rank {rank}", flush=True)
    dist.destroy_process_group()
    trt.shutdown()


if __name__ == "__main__":
    main()

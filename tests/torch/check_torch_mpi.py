"""Run under ``mpiexec -n P``: totalreduce.torch over real MPI (see test_torch_mpi.py).

Usage: ``check_torch_mpi.py CHECK[,CHECK...]`` with checks ``layout``, ``optimizer``,
``ddp`` and ``decentralized``; each rank prints ``<CHECK> OK rank R`` when
its check passed.
"""

from __future__ import annotations

import copy
import random
import sys

import numpy as np
import torch
from mpi4py import MPI

import totalreduce.torch as trt

torch.set_num_threads(1)
STEPS = 5
BATCH = 24


class Branches(torch.nn.Module):
    """Independent branches summed; ``order`` (per rank) sets the order hooks fire in."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = torch.nn.Linear(4, 6)
        self.branches = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
            for _ in range(4)
        )
        self.order = [0, 1, 2, 3]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.stem(x))
        return torch.stack([self.branches[k](h) for k in self.order]).sum(0)


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return (
        torch.randn(BATCH, 4, generator=g, dtype=torch.float64),
        torch.randn(BATCH, 3, generator=g, dtype=torch.float64),
    )


def flat(model: torch.nn.Module) -> np.ndarray:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()


def same_everywhere(values: np.ndarray) -> bool:
    everyone = MPI.COMM_WORLD.allgather(values)
    return all(np.array_equal(everyone[0], v) for v in everyone)


def check_optimizer(rank: int, size: int) -> None:
    torch.manual_seed(0)
    template = Branches().double()
    x, y = data()
    ref = copy.deepcopy(template)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for _ in range(STEPS):
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()

    model = copy.deepcopy(template)
    if rank != 0:  # only rank 0 starts right: the broadcast must fix the others
        with torch.no_grad():
            for p in model.parameters():
                p.add_(rank)
    trt.broadcast_parameters(model.state_dict(), root=0)
    random.Random(rank).shuffle(model.order)
    opt = trt.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        named_parameters=model.named_parameters(),
    )
    trt.broadcast_optimizer_state(opt, root=0)
    m = BATCH // size
    xs, ys = x[rank * m : (rank + 1) * m], y[rank * m : (rank + 1) * m]
    for _ in range(STEPS):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(xs), ys).backward()
        opt.step()
    got = flat(model)
    assert same_everywhere(got), "parameters differ between ranks"
    err = float(np.max(np.abs(got - flat(ref))))
    assert err < 1e-10, f"max difference from single-process SGD {err}"


def check_ddp(rank: int, size: int) -> None:
    import os
    import socket

    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    port = 0
    if rank == 0:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
    port = MPI.COMM_WORLD.bcast(port, root=0)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size
    )
    try:
        torch.manual_seed(3)
        template = torch.nn.Sequential(
            torch.nn.Linear(4, 16),
            torch.nn.ReLU(),
            torch.nn.Linear(16, 16),
            torch.nn.ReLU(),
            torch.nn.Linear(16, 3),
        )
        x, y = data()
        m = BATCH // size
        xs, ys = x[rank * m : (rank + 1) * m], y[rank * m : (rank + 1) * m]

        def train(model_dtype: torch.dtype, hook, state=None) -> np.ndarray:
            net = copy.deepcopy(template).to(model_dtype)
            # Small buckets, so that a step has several and they finish in any order.
            ddp = DDP(net, bucket_cap_mb=0.0005)
            if hook is not None:
                ddp.register_comm_hook(state, hook)
            opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
            for _ in range(STEPS):
                opt.zero_grad()
                out = ddp(xs.to(model_dtype))
                torch.nn.functional.mse_loss(out, ys.to(model_dtype)).backward()
                opt.step()
            return flat(net).astype(np.float64)

        builtin = train(torch.float64, None)
        ours = train(torch.float64, trt.allreduce_hook)
        err = float(np.max(np.abs(builtin - ours)))
        assert err < 1e-12, f"allreduce_hook differs from DDP's allreduce by {err}"

        state = trt.CommHookState(prefix="fp16.")
        theirs16 = train(torch.float32, default_hooks.fp16_compress_hook, dist.group.WORLD)
        ours16 = train(torch.float32, trt.fp16_compress_hook, state)
        err16 = float(np.max(np.abs(theirs16 - ours16)))
        assert err16 < 1e-3, f"fp16_compress_hook differs from DDP's by {err16}"
        assert state.calls >= STEPS, state.calls
        assert same_everywhere(ours) and same_everywhere(ours16)
    finally:
        dist.destroy_process_group()


def check_decentralized(rank: int, size: int) -> None:
    torch.manual_seed(100 + rank)  # every rank starts elsewhere
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))
    model.double()
    start = MPI.COMM_WORLD.allgather(flat(model))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    ddp = trt.DecentralizedDataParallel(model, opt, "exp", sync_initial=False)
    steps = ddp.topology.period
    x = torch.ones(2, 3, dtype=torch.float64)
    for _ in range(steps):
        opt.zero_grad()
        ddp(x).sum().backward()
        opt.step()
    ddp.synchronize()
    got = flat(model)
    if size & (size - 1) == 0:  # one-peer exp on a power of two: exact mean after a period
        err = float(np.max(np.abs(got - np.mean(start, axis=0))))
        assert err < 1e-12, f"not the exact mean after {steps} steps: {err}"
    ddp.global_average()
    assert same_everywhere(flat(model))


def check_layout(rank: int, size: int) -> None:
    """One machine: the node is the world, and there is one node."""
    node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    want = (node.Get_rank(), node.Get_size())
    node.Free()
    assert (trt.local_rank(), trt.local_size()) == want == (rank, size)
    assert (trt.cross_rank(), trt.cross_size()) == (0, 1)


CHECKS = {
    "layout": check_layout,
    "optimizer": check_optimizer,
    "ddp": check_ddp,
    "decentralized": check_decentralized,
}


def main() -> None:
    trt.init()
    rank, size = trt.rank(), trt.size()
    for name in sys.argv[1].split(","):
        CHECKS[name](rank, size)
        print(f"{name.upper()} OK rank {rank}", flush=True)
    trt.shutdown()


if __name__ == "__main__":
    main()

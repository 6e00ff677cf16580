"""Under ``mpiexec -n P``: each rank's parameters after training with Decent-DP's API over
MPI are the ones Decent-DP's algorithm gives (decent_dp_reference.py, which every rank runs
for all P ranks in one process), in float64 to 1e-10, for each of Decent-DP's topologies;
with gradient clipping, small buckets and a scheduler.  Prints ``PARITY <topology> OK rank R``.
"""

import functools

import torch
from decent_dp_reference import Reference

from totalreduce.topology import get_topology
from totalreduce.torch.decent_dp import (
    DecentralizedDataParallel,
    initialize_dist,
    lr_scheduler_fn_cosine_with_warmup,
    optim_fn_adamw,
)

rank, world = initialize_dist()
ITERATIONS = 8
SCHED = functools.partial(lr_scheduler_fn_cosine_with_warmup, t_max=6, t_warmup=2)
w_true = torch.randn(6, 1, generator=torch.Generator().manual_seed(5), dtype=torch.float64)


def batch(r: int, it: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * it + r)
    x = torch.randn(16, 6, generator=g, dtype=torch.float64)
    return x, x @ w_true


def mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out, y)


def model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
    ).double()


for topology, local in (("complete", 0), ("ring", 0), ("one-peer-exp", 0),
                        ("alternating-exp-ring", 2)):  # fmt: skip
    options = {"local_world_size": local} if local else {}
    ours = DecentralizedDataParallel(
        model(rank), optim_fn_adamw, SCHED, topology, grad_clip_norm=0.3,
        bucket_size_in_mb=600 / 2**20, **options,
    )  # fmt: skip
    for it in range(ITERATIONS):
        x, y = batch(rank, it)
        loss = mse(ours(x), y)
        ours.zero_grad()
        loss.backward()
    got = torch.cat([p.detach().reshape(-1) for p in ours.parameters()])
    buckets = [b.names for b in ours._buckets]
    assert len(buckets) > 1, buckets

    topo = get_topology(topology, world, **({"local_size": local} if local else {}))
    ref = Reference(
        model(0), world, topo, optim_fn_adamw, lr_scheduler_fn=SCHED, buckets=buckets,
        grad_clip_norm=0.3,
    )  # fmt: skip
    for it in range(ITERATIONS):
        ref.iteration(lambda r, it=it: batch(r, it), mse)
    want = torch.cat([p.detach().reshape(-1) for p in ref.ranks[rank].model.parameters()])
    diff = (got - want).abs().max().item()
    if not diff < 1e-10:
        raise SystemExit(f"rank {rank} {topology}: parameters differ from Decent-DP's by {diff}")
    ours.global_avg(will_revert=False)
    print(f"PARITY {topology} OK rank {rank} max difference {diff:.1e}")

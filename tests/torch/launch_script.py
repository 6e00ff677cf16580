"""Launch checks (test_launch_torch.py): a torchrun-style script, and the refused launches.

``python launch_script.py torchrun_style``: reads LOCAL_RANK, RANK and WORLD_SIZE from the
environment before initialising anything (as pytorch/examples' DDP scripts do), then
``init_process_group`` with env:// on the totalreduce backend and on gloo, one DDP step,
an all_reduce: prints ``OK <rank>``.
``backend`` / ``init``: what a process launched by torchrun does (must raise).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

import totalreduce.torch as trt  # noqa: F401  (registers the backend; sets torchrun's variables)


def torchrun_style() -> None:
    local_rank = int(os.environ["LOCAL_RANK"])
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    assert int(os.environ["LOCAL_WORLD_SIZE"]) == world  # one node
    assert local_rank == rank
    backend = sys.argv[2]
    dist.init_process_group(backend=backend)  # env:// with no MASTER_ADDR: MPI answers
    assert dist.get_rank() == rank and dist.get_world_size() == world
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
    loss = model(torch.full((3, 4), float(rank + 1))).sum()
    loss.backward()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    assert t.item() == world * (world + 1) / 2, t
    dist.destroy_process_group()
    print(f"OK {rank}", flush=True)


def refused(how: str) -> None:
    if how == "backend":
        dist.init_process_group("totalreduce", init_method="totalreduce://")
    else:
        trt.init()
    print("NOT REFUSED", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "torchrun_style":
        torchrun_style()
    else:
        refused(sys.argv[1])

"""Unchanged DDP (float64) on the backend ``argv[1]``, as torchrun launches it; saves each
rank's final parameters to ``argv[2].<rank>.pt`` (test_torchrun.py).  With ``argv[3]`` =
``hook``: totalreduce's DDP comm hook, and in daemon mode a check that every bucket's
result DDP got lies in the node's arena (``ARENA OK``)."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

import totalreduce.torch  # noqa: F401  (registers the "totalreduce" backend)


def main() -> None:
    backend, out = sys.argv[1], sys.argv[2]
    dist.init_process_group(backend=backend)  # env://: torchrun's store, RANK, WORLD_SIZE
    rank, world = dist.get_rank(), dist.get_world_size()
    assert rank == int(os.environ["RANK"]) and world == int(os.environ["WORLD_SIZE"])
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)
    ).double()
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.001)
    results: list[bool] = []
    if sys.argv[3:] == ["hook"]:
        import totalreduce.torch as trt
        from totalreduce.api import default_service

        thin = default_service()._thin

        def hook(state, bucket):  # type: ignore[no-untyped-def]  (DDP reads annotations)
            def seen(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
                t = fut.value()
                results.append(thin is not None and thin.arena.offset_of(t.numpy()) >= 0)
                return t

            return trt.allreduce_hook(state, bucket).then(seen)

        ddp.register_comm_hook(trt.CommHookState(), hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(5):
        x = torch.randn(8, 16, generator=g, dtype=torch.float64)
        loss = ddp(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    if results and all(results):
        print(f"ARENA OK {rank} ({len(results)} buckets)", flush=True)
    torch.save([p.detach().clone() for p in model.parameters()], f"{out}.{rank}.pt")
    dist.destroy_process_group()
    print(f"DONE {backend} {rank} pid {os.getpid()}", flush=True)


if __name__ == "__main__":
    main()

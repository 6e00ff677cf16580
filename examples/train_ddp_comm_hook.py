"""torch DistributedDataParallel with its gradient averaging moved to totalreduce: one line.

    mpiexec -n 4 python examples/train_ddp_comm_hook.py
    mpiexec -n 4 python examples/train_ddp_comm_hook.py --hook fp16
    mpiexec -n 4 python examples/train_ddp_comm_hook.py --hook none    # DDP's own allreduce

The model is wrapped in DDP as usual (process group: gloo, initialised from
MPI's ranks); the line

    ddp.register_comm_hook(None, totalreduce.torch.allreduce_hook)

hands every gradient bucket to totalreduce, which returns DDP a future that its
engine completes.  Everything else (bucketing, overlap with backward, the
optimizer) stays DDP's.  Rank 0 prints the loss per epoch and the final test
accuracy, and draws the loss curve to a PNG.
"""

from __future__ import annotations

import argparse
import time

import torch
from gloo_world import init_gloo
from spiral import SpiralNet, accuracy, batches, plot_losses, shard, spiral
from torch.nn.parallel import DistributedDataParallel

import totalreduce.torch as trt

HOOKS = {
    "allreduce": trt.allreduce_hook,
    "fp16": trt.fp16_compress_hook,
    "bf16": trt.bfloat16_compress_hook,
    "none": None,
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=25)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--points", type=int, default=1000, help="training points per class")
    p.add_argument("--hook", choices=sorted(HOOKS), default="allreduce")
    p.add_argument(
        "--plot",
        default="ddp_comm_hook_loss.png",
        help="loss curve PNG written by rank 0 ('' draws nothing)",
    )
    return p.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)  # several ranks share this machine's cores
    trt.init()
    init_gloo()
    rank, size = trt.rank(), trt.size()
    x_all, y_all = spiral(args.points, seed=0)
    x, y = shard(x_all, y_all, rank, size)
    x_test, y_test = spiral(200, seed=1)
    torch.manual_seed(0)
    ddp = DistributedDataParallel(SpiralNet(args.hidden))
    if HOOKS[args.hook] is not None:
        ddp.register_comm_hook(None, HOOKS[args.hook])  # the one line that switches
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    if rank == 0:
        print(f"{size} ranks, DDP over gloo, comm hook: {args.hook}")
    losses = []
    for epoch in range(args.epochs):
        start, total, count = time.perf_counter(), 0.0, 0
        for xb, yb in batches(x, y, args.batch_size, epoch):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(ddp(xb), yb)
            loss.backward()  # DDP's buckets go to the hook as they fill
            opt.step()
            total, count = total + loss.item(), count + 1
        mean = float(trt.allreduce(torch.tensor([total / count]), name="epoch.loss"))
        losses.append(mean)
        if rank == 0:
            print(f"epoch {epoch + 1:3d}  loss {mean:.4f}  ({time.perf_counter() - start:.2f} s)")
    if rank == 0:
        print(f"final test accuracy {accuracy(ddp.module, x_test, y_test):.3f}")
        plot_losses(args.plot, {f"DDP, hook {args.hook}": losses}, f"spiral MLP on {size} ranks")
    torch.distributed.destroy_process_group()
    trt.shutdown()


if __name__ == "__main__":
    main()

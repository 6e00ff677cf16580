"""Data-parallel training with totalreduce's DistributedOptimizer (Horovod's meaning).

    mpiexec -n 4 python examples/train_distributed_optimizer.py
    mpiexec -n 4 python examples/train_distributed_optimizer.py --skew-ms 20 --compare

Every rank trains the same MLP on its shard of a synthetic spiral data set.  A
post-accumulate-grad hook submits each gradient the moment backward produces
it; ``step()`` waits for the averages and steps.  Rank 0 prints the loss of
every epoch and the final test accuracy, and draws the loss curve to a PNG.

``--skew-ms S`` makes rank ``r`` of ``P`` sleep ``S * r / (P - 1)`` ms in the
middle of every backward pass (a straggler).  ``--compare`` then also times,
in the same run, on the same data and model, torch DDP over gloo and a
synchronous mpi4py ``Allreduce`` of every gradient in a fixed order after
backward, and prints the median time per step of each.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
from mpi4py import MPI
from spiral import SpiralNet, accuracy, batches, plot_losses, shard, spiral

import totalreduce.torch as trt


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=25)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--points", type=int, default=1000, help="training points per class")
    p.add_argument("--skew-ms", type=float, default=0.0, help="slowest rank's backward sleep")
    p.add_argument("--compare", action="store_true", help="also time DDP/gloo and mpi4py")
    p.add_argument("--compare-steps", type=int, default=60)
    p.add_argument(
        "--plot",
        default="distributed_optimizer_loss.png",
        help="loss curve PNG written by rank 0 ('' draws nothing)",
    )
    return p.parse_args()


def make_optimizer(model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)


def train(args: argparse.Namespace, model: torch.nn.Module, x, y) -> list[float]:
    """Train with DistributedOptimizer; the per-epoch loss averaged over ranks."""
    trt.broadcast_parameters(model.state_dict(), root=0)
    opt = trt.DistributedOptimizer(
        make_optimizer(model, args.lr), named_parameters=model.named_parameters()
    )
    losses = []
    for epoch in range(args.epochs):
        start, total, count = time.perf_counter(), 0.0, 0
        for xb, yb in batches(x, y, args.batch_size, epoch):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(xb), yb)
            loss.backward()
            opt.step()
            total, count = total + loss.item(), count + 1
        mean = float(trt.allreduce(torch.tensor([total / count]), name="epoch.loss"))
        losses.append(mean)
        if trt.rank() == 0:
            print(f"epoch {epoch + 1:3d}  loss {mean:.4f}  ({time.perf_counter() - start:.2f} s)")
    opt.remove_hooks()
    return losses


# ---------------------------------------------------------------- the benchmark


def timed_steps(step: Callable[[torch.Tensor, torch.Tensor], None], x, y, args) -> np.ndarray:
    """Seconds of each of ``--compare-steps`` steps on this rank, started together."""
    times = []
    data = [b for e in range(100) for b in batches(x, y, args.batch_size, e)]
    MPI.COMM_WORLD.Barrier()
    for xb, yb in data[: args.compare_steps]:
        t0 = time.perf_counter()
        step(xb, yb)
        times.append(time.perf_counter() - t0)
    return np.array(times)


def compare(args: argparse.Namespace, template: torch.nn.Module, x, y) -> None:
    from gloo_world import init_gloo
    from torch.nn.parallel import DistributedDataParallel

    comm = MPI.COMM_WORLD
    loss_fn = torch.nn.functional.cross_entropy

    model = copy.deepcopy(template)
    opt = trt.DistributedOptimizer(
        make_optimizer(model, args.lr), named_parameters=model.named_parameters(), prefix="cmp."
    )

    def totalreduce_step(xb, yb):
        opt.zero_grad()
        loss_fn(model(xb), yb).backward()
        opt.step()

    init_gloo()
    ddp = DistributedDataParallel(copy.deepcopy(template))
    ddp_opt = make_optimizer(ddp, args.lr)

    def ddp_step(xb, yb):
        ddp_opt.zero_grad()
        loss_fn(ddp(xb), yb).backward()
        ddp_opt.step()

    plain = copy.deepcopy(template)
    plain_opt = make_optimizer(plain, args.lr)

    def mpi4py_step(xb, yb):
        plain_opt.zero_grad()
        loss_fn(plain(xb), yb).backward()
        for p in plain.parameters():  # after backward, one at a time, in a fixed order
            comm.Allreduce(MPI.IN_PLACE, p.grad.numpy(), op=MPI.SUM)
            p.grad.div_(comm.size)
        plain_opt.step()

    methods = {
        "totalreduce DistributedOptimizer": totalreduce_step,
        "torch DDP over gloo": ddp_step,
        "mpi4py Allreduce after backward": mpi4py_step,
    }
    medians = {}
    warmup = 5
    for label, step in methods.items():
        mine = timed_steps(step, x, y, args)
        everyone = comm.gather(mine, root=0)
        if comm.rank == 0:
            slowest = np.max(np.stack(everyone), axis=0)[warmup:]
            medians[label] = statistics.median(slowest.tolist())
    torch.distributed.destroy_process_group()
    if comm.rank == 0:
        base = medians["totalreduce DistributedOptimizer"]
        print(
            f"\nbenchmark: {comm.size} ranks, skew {args.skew_ms:g} ms, "
            f"{args.compare_steps - warmup} timed steps each, median s/step (slowest rank):"
        )
        for label, value in medians.items():
            ratio = "" if value is base else f"   {value / base:.2f}x totalreduce"
            print(f"  {label:34s} {value:.4f}{ratio}")


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)  # several ranks share this machine's cores
    trt.init()
    rank, size = trt.rank(), trt.size()
    delay = args.skew_ms / 1000.0 * rank / max(1, size - 1)
    x_all, y_all = spiral(args.points, seed=0)
    x, y = shard(x_all, y_all, rank, size)
    x_test, y_test = spiral(200, seed=1)
    torch.manual_seed(0)
    template = SpiralNet(args.hidden, delay_s=delay)
    if rank == 0:
        print(
            f"{size} ranks, {len(y)} spiral points each, batch {args.batch_size}, "
            f"{args.epochs} epochs"
        )
    model = copy.deepcopy(template)
    losses = train(args, model, x, y)
    if rank == 0:
        print(f"final test accuracy {accuracy(model, x_test, y_test):.3f}")
        plot_losses(args.plot, {"DistributedOptimizer": losses}, f"spiral MLP on {size} ranks")
    if args.compare:
        compare(args, template, x, y)
    trt.shutdown()


if __name__ == "__main__":
    main()

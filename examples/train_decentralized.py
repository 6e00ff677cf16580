"""Decentralized training with DecentralizedDataParallel (Decent-DP's scheme).

    mpiexec -n 4 python examples/train_decentralized.py
    mpiexec -n 4 python examples/train_decentralized.py --topology ring

No gradient is reduced: every rank steps on its own gradient, then averages its
parameters with the step's neighbors in the topology while the next forward
pass begins.  The ranks' models therefore differ a little; the script prints
the mean loss and the consensus distance (how far the ranks' parameters are
from their mean) per epoch, then makes every rank hold the global mean with
``global_average()`` and reports its test accuracy.  Rank 0 draws every rank's
loss curve to a PNG.

The default ``alternating-exp-ring`` with ``--local-size 2`` treats the ranks
as nodes of 2: in each round of two steps a node averages once within itself
and once together with one peer node (Decent-DP's schedule).  The same
training in Decent-DP's own API is ``totalreduce.torch.decent_dp``.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
from spiral import SpiralNet, accuracy, batches, plot_losses, shard, spiral

import totalreduce.torch as trt
from totalreduce.topology import rho_period


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=25)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--points", type=int, default=1000, help="training points per class")
    p.add_argument("--topology", default="alternating-exp-ring")
    p.add_argument("--local-size", type=int, default=2, help="ranks per (pretend) node")
    p.add_argument(
        "--plot",
        default="decentralized_loss.png",
        help="loss curve PNG written by rank 0 ('' draws nothing)",
    )
    return p.parse_args()


def consensus_distance(model: torch.nn.Module) -> float:
    """sqrt(mean over ranks of |x_r - mean x|^2): 0 when every rank holds the same model."""
    mine = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    mean = trt.allreduce(mine, name="consensus.mean")
    sq = trt.allreduce(torch.tensor([float((mine - mean).square().sum())]), name="consensus.sq")
    return float(sq) ** 0.5


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)  # several ranks share this machine's cores
    trt.init()
    rank, size = trt.rank(), trt.size()
    x_all, y_all = spiral(args.points, seed=0)
    x, y = shard(x_all, y_all, rank, size)
    x_test, y_test = spiral(200, seed=1)
    torch.manual_seed(0)
    model = SpiralNet(args.hidden)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    local = args.local_size if args.topology == "alternating-exp-ring" else None
    ddp = trt.DecentralizedDataParallel(model, opt, topology=args.topology, local_size=local)
    if rank == 0:
        print(
            f"{size} ranks, {ddp.topology.describe()}, period {ddp.topology.period}, "
            f"rho per period {rho_period(ddp.topology):.3f}"
        )
    curves: list[list[float]] = [[] for _ in range(size)]
    for epoch in range(args.epochs):
        start, total, count = time.perf_counter(), 0.0, 0
        for xb, yb in batches(x, y, args.batch_size, epoch):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(ddp(xb), yb)
            loss.backward()
            opt.step()  # a local step, then the neighbor averaging starts
            total, count = total + loss.item(), count + 1
        ddp.synchronize()
        per_rank = trt.allgather(torch.tensor([total / count]), name="epoch.loss")
        distance = consensus_distance(model)
        for r in range(size):
            curves[r].append(float(per_rank[r]))
        if rank == 0:
            print(
                f"epoch {epoch + 1:3d}  loss {float(per_rank.mean()):.4f}  "
                f"consensus distance {distance:.2e}  ({time.perf_counter() - start:.2f} s)"
            )
    local_acc = accuracy(copy.deepcopy(model), x_test, y_test)
    ddp.global_average()
    acc = accuracy(model, x_test, y_test)
    accs = trt.allgather(torch.tensor([local_acc]), name="local.accuracy")
    if rank == 0:
        shown = " ".join(f"{float(a):.3f}" for a in accs)
        print(f"test accuracy per rank before averaging: {shown}")
        print(f"final test accuracy of the global average {acc:.3f}")
        plot_losses(
            args.plot,
            {f"rank {r}": c for r, c in enumerate(curves)},
            f"decentralized ({args.topology}) on {size} ranks",
        )
    ddp.remove_hooks()
    trt.shutdown()


if __name__ == "__main__":
    main()

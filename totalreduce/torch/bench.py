"""Benchmark: data-parallel training of a ResNet on synthetic data, three ways in one run.

Run with ``mpiexec -n P python -m totalreduce.torch.bench`` (or ``totalreduce
bench --torch``).  Every rank trains ResNet-18 (``--model resnet50`` for the
larger one; torchvision's when installed, else :mod:`totalreduce.torch.resnet`
with the same parameter tensors) on random images and labels, with SGD, in:

- ``totalreduce DistributedOptimizer``: totalreduce's optimizer wrapper
  (``--fusion-bytes`` may list several bucket caps, each a row);
- ``DDP over gloo``: ``DistributedDataParallel`` on a gloo group;
- ``DDP over totalreduce``: the same DDP on the ``"totalreduce"`` backend;
- ``compute only``: the same steps with plain SGD and no gradient exchange at all
  (``local``): the ceiling any of the others can reach on this machine, since every rank
  still computes its whole step.

The methods alternate round by round (``--rounds`` rounds of ``--steps``
steps, after one warm-up round each; each round starts with the next method),
so all see the same machine state.  A
round's time is the slowest rank's; the figure printed is the median round's
samples per second over all ranks, and ``vs first`` its ratio to the first
row's (above 1 is faster).

Benchmarks are not tests: nothing here asserts a figure.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

import totalreduce.torch as trt

from .resnet import resnet


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="totalreduce bench --torch", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--model", choices=["resnet18", "resnet50"], default="resnet18")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--batch-size", type=int, default=8, help="per rank")
    p.add_argument("--image-size", type=int, default=32, help="height and width of the images")
    p.add_argument("--steps", type=int, default=5, help="steps per round")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds per method")
    p.add_argument(
        "--fusion-bytes",
        default=None,
        help="DistributedOptimizer bucket caps, comma-separated (default: its default)",
    )
    p.add_argument(
        "--methods",
        default="totalreduce,gloo,ddp-totalreduce,local",
        help=(
            "which of totalreduce, gloo, ddp-totalreduce and local (compute only, no "
            "gradient exchange: the ceiling) to run, comma-separated"
        ),
    )
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    return p.parse_args(argv)


Step = Callable[[torch.Tensor, torch.Tensor], None]


def _device(args: argparse.Namespace) -> torch.device:
    if args.device == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch.cuda.is_available() is false on this machine")
    device = torch.device("cuda", trt.local_rank() % torch.cuda.device_count())
    torch.cuda.set_device(device)  # streams, events and DDP's buffers default to it
    return device


def _methods(args: argparse.Namespace, template: torch.nn.Module) -> dict[str, Step]:
    from .optimizer import DEFAULT_FUSION_BYTES

    loss_fn = torch.nn.CrossEntropyLoss()
    out: dict[str, Step] = {}
    wanted = [m.strip() for m in args.methods.split(",") if m.strip()]
    fusions = (
        [int(float(v)) for v in args.fusion_bytes.split(",")]
        if args.fusion_bytes
        else [DEFAULT_FUSION_BYTES]
    )
    for method in wanted:
        if method == "totalreduce":
            for fb in fusions:
                model = copy.deepcopy(template)
                opt = trt.DistributedOptimizer(
                    torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                    named_parameters=model.named_parameters(),
                    fusion_bytes=fb,
                    prefix=f"bench.{fb}.",
                )
                label = "totalreduce DistributedOptimizer"
                if len(fusions) > 1 or args.fusion_bytes:
                    label += f" (fusion {fb / 2**20:g} MiB)"
                out[label] = _stepper(model, opt, loss_fn)
        elif method in ("gloo", "ddp-totalreduce"):
            group = dist.new_group(backend="gloo") if method == "gloo" else None
            model = copy.deepcopy(template)
            ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=group)
            opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
            label = "DDP over gloo" if method == "gloo" else "DDP over totalreduce"
            out[label] = _stepper(ddp, opt, loss_fn)
        elif method == "local":
            model = copy.deepcopy(template)
            opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
            out["compute only (no exchange)"] = _stepper(model, opt, loss_fn)
        else:
            raise SystemExit(
                f"unknown method {method!r}; known: totalreduce, gloo, ddp-totalreduce, local"
            )
    return out


def _stepper(model: torch.nn.Module, opt: torch.optim.Optimizer, loss_fn: Callable) -> Step:
    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()

    return step


def _round(step: Step, x: torch.Tensor, y: torch.Tensor, steps: int, device: torch.device) -> float:
    """Seconds for ``steps`` steps on the slowest rank."""
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step(x, y)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    mine = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    return float(mine[0])


def main(argv: list[str] | None = None) -> int:
    """``totalreduce bench --torch [options]``; run it under ``mpiexec -n P``."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    dist.init_process_group(backend="totalreduce", init_method="totalreduce://")
    try:
        rank, size = dist.get_rank(), dist.get_world_size()
        device = _device(args)
        torch.manual_seed(0)
        template = resnet(args.model, num_classes=10).to(device)
        n_params = len(list(template.parameters()))
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(args.batch_size, 3, args.image_size, args.image_size, generator=g)
        y = torch.randint(0, 10, (args.batch_size,), generator=g)
        x, y = x.to(device), y.to(device)
        methods = _methods(args, template)
        times: dict[str, list[float]] = {m: [] for m in methods}
        names = list(methods)
        for r in range(args.rounds + 1):
            warm = r == 0
            # Each round starts with another method, so none always runs right after
            # the barrier or right after the same neighbour.
            for name in names[r % len(names) :] + names[: r % len(names)]:
                t = _round(methods[name], x, y, 1 if warm else args.steps, device)
                if not warm:
                    times[name].append(t)
        if rank == 0:
            samples = args.steps * args.batch_size * size
            rates = {m: samples / statistics.median(ts) for m, ts in times.items()}
            first = next(iter(rates.values()))
            source = type(template).__module__.split(".")[0]
            print(
                f"# totalreduce bench --torch: {args.model} ({n_params} parameter tensors, "
                f"from {source}), P={size}, device {args.device}, batch {args.batch_size}/rank, "
                f"{args.image_size}x{args.image_size} images, {args.threads} thread(s)/rank"
            )
            print(
                f"# median of {args.rounds} rounds of {args.steps} steps, methods alternating "
                "(each round starting with the next); a round is timed on its slowest rank"
            )
            print(f"{'method':<48} {'samples/s':>10} {'vs first':>9}")
            for m, r in rates.items():
                print(f"{m:<48} {r:>10.2f} {r / first:>9.2f}")
            sys.stdout.flush()
    finally:
        dist.destroy_process_group()
        trt.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())

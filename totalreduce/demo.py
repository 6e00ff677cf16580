"""The main demo: per-layer gradients submitted in different orders with priorities.

Run it with ``mpiexec -n 4 python -m totalreduce.demo`` (or ``totalreduce demo``).
Every rank plays a training step of an 8-layer model: its backward pass makes
the gradients ready in its own order (a rank-dependent shuffle of the
last-layer-first order, with a little per-rank compute skew), it submits each
gradient the moment it is ready with a priority that favours layers near the
input, and then waits for them in the order the next forward pass needs them.
Rank 0 prints, per op, the order each rank submitted it in and whether the
result equals the expected sum on every rank.  Exit status 0 means every
result on every rank was exact.
"""

from __future__ import annotations

import argparse
import random
import sys
import time

import numpy as np

import totalreduce as tr
from totalreduce.launch import mpi_launch

LAYERS = [
    ("embed.grad", 65536),
    ("conv1.grad", 4096),
    ("conv2.grad", 262144),
    ("conv3.grad", 1 << 20),
    ("fc1.grad", 200003),
    ("fc2.grad", 4099),
    ("fc3.grad", 100),
    ("out.bias.grad", 10),
]


def gradient(layer: int, n: int, rank: int, step: int) -> np.ndarray:
    """Position-dependent values whose sums are exact in float32."""
    idx = np.arange(n, dtype=np.int64)
    return ((idx % 101) + 7 * layer + rank + step).astype(np.float32)


def expected(layer: int, n: int, size: int, step: int) -> np.ndarray:
    idx = np.arange(n, dtype=np.int64)
    total = size * ((idx % 101) + 7 * layer + step) + size * (size - 1) // 2
    return total.astype(np.float32)


def run(steps: int, skew_ms: float) -> int:
    launch = mpi_launch()
    if launch is None or launch.rank == 0:  # before init(), which may compile for a minute
        ranks = f"{launch.size} ranks" if launch else "1 rank (start it with mpiexec -n 4)"
        print(
            f"demo: {ranks}, {steps} steps of {len(LAYERS)} allreduces in different orders; "
            "the first run of an installation compiles the engine once (about half a minute), "
            "later runs start in seconds",
            flush=True,
        )
    tr.init()
    rank, size = tr.rank(), tr.size()
    n_layers = len(LAYERS)
    ok_all = True
    for step in range(steps):
        rng = random.Random(1000 * step + rank)
        order = list(reversed(range(n_layers)))  # backward: last layer first
        rng.shuffle(order)  # ...but every rank finishes layers in its own order
        t0 = time.perf_counter()
        handles = {}
        for position, layer in enumerate(order):
            time.sleep(rng.random() * skew_ms / 1000 * (1 + rank))  # compute skew
            name, n = LAYERS[layer]
            grad = gradient(layer, n, rank, step)
            handles[layer] = (
                position,
                tr.allreduce_async(grad, name=name, priority=n_layers - layer),
            )
        results = {}
        for layer in range(n_layers):  # the next forward pass needs layer 0 first
            position, h = handles[layer]
            got = h.wait(timeout=120)
            results[layer] = (
                position,
                bool(np.array_equal(got, expected(layer, LAYERS[layer][1], size, step))),
            )
        elapsed = time.perf_counter() - t0
        # Gather every rank's submission order and verdicts (with totalreduce itself).
        table = np.zeros((2, size, n_layers), dtype=np.int64)
        for layer, (position, ok) in results.items():
            table[0, rank, layer] = position
            table[1, rank, layer] = int(ok)
        table = tr.allreduce(table, name="demo.table")
        step_ok = bool(table[1].all())
        ok_all &= step_ok
        if rank == 0:
            print(f"step {step}: {size} ranks, {n_layers} ops, {elapsed * 1e3:.1f} ms")
            print(
                f"  {'op':<16}{'elements':>10}{'priority':>10}  submit position per rank   result"
            )
            for layer, (name, n) in enumerate(LAYERS):
                positions = " ".join(f"{p:2d}" for p in table[0, :, layer])
                verdict = "ok on all ranks" if table[1, :, layer].all() else "WRONG"
                print(f"  {name:<16}{n:>10}{n_layers - layer:>10}  [{positions:<24}]  {verdict}")
    tr.shutdown()
    if rank == 0:
        word = "exact on every rank" if ok_all else "WRONG on some rank"
        print(f"demo: {steps} steps x {n_layers} allreduces on {size} ranks: {word}")
    return 0 if ok_all else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="totalreduce demo", description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--skew-ms", type=float, default=2.0, help="per-layer compute skew scale")
    args = ap.parse_args(argv)
    return run(args.steps, args.skew_ms)


if __name__ == "__main__":
    sys.exit(main())

"""Trace a few training steps with the timeline recorder and draw them: one row per rank.

Run it with ``mpiexec -n 2 python examples/timeline_step.py``. Each rank plays the backward pass
of an 8-layer model: the gradients become ready last layer first, after some arithmetic per
layer, and each is submitted the moment it is ready, with a priority that favours the layers the
next forward pass needs first. Then the rank waits for them in forward order. The script records
each op's submission, its completion (a callback of its handle) and the waits of the training
thread into a :class:`totalreduce.timeline.Timeline` per rank; rank 0 merges the ranks' files
and draws the PNG (``--plot ''`` draws nothing). Open the merged JSON in Perfetto
(ui.perfetto.dev) or chrome://tracing to see every track.

This traces from the outside, through the public API. The engine's own recording
(``TOTALREDUCE_TIMELINE=PATH``) adds the segments on the wire and the reductions.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import totalreduce as tr
from totalreduce.timeline import Timeline, merge, timeline_path, write

LAYERS = [  # (name, float32 elements), input side first
    ("embed", 1 << 18),
    ("conv1", 1 << 12),
    ("conv2", 1 << 16),
    ("conv3", 1 << 20),
    ("fc1", 1 << 18),
    ("fc2", 1 << 12),
    ("fc3", 1 << 8),
    ("out", 16),
]


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3, help="training steps to trace")
    p.add_argument(
        "--warmup", type=int, default=1, help="steps before tracing (the first compiles kernels)"
    )
    p.add_argument("--trace", default="timeline_step", help="trace files: TRACE.<rank>.json")
    p.add_argument(
        "--plot", default="timeline_step.png", help="the picture rank 0 draws ('' draws nothing)"
    )
    return p.parse_args(argv)


def backward_work(n: int, rng: np.random.Generator) -> None:
    """Arithmetic standing in for one layer's backward pass, in proportion to its size."""
    a = rng.standard_normal((64, 64))
    for _ in range(1 + n // (1 << 16)):
        a = np.tanh(a @ a.T / 64)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    tr.init()
    rank, size = tr.rank(), tr.size()
    tl = Timeline(args.trace, rank)
    rng = np.random.default_rng(rank)
    grads = {name: np.ones(n, dtype=np.float32) for name, n in LAYERS}
    for step in range(args.warmup + args.steps):
        traced = step >= args.warmup  # a name's generation is the step: one op per step
        handles = {}
        for k in reversed(range(len(LAYERS))):  # backward: the output layer first
            name, n = LAYERS[k]
            backward_work(n, rng)
            priority = len(LAYERS) - k  # the input side is needed first: highest priority
            if traced:
                tl.op(name, step, "submitted", priority)
            h = tr.allreduce_async(grads[name], name=name, op="avg", priority=priority)
            if traced:
                h.add_done_callback(
                    lambda h, name=name, p=priority: tl.op(name, h.generation, "done", p)
                )
            handles[name] = h
        for name, _ in LAYERS:  # the next forward pass needs them input side first
            t0 = time.perf_counter_ns()
            handles[name].wait()
            if traced:
                tl.wait(name, step, t0, time.perf_counter_ns())
    tl.close()
    tr.barrier()  # every rank's file is complete
    if rank == 0:
        files = [timeline_path(args.trace, r) for r in range(size)]
        merged = f"{args.trace}.json"
        write(merged, merge(files))
        print(f"wrote {merged}: open it in Perfetto or chrome://tracing")
        if args.plot:
            from totalreduce.timeline.plot import plot

            title = f"{args.steps} steps of 8 layers on {size} ranks, priority: input side first"
            plot(merge(files), args.plot, title)
            print(f"wrote {args.plot}")
    tr.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())

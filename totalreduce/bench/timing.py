"""Timing under MPI: implementations alternated iteration by iteration, slowest rank counted.

Every iteration runs each timed call once, in turn, after a barrier, so all of
them see the same machine state (this matters on a shared machine, where a
run can vary by 2x).  The order is shuffled every iteration, the same way on
every rank: a call made within a few milliseconds of totalreduce's ops runs
while the service thread is still winding down its polling (on two cores it
can cost an MPI call of a few µs tens of µs), and shuffling makes every
implementation pay that alike instead of whichever follows the last one.  An iteration's time is the
slowest rank's; the figures kept are the median, mean, minimum and maximum
over the timed iterations.

The garbage collector is off while calls are timed (after one full collection),
as ``timeit`` does: a full pass in a process that has loaded Numba's code takes
about 50 ms on the 2-core machine, longer than most of the calls timed, and where
it falls depends on what the process made before, not on the call it lands in.
"""

from __future__ import annotations

import gc
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


def _nothing() -> None:
    return None


@dataclass
class Timed:
    """A call to time, and what to do (untimed) before each call, such as restoring the input."""

    run: Callable[[], object]
    reset: Callable[[], object] = _nothing


@dataclass(frozen=True)
class Stats:
    """Seconds per call over the timed iterations (each the slowest rank's)."""

    median: float
    mean: float
    min: float
    max: float

    @classmethod
    def of(cls, samples: list[float]) -> Stats:
        return cls(
            statistics.median(samples), statistics.fmean(samples), min(samples), max(samples)
        )


def iterations_for(nbytes: int) -> int:
    """A default iteration count: many for small buffers, few for large ones."""
    if nbytes <= 64 << 10:
        return 200
    if nbytes <= 1 << 20:
        return 60
    if nbytes <= 8 << 20:
        return 20
    return 7


def time_alternating(
    comm: Any, calls: dict[str, Timed], iters: int, warmup: int = 2
) -> dict[str, Stats]:
    """Time every call ``warmup + iters`` times, alternating them; the warm-up is dropped."""
    from mpi4py import MPI

    samples: dict[str, list[float]] = {k: [] for k in calls}
    order = list(calls.items())
    collecting = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        for i in range(warmup + max(1, iters)):
            random.Random(i).shuffle(order)  # seeded by the iteration: the same on every rank
            for key, call in order:
                call.reset()
                comm.Barrier()
                t0 = time.perf_counter()
                call.run()
                dt = time.perf_counter() - t0
                worst = comm.allreduce(dt, op=MPI.MAX)
                if i >= warmup:
                    samples[key].append(worst)
    finally:
        if collecting:
            gc.enable()
    return {k: Stats.of(v) for k, v in samples.items()}


def idle_cpu(seconds: float) -> float:
    """Percent of one core this process uses over ``seconds`` of sleep (the service idling)."""
    c0, t0 = time.process_time(), time.perf_counter()
    time.sleep(seconds)
    return 100.0 * (time.process_time() - c0) / (time.perf_counter() - t0)

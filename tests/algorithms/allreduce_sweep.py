"""The sweep every allreduce schedule goes through in the simulator (Gloo's test matrix).

Shared by the allreduce algorithm tests: process counts, element counts that
leave chunks empty, position-dependent int64 values, exact expected results.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from totalreduce.algorithms.schedule import Schedule
from totalreduce.algorithms.simulator import simulate

#: 1..16 plus the larger process counts Gloo's halving-doubling tests use.
SIZES = sorted(set(range(1, 17)) | {24, 32})

Algorithm = Callable[..., Schedule]


def counts_for(p: int) -> list[int]:
    if p > 16:
        return sorted({0, p + 1, 1000})
    return sorted({0, 1, max(p - 1, 0), p, p + 1, 1000, 12345})


def inputs(p: int, n: int) -> list[np.ndarray]:
    index = np.arange(n, dtype=np.int64)
    return [index * p + r for r in range(p)]


def check_sum_exact(
    algorithm: Algorithm,
    p: int,
    in_place: bool,
    counts: list[int] | None = None,
    **options: object,
) -> None:
    """Every count (default :func:`counts_for`): every rank ends with the exact sum."""
    for n in counts_for(p) if counts is None else counts:
        want = np.arange(n, dtype=np.int64) * p * p + p * (p - 1) // 2
        schedules = [algorithm(r, p, n, **options) for r in range(p)]
        outs = simulate(
            schedules, inputs(p, n), segment_elems=97, in_place=in_place, seed=p * 7 + n
        )
        for r, out in enumerate(outs):
            np.testing.assert_array_equal(out, want, err_msg=f"P={p} {options} n={n} rank={r}")


def check_other_op(algorithm: Algorithm, p: int, op: str, **options: object) -> None:
    """max, min and avg (floor division on integers) on random int64 data."""
    n = 1001
    rng = np.random.default_rng(p)
    xs = [rng.integers(-1000, 1000, n).astype(np.int64) for _ in range(p)]
    stack = np.stack(xs)
    want = {"max": stack.max(axis=0), "min": stack.min(axis=0), "avg": stack.sum(axis=0) // p}[op]
    schedules = [algorithm(r, p, n, average=op == "avg", **options) for r in range(p)]
    for out in simulate(schedules, xs, op=op, segment_elems=50, seed=p):
        np.testing.assert_array_equal(out, want)

"""Ring allreduce proven by the simulator: Gloo's sweep of sizes and counts."""

from __future__ import annotations

import numpy as np
import pytest

from totalreduce.algorithms import allreduce_ring
from totalreduce.algorithms.simulator import simulate


def counts_for(p: int) -> list[int]:
    return sorted({0, 1, max(p - 1, 0), p, p + 1, 1000, 12345})


def inputs(p: int, n: int) -> list[np.ndarray]:
    index = np.arange(n, dtype=np.int64)
    return [index * p + r for r in range(p)]


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("p", range(1, 17))
def test_ring_sum_exact(p: int, in_place: bool) -> None:
    for n in counts_for(p):
        xs = inputs(p, n)
        want = np.arange(n, dtype=np.int64) * p * p + p * (p - 1) // 2
        schedules = [allreduce_ring(r, p, n) for r in range(p)]
        # Segments small enough that big counts pipeline over many frames.
        outs = simulate(schedules, xs, segment_elems=97, in_place=in_place, seed=p * 7 + n)
        for r, out in enumerate(outs):
            np.testing.assert_array_equal(out, want, err_msg=f"P={p} n={n} rank={r}")


@pytest.mark.parametrize("p", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("op", ["max", "min", "avg"])
def test_ring_other_ops(p: int, op: str) -> None:
    n = 1001
    rng = np.random.default_rng(p)
    xs = [rng.integers(-1000, 1000, n).astype(np.int64) for _ in range(p)]
    ref = {"max": np.max, "min": np.min, "avg": lambda a, axis: np.sum(a, axis=axis) // p}[op]
    want = ref(np.stack(xs), axis=0)
    schedules = [allreduce_ring(r, p, n, average=op == "avg") for r in range(p)]
    for out in simulate(schedules, xs, op=op, segment_elems=50, seed=p):
        np.testing.assert_array_equal(out, want)


def test_ring_bytes_on_the_wire() -> None:
    p, n = 4, 1000
    s = allreduce_ring(0, p, n)
    assert len(s.steps) == 2 * (p - 1)
    assert s.bytes_sent(8) == 8 * 2 * (p - 1) * n // p

"""Ring chunked allreduce proven by the simulator: Gloo's sweep of sizes and counts."""

from __future__ import annotations

import numpy as np
import pytest

from totalreduce.algorithms.ring_chunked import allreduce_ring_chunked
from totalreduce.algorithms.simulator import simulate

SIZES = sorted(set(range(1, 17)) | {24, 32})


def counts_for(p: int) -> list[int]:
    if p > 16:
        return sorted({0, p + 1, 1000})
    return sorted({0, 1, max(p - 1, 0), p + 1, 1000, 12345})


def inputs(p: int, n: int) -> list[np.ndarray]:
    index = np.arange(n, dtype=np.int64)
    return [index * p + r for r in range(p)]


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("p", SIZES)
def test_ring_chunked_sum_exact(p: int, in_place: bool) -> None:
    for n in counts_for(p):
        want = np.arange(n, dtype=np.int64) * p * p + p * (p - 1) // 2
        schedules = [allreduce_ring_chunked(r, p, n) for r in range(p)]
        outs = simulate(
            schedules, inputs(p, n), segment_elems=97, in_place=in_place, seed=p * 7 + n
        )
        for r, out in enumerate(outs):
            np.testing.assert_array_equal(out, want, err_msg=f"P={p} n={n} rank={r}")


@pytest.mark.parametrize("p", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("op", ["max", "min", "avg"])
def test_ring_chunked_other_ops(p: int, op: str) -> None:
    n = 1001
    rng = np.random.default_rng(p)
    xs = [rng.integers(-1000, 1000, n).astype(np.int64) for _ in range(p)]
    ref = {"max": np.max, "min": np.min, "avg": lambda a, axis: np.sum(a, axis=axis) // p}[op]
    want = ref(np.stack(xs), axis=0)
    schedules = [allreduce_ring_chunked(r, p, n, average=op == "avg") for r in range(p)]
    for out in simulate(schedules, xs, op=op, segment_elems=50, seed=p):
        np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("p", [2, 3, 4, 8, 16])
def test_ring_chunked_steps_and_bytes(p: int) -> None:
    n = 2 * p * 125  # divisible into 2P equal chunks
    for r in range(p):
        s = allreduce_ring_chunked(r, p, n)
        assert len(s.steps) == 4 * (p - 1)
        assert s.bytes_sent(8) == 8 * 2 * (p - 1) * n // p
        # Two chunks per ring round, each S / 2P.
        assert all(st.sends[0].region.count == n // (2 * p) for st in s.steps)


def test_ring_chunked_consecutive_steps_move_the_two_chunks_of_a_pair() -> None:
    p, n = 4, 80
    s = allreduce_ring_chunked(1, p, n)
    first, second = s.steps[0].sends[0].region, s.steps[1].sends[0].region
    assert second.offset == first.end  # chunks 2c and 2c + 1 are adjacent


def test_ring_chunked_one_rank_has_no_steps() -> None:
    s = allreduce_ring_chunked(0, 1, 10)
    assert s.steps == () and s.bytes_sent(8) == 0

"""Halving-doubling allreduce (binary blocks off powers of two) proven by the simulator."""

from __future__ import annotations

import numpy as np
import pytest

from totalreduce.algorithms.halving_doubling import (
    allreduce_halving_doubling,
    binary_blocks,
)
from totalreduce.algorithms.simulator import simulate

# 1..16 plus the process counts Gloo's halving-doubling tests use.
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
def test_halving_doubling_sum_exact(p: int, in_place: bool) -> None:
    for n in counts_for(p):
        want = np.arange(n, dtype=np.int64) * p * p + p * (p - 1) // 2
        schedules = [allreduce_halving_doubling(r, p, n) for r in range(p)]
        outs = simulate(
            schedules, inputs(p, n), segment_elems=97, in_place=in_place, seed=p * 7 + n
        )
        for r, out in enumerate(outs):
            np.testing.assert_array_equal(out, want, err_msg=f"P={p} n={n} rank={r}")


@pytest.mark.parametrize("p", [1, 2, 3, 6, 8, 13])
@pytest.mark.parametrize("op", ["max", "min", "avg"])
def test_halving_doubling_other_ops(p: int, op: str) -> None:
    n = 1001
    rng = np.random.default_rng(p)
    xs = [rng.integers(-1000, 1000, n).astype(np.int64) for _ in range(p)]
    ref = {"max": np.max, "min": np.min, "avg": lambda a, axis: np.sum(a, axis=axis) // p}[op]
    want = ref(np.stack(xs), axis=0)
    schedules = [allreduce_halving_doubling(r, p, n, average=op == "avg") for r in range(p)]
    for out in simulate(schedules, xs, op=op, segment_elems=50, seed=p):
        np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("p", [1, 2, 4, 8, 16, 32])
def test_halving_doubling_power_of_two_steps_and_bytes(p: int) -> None:
    n = p * 125
    lg = p.bit_length() - 1
    for r in range(p):
        s = allreduce_halving_doubling(r, p, n)
        assert len(s.steps) == 2 * lg
        assert s.bytes_sent(8) == 8 * 2 * (p - 1) * n // p
        # Distance doubles in the reduce-scatter, halves in the all-gather.
        peers = [st.sends[0].peer for st in s.steps]
        assert peers == [r ^ (1 << i) for i in range(lg)] + [
            r ^ (1 << i) for i in reversed(range(lg))
        ]
        # The data halves, then doubles.
        sizes = [st.sends[0].region.count for st in s.steps]
        assert sizes == [n >> (i + 1) for i in range(lg)] + [
            n >> (i + 1) for i in reversed(range(lg))
        ]


@pytest.mark.parametrize("p", [3, 5, 6, 7, 9, 13, 24])
def test_halving_doubling_binary_blocks_steps_and_bytes(p: int) -> None:
    blocks = binary_blocks(p)
    assert sum(n for _, n in blocks) == p
    lg = blocks[0][1].bit_length() - 1
    n = blocks[0][1] * 60
    for r in range(p):
        s = allreduce_halving_doubling(r, p, n)
        assert len(s.steps) == 2 * lg + 2 * (len(blocks) - 1)
        assert s.bytes_sent(8) <= 8 * 2 * n


def test_binary_blocks() -> None:
    assert binary_blocks(1) == [(0, 1)]
    assert binary_blocks(24) == [(0, 16), (16, 8)]
    assert binary_blocks(7) == [(0, 4), (4, 2), (6, 1)]


def test_halving_doubling_rejects_bad_rank() -> None:
    with pytest.raises(ValueError, match="rank"):
        allreduce_halving_doubling(4, 4, 10)

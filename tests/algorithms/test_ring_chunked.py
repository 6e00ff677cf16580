"""Ring chunked allreduce proven by the simulator: Gloo's sweep of sizes and counts."""

from __future__ import annotations

import pytest
from allreduce_sweep import SIZES, check_other_op, check_sum_exact

from totalreduce.algorithms.ring_chunked import allreduce_ring_chunked


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("p", SIZES)
def test_ring_chunked_sum_exact(p: int, in_place: bool) -> None:
    check_sum_exact(allreduce_ring_chunked, p, in_place)


@pytest.mark.parametrize("p", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("op", ["max", "min", "avg"])
def test_ring_chunked_other_ops(p: int, op: str) -> None:
    check_other_op(allreduce_ring_chunked, p, op)


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

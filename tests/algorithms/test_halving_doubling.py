"""Halving-doubling allreduce (binary blocks off powers of two) proven by the simulator."""

from __future__ import annotations

import pytest
from allreduce_sweep import SIZES, check_other_op, check_sum_exact

from totalreduce.algorithms.halving_doubling import (
    allreduce_halving_doubling,
    binary_blocks,
)


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("p", SIZES)
def test_halving_doubling_sum_exact(p: int, in_place: bool) -> None:
    check_sum_exact(allreduce_halving_doubling, p, in_place)


@pytest.mark.parametrize("p", [1, 2, 3, 6, 8, 13])
@pytest.mark.parametrize("op", ["max", "min", "avg"])
def test_halving_doubling_other_ops(p: int, op: str) -> None:
    check_other_op(allreduce_halving_doubling, p, op)


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

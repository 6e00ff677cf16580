"""Ring allreduce proven by the simulator: Gloo's sweep of sizes and counts."""

from __future__ import annotations

import pytest
from allreduce_sweep import SIZES, check_other_op, check_sum_exact

from totalreduce.algorithms import allreduce_ring


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("p", SIZES)
def test_ring_sum_exact(p: int, in_place: bool) -> None:
    check_sum_exact(allreduce_ring, p, in_place)


@pytest.mark.parametrize("p", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("op", ["max", "min", "avg"])
def test_ring_other_ops(p: int, op: str) -> None:
    check_other_op(allreduce_ring, p, op)


def test_ring_bytes_on_the_wire() -> None:
    p, n = 4, 1000
    s = allreduce_ring(0, p, n)
    assert len(s.steps) == 2 * (p - 1)
    assert s.bytes_sent(8) == 8 * 2 * (p - 1) * n // p

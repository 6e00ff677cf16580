"""Recursive doubling allreduce (with the fold for other P) proven by the simulator."""

from __future__ import annotations

import numpy as np
import pytest
from allreduce_sweep import check_other_op, check_sum_exact

from totalreduce.algorithms.recursive_doubling import allreduce_recursive_doubling
from totalreduce.algorithms.schedule import alias_input
from totalreduce.algorithms.simulator import simulate

SIZES = list(range(1, 33))


def counts(p: int) -> list[int]:
    """Gloo's counts: empty, one element, P - 1, primes, 1000."""
    return sorted({0, 1, max(p - 1, 0), 7, 13, 97, 1000})


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("p", SIZES)
def test_recursive_doubling_sum_exact(p: int, in_place: bool) -> None:
    check_sum_exact(allreduce_recursive_doubling, p, in_place, counts(p))


@pytest.mark.parametrize("p", [1, 2, 3, 5, 6, 8, 13])
@pytest.mark.parametrize("op", ["max", "min", "avg"])
def test_recursive_doubling_other_ops(p: int, op: str) -> None:
    check_other_op(allreduce_recursive_doubling, p, op)


@pytest.mark.parametrize("p", [2, 3, 7, 8, 12])
def test_recursive_doubling_runs_in_place_without_a_copy(p: int) -> None:
    # The in-place form needs no private input copy, and a small segment size
    # makes the write-after-read waits of every step matter.
    n = 257
    for r in range(p):
        assert alias_input(allreduce_recursive_doubling(r, p, n)) is not None
    xs = [np.arange(n, dtype=np.int64) * (r + 1) for r in range(p)]
    want = np.arange(n, dtype=np.int64) * (p * (p + 1) // 2)
    schedules = [allreduce_recursive_doubling(r, p, n) for r in range(p)]
    for seed in range(5):
        outs = simulate(schedules, xs, segment_elems=16, in_place=True, seed=seed)
        for out in outs:
            np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("p", [1, 2, 4, 8, 16, 32])
def test_recursive_doubling_power_of_two_steps_and_bytes(p: int) -> None:
    n = 100
    lg = p.bit_length() - 1
    for r in range(p):
        s = allreduce_recursive_doubling(r, p, n)
        assert len(s.steps) == lg
        assert s.bytes_sent(8) == 8 * lg * n
        assert [st.sends[0].peer for st in s.steps] == [r ^ (1 << k) for k in range(lg)]
        assert all(st.sends[0].region.count == n for st in s.steps)


@pytest.mark.parametrize("p", [3, 5, 6, 7, 12, 13, 24, 31])
def test_recursive_doubling_fold_steps_and_bytes(p: int) -> None:
    pof2 = 1 << (p.bit_length() - 1)
    rem = p - pof2
    lg = pof2.bit_length() - 1
    n = 50
    for r in range(p):
        s = allreduce_recursive_doubling(r, p, n)
        assert len(s.steps) == lg + 2
        if r < 2 * rem and r % 2 == 0:
            # Folded out: sends its input once, receives the result once.
            assert s.bytes_sent(8) == 8 * n
            assert [len(st.recvs) for st in s.steps] == [0] * (lg + 1) + [1]
        elif r < 2 * rem:
            assert s.bytes_sent(8) == 8 * (lg + 1) * n
        else:
            assert s.bytes_sent(8) == 8 * lg * n
            assert not s.steps[0].sends and not s.steps[-1].sends


def test_recursive_doubling_rejects_bad_rank() -> None:
    with pytest.raises(ValueError, match="rank"):
        allreduce_recursive_doubling(4, 4, 10)

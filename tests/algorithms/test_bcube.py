"""BCube allreduce proven by the simulator, for powers of the base and mixed radices."""

from __future__ import annotations

import math

import pytest
from allreduce_sweep import SIZES, check_other_op, check_sum_exact

from totalreduce.algorithms.bcube import allreduce_bcube, bcube_radices


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("p", SIZES)
def test_bcube_sum_exact(p: int, in_place: bool) -> None:
    check_sum_exact(allreduce_bcube, p, in_place, base=2)


@pytest.mark.parametrize("base", [3, 4, 5])
@pytest.mark.parametrize("p", SIZES)
def test_bcube_other_bases(p: int, base: int) -> None:
    counts = sorted({0, 1, p + 1, 1000})
    check_sum_exact(allreduce_bcube, p, p % 2 == 0, counts, base=base)


@pytest.mark.parametrize("p", [1, 4, 6, 9])
@pytest.mark.parametrize("op", ["max", "min", "avg"])
def test_bcube_other_ops(p: int, op: str) -> None:
    check_other_op(allreduce_bcube, p, op, base=3)


@pytest.mark.parametrize("base", [2, 3, 4])
@pytest.mark.parametrize("p", range(1, 17))
def test_bcube_steps_and_bytes(p: int, base: int) -> None:
    radices = bcube_radices(p, base)
    assert math.prod(radices) == p
    n = p * 60
    for r in range(p):
        s = allreduce_bcube(r, p, n, base=base)
        assert len(s.steps) == 2 * len(radices)
        # Any radices: (P-1)/P of the buffer each way.
        assert s.bytes_sent(8) == 8 * 2 * (p - 1) * n // p
        for st, group in zip(s.steps, radices + radices[::-1], strict=True):
            assert len(st.sends) == len(st.recvs) == group - 1


def test_bcube_power_of_base_uses_groups_of_base() -> None:
    assert bcube_radices(16, 4) == [4, 4]
    assert bcube_radices(27, 3) == [3, 3, 3]
    assert bcube_radices(8, 2) == [2, 2, 2]
    s = allreduce_bcube(5, 16, 160, base=4)
    assert [sorted(x.peer for x in st.sends) for st in s.steps[:2]] == [[4, 6, 7], [1, 9, 13]]


def test_bcube_radix_rule() -> None:
    assert bcube_radices(1, 2) == []
    assert bcube_radices(12, 2) == [2, 2, 3]
    assert bcube_radices(12, 4) == [4, 3]
    assert bcube_radices(10, 4) == [2, 5]
    assert bcube_radices(13, 4) == [13]
    with pytest.raises(ValueError, match="base"):
        bcube_radices(8, 1)

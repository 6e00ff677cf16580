"""BCube allreduce proven by the simulator, for powers of the base and mixed radices."""

from __future__ import annotations

import math

import numpy as np
import pytest

from totalreduce.algorithms.bcube import allreduce_bcube, bcube_radices
from totalreduce.algorithms.simulator import simulate

SIZES = sorted(set(range(1, 17)) | {24, 32})


def counts_for(p: int) -> list[int]:
    if p > 16:
        return sorted({0, p + 1, 1000})
    return sorted({0, 1, max(p - 1, 0), p + 1, 1000, 12345})


def inputs(p: int, n: int) -> list[np.ndarray]:
    index = np.arange(n, dtype=np.int64)
    return [index * p + r for r in range(p)]


def check_sum(p: int, counts: list[int], base: int, in_place: bool) -> None:
    for n in counts:
        want = np.arange(n, dtype=np.int64) * p * p + p * (p - 1) // 2
        schedules = [allreduce_bcube(r, p, n, base=base) for r in range(p)]
        outs = simulate(
            schedules, inputs(p, n), segment_elems=97, in_place=in_place, seed=p * 7 + n
        )
        for r, out in enumerate(outs):
            np.testing.assert_array_equal(out, want, err_msg=f"P={p} base={base} n={n} rank={r}")


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("p", SIZES)
def test_bcube_sum_exact(p: int, in_place: bool) -> None:
    check_sum(p, counts_for(p), 2, in_place)


@pytest.mark.parametrize("base", [3, 4, 5])
@pytest.mark.parametrize("p", SIZES)
def test_bcube_other_bases(p: int, base: int) -> None:
    check_sum(p, sorted({0, 1, p + 1, 1000}), base, in_place=p % 2 == 0)


@pytest.mark.parametrize("p", [1, 4, 6, 9])
@pytest.mark.parametrize("op", ["max", "min", "avg"])
def test_bcube_other_ops(p: int, op: str) -> None:
    n = 1001
    rng = np.random.default_rng(p)
    xs = [rng.integers(-1000, 1000, n).astype(np.int64) for _ in range(p)]
    ref = {"max": np.max, "min": np.min, "avg": lambda a, axis: np.sum(a, axis=axis) // p}[op]
    want = ref(np.stack(xs), axis=0)
    schedules = [allreduce_bcube(r, p, n, average=op == "avg", base=3) for r in range(p)]
    for out in simulate(schedules, xs, op=op, segment_elems=50, seed=p):
        np.testing.assert_array_equal(out, want)


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

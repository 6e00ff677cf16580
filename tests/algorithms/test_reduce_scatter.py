"""Ring reduce-scatter and all-gather-v: exact parts, and the adjoint relation."""

from __future__ import annotations

import numpy as np
import pytest

from totalreduce.algorithms.reduce_scatter import allgather_ring, reduce_scatter_ring
from totalreduce.algorithms.schedule import balanced_parts
from totalreduce.algorithms.simulator import simulate


def counts_for(p: int) -> list[int]:
    return sorted({0, 1, max(p - 1, 0), p + 1, 1000, 12345})


def reduce_scatter(xs: list[np.ndarray], *, op: str = "sum", seed: int = 0) -> list[np.ndarray]:
    p, n = len(xs), len(xs[0])
    schedules = [reduce_scatter_ring(r, p, n, average=op == "avg") for r in range(p)]
    return simulate(schedules, xs, op=op, segment_elems=97, seed=seed)


def allgather(ys: list[np.ndarray], *, seed: int = 0, in_place: bool = False) -> list[np.ndarray]:
    p = len(ys)
    counts = [len(y) for y in ys]
    schedules = [allgather_ring(r, p, counts) for r in range(p)]
    return simulate(schedules, ys, segment_elems=97, seed=seed, in_place=in_place)


@pytest.mark.parametrize("p", range(1, 17))
def test_reduce_scatter_exact_parts(p: int) -> None:
    for n in counts_for(p):
        xs = [np.arange(n, dtype=np.int64) * p + r for r in range(p)]
        total = np.arange(n, dtype=np.int64) * p * p + p * (p - 1) // 2
        outs = reduce_scatter(xs, seed=p * 7 + n)
        split = np.array_split(total, p)  # DistDL's and numpy's rule
        for r, out in enumerate(outs):
            off, m = balanced_parts(n, p)[r]
            assert len(out) == m == len(split[r])
            np.testing.assert_array_equal(out, total[off : off + m], err_msg=f"P={p} n={n} r={r}")


@pytest.mark.parametrize("p", [1, 2, 3, 7])
@pytest.mark.parametrize("op", ["max", "min", "avg"])
def test_reduce_scatter_other_ops(p: int, op: str) -> None:
    n = 1001
    rng = np.random.default_rng(p)
    xs = [rng.integers(-1000, 1000, n).astype(np.int64) for _ in range(p)]
    ref = {"max": np.max, "min": np.min, "avg": lambda a, axis: np.sum(a, axis=axis) // p}[op]
    want = ref(np.stack(xs), axis=0)
    for r, out in enumerate(reduce_scatter(xs, op=op, seed=p)):
        off, m = balanced_parts(n, p)[r]
        np.testing.assert_array_equal(out, want[off : off + m])


@pytest.mark.parametrize("p", [2, 3, 8])
def test_reduce_scatter_steps_and_bytes(p: int) -> None:
    n = p * 100
    for r in range(p):
        s = reduce_scatter_ring(r, p, n)
        assert len(s.steps) == p - 1
        assert s.bytes_sent(8) == 8 * (p - 1) * n // p
        # No copy of the input first nor of the result after; WORK only carries the parts
        # passed on between (none at P=2).
        assert s.work_count == (n if p > 2 else 0) and s.out_count == 100
        assert s.prologue == () and s.epilogue == ()
        first = s.steps[0].sends[0].region
        assert first.buffer.name == "INPUT"
        last = s.steps[-1].recvs[0]
        assert last.region.buffer.name == "OUTPUT" and last.src is not None


@pytest.mark.parametrize("p", range(1, 17))
def test_allgather_v_differing_counts(p: int) -> None:
    rng = np.random.default_rng(p)
    for trial in range(3):
        counts = [int(c) for c in rng.integers(0, 40, p)]
        if trial == 1:
            counts[::2] = [0] * len(counts[::2])  # some ranks give nothing
        if trial == 2:
            counts = [0] * p
            counts[-1] = 17  # one rank gives everything
        ys = [rng.integers(-99, 99, c).astype(np.int64) for c in counts]
        want = np.concatenate(ys)
        for in_place in (False, True):
            outs = allgather(ys, seed=trial, in_place=in_place)
            for r, out in enumerate(outs):
                np.testing.assert_array_equal(out, want, err_msg=f"P={p} {counts} rank={r}")
        for r in range(p):
            s = allgather_ring(r, p, counts)
            assert len(s.steps) == p - 1
            assert s.bytes_sent(1) == (sum(counts) - counts[(r + 1) % p] if p > 1 else 0)


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 8, 13])
@pytest.mark.parametrize("n", [1, 10, 257])
def test_allgather_is_the_adjoint_of_reduce_scatter(p: int, n: int) -> None:
    rng = np.random.default_rng(p * 1000 + n)
    xs = [rng.standard_normal(n) for _ in range(p)]
    ys = [rng.standard_normal(m) for _, m in balanced_parts(n, p)]
    rs = np.concatenate(reduce_scatter(xs, seed=1))
    ag = np.concatenate(allgather(ys, seed=2))
    lhs = float(np.dot(rs, np.concatenate(ys)))
    rhs = float(np.dot(np.concatenate(xs), ag))
    assert abs(lhs - rhs) <= 1e-12 * max(abs(lhs), abs(rhs), 1.0)


def test_allgather_rejects_bad_counts() -> None:
    with pytest.raises(ValueError, match="one count per rank"):
        allgather_ring(0, 3, [1, 2])
    with pytest.raises(ValueError, match=">= 0"):
        allgather_ring(0, 2, [1, -1])

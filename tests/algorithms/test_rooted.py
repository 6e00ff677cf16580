"""Reduce, gather, scatter, all-to-all and send/recv schedules, simulated for P = 1..16."""

from __future__ import annotations

import numpy as np
import pytest

from totalreduce.algorithms.rooted import (
    alltoall_direct,
    gather_direct,
    reduce_direct,
    scatter_direct,
    send_recv,
)
from totalreduce.algorithms.schedule import Buffer, plan_segments
from totalreduce.algorithms.simulator import simulate

SIZES = range(1, 17)
COUNTS = [0, 1, 7, 100]


def data(rank: int, n: int) -> np.ndarray:
    """Position- and rank-dependent values: a misplaced element shows."""
    return np.arange(n, dtype=np.int64) * 1000 + rank * 7 + 3


def roots(p: int) -> list[int]:
    return sorted({0, p // 2, p - 1})


@pytest.mark.parametrize("p", SIZES)
def test_reduce(p: int) -> None:
    for root in roots(p):
        for n in COUNTS:
            for op, fold in (("sum", np.add), ("max", np.maximum), ("bxor", np.bitwise_xor)):
                xs = [data(r, n) * (1 if r % 2 else -1) for r in range(p)]
                scheds = [reduce_direct(r, p, n, root=root) for r in range(p)]
                for in_place in (False, True):
                    outs = simulate(scheds, xs, op=op, segment_elems=13, in_place=in_place, seed=n)
                    np.testing.assert_array_equal(outs[root], fold.reduce(xs), f"{p} {root} {op}")
                    assert all(outs[r].size == 0 for r in range(p) if r != root)


@pytest.mark.parametrize("p", SIZES)
def test_reduce_average(p: int) -> None:
    xs = [data(r, 9) for r in range(p)]
    scheds = [reduce_direct(r, p, 9, root=p - 1, average=True) for r in range(p)]
    outs = simulate(scheds, xs, op="avg")
    np.testing.assert_array_equal(outs[p - 1], np.add.reduce(xs) // p)


@pytest.mark.parametrize("p", SIZES)
def test_gather(p: int) -> None:
    for root in roots(p):
        for n in COUNTS:
            xs = [data(r, n) for r in range(p)]
            scheds = [gather_direct(r, p, n, root=root) for r in range(p)]
            outs = simulate(scheds, xs, segment_elems=13, seed=n + root)
            np.testing.assert_array_equal(outs[root], np.concatenate(xs))


@pytest.mark.parametrize("p", SIZES)
def test_scatter(p: int) -> None:
    for root in roots(p):
        for n in COUNTS:
            whole = data(root, p * n)
            xs = [whole if r == root else whole[:0] for r in range(p)]
            scheds = [scatter_direct(r, p, n, root=root) for r in range(p)]
            outs = simulate(scheds, xs, segment_elems=13, seed=n + root)
            for r in range(p):
                np.testing.assert_array_equal(outs[r], whole[r * n : (r + 1) * n])


@pytest.mark.parametrize("p", SIZES)
def test_alltoall_equal_parts(p: int) -> None:
    for n in COUNTS:
        xs = [data(r, p * n) for r in range(p)]
        scheds = [alltoall_direct(r, p, [n] * p) for r in range(p)]
        for in_place in (False, True):
            outs = simulate(scheds, xs, segment_elems=13, in_place=in_place, seed=n)
            for r in range(p):
                want = np.concatenate([xs[j][r * n : (r + 1) * n] for j in range(p)])
                np.testing.assert_array_equal(outs[r], want)


@pytest.mark.parametrize("p", SIZES)
def test_alltoall_unequal_splits(p: int) -> None:
    # sizes[i][j]: what rank i sends rank j (some empty, some over a segment).
    rng = np.random.default_rng(p)
    sizes = rng.integers(0, 30, (p, p))
    xs = [data(i, int(sizes[i].sum())) for i in range(p)]
    scheds = [alltoall_direct(i, p, list(sizes[i]), list(sizes[:, i])) for i in range(p)]
    outs = simulate(scheds, xs, segment_elems=13, seed=p)
    for r in range(p):
        parts = []
        for j in range(p):
            start = int(sizes[j, :r].sum())
            parts.append(xs[j][start : start + sizes[j, r]])
        np.testing.assert_array_equal(outs[r], np.concatenate(parts))


def test_send_recv() -> None:
    for sender in (0, 1):
        for n in COUNTS:
            x = data(5, n)
            xs = [x if r == sender else x[:0] for r in range(2)]
            outs = simulate([send_recv(r, n, sender=sender) for r in range(2)], xs, segment_elems=3)
            np.testing.assert_array_equal(outs[1 - sender], x)


@pytest.mark.parametrize("make", [reduce_direct, gather_direct, scatter_direct])
def test_rooted_ops_confirm(make) -> None:
    # The root hears a token from every rank; every non-root waits for the release.
    for p in (2, 3, 5):
        for r in range(p):
            s = make(r, p, 4, root=0)
            got = [x.peer for st in s.steps for x in st.recvs if x.region.buffer is Buffer.WORK]
            sent = [x.peer for st in s.steps for x in st.sends if x.region.buffer is Buffer.WORK]
            release = make is not scatter_direct or p > 2
            if r == 0:
                assert sorted(got) == list(range(1, p))
                assert sorted(sent) == (list(range(1, p)) if release else [])
            else:
                assert sent == [0] and got == ([0] if release else [])


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="root"):
        reduce_direct(0, 3, 4, root=3)
    with pytest.raises(ValueError, match="split"):
        alltoall_direct(0, 3, [1, 2])
    with pytest.raises(ValueError, match="sends itself"):
        alltoall_direct(0, 2, [1, 2], [2, 2])


@pytest.mark.parametrize("make", [reduce_direct, gather_direct])
def test_two_ranks_answer_without_waiting(make) -> None:
    """At P = 2 nothing of a reduce or gather waits: the root's answer goes when the op starts
    (its own token apart from the one it receives), so the non-root finishes one message after
    it started.  From P = 3 the root's release waits for every token."""
    for root in (0, 1):
        for n in (0, 1, 7):
            for r in range(2):
                s = make(r, 2, n, root=root)
                plan = plan_segments(s, 3)
                assert not any(plan.send_waits) and not any(plan.recv_waits), (root, n, r)
                assert s.work_count == 2
    plan = plan_segments(make(0, 3, 4, root=0), 3)
    released = [i for i, x in enumerate(plan.sends) if x.region.buffer is Buffer.WORK]
    assert released and all(plan.send_waits[i] for i in released)

"""Broadcast schedules, one-to-all and pipelined chain, for every root."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from totalreduce.algorithms.broadcast import (
    broadcast_one_to_all,
    broadcast_pipelined,
    default_chunks,
)
from totalreduce.algorithms.schedule import Buffer, Schedule
from totalreduce.algorithms.simulator import simulate

COUNTS = [0, 1, 7, 1000]


def data_bytes(s: Schedule, itemsize: int) -> int:
    """Bytes of the broadcast data a rank sends (the confirmation tokens left out)."""
    return itemsize * sum(
        x.region.count for st in s.steps for x in st.sends if x.region.buffer is Buffer.OUTPUT
    )


def tokens(s: Schedule) -> tuple[list[int], list[int]]:
    """Peers a rank sends confirmation tokens to, and receives them from."""
    sent = [x.peer for st in s.steps for x in st.sends if x.region.buffer is Buffer.WORK]
    got = [x.peer for st in s.steps for x in st.recvs if x.region.buffer is Buffer.WORK]
    return sent, got


def check(p: int, make: Callable[[int, int, int, int], Schedule]) -> None:
    for root in range(p):
        for n in COUNTS:
            # Non-roots hold stale data that must be overwritten.
            xs = [
                np.arange(n, dtype=np.int64) * 3 + 1 if r == root else np.full(n, -r - 1)
                for r in range(p)
            ]
            schedules = [make(r, p, n, root) for r in range(p)]
            for in_place in (False, True):
                outs = simulate(
                    schedules, xs, segment_elems=37, in_place=in_place, seed=root * 13 + n
                )
                for r, out in enumerate(outs):
                    np.testing.assert_array_equal(
                        out, xs[root], err_msg=f"P={p} root={root} n={n} rank={r}"
                    )


@pytest.mark.parametrize("p", range(1, 17))
def test_broadcast_one_to_all(p: int) -> None:
    check(p, lambda r, p, n, root: broadcast_one_to_all(r, p, n, root=root))


@pytest.mark.parametrize("chunks", [None, 1, 3, 9])  # 9 > count 0, 1, 7: empty pieces
@pytest.mark.parametrize("p", range(1, 10))
def test_broadcast_pipelined(p: int, chunks: int | None) -> None:
    check(p, lambda r, p, n, root: broadcast_pipelined(r, p, n, root=root, chunks=chunks))


@pytest.mark.parametrize("p", [2, 3, 8])
def test_broadcast_one_to_all_steps_and_bytes(p: int) -> None:
    n = 1000
    for root in range(p):
        for r in range(p):
            s = broadcast_one_to_all(r, p, n, root=root)
            assert len(s.steps) == (1 if p == 2 else 2)  # data, then the release
            assert data_bytes(s, 4) == (4 * (p - 1) * n if r == root else 0)


@pytest.mark.parametrize("p", [2, 3, 8])
@pytest.mark.parametrize("chunks", [None, 1, 5])
def test_broadcast_pipelined_steps_and_bytes(p: int, chunks: int | None) -> None:
    n = 1000
    c = default_chunks(p, n) if chunks is None else chunks
    root = p // 2
    for r in range(p):
        s = broadcast_pipelined(r, p, n, root=root, chunks=chunks)
        assert len(s.steps) == c + p - (2 if p == 2 else 1)  # the pieces, then the release
        last = (r - root) % p == p - 1
        assert data_bytes(s, 4) == (0 if last else 4 * n)
        # One link each way: at most one piece sent and one received per step.
        pieces = [
            (
                [x for x in st.sends if x.region.buffer is Buffer.OUTPUT],
                [x for x in st.recvs if x.region.buffer is Buffer.OUTPUT],
            )
            for st in s.steps
        ]
        assert all(len(a) <= 1 and len(b) <= 1 for a, b in pieces)


@pytest.mark.parametrize("make", [broadcast_one_to_all, broadcast_pipelined])
@pytest.mark.parametrize("p", range(1, 17))
def test_broadcast_root_hears_every_rank_before_anyone_finishes(make, p: int) -> None:
    # Every non-root sends the root a token (its frame carries the op's shape);
    # with P > 2 the root releases each non-root only after every token came.
    for root in range(p):
        for r in range(p):
            sent, got = tokens(make(r, p, 10, root=root))
            others = [q for q in range(p) if q != root]
            if p == 1:
                assert (sent, got) == ([], [])
            elif r == root:
                assert sorted(got) == others
                assert sorted(sent) == (others if p > 2 else [])
            else:
                assert sent == [root]
                assert got == ([root] if p > 2 else [])
    if p > 2:
        # The release waits for every token: the root's release sends depend on its receives.
        from totalreduce.algorithms.schedule import plan_segments

        plan = plan_segments(make(0, p, 10, root=0), 4)
        release = {i for i, x in enumerate(plan.sends) if x.region.buffer is Buffer.WORK}
        for q, x in enumerate(plan.recvs):
            # every token reaches every release, maybe through the other tokens
            if x.region.buffer is Buffer.WORK:
                seen, todo = set(), [(False, q)]
                while todo:
                    is_send, k = todo.pop()
                    if (is_send, k) in seen:
                        continue
                    seen.add((is_send, k))
                    todo += [] if is_send else plan.after_recv[k]
                assert release <= {k for is_send, k in seen if is_send}


def test_broadcast_pipelined_pieces_overlap_along_the_chain() -> None:
    p, c = 4, 6
    s = broadcast_pipelined(1, p, 600, root=0, chunks=c)
    # Position 1 receives piece t at step t and forwards it at step t + 1.
    for t in range(c):
        assert s.steps[t].recvs[0].region.offset == 100 * t
        assert s.steps[t + 1].sends[0].region.offset == 100 * t


def test_broadcast_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="root"):
        broadcast_one_to_all(0, 3, 10, root=3)
    with pytest.raises(ValueError, match="chunks"):
        broadcast_pipelined(0, 3, 10, chunks=0)

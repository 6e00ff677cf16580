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
from totalreduce.algorithms.schedule import Schedule
from totalreduce.algorithms.simulator import simulate

COUNTS = [0, 1, 7, 1000]


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


@pytest.mark.parametrize("p", range(1, 10))
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
            assert len(s.steps) == 1
            assert s.bytes_sent(4) == (4 * (p - 1) * n if r == root else 0)


@pytest.mark.parametrize("p", [2, 3, 8])
@pytest.mark.parametrize("chunks", [None, 1, 5])
def test_broadcast_pipelined_steps_and_bytes(p: int, chunks: int | None) -> None:
    n = 1000
    c = default_chunks(p, n) if chunks is None else chunks
    root = p // 2
    for r in range(p):
        s = broadcast_pipelined(r, p, n, root=root, chunks=chunks)
        assert len(s.steps) == c + p - 2
        last = (r - root) % p == p - 1
        assert s.bytes_sent(4) == (0 if last else 4 * n)
        # One link each way: at most one piece sent and one received per step.
        assert all(len(st.sends) <= 1 and len(st.recvs) <= 1 for st in s.steps)


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

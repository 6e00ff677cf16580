"""Daemon mode's pieces (service/chunks.py): an op too large for the arena, cut into pieces
that each rank cuts alike, gives exactly the op's result once every piece ran.

Each piece is run here by a pure simulation of its collective among P ranks (no
processes), for P = 1..6, every piece count up to 5, and random, uneven parts.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from totalreduce.algorithms.codes import OpKind
from totalreduce.group import Group
from totalreduce.service.chunks import _plan, piece_wire, shared_bytes


def offsets(parts: tuple[int, ...]) -> list[int]:
    return [sum(parts[:j]) for j in range(len(parts))]


@pytest.mark.parametrize("size", range(1, 7))
@pytest.mark.parametrize("pieces", range(2, 6))
def test_reduce_scatter_and_allgather_pieces_give_the_whole_op(size: int, pieces: int) -> None:
    rng = random.Random(size * 10 + pieces)
    parts = tuple(rng.randint(0, 13) for _ in range(size))
    ranks = rng.sample(range(size + 2), size)  # a group: its ranks in any order
    world = max(ranks) + 1
    grp = Group(ranks)
    total = sum(parts)
    xs = {r: np.arange(total, dtype=np.int64) * (r + 1) + 7 * r for r in ranks}
    # reduce-scatter: piece by piece, each rank's output lands in its part
    outs = {r: np.full(parts[grp.rank_of(r)], -1, np.int64) for r in ranks}
    plans = {r: _plan(OpKind.REDUCE_SCATTER, xs[r], outs[r], parts, pieces, grp, r, world)
             for r in ranks}  # fmt: skip
    for i in range(pieces):
        pi = {plans[r][i][2] for r in ranks}
        assert len(pi) == 1  # every rank cut alike
        (p_i,) = pi
        summed = sum(plans[r][i][0] for r in ranks)
        at = offsets(p_i)
        for r in ranks:
            me = grp.rank_of(r)
            plans[r][i][1][:] = summed[at[me] : at[me] + p_i[me]]
    whole = sum(xs.values())
    at = offsets(parts)
    for r in ranks:
        me = grp.rank_of(r)
        assert np.array_equal(outs[r], whole[at[me] : at[me] + parts[me]])
    # all-gather: each piece sends a cut of the part, what comes back is put in place
    mine = {r: np.arange(parts[grp.rank_of(r)], dtype=np.int64) + 100 * r for r in ranks}
    outs = {r: np.full(total, -1, np.int64) for r in ranks}
    plans = {r: _plan(OpKind.ALLGATHER, mine[r], outs[r], parts, pieces, grp, r, world)
             for r in ranks}  # fmt: skip
    for i in range(pieces):
        joined = np.concatenate([plans[q][i][0] for q in ranks])
        for r in ranks:
            _, got, _, back = plans[r][i]
            got[:] = joined
            assert back is not None
            back()
    want = np.concatenate([mine[q] for q in ranks])
    for r in ranks:
        assert np.array_equal(outs[r], want)


@pytest.mark.parametrize("size", range(1, 6))
@pytest.mark.parametrize("pieces", range(2, 5))
def test_alltoall_pieces_give_the_whole_op(size: int, pieces: int) -> None:
    """Random, uneven counts per pair; each side cuts the pair's block alike."""
    rng = random.Random(size * 7 + pieces)
    m = [[rng.randint(0, 9) for _ in range(size)] for _ in range(size)]  # m[a][b]: a -> b
    xs = {a: np.arange(sum(m[a]), dtype=np.int64) + 1000 * a for a in range(size)}
    outs = {b: np.full(sum(m[a][b] for a in range(size)), -1, np.int64) for b in range(size)}
    plans = {
        a: _plan(OpKind.ALLTOALL, xs[a], outs[a], (*m[a], *(row[a] for row in m)), pieces,
                 None, a, size)
        for a in range(size)
    }  # fmt: skip
    for i in range(pieces):
        for b in range(size):
            _, got, pb, back = plans[b][i]
            blocks = []
            for a in range(size):
                xa, _, pa, _ = plans[a][i]
                assert pa is not None and pb is not None
                assert pa[b] == pb[size + a]  # the pair's cut agrees on both sides
                at = sum(pa[:b])
                blocks.append(xa[at : at + pa[b]])
            got[:] = np.concatenate(blocks)
            assert back is not None
            back()
    for b in range(size):
        want = [xs[a][sum(m[a][:b]) : sum(m[a][:b]) + m[a][b]] for a in range(size)]
        assert np.array_equal(outs[b], np.concatenate(want))


def test_allreduce_pieces_are_views_covering_the_buffers() -> None:
    x = np.arange(101, dtype=np.float32)
    out = np.zeros_like(x)
    plan = _plan(OpKind.ALLREDUCE, x, out, None, 4, None, 0, 2)
    assert [p[0].size for p in plan] == [26, 25, 25, 25]
    for xi, oi, parts, back in plan:
        assert np.shares_memory(xi, x) and np.shares_memory(oi, out)
        assert parts is None and back is None
        oi[:] = xi * 2
    assert np.array_equal(out, x * 2)


def test_the_cut_depends_only_on_what_every_rank_knows() -> None:
    x = np.zeros(10, np.float64)
    assert shared_bytes(OpKind.ALLREDUCE, x, None, 0) == 80
    assert shared_bytes(OpKind.ALLGATHER, x[:3], (3, 5, 2), 0) == 80  # the whole, not the part
    assert shared_bytes(OpKind.ALLTOALL, x, (5, 5, 4, 6), 123) == 123  # the caller's
    wire = 0x1234_5678_9ABC_DEF0
    ids = {piece_wire(wire, i) for i in range(1000)}
    assert piece_wire(wire, 0) == wire and len(ids) == 1000

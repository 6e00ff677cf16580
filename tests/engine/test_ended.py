"""The ring of ended ops (``engine/ended.py``): what a late error or a late frame about an op
that ended here finds, in arrays, and a repeat that ends in its call keeps nothing else."""

from __future__ import annotations

import gc
import sys
from typing import Any

import numpy as np
import pytest

from conftest import local_services, run_ranks
from totalreduce.engine import ended as E
from totalreduce.engine.ended import EndedOps
from totalreduce.engine.wire import wire_id


def test_an_ended_op_is_found_with_its_name_group_and_hints() -> None:
    e = EndedOps(8)
    big = wire_id("fc1.grad")  # a 64-bit wire id: kept as the int64 of its bits
    r = e.row("fc1.grad", (0, 1), ("hint {sender} {me}",))
    e.note(big, 7, r)
    assert (big, 7) in e
    assert e.get((big, 7)) == (("fc1.grad", 7), (0, 1), ("hint {sender} {me}",), ())
    assert e.get((big, 6)) is None and (big, 8) not in e
    e.forget((big, 7))
    assert e.get((big, 7)) is None and len(e) == 0


def test_the_ring_keeps_the_last_n_and_the_newest_entry_of_a_key() -> None:
    e = EndedOps(8)
    a, b = e.row("a", (0, 1), ()), e.row("b", (0, 2), ())
    assert a != b and e.row("a", (0, 1), ()) == a
    for g in range(20):
        e.note(5, g, a)
    assert len(e) == 8
    assert [g for g in range(20) if (5, g) in e] == list(range(12, 20))
    e.note(5, 19, b)  # the same key again (a session op's name, met again): the newest wins
    assert e.get((5, 19)) == (("b", 19), (0, 2), (), ())
    e.note_span(9, 100, 3, b)
    assert [(9, g) in e for g in (99, 100, 101, 102, 103)] == [False, True, True, True, False]
    e.note_span(9, 0, 50, a)  # more than the ring: the last 8
    assert [g for g in range(50) if (9, g) in e] == list(range(42, 50))


def test_rows_are_compacted_to_those_the_ring_names_and_the_epoch_moves(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(E, "ROWS", 16)
    e = EndedOps(8)
    kept = e.row("kept", (0,), ())
    e.note(99, 0, kept)
    epoch = e.epoch
    for i in range(40):  # every op a name of its own (unnamed ops): rows stay bounded
        e.note(i, 0, e.row(f"op{i}", (0, 1), ()))
        assert len(e._named) <= 17
    assert e.epoch > epoch  # a row kept from before (``kept``) is stale now
    assert all(e.get((i, 0)) == ((f"op{i}", 0), (0, 1), (), ()) for i in range(32, 40))
    assert e.get((0, 0)) is None and e.get((99, 0)) is None  # overwritten with its row


def test_a_ring_of_other_than_a_power_of_two_is_refused() -> None:
    with pytest.raises(ValueError, match="power of two"):
        EndedOps(6)


def test_blocking_repeats_keep_no_python_object_per_op() -> None:
    """1,000 blocking 4 KiB repeats into ``out`` on each of two ranks: the interpreter's
    allocated blocks and its tracked objects do not grow with them (each op's end is three
    words in the ring; before, a dict entry of three tuples per op, to 4,096 of them)."""
    n = 1000

    def body(s: Any) -> tuple[float, float, int]:
        x = np.ones(1024, np.float32)
        out = np.empty_like(x)
        for _ in range(20):  # the whole way, then the lane's part of the record
            s.allreduce(x, name="blk", out=out)
        s.barrier()
        blocks = sys.getallocatedblocks()
        objs = len(gc.get_objects())
        e0 = s.loop.stats.lane_express
        for _ in range(n):
            s.allreduce(x, name="blk", out=out)
        took = s.loop.stats.lane_express - e0
        grew = (sys.getallocatedblocks() - blocks) / n, (len(gc.get_objects()) - objs) / n
        assert np.array_equal(out, np.full(1024, 2, np.float32))
        s.barrier()
        return grew[0], grew[1], took

    gc.collect()
    gc.disable()
    try:
        with local_services(2) as svcs:
            got = run_ranks(svcs, body, timeout=240)
    finally:
        gc.enable()
    for blocks, objs, took in got:
        assert took >= n * 0.9  # the repeats took the one compiled call
        assert blocks < 0.5, got
        assert objs < 0.2, got

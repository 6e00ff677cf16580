"""The compiled lane's ready heap when an op rises (``lane_tables._raise``): a thread here
waits for it, or a peer's ``NEED`` came.  Its sends already in the heap move up in place,
so the next ones out are its own among equal priorities (pure: the heap's words in a small
``mem``, no transport)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from totalreduce import protocol as L
from totalreduce.lane.lane_tables import _heap_len, _heap_pop, _heap_push, _raise

NOPS, STKCAP = 8, 256


def heap_mem(prios: list[int]) -> np.ndarray:
    """A ``mem`` with an op table of ``NOPS`` ops (op ``s``: priority ``prios[s]``,
    submission ``s + 1``, not urgent) and an empty work stack and heap."""
    ops = L.C_LEN
    stk = ops + NOPS * L.O_N + 1
    mem = np.zeros(stk + STKCAP * 2 + 1 + STKCAP * 4 + 8, dtype=np.int64)
    mem[L.C_OPS], mem[L.C_STK], mem[L.C_STKCAP] = ops, stk, STKCAP
    for s, prio in enumerate(prios):
        mem[ops + s * L.O_N + L.O_PRIO] = prio
        mem[ops + s * L.O_N + L.O_SEQ] = s + 1
    return mem


def key(mem: np.ndarray, slot: int) -> tuple[int, int]:
    o = int(mem[L.C_OPS]) + slot * L.O_N
    return -int(mem[o + L.O_PRIO]) * 2 + (0 if mem[o + L.O_URGENT] else 1), int(mem[o + L.O_SEQ])


def pop_all(mem: np.ndarray) -> list[int]:
    """The ops of the heap's entries, in the order they come out."""
    base = int(mem[L.C_STK]) + STKCAP * 2 + 1
    out = []
    while _heap_len(mem) > 0:
        out.append(int(mem[base + 2]))
        _heap_pop(mem)
    return out


@pytest.mark.parametrize("seed", range(20))
def test_an_op_raised_comes_out_first_among_its_priority(seed: int) -> None:
    rng = random.Random(seed)
    prios = [rng.choice([0, 0, 1, 5]) for _ in range(NOPS)]
    mem = heap_mem(prios)
    entries = [rng.randrange(NOPS) for _ in range(rng.randrange(1, 200))]
    for i, slot in enumerate(entries):
        assert _heap_push(mem, slot, i)
    raised = rng.choice(entries)
    assert _raise(mem, raised)
    assert not _raise(mem, raised)  # once
    got = pop_all(mem)
    assert sorted(got) == sorted(entries)
    # Out in key order (priority, then urgency, then submission): the raised op's entries
    # before every unraised op of its priority, old as they are.
    keys = [key(mem, s) for s in got]
    assert keys == sorted(keys), (raised, prios, got)
    first = got.index(raised)
    assert all(prios[s] > prios[raised] for s in got[:first]), (raised, prios, got)


def test_entries_of_an_earlier_op_in_the_same_slot_keep_their_place() -> None:
    """A heap entry names its op's submission: one of a slot's earlier op is not raised."""
    mem = heap_mem([0] * NOPS)
    _heap_push(mem, 1, 0)
    _heap_push(mem, 3, 0)
    mem[int(mem[L.C_OPS]) + 3 * L.O_N + L.O_SEQ] = 99  # slot 3 holds a later op now
    _raise(mem, 3)
    assert pop_all(mem) == [1, 3]


def test_entries_left_by_a_failed_op_are_not_sent_as_its_slots_next_ops() -> None:
    """An op that fails with segments waiting in the heap (bodies put off while its peer
    had enough in flight) leaves their entries there; its slot may hold a later op by the
    time they come out.  They are dropped, never taken as that op's segments (which sent
    a later op's segment before its turn, or one past its plan: a frame of 0 bytes)."""
    from totalreduce.lane.lane_tables import _heap_next

    mem = heap_mem([0] * NOPS)
    ops = int(mem[L.C_OPS])
    for s in range(NOPS):
        mem[ops + s * L.O_N + L.O_STATE] = L.S_ACTIVE
    for i in range(5):
        _heap_push(mem, 3, 100 + i)  # the failed op's segments 100..104
    _heap_push(mem, 1, 7)
    mem[ops + 3 * L.O_N + L.O_SEQ] = 99  # slot 3 holds a later op now
    _heap_push(mem, 3, 0)  # its own segment 0
    got = []
    while _heap_len(mem) > 0:
        got.append(tuple(int(v) for v in _heap_next(mem)))
    assert sorted(got) == sorted([(-1, -1)] * 5 + [(1, 7), (3, 0)]), got
    # and entries of an op that failed and was not replaced: dropped too
    _heap_push(mem, 2, 4)
    mem[ops + 2 * L.O_N + L.O_STATE] = L.S_FAILED
    assert tuple(int(v) for v in _heap_next(mem)) == (-1, -1)

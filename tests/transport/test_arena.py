"""The node's arena (transport/arena.py): layout, placement of buffers, the error ring."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest

from totalreduce.errors import TotalReduceError
from totalreduce.transport import arena as A
from totalreduce.transport.shm import SharedRegion


def test_slots_do_not_overlap_and_a_client_maps_the_same_memory() -> None:
    a = A.Arena.create(3, 1 << 20)
    try:
        starts = [a.data_start(k) for k in range(3)]
        assert all(s2 - s1 == a.slot_bytes for s1, s2 in zip(starts, starts[1:], strict=False))
        assert a.data_bytes >= 1 << 20 and starts[-1] + a.data_bytes <= a.size
        assert a.fd is not None
        b = A.Arena.attach(os.dup(a.fd), a.size)
        x = a.view(starts[1], 4, np.dtype(np.float64))
        x[:] = [1, 2, 3, 4]
        y = b.view(starts[1], 4, np.dtype(np.float64))
        assert np.array_equal(y, [1, 2, 3, 4])
        assert b.offset_of(y) == starts[1] and b.offset_of(np.ones(4)) == -1
        a.control(1)[A.C_TAIL] = 7
        a.reset(1)
        assert not b.control(1).any()
        b.close()
    finally:
        a.close()


def test_a_memory_file_that_is_no_arena_is_refused() -> None:
    r = SharedRegion.create(1 << 16, "not-an-arena")
    assert r.fd is not None
    with pytest.raises(TotalReduceError, match="not a totalreduce arena"):
        A.Arena.attach(os.dup(r.fd), r.size)
    r.close_fd()


def test_allocator_places_frees_merges_and_says_when_full() -> None:
    space = A.Allocator(4096, 1 << 16)
    rng = random.Random(5)
    held: dict[int, int] = {}
    for _ in range(2000):
        if held and (rng.random() < 0.45 or len(held) > 40):
            at = rng.choice(list(held))
            space.free(at)
            del held[at]
        else:
            n = rng.randrange(1, 5000)
            at = space.alloc(n)
            if at < 0:
                continue
            assert at % A.ALIGN == 0 and 4096 <= at and at + n <= 4096 + (1 << 16)
            for b, m in held.items():  # no two blocks overlap
                assert at + n <= b or b + m <= at
            held[at] = n
    for at in list(held):
        space.free(at)
    assert space.used_bytes == 0
    assert space.alloc(1 << 16) == 4096  # all merged back into one run
    assert space.alloc(1) == -1


def test_error_ring_keeps_the_latest_texts() -> None:
    ctl = np.zeros(A.CONTROL_BYTES // 8, np.int64)
    for t in range(1, 100):
        A.write_error(ctl, t, A.E_MISMATCH, f"op {t}: ranks disagree é")
    assert A.read_error(ctl, 99) == (A.E_MISMATCH, "op 99: ranks disagree é")
    assert A.read_error(ctl, 99 - A.ERRORS + 1) is not None
    assert A.read_error(ctl, 99 - A.ERRORS) is None  # overwritten
    A.write_error(ctl, 100, A.E_FAILED, "x" * 5000)  # cut to the entry
    kind, text = A.read_error(ctl, 100) or (0, "")
    assert kind == A.E_FAILED and text == "x" * (A.ERROR_BYTES - 16)

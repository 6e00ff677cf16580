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


def test_a_large_block_starts_on_a_huge_page_and_its_gap_stays_free() -> None:
    H = A.HUGE_BYTES
    space = A.Allocator(4096 + 64, 3 * H)
    small = space.alloc(100)
    assert small == 4096 + 64
    big = space.alloc(H + 10)
    assert big % H == 0 and big >= small + 128
    in_gap = space.alloc(100)  # the gap before the large block is still free, first fit
    assert small < in_gap < big
    for at in (small, big, in_gap):
        space.free(at)
    assert space.used_bytes == 0 and space.alloc(3 * H) == 4096 + 64  # merged back
    # a large block where no run has room for it on a huge page goes where it fits
    tight = A.Allocator(4096, H + 4096)
    assert tight.alloc(H) == 4096


def _pmd_mapped_kib(address: int) -> int:
    """ShmemPmdMapped of this process's mapping that holds ``address``."""
    import re

    with open("/proc/self/smaps") as f:
        text = f.read()
    for m in re.finditer(r"(?m)^([0-9a-f]+)-([0-9a-f]+) .*\n((?:[A-Za-z_]+:.*\n)+)", text):
        if int(m.group(1), 16) <= address < int(m.group(2), 16):
            found = re.search(r"ShmemPmdMapped:\s+(\d+)", m.group(3))
            return int(found.group(1)) if found else 0
    raise AssertionError(f"no mapping holds {address:#x}")


def test_huge_pages_back_a_large_buffer_in_every_process_that_maps_it() -> None:
    """The arena is mapped on a huge page boundary by its maker and by a client; a large
    buffer made huge keeps its contents, and both map its pages whole."""
    H = A.HUGE_BYTES
    a = A.Arena.create(1, 4 * H)
    try:
        assert a.fd is not None
        b = A.Arena.attach(os.dup(a.fd), a.size)
        assert a.base % H == 0 and b.base % H == 0
        at = -(-a.data_start(0) // H) * H
        x = a.view(at, 2 * H // 8, np.dtype(np.int64))
        x[:] = np.arange(x.size)
        assert b.make_huge(at - 64, 64) == 0  # covers no whole huge page
        got = b.make_huge(at, 2 * H + 64)
        if got == 0:
            pytest.skip(
                "this kernel does not collapse shared memory into huge pages "
                "(MADV_COLLAPSE: Linux 6.1, and shmem_enabled other than deny)"
            )
        assert got == 2 * H and b.make_huge(at, 2 * H) == 2 * H  # the second time: kept
        y = b.view(at, 2 * H // 8, np.dtype(np.int64))
        assert np.array_equal(y, np.arange(y.size)) and np.array_equal(x, y)
        y[::512] += 1  # each side touches its pages: both map them whole
        assert int(x[512]) == 513
        assert _pmd_mapped_kib(a.base + at) >= 2 * H // 1024
        assert _pmd_mapped_kib(b.base + at) >= 2 * H // 1024
        del x, y
        b.close()
    finally:
        a.close()

"""Shared memory between a training process and its node's service.

This module owns three things:

- :class:`SharedRegion` (defined in ``transport/shm.py``, re-exported here):
  an anonymous memory file (``memfd_create``) mapped by both processes.  The
  client creates it, seals it against shrinking and growing, and hands its
  descriptor to the service over the socket; the service checks the seals and
  the size before mapping it, so a client cannot make the service fault by
  truncating memory the service reads.  Nothing has a name in the file system:
  the memory is freed when the last descriptor and mapping are gone, whichever
  side dies first, with nothing to unlink.
- :class:`ControlBlock`: one region per client holding a completion slot per op
  in flight (sequence number, state, error kind and length) and the slots'
  error texts.  The service writes a slot when the op ends; the client polls
  it with plain memory reads, no system call.
- :class:`FreeList`: the first-fit allocator the client uses to stage arrays
  that were not allocated in registered memory.

The service writes an op's result before the slot's state, and the client reads
the state before the result.  Both are ordinary stores and loads, so this relies
on the CPU keeping stores in order (x86-64 does); see docs/daemon.md.
"""

from __future__ import annotations

from bisect import bisect_left

import numpy as np

from ..errors import TotalReduceError

# The sealed memory file moved to transport/shm.py (the shared-memory transport
# builds its channels on it); re-exported here so old imports keep working.
from ..transport.shm import PAGE, REQUIRED_SEALS, SharedRegion, round_up  # noqa: F401

# ---------------------------------------------------------------------- control block

PENDING = 0
DONE = 1
FAILED = 2

#: Error kinds a failed slot carries (the client raises the matching class).
ERROR_FAILED = 1
ERROR_MISMATCH = 2
ERROR_INVALID = 3
ERROR_OTHER = 4

MAGIC = 0x5452_4454_4C42_0001  # "TRDTLB" v1
_HEADER_WORDS = 8
_SLOT_WORDS = 4  # seq, state, error length, error kind
ERROR_BYTES = 1024
MAX_SLOTS = 1 << 16


class ControlBlock:
    """Completion slots of one client's ops, in a shared region.

    The client arms a slot (``arm``) before submitting an op that names it;
    the service ends it once (``complete`` or ``fail``), checking the sequence
    number so a late write can never land on a slot already reused.  The
    header's ``waiters`` word counts the client's threads blocked on its wake-up
    descriptor: only then does the service signal it after ending a slot.
    """

    def __init__(self, region: SharedRegion, slots: int) -> None:
        if not 1 <= slots <= MAX_SLOTS:
            raise TotalReduceError(f"a control block has 1..{MAX_SLOTS} slots, not {slots}")
        if region.size != self.size_for(slots):
            raise TotalReduceError(
                f"a control block of {slots} slots is {self.size_for(slots)} bytes, "
                f"not {region.size}"
            )
        self.region = region
        self.slots = slots
        words = _HEADER_WORDS + slots * _SLOT_WORDS
        self.header = region.array(0, _HEADER_WORDS, np.int64)
        self.table = region.array(0, words, np.int64)[_HEADER_WORDS:].reshape(slots, _SLOT_WORDS)
        self.errors = region.array(words * 8, slots * ERROR_BYTES, np.uint8).reshape(
            slots, ERROR_BYTES
        )

    @staticmethod
    def size_for(slots: int) -> int:
        return round_up((_HEADER_WORDS + slots * _SLOT_WORDS) * 8 + slots * ERROR_BYTES)

    @classmethod
    def create(cls, slots: int) -> ControlBlock:
        block = cls(SharedRegion.create(cls.size_for(slots), "control"), slots)
        block.header[0] = MAGIC
        block.header[1] = slots
        return block

    @classmethod
    def attach(cls, fd: int, slots: int) -> ControlBlock:
        block = cls(SharedRegion.attach(fd, cls.size_for(slots)), slots)
        if int(block.header[0]) != MAGIC or int(block.header[1]) != slots:
            raise TotalReduceError("the control block's header is not a totalreduce control block")
        return block

    @property
    def waiters(self) -> int:
        return int(self.header[2])

    @waiters.setter
    def waiters(self, n: int) -> None:
        self.header[2] = n

    # client side
    def arm(self, slot: int, seq: int) -> None:
        row = self.table[slot]
        row[1] = PENDING
        row[2] = 0
        row[3] = 0
        row[0] = seq

    def state(self, slot: int) -> int:
        return int(self.table[slot, 1])

    def error(self, slot: int) -> tuple[int, str]:
        n = min(int(self.table[slot, 2]), ERROR_BYTES)
        text = bytes(self.errors[slot, :n]).decode("utf-8", errors="replace")
        return int(self.table[slot, 3]), text

    # service side
    def complete(self, slot: int, seq: int) -> bool:
        row = self.table[slot]
        if int(row[0]) != seq or int(row[1]) != PENDING:
            return False
        row[1] = DONE
        return True

    def fail(self, slot: int, seq: int, kind: int, text: str) -> bool:
        row = self.table[slot]
        if int(row[0]) != seq or int(row[1]) != PENDING:
            return False
        raw = text.encode("utf-8", errors="replace")[:ERROR_BYTES]
        self.errors[slot, : len(raw)] = np.frombuffer(raw, dtype=np.uint8)
        row[2] = len(raw)
        row[3] = kind
        row[1] = FAILED
        return True


# ---------------------------------------------------------------------- allocator


class FreeList:
    """First-fit allocation of byte ranges in ``[0, size)``, aligned to ``align``.

    >>> f = FreeList(1024)
    >>> a, b = f.alloc(100), f.alloc(100)
    >>> (a, b)
    (0, 128)
    >>> f.free(a, 100); f.alloc(64)
    0
    """

    def __init__(self, size: int, align: int = 64) -> None:
        self.size = size
        self.align = align
        self._starts: list[int] = [0]  # sorted free block starts
        self._lengths: dict[int, int] = {0: size}
        self.used = 0

    def _round(self, n: int) -> int:
        return max(self.align, (n + self.align - 1) // self.align * self.align)

    def alloc(self, nbytes: int) -> int | None:
        """Offset of a new block of ``nbytes``, or None if no free block is big enough."""
        n = self._round(nbytes)
        for i, start in enumerate(self._starts):
            length = self._lengths[start]
            if length >= n:
                del self._lengths[start]
                if length == n:
                    del self._starts[i]
                else:
                    self._starts[i] = start + n
                    self._lengths[start + n] = length - n
                self.used += n
                return start
        return None

    def free(self, offset: int, nbytes: int) -> None:
        n = self._round(nbytes)
        self.used -= n
        i = bisect_left(self._starts, offset)
        end = offset + n
        # merge with the next block
        if i < len(self._starts) and self._starts[i] == end:
            n += self._lengths.pop(self._starts[i])
            del self._starts[i]
        # merge with the previous block
        if i > 0:
            prev = self._starts[i - 1]
            if prev + self._lengths[prev] == offset:
                self._lengths[prev] += n
                return
        self._starts.insert(i, offset)
        self._lengths[offset] = n

    @property
    def empty(self) -> bool:
        return self.used == 0

"""A node's arena: the shared memory between a node's service and its thin clients.

One sealed memory file per node, made by the service and mapped by every client
it admits (the file descriptor travels with ``welcome``).  A header page, then
one *slot* per local client:

- the slot's **control block**: the submission ring (the client writes op
  descriptors, the service reads them), one completion word per ring entry (the
  service writes the op's ticket there when it is done, minus the ticket when it
  failed), a ring of error texts, and the sleeping flag of the client;
- the slot's **data region**, where the client places the buffers of its ops:
  arrays it allocated there (:meth:`Arena.empty`, zero copy), or staging copies
  of other arrays.  The service reads and writes the buffers in place.

After the slots, the node's *meeting place* (:mod:`.meeting`): where a one-node
service's clients run the world's allreduces, broadcasts and barriers among themselves,
and any service's clients those over groups of the node's clients, without the service
(``H_MEET_ON`` says whether they do: ``MEET_WORLD`` both, ``MEET_GROUPS`` only groups').

Words are ``int64``; one side writes each (the client the tail and the
descriptors, the service the head, the completion words and the error ring).
A side about to sleep sets its flag, :func:`~.shm.fence`, checks again, then
sleeps on its eventfd; the other side writes the eventfd only when it sees the
flag.  Nothing here calls MPI or does arithmetic on payload.
"""

from __future__ import annotations

import bisect
import threading
from typing import Any

import numpy as np

from .. import protocol as P
from ..errors import TotalReduceError
from .shm import HUGE, SharedRegion, round_up

# The arena's layout is declared with the protocol (totalreduce/protocol.py, AR_*): the
# header page's words, a descriptor's fields and flags, a control block's words and places,
# the error kinds of an error entry (ErrorCode's numbers).
MAGIC = P.AR_MAGIC
H_MAGIC = P.AR_H_MAGIC
H_SLOTS = P.AR_H_SLOTS
H_SLOT_BYTES = P.AR_H_SLOT_BYTES
H_CONTROL_BYTES = P.AR_H_CONTROL_BYTES
H_SERVICE_SLEEPING = P.AR_H_SERVICE_SLEEPING
H_MEET = P.AR_H_MEET
H_MEET_ON = P.AR_H_MEET_ON
MEET_WORLD, MEET_GROUPS = P.AR_MEET_WORLD, P.AR_MEET_GROUPS
H_LOOP_ENTERED = P.AR_H_LOOP_ENTERED
H_LOOP_RAN = P.AR_H_LOOP_RAN
H_HOST_PROCS = P.AR_H_HOST_PROCS
HEADER_BYTES = P.AR_HEADER_BYTES
RING = P.AR_RING
D_WORDS = P.AR_D_WORDS
D_TICKET = P.AR_D_TICKET
D_KIND = P.AR_D_KIND
D_WIRE = P.AR_D_WIRE
D_GEN = P.AR_D_GEN
D_DTYPE = P.AR_D_DTYPE
D_COUNT = P.AR_D_COUNT
D_OP = P.AR_D_OP
D_ROOT = P.AR_D_ROOT
D_PRIO = P.AR_D_PRIO
D_IN = P.AR_D_IN
D_OUT = P.AR_D_OUT
D_FLAGS = P.AR_D_FLAGS
D_GROUP = P.AR_D_GROUP
D_CTX = P.AR_D_CTX
D_AUX = P.AR_D_AUX
D_ALGO = P.AR_D_ALGO
F_AVG = P.AR_F_AVG
F_UNNAMED = P.AR_F_UNNAMED
F_PASSIVE = P.AR_F_PASSIVE
C_TAIL = P.AR_C_TAIL
C_HEAD = P.AR_C_HEAD
C_SLEEPING = P.AR_C_SLEEPING
C_ERR_TAIL = P.AR_C_ERR_TAIL
C_LATE = P.AR_C_LATE
C_FUTEX = P.AR_C_FUTEX
RING_WORD = P.AR_RING_WORD
DONE_WORD = P.AR_DONE_WORD
ERRORS = P.AR_ERRORS
ERROR_BYTES = P.AR_ERROR_BYTES
ERROR_WORD = P.AR_ERROR_WORD
CONTROL_BYTES = P.AR_CONTROL_BYTES
E_FAILED = P.AR_E_FAILED
E_MISMATCH = P.AR_E_MISMATCH
E_INVALID = P.AR_E_INVALID
E_TRANSPORT = P.AR_E_TRANSPORT

# ---------------------------------------------------------------- the meeting place (meeting.py)
#: Generations of one name a client may have in flight at the meeting (more wait).
MEET_DEPTH = 8
#: Most bytes the meeting place takes (fewer channels where a node has many clients).
MEET_BUDGET = 16 << 20
MEET_CHANNELS = 2048
MEET_MIN_CHANNELS = 64
MEET_HEADER = 4096
#: An op slot's state and work lines, then one line per client.
MEET_ENTRY = 128


def meeting_layout(slots: int) -> tuple[int, int, int, int]:
    """(channels, channel bytes, op slot bytes, bytes in all) of the meeting place of
    ``slots`` clients: its header page, its queue (16 bytes per op slot), its channels."""
    osb = MEET_ENTRY + 64 * slots
    chb = 64 + MEET_DEPTH * osb
    c = MEET_CHANNELS
    while c > MEET_MIN_CHANNELS and c * chb > MEET_BUDGET:
        c //= 2
    return c, chb, osb, MEET_HEADER + round_up(c * MEET_DEPTH * 16, 4096) + c * chb


#: Buffers are placed on this alignment (a cache line) ...
ALIGN = 64
#: ... and those of at least a huge page on a huge page (:meth:`Arena.make_huge`).
HUGE_BYTES = HUGE


def signed(wire: int) -> int:
    """A 64-bit wire id as the signed word a descriptor holds."""
    return wire - (1 << 64) if wire >= 1 << 63 else wire


class Arena:
    """The mapped arena of one node (the service's, or a client's view of it)."""

    def __init__(self, region: SharedRegion) -> None:
        self.region = region
        self.header = region.array(0, HEADER_BYTES // 8, np.int64)
        if int(self.header[H_MAGIC]) != MAGIC:
            raise TotalReduceError("the arena's memory file is not a totalreduce arena")
        self.slots = int(self.header[H_SLOTS])
        self.slot_bytes = int(self.header[H_SLOT_BYTES])
        self.size = region.size
        self.base = region.address
        meet = HEADER_BYTES + self.slots * self.slot_bytes
        if int(self.header[H_MEET]) != meet or meet + meeting_layout(self.slots)[3] > self.size:
            raise TotalReduceError("the arena's header describes more slots than it holds")
        self.data_bytes = self.slot_bytes - CONTROL_BYTES
        self.bytes = region.bytes()

    @classmethod
    def create(cls, slots: int, data_bytes: int) -> Arena:
        """A new arena of ``slots`` slots with ``data_bytes`` of buffers each (rounded up)."""
        slot_bytes = CONTROL_BYTES + round_up(max(data_bytes, 1 << 16), 1 << 20)
        meet = HEADER_BYTES + slots * slot_bytes
        region = SharedRegion.create(meet + meeting_layout(slots)[3], "arena", huge=True)
        h = region.array(0, HEADER_BYTES // 8, np.int64)
        h[H_SLOTS], h[H_SLOT_BYTES], h[H_CONTROL_BYTES] = slots, slot_bytes, CONTROL_BYTES
        h[H_MEET] = meet
        h[H_MAGIC] = MAGIC
        return cls(region)

    @classmethod
    def attach(cls, fd: int, size: int) -> Arena:
        """Map the arena a service sent (takes ownership of ``fd``)."""
        return cls(SharedRegion.attach(fd, size, huge=True))

    @property
    def fd(self) -> int | None:
        return self.region.fd

    def slot_start(self, slot: int) -> int:
        return HEADER_BYTES + slot * self.slot_bytes

    def control(self, slot: int) -> np.ndarray:
        """Slot ``slot``'s control block as int64 words."""
        return self.region.array(self.slot_start(slot), CONTROL_BYTES // 8, np.int64)

    def data_start(self, slot: int) -> int:
        """The arena offset of slot ``slot``'s data region."""
        return self.slot_start(slot) + CONTROL_BYTES

    def reset(self, slot: int) -> None:
        """Zero a slot's control block (the service, before a new client takes the slot)."""
        self.control(slot)[:] = 0

    def view(self, offset: int, count: int, dtype: np.dtype) -> np.ndarray:
        """``count`` elements of ``dtype`` at arena byte ``offset``."""
        return self.region.array(offset, count, dtype)

    def make_huge(self, offset: int, nbytes: int) -> int:
        """Back a buffer's whole huge pages with huge pages (best effort: see
        :meth:`~.shm.SharedRegion.make_huge`); the bytes so backed."""
        return self.region.make_huge(offset, nbytes)

    def offset_of(self, arr: np.ndarray) -> int:
        """The arena offset of a C-contiguous ``arr`` that lies in the arena, else -1."""
        addr = int(arr.__array_interface__["data"][0]) - self.base
        if 0 <= addr and addr + arr.nbytes <= self.size:
            return addr
        return -1

    def close(self) -> None:
        self.bytes = self.header = None  # type: ignore[assignment]
        try:
            self.region.mm.close()
        except BufferError:  # an array of it is still alive: the mapping goes with it
            pass
        self.region.close_fd()


def write_error(ctl: np.ndarray, ticket: int, kind: int, text: str) -> None:
    """The service: append the error text of op ``ticket`` to a slot's error ring."""
    i = int(ctl[C_ERR_TAIL]) % ERRORS
    raw = text.encode("utf-8", "replace")[: ERROR_BYTES - 16]
    entry = ctl[ERROR_WORD + i * (ERROR_BYTES // 8) : ERROR_WORD + (i + 1) * (ERROR_BYTES // 8)]
    entry[0] = ticket
    entry[1] = kind << 32 | len(raw)
    entry.view(np.uint8)[16 : 16 + len(raw)] = np.frombuffer(raw, np.uint8)
    ctl[C_ERR_TAIL] += 1


def read_error(ctl: np.ndarray, ticket: int) -> tuple[int, str] | None:
    """The client: the error kind and text of op ``ticket``, if still in the ring."""
    tail = int(ctl[C_ERR_TAIL])
    for n in range(tail - 1, max(-1, tail - 1 - ERRORS), -1):
        i = n % ERRORS
        entry = ctl[ERROR_WORD + i * (ERROR_BYTES // 8) : ERROR_WORD + (i + 1) * (ERROR_BYTES // 8)]
        if int(entry[0]) == ticket:
            kind, length = int(entry[1]) >> 32, int(entry[1]) & 0xFFFF_FFFF
            raw = entry.view(np.uint8)[16 : 16 + min(length, ERROR_BYTES - 16)].tobytes()
            return kind, raw.decode("utf-8", "replace")
    return None


class Allocator:
    """First-fit placement of buffers in one slot's data region (a client's own; any thread).

    Offsets are arena offsets.  ``alloc`` returns -1 when no free run is long enough:
    the caller waits for its ops in flight to give staging back (backpressure).  A block
    of at least :data:`HUGE_BYTES` starts on a huge page (where a run has room for that;
    else anywhere it fits), so that huge pages can back it.
    """

    def __init__(self, start: int, size: int) -> None:
        self.start, self.size = start, size
        self._free_at: list[int] = [start]  # sorted starts of the free runs
        self._free_len: dict[int, int] = {start: size}
        self._used: dict[int, int] = {}
        self._lock = threading.Lock()

    @property
    def used_bytes(self) -> int:
        return sum(self._used.values())

    def alloc(self, nbytes: int) -> int:
        n = max(ALIGN, (nbytes + ALIGN - 1) // ALIGN * ALIGN)
        with self._lock:
            if n >= HUGE_BYTES:
                for at in self._free_at:
                    gap = -at % HUGE_BYTES
                    if self._free_len[at] >= gap + n:
                        return self._take(at, gap, n)
            for at in self._free_at:
                if self._free_len[at] >= n:
                    return self._take(at, 0, n)
        return -1

    def _take(self, at: int, gap: int, n: int) -> int:
        """Use ``n`` bytes ``gap`` bytes into the free run at ``at`` (the gap stays free)."""
        run = self._free_len.pop(at)
        self._free_at.remove(at)
        if gap:
            bisect.insort(self._free_at, at)
            self._free_len[at] = gap
        if run > gap + n:
            bisect.insort(self._free_at, at + gap + n)
            self._free_len[at + gap + n] = run - gap - n
        self._used[at + gap] = n
        return at + gap

    def free(self, at: int) -> None:
        with self._lock:
            n = self._used.pop(at)
            i = bisect.bisect_left(self._free_at, at)
            # merge with the next run, then with the previous one
            if i < len(self._free_at) and self._free_at[i] == at + n:
                n += self._free_len.pop(self._free_at.pop(i))
            if i > 0 and self._free_at[i - 1] + self._free_len[self._free_at[i - 1]] == at:
                self._free_len[self._free_at[i - 1]] += n
            else:
                self._free_at.insert(i, at)
                self._free_len[at] = n


def describe(arr: Any) -> str:
    return f"{getattr(arr, 'dtype', '?')}{list(getattr(arr, 'shape', ()))}"

"""Growing the compiled lane's tables between compiled calls: the pool of frame slots and
the body request table, when compiled code ran out of one (``C_FULL``, ``C_BFULL``).

Both live in ``mem`` (the pool's slots in an array of their own); a larger copy replaces
each, so nothing compiled may hold one across the call that grows it (the caller holds the
main loop's lock).  Early frames never grow the pool: their slots are bounded by the
credit granted to the peers (``lane_receive``); only bodies of ops submitted here, staged
until their turn, can run it out.
"""

from __future__ import annotations

import logging

import numpy as np

from .. import protocol as L
from ..transport import mpi_native

log = logging.getLogger("totalreduce.engine")


def _status_words(b: np.ndarray) -> int:
    """int64 words of one ``MPI_Status`` of the binding's library."""
    return (int(b[mpi_native.B_STATUS_BYTES]) + 7) // 8


class LaneGrowth:
    """A base of :class:`~.lane.Lane`: its ``grow``."""

    mem: np.ndarray
    arena: np.ndarray
    pool: np.ndarray
    b: np.ndarray
    rank: int

    def grow(self) -> None:
        """Compiled code is out of pool slots (``C_FULL``) or body requests (``C_BFULL``):
        double what ran out.  Both live in ``mem`` (and the pool in the arena too), which
        are replaced by larger copies between compiled calls."""
        if self.mem[L.C_FULL] == 1:  # (2: the control events wait for Python, no slot)
            self._grow_pool()
        if self.mem[L.C_BFULL]:
            self._grow_requests()

    def _grow_requests(self) -> None:
        """Double the body request table: its entries, handles (MPI keeps no pointer to
        them between calls), and room for ``MPI_Testsome``'s indices and statuses, at the
        end of a larger ``mem``; the bodies that waited go in the next pass."""
        mem = self.mem
        old = int(mem[L.C_BREQCAP])
        new = 2 * old
        n = int(mem[L.C_NBREQ])
        hb = int(self.b[mpi_native.B_HANDLE_BYTES])
        words = new * L.BR_N + new + (new + 1) // 2 + new * _status_words(self.b)
        end = mem.size
        bigger = np.zeros(end + words, dtype=np.int64)
        bigger[:end] = mem
        breq, breqh = end, end + new * L.BR_N
        bidx = breqh + new
        bst = bidx + (new + 1) // 2
        at = int(mem[L.C_BREQ])
        bigger[breq : breq + n * L.BR_N] = mem[at : at + n * L.BR_N]
        h0 = int(mem[L.C_BREQH]) * 8
        bigger.view(np.uint8)[breqh * 8 : breqh * 8 + n * hb] = mem.view(np.uint8)[h0 : h0 + n * hb]
        bigger[L.C_BREQ] = breq
        bigger[L.C_BREQH] = breqh
        bigger[L.C_BIDX] = bidx
        bigger[L.C_BST] = bst
        bigger[L.C_BREQCAP] = new
        bigger[L.C_BFULL] = 0
        self.mem = bigger
        log.info("rank %d: the lane's body requests grew to %d", self.rank, new)

    def _grow_pool(self) -> None:
        """The pool is out of slots (bodies of submitted ops staged until their turn):
        double it.  Nothing outside compiled calls points into the slots (MPI reads and
        writes the arena's buffers only), so the old array goes at once."""
        mem = self.mem
        old = int(mem[L.C_NSLOTS])
        slot_bytes = int(mem[L.C_SLOT])
        pool = np.zeros(2 * old * slot_bytes, dtype=np.uint8)
        pool[: self.pool.size] = self.pool
        self.pool = pool
        # meta and the free stack live in mem with room for ``old`` slots: move both to
        # a larger mem.
        meta = int(mem[L.C_META])
        free = int(mem[L.C_FREESLOT])
        end = mem.size
        bigger = np.zeros(end + 2 * old * L.M_N + 2 * old, dtype=np.int64)
        bigger[:end] = mem
        new_meta = end
        new_free = end + 2 * old * L.M_N
        bigger[new_meta : new_meta + old * L.M_N] = mem[meta : meta + old * L.M_N]
        nfree = int(mem[L.C_NFREE])
        bigger[new_free : new_free + nfree] = mem[free : free + nfree]
        bigger[new_free + nfree : new_free + nfree + old] = np.arange(2 * old - 1, old - 1, -1)
        bigger[L.C_META] = new_meta
        bigger[L.C_FREESLOT] = new_free
        bigger[L.C_NFREE] = nfree + old
        bigger[L.C_NSLOTS] = 2 * old
        bigger[L.C_POOL] = pool.ctypes.data
        self.mem = bigger
        log.info("rank %d: the lane's pool grew to %d slots", self.rank, 2 * old)

"""Floating messages and the buffer pool they live in.

A frame for an op this rank has not submitted yet (the seed's ahead-of-time
message) is kept in the :class:`FloatingList` under its op id until the op is
submitted.  Two kinds of frame float, and both are bounded:

- an eager body (up to ``micro_bytes``) is stored within its sender's eager
  credit: the sender spends credit on every eager frame and gets it back when
  the frame is consumed here, so one peer can never hold more than its share;
- a large body is received into the pool only when the pool has room for it
  (``rendezvous`` share); otherwise the announcement is refused and the sender
  keeps the body until this rank submits the op and says so.

So the bytes held for ops not submitted here never exceed ``floating_pool_bytes``,
whatever the peers send and in whatever order.  :class:`BufferPool` recycles
buffers by power-of-two size class.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from dataclasses import dataclass

import numpy as np

from . import wire
from .payload import OpKey


class BufferPool:
    """Reusable byte buffers in power-of-two size classes."""

    def __init__(self, keep_per_class: int = 8) -> None:
        self._free: dict[int, list[np.ndarray]] = defaultdict(list)
        self._keep = keep_per_class
        self._work: dict[int, list[np.ndarray]] = {}
        self._work_bytes = 0
        self.work_cache_bytes = 512 << 20

    @staticmethod
    def _class(nbytes: int) -> int:
        return max(64, 1 << max(0, nbytes - 1).bit_length())

    def take(self, nbytes: int) -> np.ndarray:
        """A ``uint8`` array of exactly ``nbytes`` (a view of a pooled buffer)."""
        c = self._class(nbytes)
        free = self._free[c]
        base = free.pop() if free else np.empty(c, dtype=np.uint8)
        return base[:nbytes]

    def give(self, buf: np.ndarray) -> None:
        base = buf.base if buf.base is not None else buf
        if isinstance(base, np.ndarray) and base.dtype == np.uint8 and base.ndim == 1:
            free = self._free[base.size]
            if len(free) < self._keep and base.size == self._class(base.size):
                free.append(base)

    def take_work(self, nbytes: int) -> np.ndarray:
        """A scratch array for a schedule's WORK buffer, reused across ops of similar size.

        Reuse matters for big ops: a fresh 64 MiB array costs thousands of page
        faults on first touch.  At most ``work_cache_bytes`` are kept.
        """
        c = self._class(nbytes)
        free = self._work.get(c)
        if free:
            base = free.pop()
            self._work_bytes -= c
        else:
            base = np.empty(c, dtype=np.uint8)
        return base[:nbytes]

    def give_work(self, buf: np.ndarray) -> None:
        base = buf.base if buf.base is not None else buf
        if not isinstance(base, np.ndarray) or base.dtype != np.uint8 or base.ndim != 1:
            return
        c = base.size
        if c != self._class(c) or self._work_bytes + c > self.work_cache_bytes:
            return
        self._work.setdefault(c, []).append(base)
        self._work_bytes += c


@dataclass(eq=False, slots=True)
class FloatingFrame:
    """A received frame waiting for its op to be submitted here."""

    frame: wire.Frame
    body: np.ndarray
    source: int
    eager: int  # eager credit it holds (0: a rendezvous body, held in the pool share)


class FloatingList:
    """Frames of ops not submitted yet, by op id, in arrival order, with their byte counts."""

    def __init__(self, limit: int, size: int) -> None:
        self.limit = limit
        peers = max(1, size - 1)
        #: Eager credit each peer gets: half the pool, shared equally.
        self.eager_share = limit // (2 * peers)
        #: Bytes of large bodies the pool takes for ops not submitted here.
        self.rendezvous_limit = limit - peers * self.eager_share
        self.eager_held = [0] * size  # per peer
        self.rendezvous_held = 0  # received or reserved
        self.held = 0  # both, kept as a running total
        self.peak = 0
        self._frames: dict[OpKey, list[FloatingFrame]] = defaultdict(list)
        self._errors: OrderedDict[OpKey, tuple[str, int]] = OrderedDict()

    def _note_peak(self) -> None:
        if self.held > self.peak:
            self.peak = self.held

    def reserve(self, nbytes: int) -> bool:
        """Room for a large body of an op not submitted here? Reserve it if so."""
        if self.rendezvous_held + nbytes > self.rendezvous_limit:
            return False
        self.rendezvous_held += nbytes
        self.held += nbytes
        self._note_peak()
        return True

    def release(self, nbytes: int) -> None:
        self.rendezvous_held -= nbytes
        self.held -= nbytes

    def add(self, key: OpKey, ff: FloatingFrame) -> None:
        """File a frame (a rendezvous body's bytes were reserved already)."""
        self._frames[key].append(ff)
        if ff.eager:
            self.eager_held[ff.source] += ff.eager
            self.held += ff.eager
            self._note_peak()

    def take(self, key: OpKey) -> list[FloatingFrame]:
        """The frames of op ``key``, now submitted; their bytes leave the pool."""
        frames = self._frames.pop(key, [])
        for ff in frames:
            if ff.eager:
                self.eager_held[ff.source] -= ff.eager
                self.held -= ff.eager
            else:
                self.rendezvous_held -= ff.body.nbytes
                self.held -= ff.body.nbytes
        return frames

    def add_error(self, key: OpKey, message: str, code: int) -> None:
        """An op failed on a peer before this rank submitted it."""
        if len(self._errors) > 4096:  # old ones belong to ops nobody will submit
            self._errors.popitem(last=False)
        self._errors[key] = (message, code)

    def has_error(self, key: OpKey) -> bool:
        return key in self._errors

    def take_error(self, key: OpKey) -> tuple[str, int] | None:
        return self._errors.pop(key, None)

    def __len__(self) -> int:
        return sum(len(v) for v in self._frames.values())

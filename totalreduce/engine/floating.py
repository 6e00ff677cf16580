"""Floating messages and the buffer pool they live in.

A frame for an op this rank has not submitted yet (the seed's ahead-of-time
message) is received into a pooled buffer and filed in the
:class:`FloatingList` under its op id, with its header, until the op is
submitted.  Frames of a known op that cannot be applied yet wait in the
op's own pending map, in buffers of the same pool.

The :class:`BufferPool` recycles buffers by power-of-two size class and
bounds the bytes held by floating frames: when the bound is reached the comm
loop stops posting body receives for unknown ops (the senders' MPI sends
simply stay pending: backpressure), it never drops data.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from .payload import OpKey
from .wire import Header


class BufferPool:
    """Reusable byte buffers in power-of-two size classes."""

    def __init__(self, floating_limit: int, keep_per_class: int = 8) -> None:
        self.floating_limit = floating_limit
        self.floating_bytes = 0
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

    def can_float(self, nbytes: int) -> bool:
        return self.floating_bytes + nbytes <= self.floating_limit or self.floating_bytes == 0


@dataclass(eq=False)
class FloatingFrame:
    """A received frame (header and body) waiting for its op to be submitted."""

    header: Header
    body: np.ndarray


class FloatingList:
    """Frames of ops not submitted yet, by op id, in arrival order."""

    def __init__(self, pool: BufferPool) -> None:
        self.pool = pool
        self._frames: dict[OpKey, list[FloatingFrame]] = defaultdict(list)
        self._errors: dict[OpKey, tuple[str, int]] = {}

    def add(self, key: OpKey, frame: FloatingFrame) -> None:
        self._frames[key].append(frame)
        self.pool.floating_bytes += frame.body.nbytes

    def take(self, key: OpKey) -> list[FloatingFrame]:
        frames = self._frames.pop(key, [])
        for f in frames:
            self.pool.floating_bytes -= f.body.nbytes
        return frames

    def add_error(self, key: OpKey, message: str, code: int) -> None:
        """An op failed on a peer before this rank submitted it."""
        if len(self._errors) > 4096:  # old ones belong to ops nobody will submit
            self._errors.pop(next(iter(self._errors)))
        self._errors[key] = (message, code)

    def take_error(self, key: OpKey) -> tuple[str, int] | None:
        return self._errors.pop(key, None)

    def __len__(self) -> int:
        return sum(len(v) for v in self._frames.values())

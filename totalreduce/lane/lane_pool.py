"""The lane's pool of large buffers: scratch that receives land in, and private copies of
in-place inputs.

A buffer of a few hundred KiB from ``numpy.empty`` is a fresh ``mmap`` each time (glibc
maps allocations above its threshold), so every op that took one paid a page fault per
4 KiB and the kernel's zeroing, and gave the pages back when it ended. The pool keeps
buffers of each size that ops gave back, as many as were ever in use at once (the
high-water mark, at least ``min_per_size``), within ``max_bytes`` in all: a training step
that has 60 gradients of one size in flight takes all 60 from the pool in the next step.
Before, the pool kept 4 per size, and 64 allreduces of 754 KB in flight at once took
2.3x as long as with the high-water mark (``docs/benchmarks.md``).

What the pool keeps is memory the process already needed at once; it goes with the lane.
"""

from __future__ import annotations

import numpy as np


class BufferPool:
    """Byte buffers by exact size; see the module docstring."""

    def __init__(self, max_bytes: int, min_per_size: int) -> None:
        self.max_bytes = max_bytes
        self.min_per_size = min_per_size
        self.free: dict[int, list[np.ndarray]] = {}
        self.pooled_bytes = 0
        self._busy: dict[int, int] = {}  # buffers of each size taken and not back
        self._peak: dict[int, int] = {}  # most of each size taken at once

    def take(self, nbytes: int) -> np.ndarray:
        """A buffer of ``nbytes`` bytes (uint8): a pooled one, else a new one."""
        busy = self._busy.get(nbytes, 0) + 1
        self._busy[nbytes] = busy
        if busy > self._peak.get(nbytes, 0):
            self._peak[nbytes] = busy
        free = self.free.get(nbytes)
        if free:
            self.pooled_bytes -= nbytes
            return free.pop()
        return np.empty(nbytes, dtype=np.uint8)

    def give(self, raw: np.ndarray) -> None:
        """``raw`` (from :meth:`take`) is free again: kept, or let go."""
        n = raw.size
        free = self.free.setdefault(n, [])
        keep = max(self.min_per_size, self._peak.get(n, 0))
        if len(free) < keep and self.pooled_bytes + n <= self.max_bytes:
            free.append(raw)
            self.pooled_bytes += n
        busy = self._busy.get(n, 0) - 1
        if busy > 0:
            self._busy[n] = busy
            return
        self._busy.pop(n, None)
        if not self.free.get(n):  # nothing of this size kept: forget it (sizes may not recur)
            self.free.pop(n, None)
            self._peak.pop(n, None)

    def in_use(self, nbytes: int) -> int:
        """Buffers of ``nbytes`` taken and not given back."""
        return self._busy.get(nbytes, 0)

    def peak(self, nbytes: int) -> int:
        """Most buffers of ``nbytes`` in use at once, while the size is remembered."""
        return self._peak.get(nbytes, 0)

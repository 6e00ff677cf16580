"""Shared memory between a node's service and its local clients: regions, barrier, waking.

This module owns:

- :class:`SharedRegion`: an anonymous memory file (``memfd_create``) mapped by
  several processes (the node's arena, :mod:`totalreduce.transport.arena`, is
  one).  Its creator seals it against shrinking and growing and hands its
  descriptor over; the receiver checks the seals and the size before mapping
  it, so the other side cannot make it fault by truncating memory it reads.
  Nothing has a name in the file system: the memory is freed when the last
  descriptor and mapping are gone, whichever side dies first.
- :func:`fence`, and the eventfds a side sleeps on and the other writes.

Memory ordering: both sides use ordinary stores and loads (numpy assignments
into the mapping, aligned 8-byte words) and rely on x86-64's TSO: stores become
visible in program order and loads are not reordered with older loads.  A
writer stores what a word describes *before* the word (a descriptor before the
ring's tail, a result before the completion word), and a reader loads the word
*before* what it describes, so neither side sees a word before what it
describes.  The one reordering TSO allows, a later load passing an earlier
store (StoreLoad), would lose a wake-up (the sleeper sets its flag and checks
for work while the other side adds work and checks the flag, each seeing the
other's old value), so both sides put a full barrier between the two:
:func:`fence`, an uncontended lock acquire and release, which CPython
implements with ``lock``-prefixed instructions (a full barrier on x86-64).  See
docs/daemon.md.

Waking: each process has one eventfd (nonblocking, close-on-exec).  A side
about to sleep sets its sleeping flag, fences, re-checks for work and only then
sleeps in ``select`` on its eventfd; a side that gave the other work writes the
other side's eventfd only if that side's flag is set, so the busy path costs no
system call.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import select
import stat
import threading

import numpy as np

from ..errors import TotalReduceError

log = logging.getLogger("totalreduce.transport.shm")

PAGE = mmap.PAGESIZE
#: Seals a region must carry before the receiving side maps it.
REQUIRED_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
_ALL_SEALS = REQUIRED_SEALS | fcntl.F_SEAL_SEAL


def round_up(n: int, to: int = PAGE) -> int:
    return max(to, (n + to - 1) // to * to)


class SharedRegion:
    """A sealed anonymous memory file mapped into this process.

    >>> r = SharedRegion.create(1 << 20, "staging")
    >>> a = r.array(0, 4, np.float32)
    >>> r.size
    1048576
    """

    __slots__ = ("size", "mm", "fd", "__weakref__")

    def __init__(self, size: int, mm: mmap.mmap, fd: int | None) -> None:
        self.size = size
        self.mm = mm
        self.fd = fd

    @classmethod
    def create(cls, size: int, label: str) -> SharedRegion:
        """A new zero-filled region of ``size`` bytes (rounded up to a page), sealed."""
        size = round_up(size)
        fd = os.memfd_create(f"totalreduce-{label}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _ALL_SEALS)
            mm = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        return cls(size, mm, fd)

    @classmethod
    def attach(cls, fd: int, size: int) -> SharedRegion:
        """Map a region received from the other side; takes ownership of ``fd`` (closed here).

        Raises TotalReduceError if ``fd`` is not a sealed memory file of ``size`` bytes.
        """
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise TotalReduceError("the descriptor is not a memory file")
            if st.st_size != size:
                raise TotalReduceError(f"the memory file has {st.st_size} bytes, not {size}")
            try:
                seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            except OSError:
                seals = 0
            if seals & REQUIRED_SEALS != REQUIRED_SEALS:
                raise TotalReduceError(
                    "the memory file is not sealed against shrinking and growing "
                    "(create it with SharedRegion.create)"
                )
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        return cls(size, mm, None)

    def close_fd(self) -> None:
        """Close the creator's descriptor once it was handed over (the mapping stays)."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def bytes(self) -> np.ndarray:
        """The whole region as a uint8 array (keeps the mapping alive while it lives)."""
        return np.frombuffer(self.mm, dtype=np.uint8)

    def array(self, offset: int, count: int, dtype: np.dtype | type) -> np.ndarray:
        """``count`` elements of ``dtype`` from byte ``offset``, as a 1-D view."""
        return np.frombuffer(self.mm, dtype=dtype, count=count, offset=offset)

    @property
    def address(self) -> int:
        return int(self.bytes().ctypes.data)


# ---------------------------------------------------------------------- barrier, eventfd

_fence_lock = threading.Lock()


def fence() -> None:
    """A full memory barrier (orders an earlier store before a later load).

    CPython's lock acquire and release are atomic read-modify-writes
    (``lock cmpxchg`` / ``lock xadd`` on x86-64), each a full barrier.
    """
    _fence_lock.acquire()
    _fence_lock.release()


def new_eventfd() -> int:
    """A nonblocking, close-on-exec eventfd: this process's wake-up descriptor."""
    return os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)


def signal_eventfd(fd: int) -> None:
    try:
        os.eventfd_write(fd, 1)
    except (BlockingIOError, OSError):  # counter saturated (already readable) or closed
        pass


def drain_eventfd(fd: int) -> None:
    try:
        os.eventfd_read(fd)
    except (BlockingIOError, OSError):
        pass


def sleep_on(fd: int, timeout: float) -> None:
    """Block until ``fd`` is readable or ``timeout`` seconds passed, then drain it.

    ``select`` takes microseconds (``poll`` only milliseconds: a 20 µs nap would last a
    whole millisecond), so short sleeps stay short.
    """
    if timeout > 0:
        try:
            select.select((fd,), (), (), timeout)
        except InterruptedError:
            pass
    drain_eventfd(fd)

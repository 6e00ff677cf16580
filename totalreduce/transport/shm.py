"""Shared memory between a node's service and its local clients: regions, barrier, waking.

This module owns:

- :class:`SharedRegion`: an anonymous memory file (``memfd_create``) mapped by
  several processes (the node's arena, :mod:`totalreduce.transport.arena`, is
  one).  Its creator seals it against shrinking and growing and hands its
  descriptor over; the receiver checks the seals and the size before mapping
  it, so the other side cannot make it fault by truncating memory it reads.
  Nothing has a name in the file system: the memory is freed when the last
  descriptor and mapping are gone, whichever side dies first.
  A region made or attached with ``huge=True`` is mapped at an address aligned
  to the transparent huge page size (2 MiB on x86-64), so that
  :meth:`SharedRegion.make_huge` can back a large buffer with huge pages (see
  there).
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

import ctypes
import ctypes.util
import errno
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


def _huge_page_bytes() -> int:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 2 << 20


#: The transparent huge page size: large arena buffers are placed on it.
HUGE = _huge_page_bytes()

_MAP_SHARED, _MAP_FIXED = 0x01, 0x10
_MADV_POPULATE_WRITE, _MADV_COLLAPSE = 23, 25  # Linux 5.14, 6.1


class _Libc:
    """``mmap`` with an address and ``madvise`` with the advice Python's mmap lacks."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        self.mmap = libc.mmap
        self.mmap.restype = ctypes.c_void_p
        self.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                              ctypes.c_int, ctypes.c_long]  # fmt: skip
        self.madvise = libc.madvise
        self.madvise.restype = ctypes.c_int
        self.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        #: False once the kernel refused to collapse (too old, or shmem huge pages denied)
        self.collapses = True


_libc: _Libc | None = None


def _the_libc() -> _Libc:
    global _libc
    if _libc is None:
        _libc = _Libc()
    return _libc


class SharedRegion:
    """A sealed anonymous memory file mapped into this process.

    >>> r = SharedRegion.create(1 << 20, "staging")
    >>> a = r.array(0, 4, np.float32)
    >>> r.size
    1048576
    """

    __slots__ = ("size", "mm", "fd", "off", "_huge_done", "__weakref__")

    def __init__(self, size: int, mm: mmap.mmap, fd: int | None, off: int = 0) -> None:
        self.size = size
        #: the mapping; the region is its bytes ``off .. off + size``
        self.mm = mm
        self.fd = fd
        self.off = off
        #: huge-page-sized chunks (region offset // HUGE) :meth:`make_huge` already did
        self._huge_done: set[int] = set()

    @classmethod
    def create(cls, size: int, label: str, huge: bool = False) -> SharedRegion:
        """A new zero-filled region of ``size`` bytes (rounded up to a page), sealed;
        ``huge``: mapped on a huge page boundary (:meth:`make_huge`)."""
        size = round_up(size)
        fd = os.memfd_create(f"totalreduce-{label}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _ALL_SEALS)
            mm, off = _map(fd, size, huge)
        except BaseException:
            os.close(fd)
            raise
        return cls(size, mm, fd, off)

    @classmethod
    def attach(cls, fd: int, size: int, huge: bool = False) -> SharedRegion:
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
            mm, off = _map(fd, size, huge)
        finally:
            os.close(fd)
        return cls(size, mm, None, off)

    def close_fd(self) -> None:
        """Close the creator's descriptor once it was handed over (the mapping stays)."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def bytes(self) -> np.ndarray:
        """The whole region as a uint8 array (keeps the mapping alive while it lives)."""
        return np.frombuffer(self.mm, dtype=np.uint8, count=self.size, offset=self.off)

    def array(self, offset: int, count: int, dtype: np.dtype | type) -> np.ndarray:
        """``count`` elements of ``dtype`` from byte ``offset``, as a 1-D view."""
        return np.frombuffer(self.mm, dtype=dtype, count=count, offset=self.off + offset)

    @property
    def address(self) -> int:
        return int(self.bytes().ctypes.data)

    def make_huge(self, offset: int, nbytes: int) -> int:
        """Back the huge pages that bytes ``offset .. offset + nbytes`` cover whole with
        transparent huge pages, keeping their contents; returns how many bytes are (or
        already were) so backed, 0 where the kernel cannot.

        A memory file gets small pages on Linux unless the administrator enabled huge
        ones for shared memory (``shmem_enabled``), whereas numpy's large arrays get huge
        pages by default: MPI moves a buffer between processes of a node much faster on
        huge pages (MPICH's CMA pins it page by page), and the kernels touch fewer TLB
        entries.  ``MADV_COLLAPSE`` (Linux 6.1) makes them whatever that setting says
        (unless it is ``deny``); every process that maps the region on a huge page
        boundary (``huge=True``) then maps them whole.  A best effort: the pages are
        committed here (first written, then copied once into huge pages), and a kernel
        that refuses is asked no more.
        """
        libc = _the_libc()
        lo = -(-offset // HUGE) * HUGE
        hi = (offset + nbytes) // HUGE * HUGE
        if hi <= lo or not libc.collapses:
            return 0
        base = self.address
        done = 0
        for at in range(lo, hi, HUGE):
            if at // HUGE in self._huge_done:
                done += HUGE
                continue
            if (base + at) % HUGE:  # not mapped on a huge page boundary
                return done
            libc.madvise(base + at, HUGE, _MADV_POPULATE_WRITE)
            if libc.madvise(base + at, HUGE, _MADV_COLLAPSE) != 0:
                err = ctypes.get_errno()
                if err in (errno.EINVAL, errno.EPERM, errno.EOPNOTSUPP):  # not here
                    libc.collapses = False
                    log.debug("no huge pages for shared memory here (errno %d)", err)
                return done  # else (EAGAIN, ENOMEM): no huge page free now
            self._huge_done.add(at // HUGE)
            done += HUGE
        return done


def _map(fd: int, size: int, huge: bool) -> tuple[mmap.mmap, int]:
    """Map memory file ``fd``: (the mapping, the region's offset in it).  ``huge``: at a
    huge page boundary, mapped (fixed) into an anonymous mapping ``HUGE`` bytes larger,
    which owns the address range (closing it unmaps both); elsewhere as mmap maps."""
    if huge:
        try:
            mm = mmap.mmap(-1, size + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        except OSError:  # (no room to reserve it under strict overcommit: the plain way)
            return mmap.mmap(fd, size), 0
        base = int(np.frombuffer(mm, np.uint8, count=1).ctypes.data)
        off = -base % HUGE
        got = _the_libc().mmap(base + off, size, mmap.PROT_READ | mmap.PROT_WRITE,
                               _MAP_SHARED | _MAP_FIXED, fd, 0)  # fmt: skip
        if got == base + off:
            return mm, off
        mm.close()  # (that failed: the plain way)
    return mmap.mmap(fd, size), 0


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

"""Compiling once per installation: one process compiles while the others wait, then load.

Numba's cache (``cache=True``) keeps compiled code on disk, but every process that finds
it missing compiles for itself: four ranks started at once on a fresh install compiled
the lane four times side by side, on two cores, and printed nothing for minutes.  Here a
file lock beside the cache (``NAME.lock`` in the probe's cache directory: the package's
``__pycache__``, Numba's per-user cache when the installation is read-only, or
``NUMBA_CACHE_DIR``) puts one process in charge:

- every process first loads under the shared lock; Numba tells it (its ``numba:compile``
  event, from this thread) the moment something is missing, before compiling anything.
  A complete cache loads in parallel, with nothing said;
- a process that found something missing takes the exclusive lock if it is free, drops
  stale code (``forget``: only ever under the exclusive lock, so never under a loader's
  feet), compiles, and says so in one line when Numba starts compiling;
- one that finds the exclusive lock taken waits for the shared lock (saying so once if the
  wait is long and the compiler is not a sibling, a rank of its own job whose line it would
  echo) and
  loads what the compiler left; if something is still missing (the compiler died), it
  takes the exclusive lock, waiting for it, and compiles what is left.

The kernel releases a ``flock`` when its process dies, so a compiler killed half-way holds
nobody up: what it finished is in the cache (Numba writes each file whole, under a new name)
and the next process compiles the rest.  Where no lock can be had (no lock file can be made,
a file system without ``flock``), each process compiles for itself, as Numba alone does.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from numba.core import event

log = logging.getLogger("totalreduce.compile")

#: A process waiting for another's compile says so only after this long: a wait for a
#: load or for the last seconds of a compile passes without a word.
WAIT_NOTICE_S = 2.0


class _Missing(Exception):
    """Numba is about to compile: the cache does not hold everything (raised before any
    compiling, out of the caller's own ``compile`` call)."""


class _Watch(event.Listener):
    """A ``numba:compile`` listener for one thread: raises :class:`_Missing` at the first
    compile (``strict``), or runs ``on_first`` once (the line that says a compile runs).
    Events of other threads (a comm thread compiling a kernel meanwhile) pass untouched."""

    def __init__(self, strict: bool, on_first: Callable[[], None] | None = None) -> None:
        self.thread = threading.get_ident()
        self.strict = strict
        self.on_first = on_first
        self.compiled = False

    def on_start(self, ev: Any) -> None:
        if threading.get_ident() != self.thread:
            return
        if self.strict:
            raise _Missing
        if not self.compiled:
            self.compiled = True
            if self.on_first is not None:
                self.on_first()

    def on_end(self, ev: Any) -> None:
        pass


@contextmanager
def _watching(watch: _Watch) -> Iterator[_Watch]:
    with event.install_listener("numba:compile", watch):
        yield watch


def cache_dir(probe: Any) -> Path | None:
    """The directory of ``probe``'s (a ``cache=True`` dispatcher's) Numba cache, if any."""
    path = getattr(getattr(probe, "_cache", None), "cache_path", None)
    return Path(path) if path else None


def _open_lock(path: Path) -> int | None:
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError:
        pass
    try:  # made by another user: flock works on a descriptor open for reading too
        return os.open(path, os.O_RDONLY)
    except OSError:
        return None


def _try_lock(fd: int, mode: int) -> bool:
    """``flock`` without waiting: True if taken, False if another process holds it."""
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _me() -> str:
    """Who holds the lock, as the holder writes it: pid, launcher (parent) pid, host."""
    return f"{os.getpid()} {os.getppid()} {socket.gethostname()}\n"


def _holder(fd: int) -> tuple[int, bool] | None:
    """The exclusive holder's pid, and whether it is a sibling of this process (the same
    parent on the same host: the ranks of one ``mpiexec``, whose output is ours), if the
    holder wrote them into the lock file."""
    try:
        pid, ppid, host = os.pread(fd, 256, 0).decode().split()[:3]
        return int(pid), int(ppid) == os.getppid() and host == socket.gethostname()
    except (OSError, ValueError):
        return None


def _lock(fd: int, mode: int, what: str) -> None:
    """``flock``, waiting; one line after :data:`WAIT_NOTICE_S` of waiting, unless the
    process compiling is a sibling of this one (another rank of its job: it said so)."""
    if _try_lock(fd, mode):
        return
    deadline = time.monotonic() + WAIT_NOTICE_S
    while time.monotonic() < deadline:
        time.sleep(0.05)
        if _try_lock(fd, mode):
            return
    holder = _holder(fd)
    if holder is None or not holder[1]:
        by = f"process {holder[0]}" if holder else "another process"
        log.warning(
            "totalreduce: waiting for %s, which is compiling %s for this installation", by, what
        )
    fcntl.flock(fd, mode)


def _say_compiling(what: str, takes: str, where: Path | None) -> Callable[[], None]:
    def say() -> None:
        log.warning(
            "totalreduce: compiling %s (Numba), once for this installation: %s; later runs "
            "load it from %s",
            what,
            takes,
            where or "Numba's cache",
        )

    return say


def compile_once(
    compile: Callable[[], None],
    probe: Any,
    *,
    name: str,
    what: str,
    takes: str,
    current: Callable[[], bool] = lambda: True,
    forget: Callable[[], object] = lambda: None,
) -> None:
    """Run ``compile`` (which compiles or loads ``cache=True`` Numba functions by signature)
    so that, among the processes of an installation, one compiles and the others load.

    ``probe``: one of those functions; the lock file ``NAME.lock`` lives in its cache
    directory.  ``current()``: whether the cache was made from the sources as they are (read
    only); when not, ``forget()`` drops it, under the exclusive lock, before compiling.
    ``what`` and ``takes`` fill the line a compiling process logs (level WARNING on the
    ``totalreduce.compile`` logger, so Python prints it to stderr when logging is not
    configured): "compiling WHAT (Numba), once for this installation: TAKES; ...".

    >>> compile_once(lambda: kernel.compile(sig), kernel, name="kernel", what="the kernel",
    ...              takes="about a second")  # doctest: +SKIP
    """
    where = cache_dir(probe)
    say = _say_compiling(what, takes, where)
    fd = _open_lock(where / f"{name}.lock") if where is not None else None
    if fd is None:  # no lock to share: compile here, as Numba alone would
        forget()
        with _watching(_Watch(False, say)):
            compile()
        return
    try:
        _coordinated(fd, compile, what, say, current, forget)
    except OSError as exc:  # flock refused (ENOLCK on some network file systems)
        if exc.errno not in (errno.ENOLCK, errno.EINVAL, errno.EOPNOTSUPP):
            raise
        forget()
        with _watching(_Watch(False, say)):
            compile()
    finally:
        os.close(fd)


def _coordinated(
    fd: int,
    compile: Callable[[], None],
    what: str,
    say: Callable[[], None],
    current: Callable[[], bool],
    forget: Callable[[], object],
) -> None:
    waited = False
    while True:
        _lock(fd, fcntl.LOCK_SH, what)  # waits while another process compiles
        try:
            if current():
                with _watching(_Watch(True)):
                    compile()
                return  # everything loaded
        except _Missing:
            pass
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
        if waited:  # the compiler we waited for left something missing (it died): ours now
            _lock(fd, fcntl.LOCK_EX, what)
        elif not _try_lock(fd, fcntl.LOCK_EX):
            waited = True  # another process is compiling (or loading): wait, then load
            continue
        try:
            try:
                os.ftruncate(fd, 0)
                os.pwrite(fd, _me().encode(), 0)
            except OSError:  # a lock file open for reading only: waiters say less
                pass
            forget()
            with _watching(_Watch(False, say)):
                compile()  # loads what another process finished meanwhile
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
        return

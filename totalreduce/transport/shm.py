"""Shared-memory channels between a node's service (its relay rank) and its local clients.

This module owns:

- :class:`SharedRegion`: an anonymous memory file (``memfd_create``) mapped by
  two processes.  Its creator seals it against shrinking and growing and hands
  its descriptor over; the receiver checks the seals and the size before mapping
  it, so the other side cannot make it fault by truncating memory it reads.
  Nothing has a name in the file system: the memory is freed when the last
  descriptor and mapping are gone, whichever side dies first.
- :class:`Channel`: one region per client slot holding two single-producer
  single-consumer byte rings, client -> service and service -> client, each with
  a u64 head (bytes ever written, stored by the writer) and tail (bytes ever
  read, stored by the reader), plus a "sleeping" flag per side.
- :class:`ShmClientTransport`: a client's transport.  Every message it sends,
  whatever its destination, goes into its client -> service ring carrying that
  destination (the relay forwards it); every message it receives comes from the
  service -> client ring carrying its original source.

Ring messages are a 32-byte header (magic, source engine rank, destination
engine rank, tag, byte count) and the bytes.  A message that does not fit the
free space, or is larger than the whole ring, is streamed: the writer writes
what fits and continues on later calls, the reader copies out progressively
into the posted receive's buffer (or an unexpected-message buffer).  All
progress happens inside transport calls and :meth:`wait`, on the one thread
that uses the transport; a send completes once it is wholly in the ring.

Memory ordering: both sides use ordinary stores and loads (numpy assignments
into the mapping, aligned 8-byte counter words) and rely on x86-64's TSO: stores
become visible in program order and loads are not reordered with older loads.
A writer copies bytes into the ring *before* storing the head that covers them,
and a reader copies bytes out *before* storing the tail that frees them, so the
other side never sees a counter before the bytes it describes.  The one
reordering TSO allows, a later load passing an earlier store (StoreLoad), would
lose a wake-up (the sleeper sets its flag and checks the ring while the writer
advances the ring and checks the flag, each seeing the other's old value), so
both sides put a full barrier between the two: :func:`fence`, an uncontended
lock acquire and release, which CPython implements with ``lock``-prefixed
instructions (a full barrier on x86-64).  See docs/daemon.md.

Waking: each process has one eventfd (nonblocking, close-on-exec).  A reader
about to sleep sets its sleeping flag, fences, re-checks its rings and only
then sleeps in ``poll`` on its eventfd; a side that advanced a ring the other
side waits on writes the other side's eventfd only if that side's flag is set,
so the busy path costs no system call.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import select
import stat
import struct
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import TotalReduceError, TransportError
from .base import ANY_SOURCE, OversizeMessage, pid_alive

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


# ---------------------------------------------------------------------- channel

CHANNEL_MAGIC = 0x5452_4348_414E_0001  # "TRCHAN" v1
DEFAULT_CAPACITY = 256 << 10
#: Body tags rotate through this many values unless the service says otherwise
#: (it must pass its relay's ``tag_span``: every rank of a world needs the same).
DEFAULT_TAG_SPAN = 1 << 20

# u64 words of the header page; each counter and flag on its own 64-byte line.
_W_MAGIC, _W_CAPACITY = 0, 1
C2S_HEAD, C2S_TAIL, S2C_HEAD, S2C_TAIL = 8, 16, 24, 32
CLIENT_SLEEPING, SERVICE_SLEEPING = 40, 48
_HEADER_WORDS = 56

#: A ring message's header: magic, source, destination, tag, byte count, reserved.
MSG = struct.Struct("<IiiiQQ")
MSG_SIZE = MSG.size
MSG_MAGIC = 0x4753_4D52  # "RMSG"
MAX_MESSAGE = 1 << 40
assert MSG_SIZE == 32


class _Ring:
    """One single-producer single-consumer byte ring of a channel."""

    __slots__ = ("data", "cap", "ctl", "head_word", "tail_word")

    def __init__(self, data: np.ndarray, ctl: np.ndarray, head_word: int, tail_word: int) -> None:
        self.data = data
        self.cap = data.nbytes
        self.ctl = ctl
        self.head_word = head_word
        self.tail_word = tail_word

    def head(self) -> int:
        return int(self.ctl[self.head_word])

    def tail(self) -> int:
        return int(self.ctl[self.tail_word])

    def put(self, pos: int, src: np.ndarray) -> None:
        cap = self.cap
        p = pos % cap
        n = src.nbytes
        first = cap - p
        if n <= first:
            self.data[p : p + n] = src
        else:
            self.data[p:] = src[:first]
            self.data[: n - first] = src[first:]

    def get(self, pos: int, dst: np.ndarray) -> None:
        cap = self.cap
        p = pos % cap
        n = dst.nbytes
        first = cap - p
        if n <= first:
            dst[:] = self.data[p : p + n]
        else:
            dst[:first] = self.data[p:]
            dst[first:] = self.data[: n - first]


class Channel:
    """The shared memory of one client slot: two rings and the sleeping flags.

    The service creates it (:meth:`create`, owning :attr:`fd`) and hands the
    descriptor to its client, which maps it with :meth:`attach`.
    """

    def __init__(self, region: SharedRegion, capacity: int) -> None:
        self.region = region
        self.capacity = capacity
        self.ctl = region.array(0, _HEADER_WORDS, np.uint64)
        data = region.bytes()
        self.c2s = _Ring(data[PAGE : PAGE + capacity], self.ctl, C2S_HEAD, C2S_TAIL)
        self.s2c = _Ring(data[PAGE + capacity : PAGE + 2 * capacity], self.ctl, S2C_HEAD, S2C_TAIL)

    @staticmethod
    def size_for(capacity: int) -> int:
        return PAGE + 2 * round_up(capacity)

    @classmethod
    def create(cls, capacity: int = DEFAULT_CAPACITY) -> Channel:
        """A new channel with two rings of ``capacity`` bytes (rounded up to a page)."""
        capacity = round_up(capacity)
        region = SharedRegion.create(cls.size_for(capacity), "channel")
        ch = cls(region, capacity)
        ch.ctl[_W_CAPACITY] = capacity
        ch.ctl[_W_MAGIC] = CHANNEL_MAGIC
        return ch

    @classmethod
    def attach(cls, fd: int, size: int) -> Channel:
        """Map a channel received from the service; takes ownership of ``fd`` (closed here).

        Refuses (TotalReduceError) a descriptor that is not a sealed memory file
        of ``size`` bytes, or whose header is not a channel of that size.
        """
        region = SharedRegion.attach(fd, size)
        words = region.array(0, 2, np.uint64)
        magic, capacity = int(words[0]), int(words[1])
        del words
        if magic != CHANNEL_MAGIC or capacity <= 0 or cls.size_for(capacity) != size:
            region.mm.close()
            raise TotalReduceError(
                f"the memory file of {size} bytes is not a totalreduce channel "
                f"(magic {magic:#x}, capacity {capacity})"
            )
        return cls(region, capacity)

    @property
    def fd(self) -> int | None:
        return self.region.fd

    @property
    def size(self) -> int:
        return self.region.size

    def reset(self) -> None:
        """Empty both rings and clear the flags (service side, for a new client).

        Only while no client maps it any more (the old one died or let go) and
        no transport uses it.
        """
        for w in (C2S_HEAD, C2S_TAIL, S2C_HEAD, S2C_TAIL, CLIENT_SLEEPING, SERVICE_SLEEPING):
            self.ctl[w] = 0

    def close(self) -> None:
        """Close the descriptor and unmap (views still alive keep the mapping until freed)."""
        self.region.close_fd()
        self.c2s = self.s2c = None  # type: ignore[assignment]
        self.ctl = None  # type: ignore[assignment]
        try:
            self.region.mm.close()
        except BufferError:  # someone still holds a view; freed with it
            pass


# ---------------------------------------------------------------------- requests, matching


class _Send:
    __slots__ = ("dest", "done", "error", "peer", "mpi", "keep")

    def __init__(self, dest: int) -> None:
        self.dest = dest
        self.done = False
        self.error: str | None = None
        self.peer = dest
        self.mpi: Any = None  # relay: the MPI request carrying it
        self.keep: Any = None  # relay: a buffer that must live while ``mpi`` runs


class _Recv:
    __slots__ = (
        "source",
        "tag",
        "buf",
        "done",
        "matched_source",
        "nbytes",
        "error",
        "cancelled",
        "peer",
        "pending",
    )

    def __init__(self, buf: np.ndarray, source: int, tag: int) -> None:
        self.source = source
        self.tag = tag
        self.buf = buf
        self.done = False
        self.matched_source = -1
        self.nbytes = 0
        self.error: str | None = None
        self.cancelled = False
        self.peer = source
        self.pending = False  # matched, bytes still arriving


class _In:
    """An unexpected message: kept (copied) until a receive or ``poll_message`` takes it."""

    __slots__ = ("source", "tag", "nbytes", "buf", "complete", "recv")

    def __init__(self, source: int, tag: int, nbytes: int, data: np.ndarray | None) -> None:
        self.source = source
        self.tag = tag
        self.nbytes = nbytes
        self.buf = np.empty(nbytes, dtype=np.uint8) if data is None else data
        self.complete = False
        self.recv: _Recv | None = None  # a receive that matched it while it streamed in


def _truncated(recv: _Recv, source: int, n: int) -> str:
    return (
        f"message of {n} bytes from rank {source} tag {recv.tag} truncated "
        f"into a {recv.buf.nbytes}-byte receive"
    )


class Matcher:
    """MPI matching of one rank's posted receives and arrived (unexpected) messages.

    Arrivals are announced in order per sender (``arrive`` when a message's header
    arrives, ``complete`` when its last byte has), so the earliest posted receive
    that matches takes the earliest matching message: non-overtaking.
    """

    def __init__(self) -> None:
        self.posted: list[_Recv] = []
        self.unexpected: list[_In] = []

    def arrive(
        self, source: int, tag: int, n: int, data: np.ndarray | None = None
    ) -> tuple[Any, np.ndarray | None]:
        """Where a message's bytes go: (target, buffer of n bytes or None to discard).

        ``data``: the message's bytes are already in this buffer, which an
        unexpected message may keep instead of a copy.
        """
        for i, recv in enumerate(self.posted):
            if recv.tag == tag and (recv.source == ANY_SOURCE or recv.source == source):
                del self.posted[i]
                recv.matched_source = recv.peer = source
                recv.nbytes = n
                recv.pending = True
                if n > recv.buf.nbytes:
                    recv.error = _truncated(recv, source, n)
                    return recv, None
                return recv, recv.buf[:n]
        entry = _In(source, tag, n, data)
        self.unexpected.append(entry)
        return entry, entry.buf

    def complete(self, target: Any) -> None:
        if target is None:  # a discarded message
            return
        if isinstance(target, _Recv):
            target.pending = False
            target.done = True
            return
        target.complete = True
        recv = target.recv
        if recv is not None:
            self._fill(recv, target)

    def fail(self, target: Any, why: str) -> None:
        """The message ``target`` was receiving will never complete (its sender died)."""
        if isinstance(target, _Recv):
            target.error = why
            target.pending = False
            target.done = True
            return
        if target in self.unexpected:
            self.unexpected.remove(target)
        if target.recv is not None:
            target.recv.error = why
            target.recv.pending = False
            target.recv.done = True

    @staticmethod
    def _fill(recv: _Recv, entry: _In) -> None:
        n = entry.nbytes
        recv.matched_source = recv.peer = entry.source
        recv.nbytes = n
        if n > recv.buf.nbytes:
            recv.error = _truncated(recv, entry.source, n)
        else:
            recv.buf[:n] = entry.buf
        recv.pending = False
        recv.done = True

    def post(self, recv: _Recv) -> None:
        for i, entry in enumerate(self.unexpected):
            if entry.tag == recv.tag and (recv.source == ANY_SOURCE or recv.source == entry.source):
                del self.unexpected[i]
                if entry.complete:
                    self._fill(recv, entry)
                else:
                    entry.recv = recv
                    recv.pending = True
                return
        self.posted.append(recv)

    def take(self, tag: int, limit: int) -> tuple[int, np.ndarray] | None:
        """The earliest wholly arrived message on ``tag`` not behind one still arriving."""
        blocked: set[int] = set()
        for i, entry in enumerate(self.unexpected):
            if entry.tag != tag:
                continue
            if not entry.complete:
                blocked.add(entry.source)
                continue
            if entry.source in blocked:
                continue
            del self.unexpected[i]
            if entry.nbytes > limit:
                raise OversizeMessage(entry.source, entry.nbytes, limit)
            return entry.source, entry.buf
        return None

    def cancel(self, recv: _Recv) -> None:
        if recv in self.posted:
            self.posted.remove(recv)
            recv.cancelled = True
            recv.done = True  # completes, as a cancelled MPI request does


def check_buffer(buf: np.ndarray) -> np.ndarray:
    if buf.dtype != np.uint8 or buf.ndim != 1 or not buf.flags.c_contiguous:
        raise TransportError(f"transport buffers are 1-D contiguous uint8, got {buf.dtype}")
    return buf


def request_state(req: Any) -> tuple[bool, int, int]:
    if not req.done:
        return False, -1, 0
    if req.error:
        err = TransportError(req.error)
        err.peer = req.peer  # type: ignore[attr-defined]
        raise err
    if isinstance(req, _Recv):
        return True, req.matched_source, req.nbytes
    return True, -1, 0


def collect(reqs: list[Any], counts: list[int] | None) -> list[int]:
    """testsome's answer over requests whose ``done``/``error`` fields are up to date."""
    out: list[int] = []
    failed: list[int] = []
    first: Any = None
    for i, r in enumerate(reqs):
        if r.done:
            if r.error:
                failed.append(i)
                if first is None:
                    first = r
                continue
            out.append(i)
            if counts is not None:
                counts.append(r.nbytes if isinstance(r, _Recv) else 0)
    if failed:
        err = TransportError(first.error)
        err.done, err.failed = out, failed  # type: ignore[attr-defined]
        err.peer = first.peer  # type: ignore[attr-defined]
        raise err
    return out


# ---------------------------------------------------------------------- ring ends


class _Out:
    """A message queued for a ring: header, then body, streamed as space allows."""

    __slots__ = ("header", "body", "off", "req")

    def __init__(self, source: int, dest: int, tag: int, body: np.ndarray, req: Any) -> None:
        self.header = np.frombuffer(
            MSG.pack(MSG_MAGIC, source, dest, tag, body.nbytes, 0), dtype=np.uint8
        )
        self.body = body
        self.off = -1  # body bytes written; -1: the header is not in the ring yet
        self.req = req


class RingWriter:
    """The producing end of a ring: a queue of messages streamed in order."""

    __slots__ = ("ring", "head", "q")

    def __init__(self, ring: _Ring) -> None:
        self.ring = ring
        self.head = ring.head()
        self.q: deque[_Out] = deque()

    def pump(self) -> bool:
        """Write what fits; True if the head moved.  Completes the sends wholly written."""
        q = self.q
        if not q:
            return False
        ring = self.ring
        head = start = self.head
        free = ring.cap - (head - ring.tail())
        while q:
            m = q[0]
            if m.off < 0:
                if free < MSG_SIZE:
                    break
                ring.put(head, m.header)
                head += MSG_SIZE
                free -= MSG_SIZE
                m.off = 0
            left = m.body.nbytes - m.off
            if left:
                k = left if left <= free else free
                if k == 0:
                    break
                ring.put(head, m.body[m.off : m.off + k])
                head += k
                free -= k
                m.off += k
                if k < left:
                    break
            q.popleft()
            if m.req is not None:
                m.req.done = True
        if head == start:
            return False
        self.head = head
        ring.ctl[ring.head_word] = head  # after the bytes (TSO keeps the order)
        return True

    def can_write(self) -> bool:
        """Whether a message waits and the ring has room for its next piece.

        Safe to call from a thread other than the one writing (a sleeper's check):
        a message taken meanwhile only makes the answer stale, never an error.
        """
        try:
            m = self.q[0]
        except IndexError:
            return False
        free = self.ring.cap - (self.head - self.ring.tail())
        return free >= (MSG_SIZE if m.off < 0 else 1)

    def drop(self) -> None:
        """Forget queued messages (their sends complete: the receiver is gone)."""
        for m in self.q:
            if m.req is not None:
                m.req.done = True
        self.q.clear()


class Corrupt(TransportError):
    """A ring holds something that is not a message header."""


class RingReader:
    """The consuming end of a ring.

    ``begin(source, dest, tag, n)`` returns ``(target, buffer)`` for a message
    whose header arrived (buffer None: discard its bytes); ``end(target)`` is
    called once its last byte is copied.
    """

    __slots__ = ("ring", "tail", "begin", "end", "target", "buf", "off", "n", "_hdr")

    def __init__(self, ring: _Ring, begin: Any, end: Any) -> None:
        self.ring = ring
        self.tail = ring.tail()
        self.begin = begin
        self.end = end
        self.target: Any = None
        self.buf: np.ndarray | None = None
        self.off = 0
        self.n = -1  # -1: between messages
        self._hdr = np.empty(MSG_SIZE, dtype=np.uint8)

    def pending(self) -> bool:
        return self.ring.head() != self.tail

    def pump(self) -> bool:
        """Read what arrived; True if the tail moved."""
        ring = self.ring
        head = ring.head()
        tail = self.tail
        if head == tail:
            return False
        try:
            while tail != head:
                avail = head - tail
                if self.n < 0:
                    if avail < MSG_SIZE:
                        break
                    ring.get(tail, self._hdr)
                    # numpy arrays are buffers; numpy's stubs do not say so
                    magic, src, dst, tag, n, _ = MSG.unpack_from(self._hdr)  # type: ignore[arg-type]
                    if magic != MSG_MAGIC or n > MAX_MESSAGE:
                        raise Corrupt(
                            f"shared-memory ring: bad message header at byte {tail} "
                            f"(magic {magic:#x}, {n} bytes)"
                        )
                    tail += MSG_SIZE
                    self.target, self.buf = self.begin(src, dst, tag, n)
                    self.n, self.off = n, 0
                    if n == 0:
                        self._finish()
                    continue
                left = self.n - self.off
                k = left if left <= avail else avail
                if self.buf is not None:
                    ring.get(tail, self.buf[self.off : self.off + k])
                tail += k
                self.off += k
                if self.off == self.n:
                    self._finish()
        finally:
            self.tail = tail
            ring.ctl[ring.tail_word] = tail  # after the bytes were copied out
        return True

    def _finish(self) -> None:
        target = self.target
        self.target = self.buf = None
        self.n = -1
        self.end(target)

    def abandon(self) -> Any:
        """The target of a message cut off mid-stream (the writer died), or None."""
        target = self.target if self.n >= 0 else None
        self.target = self.buf = None
        self.n = -1
        return target


# ---------------------------------------------------------------------- the client transport


class ShmClientTransport:
    """A local client's transport: everything goes through its channel to the node's relay.

    ``rank`` is this client's engine rank, ``size`` the number of client ranks,
    ``relays`` the number of relay ranks (one per node), ``relay`` the engine rank
    of this node's relay.  Takes ownership of ``channel`` (attached), of
    ``own_eventfd`` (this process's wake-up descriptor) and of ``relay_eventfd``
    (the service's), closing them in :meth:`close`.
    """

    def __init__(
        self,
        rank: int,
        size: int,
        relays: int,
        relay: int,
        channel: Channel,
        own_eventfd: int,
        relay_eventfd: int,
        relay_pid: int,
        *,
        tag_span: int = DEFAULT_TAG_SPAN,
    ) -> None:
        if relays < 1 or size % relays:
            raise TransportError(f"{size} client ranks do not split over {relays} nodes")
        if not 0 <= rank < size or not size <= relay < size + relays:
            raise TransportError(f"client rank {rank} / relay {relay} outside a world of {size}")
        self.rank = rank
        self.size = size
        self.relays = relays
        self.relay = relay
        self.tag_span = tag_span
        self.channel = channel
        self.eventfd = own_eventfd
        self.relay_eventfd = relay_eventfd
        self.relay_pid = relay_pid
        #: The node's session (daemon/node.py), the engine options of the world, and
        #: what to do after closing (say bye on the socket): set by ``hello.attach``.
        self.epoch = 0
        self.incarnation = 0  # which process of its rank this client is (from the welcome)
        self.options: dict[str, int] = {}
        self.socket_path = ""
        self.on_close: Callable[[], None] | None = None
        #: The node's arena and what goes with it (hello.ArenaLink): the thin path.
        self.arena: Any = None
        per_node = size // relays
        node = relay - size
        if rank // per_node != node:
            raise TransportError(f"client rank {rank} is not on node {node}")
        self._layout = (rank - node * per_node, per_node, node, relays)
        self.description = (
            f"shm (client {rank} of {size}, node {node} of {relays}, "
            f"{channel.capacity >> 10} KiB rings)"
        )
        self._ctl = channel.ctl
        self._matcher = Matcher()
        self._writer = RingWriter(channel.c2s)
        self._reader = RingReader(channel.s2c, self._begin, self._matcher.complete)
        self._closed = False

    # ring callbacks
    def _begin(self, src: int, dst: int, tag: int, n: int) -> tuple[Any, np.ndarray | None]:
        if dst != self.rank:
            log.warning("rank %d: dropping a %d-byte message meant for rank %d", self.rank, n, dst)
            return None, None
        return self._matcher.arrive(src, tag, n)

    def _progress(self) -> None:
        moved = self._writer.pump() if self._writer.q else False
        if self._reader.pump():
            moved = True
        if moved:
            fence()
            if self._ctl[SERVICE_SLEEPING]:
                signal_eventfd(self.relay_eventfd)

    # the protocol
    def isend(self, buf: np.ndarray, dest: int, tag: int) -> Any:
        if not 0 <= dest < self.size + self.relays:
            raise TransportError(
                f"rank {self.rank} sends to rank {dest} outside 0..{self.size + self.relays - 1}"
            )
        req = _Send(dest)
        self._writer.q.append(_Out(self.rank, dest, tag, check_buffer(buf), req))
        self._progress()
        return req

    def irecv(self, buf: np.ndarray, source: int, tag: int) -> Any:
        req = _Recv(check_buffer(buf), source, tag)
        self._progress()
        self._matcher.post(req)
        return req

    def test(self, req: Any) -> tuple[bool, int, int]:
        self._progress()
        return request_state(req)

    def testsome(self, reqs: list[Any], counts: list[int] | None = None) -> list[int]:
        self._progress()
        return collect(reqs, counts)

    def poll_message(self, tag: int, limit: int) -> tuple[int, np.ndarray] | None:
        self._progress()
        return self._matcher.take(tag, limit)

    def alive(self, peer: int) -> bool | None:
        if peer == self.rank:
            return True
        if peer == self.relay:
            return pid_alive(self.relay_pid)
        return None

    def cancel(self, req: Any) -> None:
        if isinstance(req, _Recv):
            self._matcher.cancel(req)

    def node_layout(self) -> tuple[int, int, int, int]:
        """(local slot, local clients, node, nodes)."""
        return self._layout

    def wait(self, timeout: float) -> None:
        """Block until something may have arrived, :meth:`wake` was called, or ``timeout``.

        Moves no data: another thread may be running a pass of the loop meanwhile.
        """
        if timeout <= 0 or self._reader.pending() or self._writer.can_write():
            return
        ctl = self._ctl
        ctl[CLIENT_SLEEPING] = 1
        fence()
        if self._reader.pending() or self._writer.can_write():
            ctl[CLIENT_SLEEPING] = 0
            return
        sleep_on(self.eventfd, timeout)
        ctl[CLIENT_SLEEPING] = 0

    def wake(self) -> None:
        """Make a concurrent or the next :meth:`wait` return (any thread)."""
        signal_eventfd(self.eventfd)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._reader = self._writer = None  # type: ignore[assignment]
        self._ctl = None  # type: ignore[assignment]
        self.channel.close()
        for fd in (self.eventfd, self.relay_eventfd):
            try:
                os.close(fd)
            except OSError:
                pass
        if self.on_close is not None:
            self.on_close()

"""The relay transport: a node's service, one engine rank that forwards for its clients.

Engine ranks of a daemon world of ``nodes`` nodes with ``L`` local clients
each: clients are ranks ``0 .. C-1`` (``C = nodes * L``; the client of node n,
local slot k, is rank ``n * L + k``) and the relay (service) of node n is rank
``C + n``.  Clients talk only to their node's relay, through a shared-memory
:class:`~totalreduce.transport.shm.Channel` each; relays talk to each other over
MPI (``comm``: one rank per node, services only).

Routing of a message from ``source`` to ``dest``, wherever it entered (this
relay's own ``isend``, a local client's ring, or MPI):

- ``dest`` is this relay: delivered to this relay's own receives / ``poll_message``;
- ``dest`` is a local client: queued for that client's service -> client ring;
- ``dest`` is another relay and ``source`` is this relay: plain MPI to that node,
  on the message's own tag (the engine's tags are >= 1);
- anything else (a client of another node, or another relay for a message a
  client sent): MPI to the destination's node on :data:`ENVELOPE_TAG` (0), the
  message preceded by a ring header naming its original source, destination and
  tag; that node's relay delivers it as above.

Per (source, destination, tag) order holds: each source's messages take one
path, every stage keeps FIFO order (a ring, one ring's reader, the per-slot
output queues, MPI's non-overtaking order between two relays on one tag, and
envelopes delivered in the order they were probed).

Memory: bytes forwarded toward a local client whose ring is full wait in that
slot's output queue, and bytes from a client's ring wait whole in a buffer
before going on (to a ring or MPI).  Nothing bounds that here; the engine does:
a body is only sent once its receiver posted a receive for it (clear-to-send),
eager bodies spend the receiver's eager credit and control messages its control
credit, so what waits toward one client is bounded by what that client has
agreed to receive.

All MPI calls run on the thread using the transport; :meth:`attach`,
:meth:`detach` and :meth:`wake` may be called from any thread.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import numpy as np

from ..errors import TransportError
from .base import pid_alive
from .shm import (
    CLIENT_SLEEPING,
    DEFAULT_CAPACITY,
    DEFAULT_TAG_SPAN,
    MSG,
    MSG_MAGIC,
    MSG_SIZE,
    SERVICE_SLEEPING,
    Channel,
    Corrupt,
    Matcher,
    RingReader,
    RingWriter,
    _Out,
    _Recv,
    _Send,
    check_buffer,
    collect,
    fence,
    new_eventfd,
    request_state,
    signal_eventfd,
    sleep_on,
)

log = logging.getLogger("totalreduce.transport.relay")

#: The MPI tag of forwarded messages (with their envelope); the engine's tags are >= 1.
ENVELOPE_TAG = 0
#: How long after the last MPI traffic the relay polls MPI every POLL_S while asleep.
BUSY_S = 0.5
POLL_S = 1e-3


class _Fwd:
    """A message from a local client's ring that goes on: to another ring or over MPI."""

    __slots__ = ("source", "dest", "tag", "buf", "node")

    def __init__(self, source: int, dest: int, tag: int, buf: np.ndarray, node: int) -> None:
        self.source = source
        self.dest = dest
        self.tag = tag
        self.buf = buf  # the body (local) or envelope header + body (over MPI)
        self.node = node  # -1: a local client


class _Slot:
    __slots__ = ("index", "rank", "channel", "client_fd", "pid", "reader", "writer")

    def __init__(self, index: int, rank: int, channel: Channel, client_fd: int, pid: int) -> None:
        self.index = index
        self.rank = rank
        self.channel = channel
        self.client_fd = client_fd
        self.pid = pid
        self.writer = RingWriter(channel.s2c)
        self.reader: RingReader  # set by the relay (its callbacks name the slot)


class RelayTransport:
    """Node ``comm.rank``'s relay: engine rank ``C + comm.rank`` of ``C = comm.size * L``.

    ``comm``: an mpi4py communicator with one rank per node (the relay sends and
    probes every tag on it, so give it a communicator of its own), or None for a
    world of one node without MPI.  ``local_clients``: ``L``.  ``capacity``: the
    ring size of channels made by :meth:`new_channel`.
    """

    def __init__(
        self,
        comm: Any,
        local_clients: int,
        capacity: int = DEFAULT_CAPACITY,
    ) -> None:
        if local_clients < 1:
            raise TransportError(f"a relay needs at least one local client, got {local_clients}")
        self.comm = comm
        if comm is None:
            self._MPI: Any = None
            node, nodes = 0, 1
            self.tag_span = DEFAULT_TAG_SPAN
        else:
            from mpi4py import MPI

            self._MPI = MPI
            node, nodes = comm.Get_rank(), comm.Get_size()
            self._status = MPI.Status()
            tag_ub = comm.Get_attr(MPI.TAG_UB)
            # Same rule as the MPI transport; clients must be given this value.
            self.tag_span = max(1024, min(1 << 20, int(tag_ub or 32767) - 16))
        self.node = node
        self.nodes = nodes
        self.local_clients = local_clients
        self.size = nodes * local_clients
        self.relays = nodes
        self.rank = self.size + node
        self.capacity = capacity
        self.description = (
            f"relay (node {node} of {nodes}, {local_clients} local clients, "
            f"shared memory{' + mpi' if nodes > 1 else ''})"
        )
        self.eventfd = new_eventfd()
        self.pid = os.getpid()
        self._slots: list[_Slot | None] = [None] * local_clients
        self._state: list[str | None] = [None] * local_clients  # None, "attached", "gone"
        # Forwarded messages for slots whose client has not arrived yet this session:
        # the clients of a job start at different moments, and a peer's first frames
        # may come before their receiver does.  Delivered at its attach.
        self._early: list[list[_Out]] = [[] for _ in range(local_clients)]
        self._matcher = Matcher()
        self._ops: list[tuple[Any, ...]] = []
        self._ops_lock = threading.Lock()
        self._has_ops = False
        self._mpi_in: list[tuple[Any, Any]] = []  # (MPI request, target) of plain messages
        self._env_in: list[tuple[Any, np.ndarray, int]] = []  # envelopes, in probe order
        self._fwd_sends: list[tuple[Any, np.ndarray, int]] = []  # forwarded over MPI
        self._closed = False
        # MPI cannot wake the eventfd: while traffic moves (and for BUSY_S after), a
        # sleep is cut to POLL_S so forwarded messages are not held up by the loop's
        # idle backoff; a quiet relay sleeps as long as the loop asks.
        self._busy_until = 0.0

    # ------------------------------------------------------------------ slots (any thread)

    def new_channel(self) -> Channel:
        """A fresh channel of this relay's capacity, for a client about to connect."""
        return Channel.create(self.capacity)

    def attach(self, slot: int, channel: Channel, client_eventfd: int, pid: int) -> None:
        """Connect local slot ``slot`` (any thread; applied at the next transport call).

        Takes ownership of ``channel`` (until :meth:`detach`) and of ``client_eventfd``.
        """
        if not 0 <= slot < self.local_clients:
            raise TransportError(f"slot {slot} outside 0..{self.local_clients - 1}")
        with self._ops_lock:
            self._ops.append(("attach", slot, channel, client_eventfd, pid))
            self._has_ops = True
        self.wake()

    def new_session(self) -> None:
        """The node's clients all left and a new set starts (any thread): every slot not
        attached now waits for a client again, keeping what is forwarded to it."""
        with self._ops_lock:
            self._ops.append(("session",))
            self._has_ops = True
        self.wake()

    def detach(self, slot: int) -> threading.Event:
        """Disconnect ``slot`` (its client died or left; any thread).

        Returns an event set once applied: the transport no longer touches the
        channel, which it has reset (both rings empty) and closed nothing of; only
        then may the channel be handed to a new client.  Until a new attach,
        ``alive(rank)`` is False, sends to the slot's rank complete at once
        (dropped) and receives from it never match.
        """
        done = threading.Event()
        with self._ops_lock:
            self._ops.append(("detach", slot, done))
            self._has_ops = True
        self.wake()
        return done

    def _apply_ops(self) -> None:
        with self._ops_lock:
            ops, self._ops = self._ops, []
            self._has_ops = False
        for op in ops:
            if op[0] == "session":
                for i, state in enumerate(self._state):
                    if state == "gone":
                        self._state[i] = None
                        self._early[i].clear()
            elif op[0] == "attach":
                _, i, channel, fd, pid = op
                self._release(i, "gone")
                s = _Slot(i, self.node * self.local_clients + i, channel, fd, pid)
                s.reader = RingReader(channel.c2s, self._begin_for(s), self._end)
                self._slots[i] = s
                self._state[i] = "attached"
                s.writer.q.extend(self._early[i])
                self._early[i].clear()
            else:
                _, i, done = op
                s = self._slots[i]
                if s is not None:  # what the client wrote before it went is still delivered
                    self._drain(s)
                self._release(i, "gone")
                done.set()

    def _drain(self, s: _Slot) -> None:
        """Read every whole message left in a departing client's ring (its last frames and
        its goodbye may not have been read yet); a message cut off stays behind."""
        try:
            while s.reader.pump():
                pass
        except Corrupt as exc:
            log.error("relay %d: client rank %d: %s", self.rank, s.rank, exc)

    def _release(self, i: int, state: str) -> None:
        s = self._slots[i]
        if s is None:
            return
        self._slots[i] = None
        self._state[i] = state
        target = s.reader.abandon()
        if target is not None and not isinstance(target, _Fwd):
            self._matcher.fail(target, f"client rank {s.rank} went away in the middle of a message")
        s.writer.drop()
        s.channel.reset()
        try:
            os.close(s.client_fd)
        except OSError:
            pass

    # ------------------------------------------------------------------ routing

    def _envelope(self, source: int, dest: int, tag: int, n: int) -> np.ndarray:
        buf = np.empty(MSG_SIZE + n, dtype=np.uint8)
        MSG.pack_into(buf, 0, MSG_MAGIC, source, dest, tag, n, 0)  # type: ignore[arg-type]
        return buf

    def _begin_for(self, s: _Slot) -> Any:
        src = s.rank  # whatever the header says: a client cannot speak for another rank

        def begin(_src: int, dst: int, tag: int, n: int) -> tuple[Any, np.ndarray | None]:
            if dst == self.rank:
                return self._matcher.arrive(src, tag, n)
            L = self.local_clients
            if 0 <= dst < self.size:
                node = dst // L
            elif self.size <= dst < self.size + self.relays:
                node = dst - self.size
            else:
                log.warning("client rank %d sent %d bytes to rank %d: no such rank", src, n, dst)
                return None, None
            if node == self.node:  # a local client (the other relays are remote)
                buf = np.empty(n, dtype=np.uint8)
                return _Fwd(src, dst, tag, buf, -1), buf
            env = self._envelope(src, dst, tag, n)
            return _Fwd(src, dst, tag, env, node), env[MSG_SIZE:]

        return begin

    def _end(self, target: Any) -> None:
        if isinstance(target, _Fwd):
            if target.node < 0:
                self._to_local(target.source, target.dest, target.tag, target.buf, None)
            else:
                self._forward_mpi(target.buf, target.node)
        else:
            self._matcher.complete(target)

    def _to_local(self, source: int, dest: int, tag: int, body: np.ndarray, req: Any) -> None:
        i = dest - self.node * self.local_clients
        s = self._slots[i]
        if s is None:
            if req is None and self._state[i] is None:  # forwarded, its client yet to come
                self._early[i].append(_Out(source, dest, tag, body, None))
            elif req is not None:
                req.done = True  # dropped: the client is gone (or this relay's own notice)
            return
        s.writer.q.append(_Out(source, dest, tag, body, req))

    def _forward_mpi(self, env: np.ndarray, node: int) -> None:
        MPI = self._MPI
        self._busy_until = time.monotonic() + BUSY_S
        try:
            r = self.comm.Isend([env, MPI.BYTE], dest=node, tag=ENVELOPE_TAG)
        except MPI.Exception as exc:
            log.error("relay %d: forwarding to node %d failed: %s", self.rank, node, exc)
            return
        self._fwd_sends.append((r, env, node))

    def _deliver_envelope(self, env: np.ndarray, node: int) -> None:
        if env.nbytes < MSG_SIZE:
            log.error("relay %d: a %d-byte envelope from node %d", self.rank, env.nbytes, node)
            return
        magic, src, dst, tag, n, _ = MSG.unpack_from(env)  # type: ignore[arg-type]
        if magic != MSG_MAGIC or n != env.nbytes - MSG_SIZE:
            log.error("relay %d: a malformed envelope from node %d", self.rank, node)
            return
        body = env[MSG_SIZE:]
        if dst == self.rank:
            target, buf = self._matcher.arrive(src, tag, n, body)
            if buf is not None and buf is not body:
                buf[:] = body
            self._matcher.complete(target)
        elif 0 <= dst < self.size and dst // self.local_clients == self.node:
            self._to_local(src, dst, tag, body, None)
        else:
            log.error("relay %d: node %d forwarded a message for rank %d", self.rank, node, dst)

    # ------------------------------------------------------------------ progress

    def _error(self, what: str, peer: int | None, exc: Exception) -> TransportError:
        who = "" if peer is None or peer < 0 else f" with rank {peer}"
        err = TransportError(f"rank {self.rank}: MPI {what}{who} failed: {exc}")
        err.peer = peer  # type: ignore[attr-defined]
        return err

    def _progress(self) -> None:
        if self._has_ops:
            self._apply_ops()
        slots = [s for s in self._slots if s is not None]
        moved: list[_Slot] = []
        for s in slots:
            try:
                if s.reader.pump():
                    moved.append(s)
            except Corrupt as exc:
                log.error("relay %d: client rank %d: %s; disconnecting it", self.rank, s.rank, exc)
                self._release(s.index, "gone")
        if self._MPI is not None and self.nodes > 1:
            self._mpi_progress()
        for s in slots:
            if s.writer.q and self._slots[s.index] is s and s.writer.pump() and s not in moved:
                moved.append(s)
        if moved:
            fence()
            for s in moved:
                if self._slots[s.index] is s and s.channel.ctl[CLIENT_SLEEPING]:
                    signal_eventfd(s.client_fd)

    def _mpi_progress(self) -> None:
        MPI = self._MPI
        comm, st = self.comm, self._status
        matcher = self._matcher
        while True:
            try:
                msg = comm.Improbe(MPI.ANY_SOURCE, MPI.ANY_TAG, st)
            except MPI.Exception as exc:
                raise self._error("probe", None, exc) from None
            if msg is None:
                break
            self._busy_until = time.monotonic() + BUSY_S
            node, tag, n = st.Get_source(), st.Get_tag(), st.Get_count(MPI.BYTE)
            try:
                if tag == ENVELOPE_TAG:
                    env = np.empty(n, dtype=np.uint8)
                    self._env_in.append((msg.Irecv([env, MPI.BYTE]), env, node))
                else:
                    target, buf = matcher.arrive(self.size + node, tag, n)
                    if buf is None:  # truncated: receive it anyway, to drop it
                        buf = np.empty(n, dtype=np.uint8)
                    self._mpi_in.append((msg.Irecv([buf, MPI.BYTE]), target))
            except MPI.Exception as exc:
                raise self._error("receive", self.size + node, exc) from None
        if self._mpi_in:
            keep = []
            for r, target in self._mpi_in:
                try:
                    if not r.Test():
                        keep.append((r, target))
                        continue
                except MPI.Exception as exc:
                    peer = getattr(target, "peer", -1)
                    matcher.fail(target, str(self._error("receive", peer, exc)))
                    continue
                matcher.complete(target)
            self._mpi_in = keep
        if self._env_in:
            done = 0
            for r, buf, node in self._env_in:  # delivered in probe order
                try:
                    if not r.Test():
                        break
                except MPI.Exception as exc:
                    log.error("relay %d: an envelope from node %d failed: %s", self.rank, node, exc)
                    done += 1
                    continue
                done += 1
                self._deliver_envelope(buf, node)
            del self._env_in[:done]
        if self._fwd_sends:
            keep_s = []
            for r, env, node in self._fwd_sends:
                try:
                    if not r.Test():
                        keep_s.append((r, env, node))
                except MPI.Exception as exc:
                    log.error("relay %d: forwarding to node %d failed: %s", self.rank, node, exc)
            self._fwd_sends = keep_s

    def _poll_own(self, reqs: list[Any]) -> None:
        """Test the MPI requests behind this relay's own sends."""
        MPI = self._MPI
        for req in reqs:
            if req.__class__ is _Send and req.mpi is not None and not req.done:
                try:
                    if req.mpi.Test():
                        req.done = True
                        req.mpi = req.keep = None
                except MPI.Exception as exc:
                    req.error = str(self._error("send", req.dest, exc))
                    req.done = True
                    req.mpi = req.keep = None

    # ------------------------------------------------------------------ the protocol

    def isend(self, buf: np.ndarray, dest: int, tag: int) -> Any:
        check_buffer(buf)
        if self._has_ops:
            self._apply_ops()
        req = _Send(dest)
        L = self.local_clients
        if dest == self.rank:
            target, tbuf = self._matcher.arrive(self.rank, tag, buf.nbytes)
            if tbuf is not None:
                tbuf[:] = buf
            self._matcher.complete(target)
            req.done = True
        elif 0 <= dest < self.size and dest // L == self.node:
            self._to_local(self.rank, dest, tag, buf, req)
        elif 0 <= dest < self.size + self.relays:
            MPI = self._MPI
            try:
                if dest < self.size:
                    env = self._envelope(self.rank, dest, tag, buf.nbytes)
                    env[MSG_SIZE:] = buf
                    req.keep = env
                    req.mpi = self.comm.Isend([env, MPI.BYTE], dest=dest // L, tag=ENVELOPE_TAG)
                else:
                    if tag == ENVELOPE_TAG:
                        raise TransportError(f"tag {ENVELOPE_TAG} is the relay's own")
                    req.mpi = self.comm.Isend([buf, MPI.BYTE], dest=dest - self.size, tag=tag)
            except MPI.Exception as exc:
                raise self._error("send", dest, exc) from None
        else:
            raise TransportError(
                f"rank {self.rank} sends to rank {dest} outside 0..{self.size + self.relays - 1}"
            )
        self._progress()
        return req

    def irecv(self, buf: np.ndarray, source: int, tag: int) -> Any:
        req = _Recv(check_buffer(buf), source, tag)
        self._progress()
        self._matcher.post(req)
        return req

    def test(self, req: Any) -> tuple[bool, int, int]:
        self._progress()
        if self._MPI is not None:
            self._poll_own([req])
        return request_state(req)

    def testsome(self, reqs: list[Any], counts: list[int] | None = None) -> list[int]:
        self._progress()
        if self._MPI is not None:
            self._poll_own(reqs)
        return collect(reqs, counts)

    def poll_message(self, tag: int, limit: int) -> tuple[int, np.ndarray] | None:
        self._progress()
        return self._matcher.take(tag, limit)

    def alive(self, peer: int) -> bool | None:
        if peer == self.rank:
            return True
        i = peer - self.node * self.local_clients
        if 0 <= peer < self.size and 0 <= i < self.local_clients:
            if self._has_ops:
                self._apply_ops()
            s = self._slots[i]
            if s is not None:
                return pid_alive(s.pid)
            return False if self._state[i] == "gone" else None
        return None

    def cancel(self, req: Any) -> None:
        if isinstance(req, _Recv):
            self._matcher.cancel(req)

    def node_layout(self) -> tuple[int, int, int, int]:
        """(L, L, node, nodes): the relay counts as local index L, past its clients."""
        return self.local_clients, self.local_clients, self.node, self.nodes

    def _ready(self) -> bool:
        if self._has_ops:
            return True
        for s in self._slots:
            if s is not None and (s.reader.pending() or s.writer.can_write()):
                return True
        return False

    def wait(self, timeout: float) -> None:
        """Block until a client may have written, :meth:`wake` was called, or ``timeout``.

        Moves no data: another thread may be running a pass of the loop meanwhile.
        MPI traffic cannot wake the eventfd: the loop's sleeps are short (its busy
        ceiling, ``backoff_max_s``) while its own ops are in flight, and this caps
        them at ``POLL_S`` for ``BUSY_S`` after any MPI traffic (forwarded ops).
        """
        if self.nodes > 1 and time.monotonic() < self._busy_until:
            timeout = min(timeout, POLL_S)
        if timeout <= 0 or self._ready():
            return
        slots = [s for s in self._slots if s is not None]
        for s in slots:
            s.channel.ctl[SERVICE_SLEEPING] = 1
        fence()
        if not self._ready():
            sleep_on(self.eventfd, timeout)
        for s in slots:
            if s.channel.ctl is not None:
                s.channel.ctl[SERVICE_SLEEPING] = 0

    def wake(self) -> None:
        """Make a concurrent or the next :meth:`wait` return (any thread)."""
        signal_eventfd(self.eventfd)

    def close(self) -> None:
        """Close attached channels and the descriptors (the communicator stays)."""
        if self._closed:
            return
        self._closed = True
        if self._has_ops:
            with self._ops_lock:
                ops, self._ops = self._ops, []
            for op in ops:
                if op[0] == "attach":
                    op[2].close()
                    os.close(op[3])
                else:
                    op[2].set()
        for i, s in enumerate(self._slots):
            if s is not None:
                self._slots[i] = None
                s.channel.close()
                try:
                    os.close(s.client_fd)
                except OSError:
                    pass
        os.close(self.eventfd)


def open_relay(local_clients: int, capacity: int = DEFAULT_CAPACITY) -> RelayTransport:
    """This node's relay over MPI's world (one rank per node), on a communicator of its own."""
    from mpi4py import MPI

    if not MPI.Is_initialized():
        MPI.Init_thread(MPI.THREAD_MULTIPLE)
    return RelayTransport(MPI.COMM_WORLD.Dup(), local_clients, capacity)


def agree(relay: RelayTransport, values: list[int]) -> list[int]:
    """The element-wise maximum of ``values`` over every node (blocking; before serving)."""
    if relay.comm is None:
        return list(values)
    from mpi4py import MPI

    mine = np.array(values, np.int64)
    out = np.empty_like(mine)
    relay.comm.Allreduce(mine, out, op=MPI.MAX)
    return [int(v) for v in out]

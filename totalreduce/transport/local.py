"""The local transport: ``size`` ranks as threads of one process.

Used by the tests and simulations.  It keeps MPI's matching rules: receives
posted in order match messages in the order each sender sent them on a tag
(non-overtaking), ``ANY_SOURCE`` takes the earliest matching message.  A
send reads its buffer only when a receive matches it and completes then, as
a rendezvous send does: a buffer changed while its send is in flight shows up
as wrong results, just as it would on a real network.  Message order across
senders is shuffled by an optional random delay to shake out order
assumptions.

The compiled lane does not call these Python methods: it calls the world's compiled message
layer (:mod:`.local_native`, the same functions MPI's binding record names, written for
threads) through :meth:`LocalTransport.native_binding`.  Its messages keep the same rules
(matching, non-overtaking, a send completes when a receive takes it), and ``jitter`` holds
its sends back too.  Every world has that layer: the engine runs every op in the lane.
"""

from __future__ import annotations

import random
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import TransportError
from .base import ANY_SOURCE, OversizeMessage


@dataclass(eq=False)
class _Send:
    source: int
    tag: int
    buf: np.ndarray
    done: bool = False


@dataclass(eq=False)
class _Recv:
    source: int
    tag: int
    buf: np.ndarray
    done: bool = False
    matched_source: int = -1
    nbytes: int = 0
    error: str | None = None
    cancelled: bool = False


@dataclass
class _Mailbox:
    unexpected: deque[_Send] = field(default_factory=deque)
    posted: list[_Recv] = field(default_factory=list)


class LocalWorld:
    """A set of ``size`` connected local transports; ``world.transport(r)`` is rank r's end.

    ``jitter`` (0..1) is the probability that a send is held back once before
    it becomes visible, which reorders messages across senders and tags but
    never within one sender and tag.  Each rank's transport has a binding to the world's
    compiled message layer, which the compiled lane runs over.
    """

    def __init__(self, size: int, *, jitter: float = 0.0, seed: int = 0) -> None:
        if size < 1:
            raise ValueError(f"a local world needs at least one rank, got {size}")
        self.size = size
        self._lock = threading.Lock()
        self._boxes = [_Mailbox() for _ in range(size)]
        self._held: list[tuple[int, _Send]] = []
        self._jitter = jitter
        self._rng = random.Random(seed)
        self._seed = seed
        self._native: Any = None  # .local_native.NativeWorld, made by the first binding

    def native(self) -> Any:
        """The world's compiled message layer (made, and compiled or loaded from the cache,
        on first use)."""
        with self._lock:
            if self._native is None:
                from .local_native import NativeWorld

                self._native = NativeWorld(self.size, jitter=self._jitter, seed=self._seed)
            return self._native

    def transport(self, rank: int) -> LocalTransport:
        return LocalTransport(self, rank)

    @staticmethod
    def _match(recv: _Recv, send: _Send) -> None:
        n = send.buf.nbytes
        if n > recv.buf.nbytes:
            recv.error = (
                f"message of {n} bytes from rank {send.source} tag {send.tag} truncated "
                f"into a {recv.buf.nbytes}-byte receive"
            )
        else:
            recv.buf[:n] = send.buf
        recv.nbytes = n
        recv.matched_source = send.source
        recv.done = True
        send.done = True

    def _deliver(self, dest: int, send: _Send) -> None:
        box = self._boxes[dest]
        for i, recv in enumerate(box.posted):
            if recv.tag == send.tag and recv.source in (ANY_SOURCE, send.source):
                del box.posted[i]
                self._match(recv, send)
                return
        box.unexpected.append(send)

    def _release_held(self, force: bool = False) -> None:
        keep = []
        kept: set[tuple[int, int]] = set()
        for dest, send in self._held:
            key = (send.source, send.tag)
            if key not in kept and (force or self._rng.random() >= self._jitter):
                self._deliver(dest, send)
            else:
                kept.add(key)
                keep.append((dest, send))
        self._held = keep

    def send(self, dest: int, send: _Send) -> None:
        with self._lock:
            self._release_held()
            # Hold a message back only if nothing of its sender and tag is held:
            # that keeps per-sender, per-tag order.
            blocked = any(s.source == send.source and s.tag == send.tag for _, s in self._held)
            if blocked or (self._jitter and self._rng.random() < self._jitter):
                self._held.append((dest, send))
            else:
                self._deliver(dest, send)

    def recv(self, rank: int, recv: _Recv) -> None:
        with self._lock:
            self._release_held()
            box = self._boxes[rank]
            for i, send in enumerate(box.unexpected):
                if send.tag == recv.tag and recv.source in (ANY_SOURCE, send.source):
                    del box.unexpected[i]
                    self._match(recv, send)
                    return
            box.posted.append(recv)

    def poke(self) -> None:
        """Let held messages through (called when a rank tests)."""
        if self._held:
            with self._lock:
                self._release_held(force=self._rng.random() < 0.5)

    def take(self, rank: int, tag: int) -> _Send | None:
        """The earliest unexpected message on ``tag`` from any source, matched now."""
        with self._lock:
            self._release_held()
            box = self._boxes[rank]
            for i, send in enumerate(box.unexpected):
                if send.tag == tag:
                    del box.unexpected[i]
                    send.done = True
                    return send
            return None

    def cancel(self, rank: int, recv: _Recv) -> None:
        with self._lock:
            box = self._boxes[rank]
            if recv in box.posted:
                box.posted.remove(recv)
                recv.cancelled = True
                recv.done = True  # completes, as a cancelled MPI request does


class LocalTransport:
    """Rank ``rank``'s end of a :class:`LocalWorld`."""

    def __init__(self, world: LocalWorld, rank: int) -> None:
        if not 0 <= rank < world.size:
            raise ValueError(f"rank {rank} outside a local world of {world.size}")
        self.world = world
        self.rank = rank
        self.size = world.size
        self.description = f"local ({world.size} ranks in one process)"
        self.tag_ub = (1 << 31) - 1  # the compiled layer takes any non-negative int tag
        self.native_binding = self._native_binding

    def _native_binding(self) -> np.ndarray:
        """The record compiled code calls this rank's end of the world through
        (:meth:`.local_native.NativeWorld.binding`)."""
        return self.world.native().binding(self.rank)

    @staticmethod
    def _bytes(buf: np.ndarray) -> np.ndarray:
        if buf.dtype != np.uint8 or buf.ndim != 1 or not buf.flags.c_contiguous:
            raise TransportError(f"transport buffers are 1-D contiguous uint8, got {buf.dtype}")
        return buf

    def isend(self, buf: np.ndarray, dest: int, tag: int) -> Any:
        if not 0 <= dest < self.size:
            raise TransportError(
                f"rank {self.rank} sends to rank {dest} outside 0..{self.size - 1}"
            )
        req = _Send(self.rank, tag, self._bytes(buf))
        self.world.send(dest, req)
        return req

    def irecv(self, buf: np.ndarray, source: int, tag: int) -> Any:
        req = _Recv(source, tag, self._bytes(buf))
        self.world.recv(self.rank, req)
        return req

    def test(self, req: Any) -> tuple[bool, int, int]:
        self.world.poke()
        if not req.done:
            return False, -1, 0
        if isinstance(req, _Recv):
            if req.error:
                raise TransportError(req.error)
            return True, req.matched_source, req.nbytes
        return True, self.rank, 0

    def testsome(self, reqs: list[Any], counts: list[int] | None = None) -> list[int]:
        self.world.poke()
        out: list[int] = []
        failed: list[int] = []
        errors = []
        for i, r in enumerate(reqs):
            if r.done:
                if isinstance(r, _Recv) and r.error:
                    failed.append(i)
                    errors.append(r)
                    continue
                out.append(i)
                if counts is not None:
                    counts.append(r.nbytes if isinstance(r, _Recv) else 0)
        if failed:
            err = TransportError(errors[0].error)
            err.done, err.failed = out, failed  # type: ignore[attr-defined]
            err.peer = errors[0].matched_source  # type: ignore[attr-defined]
            raise err
        return out

    def poll_message(self, tag: int, limit: int) -> tuple[int, np.ndarray] | None:
        send = self.world.take(self.rank, tag)
        if send is None:
            return None
        if send.buf.nbytes > limit:
            raise OversizeMessage(send.source, send.buf.nbytes, limit)
        return send.source, send.buf.copy()

    def alive(self, peer: int) -> bool | None:
        return True  # threads of this process

    def cancel(self, req: Any) -> None:
        self.world.cancel(self.rank, req)

    def node_layout(self) -> tuple[int, int, int, int]:
        """(local_rank, local_size, cross_rank, cross_size): one node, so local is global."""
        return self.rank, self.size, 0, 1

    def close(self) -> None:
        pass

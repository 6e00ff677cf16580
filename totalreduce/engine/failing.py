"""Failing ops in the main loop: errors here, errors from peers and to them, aborts.

:class:`FailHooks` is a base of :class:`~.loop.CommLoop`.  An op that fails here
(``_fail``; ``_fail_unsubmitted`` before it entered the table) leaves the table, gives
its buffers back, tells the ranks that cleared its bodies that they will not come
(an empty message on the tag: ``_abandon``), fails the ops chained after it, and
tells its group (ERROR, ``_error_frame``).  An error from a peer (``_on_error``)
fails the op here and is relayed once to its group; one for an op finished here is
raised late; one for an op not submitted yet waits for it.  An abort
(``request_abort``) fails an op here and on every rank.  Peers that fail or leave
are ``peers.py``'s; ops that stop moving are ``stalls.py``'s.
"""

from __future__ import annotations

import heapq
import logging
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import (
    FrameError,
    OpFailedError,
    OpMismatchError,
    OpTimeoutError,
    TotalReduceError,
    TransportError,
)
from ..transport.base import Transport
from . import wire
from .failures import ERROR_FAILED, ERROR_FRAME, ERROR_MISMATCH, ERROR_TIMEOUT, _error_from_peer
from .floating import BufferPool, FloatingList
from .payload import OpKey, OpSpec, OpState, Payload, describe_op
from .sending import _CTL
from .wire import ERROR, F_GEN, F_NBYTES, F_PARAM, F_WID

if TYPE_CHECKING:
    from .lane import Lane

log = logging.getLogger("totalreduce.engine")

MAX_ERROR_TEXT = 4096


class FailHooks:
    """Failing ops in the main loop (see the module docstring)."""

    rank: int
    world: int
    t: Transport
    stats: Any  # LoopStats
    trace: Any
    lane: Lane | None
    lock: threading.Lock
    table: dict[OpKey, Payload]
    failed: OrderedDict[OpKey, str]
    completed: OrderedDict[OpKey, tuple[Any, ...]]
    late_errors: deque[TotalReduceError]
    floating: FloatingList
    pool: BufferPool
    submissions: deque[Any]
    _passive: int
    _held: dict[OpKey, list[OpSpec]]
    _cleared: list[tuple[int, int, int, int, Payload, int, int]]
    _rejected: dict[OpKey, set[int]]
    _left: set[int]
    _unreachable: set[int]

    # provided by CommLoop and its other bases
    _remember: Callable[[Any, OpKey, Any], None]
    _finish_spec: Callable[[OpSpec, BaseException | None], None]
    _control: Callable[..., None]
    _track: Callable[[Any, int, Any], None]
    _drop_floating: Callable[[Any], None]
    _lane_fail: Callable[..., None]
    _lane_fail_all: Callable[[BaseException], None]

    # ------------------------------------------------------------------ failing ops

    def _fail(self, p: Payload, error: BaseException, *, tell_peers: bool, also: int = -1) -> None:
        """Fail op ``p`` here; with ``tell_peers``, tell its group (and rank ``also``)."""
        if p.state in (OpState.DONE, OpState.FAILED):
            return
        p.state = OpState.FAILED
        if self.table.pop(p.key, None) is not None:
            self._passive -= p.spec.passive
            if self.lane is not None:
                self.lane.set_foreign(p.key, False)
        p.ready.clear()
        p.parked.clear()
        for buf in p.pending.values():
            self.pool.give(buf)
        p.pending.clear()
        # Bodies cleared to send go out as empty messages: the receiver posted a receive
        # for each and learns from the empty one that this rank gave up. Receives posted
        # here stay posted until their sender's body (or its giving up) comes.
        if any(e[4] is p for e in self._cleared):
            for e in [e for e in self._cleared if e[4] is p]:
                self._abandon(e[5], e[6])
            self._cleared = [e for e in self._cleared if e[4] is not p]
            heapq.heapify(self._cleared)
        for i, tag in p.early.items():  # clears that came unasked: their receives are up
            self._abandon(p.spec.group[p.spec.plan.sends[i].peer], tag)
        p.early.clear()
        self._rejected.pop(p.key, None)
        self._remember(self.failed, p.key, str(error))
        self.stats.ops_failed += 1
        for spec in self._held.pop(p.key, ()):  # p left the table: they fail, not wait
            self._fail_unsubmitted(spec, self._chain_error(spec, str(error)))
        if tell_peers:
            self._tell_group(p.key, p.spec.group, also, error)
        text = str(error)
        log.log(
            logging.INFO if p.spec.passive else logging.ERROR,  # its owner reports it
            "%s",
            text if text.startswith(f"rank {self.rank}:") else f"rank {self.rank}: {text}",
        )
        if self.trace is not None:
            self.trace.op(p.spec.name, p.spec.generation, "failed", p.spec.priority)
        self._finish_spec(p.spec, error)

    def _tell_group(
        self, key: OpKey, group: tuple[int, ...], also: int, error: BaseException
    ) -> None:
        """Send op ``key``'s error to the other ranks of ``group`` and to rank ``also``
        (>= 0), with the code that tells a peer what to raise (main loop and lane alike)."""
        if isinstance(error, OpMismatchError):
            code = ERROR_MISMATCH
        elif isinstance(error, FrameError):
            code = ERROR_FRAME
        elif isinstance(error, OpTimeoutError):
            code = ERROR_TIMEOUT
        else:
            code = ERROR_FAILED
        dests = set(group)
        if also >= 0:
            dests.add(also)
        for world in sorted(dests):
            if world != self.rank:
                self._error_frame(key, world, str(error), code)

    @staticmethod
    def _chain_error(spec: OpSpec, why: str) -> OpFailedError:
        return OpFailedError(f"{spec.describe()}: the phase it starts after failed: {why}")

    def _fail_unsubmitted(self, spec: OpSpec, error: TotalReduceError) -> None:
        """An op fails before it entered the table: tell its group, drop its floating frames."""
        key = spec.key
        self._remember(self.failed, key, str(error))
        for ff in self.floating.take(key):
            self._drop_floating(ff)
        self._rejected.pop(key, None)
        code = (
            ERROR_MISMATCH
            if isinstance(error, OpMismatchError)
            else ERROR_FRAME
            if isinstance(error, FrameError)
            else ERROR_FAILED
        )
        for world in spec.group:
            if world != self.rank:
                self._error_frame(key, world, str(error), code)
        log.error("rank %d: %s", self.rank, error)
        self._finish_spec(spec, error)

    def _abandon(self, dest: int, tag: int) -> None:
        """Tell ``dest`` that a body it cleared will not come: an empty message on its tag."""
        if dest in self._unreachable:
            return
        empty = np.empty(0, dtype=np.uint8)
        try:
            self._track(self.t.isend(empty, dest, tag), _CTL, empty)
        except TransportError as exc:
            self._unreachable.add(dest)
            log.debug("giving up a body for rank %d failed: %s", dest, exc)

    def _fail_all(self, error: BaseException) -> None:
        for p in list(self.table.values()):
            self._fail(p, error, tell_peers=False)
        self._lane_fail_all(error)
        while self.submissions:
            item = self.submissions.popleft()
            if not isinstance(item, tuple):  # aborts and notes need no answer
                self._finish_spec(item, error)

    def fail_all(self, error: BaseException) -> None:
        """Fail every op in flight (shutdown); takes the lock."""
        with self.lock:
            self._fail_all(error)

    # ------------------------------------------------------------------ errors from and to peers

    def _error_frame(self, key: OpKey, dest: int, message: str, code: int) -> None:
        """Tell rank ``dest`` that op ``key`` failed."""
        if dest in self._unreachable or dest in self._left:
            return
        body = message.encode()[:MAX_ERROR_TEXT]
        shape = (0, 0, 0, 0, 0, code, 0)
        self._control(dest, ERROR, shape, key, body=body)

    @staticmethod
    def _named(message: str, key: OpKey, name: str | int) -> str:
        """An error a node's service wrote names the op by its id: name it as users do."""
        return message.replace(f"op '#{key[0]:016x}'", f"op {name!r}")

    def _on_error_frame(self, source: int, f: wire.Frame, buf: np.ndarray, off: int) -> None:
        """An op failed on rank ``source``; the frame's body says why."""
        n = f[F_NBYTES]
        text = bytes(buf[off : off + n]).decode(errors="replace")
        self._on_error((f[F_WID], f[F_GEN]), text, f[F_PARAM], source)

    def _on_error(self, key: OpKey, message: str, code: int, source: int) -> None:
        """An op failed on rank ``source``: fail it here and pass it on to its group."""
        if key in self.failed:
            return  # heard already: relayed once, no loops
        p = self.table.get(key)
        if p is not None:
            message = self._named(message, key, p.spec.name)
        err = _error_from_peer(message, code)
        if p is not None:
            self._fail(p, err, tell_peers=True)
            return
        lop = None if self.lane is None else self.lane.by_key.get(key)
        if lop is not None:
            message = self._named(message, key, lop.spec.name)
            self._lane_fail(lop, _error_from_peer(message, code), tell_peers=True)
            return
        done = self.completed.get(key)
        if done is not None:
            # Finished here already: the result may be wrong. Say so at once and
            # raise it at this rank's next call.
            what, group = describe_op(*done[0]), done[1]
            late = type(err)(
                f"{what} completed on rank {self.rank}, but failed elsewhere: {message}"
            )
            log.error("rank %d: %s", self.rank, late)
            self.late_errors.append(late)
            self._remember(self.failed, key, message)
            for world in group:
                if world not in (self.rank, source):
                    self._error_frame(key, world, message, code)
            return
        # Not submitted here yet: fail it when it is (and tell the group then).
        for ff in self.floating.take(key):
            self._drop_floating(ff)
        self.floating.add_error(key, message, code)

    def _abort(self, key: OpKey, name: str, reason: str, mismatch: bool = False) -> None:
        err: TotalReduceError = OpMismatchError(reason) if mismatch else OpFailedError(reason)
        code = ERROR_MISMATCH if mismatch else ERROR_FAILED
        p = self.table.get(key)
        if p is not None:
            self._fail(p, err, tell_peers=True)
            return
        lop = None if self.lane is None else self.lane.by_key.get(key)
        if lop is not None:
            self._lane_fail(lop, err, tell_peers=True)
            return
        # Not submitted here (yet): remember, and tell every rank.
        for ff in self.floating.take(key):
            self._drop_floating(ff)
        self.floating.add_error(key, reason, code)
        for world in range(self.world):
            if world != self.rank:
                self._error_frame(key, world, reason, code)
        log.error("rank %d: op %r generation %d aborted: %s", self.rank, name, key[1], reason)

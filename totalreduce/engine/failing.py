"""Failing ops: errors here, errors from peers and to them, aborts.

:class:`FailHooks` is a base of :class:`~.loop.CommLoop`.  An op that fails before it
entered the lane (``_fail_unsubmitted``) fails the ops chained after it and tells its
group (ERROR, ``_error_frame``); a lane op fails in ``lane_failing.py``.  An error
from a peer (``_on_error``) fails the op here and is relayed once to its group; one
for an op finished here is raised late; one for an op not submitted yet waits for it
(``_early_errors``, the last ``REMEMBERED``).  An abort (``request_abort``) fails an
op here and on every rank.  Peers that fail or leave are ``peers.py``'s; ops that stop
moving are ``stalls.py``'s.
"""

from __future__ import annotations

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
)
from ..lane.payload import REMEMBERED, OpKey, OpSpec, describe_op
from ..protocol import ERROR, F_GEN, F_NBYTES, F_PARAM, F_WID, MAX_CONTROL_BODY
from .failures import ERROR_FAILED, ERROR_FRAME, ERROR_MISMATCH, ERROR_TIMEOUT, _error_from_peer

if TYPE_CHECKING:
    from ..lane.lane import Lane

log = logging.getLogger("totalreduce.engine")

MAX_ERROR_TEXT = MAX_CONTROL_BODY


def error_code(error: BaseException) -> int:
    """The code an ERROR frame carries for ``error`` (the class the peer raises)."""
    if isinstance(error, OpMismatchError):
        return ERROR_MISMATCH
    if isinstance(error, FrameError):
        return ERROR_FRAME
    if isinstance(error, OpTimeoutError):
        return ERROR_TIMEOUT
    return ERROR_FAILED


class FailHooks:
    """Failing ops (see the module docstring)."""

    rank: int
    world: int
    stats: Any  # LoopStats
    trace: Any
    lane: Lane | None
    lock: threading.Lock
    failed: OrderedDict[OpKey, str]
    completed: OrderedDict[OpKey, tuple[Any, ...]]
    late_errors: deque[TotalReduceError]
    submissions: deque[Any]
    _held: dict[OpKey, list[OpSpec]]
    _left: set[int]
    _unreachable: set[int]
    _early_errors: OrderedDict[OpKey, tuple[str, int]]

    # provided by CommLoop and its other bases
    _remember: Callable[[Any, OpKey, Any], None]
    _finish_spec: Callable[[OpSpec, BaseException | None], None]
    _control: Callable[..., None]
    _lane_fail: Callable[..., None]
    _lane_fail_all: Callable[[BaseException], None]

    # ------------------------------------------------------------------ failing ops

    def _tell_group(
        self, key: OpKey, group: tuple[int, ...], also: int, error: BaseException
    ) -> None:
        """Send op ``key``'s error to the other ranks of ``group`` and to rank ``also``
        (>= 0), with the code that tells a peer what to raise."""
        code = error_code(error)
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
        """An op fails before it entered the lane: tell its group, drop its floating frames."""
        key = spec.key
        self._remember(self.failed, key, str(error))
        if self.lane is not None:
            self.lane.drop_floating(key)
        self._tell_group(key, spec.group, -1, error)
        log.error("rank %d: %s", self.rank, error)
        for later in self._held.pop(key, ()):
            self._fail_unsubmitted(later, self._chain_error(later, str(error)))
        self._finish_spec(spec, error)

    def _fail_all(self, error: BaseException) -> None:
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

    def _on_error_frame(self, source: int, f: tuple[int, ...], buf: np.ndarray, off: int) -> None:
        """An op failed on rank ``source``; the frame's body says why."""
        n = f[F_NBYTES]
        text = bytes(buf[off : off + n]).decode(errors="replace")
        self._on_error((f[F_WID], f[F_GEN]), text, f[F_PARAM], source)

    def _on_error(self, key: OpKey, message: str, code: int, source: int) -> None:
        """An op failed on rank ``source``: fail it here and pass it on to its group."""
        if key in self.failed:
            return  # heard already: relayed once, no loops
        lop = None if self.lane is None else self.lane.by_key.get(key)
        if lop is not None:
            message = self._named(message, key, lop.spec.name)
            self._lane_fail(lop, _error_from_peer(message, code), tell_peers=True)
            return
        err = _error_from_peer(message, code)
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
        if self.lane is not None:
            self.lane.drop_floating(key)
        self._early_error(key, message, code)

    def _early_error(self, key: OpKey, message: str, code: int) -> None:
        """An op failed elsewhere before this rank submitted it (the last REMEMBERED: older
        ones belong to ops nobody will submit)."""
        errors = self._early_errors
        errors[key] = (message, code)
        if len(errors) > REMEMBERED:
            errors.popitem(last=False)

    def _abort(self, key: OpKey, name: str, reason: str, mismatch: bool = False) -> None:
        err: TotalReduceError = OpMismatchError(reason) if mismatch else OpFailedError(reason)
        code = ERROR_MISMATCH if mismatch else ERROR_FAILED
        lop = None if self.lane is None else self.lane.by_key.get(key)
        if lop is not None:
            self._lane_fail(lop, err, tell_peers=True)
            return
        # Not submitted here (yet): remember, and tell every rank.
        if self.lane is not None:
            self.lane.drop_floating(key)
        self._early_error(key, reason, code)
        for world in range(self.world):
            if world != self.rank:
                self._error_frame(key, world, reason, code)
        log.error("rank %d: op %r generation %d aborted: %s", self.rank, name, key[1], reason)

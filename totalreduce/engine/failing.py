"""Failing ops: the one table of errors, errors from peers and to them, aborts, late errors.

:class:`Failures` is an object of :class:`~.loop.CommLoop`'s (``loop.failures``) that owns
what a rank knows of ops that ended: the one table of their errors (``errors``,
:class:`~.failures.OpErrors`), the ops that completed here (``completed``, for a late
error or a late frame about one), and the errors to raise at this rank's next call
(``late``).  An op that fails before it entered the lane (:meth:`~Failures.fail_unsubmitted`)
fails the ops chained after it and tells its group (ERROR, :meth:`~Failures.send_error`);
a lane op fails in ``lane_failing.py``.  An error from a peer (:meth:`~Failures.on_error`)
fails the op here and is relayed once to its group; one for an op finished here is
raised late; one for an op not submitted yet waits for it (an early error in the table).
An abort (``CommLoop.request_abort``) fails an op here and on every rank.  A frame of an
op finished here that a peer still sends is a disagreement about the op's pattern
(:meth:`~Failures.late_frame`).  Peers that fail or leave are ``peers.py``'s; ops that stop
moving are ``stalls.py``'s.
"""

from __future__ import annotations

import logging
from collections import deque

import numpy as np

from ..errors import (
    FrameError,
    OpFailedError,
    OpMismatchError,
    OpTimeoutError,
    TotalReduceError,
)
from ..lane.payload import REMEMBERED, OpKey, OpSpec, describe_op
from ..protocol import (
    ERROR,
    F_GEN,
    F_NBYTES,
    F_PARAM,
    F_SEGMENT,
    F_STEP,
    F_WID,
    MAX_CONTROL_BODY,
)
from .completion import finish
from .ended import EndedOps
from .failures import (
    ERROR_FAILED,
    ERROR_FRAME,
    ERROR_MISMATCH,
    ERROR_TIMEOUT,
    OpErrors,
    _error_from_peer,
)
from .parts import Loop
from .wire import SESSION_ID

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


class Failures:
    """Failing ops, and what a rank knows of ops that ended (see the module docstring)."""

    def __init__(self, loop: Loop) -> None:
        self._loop = loop
        #: The one table of ops' errors: failed here, or elsewhere before submitted here.
        self.errors = OpErrors()
        #: Ops finished here, the last ``REMEMBERED`` (a ring of arrays, ``ended.py``: an
        #: op's wire id, generation and the row naming it, its group and its schedule's
        #: hints): a frame for one means a peer disagrees about the op; an error for one
        #: is raised late.
        self.completed = EndedOps(REMEMBERED)
        #: Errors of ops that completed here but failed elsewhere, for this rank's next call.
        self.late: deque[TotalReduceError] = deque()

    def done(self, wid: int, gen: int, row: int) -> None:
        """Op ``(wid, gen)`` completed here; ``row``: what names it in :attr:`completed`
        (``completed.row(name, group, hints)``, kept by whoever repeats it)."""
        if wid == SESSION_ID:
            return  # every job starts with it: a memory of it would meet the next job
        self.completed.note(wid, gen, row)

    def forget(self, key: OpKey) -> None:
        """Op ``key`` will come again (a node's session op): forget how it ended."""
        self.completed.forget(key)
        self.errors.forget(key)

    # ------------------------------------------------------------------ failing ops

    def tell_group(
        self, key: OpKey, group: tuple[int, ...], also: int, error: BaseException
    ) -> None:
        """Send op ``key``'s error to the other ranks of ``group`` and to rank ``also``
        (>= 0), with the code that tells a peer what to raise."""
        code = error_code(error)
        dests = set(group)
        if also >= 0:
            dests.add(also)
        rank = self._loop.rank
        for world in sorted(dests):
            if world != rank:
                self.send_error(key, world, str(error), code)

    @staticmethod
    def chain_error(spec: OpSpec, why: str) -> OpFailedError:
        """The error of an op chained after one that failed with ``why``."""
        return OpFailedError(f"{spec.describe()}: the phase it starts after failed: {why}")

    def fail_unsubmitted(self, spec: OpSpec, error: TotalReduceError) -> None:
        """An op fails before it entered the lane: tell its group, drop its floating frames."""
        loop = self._loop
        key = spec.key
        self.errors.note_failed(key, str(error))
        if loop.lane is not None:
            loop.lane.drop_floating(key)
        self.tell_group(key, spec.group, -1, error)
        log.error("rank %d: %s", loop.rank, error)
        for later in loop.ops.chained_after(key):
            self.fail_unsubmitted(later, self.chain_error(later, str(error)))
        finish(spec, error)

    def fail_everything(self, error: BaseException) -> None:
        """Fail every op in flight and queued (the caller holds the loop's lock)."""
        loop = self._loop
        loop.lane_errors.fail_all(error)
        submissions = loop.submissions
        while submissions:
            item = submissions.popleft()
            if not isinstance(item, tuple):  # aborts and notes need no answer
                finish(item, error)

    def fail_all(self, error: BaseException) -> None:
        """Fail every op in flight (shutdown); takes the loop's lock."""
        with self._loop.lock:
            self.fail_everything(error)

    # ------------------------------------------------------------------ errors from and to peers

    def send_error(self, key: OpKey, dest: int, message: str, code: int) -> None:
        """Tell rank ``dest`` that op ``key`` failed."""
        loop = self._loop
        if loop.peers.shut_out(dest):
            return
        body = message.encode()[:MAX_ERROR_TEXT]
        shape = (0, 0, 0, 0, 0, code, 0)
        loop.control.send(dest, ERROR, shape, key, body=body)

    @staticmethod
    def named(message: str, key: OpKey, name: str | int) -> str:
        """An error a node's service wrote names the op by its id: name it as users do."""
        return message.replace(f"op '#{key[0]:016x}'", f"op {name!r}")

    def on_error_frame(self, source: int, f: tuple[int, ...], buf: np.ndarray, off: int) -> None:
        """An op failed on rank ``source``; the frame's body says why (ERROR's handler)."""
        n = f[F_NBYTES]
        text = bytes(buf[off : off + n]).decode(errors="replace")
        self.on_error((f[F_WID], f[F_GEN]), text, f[F_PARAM], source)

    def on_error(self, key: OpKey, message: str, code: int, source: int) -> None:
        """An op failed on rank ``source``: fail it here and pass it on to its group."""
        if self.errors.failed(key) is not None:
            return  # heard already: relayed once, no loops
        loop = self._loop
        lane = loop.lane
        lop = None if lane is None else lane.by_key.get(key)
        if lop is not None:
            message = self.named(message, key, lop.spec.name)
            loop.lane_errors.fail(lop, _error_from_peer(message, code), tell_peers=True)
            return
        err = _error_from_peer(message, code)
        done = self.completed.get(key)
        if done is not None:
            # Finished here already: the result may be wrong. Say so at once and
            # raise it at this rank's next call.
            what, group = describe_op(*done[0]), done[1]
            late = type(err)(
                f"{what} completed on rank {loop.rank}, but failed elsewhere: {message}"
            )
            log.error("rank %d: %s", loop.rank, late)
            self.late.append(late)
            self.errors.note_failed(key, message)
            for world in group:
                if world not in (loop.rank, source):
                    self.send_error(key, world, message, code)
            return
        # Not submitted here yet: fail it when it is (and tell the group then); the last
        # ones only: older ones belong to ops nobody will submit.
        if lane is not None:
            lane.drop_floating(key)
        self.errors.note_early(key, message, code)

    def late_frame(self, source: int, f: tuple[int, ...], key: OpKey) -> bool:
        """A frame of an op not in the lane's table: True if it was dealt with (the op
        failed here, or finished here and the ranks disagree about its pattern)."""
        if self.errors.knows(key):
            return True
        done = self.completed.get(key)
        if done is None:
            return False
        rank = self._loop.rank
        (name, gen), _, hints = done[0], done[1], done[2]
        what = describe_op(name, gen)
        step = f[F_STEP]
        if step < len(hints):
            detail = hints[step].format(sender=source, me=rank)
        else:
            detail = (
                f"rank {source} sends to rank {rank} at step {step} (segment "
                f"{f[F_SEGMENT]}), but rank {rank} finished the op without that exchange "
                "(the ranks disagree on the op's pattern: root, topology, weights, group or "
                "algorithm)"
            )
        msg = f"{what}: {detail}"
        self.on_error(key, msg, ERROR_MISMATCH, source)
        self.send_error(key, source, msg, ERROR_MISMATCH)
        return True

    def abort(self, key: OpKey, name: str, reason: str, mismatch: bool = False) -> None:
        """Fail op ``key`` here and on every rank, submitted here or not."""
        loop = self._loop
        err: TotalReduceError = OpMismatchError(reason) if mismatch else OpFailedError(reason)
        code = ERROR_MISMATCH if mismatch else ERROR_FAILED
        lane = loop.lane
        lop = None if lane is None else lane.by_key.get(key)
        if lop is not None:
            loop.lane_errors.fail(lop, err, tell_peers=True)
            return
        # Not submitted here (yet): remember, and tell every rank.
        if lane is not None:
            lane.drop_floating(key)
        self.errors.note_early(key, reason, code)
        for world in range(loop.world):
            if world != loop.rank:
                self.send_error(key, world, reason, code)
        log.error("rank %d: op %r generation %d aborted: %s", loop.rank, name, key[1], reason)

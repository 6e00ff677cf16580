"""The loop's ops in the compiled lane: entering them, finishing them, chains.

:class:`LaneOps` is an object of :class:`~.loop.CommLoop`'s (``loop.ops``) that owns the
ops chained after others (``OpSpec.after``, held until their first op completes).  It
enters every op into the lane (:meth:`~LaneOps.activate`: ``Lane.plan_of``; one it cannot
run fails on every rank of its group with the reason, ``Lane.why_not``), or, repeated,
straight from the submitting thread (:meth:`~LaneOps.express`, :meth:`~LaneOps.now`),
and, after the lane's compiled passes (``loop.driving``'s), turns the lane's events into
errors (``loop.lane_errors``) and finishes the ops it completed (:meth:`~LaneOps.drain`).
A node service's compiled loop enters repeats itself (``lane/lane_service.py``): the
conditions under which it may, and the record of what it ran, are here too
(:meth:`~LaneOps.hold_for_repeats` to :meth:`~LaneOps.release_repeats`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from .. import protocol as L
from ..errors import OpFailedError, TotalReduceError
from ..lane.payload import OpKey, OpSpec
from .completion import finish
from .failures import _error_from_peer
from .parts import Loop
from .wire import SESSION_ID

if TYPE_CHECKING:
    import numpy as np

    from ..lane.lane import LaneOp, LaneShape

log = logging.getLogger("totalreduce.engine")

#: No clears sent unasked (a lane op's record in ``completed``): a tuple, not a frozenset,
#: so that the record holds no container the garbage collector tracks and the record
#: leaves its young generation untracked instead of being promoted, once per op.
_NONE: tuple[Any, ...] = ()
_get_ident = threading.get_ident


class LaneOps:
    """The loop's ops in the lane (see the module docstring)."""

    def __init__(self, loop: Loop) -> None:
        self._loop = loop
        #: Ops submitted to start after another op of this rank completes (OpSpec.after).
        self.held: dict[OpKey, list[OpSpec]] = {}

    def has_chains(self) -> bool:
        """Ops wait for another op of this rank to complete."""
        return bool(self.held)

    def chained_after(self, key: OpKey) -> Iterable[OpSpec]:
        """The ops chained after op ``key``, which ended: no longer held."""
        return self.held.pop(key, ())

    # ------------------------------------------------------------------ entering

    def activate(self, spec: OpSpec) -> None:
        """Start a submitted op: hold it for the op it is chained after, fail it for a bad
        peer in its group or a failed first op, else enter it into the lane."""
        loop = self._loop
        if loop.fatal is not None:
            finish(spec, TotalReduceError(f"the comm loop stopped: {loop.fatal}"))
            return
        lane = loop.lane
        if lane is None:
            finish(spec, TotalReduceError(f"{spec.describe()}: the engine has no compiled lane"))
            return
        failures = loop.failures
        if spec.after is not None:
            first = spec.after
            if first in lane.by_key:
                self.held.setdefault(first, []).append(spec)
                return
            why = failures.errors.failed(first)
            if why is not None:
                failures.fail_unsubmitted(spec, failures.chain_error(spec, why))
                return
        bad = loop.peers.blocking(spec.group)
        if bad is not None:
            failures.fail_unsubmitted(spec, type(bad)(f"{spec.describe()}: {bad}"))
            return
        self._enter(spec)

    def _enter(self, spec: OpSpec) -> None:
        """Enter ``spec`` into the lane; one it cannot run fails here and on its group."""
        loop = self._loop
        lane = loop.lane
        assert lane is not None
        rank = loop.rank
        key = spec.key
        why = lane.unrunnable(spec)
        if why is not None:  # no engine runs it: it fails here and on its group
            lane.drop_floating(key)
            self.refuse(spec, OpFailedError(f"{spec.describe()} on rank {rank}: {why}"))
            return
        plan = lane.plan_of(spec)
        if plan < 0:  # the same on every rank of the op: each refuses it, and tells the rest
            lane.drop_floating(key)
            self.refuse(
                spec,
                OpFailedError(
                    f"{spec.describe()} on rank {rank}: it cannot run: {lane.why_not(spec)}"
                ),
            )
            return
        failures = loop.failures
        err = failures.errors.take_early(key)
        if err is not None:
            lane.drop_floating(key)
            error = _error_from_peer(failures.named(err[0], key, spec.name), err[1])
            self.refuse(spec, error)
            return
        if key in lane.by_key:
            finish(spec, OpFailedError(f"{spec.describe()} submitted twice on rank {rank}"))
            return
        lop = lane.submit(spec, plan, spec.schedule.work_count)
        if lop is None:
            self.refuse(
                spec,
                OpFailedError(
                    f"{spec.describe()}: rank {rank} has {lane.inflight} ops in flight, "
                    "the most the compiled lane holds; wait for some before submitting more"
                ),
            )
            return
        if loop.trace is not None:
            loop.trace.op(spec.name, spec.generation, "submitted", spec.priority)
        peers = loop.peers
        left = peers.left
        # What peers that left sent before leaving is placed above.
        for peer in sorted(left.intersection(spec.group)) if left else ():
            if lane.state(lop) == L.S_ACTIVE and lane.needs(lop, peer):
                loop.lane_errors.fail(
                    lop,
                    OpFailedError(
                        f"rank {rank}: {spec.describe()}: {peers.who(peer)} stopped (its "
                        "service shut down: the program ended or failed) before it completed"
                    ),
                    tell_peers=True,
                )
        self.drain()

    def refuse(self, spec: OpSpec, error: TotalReduceError) -> None:
        """Fail an op the lane never entered, telling its group."""
        loop = self._loop
        loop.failures.fail_unsubmitted(spec, error)
        if loop.lane is not None:
            loop.lane.remember_failed(spec.key)

    def express(self, spec: OpSpec, holder: Any) -> LaneOp | None:
        """Enter a repeat of an op the lane runs (an allreduce, a reduce-scatter or a
        broadcast: service/express.py) into the lane from the submitting thread,
        past the submission queue and the loop's activation (its lane op, which a
        waiter may wait on straight away: ``Driver.try_op``); None when anything
        those would look at stands in the way (the caller then submits it the usual way,
        which sorts it out).  ``holder.lane_shape`` keeps the lane's fields of the shape
        between calls (made here, under the lock, the first time).  A timeline is a sink on
        this route: the op's events are recorded here as the usual route records them."""
        loop = self._loop
        lane = loop.lane
        peers = loop.peers
        driving = loop.driving
        if (
            lane is None
            or holder.lane_shape is False
            or loop.submissions  # ops queued before this one enter first
            or peers.bad
            or self.held
            or lane.mem[L.C_FULL]
            or not driving.express_lock(lane)
        ):
            return None
        driving.owner = _get_ident()
        try:
            errors = loop.failures.errors
            if (
                loop.fatal is not None
                or peers.bad  # again, under the lock: a peer may have left meanwhile
                or (  # the key met before (most often nothing is there to look in)
                    (errors.early or lane.by_key)
                    and ((key := spec.key) in lane.by_key or errors.is_early(key))
                )
            ):
                return None
            try:
                shape = holder.lane_shape
                if shape is None or shape.epoch != lane.plans_epoch:  # new, or its plan moved
                    shape = lane.shape_of(spec)
                    holder.lane_shape = False if shape is None else shape
                    if shape is None:
                        return None
                lop = lane.enter(spec, shape)
                if lop is None:
                    return None
                loop.stats.lane_express += 1
                if loop.trace is not None:  # a sink on the route, the usual route's events
                    loop.trace.op(spec.name, spec.generation, "submitted", spec.priority)
            except Exception:  # the usual path fails the op properly, naming the cause
                log.exception("rank %d: the lane's express entry failed", loop.rank)
                return None
            if lane.pending:  # it ended at once (its peers' frames came first), or events wait
                try:
                    self.drain()
                except Exception as exc:
                    loop.stopped_by(exc)
        finally:
            driving.owner = 0
            loop.lock.release()
        driving.nudge()
        return lop

    def now(
        self, shape: LaneShape, name: str | int, wid: int, gen: int, group: tuple[int, ...],
        priority: int, inbuf: np.ndarray, outbuf: np.ndarray, make: Callable[..., Any],
        record: Any, svc: Any, result: Any,
    ) -> Any:  # fmt: skip
        """A blocking repeat (``service/express.run``) of a quick lane shape: enter it and
        drive it from the calling thread in one hold of the loop's lock and one compiled
        call (``Lane.now``: ``lane_core.lane_once``, the async form's entry too), as a
        waiter's first try does (``Driver.try_op``), with nothing made for it in Python but
        its record among the ended ops.  True when it ended well in that try (recorded as
        done; its generation never was in flight); None when it was not entered (whatever
        :meth:`express` or ``Driver.try_op`` would stay away from: the caller goes their
        way); else the handle of ``make(svc, record, name, gen, inbuf, outbuf, result,
        priority, True)``, whose op is the lane op entered and not ended (its peers are
        late, or the lane has events or ops for Python), which the caller waits for."""
        loop = self._loop
        lane = loop.lane
        peers = loop.peers
        driving = loop.driving
        if (
            lane is None
            or loop.submissions
            or peers.bad
            or self.held
            or loop.control.waiting
            or lane.mem[L.C_FULL]
            or shape.epoch != lane.plans_epoch  # its plan moved: express makes it anew
            or not driving.express_lock(lane)
        ):
            return None
        driving.owner = _get_ident()
        try:
            errors = loop.failures.errors
            stalls = loop.stalls
            if (
                loop.fatal is not None
                or peers.bad
                or loop.submissions
                or time.monotonic() - stalls.last > stalls.every
                or (
                    (errors.early or lane.by_key)
                    and ((key := (wid, gen)) in lane.by_key or errors.is_early(key))
                )
            ):
                return None
            trace = loop.trace
            t0 = time.perf_counter_ns() if trace is not None else 0
            try:
                r = lane.now(shape, inbuf, outbuf, gen, priority, driving.wait_spin_ns)
            except Exception as exc:
                loop.stopped_by(exc)
                return None
            if r < 0:
                return None
            stats = loop.stats
            stats.lane_express += 1
            if trace is not None:  # a sink on the route: the usual route's events
                trace.op(name, gen, "submitted", priority, t0)
            if r == 2:  # it ended well, the one op done: taken out of the table
                # its end: three words in a ring, nothing made (the record keeps its row)
                loop.failures.done(wid, gen, self.ended_row(record, name, group))
                stats.ops_completed += 1
                if trace is not None:  # and the caller's wait: it drove the op to its end
                    t1 = time.perf_counter_ns()
                    trace.op(name, gen, "done", priority, t1)
                    trace.wait(name, gen, t0, t1)
                return True
            handle, spec = make(svc, record, name, gen, inbuf, outbuf, result, priority, True)
            handle._lop = lane.adopt(spec)
            try:
                self.settle()
            except Exception as exc:
                loop.stopped_by(exc)
            return handle
        finally:
            driving.owner = 0
            loop.lock.release()

    # ------------------------------------------------------------------ finishing

    def pump(self) -> bool:
        """One compiled pass of the lane, then its events and ended ops (the lock held)."""
        lane = self._loop.lane
        assert lane is not None
        if lane.full:
            lane.grow()
        moved = lane.pump() > 0
        if lane.mem[L.C_NEV] or lane.mem[L.C_NDONE]:
            self.drain()
            moved = True
        return moved

    def drain(self) -> None:
        """Turn the lane's events into errors and finish the ops it completed."""
        loop = self._loop
        lane = loop.lane
        assert lane is not None
        mem = lane.mem
        if mem[L.C_NEV]:
            on_event = loop.lane_errors.on_event
            for ev in lane.take_events():
                on_event(*ev)
        control = loop.control
        if control.dirty:  # what the control frames' handlers answered
            control.flush()
        if not mem[L.C_NDONE]:
            return
        for lop, ok in lane.take_done():
            spec = lop.spec
            if ok:
                self.ok(lop)
            else:
                failures = loop.failures
                error = lop.error or OpFailedError(f"{spec.describe()}: failed on rank {loop.rank}")
                failures.errors.note_failed(spec.key, str(error))
                loop.stats.ops_failed += 1
                if loop.trace is not None:
                    loop.trace.op(spec.name, spec.generation, "failed", spec.priority)
                finish(spec, error)
                for later in self.held.pop(spec.key, ()):
                    failures.fail_unsubmitted(later, failures.chain_error(later, str(error)))

    def ended_row(self, record: Any, name: str | int, group: tuple[int, ...]) -> int:
        """The row in the ring of ended ops (``engine/ended.py``) of a repeat of express
        record ``record``: kept in the record, made anew when the ring's rows moved (with
        the schedule's hints: a late frame says what the pattern was)."""
        ended = self._loop.failures.completed
        if record.ended_epoch != ended.epoch:
            record.ended_row = ended.row(name, group, record.sched.unexpected)
            record.ended_epoch = ended.epoch
        return record.ended_row  # type: ignore[no-any-return]

    def ok(self, lop: LaneOp) -> None:
        """Finish ``lop``, which the lane completed and which left its table."""
        loop = self._loop
        spec = lop.spec
        # (name, generation), not its text: made only if an error about it comes later
        ex = spec._ex  # a repeat's record keeps its row
        row = (
            self._loop.failures.completed.row(spec.name, spec.group, spec.schedule.unexpected)
            if ex is None
            else self.ended_row(ex, spec.name, spec.group)
        )
        loop.failures.done(spec.wire_id, spec.generation, row)
        loop.stats.ops_completed += 1
        if loop.trace is not None:
            loop.trace.op(spec.name, spec.generation, "done", spec.priority)
        on_done = spec.on_done  # finish's work, written out: a call is 0.3-0.6 µs of a
        if on_done is not None:  # small op's wait (measured in one process, in turn)
            try:
                on_done(None)
            except Exception:  # a user callback must not kill the loop
                log.exception("completion callback of %s failed", spec.describe())
        held = self.held
        if held:
            for later in held.pop(lop.key, ()):
                self.activate(later)

    def settle(self) -> None:
        """After compiled passes outside a pass (a waiter's, an express entry's): grow
        what they filled, then turn their events into errors and finish the ops they
        completed."""
        lane = self._loop.lane
        assert lane is not None
        if lane.full:
            lane.grow()
        self.drain()

    # ------------------------------------------------------------------ a node's compiled repeats

    def hold_for_repeats(self, plans_epoch: int) -> bool:
        """Take the loop's lock for repeats that compiled code enters and drives itself (a
        node service's loop, ``lane/lane_service.py``) when nothing the loop's Python
        would have to see first stands in the way (what :meth:`now` looks at, for any key:
        nothing of the loop in flight, no error, no frame or op of any key in Python's
        tables), and the caller's lane fields are of the lane's ``plans_epoch``; False
        (nothing held) otherwise.  :meth:`release_repeats` gives the lock back."""
        loop = self._loop
        lane = loop.lane
        if (
            lane is None
            or loop.fatal is not None
            or loop.failures.late
            or loop.submissions
            or loop.peers.bad
            or loop.trace is not None
            or self.held
            or loop.control.waiting
            or lane.mem[L.C_FULL]
            or lane.mem[L.C_NEV]
            or lane.mem[L.C_NDONE]
            or lane.by_key
            or not loop.driving.express_lock(lane)  # (the comm thread's: it hands it over)
        ):
            return False
        loop.driving.owner = _get_ident()
        stalls = loop.stalls
        if (
            loop.fatal is not None
            or loop.peers.bad
            or loop.submissions
            or lane.by_key
            or loop.failures.errors.early
            or lane.full
            or lane.plans_epoch != plans_epoch  # plans moved since the fields were made
            or time.monotonic() - stalls.last > stalls.every
        ):
            self.release_repeats()
            return False
        return True

    def release_repeats(self) -> None:
        """Give back the lock :meth:`hold_for_repeats` took."""
        loop = self._loop
        loop.driving.owner = 0
        loop.lock.release()

    def repeats_ended(
        self, name: int, wid: int, first: int, k: int, group: tuple[int, ...]
    ) -> None:
        """``k`` repeats of ``name`` (wire id ``wid``, generations ``first``...) ended well
        in compiled code: recorded as :meth:`now` records its op (a late error about one
        names it)."""
        loop = self._loop
        ended = loop.failures.completed
        if wid != SESSION_ID:
            ended.note_span(wid, first, k, ended.row(name, group, _NONE))
        loop.stats.ops_completed += k
        loop.stats.lane_express += k

    def repeat_adopted(self, spec: OpSpec, slot: int, seq: int) -> LaneOp:
        """The lane op of a repeat compiled code entered in slot ``slot`` (submission
        ``seq``) and did not end: in flight from now, as any."""
        loop = self._loop
        lane = loop.lane
        assert lane is not None
        loop.stats.lane_express += 1
        return lane.adopt(spec, slot, seq)

    def repeats_settle(self) -> None:
        """After compiled repeats' passes: what they filled grown, their events and ended
        ops handled (the lock held)."""
        loop = self._loop
        lane = loop.lane
        if lane is not None and (lane.full or lane.mem[L.C_NEV] or lane.mem[L.C_NDONE]):
            try:
                self.settle()
            except Exception as exc:
                loop.stopped_by(exc)

    @property
    def spin_ns(self) -> int:
        """How long a waiter spins in compiled passes before it sleeps, in ns."""
        return self._loop.driving.wait_spin_ns

"""The loop's side of the compiled lane: handing ops over, driving, waiting.

:class:`LaneHooks` is a base of :class:`~.loop.CommLoop`.  It enters every op into the
lane (``Lane.plan_of``; one it cannot run fails on every rank of its group with the
reason, ``Lane.why_not``), or, repeated, straight from the submitting thread
(``lane_express``), drives the lane in every pass, on the comm thread and in ``wait()``,
and finishes the ops the lane completed.  The lane's events turned into errors, and lane
ops taken through everything that fails ops (errors from peers, peers gone, aborts,
stalls, shutdown), are its sibling base :class:`~.lane_failing.LaneFailHooks`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .. import protocol as L
from ..errors import OpFailedError, TotalReduceError
from ..lane.payload import OpKey, OpSpec
from .completion import Waitable
from .failures import _error_from_peer

if TYPE_CHECKING:
    import numpy as np

    from ..lane.lane import Lane, LaneOp, LaneShape
    from .stalls import StallInspector

log = logging.getLogger("totalreduce.engine")

#: No clears sent unasked (a lane op's record in ``completed``): a tuple, not a frozenset,
#: so that the record holds no container the garbage collector tracks and the record
#: leaves its young generation untracked instead of being promoted, once per op.
_NONE: tuple[Any, ...] = ()
#: How long an express entry waits for the comm thread to hand the loop's lock over.
EXPRESS_WAIT_S = 0.0005
_get_ident = threading.get_ident


class LaneHooks:
    """Lane handling for the loop (see the module docstring)."""

    lane: Lane | None
    rank: int
    _early_errors: OrderedDict[OpKey, tuple[str, int]]
    completed: OrderedDict[OpKey, tuple[Any, ...]]
    failed: OrderedDict[OpKey, str]
    submissions: deque[Any]
    trace: Any
    stats: Any
    lock: threading.Lock
    bad_peers: dict[int, TotalReduceError]
    waiters: int
    cfg: Any  # totalreduce.config.Config
    fatal: BaseException | None
    _owner: int
    _comm_ident: int
    _wanted: bool

    # provided by CommLoop
    _remember: Callable[[Any, OpKey, Any], None]
    _finish_spec: Callable[[OpSpec, BaseException | None], None]
    _who: Callable[[int], str]
    _named: Callable[[str, OpKey, str | int], str]
    # provided by LaneFailHooks
    _lane_fail: Callable[..., None]
    _lane_event: Callable[[int, int, int, int, int, bytes], None]
    # provided by CommLoop and its other bases
    _held: dict[OpKey, list[OpSpec]]
    _left: set[int]
    _ctl_backlog: list[tuple[Any, ...]]
    _ctl_dirty: bool
    _ctl_flush: Callable[[], None]
    _asleep: bool
    stalls: StallInspector
    _wait_spin_ns: int
    _activate: Callable[[OpSpec], None]
    _fail_all: Callable[[BaseException], None]
    _fail_unsubmitted: Callable[[OpSpec, TotalReduceError], None]
    _chain_error: Callable[[OpSpec, str], OpFailedError]
    _nudge: Callable[[], None]
    _sleep: Callable[..., None]
    run_once: Callable[[], bool]

    # ------------------------------------------------------------------ routing

    def _lane_activate(self, spec: OpSpec) -> None:
        """Enter ``spec`` into the lane; one it cannot run fails here and on its group."""
        lane = self.lane
        assert lane is not None
        key = spec.key
        why = lane.unrunnable(spec)
        if why is not None:  # no engine runs it: it fails here and on its group
            lane.drop_floating(key)
            self._lane_refuse(spec, OpFailedError(f"{spec.describe()} on rank {self.rank}: {why}"))
            return
        plan = lane.plan_of(spec)
        if plan < 0:  # the same on every rank of the op: each refuses it, and tells the rest
            lane.drop_floating(key)
            self._lane_refuse(
                spec,
                OpFailedError(
                    f"{spec.describe()} on rank {self.rank}: it cannot run: {lane.why_not(spec)}"
                ),
            )
            return
        err = self._early_errors.pop(key, None)
        if err is not None:
            lane.drop_floating(key)
            error = _error_from_peer(self._named(err[0], key, spec.name), err[1])
            self._lane_refuse(spec, error)
            return
        if key in lane.by_key:
            self._finish_spec(
                spec, OpFailedError(f"{spec.describe()} submitted twice on rank {self.rank}")
            )
            return
        lop = lane.submit(spec, plan, spec.schedule.work_count)
        if lop is None:
            self._lane_refuse(
                spec,
                OpFailedError(
                    f"{spec.describe()}: rank {self.rank} has {lane.inflight} ops in flight, "
                    "the most the compiled lane holds; wait for some before submitting more"
                ),
            )
            return
        if self.trace is not None:
            self.trace.op(spec.name, spec.generation, "submitted", spec.priority)
        left = self._left
        # What peers that left sent before leaving is placed above.
        for peer in sorted(left.intersection(spec.group)) if left else ():
            if lane.state(lop) == L.S_ACTIVE and lane.needs(lop, peer):
                self._lane_fail(
                    lop,
                    OpFailedError(
                        f"rank {self.rank}: {spec.describe()}: {self._who(peer)} stopped (its "
                        "service shut down: the program ended or failed) before it completed"
                    ),
                    tell_peers=True,
                )
        self._lane_drain()

    def lane_express(self, spec: OpSpec, holder: Any) -> LaneOp | None:
        """Enter a repeat of an op the lane runs (an allreduce, a reduce-scatter or a
        broadcast: service/express.py) into the lane from the submitting thread,
        past the submission queue and the main loop's activation (its lane op, which a
        waiter may wait on straight away: ``LaneHooks._lane_try``); None when anything
        those would look at stands in the way (the caller then submits it the usual way,
        which sorts it out).  ``holder.lane_shape`` keeps the lane's fields of the shape
        between calls (made here, under the lock, the first time).  A timeline is a sink on
        this route: the op's events are recorded here as the usual route records them."""
        lane = self.lane
        if (
            lane is None
            or holder.lane_shape is False
            or self.submissions  # ops queued before this one enter first
            or self.bad_peers
            or self._held
            or lane.mem[L.C_FULL]
            or not self._express_lock(lane)
        ):
            return None
        self._owner = _get_ident()
        try:
            early = self._early_errors
            if (
                self.fatal is not None
                or self.bad_peers  # again, under the lock: a peer may have left meanwhile
                or (  # the key met before (most often nothing is there to look in)
                    (early or lane.by_key) and ((key := spec.key) in early or key in lane.by_key)
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
                self.stats.lane_express += 1
                if self.trace is not None:  # a sink on the route, the usual route's events
                    self.trace.op(spec.name, spec.generation, "submitted", spec.priority)
            except Exception:  # the usual path fails the op properly, naming the cause
                log.exception("rank %d: the lane's express entry failed", self.rank)
                return None
            if lane.pending:  # it ended at once (its peers' frames came first), or events wait
                try:
                    self._lane_drain()
                except Exception as exc:
                    self._stopped_by(exc)
        finally:
            self._owner = 0
            self.lock.release()
        if self._asleep:
            self._nudge()
        return lop

    def lane_now(
        self, shape: LaneShape, name: str | int, wid: int, gen: int, group: tuple[int, ...],
        priority: int, inbuf: np.ndarray, outbuf: np.ndarray, make: Callable[..., Any],
        record: Any, svc: Any, result: Any,
    ) -> Any:  # fmt: skip
        """A blocking repeat (``service/express.run``) of a quick lane shape: enter it and
        drive it from the calling thread in one hold of the loop's lock and one compiled
        call (``Lane.now``: ``lane_core.lane_once``, the async form's entry too), as a
        waiter's first try does (``_lane_try``), with nothing made for it in Python but its
        record among the ended ops.  True when it ended well in that try (recorded as
        done; its generation never was in flight); None when it was not entered (whatever
        ``lane_express`` or ``_lane_try`` would stay away from: the caller goes their
        way); else the handle of ``make(svc, record, name, gen, inbuf, outbuf, result,
        priority, True)``, whose op is the lane op entered and not ended (its peers are
        late, or the lane has events or ops for Python), which the caller waits for."""
        lane = self.lane
        if (
            lane is None
            or self.submissions
            or self.bad_peers
            or self._held
            or self._ctl_backlog
            or lane.mem[L.C_FULL]
            or shape.epoch != lane.plans_epoch  # its plan moved: lane_express makes it anew
            or not self._express_lock(lane)
        ):
            return None
        self._owner = _get_ident()
        try:
            early = self._early_errors
            if (
                self.fatal is not None
                or self.bad_peers
                or self.submissions
                or time.monotonic() - self.stalls.last > self.stalls.every
                or ((early or lane.by_key) and ((key := (wid, gen)) in early or key in lane.by_key))
            ):
                return None
            trace = self.trace
            t0 = time.perf_counter_ns() if trace is not None else 0
            try:
                r = lane.now(shape, inbuf, outbuf, gen, priority, self._wait_spin_ns)
            except Exception as exc:
                self._stopped_by(exc)
                return None
            if r < 0:
                return None
            self.stats.lane_express += 1
            if trace is not None:  # a sink on the route: the usual route's events
                trace.op(name, gen, "submitted", priority, t0)
            if r == 2:  # it ended well, the one op done: taken out of the table
                self._remember(self.completed, (wid, gen), ((name, gen), group, (), _NONE))
                self.stats.ops_completed += 1
                if trace is not None:  # and the caller's wait: it drove the op to its end
                    t1 = time.perf_counter_ns()
                    trace.op(name, gen, "done", priority, t1)
                    trace.wait(name, gen, t0, t1)
                return True
            handle, spec = make(svc, record, name, gen, inbuf, outbuf, result, priority, True)
            handle._lop = lane.adopt(spec)
            try:
                self._lane_settle()
            except Exception as exc:
                self._stopped_by(exc)
            return handle
        finally:
            self._owner = 0
            self.lock.release()

    def _express_lock(self, lane: Lane) -> bool:
        """Take the loop's lock for an express entry.  Held by the comm thread (its compiled
        passes, or a pass): ask for it (``_wanted``, and a kick that brings the compiled
        passes back) and wait up to ``EXPRESS_WAIT_S``, since queueing the op instead
        would send it, and every op submitted after it until the queue drains, the whole
        way.  Held by another thread (a waiter's passes) or by this one (a callback that
        runs inside a pass submits): False at once.  Held by the comm thread while bodies
        are in flight: False at once too, as its pass may be reducing or copying a
        segment of up to ``segment_bytes`` first (hundreds of µs, measured in
        ``bench --step``), and the submitting thread (a training loop's backward) would
        wait for it; such an op is queued, and the comm thread's next pass takes it."""
        if self.lock.acquire(blocking=False):
            return True
        owner = self._owner
        if owner != self._comm_ident or not owner or owner == threading.get_ident():
            return False  # a waiter's passes, or this thread's own (a completion callback)
        if lane.mem[L.C_NBREQ]:
            return False
        self._wanted = True
        lane.kick()
        try:
            return self.lock.acquire(timeout=EXPRESS_WAIT_S)
        finally:
            self._wanted = False

    def _stopped_by(self, exc: Exception) -> None:
        """The loop met an error of its own (a bug, not an op's): fail every op, once, so
        nothing waits forever on a loop that stopped (what ``CommLoop._pass`` does)."""
        if getattr(self, "fatal", None) is None:
            log.exception("rank %d: comm loop stopped by an error", self.rank)
            self.fatal = exc
            self._fail_all(TotalReduceError(f"rank {self.rank}: the comm loop failed: {exc}"))

    def _lane_refuse(self, spec: OpSpec, error: TotalReduceError) -> None:
        """Fail an op the lane never entered, telling its group."""
        self._fail_unsubmitted(spec, error)
        if self.lane is not None:
            self.lane.remember_failed(spec.key)

    # ------------------------------------------------------------------ driving

    def _lane_pump(self) -> bool:
        lane = self.lane
        assert lane is not None
        if lane.full:
            lane.grow()
        moved = lane.pump() > 0
        if lane.mem[L.C_NEV] or lane.mem[L.C_NDONE]:
            self._lane_drain()
            moved = True
        return moved

    def _lane_drain(self) -> None:
        """Turn the lane's events into errors and finish the ops it completed."""
        lane = self.lane
        assert lane is not None
        mem = lane.mem
        if mem[L.C_NEV]:
            for ev in lane.take_events():
                self._lane_event(*ev)
        if self._ctl_dirty:  # what the control frames' handlers answered
            self._ctl_flush()
        if not mem[L.C_NDONE]:
            return
        for lop, ok in lane.take_done():
            spec = lop.spec
            if ok:
                self._lane_ok(lop)
            else:
                error = lop.error or OpFailedError(f"{spec.describe()}: failed on rank {self.rank}")
                self._remember(self.failed, spec.key, str(error))
                self.stats.ops_failed += 1
                if self.trace is not None:
                    self.trace.op(spec.name, spec.generation, "failed", spec.priority)
                self._finish_spec(spec, error)
                for later in self._held.pop(spec.key, ()):
                    self._fail_unsubmitted(later, self._chain_error(later, str(error)))

    def _lane_ok(self, lop: LaneOp) -> None:
        """Finish ``lop``, which the lane completed and which left its table."""
        spec = lop.spec
        # (name, generation), not its text: made only if an error about it comes later
        self._remember(  # with the schedule's hints: a late frame says what the pattern was
            self.completed,
            lop.key,
            ((spec.name, spec.generation), spec.group, spec.schedule.unexpected, _NONE),
        )
        self.stats.ops_completed += 1
        if self.trace is not None:
            self.trace.op(spec.name, spec.generation, "done", spec.priority)
        on_done = spec.on_done  # _finish_spec's work, written out: a call is 0.3-0.6 µs of a
        if on_done is not None:  # small op's wait (measured in one process, in turn)
            try:
                on_done(None)
            except Exception:  # a user callback must not kill the loop
                log.exception("completion callback of %s failed", spec.describe())
        held = self._held
        if held:
            for later in held.pop(lop.key, ()):
                self._activate(later)

    # ------------------------------------------------------------------ waiting

    def _lane_settle(self) -> None:
        """After a waiter's compiled passes: grow what they filled, then turn their events
        into errors and finish the ops they completed."""
        lane = self.lane
        assert lane is not None
        if lane.full:
            lane.grow()
        self._lane_drain()

    def _lane_try(self, lop: LaneOp, done: Waitable, span: float, outer: bool = False) -> bool:
        """``wait()``'s first try on a lane op: compiled passes for up to ``span`` s, then
        its completion, without the waiter's bookkeeping (most small ops end within
        it); False when it did not end, or the lock or the main loop's work stood in
        the way (the caller then waits the whole way).  ``outer``: until the lane's outer
        words moved, too (``Lane.watch_outer``; ``lane.outer_moved`` says so)."""
        if not self.lock.acquire(blocking=False):
            return False
        self._owner = _get_ident()
        try:
            # _main_has_work: wait_own's compiled call returns for the lane's events
            if (
                self.submissions
                or self._ctl_backlog
                or time.monotonic() - self.stalls.last > self.stalls.every
            ):
                return False
            lane = self.lane
            assert lane is not None
            if lane.wait_own(lop, int(span * 1e9), self._wait_spin_ns, outer):
                self._lane_ok(lop)  # its op alone ended, well: no drain of the whole lane
            else:
                self._lane_settle()
        except Exception as exc:
            self._stopped_by(exc)
        finally:
            self._owner = 0
            self.lock.release()
        return done.is_set()

    def _lane_progress(
        self, lop: LaneOp, done: Waitable, deadline: float | None, spin_s: float,
        outer: bool = False,
    ) -> bool | None:  # fmt: skip
        """``wait()`` on a lane op: compiled passes, the main loop's only when it has work.
        None when the op ended and ``done`` is still not set: the handle waits for an op
        chained after it (an all-gather's data after its sizes), which the caller then
        waits for the general way.  ``outer``: back (False) as soon as the lane's outer
        words moved (``Lane.watch_outer``), the op not ended."""
        lane = self.lane
        assert lane is not None
        last = time.perf_counter()
        delay = 0.0
        ended = False
        while not done.is_set():
            if ended:
                return None
            now = time.perf_counter()
            if deadline is not None and now >= deadline:
                return done.is_set()
            quiet = now - last >= spin_s
            if self.lock.acquire(blocking=False):
                self._owner = threading.get_ident()
                try:
                    if self._main_has_work():
                        if self.run_once():
                            last = now
                    if done.is_set():
                        break
                    # Compiled passes for up to 200 us while the op moves; one pass once
                    # it has been quiet for spin_s (then the thread sleeps between passes).
                    span = 0.0 if quiet else 2e-4
                    if deadline is not None:
                        span = min(span, max(0.0, deadline - now))
                    moves = lane.mem[L.C_PROGRESS]
                    ended = lane.wait(lop, span, spin_s, outer)
                    if outer and lane.outer_moved:
                        self._lane_settle()
                        return done.is_set()
                    if ended or lane.mem[L.C_PROGRESS] != moves:
                        last = time.perf_counter()
                        delay = 0.0
                    self._lane_settle()
                except Exception as exc:
                    self._stopped_by(exc)
                finally:
                    self._owner = 0
                    self.lock.release()
                if ended or time.perf_counter() - last < spin_s or done.is_set():
                    continue
            elif not quiet:
                time.sleep(0)
                continue
            # A long silence (a peer that is late): sleep between passes, as the main
            # loop's waiter does, so a waiting rank does not hold a core meanwhile.
            delay = min(max(2 * delay, 2e-5), self.cfg.backoff_max_s)
            if deadline is not None:
                delay = min(delay, max(0.0, deadline - time.perf_counter()))
            self._sleep(delay, done)
        return True

    def _lane_spin(self, span: float) -> bool:
        """The comm thread's spin while only lane ops are in flight: compiled passes for
        up to ``span`` s (after an op ends, ``spin_s`` again) that hold the loop's lock but
        not the interpreter's, so the training loop's Python runs meanwhile; ``span`` 0 is
        one pass.  False when the main loop has work or nothing moved."""
        lane = self.lane
        assert lane is not None
        if not self.lock.acquire(blocking=False):
            return False
        self._owner = threading.get_ident()
        mem = lane.mem
        moved = False
        try:
            while True:
                mem[L.C_KICK] = 0  # before the checks: a kick after them is seen
                if self.waiters or self._wanted or self._main_has_work():
                    return moved
                if not (lane.inflight or lane.sends_busy):
                    return moved
                self.stats.lane_spins += 1
                if not lane.drive(span, span):
                    return moved
                if lane.full:
                    lane.grow()
                    mem = lane.mem  # grown: a larger copy
                moved = True
                if mem[L.C_NEV] or mem[L.C_CTL_WAITING] or mem[L.C_KICK] or mem[L.C_FULL]:
                    self._lane_drain()
                    return True
                self._lane_drain()  # ops ended: their completions, then drive on
                span = self.cfg.spin_s
        except Exception as exc:
            self._stopped_by(exc)
            return False
        finally:
            self._owner = 0
            self.lock.release()

    def _main_has_work(self) -> bool:
        return bool(
            self.submissions
            or self._ctl_backlog
            or time.monotonic() - self.stalls.last > self.stalls.every
        )

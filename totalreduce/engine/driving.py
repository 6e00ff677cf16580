"""Driving the loop: the comm thread's run, one pass under the lock, and waiting.

:class:`DriveHooks` is a base of :class:`~.loop.CommLoop`.  The comm thread runs
:meth:`~DriveHooks.run` while nobody waits: the lane's compiled passes without the
interpreter lock while ops are in flight, a Python pass (submissions, the lane's events,
the stall inspector) otherwise, backing off when idle.  A thread blocked in ``wait()``
drives progress itself (:meth:`~DriveHooks.progress`, as ``MPI_Wait`` progresses MPI):
its op crosses no thread hand-off, and the comm thread steps aside while it waits
(:class:`_Waiting`).  Asleep,
a thread sleeps in the transport when the transport can wake it (shared memory), else
on the op's completion word.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..errors import TotalReduceError
from ..lane.payload import OpSpec
from .completion import Waitable

if TYPE_CHECKING:
    from ..lane.lane import Lane

log = logging.getLogger("totalreduce.engine")

# Let other threads run without sleeping: time.sleep(0) is a zero-length nanosleep,
# which the kernel's timer slack (50 µs by default) turns into a real sleep; measured
# 90 µs against 0.6 µs for sched_yield on the 2-core machine.
_yield: Callable[[], None] = getattr(os, "sched_yield", lambda: time.sleep(0))

#: Longest idle sleep of a comm thread with standing receives (a window's) in its table:
#: a message to it waits at most about this long, even where the idle backoff is longer
#: (a daemon's services).
STANDING_BACKOFF_S = 0.05


def set_timer_slack(ns: int = 1000) -> None:
    """Sleep precisely on this thread (Linux's default timer slack is 50 µs)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(29, ns, 0, 0, 0)  # PR_SET_TIMERSLACK
        except (OSError, AttributeError) as exc:  # not fatal: sleeps are just coarser
            log.debug("could not set the timer slack: %s", exc)


class DriveHooks:
    """The loop's drivers (see the module docstring)."""

    cfg: Any  # totalreduce.config.Config
    lane: Lane | None
    lock: threading.Lock
    wake: threading.Event
    waiters: int
    submissions: deque[Any]
    stats: Any  # LoopStats
    _owner: int
    _comm_ident: int
    _wanted: bool
    _asleep: bool
    _sleep_s: float
    _nudged: bool
    _wait_spin: float
    _wait_spin_ns: int
    run_once: Callable[[], bool]
    mark_needed: Callable[[OpSpec], None]
    _stopped_by: Callable[[Exception], None]
    _lane_spin: Callable[[float], bool]
    _lane_try: Callable[..., bool]  # (lop, done, span, outer=False)
    _lane_progress: Callable[..., bool | None]  # (lop, done, deadline, spin_s, outer=False)
    _ring: Callable[[], None]

    if TYPE_CHECKING:  # CommLoop's property: ops in flight or work queued

        @property
        def busy(self) -> bool: ...

    def _sleep(self, delay: float, done: Waitable) -> None:
        """Sleep up to ``delay`` unless ``done`` is set."""
        done.wait(delay)

    # ------------------------------------------------------------------ driving the loop

    def run(self, stop: threading.Event) -> None:
        """The comm thread: progress until ``stop`` is set; back off when idle."""
        set_timer_slack()
        self._comm_ident = threading.get_ident()
        cfg = self.cfg
        delay = cfg.backoff_min_s
        last = time.perf_counter()
        while not stop.is_set():
            if self._wanted:  # a submitting thread waits for the lock: let it have it
                _yield()
                continue
            if self.waiters:
                # A waiting thread drives the loop; stay out of its way.
                self.wake.wait(cfg.backoff_max_s)
                self.wake.clear()
                continue
            # Ops in flight: compiled passes without the interpreter lock, until something
            # needs Python; a Python pass below otherwise.
            # Spinning only within spin_s of the last progress (else one pass, no spin): a
            # peer that submits late must not cost a core while its op waits here.
            lane = self.lane
            if (
                lane is not None
                and lane.inflight
                and not self.submissions
                and self._lane_spin(max(cfg.spin_s - (time.perf_counter() - last), 0.0))
            ):
                delay = cfg.backoff_min_s
                last = time.perf_counter()
                continue
            if self._wanted:  # the spin returned for a submitter: no pass before it enters
                continue
            if self._pass():
                delay = cfg.backoff_min_s
                last = time.perf_counter()
                continue
            if self.busy and time.perf_counter() - last < cfg.spin_s:
                _yield()  # frames likely microseconds away: yield, no sleep
                continue
            self.stats.idle_sleeps += 1
            self._asleep = True
            if lane is not None and lane.inflight:
                # An op entered the lane since the look above (_nudge saw no sleep): it
                # may have nobody else to drive it
                delay = min(delay, cfg.backoff_max_s)
            self._sleep_s = delay
            if not self.submissions:  # one queued since the last pass: no sleep
                self._sleep(delay, self.wake)
            self._asleep = False
            self.wake.clear()
            if self._nudged:
                # An op entered the lane in a long sleep: drive it within a busy loop's
                # sleep, not at once (its submitter may be entering more: the lock stays
                # theirs meanwhile, as it did while this thread slept)
                self._nudged = False
                self._sleep_s = delay = cfg.backoff_max_s
                self._asleep = True
                self._sleep(delay, self.wake)
                self._asleep = False
                self.wake.clear()
                continue
            ceiling = cfg.backoff_max_s if self.busy else cfg.idle_backoff_max_s
            if lane is not None and lane.passive:
                ceiling = min(ceiling, STANDING_BACKOFF_S)
            delay = min(delay * 2, ceiling)

    def _nudge(self) -> None:
        """An op entered the lane from a submitting thread: wake the comm thread if it is in
        a sleep longer than a busy loop's (an idle one's, up to ``idle_backoff_max_s``).
        Nobody may wait for the op (a completion callback, a torch future): the comm thread
        is then what drives it, and it would sleep on.  Shorter sleeps end soon enough, and
        waking for each op of a tight loop would cost the loop a futex call per op.  The
        thread woken so sleeps ``backoff_max_s`` more before it drives (see :meth:`run`)."""
        if self._asleep and self._sleep_s > self.cfg.backoff_max_s:
            self._nudged = True
            self._ring()

    def _pass(self) -> bool:
        """One pass under the lock (False if another thread is running one)."""
        if not self.lock.acquire(blocking=False):
            return False
        self._owner = threading.get_ident()
        try:
            return self.run_once()
        except Exception as exc:  # never die silently: fail every op
            self._stopped_by(exc)
            return False
        finally:
            self._owner = 0
            self.lock.release()

    def poll(self) -> None:
        """Run one pass if no other thread is running one (``done()``, like ``MPI_Test``)."""
        if self._owner != threading.get_ident():
            self._pass()

    def progress(
        self,
        done: Waitable,
        timeout: float | None,
        spec: OpSpec | None,
        follow: Callable[[], OpSpec | None] | None = None,
        tried: bool = False,
        outer: bool = False,
    ) -> bool:
        """Drive the loop from a waiting thread until ``done`` is set; False on timeout.
        ``follow`` gives the op the waiter's handle stands for now, when that changes
        (an all-gather's data op after its sizes): a lane op is then waited for in
        compiled passes too.  ``tried``: the caller has just made the first try on the op
        (``_lane_try``; ``Handle.wait`` on the express path), which is not made again.
        ``outer``: a lane op's compiled passes also end (False, before ``timeout``) as
        soon as the lane's outer words move (``Lane.watch_outer``: a node service's
        arena thread, back at its clients' rings when one writes there)."""
        if self._owner == threading.get_ident():
            raise TotalReduceError(
                "wait() inside a completion callback would block the loop that completes it; "
                "use add_done_callback or wait outside the callback"
            )
        cfg = self.cfg
        start = time.perf_counter()
        deadline = None if timeout is None else start + timeout
        last = start
        delay = 0.0
        lane = self.lane
        if spec is not None:
            lop = None if lane is None else lane.by_key.get((spec.wire_id, spec.generation))
            if lane is not None and lop is not None and lop.spec is spec:  # the waiter's
                lane.outer_moved = False  # compiled passes mark it
                if not tried and self._lane_try(
                    lop, done, 2e-4 if timeout is None else min(2e-4, timeout), outer
                ):
                    return True
                if outer and lane.outer_moved:
                    return done.is_set()
                with _Waiting(self):
                    ended = self._lane_progress(lop, done, deadline, self._wait_spin, outer)
                if ended is not None:
                    return ended
                # Its op ended, the handle waits for one chained after it: the general way.
            else:
                self.mark_needed(spec)
        with _Waiting(self):
            while not done.is_set():
                if follow is not None:
                    spec = follow() or spec
                if lane is not None and spec is not None:
                    lop = lane.by_key.get((spec.wire_id, spec.generation))
                    if lop is not None and lop.spec is spec:
                        ended = self._lane_progress(lop, done, deadline, self._wait_spin, outer)
                        if ended is not None:
                            return ended
                        continue
                now = time.perf_counter()
                if deadline is not None and now >= deadline:
                    return done.is_set()
                if self._pass():
                    last = now
                    delay = 0.0
                    continue
                if now - last < self._wait_spin:
                    # Frames are likely on their way: spin (as MPI_Wait does), letting
                    # other threads run; only a long silence turns into sleeping.
                    _yield()
                    continue
                delay = min(max(2 * delay, 2e-5), cfg.backoff_max_s)
                if deadline is not None:
                    delay = min(delay, max(0.0, deadline - now))
                self._sleep(delay, done)
        return True


class _Waiting:
    """Counts a thread waiting in :meth:`CommLoop.progress` (the comm thread steps aside)."""

    _lock = threading.Lock()

    def __init__(self, loop: Any) -> None:
        self.loop = loop

    def __enter__(self) -> None:
        with self._lock:
            self.loop.waiters += 1
        if self.loop.lane is not None:  # the comm thread may be in compiled passes
            self.loop.lane.kick()

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self.loop.waiters -= 1
        if self.loop.submissions:
            # Ops nobody waits for (and notes this waiter left) go on at once, on the
            # comm thread, not after its idle sleep.
            self.loop.wake.set()

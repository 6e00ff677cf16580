"""Driving the loop: the comm thread's run, one pass under the lock, and waiting.

:class:`Driver` is an object of :class:`~.loop.CommLoop`'s (``loop.driving``) that owns
who drives the loop: which thread holds the loop's lock for a pass (``owner``), the comm
thread's sleep, the waiting threads.  The comm thread runs :meth:`~Driver.run` while
nobody waits: the lane's compiled passes without the interpreter lock while ops are in
flight (:meth:`~Driver.spin`), a Python pass (``CommLoop.run_once``: submissions, the
lane's events, the stall inspector) otherwise, backing off when idle.  A thread blocked
in ``wait()`` drives progress itself (:meth:`~Driver.progress`, as ``MPI_Wait`` progresses
MPI): its op crosses no thread hand-off (:meth:`~Driver.try_op` first, then compiled
passes on its op), and the comm thread steps aside while it waits (:class:`_Waiting`).
A thread that enters a repeat (``loop.ops.express``) asks the comm thread for the lock
(:meth:`~Driver.express_lock`).  Asleep, a thread sleeps on the op's completion word.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from .. import protocol as L
from ..errors import TotalReduceError
from ..lane.payload import OpSpec
from .completion import Waitable
from .parts import Loop

if TYPE_CHECKING:
    from ..lane.lane import Lane, LaneOp

log = logging.getLogger("totalreduce.engine")

# Let other threads run without sleeping: time.sleep(0) is a zero-length nanosleep,
# which the kernel's timer slack (50 µs by default) turns into a real sleep; measured
# 90 µs against 0.6 µs for sched_yield on the 2-core machine.
_yield: Callable[[], None] = getattr(os, "sched_yield", lambda: time.sleep(0))

#: Longest idle sleep of a comm thread with standing receives (a window's) in its table:
#: a message to it waits at most about this long, even where the idle backoff is longer
#: (a daemon's services).
STANDING_BACKOFF_S = 0.05
#: How long an express entry waits for the comm thread to hand the loop's lock over.
EXPRESS_WAIT_S = 0.0005
_get_ident = threading.get_ident


def set_timer_slack(ns: int = 1000) -> None:
    """Sleep precisely on this thread (Linux's default timer slack is 50 µs)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(29, ns, 0, 0, 0)  # PR_SET_TIMERSLACK
        except (OSError, AttributeError) as exc:  # not fatal: sleeps are just coarser
            log.debug("could not set the timer slack: %s", exc)


class Driver:
    """Who drives the loop, and how (see the module docstring)."""

    def __init__(self, loop: Loop) -> None:
        self._loop = loop
        #: The loop's lock (``loop.lock``): one thread runs the loop at a time.
        self.lock = loop.lock
        #: Threads waiting in :meth:`progress` (the comm thread steps aside meanwhile).
        self.waiters = 0
        #: Ident of the thread running a pass (set by whoever holds the lock; 0: none).
        self.owner = 0
        #: The comm thread's ident (set when it starts running).
        self.comm_ident = 0
        #: A thread that submits a repeat (``loop.ops.express``) while the comm thread holds
        #: the lock asks for it: the comm thread hands the lock over at its next check.
        self.wanted = False
        #: The comm thread is (about to be) blocked on ``loop.wake``, for up to ``sleep_s``.
        self.asleep = False
        self.sleep_s = 0.0
        #: Woken by :meth:`nudge` (an op entered the lane in a long sleep).
        self.nudged = False
        #: A waiter spins (``MPI_Wait``-like) this long before it sleeps (s, and ns).
        self.wait_spin = loop.cfg.wait_spin_s
        self.wait_spin_ns = int(self.wait_spin * 1e9)

    @staticmethod
    def sleep(delay: float, done: Waitable) -> None:
        """Sleep up to ``delay`` unless ``done`` is set (a completion word's ``sleep``; a
        ``threading.Event``'s ``wait``)."""
        sleep = getattr(done, "sleep", None)
        (done.wait if sleep is None else sleep)(delay)

    # ------------------------------------------------------------------ driving the loop

    def run(self, stop: threading.Event) -> None:
        """The comm thread: progress until ``stop`` is set; back off when idle."""
        set_timer_slack()
        self.comm_ident = threading.get_ident()
        loop = self._loop
        cfg = loop.cfg
        wake = loop.wake
        submissions = loop.submissions
        delay = cfg.backoff_min_s
        last = time.perf_counter()
        while not stop.is_set():
            if self.wanted:  # a submitting thread waits for the lock: let it have it
                _yield()
                continue
            if self.waiters:
                # A waiting thread drives the loop; stay out of its way.
                wake.wait(cfg.backoff_max_s)
                wake.clear()
                continue
            # Ops in flight: compiled passes without the interpreter lock, until something
            # needs Python; a Python pass below otherwise.
            # Spinning only within spin_s of the last progress (else one pass, no spin): a
            # peer that submits late must not cost a core while its op waits here.
            lane = loop.lane
            if (
                lane is not None
                and lane.inflight
                and not submissions
                and self.spin(max(cfg.spin_s - (time.perf_counter() - last), 0.0))
            ):
                delay = cfg.backoff_min_s
                last = time.perf_counter()
                continue
            if self.wanted:  # the spin returned for a submitter: no pass before it enters
                continue
            if self.one_pass():
                delay = cfg.backoff_min_s
                last = time.perf_counter()
                continue
            if loop.busy and time.perf_counter() - last < cfg.spin_s:
                _yield()  # frames likely microseconds away: yield, no sleep
                continue
            loop.stats.idle_sleeps += 1
            self.asleep = True
            if lane is not None and lane.inflight:
                # An op entered the lane since the look above (nudge saw no sleep): it
                # may have nobody else to drive it
                delay = min(delay, cfg.backoff_max_s)
            self.sleep_s = delay
            if not submissions:  # one queued since the last pass: no sleep
                self.sleep(delay, wake)
            self.asleep = False
            wake.clear()
            if self.nudged:
                # An op entered the lane in a long sleep: drive it within a busy loop's
                # sleep, not at once (its submitter may be entering more: the lock stays
                # theirs meanwhile, as it did while this thread slept)
                self.nudged = False
                self.sleep_s = delay = cfg.backoff_max_s
                self.asleep = True
                self.sleep(delay, wake)
                self.asleep = False
                wake.clear()
                continue
            ceiling = cfg.backoff_max_s if loop.busy else cfg.idle_backoff_max_s
            if lane is not None and lane.passive:
                ceiling = min(ceiling, STANDING_BACKOFF_S)
            delay = min(delay * 2, ceiling)

    def nudge(self) -> None:
        """An op entered the lane from a submitting thread: wake the comm thread if it is in
        a sleep longer than a busy loop's (an idle one's, up to ``idle_backoff_max_s``).
        Nobody may wait for the op (a completion callback, a torch future): the comm thread
        is then what drives it, and it would sleep on.  Shorter sleeps end soon enough, and
        waking for each op of a tight loop would cost the loop a futex call per op.  The
        thread woken so sleeps ``backoff_max_s`` more before it drives (see :meth:`run`)."""
        if self.asleep and self.sleep_s > self._loop.cfg.backoff_max_s:
            self.nudged = True
            self._loop.ring()

    def one_pass(self) -> bool:
        """One pass under the lock (False if another thread is running one)."""
        if not self.lock.acquire(blocking=False):
            return False
        self.owner = threading.get_ident()
        try:
            return self._loop.run_once()
        except Exception as exc:  # never die silently: fail every op
            self._loop.stopped_by(exc)
            return False
        finally:
            self.owner = 0
            self.lock.release()

    def poll(self) -> None:
        """Run one pass if no other thread is running one (``done()``, like ``MPI_Test``)."""
        if self.owner != threading.get_ident():
            self.one_pass()

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
        (:meth:`try_op`; ``Handle.wait`` on the express path), which is not made again.
        ``outer``: a lane op's compiled passes also end (False, before ``timeout``) as
        soon as the lane's outer words move (``Lane.watch_outer``: a node service's
        arena thread, back at its clients' rings when one writes there)."""
        if self.owner == threading.get_ident():
            raise TotalReduceError(
                "wait() inside a completion callback would block the loop that completes it; "
                "use add_done_callback or wait outside the callback"
            )
        loop = self._loop
        cfg = loop.cfg
        start = time.perf_counter()
        deadline = None if timeout is None else start + timeout
        last = start
        delay = 0.0
        lane = loop.lane
        if spec is not None:
            lop = None if lane is None else lane.by_key.get((spec.wire_id, spec.generation))
            if lane is not None and lop is not None and lop.spec is spec:  # the waiter's
                lane.outer_moved = False  # compiled passes mark it
                if not tried and self.try_op(
                    lop, done, 2e-4 if timeout is None else min(2e-4, timeout), outer
                ):
                    return True
                if outer and lane.outer_moved:
                    return done.is_set()
                with _Waiting(self, loop):
                    ended = self._follow(lop, done, deadline, self.wait_spin, outer)
                if ended is not None:
                    return ended
                # Its op ended, the handle waits for one chained after it: the general way.
            else:
                loop.mark_needed(spec)
        with _Waiting(self, loop):
            while not done.is_set():
                if follow is not None:
                    spec = follow() or spec
                if lane is not None and spec is not None:
                    lop = lane.by_key.get((spec.wire_id, spec.generation))
                    if lop is not None and lop.spec is spec:
                        ended = self._follow(lop, done, deadline, self.wait_spin, outer)
                        if ended is not None:
                            return ended
                        continue
                now = time.perf_counter()
                if deadline is not None and now >= deadline:
                    return done.is_set()
                if self.one_pass():
                    last = now
                    delay = 0.0
                    continue
                if now - last < self.wait_spin:
                    # Frames are likely on their way: spin (as MPI_Wait does), letting
                    # other threads run; only a long silence turns into sleeping.
                    _yield()
                    continue
                delay = min(max(2 * delay, 2e-5), cfg.backoff_max_s)
                if deadline is not None:
                    delay = min(delay, max(0.0, deadline - now))
                self.sleep(delay, done)
        return True

    def express_lock(self, lane: Lane) -> bool:
        """Take the loop's lock for an express entry.  Held by the comm thread (its compiled
        passes, or a pass): ask for it (:attr:`wanted`, and a kick that brings the compiled
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
        owner = self.owner
        if owner != self.comm_ident or not owner or owner == threading.get_ident():
            return False  # a waiter's passes, or this thread's own (a completion callback)
        if lane.mem[L.C_NBREQ]:
            return False
        self.wanted = True
        lane.kick()
        try:
            return self.lock.acquire(timeout=EXPRESS_WAIT_S)
        finally:
            self.wanted = False

    def try_op(self, lop: LaneOp, done: Waitable, span: float, outer: bool = False) -> bool:
        """``wait()``'s first try on a lane op: compiled passes for up to ``span`` s, then
        its completion, without the waiter's bookkeeping (most small ops end within
        it); False when it did not end, or the lock or the main loop's work stood in
        the way (the caller then waits the whole way).  ``outer``: until the lane's outer
        words moved, too (``Lane.watch_outer``; ``lane.outer_moved`` says so)."""
        if not self.lock.acquire(blocking=False):
            return False
        self.owner = _get_ident()
        loop = self._loop
        try:
            # main_has_work: wait_own's compiled call returns for the lane's events
            stalls = loop.stalls
            if (
                loop.submissions
                or loop.control.waiting
                or time.monotonic() - stalls.last > stalls.every
            ):
                return False
            lane = loop.lane
            assert lane is not None
            if lane.wait_own(lop, int(span * 1e9), self.wait_spin_ns, outer):
                loop.ops.ok(lop)  # its op alone ended, well: no drain of the whole lane
            else:
                loop.ops.settle()
        except Exception as exc:
            loop.stopped_by(exc)
        finally:
            self.owner = 0
            self.lock.release()
        return done.is_set()

    def _follow(
        self, lop: LaneOp, done: Waitable, deadline: float | None, spin_s: float,
        outer: bool = False,
    ) -> bool | None:  # fmt: skip
        """``wait()`` on a lane op: compiled passes, the main loop's only when it has work.
        None when the op ended and ``done`` is still not set: the handle waits for an op
        chained after it (an all-gather's data after its sizes), which the caller then
        waits for the general way.  ``outer``: back (False) as soon as the lane's outer
        words moved (``Lane.watch_outer``), the op not ended."""
        loop = self._loop
        lane = loop.lane
        assert lane is not None
        ops = loop.ops
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
                self.owner = threading.get_ident()
                try:
                    if self.main_has_work():
                        if loop.run_once():
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
                        ops.settle()
                        return done.is_set()
                    if ended or lane.mem[L.C_PROGRESS] != moves:
                        last = time.perf_counter()
                        delay = 0.0
                    ops.settle()
                except Exception as exc:
                    loop.stopped_by(exc)
                finally:
                    self.owner = 0
                    self.lock.release()
                if ended or time.perf_counter() - last < spin_s or done.is_set():
                    continue
            elif not quiet:
                time.sleep(0)
                continue
            # A long silence (a peer that is late): sleep between passes, as the main
            # loop's waiter does, so a waiting rank does not hold a core meanwhile.
            delay = min(max(2 * delay, 2e-5), loop.cfg.backoff_max_s)
            if deadline is not None:
                delay = min(delay, max(0.0, deadline - time.perf_counter()))
            self.sleep(delay, done)
        return True

    def spin(self, span: float) -> bool:
        """The comm thread's spin while only lane ops are in flight: compiled passes for
        up to ``span`` s (after an op ends, ``spin_s`` again) that hold the loop's lock but
        not the interpreter's, so the training loop's Python runs meanwhile; ``span`` 0 is
        one pass.  False when the main loop has work or nothing moved."""
        loop = self._loop
        lane = loop.lane
        assert lane is not None
        if not self.lock.acquire(blocking=False):
            return False
        self.owner = threading.get_ident()
        ops = loop.ops
        stats = loop.stats
        mem = lane.mem
        moved = False
        try:
            while True:
                mem[L.C_KICK] = 0  # before the checks: a kick after them is seen
                if self.waiters or self.wanted or self.main_has_work():
                    return moved
                if not (lane.inflight or lane.sends_busy):
                    return moved
                stats.lane_spins += 1
                if not lane.drive(span, span):
                    return moved
                if lane.full:
                    lane.grow()
                    mem = lane.mem  # grown: a larger copy
                moved = True
                if mem[L.C_NEV] or mem[L.C_KICK] or mem[L.C_FULL]:
                    ops.drain()
                    return True
                ops.drain()  # ops ended: their completions, then drive on
                span = loop.cfg.spin_s
        except Exception as exc:
            loop.stopped_by(exc)
            return False
        finally:
            self.owner = 0
            self.lock.release()

    def main_has_work(self) -> bool:
        """A Python pass has work: submissions, control frames to send, a stall check due."""
        loop = self._loop
        stalls = loop.stalls
        return bool(
            loop.submissions
            or loop.control.waiting
            or time.monotonic() - stalls.last > stalls.every
        )


class _Waiting:
    """Counts a thread waiting in :meth:`Driver.progress` (the comm thread steps aside)."""

    _lock = threading.Lock()

    def __init__(self, driver: Driver, loop: Loop) -> None:
        self.driver = driver
        self.loop = loop

    def __enter__(self) -> None:
        with self._lock:
            self.driver.waiters += 1
        lane = self.loop.lane
        if lane is not None:  # the comm thread may be in compiled passes
            lane.kick()

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self.driver.waiters -= 1
        loop = self.loop
        if loop.submissions:
            # Ops nobody waits for (and notes this waiter left) go on at once, on the
            # comm thread, not after its idle sleep.
            loop.wake.set()

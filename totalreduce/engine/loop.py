"""The big loop: executes ops' segment plans over a transport, never blocking in it.

Each pass of :meth:`CommLoop.run_once` does, in this order:

1. take new submissions (and aborts, and "someone waits for this" notes) from
   the client queue and turn them into payloads, filing floating frames that
   now belong to them and telling peers whose frames were refused to send again;
2. take finished compute requests back from the reducer;
3. take every control message that arrived (``poll_message``) and act on its
   frames: eager bodies are applied or filed, announcements (RTS) answered with
   clear-to-send into the op's buffer or a pool buffer, or refused when the op is
   not submitted here and the pool is full; errors are relayed;
4. test posted body sends and receives; advance the ops they belong to;
5. schedule sends from a priority heap (priority, then someone waiting here or on
   the peer, then submission order): bodies cleared to send first, up to
   ``max_inflight_sends``, then eager bodies and announcements into each peer's
   outgoing message;
6. send each peer's outgoing message (coalescing: one message per peer and pass)
   within its control credit, with the credit this rank owes that peer attached.

Flow control (why no order of submissions and waits can deadlock): a large body
leaves only after its receiver has a place for it, so a send slot is never held
by a body that cannot be received; an eager body spends its sender's eager
credit, which the receiver returns when the body is consumed, so floating eager
frames never exceed the receiver's pool share, and a frame that finds no eager
credit goes as an announcement instead; an announcement for an op the receiver
has not submitted and has no room for is refused and parked at the sender until
the receiver submits the op (READY), so an op that has been submitted always has
a path: its bodies go into its own buffers.  Control messages cost control
credit that the receiver returns as soon as it has read them; it always reads
them, so credit always comes back.

Progress: the comm thread runs the loop while nobody waits; a thread blocked in
``wait()`` runs it itself (:meth:`progress`), as ``MPI_Wait`` progresses MPI, so an
op someone waits for crosses no thread hand-off.  One thread runs the loop at a
time (``lock``).  The loop knows no algorithm: it executes segment plans.
"""

from __future__ import annotations

import ctypes
import heapq
import logging
import os
import sys
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..algorithms.schedule import Action, Buffer, LocalKind, LocalOp
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
from .completion import Waitable
from .compute import ComputeKind, ComputeList, ComputeRequest
from .failures import ERROR_FAILED, ERROR_FRAME, ERROR_MISMATCH, ERROR_TIMEOUT, _error_from_peer
from .floating import BufferPool, FloatingList
from .lane_loop import LaneHooks
from .payload import OpKey, OpSpec, OpState, Payload
from .receiving import ReceiveHooks
from .sending import _CTL, _NO_SHAPE, _RECV, SendHooks
from .wire import (
    BYE,
    ERROR,
    F_AUX,
    F_GEN,
    F_NBYTES,
    F_PARAM,
    F_WID,
    FRAME_SIZE,
    GONE,
    HAVE,
    JOIN,
    MSG_SIZE,
    PROBE,
    READY,
)
from .wire import NEED as NEED  # tests import it from here

if TYPE_CHECKING:
    from .lane import Lane  # the lane imports the MPI binding: only when a service makes one

log = logging.getLogger("totalreduce.engine")

MAX_ERROR_TEXT = 4096

_LOCAL_KIND = {
    LocalKind.COPY: ComputeKind.COPY,
    LocalKind.SCALE: ComputeKind.SCALE,
    LocalKind.AVERAGE: ComputeKind.AVERAGE,
    LocalKind.ACCUMULATE: ComputeKind.ACCUMULATE,
}
_RECV_KIND = {
    Action.COPY: ComputeKind.COPY,
    Action.REDUCE: ComputeKind.REDUCE,
    Action.ACCUMULATE: ComputeKind.ACCUMULATE,
}


@dataclass
class LoopConfig:
    """The loop's knobs (see ``service/config.py`` for their documentation)."""

    micro_bytes: int = 16384
    max_inflight_sends: int = 8
    floating_pool_bytes: int = 256 << 20
    stall_warning_s: float = 60.0
    stall_shutdown_s: float = 0.0
    backoff_min_s: float = 1e-6
    backoff_max_s: float = 1e-3
    idle_backoff_max_s: float = 5e-2
    spin_s: float = 2e-4
    wait_spin_s: float = 2e-2
    inline_compute_bytes: int = 1 << 20
    need_after_s: float = 5e-4
    segment_bytes: int = 1 << 20


@dataclass
class LoopStats:
    frames_sent: int = 0
    messages_sent: int = 0
    frames_received: int = 0
    messages_received: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    floating_frames: int = 0
    rejected: int = 0
    ops_completed: int = 0
    ops_failed: int = 0
    passes: int = 0
    idle_sleeps: int = 0
    #: The comm thread's compiled passes over lane ops without the interpreter lock.
    lane_spins: int = 0

    @property
    def frames_per_message(self) -> float:
        return self.frames_sent / self.messages_sent if self.messages_sent else 0.0


# Let other threads run without sleeping: time.sleep(0) is a zero-length nanosleep,
# which the kernel's timer slack (50 µs by default) turns into a real sleep; measured
# 90 µs against 0.6 µs for sched_yield on the 2-core machine.
_yield: Callable[[], None] = getattr(os, "sched_yield", lambda: time.sleep(0))


def _set_timer_slack(ns: int = 1000) -> None:
    """Sleep precisely on this thread (Linux's default timer slack is 50 µs)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(29, ns, 0, 0, 0)  # PR_SET_TIMERSLACK
        except (OSError, AttributeError) as exc:  # not fatal: sleeps are just coarser
            log.debug("could not set the timer slack: %s", exc)


class CommLoop(LaneHooks, ReceiveHooks, SendHooks):
    """Executes payloads' segment plans over a transport (see the module docstring)."""

    def __init__(
        self,
        transport: Transport,
        config: LoopConfig | None = None,
        execute: Callable[[ComputeRequest], None] | None = None,
        run: Callable[..., None] | None = None,
    ) -> None:
        self.t = transport
        #: The compiled lane for small ops (``attach_lane``), or None.
        self.lane: Lane | None = None
        # Small reductions run right here (through the kernels the service hands
        # in), sparing two thread hand-offs; big ones go to the reducer thread.
        self._execute = execute
        self._run = run
        self._inline: deque[tuple[Payload, int, np.ndarray, bool]] = deque()
        self._draining = False
        self.rank = transport.rank
        self.size = transport.size
        # Ranks the loop may talk to: the user ranks and, in daemon mode, the nodes'
        # services after them (``transport.relays``).
        self.world = transport.size + int(getattr(transport, "relays", 0))
        self.cfg = cfg = config or LoopConfig()
        # Ops, aborts and urgency notes in one queue, so they are seen in order.
        self.submissions: deque[Any] = deque()
        self.compute = ComputeList()
        self.wake = threading.Event()
        self.lock = threading.Lock()
        self.waiters = 0
        self._owner = 0  # ident of the thread running a pass
        self._asleep = False  # the comm thread is (about to be) blocked on ``wake``
        # A transport that can wake a sleeping process (shared memory: an eventfd)
        # offers ``wait``/``wake``: the loop then sleeps in the transport, so a
        # message from another process ends the sleep at once.  Threads asleep there:
        self._t_wait: Callable[[float], None] | None = getattr(transport, "wait", None)
        self._t_wake: Callable[[], None] | None = getattr(transport, "wake", None)
        self._t_sleepers: set[int] = set()
        # A waiter spins (MPI_Wait-like) only where nothing can wake it: a transport that
        # wakes a sleeper when a message arrives (shared memory) makes spinning a waste of
        # the cores the other processes of the node need.
        self._wait_spin = cfg.wait_spin_s if self._t_wake is None else min(cfg.wait_spin_s, 5e-5)
        self.pool = BufferPool()
        self.floating = FloatingList(cfg.floating_pool_bytes, self.world)
        self.table: dict[OpKey, Payload] = {}
        # Daemon mode: which process of its rank this one is, and the latest process of
        # each peer this rank has heard of (JOIN).  BYE, GONE and JOIN carry it in their
        # op id, so a late notice about an earlier process of a rank is ignored.
        self.incarnation = int(getattr(transport, "incarnation", 0) or 0)
        self._incarnations = [0] * self.world
        self._passive = 0  # standing receives in the table (OpSpec.passive)
        # Bounded memories of finished ops: OrderedDict, because evicting the oldest
        # entry of a plain dict scans past every deleted slot (quadratic over a run).
        self.failed: OrderedDict[OpKey, str] = OrderedDict()
        # Ops finished here, remembered for a while (description, group): a frame
        # for one means a peer disagrees about the op; an error for one is raised late.
        # (description, group, unexpected-frame hints, segments cleared unasked)
        self.completed: OrderedDict[OpKey, tuple[Any, ...]] = OrderedDict()
        self.late_errors: deque[TotalReduceError] = deque()
        # Ops submitted to start after another op of this rank completes (OpSpec.after).
        self._held: dict[OpKey, list[OpSpec]] = {}
        self.stats = LoopStats()
        self.fatal: BaseException | None = None
        self.bad_peers: dict[int, TotalReduceError] = {}
        self.trace: Any = None  # a timeline recorder, when one is on
        # Daemon mode, a client: the rank every message goes through (its node's service).
        self._via: int | None = getattr(transport, "relay", None)
        # Daemon mode: a node's service takes part in ops it never submitted (the relay
        # steps of hierarchical schedules).  ``adopt(source, frame)`` returns the spec of
        # the op a frame for an unknown op belongs to, if this rank is to join it.
        self.adopt: Callable[[int, wire.Frame], OpSpec | None] | None = None
        self._seq = 0
        # Sending.
        self._heap: list[tuple[int, int, int, int, int, Payload]] = []
        self._cleared: list[tuple[int, int, int, int, Payload, int, int]] = []
        self._bodies_inflight = 0
        self._blocked: list[list[tuple[int, int, int, int, int, Payload]]] = [
            [] for _ in range(self.world)
        ]
        # Per peer: the outgoing message being built, messages waiting for credit,
        # credits, and credit owed back.
        self._msg_cap = max(64 << 10, 2 * (FRAME_SIZE + cfg.micro_bytes) + MSG_SIZE)
        self._out: list[bytearray | None] = [None] * self.world
        self._out_frames = [0] * self.world
        self._backlog: list[deque[tuple[bytearray, int]]] = [deque() for _ in range(self.world)]
        self._dirty: set[int] = set()
        window = 4 * self._msg_cap
        self._ctl_window = window
        self._ctl_credit = [window] * self.world
        self._queued = [0] * self.world  # bytes in outbox + backlog, not yet sent
        self._eager_credit = [self.floating.eager_share] * self.world
        self._owe_ctl = [0] * self.world
        self._owe_eager = [0] * self.world
        self._next_tag = [0] * self.world
        self._tag_span = int(getattr(transport, "tag_span", wire.BODY_TAG_SPAN))
        self._left: set[int] = set()  # peers that said goodbye (a subset of bad_peers)
        self._unreachable: set[int] = set()  # peers whose link failed: nothing goes to them
        # Receiving: ops refused for lack of room here (to tell when submitted), and
        # urgency noted for ops not submitted yet.
        self._rejected: dict[OpKey, set[int]] = {}
        self._needed: OrderedDict[OpKey, bool] = OrderedDict()
        # Posted requests and their owners, parallel lists; removal swaps with the last.
        self._reqs: list[Any] = []
        self._owners: list[tuple[int, Any]] = []
        # What each frame type does (a handler per type).
        self._handlers = self._frame_handlers()
        self._last_stall_check = time.monotonic()
        stall = [x for x in (cfg.stall_warning_s, cfg.stall_shutdown_s) if x > 0]
        self._stall_every = min([1.0] + [x / 4 for x in stall])

    # ------------------------------------------------------------------ client side

    def attach_lane(self, lane: Lane) -> None:
        """Run the small ops the compiled lane can run there (before any op is submitted)."""
        self.lane = lane

    def submit(self, spec: OpSpec) -> None:
        """Queue an op (any thread); with the lane, enter it now if no pass is running."""
        self.submissions.append(spec)
        if self.lane is not None and self.lock.acquire(blocking=False):
            self._owner = threading.get_ident()
            try:
                self._take_submissions()
            finally:
                self._owner = 0
                self.lock.release()
            return
        if self.lane is not None:  # it may be in compiled passes, holding the lock
            self.lane.kick()
        if self._asleep:  # wake the comm thread only if it sleeps (a futex call saved)
            self._ring()

    def mark_needed(self, spec: OpSpec) -> None:
        """Someone waits for this op (any thread): raise it here, ask the peers to."""
        if not spec.urgent:
            spec.urgent = True
            lop = None if self.lane is None else self.lane.by_key.get(spec.key)
            if lop is not None:  # one word in the lane's table: no pass of the main loop
                self.lane.set_urgent(lop)
                return
            self.submissions.append(("need", spec.key))

    def request_abort(self, key: OpKey, name: str, reason: str) -> None:
        """Fail an op here and on every rank, submitted or not (any thread)."""
        self.submissions.append(("abort", key, name, reason))
        self._ring()

    def notify(self) -> None:
        self._ring()

    def _ring(self) -> None:
        """Wake the comm thread, and any thread asleep in the transport."""
        if self.lane is not None:
            self.lane.kick()
        self.wake.set()
        if self._t_sleepers and self._t_wake is not None:
            self._t_wake()

    def _sleep(self, delay: float, done: Waitable) -> None:
        """Sleep up to ``delay`` unless ``done`` is set: in the transport if it can wake us."""
        if self._t_wait is None:
            done.wait(delay)
            return
        me = threading.get_ident()
        self._t_sleepers.add(me)  # before the check: a waker that sets ``done`` sees us
        try:
            if not done.is_set():
                self._t_wait(delay)
        finally:
            self._t_sleepers.discard(me)

    @property
    def busy(self) -> bool:
        return bool(
            len(self.table) > self._passive
            or (self.lane is not None and self.lane.inflight > 0)
            or self.submissions
            or len(self.compute)
            or self.compute.done
        )

    @property
    def sending(self) -> bool:
        """Messages queued for a peer and not handed to the transport yet."""
        return bool(self._dirty)

    @property
    def sends_in_flight(self) -> bool:
        """Sends handed to the transport that have not completed: their buffers must live
        (and the transport stay open) until they have, or a peer gets freed memory."""
        if self.lane is not None and self.lane.sends_busy:
            return True
        return any(what != _RECV for what, _ in self._owners)

    # ------------------------------------------------------------------ driving the loop

    def run(self, stop: threading.Event) -> None:
        """The comm thread: progress until ``stop`` is set; back off when idle."""
        _set_timer_slack()
        cfg = self.cfg
        delay = cfg.backoff_min_s
        last = time.perf_counter()
        while not stop.is_set():
            if self.waiters:
                # A waiting thread drives the loop; stay out of its way.
                self.wake.wait(cfg.backoff_max_s)
                self.wake.clear()
                continue
            # Only lane ops in flight: compiled passes without the interpreter lock, until
            # something needs Python; the main loop's pass below otherwise.
            if self.lane is not None and self._lane_spin(cfg.spin_s):
                delay = cfg.backoff_min_s
                last = time.perf_counter()
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
            if not self.submissions:  # one queued since the last pass: no sleep
                self._sleep(delay, self.wake)
            self._asleep = False
            self.wake.clear()
            ceiling = cfg.backoff_max_s if self.busy else cfg.idle_backoff_max_s
            delay = min(delay * 2, ceiling)

    def _pass(self) -> bool:
        """One pass under the lock (False if another thread is running one)."""
        if not self.lock.acquire(blocking=False):
            return False
        self._owner = threading.get_ident()
        try:
            return self.run_once()
        except Exception as exc:  # never die silently: fail every op
            if self.fatal is None:
                log.exception("rank %d: comm loop stopped by an error", self.rank)
                self.fatal = exc
                self._fail_all(TotalReduceError(f"rank {self.rank}: the comm loop failed: {exc}"))
            return False
        finally:
            self._owner = 0
            self.lock.release()

    def poll(self) -> None:
        """Run one pass if no other thread is running one (``done()``, like ``MPI_Test``)."""
        if self._owner != threading.get_ident():
            self._pass()

    def progress(self, done: Waitable, timeout: float | None, spec: OpSpec | None) -> bool:
        """Drive the loop from a waiting thread until ``done`` is set; False on timeout."""
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
        needed = False
        lane = self.lane
        with _Waiting(self):
            while not done.is_set():
                if lane is not None and spec is not None:
                    lop = lane.by_key.get(spec.key)
                    if lop is not None and lop.spec is spec:
                        return self._lane_progress(lop, done, deadline, self._wait_spin)
                now = time.perf_counter()
                if deadline is not None and now >= deadline:
                    return done.is_set()
                if self._pass():
                    last = now
                    delay = 0.0
                    continue
                if spec is not None and not needed and now - start > cfg.need_after_s:
                    needed = True
                    self.submissions.append(("ask", spec.key))
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

    # ------------------------------------------------------------------ one pass

    def run_once(self) -> bool:
        """One pass of the big loop (caller holds ``lock``); True when anything progressed."""
        self.stats.passes += 1
        progressed = False
        if self.submissions:
            progressed = self._take_submissions()
        if self.lane is not None and self._lane_pump():
            progressed = True
        done = self.compute.done
        while done:
            self._on_computed(done.popleft())
            progressed = True
        if self._poll_messages():
            progressed = True
        if self._reqs and self._poll_requests():
            progressed = True
        if (self._heap or self._cleared) and self._schedule_sends():
            progressed = True
        if self._dirty:
            self._flush()
        if progressed and self._t_sleepers:  # an op another thread waits for may be done
            self._ring()
        now = time.monotonic()
        if now - self._last_stall_check > self._stall_every:
            self._last_stall_check = now
            if self.table or (self.lane is not None and self.lane.ops):
                self._check_peers()
            self._check_stalls(now)
        return progressed

    def _take_submissions(self) -> bool:
        while self.submissions:
            item = self.submissions.popleft()
            if isinstance(item, tuple):
                if item[0] == "abort":
                    self._abort(item[1], item[2], item[3])
                elif item[0] == "rejoin":
                    peer, inc = item[1], item[2]
                    self._incarnations[peer] = max(self._incarnations[peer], inc)
                    self._rejoin(peer)
                    self._announce(JOIN, peer, inc)
                elif item[0] == "gone":
                    peer, inc = item[1], item[2]
                    if self._current(peer, inc) and peer not in self._left:
                        self._peer_left(peer)
                    self._announce(GONE, peer, inc)
                elif item[0] == "need":
                    p = self.table.get(item[1])
                    if p is not None:
                        self._raise(p)
                    elif self.lane is not None and item[1] in self.lane.by_key:
                        self.lane.set_urgent(self.lane.by_key[item[1]])
                else:  # "ask": the waiter is still waiting: ask the peers too
                    self._ask(item[1])
                continue
            try:
                self._activate(item)
            except Exception as exc:  # one bad op must not stop the loop
                log.exception("rank %d: activating %s failed", self.rank, item.describe())
                err = OpFailedError(
                    f"{item.describe()}: rank {self.rank} could not start it: {exc}"
                )
                p = self.table.get(item.key)
                if p is not None and p.spec is item:
                    self._fail(p, err, tell_peers=True)
                else:
                    self._fail_unsubmitted(item, err)
        return True

    # ------------------------------------------------------------------ activation

    def _activate(self, spec: OpSpec) -> None:
        key = spec.key
        if self.fatal is not None:
            self._finish_spec(spec, TotalReduceError(f"the comm loop stopped: {self.fatal}"))
            return
        if spec.after is not None:
            first = spec.after
            if first in self.table or (self.lane is not None and first in self.lane.by_key):
                self._held.setdefault(first, []).append(spec)
                return
            if first in self.failed:
                self._fail_unsubmitted(spec, self._chain_error(spec, self.failed[first]))
                return
        bad = self.bad_peers and [
            self.bad_peers[w] for w in spec.group if w in self.bad_peers and w not in self._left
        ]
        if bad and not spec.joined:
            self._fail_unsubmitted(spec, type(bad[0])(f"{spec.describe()}: {bad[0]}"))
            return
        if self.lane is not None and not spec.joined and self._lane_activate(spec):
            return
        if key in self.table:
            self._finish_spec(
                spec, OpFailedError(f"{spec.describe()} submitted twice on rank {self.rank}")
            )
            return
        s = spec.schedule
        inbuf = spec.inbuf
        bufs = {Buffer.INPUT: inbuf, Buffer.OUTPUT: spec.outbuf}
        work = self.pool.take_work(s.work_count * spec.dtype.itemsize)
        bufs[Buffer.WORK] = work.view(spec.dtype.numpy)
        prologue: list[LocalOp | tuple[np.ndarray, np.ndarray]] = list(s.prologue)
        if spec.in_place and s.reads_input:
            private = np.empty_like(inbuf)
            bufs[Buffer.INPUT] = private
            prologue.insert(0, (private, inbuf))
        self._seq += 1
        p = Payload(spec, self._seq, bufs)
        self.table[key] = p
        self._passive += spec.passive
        if self.trace is not None:
            self.trace.op(spec.name, spec.generation, "submitted", spec.priority)
        if self._needed.pop(key, False):
            p.hot = True
        err = self.floating.take_error(key)
        frames = self.floating.take(key)
        if err is not None:
            for ff in frames:
                self._drop_floating(ff)
            message = self._named(err[0], key, spec.name)
            self._fail(p, _error_from_peer(message, err[1]), tell_peers=True)
            return
        for i, ff in enumerate(frames):
            if ff.eager:
                self._owe(ff.source, 0, ff.eager)
            q = self._match(p, ff.frame, ff.source)
            if q is None:  # the op failed: the rest of its frames go too
                self.pool.give(ff.body)
                for rest in frames[i + 1 :]:
                    self._drop_floating(rest)
                return
            self._on_body(p, q, ff.body)
        for peer in self._rejected.pop(key, ()):
            self._control(peer, READY, p.shape, key)
        for peer in () if spec.joined else self._left.intersection(spec.group):
            if p.needs(peer):  # frames it sent before leaving are filed above
                self._fail(p, self._left_error(p, peer), tell_peers=True)
                return
        p.local_left = len(prologue)
        if not prologue:
            self._start(p)
            return
        reqs = []
        for lop in prologue:
            if isinstance(lop, tuple):
                dst, src = lop
                reqs.append(ComputeRequest(ComputeKind.COPY, spec.dtype, dst, src, owner=p))
            else:
                reqs.append(self._local_request(p, lop))
        self._run_locals(reqs)

    def _run_locals(self, reqs: list[ComputeRequest]) -> None:
        """Run a prologue or epilogue in order: inline when small, else on the reducer."""
        inline = sum(r.dst.nbytes for r in reqs) <= self.cfg.inline_compute_bytes
        for req in reqs:
            self._compute(req, inline)

    def _compute(self, req: ComputeRequest, inline: bool) -> None:
        """Run a request here (small) or queue it for the reduce thread (large).

        Either way it comes back through ``compute.done``, so finishing it never
        recurses into the code that queued it.
        """
        if inline and self._execute is not None:
            t0 = time.perf_counter_ns() if self.trace is not None else 0
            try:
                self._execute(req)
            except Exception as exc:  # handed to the op, as the reducer would
                req.error = exc
            if self.trace is not None:
                spec = req.owner.spec
                self.trace.compute(
                    spec.name, spec.generation, req.kind.name.lower(), req.dst.nbytes, t0,
                    time.perf_counter_ns(),
                )  # fmt: skip
            self.compute.done.append(req)
        else:
            self.compute.put(req)

    def _local_request(self, p: Payload, lop: LocalOp) -> ComputeRequest:
        d = lop.dst
        dst = p.region(d.buffer, d.offset, d.count)
        src = None if lop.src is None else p.region(lop.src.buffer, lop.src.offset, lop.src.count)
        return ComputeRequest(
            _LOCAL_KIND[lop.kind],
            p.spec.dtype,
            dst,
            src,
            op=p.spec.op,
            weight=lop.weight,
            divisor=lop.divisor,
            owner=p,
            token=-1,
        )

    def _start(self, p: Payload) -> None:
        """Prologue done: sends may go, arrived frames may apply."""
        if p.state is not OpState.PREPARING:
            return
        p.state = OpState.ACTIVE
        self._preclear(p)
        for i, w in enumerate(p.send_waits):
            if w == 0:
                self._push(p, i)
        for q in [q for q in p.pending if p.recv_waits[q] == 0]:
            self._apply(p, q, p.pending.pop(q))
        self._maybe_finish(p)

    def _maybe_finish(self, p: Payload) -> None:
        if p.state is not OpState.ACTIVE or p.sends_left or p.recvs_left:
            return
        epilogue = p.spec.schedule.epilogue
        p.state = OpState.FINISHING
        if not epilogue:
            self._complete(p)
            return
        p.local_left = len(epilogue)
        self._run_locals([self._local_request(p, lop) for lop in epilogue])

    def _release_work(self, p: Payload) -> None:
        work = p.bufs.get(Buffer.WORK)
        if work is not None and work.size:
            self.pool.give_work(work.view(np.uint8))
            p.bufs[Buffer.WORK] = work[:0]

    def _complete(self, p: Payload) -> None:
        self._release_work(p)
        cleared: frozenset[tuple[int, int, int]] = frozenset()
        if p.precleared:  # an announcement that crossed its clear may still come
            recvs, group = p.spec.plan.recvs, p.spec.group
            cleared = frozenset(
                (recvs[q].step, group[recvs[q].peer], recvs[q].segment) for q in p.precleared
            )
        done = (p.spec.describe(), p.spec.group, p.spec.schedule.unexpected, cleared)
        self._remember(self.completed, p.key, done)
        p.state = OpState.DONE
        del self.table[p.key]
        if self.lane is not None:
            self.lane.set_foreign(p.key, False)
        self._passive -= p.spec.passive
        self.stats.ops_completed += 1
        for spec in self._held.pop(p.key, ()):  # the next phases of a chain
            self._activate(spec)
        if self.trace is not None:
            self.trace.op(p.spec.name, p.spec.generation, "done", p.spec.priority)
        self._finish_spec(p.spec, None)

    @staticmethod
    def _remember(table: OrderedDict[OpKey, Any], key: OpKey, value: Any) -> None:
        if key[0] == wire.SESSION_ID:
            return  # every job starts with it: a memory of it would meet the next job
        table[key] = value
        if len(table) > 4096:
            table.popitem(last=False)

    @staticmethod
    def _finish_spec(spec: OpSpec, error: BaseException | None) -> None:
        if spec.on_done is not None:
            try:
                spec.on_done(error)
            except Exception:  # a user callback must not kill the loop
                log.exception("completion callback of %s failed", spec.describe())

    # ------------------------------------------------------------------ failures

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
            if isinstance(error, OpMismatchError):
                code = ERROR_MISMATCH
            elif isinstance(error, FrameError):
                code = ERROR_FRAME
            elif isinstance(error, OpTimeoutError):
                code = ERROR_TIMEOUT
            else:
                code = ERROR_FAILED
            dests = set(p.spec.group)
            if also >= 0:
                dests.add(also)
            for world in sorted(dests):
                if world != self.rank:
                    self._error_frame(p.key, world, str(error), code)
        text = str(error)
        log.log(
            logging.INFO if p.spec.passive else logging.ERROR,  # its owner reports it
            "%s",
            text if text.startswith(f"rank {self.rank}:") else f"rank {self.rank}: {text}",
        )
        if self.trace is not None:
            self.trace.op(p.spec.name, p.spec.generation, "failed", p.spec.priority)
        self._finish_spec(p.spec, error)

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

    def say_goodbye(self) -> None:
        """Tell every peer this service stops: their ops with this rank fail at once."""
        with self.lock:
            for peer in range(self.world):
                if peer != self.rank and peer not in self.bad_peers:
                    self._control(peer, BYE, _NO_SHAPE, (self.incarnation, 0))
            self._flush()

    def _error_frame(self, key: OpKey, dest: int, message: str, code: int) -> None:
        """Tell rank ``dest`` that op ``key`` failed."""
        if dest in self._unreachable or dest in self._left:
            return
        body = message.encode()[:MAX_ERROR_TEXT]
        shape = (0, 0, 0, 0, 0, code, 0)
        self._control(dest, ERROR, shape, key, body=body)

    def _who(self, rank: int) -> str:
        """A rank in words: the nodes' services (daemon mode) are ranks after the users'."""
        if rank < self.size:
            return f"rank {rank}"
        return f"the service of node {rank - self.size} (rank {rank})"

    @staticmethod
    def _named(message: str, key: OpKey, name: str | int) -> str:
        """An error a node's service wrote names the op by its id: name it as users do."""
        return message.replace(f"op '#{key[0]:016x}'", f"op {name!r}")

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
            what, group = done[0], done[1]
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

    def _abort(self, key: OpKey, name: str, reason: str) -> None:
        err = OpFailedError(reason)
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
        self.floating.add_error(key, reason, ERROR_FAILED)
        for world in range(self.world):
            if world != self.rank:
                self._error_frame(key, world, reason, ERROR_FAILED)
        log.error("rank %d: op %r generation %d aborted: %s", self.rank, name, key[1], reason)

    def _bad_peer(self, peer: int, err: TotalReduceError, *, reachable: bool = True) -> None:
        """A peer spoke garbage or failed: fail every op it is part of, now and later.

        Its ops' errors still go to it when it can be reached (it may be able to stop its
        own ops); its bodies will not come, so receives posted for it are cancelled.
        """
        if peer in self.bad_peers and peer not in self._left:
            return
        if not reachable:
            self._unreachable.add(peer)
        for p in [p for p in self.table.values() if peer in p.group_rank]:
            self._fail(p, type(err)(f"{p.spec.describe()}: {err}"), tell_peers=True)
        self._lane_fail_with(peer, lambda s: type(err)(f"{s.describe()}: {err}"))
        self.bad_peers[peer] = err
        log.error("%s", err)
        self._cancel_from(peer)
        if peer == self._via:
            self._cut_off(peer)

    def _cancel_from(self, peer: int) -> None:
        """Cancel receives posted for bodies from ``peer``; they complete empty (given up)."""
        for what, obj in self._owners:
            if what == _RECV and obj[0].source == peer:
                self.t.cancel(obj[0].req)

    def _peer_left(self, peer: int) -> None:
        """Rank ``peer`` shut down: it sends nothing more (every frame it sent has come,
        in order), so the ops that still need it fail; those with only local work left
        finish."""
        why = f"rank {peer} stopped (its service shut down: the program ended or failed)"
        if self._reqs:  # sends it received may not be marked done here yet
            self._poll_requests()
        self.bad_peers[peer] = OpFailedError(f"rank {self.rank}: {why}; ops with it fail")
        self._left.add(peer)
        if self.lane is not None:
            self._lane_pump()  # what it sent before its goodbye has arrived: take it first
        hit = [p for p in self.table.values() if peer in p.group_rank and p.needs(peer)]
        if not hit:
            log.info("rank %d: %s", self.rank, why)
        for p in hit:
            self._fail(p, self._left_error(p, peer), tell_peers=True)
        self._lane_fail_with(
            peer,
            lambda s: OpFailedError(
                f"rank {self.rank}: {s.describe()}: {self._who(peer)} stopped (its service "
                "shut down: the program ended or failed) before it completed"
            ),
            only_needed=True,
        )
        self._cancel_from(peer)
        if peer == self._via:
            self._cut_off(peer)

    def _cut_off(self, via: int) -> None:
        """Every message goes through rank ``via`` and it is gone: every op fails."""
        self._lane_fail_all(OpFailedError(f"rank {self.rank}: {self._who(via)} stopped"))
        for p in list(self.table.values()):
            self._fail(
                p,
                OpFailedError(
                    f"rank {self.rank}: {p.spec.describe()}: {self._who(via)} stopped; this "
                    "rank reaches no other rank without it"
                ),
                tell_peers=False,
            )

    def _left_error(self, p: Payload, peer: int) -> OpFailedError:
        return OpFailedError(
            f"rank {self.rank}: {p.spec.describe()}: {self._who(peer)} stopped (its service "
            "shut down: the program ended or failed) before it completed"
        )

    # ------------------------------------------------------------------ sending

    # ------------------------------------------------------------------ receiving

    def _on_bye(self, source: int, f: wire.Frame, buf: np.ndarray, off: int) -> None:
        """Rank ``source`` shuts down."""
        if self._current(source, f[F_WID]):  # else an earlier process's goodbye
            self._peer_left(source)

    def _on_gone(self, source: int, f: wire.Frame, buf: np.ndarray, off: int) -> None:
        """A node's service says client rank ``f[F_AUX]``'s process died."""
        peer, inc = f[F_AUX], f[F_WID]
        if 0 <= peer < self.size and peer != self.rank and peer != source:
            if peer not in self._left and self._current(peer, inc):
                self._peer_left(peer)

    def _on_join(self, source: int, f: wire.Frame, buf: np.ndarray, off: int) -> None:
        """A node's service says a new process has client rank ``f[F_AUX]``."""
        peer, inc = f[F_AUX], f[F_WID]
        if 0 <= peer < self.size and peer != self.rank and peer != source:
            if inc >= self._incarnations[peer]:  # else an earlier process's JOIN
                self._incarnations[peer] = inc
                self._rejoin(peer)

    def _on_probe(self, source: int, f: wire.Frame, buf: np.ndarray, off: int) -> None:
        """A stalled op's rank asks who has submitted it: answer HAVE if this rank has."""
        key = (f[F_WID], f[F_GEN])
        if (
            key in self.table
            or key in self.completed
            or (self.lane is not None and key in self.lane.by_key)
        ):
            self._control(source, HAVE, _NO_SHAPE, key)

    def _on_have(self, source: int, f: wire.Frame, buf: np.ndarray, off: int) -> None:
        """Rank ``source`` has submitted the op this rank probed for."""
        p = self.table.get((f[F_WID], f[F_GEN]))
        if p is not None:
            p.have.add(source)
        elif self.lane is not None and (f[F_WID], f[F_GEN]) in self.lane.by_key:
            self.lane.by_key[(f[F_WID], f[F_GEN])].have.add(source)

    def _on_error_frame(self, source: int, f: wire.Frame, buf: np.ndarray, off: int) -> None:
        """An op failed on rank ``source``; the frame's body says why."""
        n = f[F_NBYTES]
        text = bytes(buf[off : off + n]).decode(errors="replace")
        self._on_error((f[F_WID], f[F_GEN]), text, f[F_PARAM], source)

    def peer_gone(self, peer: int, incarnation: int = 0) -> None:
        """Daemon mode, a node's service: client rank ``peer``'s process (``incarnation``)
        died (any thread).  Its ops fail here and, told by GONE, on every rank, as if it
        had said BYE."""
        self.submissions.append(("gone", peer, int(incarnation)))
        self._ring()

    def rejoin(self, peer: int, incarnation: int = 0) -> None:
        """Daemon mode, a node's service: a new process (``incarnation``) has client rank
        ``peer`` (any thread).  Every rank that saw the old one leave forgets it (JOIN), and
        a late BYE or GONE of the old one is ignored."""
        self.submissions.append(("rejoin", peer, int(incarnation)))
        self._ring()

    def _current(self, peer: int, incarnation: int) -> bool:
        """Whether a BYE or GONE about client rank ``peer``'s process ``incarnation`` is
        about the process this rank knows.  In daemon mode a node forwards what comes for
        a slot between jobs to the slot's next client, so a goodbye of a rank's process
        from the job before can reach the next job's ranks, before or after the JOIN of
        the rank's new process: only a notice about the process JOIN announced counts.
        """
        if self.world == self.size or peer >= self.size:
            return True  # embedded (no incarnations), or a node's service
        known = self._incarnations[peer]
        return known > 0 and incarnation >= known

    def _announce(self, ftype: int, peer: int, incarnation: int) -> None:
        for world in range(self.world):
            if world not in (self.rank, peer) and world not in self._unreachable:
                self._control(world, ftype, _NO_SHAPE, (incarnation, 0), aux=peer)

    def _rejoin(self, peer: int) -> None:
        """Forget the process that had rank ``peer`` if it left (its ops failed then).

        Between nodes' services a JOIN travels on MPI's control tag and the new
        process's own frames in envelopes on another tag, so MPI does not order them:
        a frame of the new process could be counted before the JOIN resets its
        credits.  Its session agreement at ``init()`` comes first in practice (every
        client waits for it before its first op), which is what the tests exercise.
        """
        if peer not in self._left and peer not in self.bad_peers:
            return  # never seen leave: nothing to forget (a rank's first process)
        self.bad_peers.pop(peer, None)
        self._left.discard(peer)
        self._unreachable.discard(peer)
        for key in self.floating.keys_from(peer):
            for ff in self.floating.take(key):
                self._drop_floating(ff)
        self._ctl_credit[peer] = self._ctl_window
        self._eager_credit[peer] = self.floating.eager_share
        self._owe_ctl[peer] = self._owe_eager[peer] = 0
        self._out[peer] = None
        self._out_frames[peer] = 0
        self._backlog[peer].clear()
        self._queued[peer] = 0
        self._dirty.discard(peer)
        self._blocked[peer].clear()
        self._next_tag[peer] = 0

    def _on_body(self, p: Payload, q: int, body: np.ndarray) -> None:
        """A body for receive segment ``q`` is in a scratch buffer."""
        p.got[q] = 1
        if p.state is OpState.ACTIVE and p.recv_waits[q] == 0:
            self._apply(p, q, body)
        else:
            p.pending[q] = body

    def _apply(self, p: Payload, q: int, body: np.ndarray, scratch: bool = True) -> None:
        if self._run is not None and body.nbytes <= self.cfg.inline_compute_bytes:
            # Reduce right here, in order, without recursing through the segments it
            # releases (a chain of pending segments can be long).
            self._inline.append((p, q, body, scratch))
            if not self._draining:
                self._drain_inline()
            return
        seg = p.spec.plan.recvs[q]
        reg = seg.region
        dst = p.region(reg.buffer, reg.offset, reg.count)
        src = body.view(p.spec.dtype.numpy)
        req = ComputeRequest(
            _RECV_KIND[seg.action],
            p.spec.dtype,
            dst,
            src,
            op=p.spec.op,
            weight=seg.weight,
            owner=p,
            token=q,
            scratch=body if scratch else None,
        )
        if seg.src is not None:
            req.base = p.region(seg.src.buffer, seg.src.offset, seg.src.count)
        self._compute(req, body.nbytes <= self.cfg.inline_compute_bytes)

    def _drain_inline(self) -> None:
        self._draining = True
        run = self._run
        trace = self.trace
        try:
            while self._inline:
                p, q, body, scratch = self._inline.popleft()
                if p.state is not OpState.ACTIVE:
                    if scratch:
                        self.pool.give(body)
                    continue
                seg = p.spec.plan.recvs[q]
                reg = seg.region
                dst = p.bufs[reg.buffer][reg.offset : reg.end]
                src = body.view(p.spec.dtype.numpy)
                base = None
                if seg.src is not None:
                    base = p.bufs[seg.src.buffer][seg.src.offset : seg.src.end]
                t0 = time.perf_counter_ns() if trace is not None else 0
                try:
                    run(
                        _RECV_KIND[seg.action],
                        p.spec.dtype,
                        dst,
                        src,
                        p.spec.op,
                        seg.weight,
                        1,
                        base,
                    )
                except Exception as exc:  # handed to the op, as the reducer would
                    if scratch:
                        self.pool.give(body)
                    self._fail(
                        p,
                        OpFailedError(
                            f"{p.spec.describe()}: reduction failed on rank {self.rank}: {exc}"
                        ),
                        tell_peers=True,
                    )
                    continue
                if trace is not None:
                    trace.compute(
                        p.spec.name, p.spec.generation, seg.action.name.lower(), dst.nbytes, t0,
                        time.perf_counter_ns(),
                    )  # fmt: skip
                if scratch:
                    self.pool.give(body)
                self._applied(p, q)
        finally:
            self._draining = False

    def _applied(self, p: Payload, q: int) -> None:
        p.recvs_left -= 1
        p.last_progress = time.monotonic()
        if self.trace is not None and not p.recvs_left:
            self.trace.op(p.spec.name, p.spec.generation, "reduced", p.spec.priority)
        for is_send, idx in p.spec.plan.after_recv[q]:
            if is_send:
                p.send_waits[idx] -= 1
                if p.send_waits[idx] == 0:
                    self._push(p, idx)
            else:
                p.recv_waits[idx] -= 1
                if p.recv_waits[idx] == 0 and idx in p.pending:
                    self._apply(p, idx, p.pending.pop(idx))
        self._maybe_finish(p)

    # ------------------------------------------------------------------ compute results

    def _on_computed(self, req: ComputeRequest) -> None:
        p: Payload = req.owner
        if req.scratch is not None:
            self.pool.give(req.scratch)
        if p.state in (OpState.FAILED, OpState.DONE):
            return
        if req.error is not None:
            self._fail(
                p,
                OpFailedError(
                    f"{p.spec.describe()}: reduction failed on rank {self.rank}: {req.error}"
                ),
                tell_peers=True,
            )
            return
        if req.token >= 0:
            self._applied(p, req.token)
            return
        p.local_left -= 1
        if p.local_left:
            return
        if p.state is OpState.PREPARING:
            self._start(p)
        elif p.state is OpState.FINISHING:
            self._complete(p)

    # ------------------------------------------------------------------ stalls

    def _check_peers(self) -> None:
        """Fail every op of a peer whose process is gone (where the transport can tell)."""
        peers = {w for p in self.table.values() for w in p.spec.group}
        if self.lane is not None:
            peers.update(w for lop in self.lane.ops.values() for w in lop.spec.group)
        peers.discard(self.rank)
        for peer in sorted(peers - set(self.bad_peers)):
            if self.t.alive(peer) is False:
                self._bad_peer(
                    peer,
                    TransportError(
                        f"rank {self.rank}: {self._who(peer)} is gone (its process exited); "
                        "every op with it fails"
                    ),
                )

    def _check_stalls(self, now: float) -> None:
        """Probe, warn about and (with ``stall_shutdown_s``) fail ops that stopped moving.

        Halfway to the warning, a stalled op asks its group who has submitted it
        (PROBE; submitted ranks answer HAVE), so the warning names the ranks that
        have not, not only the neighbour the op waits on.
        """
        warn, shut = self.cfg.stall_warning_s, self.cfg.stall_shutdown_s
        first = min(x for x in (warn, shut, float("inf")) if x > 0)
        self._lane_stalls(now, first, warn, shut)
        for p in list(self.table.values()):
            if p.spec.passive:
                continue  # a window's standing receive waits as long as its peer likes
            if p.given_up is not None and now - p.given_up[0] > 1.0:
                self._fail(p, OpFailedError(p.given_up[1]), tell_peers=True)
                continue
            idle = now - p.last_progress
            if not p.probed and idle >= first / 2:
                p.probed = True
                for world in p.spec.group:
                    if world != self.rank and world not in p.heard:
                        self._control(world, PROBE, p.shape, p.key)
            if shut > 0 and idle >= shut:
                self._fail(
                    p,
                    OpTimeoutError(
                        f"{p.spec.describe()}: no progress for {idle:.0f} s "
                        f"(stall_shutdown_s={shut:g}); {self._stall_text(p)}"
                    ),
                    tell_peers=True,
                )
            elif warn > 0 and idle >= warn and not p.warned:
                p.warned = True
                log.warning(
                    "rank %d: %s made no progress for %.0f s; %s",
                    self.rank,
                    p.spec.describe(),
                    idle,
                    self._stall_text(p),
                )

    def _stall_text(self, p: Payload) -> str:
        recv_from, send_to = p.waiting_on()
        missing = p.missing(self.rank)
        text = f"ranks {missing} have not submitted it; " if missing else ""
        text += f"it waits for frames from ranks {recv_from}"
        if send_to:
            text += f" and has frames for ranks {send_to}"
        return text

    def stalled(self) -> list[str]:
        """Descriptions of the ops in flight and whom they wait for (for error messages)."""
        out = []
        with self.lock:  # the comm thread may be in a pass
            for p in list(self.table.values()):
                if p.spec.passive:
                    continue
                recv_from, _ = p.waiting_on()
                out.append(f"{p.spec.describe()} waits for ranks {recv_from}")
            if self.lane is not None:
                for lop in list(self.lane.ops.values()):
                    recv_from = self.lane.waiting_on(lop)
                    out.append(f"{lop.spec.describe()} waits for ranks {recv_from}")
        return out

    def timeout_error(
        self, spec: OpSpec | None, name: Any, generation: int, timeout: float
    ) -> OpTimeoutError:
        """The error of a ``wait(timeout=...)`` that ran out, naming whom the op waits for."""
        who = ""
        with self.lock:  # another thread may be in a pass
            p = None if spec is None else self.table.get(spec.key)
            lop = None if spec is None or self.lane is None else self.lane.by_key.get(spec.key)
            if p is not None:
                recv_from, send_to = p.waiting_on()
                who = f"; it waits for frames from ranks {recv_from}"
                if send_to:
                    who += f" and has frames for ranks {send_to}"
            elif lop is not None:
                who = f"; it waits for frames from ranks {self.lane.waiting_on(lop)}"
        return OpTimeoutError(
            f"op {name!r} generation {generation} did not complete within {timeout} s on rank "
            f"{self.rank}{who} (it stays in flight; wait again or check the peers)"
        )


class _Waiting:
    """Counts a thread waiting in :meth:`CommLoop.progress` (the comm thread steps aside)."""

    _lock = threading.Lock()

    def __init__(self, loop: CommLoop) -> None:
        self.loop = loop

    def __enter__(self) -> None:
        with self._lock:
            self.loop.waiters += 1
        if self.loop.lane is not None:  # the comm thread may be in compiled passes
            self.loop.lane.kick()

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self.loop.waiters -= 1
        if self.loop.table:  # ops nobody waits for go on at once, on the comm thread
            self.loop.wake.set()

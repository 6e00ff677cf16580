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

This module holds :class:`CommLoop`'s construction (all its state), the client side
(submitting, urgency, aborts, waking), one pass (:meth:`~CommLoop.run_once`) and
activation (an op entering the table, starting, completing).  Its other jobs are its
bases, one module each: ``driving.py`` (:class:`~.driving.DriveHooks`: the comm thread's
run, a pass under the lock, a waiting thread's progress), ``receiving.py``
(:class:`~.receiving.ReceiveHooks`: messages in, a handler per frame type, floating
frames, body receives), ``sending.py`` (:class:`~.sending.SendHooks`: the send heaps,
outgoing messages and credit, the receiver's answers), ``reducing.py``
(:class:`~.reducing.ReduceHooks`: reductions and local steps), ``failing.py``
(:class:`~.failing.FailHooks`: ops failing, errors to and from peers, aborts),
``peers.py`` (:class:`~.peers.PeerHooks`: peers failing, leaving, dying, coming back),
``stalls.py`` (:class:`~.stalls.StallHooks`: the stall inspector), ``lane_loop.py``
(:class:`~.lane_loop.LaneHooks`: the compiled lane's side) and ``lane_failing.py``
(:class:`~.lane_failing.LaneFailHooks`: lane ops failing).  Each base declares what it
uses of the others as class annotations; none imports this module.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ..algorithms.schedule import Buffer, LocalOp
from ..config import Config
from ..errors import OpFailedError, TotalReduceError
from ..transport.base import Transport
from . import wire
from .compute import ComputeKind, ComputeList, ComputeRequest
from .driving import DriveHooks
from .failing import FailHooks
from .failures import _error_from_peer
from .floating import BufferPool, FloatingList
from .lane_failing import LaneFailHooks
from .lane_loop import LaneHooks
from .link import Link
from .payload import REMEMBERED, OpKey, OpSpec, OpState, Payload
from .peers import PeerHooks
from .receiving import ReceiveHooks
from .reducing import ReduceHooks
from .sending import _NO_SHAPE as _NO_SHAPE  # tests import it from here
from .sending import _RECV, SendHooks
from .stalls import StallHooks
from .wire import FRAME_SIZE, MSG_SIZE, READY
from .wire import NEED as NEED  # tests import it from here

if TYPE_CHECKING:
    from .lane import Lane  # the lane imports the MPI binding: only when a service makes one

log = logging.getLogger("totalreduce.engine")


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
    #: Ops the submitting thread entered into the lane itself (``lane_express``).
    lane_express: int = 0
    #: Ops the main loop's interpreted data path ran (entered its table): what is left of
    #: the second engine, counted so that tests can assert an op's route.
    main_ops: int = 0
    #: Control frames (ERROR to JOIN) the lane handed up, by frame type.
    lane_control: dict[int, int] = field(default_factory=dict)

    @property
    def frames_per_message(self) -> float:
        return self.frames_sent / self.messages_sent if self.messages_sent else 0.0


class CommLoop(
    DriveHooks,
    LaneHooks,
    LaneFailHooks,
    FailHooks,
    PeerHooks,
    StallHooks,
    ReceiveHooks,
    SendHooks,
    ReduceHooks,
):
    """Executes payloads' segment plans over a transport (see the module docstring)."""

    def __init__(
        self,
        transport: Transport,
        config: Config | None = None,
        execute: Callable[[ComputeRequest], None] | None = None,
        run: Callable[..., None] | None = None,
    ) -> None:
        self.t = transport
        #: The compiled lane for the allreduces it runs (``attach_lane``), or None.
        self.lane: Lane | None = None
        #: The lane's outer words (:meth:`watch_outer`), for a lane attached later.
        self._outer: tuple[int, int, int, int, int] | None = None
        # Small reductions run right here (through the kernels the service hands
        # in), sparing two thread hand-offs; big ones go to the reducer thread.
        self._execute = execute
        self._run = run
        self._inline: deque[tuple[Payload, int, np.ndarray, bool]] = deque()
        self._draining = False
        self.rank = transport.rank
        self.size = transport.size
        self.world = transport.size  # the ranks the loop may talk to
        self.cfg = cfg = config or Config()
        # Ops, aborts and urgency notes in one queue, so they are seen in order.
        self.submissions: deque[Any] = deque()
        self.compute = ComputeList()
        self.wake = threading.Event()
        self.lock = threading.Lock()
        self.waiters = 0
        self._owner = 0  # ident of the thread running a pass
        self._comm_ident = 0  # the comm thread's ident (set when it starts running)
        # A thread that submits a repeat (lane_express) while the comm thread holds the
        # lock asks for it: the comm thread hands the lock over at its next check.
        self._wanted = False
        self._asleep = False  # the comm thread is (about to be) blocked on ``wake``
        self._sleep_s = 0.0  # for how long (at most)
        self._nudged = False  # woken by _nudge (an op entered the lane in a long sleep)
        self._wait_spin = cfg.wait_spin_s  # a waiter spins (MPI_Wait-like) this long
        self._wait_spin_ns = int(self._wait_spin * 1e9)
        self.pool = BufferPool()
        self.floating = FloatingList(cfg.floating_pool_bytes, self.world)
        self.table: dict[OpKey, Payload] = {}
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
        self._seq = 0
        # Sending.
        self._heap: list[tuple[int, int, int, int, int, Payload]] = []
        self._cleared: list[tuple[int, int, int, int, Payload, int, int]] = []
        self._bodies_inflight = 0
        # Per peer: the outgoing messages, the credits both ways, the body tags (link.py);
        # the peers with something to flush.
        self._msg_cap = max(64 << 10, 2 * (FRAME_SIZE + cfg.micro_bytes) + MSG_SIZE)
        self._ctl_window = 4 * self._msg_cap
        self._links = [
            Link(self._msg_cap, self._ctl_window, self.floating.eager_share)
            for _ in range(self.world)
        ]
        self._dirty: set[int] = set()
        self._tag_span = int(getattr(transport, "tag_span", wire.BODY_TAG_SPAN))
        self._left: set[int] = set()  # peers that said goodbye (a subset of bad_peers)
        #: A node's service: what another service tells of its clients (engine/peers.py).
        self.on_client_notice: Callable[[str, int, int, int], None] | None = None
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
        self._ctl_backlog: list[tuple[Any, ...]] = []
        self._ctl_dirty = False
        self._last_stall_check = time.monotonic()
        stall = [x for x in (cfg.stall_warning_s, cfg.stall_shutdown_s) if x > 0]
        self._stall_every = min([1.0] + [x / 4 for x in stall])

    # ------------------------------------------------------------------ client side

    def attach_lane(self, lane: Lane) -> None:
        """Run the ops the compiled lane can run there (before any op is submitted).

        ``floating_pool_bytes`` bounds what peers make this rank hold for ops it has not
        submitted, both engines together: the lane has its ``pool_bytes`` of it, the main
        loop the rest (its eager credit shrinks to match, the same on every rank)."""
        self.floating = FloatingList(max(0, self.cfg.floating_pool_bytes - lane.pool_bytes),
                                     self.world)  # fmt: skip
        for link in self._links:
            link.eager_share = self.floating.eager_share
            link.reset()
        lane.naps(self.cfg.nap_s)
        lane.need_after(self.cfg.need_after_s)
        if self._outer is not None:
            lane.watch_outer(*self._outer)
        self.lane = lane

    @property
    def floating_bytes(self) -> int:
        """Bytes held now for ops not submitted here, by both engines."""
        return self.floating.held + (0 if self.lane is None else self.lane.floating_bytes)

    @property
    def floating_peak_bytes(self) -> int:
        """The most bytes each engine held at once for ops not submitted here, summed (at
        least the most both held at once)."""
        lane = 0 if self.lane is None else self.lane.floating_peak_bytes
        return self.floating.peak + lane

    def watch_outer(self, at: int, stride: int, n: int, seen: int, flag: int) -> None:
        """The lane's outer words (``Lane.watch_outer``), for its waiters that ask
        (``progress(outer=True)``); kept for a lane attached later."""
        self._outer = (at, stride, n, seen, flag)
        if self.lane is not None:
            self.lane.watch_outer(at, stride, n, seen, flag)

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
            self._nudge()
            return
        if self.lane is not None:  # it may be in compiled passes, holding the lock
            self.lane.kick()
        if self._asleep:  # wake the comm thread only if it sleeps (a futex call saved)
            self._ring()

    def mark_needed(self, spec: OpSpec) -> None:
        """Someone waits for this op (any thread): raise it here, ask the peers to
        (:meth:`progress` does it for the op it waits on)."""
        if not spec.urgent:
            spec.urgent = True
            lane = self.lane
            lop = None if lane is None else lane.by_key.get(spec.key)
            if lane is not None and lop is not None:  # a word in the lane's table: no pass
                lane.set_urgent(lop)
                return
            self.submissions.append(("need", spec.key))

    def request_abort(self, key: OpKey, name: str, reason: str, mismatch: bool = False) -> None:
        """Fail an op here and on every rank, submitted or not (any thread); with
        ``OpMismatchError`` if ``mismatch``, else ``OpFailedError``."""
        self.submissions.append(("abort", key, name, reason, mismatch))
        self._ring()

    def forget_op(self, key: OpKey) -> None:
        """Drop what this rank remembers of an ended op, whose key will come again (any
        thread): its frames are then kept for the next op of that key."""
        self.submissions.append(("forget", key))
        self._ring()

    def notify(self) -> None:
        self._ring()

    def _ring(self) -> None:
        """Wake the comm thread."""
        if self.lane is not None:
            self.lane.kick()
        self.wake.set()

    @property
    def busy(self) -> bool:
        return bool(
            len(self.table) > self._passive
            or (self.lane is not None and self.lane.inflight > 0)
            or self.submissions
            or len(self.compute)
            or self.compute.done
        )

    def link(self, peer: int) -> Link:
        """This rank's messaging state with world rank ``peer`` (outbox, credits, tags)."""
        return self._links[peer]

    @property
    def sending(self) -> bool:
        """Messages queued for a peer and not handed to the transport yet."""
        return bool(self._dirty or self._ctl_backlog)

    @property
    def sends_in_flight(self) -> bool:
        """Sends handed to the transport that have not completed: their buffers must live
        (and the transport stay open) until they have, or a peer gets freed memory."""
        if self.lane is not None and self.lane.sends_busy:
            return True
        return any(what != _RECV for what, _ in self._owners)

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
        now = time.monotonic()
        if now - self._last_stall_check > self._stall_every:
            self._last_stall_check = now
            if self.table or (self.lane is not None and self.lane.ops):
                self._check_peers()
            self._check_stalls(now)
        if self._ctl_dirty:
            self._ctl_flush()
        return progressed

    def _take_submissions(self) -> bool:
        while self.submissions:
            item = self.submissions.popleft()
            if isinstance(item, tuple):
                if item[0] == "abort":
                    self._abort(item[1], item[2], item[3], item[4])
                elif item[0] == "forget":  # the key comes again (a node's session op)
                    self.completed.pop(item[1], None)
                    self.failed.pop(item[1], None)
                    if self.lane is not None:
                        self.lane.forget(item[1])
                elif item[0] == "notice":  # a node's service tells the others
                    self._announce(*item[1:])
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
        if bad:
            self._fail_unsubmitted(spec, type(bad[0])(f"{spec.describe()}: {bad[0]}"))
            return
        if self.lane is not None and self._lane_activate(spec):
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
        self.stats.main_ops += 1
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
        for peer in self._left.intersection(spec.group):
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
        done = ((p.spec.name, p.spec.generation), p.spec.group, p.spec.schedule.unexpected, cleared)
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
        if len(table) > REMEMBERED:
            table.popitem(last=False)

    @staticmethod
    def _finish_spec(spec: OpSpec, error: BaseException | None) -> None:
        if spec.on_done is not None:
            try:
                spec.on_done(error)
            except Exception:  # a user callback must not kill the loop
                log.exception("completion callback of %s failed", spec.describe())

"""The engine's loop: the control plane around the compiled lane, which runs every op.

Every op runs its schedule in the compiled lane (:mod:`.lane`: one Numba pass over the
transport's compiled binding, its credits, rendezvous, floating frames and flow control
in compiled code).  Python keeps the control plane: names, first occurrences and
schedules compiled once per shape, submissions (``submit``: an op enters the lane at
once when no pass is running), chains (``OpSpec.after``), errors and mismatch texts,
the control frames (ERROR, PROBE/HAVE, BYE, GONE/JOIN: ``control.py``), stalls,
membership, the timeline, and the events the lane hands up.

Each pass of :meth:`CommLoop.run_once` takes the submissions (ops, aborts, urgency
notes), a compiled pass of the lane and its events and finished ops, the stall
inspector a few times per ``stall_warning_s``, and sends the control frames it wrote.
Progress: the comm thread drives the lane's compiled passes while ops are in flight; a
thread blocked in ``wait()`` drives them itself (:meth:`progress`), as ``MPI_Wait``
progresses MPI.  One thread runs the loop at a time (``lock``).

This module holds :class:`CommLoop`'s construction (all its state), the client side
(submitting, urgency, aborts, waking), one pass (:meth:`~CommLoop.run_once`) and
activation (an op entering the lane).  Its other jobs are its bases, one module each:
``driving.py`` (:class:`~.driving.DriveHooks`: the comm thread's run, a pass under the
lock, a waiting thread's progress), ``control.py`` (:class:`~.control.ControlHooks`:
control frames both ways), ``failing.py`` (:class:`~.failing.FailHooks`: errors to and
from peers, aborts), ``peers.py`` (:class:`~.peers.PeerHooks`: peers failing, leaving,
dying, coming back), ``lane_loop.py`` (:class:`~.lane_loop.LaneHooks`: the compiled lane's
side) and ``lane_failing.py`` (:class:`~.lane_failing.LaneFailHooks`: lane ops
failing).  Each base declares what it uses of the others as class annotations; none
imports this module.  The stall inspector is an object that owns its timers
(``stalls.py``: :class:`~.stalls.StallInspector`, ``self.stalls``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..config import Config
from ..errors import OpFailedError, TotalReduceError
from ..lane.payload import REMEMBERED, OpKey, OpSpec
from ..transport.base import Transport
from . import wire
from .control import ControlHooks
from .driving import DriveHooks
from .failing import FailHooks
from .lane_failing import LaneFailHooks
from .lane_loop import LaneHooks
from .peers import PeerHooks
from .stalls import StallInspector

if TYPE_CHECKING:
    from ..lane.lane import Lane  # the lane imports the MPI binding: only when a service makes one

log = logging.getLogger("totalreduce.engine")


@dataclass
class LoopStats:
    #: Control frames (ERROR to JOIN) this loop wrote and received (the lane counts the
    #: rest: ``Lane.stats``).
    frames_sent: int = 0
    frames_received: int = 0
    ops_completed: int = 0
    ops_failed: int = 0
    passes: int = 0
    idle_sleeps: int = 0
    #: The comm thread's compiled passes over lane ops without the interpreter lock.
    lane_spins: int = 0
    #: Ops the submitting thread entered into the lane itself (``lane_express``).
    lane_express: int = 0
    #: Control frames (ERROR to JOIN) the lane handed up, by frame type.
    lane_control: dict[int, int] = field(default_factory=dict)


class CommLoop(
    DriveHooks,
    LaneHooks,
    LaneFailHooks,
    ControlHooks,
    FailHooks,
    PeerHooks,
):
    """The control plane around the compiled lane (see the module docstring)."""

    def __init__(
        self,
        transport: Transport,
        config: Config | None = None,
    ) -> None:
        self.t = transport
        #: The compiled lane, which runs every op (``attach_lane``, before any op).
        self.lane: Lane | None = None
        #: The lane's outer words (:meth:`watch_outer`), for a lane attached later.
        self._outer: tuple[int, int, int, int, int] | None = None
        self.rank = transport.rank
        self.size = transport.size
        self.world = transport.size  # the ranks the loop may talk to
        self.cfg = cfg = config or Config()
        # Ops, aborts and urgency notes in one queue, so they are seen in order.
        self.submissions: deque[Any] = deque()
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
        # Bounded memories of finished ops: OrderedDict, because evicting the oldest
        # entry of a plain dict scans past every deleted slot (quadratic over a run).
        self.failed: OrderedDict[OpKey, str] = OrderedDict()
        # Ops finished here, remembered for a while ((name, generation), group,
        # unexpected-frame hints): a frame for one means a peer disagrees about the op;
        # an error for one is raised late.
        self.completed: OrderedDict[OpKey, tuple[Any, ...]] = OrderedDict()
        # Errors of ops not submitted here yet (failed elsewhere first).
        self._early_errors: OrderedDict[OpKey, tuple[str, int]] = OrderedDict()
        self.late_errors: deque[TotalReduceError] = deque()
        # Ops submitted to start after another op of this rank completes (OpSpec.after).
        self._held: dict[OpKey, list[OpSpec]] = {}
        self.stats = LoopStats()
        self.fatal: BaseException | None = None
        self.bad_peers: dict[int, TotalReduceError] = {}
        self.trace: Any = None  # a timeline recorder, when one is on
        self._left: set[int] = set()  # peers that said goodbye (a subset of bad_peers)
        #: A node's service: what another service tells of its clients (engine/peers.py).
        self.on_client_notice: Callable[[str, int, int, int], None] | None = None
        self._unreachable: set[int] = set()  # peers whose link failed: nothing goes to them
        # What each control frame type does (a handler per type), and the control frames
        # written and not sent yet.
        #: The stall inspector, which owns its timers (before the handlers: PROBE, HAVE).
        self.stalls = StallInspector(self)
        self._handlers = self._frame_handlers()
        self._ctl_backlog: list[tuple[Any, ...]] = []
        self._ctl_dirty = False

    # ------------------------------------------------------------------ client side

    def attach_lane(self, lane: Lane) -> None:
        """The compiled lane, which runs every op (before any op is submitted); it holds
        what peers send for ops not submitted here within ``floating_pool_bytes``."""
        lane.naps(self.cfg.nap_s)
        lane.need_after(self.cfg.need_after_s)
        if self._outer is not None:
            lane.watch_outer(*self._outer)
        self.lane = lane

    @property
    def floating_bytes(self) -> int:
        """Bytes held now for ops not submitted here."""
        return 0 if self.lane is None else self.lane.floating_bytes

    @property
    def floating_peak_bytes(self) -> int:
        """The most bytes held at once for ops not submitted here."""
        return 0 if self.lane is None else self.lane.floating_peak_bytes

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
        return bool((self.lane is not None and self.lane.inflight > 0) or self.submissions)

    @property
    def sending(self) -> bool:
        """Control frames written and not handed to the lane's send buffers yet."""
        return bool(self._ctl_backlog)

    @property
    def sends_in_flight(self) -> bool:
        """Sends handed to the transport that have not completed: their buffers must live
        (and the transport stay open) until they have, or a peer gets freed memory."""
        return self.lane is not None and bool(self.lane.sends_busy)

    # ------------------------------------------------------------------ one pass

    def run_once(self) -> bool:
        """One pass (caller holds ``lock``); True when anything progressed."""
        self.stats.passes += 1
        progressed = False
        if self.submissions:
            progressed = self._take_submissions()
        if self.lane is not None and self._lane_pump():
            progressed = True
        now = time.monotonic()
        stalls = self.stalls
        if now - stalls.last > stalls.every:
            stalls.last = now
            if self.lane is not None and self.lane.ops:
                self._check_peers()
            stalls.check(now)
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
                    self._early_errors.pop(item[1], None)
                    if self.lane is not None:
                        self.lane.forget(item[1])
                elif item[0] == "notice":  # a node's service tells the others
                    self._announce(*item[1:])
                elif item[0] == "need":
                    if self.lane is not None and item[1] in self.lane.by_key:
                        self.lane.set_urgent(self.lane.by_key[item[1]])
                continue
            try:
                self._activate(item)
            except Exception as exc:  # one bad op must not stop the loop
                log.exception("rank %d: activating %s failed", self.rank, item.describe())
                err = OpFailedError(
                    f"{item.describe()}: rank {self.rank} could not start it: {exc}"
                )
                lop = None if self.lane is None else self.lane.by_key.get(item.key)
                if lop is not None and lop.spec is item:
                    self._lane_fail(lop, err, tell_peers=True)
                else:
                    self._fail_unsubmitted(item, err)
        return True

    # ------------------------------------------------------------------ activation

    def _activate(self, spec: OpSpec) -> None:
        if self.fatal is not None:
            self._finish_spec(spec, TotalReduceError(f"the comm loop stopped: {self.fatal}"))
            return
        lane = self.lane
        if lane is None:
            self._finish_spec(
                spec, TotalReduceError(f"{spec.describe()}: the engine has no compiled lane")
            )
            return
        if spec.after is not None:
            first = spec.after
            if first in lane.by_key:
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
        self._lane_activate(spec)

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

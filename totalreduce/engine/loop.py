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
thread blocked in ``wait()`` drives them itself (``driving.progress``), as ``MPI_Wait``
progresses MPI.  One thread runs the loop at a time (``lock``).

This module holds :class:`CommLoop`: the state every part shares (the lane, the lock,
the submissions, the stats), the client side (submitting, urgency, aborts, waking) and one
pass (:meth:`~CommLoop.run_once`).  Each other job is an object the loop owns, which owns
its state, one module each; they call each other through the interfaces of ``parts.py``:
``loop.driving`` (``driving.py``, :class:`~.driving.Driver`: the comm thread's run, a pass
under the lock, a waiting thread's progress), ``loop.ops`` (``lane_loop.py``,
:class:`~.lane_loop.LaneOps`: ops into the lane and out of it, chains), ``loop.lane_errors``
(``lane_failing.py``, :class:`~.lane_failing.LaneErrors`: the lane's events into errors,
lane ops failing), ``loop.failures`` (``failing.py``, :class:`~.failing.Failures`: the one
table of errors, errors to and from peers, aborts, late errors), ``loop.peers``
(``peers.py``, :class:`~.peers.Peers`: membership), ``loop.control`` (``control.py``,
:class:`~.control.ControlFrames`: control frames both ways) and ``loop.stalls``
(``stalls.py``, :class:`~.stalls.StallInspector`: ops that stopped moving).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..config import Config
from ..errors import OpFailedError, TotalReduceError
from ..lane.payload import NO_SHAPE, OpKey, OpSpec
from ..protocol import PROBE
from ..transport.base import Transport
from .control import ControlFrames
from .driving import Driver
from .failing import Failures
from .lane_failing import LaneErrors
from .lane_loop import LaneOps
from .parts import LoopStats
from .peers import Peers
from .stalls import StallInspector

if TYPE_CHECKING:
    from ..lane.lane import Lane  # the lane imports the MPI binding: only when a service makes one

log = logging.getLogger("totalreduce.engine")

__all__ = ["CommLoop", "LoopStats"]


class CommLoop:
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
        self.cfg = config or Config()
        # Ops, aborts and urgency notes in one queue, so they are seen in order.
        self.submissions: deque[Any] = deque()
        self.wake = threading.Event()
        #: One thread runs the loop at a time (``driving.owner`` says which).
        self.lock = threading.Lock()
        self.stats = LoopStats()
        #: The error that stopped the loop (:meth:`stopped_by`): every op fails with it.
        self.fatal: BaseException | None = None
        self.trace: Any = None  # a timeline recorder, when one is on
        # The parts, each owning its state (parts.py); the control frames' handlers are
        # the others', so they come last.
        self.driving = Driver(self)
        self.ops = LaneOps(self)
        self.lane_errors = LaneErrors(self)
        self.failures = Failures(self)
        self.peers = Peers(self)
        self.stalls = StallInspector(self)
        self.control = ControlFrames(self)

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
        driving = self.driving
        if self.lane is not None and self.lock.acquire(blocking=False):
            driving.owner = threading.get_ident()
            try:
                self._take_submissions()
            finally:
                driving.owner = 0
                self.lock.release()
            driving.nudge()
            return
        if self.lane is not None:  # it may be in compiled passes, holding the lock
            self.lane.kick()
        if driving.asleep:  # wake the comm thread only if it sleeps (a futex call saved)
            self.ring()

    def mark_needed(self, spec: OpSpec) -> None:
        """Someone waits for this op (any thread): raise it here, ask the peers to
        (``driving.progress`` does it for the op it waits on)."""
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
        self.ring()

    def send_probe(self, dest: int, key: OpKey, body: bytes) -> None:
        """Send rank ``dest`` a PROBE of op ``key`` with the owner's note ``body`` (any
        thread; ``stalls.watch``'s owner answers a stray probe this way)."""
        self.submissions.append(("probe", dest, key, body))
        self.ring()

    def forget_op(self, key: OpKey) -> None:
        """Drop what this rank remembers of an ended op, whose key will come again (any
        thread): its frames are then kept for the next op of that key."""
        self.submissions.append(("forget", key))
        self.ring()

    def tell_services(self, what: str, client: int, session: int = 0, agreed: int = 0) -> None:
        """A node's service tells the other services of its clients (any thread):
        :meth:`.peers.Peers.tell_services`."""
        self.peers.tell_services(what, client, session, agreed)

    @property
    def on_client_notice(self) -> Callable[[str, int, int, int], None] | None:
        """What another node's service told of its clients (``peers.on_client_notice``)."""
        return self.peers.on_client_notice

    @on_client_notice.setter
    def on_client_notice(self, hook: Callable[[str, int, int, int], None] | None) -> None:
        self.peers.on_client_notice = hook

    @property
    def late_errors(self) -> deque[TotalReduceError]:
        """Errors of ops that completed here but failed elsewhere, to raise at this rank's
        next call (``failures.late``)."""
        return self.failures.late

    def notify(self) -> None:
        self.ring()

    def ring(self) -> None:
        """Wake the comm thread."""
        if self.lane is not None:
            self.lane.kick()
        self.wake.set()

    def stopped_by(self, exc: Exception) -> None:
        """The loop met an error of its own (a bug, not an op's): fail every op, once, so
        nothing waits forever on a loop that stopped."""
        if self.fatal is None:
            log.exception("rank %d: comm loop stopped by an error", self.rank)
            self.fatal = exc
            self.failures.fail_everything(
                TotalReduceError(f"rank {self.rank}: the comm loop failed: {exc}")
            )

    @property
    def busy(self) -> bool:
        return bool((self.lane is not None and self.lane.inflight > 0) or self.submissions)

    @property
    def sending(self) -> bool:
        """Control frames written and not handed to the lane's send buffers yet."""
        return self.control.waiting

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
        if self.lane is not None and self.ops.pump():
            progressed = True
        now = time.monotonic()
        stalls = self.stalls
        if now - stalls.last > stalls.every:
            stalls.last = now
            if self.lane is not None and self.lane.ops:
                self.peers.check_alive()
            stalls.check(now)
        if self.control.dirty:
            self.control.flush()
        return progressed

    def _take_submissions(self) -> bool:
        while self.submissions:
            item = self.submissions.popleft()
            if isinstance(item, tuple):
                if item[0] == "abort":
                    self.failures.abort(item[1], item[2], item[3], item[4])
                elif item[0] == "forget":  # the key comes again (a node's session op)
                    self.failures.forget(item[1])
                    if self.lane is not None:
                        self.lane.forget(item[1])
                elif item[0] == "notice":  # a node's service tells the others
                    self.peers.announce(*item[1:])
                elif item[0] == "probe":  # an owner's note for a peer (stalls.watch)
                    if self.lane is not None:
                        self.control.send(item[1], PROBE, NO_SHAPE, item[2], body=item[3])
                elif item[0] == "need":
                    if self.lane is not None and item[1] in self.lane.by_key:
                        self.lane.set_urgent(self.lane.by_key[item[1]])
                continue
            try:
                self.ops.activate(item)
            except Exception as exc:  # one bad op must not stop the loop
                log.exception("rank %d: activating %s failed", self.rank, item.describe())
                err = OpFailedError(
                    f"{item.describe()}: rank {self.rank} could not start it: {exc}"
                )
                lop = None if self.lane is None else self.lane.by_key.get(item.key)
                if lop is not None and lop.spec is item:
                    self.lane_errors.fail(lop, err, tell_peers=True)
                else:
                    self.failures.fail_unsubmitted(item, err)
        return True

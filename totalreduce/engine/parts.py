"""The control plane's parts as each sees the others: one narrow interface per object.

:class:`~.loop.CommLoop` owns one object per job, each owning its state (``engine/``):

- ``loop.driving`` (:class:`~.driving.Driver`): the comm thread's run, passes, waiting threads;
- ``loop.ops`` (:class:`~.lane_loop.LaneOps`): ops into the lane and out of it, chains;
- ``loop.lane_errors`` (:class:`~.lane_failing.LaneErrors`): the lane's events into errors,
  lane ops failing;
- ``loop.failures`` (:class:`~.failing.Failures`): the one table of errors, errors to and
  from peers, aborts, late errors;
- ``loop.peers`` (:class:`~.peers.Peers`): membership: peers bad, gone, leaving;
- ``loop.control`` (:class:`~.control.ControlFrames`): control frames out, and in to a
  handler;
- ``loop.stalls`` (:class:`~.stalls.StallInspector`): ops that stopped moving.

Each part's module imports this one and never another part's, so the parts form no import
cycle; they call each other through the loop (``loop.failures.on_error(...)``) and only
through what is declared here.  mypy checks that the loop and each part fit these
interfaces where the loop builds them (``CommLoop.__init__``).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ..errors import OpFailedError, TotalReduceError
from ..lane.payload import OpKey, OpSpec
from ..transport.base import Transport
from .failures import OpErrors

if TYPE_CHECKING:
    from ..config import Config
    from ..lane.lane import Lane, LaneOp
    from .ended import EndedOps

#: A control frame's handler: ``handler(source, frame, bytes, offset of its body)``.
Handler = Callable[[int, tuple[int, ...], np.ndarray, int], None]


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
    #: Ops the submitting thread entered into the lane itself (``LaneOps.express``).
    lane_express: int = 0
    #: Control frames (ERROR to JOIN) the lane handed up, by frame type.
    lane_control: dict[int, int] = field(default_factory=dict)


class DriverPart(Protocol):
    """``loop.driving`` (:class:`~.driving.Driver`), as the other parts use it."""

    #: Ident of the thread running a pass (set by whoever holds ``loop.lock``; 0: none).
    owner: int
    #: The comm thread is (about to be) asleep on ``loop.wake``.
    asleep: bool
    #: How long a waiter spins in compiled passes before it sleeps, in ns.
    wait_spin_ns: int

    def express_lock(self, lane: Lane) -> bool: ...

    def nudge(self) -> None: ...

    def main_has_work(self) -> bool: ...


class OpsPart(Protocol):
    """``loop.ops`` (:class:`~.lane_loop.LaneOps`), as the other parts use it."""

    def activate(self, spec: OpSpec) -> None: ...

    def chained_after(self, key: OpKey) -> Iterable[OpSpec]: ...

    def has_chains(self) -> bool: ...

    def pump(self) -> bool: ...

    def drain(self) -> None: ...

    def settle(self) -> None: ...

    def ok(self, lop: LaneOp) -> None: ...


class LaneErrorsPart(Protocol):
    """``loop.lane_errors`` (:class:`~.lane_failing.LaneErrors`), as the other parts use it."""

    def fail(
        self, lop: LaneOp, error: BaseException, *, tell_peers: bool, also: int = -1
    ) -> None: ...

    def fail_with(
        self, peer: int, make: Callable[[OpSpec], BaseException], *, only_needed: bool = False
    ) -> None: ...

    def fail_all(self, error: BaseException) -> None: ...

    def on_event(self, kind: int, slot: int, source: int, a: int, b: int, raw: bytes) -> None: ...


class FailuresPart(Protocol):
    """``loop.failures`` (:class:`~.failing.Failures`), as the other parts use it."""

    @property
    def errors(self) -> OpErrors: ...

    @property
    def completed(self) -> EndedOps: ...

    @property
    def late(self) -> deque[TotalReduceError]: ...

    def done(self, wid: int, gen: int, row: int) -> None: ...

    def fail_unsubmitted(self, spec: OpSpec, error: TotalReduceError) -> None: ...

    def chain_error(self, spec: OpSpec, why: str) -> OpFailedError: ...

    def tell_group(
        self, key: OpKey, group: tuple[int, ...], also: int, error: BaseException
    ) -> None: ...

    def named(self, message: str, key: OpKey, name: str | int) -> str: ...

    def on_error_frame(
        self, source: int, f: tuple[int, ...], buf: np.ndarray, off: int
    ) -> None: ...

    def late_frame(self, source: int, f: tuple[int, ...], key: OpKey) -> bool: ...

    def abort(self, key: OpKey, name: str, reason: str, mismatch: bool = False) -> None: ...

    def fail_everything(self, error: BaseException) -> None: ...

    def forget(self, key: OpKey) -> None: ...


class PeersPart(Protocol):
    """``loop.peers`` (:class:`~.peers.Peers`), as the other parts use it."""

    @property
    def bad(self) -> dict[int, TotalReduceError]: ...

    @property
    def left(self) -> set[int]: ...

    def who(self, rank: int) -> str: ...

    def refused(self, source: int) -> bool: ...

    def shut_out(self, dest: int) -> bool: ...

    def blocking(self, group: tuple[int, ...]) -> TotalReduceError | None: ...

    def mark_bad(self, peer: int, err: TotalReduceError, *, reachable: bool = True) -> None: ...

    def check_alive(self) -> None: ...

    def announce(self, ftype: int, client: int, key: OpKey = (0, 0), step: int = 0) -> None: ...

    def on_bye(self, source: int, f: tuple[int, ...], buf: np.ndarray, off: int) -> None: ...

    def on_gone(self, source: int, f: tuple[int, ...], buf: np.ndarray, off: int) -> None: ...

    def on_join(self, source: int, f: tuple[int, ...], buf: np.ndarray, off: int) -> None: ...


class ControlPart(Protocol):
    """``loop.control`` (:class:`~.control.ControlFrames`), as the other parts use it."""

    #: Control frames were written in this pass: ``flush`` sends them.
    dirty: bool
    #: Control frames wait for a free send buffer.
    waiting: bool

    def send(
        self,
        dest: int,
        ftype: int,
        shape: tuple[int, ...],
        key: OpKey,
        *,
        aux: int = 0,
        step: int = 0,
        segment: int = 0,
        body: bytes = b"",
    ) -> None: ...

    def flush(self) -> None: ...

    def on_event(self, source: int, raw: bytes) -> None: ...


class StallsPart(Protocol):
    """``loop.stalls`` (:class:`~.stalls.StallInspector`), as the other parts use it."""

    every: float
    last: float

    def check(self, now: float) -> None: ...

    def on_probe(self, source: int, f: tuple[int, ...], buf: np.ndarray, off: int) -> None: ...

    def on_have(self, source: int, f: tuple[int, ...], buf: np.ndarray, off: int) -> None: ...


class Loop(Protocol):
    """The loop (:class:`~.loop.CommLoop`) as its parts see it: its shared state, its parts."""

    rank: int
    world: int
    cfg: Config
    t: Transport
    lane: Lane | None
    lock: threading.Lock
    wake: threading.Event
    #: Ops, aborts and urgency notes, in order (``CommLoop.submit`` and the rest).
    submissions: deque[Any]
    stats: LoopStats
    trace: Any
    fatal: BaseException | None

    @property
    def driving(self) -> DriverPart: ...

    @property
    def ops(self) -> OpsPart: ...

    @property
    def lane_errors(self) -> LaneErrorsPart: ...

    @property
    def failures(self) -> FailuresPart: ...

    @property
    def peers(self) -> PeersPart: ...

    @property
    def control(self) -> ControlPart: ...

    @property
    def stalls(self) -> StallsPart: ...

    @property
    def busy(self) -> bool: ...

    def ring(self) -> None: ...

    def stopped_by(self, exc: Exception) -> None: ...

    def mark_needed(self, spec: OpSpec) -> None: ...

    def run_once(self) -> bool: ...


__all__ = [
    "ControlPart",
    "DriverPart",
    "FailuresPart",
    "Handler",
    "LaneErrorsPart",
    "Loop",
    "LoopStats",
    "OpsPart",
    "PeersPart",
    "StallsPart",
]

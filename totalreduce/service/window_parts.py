"""A window's parts: its state on one rank, its messages' format, and the handles of its
transfers (used by :mod:`.windows`, which says how windows work).

A message on a window's channel is a :data:`HEADER` (kind, the piece's index, ``p``)
and, on a data channel, the window's bytes (or, in daemon mode for a window larger
than :data:`THIN_MESSAGE_BYTES`, one piece of them: :class:`_Pieces` sends a message
as pieces, and :class:`_Gathering` is what the receiver has of one so far).
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..dtypes import DType
from ..errors import InvalidArgumentError, OpFailedError, OpTimeoutError

PUT, ACCUMULATE, REPLY, FREE, GET = 1, 2, 3, 4, 5
HEADER = 16  # int32 kind, int32 piece index (0 unless pieced), float64 p (or a GET's weight)
#: Daemon mode: the largest message on a window's channel.  A standing receive's buffer
#: lies in the client's part of the node's arena for as long as the window lives, so it
#: is never larger than this; a window whose data messages would be (16 bytes of header
#: and the window) sends each as pieces of this size (see :class:`_Pieces`).
THIN_MESSAGE_BYTES = 64 << 10
#: The window's bytes one piece carries.
PIECE_BYTES = THIN_MESSAGE_BYTES - HEADER
#: Pieces of one message a rank has in flight at a time.
PIECES_IN_FLIGHT = 4
CH_DATA, CH_ASK = 0, 1  # the channels: data (into a slot) and get requests
_KINDS = {CH_DATA: (PUT, ACCUMULATE, REPLY, FREE), CH_ASK: (GET, FREE)}
_FLOATS = (DType.FLOAT16, DType.BFLOAT16, DType.FLOAT32, DType.FLOAT64)


_EMPTY = np.empty(0, np.uint8)


def _channel(window: str, src: int, dst: int, chan: int) -> str:
    return f"win {window} {src}->{dst}{' get' if chan == CH_ASK else ''}"


def _weight(value: Any, what: str) -> float:
    try:
        w = float(value)
    except (TypeError, ValueError):
        raise InvalidArgumentError(f"{what} must be a number, got {value!r}") from None
    if not math.isfinite(w):
        raise InvalidArgumentError(f"{what} must be finite, got {w}")
    return w


@dataclass
class _Get:
    """One rank's reply awaited by a ``get``."""

    event: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


@dataclass
class _Gathering:
    """A pieced message arriving from one in-neighbour: what its pieces said so far."""

    kind: int  # every piece carries the message's kind and p; the last one's p is used
    body: np.ndarray  # the window's bytes
    next: int = 0  # the piece expected


@dataclass
class Window:
    """One window on this rank: its array, the slots of its in-neighbours and their state."""

    name: str
    dtype: DType
    shape: tuple[int, ...]
    mine: np.ndarray  # the registered array, flat (a view: updates land in the caller's)
    in_ranks: tuple[int, ...]
    out_ranks: tuple[int, ...]
    slots: dict[int, np.ndarray]
    weights: tuple[float, dict[int, float]]  # the topology's (self, in-neighbours)
    p: float = 1.0
    slot_p: dict[int, float] = field(default_factory=dict)
    versions: dict[int, int] = field(default_factory=dict)
    lock: threading.RLock = field(default_factory=threading.RLock)
    changed: threading.Condition = field(init=False)
    error: BaseException | None = None
    gets: dict[int, list[_Get]] = field(default_factory=dict)
    closed: dict[int, set[int]] = field(default_factory=lambda: {CH_DATA: set(), CH_ASK: set()})
    sends: list[Any] = field(default_factory=list)  # handles of replies in flight
    freeing: bool = False
    pending: list[Any] = field(default_factory=list)  # arrivals not applied yet, in order
    held: int = 0  # win_mutex blocks holding it
    pieced: bool = False  # data messages travel as pieces (daemon mode, a large window)
    gathering: dict[int, _Gathering] = field(default_factory=dict)  # by in-neighbour
    bodies: dict[int, np.ndarray] = field(default_factory=dict)  # their memory, kept

    def __post_init__(self) -> None:
        self.changed = threading.Condition(self.lock)

    @property
    def nbytes(self) -> int:
        return int(self.mine.nbytes)

    @property
    def message_bytes(self) -> int:
        """The size of every message on one of its data channels."""
        return THIN_MESSAGE_BYTES if self.pieced else HEADER + self.nbytes

    def check_open(self, what: str) -> None:
        if self.freeing:
            raise InvalidArgumentError(f"{what}: window {self.name!r} is being freed")
        if self.error is not None:
            raise OpFailedError(f"{what}: window {self.name!r} failed: {self.error}")


class WinHandle:
    """A window transfer in flight: ``done()`` polls, ``wait()`` blocks and returns True."""

    def __init__(self, what: str, handles: list[Any], gets: list[_Get]) -> None:
        self.name = what
        self._handles = handles
        self._gets = gets

    def done(self) -> bool:
        """True once every message of the transfer went (and every reply of a get came)."""
        return all(h.done() for h in self._handles) and all(g.event.is_set() for g in self._gets)

    def exception(self) -> BaseException | None:
        """The transfer's error once done, else None."""
        for h in self._handles:
            if h.done() and h.exception() is not None:
                return h.exception()  # type: ignore[no-any-return]
        for g in self._gets:
            if g.error is not None:
                return g.error
        return None

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the transfer is done (``OpTimeoutError`` after ``timeout`` s)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for h in self._handles:
            h.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        for g in self._gets:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not g.event.wait(left):
                raise OpTimeoutError(f"{self.name} did not complete within {timeout} s")
            if g.error is not None:
                raise g.error
        return True

    def __repr__(self) -> str:
        return f"<WinHandle {self.name} {'done' if self.done() else 'in flight'}>"


class _Pieces:
    """A pieced message: a handle (``done``, ``exception``, ``wait``) that the sender
    thread's :meth:`run` ends, once every piece went or one failed."""

    def __init__(self, what: str, send: Any, msgs: np.ndarray) -> None:
        self.name = what
        self._send = send
        self._msgs: np.ndarray | None = msgs
        self._error: BaseException | None = None
        self._ended = threading.Event()

    def run(self) -> None:
        flight: list[Any] = []
        try:
            assert self._msgs is not None
            for msg in self._msgs:
                if len(flight) >= PIECES_IN_FLIGHT:
                    flight.pop(0).wait()
                flight.append(self._send(msg))
            for h in flight:
                h.wait()
        except Exception as exc:
            self._error = exc
        finally:
            self._msgs = None
            self._ended.set()

    def done(self) -> bool:
        return self._ended.is_set()

    def exception(self) -> BaseException | None:
        return self._error if self._ended.is_set() else None

    def wait(self, timeout: float | None = None) -> bool:
        if not self._ended.wait(timeout):
            raise OpTimeoutError(f"{self.name} did not complete within {timeout} s")
        if self._error is not None:
            raise self._error
        return True

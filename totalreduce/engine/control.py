"""The control frames: ERROR, PROBE, HAVE, BYE, GONE and JOIN, in the lane's messages.

:class:`ControlHooks` is a base of :class:`~.loop.CommLoop`.  ``_control`` is the one
send point: the frame goes into the peer's outbox in the lane's send buffer (sent with
the next message to that peer; ``_ctl_flush`` at the end of a pass), or, when no send
buffer is free, waits in order in ``_ctl_backlog``.  The lane hands each control frame
it receives up as an ``EV_CONTROL`` event (``_on_control_event``), and the handler of
its type runs (``_frame_handlers``: ERROR in ``failing.py``, BYE, GONE and JOIN in
``peers.py``, PROBE and HAVE in ``stalls.py``).  A frame of an op finished here that a
peer still sends (the lane's ``EV_LATE``) is a disagreement about the op's pattern
(``_unknown_op``).
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import protocol as L
from ..lane.payload import OpKey, describe_op
from ..protocol import BYE, ERROR, F_SEGMENT, F_STEP, GONE, HAVE, JOIN, PROBE
from .failures import ERROR_MISMATCH

if TYPE_CHECKING:
    from ..lane.lane import Lane
    from .stalls import StallInspector

_FRAME = struct.Struct(L.FRAME_FORMAT)

#: A control frame's handler: ``handler(source, frame, bytes, offset of its body)``.
Handler = Callable[[int, tuple[int, ...], np.ndarray, int], None]


class ControlHooks:
    """The control frames, both ways (see the module docstring)."""

    rank: int
    lane: Lane | None
    stats: Any
    bad_peers: dict[int, Any]
    failed: OrderedDict[OpKey, str]
    completed: OrderedDict[OpKey, tuple[Any, ...]]
    _left: set[int]
    _early_errors: OrderedDict[OpKey, tuple[str, int]]
    #: Control frames for the lane's outboxes that found no free send buffer (our own:
    #: each a frame Python chose to send), in order; ``_ctl_flush`` tries them again.
    _ctl_backlog: list[tuple[Any, ...]]
    _ctl_dirty: bool
    _handlers: dict[int, Handler]

    # provided by CommLoop's other bases
    _on_error_frame: Handler
    _on_bye: Handler
    _on_gone: Handler
    _on_join: Handler
    stalls: StallInspector
    _on_error: Callable[[OpKey, str, int, int], None]
    _error_frame: Callable[[OpKey, int, str, int], None]

    def _frame_handlers(self) -> dict[int, Handler]:
        """What each control frame type does."""
        return {
            ERROR: self._on_error_frame,
            BYE: self._on_bye,
            GONE: self._on_gone,
            JOIN: self._on_join,
            PROBE: self.stalls.on_probe,
            HAVE: self.stalls.on_have,
        }

    def _control(
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
    ) -> None:
        """Queue a control frame (ERROR to JOIN) for ``dest``: written into its outbox in
        the lane at once (sent with that peer's next message), or kept in order until a
        send buffer is free."""
        lane = self.lane
        if lane is None:
            raise AssertionError("a control frame before the lane was attached")
        if ftype not in L.CONTROL_FRAME_TYPES:
            raise ValueError(f"frame type {ftype} is not a control frame")
        frame = (dest, ftype, shape, key, aux, step, segment, body)
        if self._ctl_backlog or not lane.control(*frame):
            self._ctl_backlog.append(frame)
        self._ctl_dirty = True
        self.stats.frames_sent += 1

    def _ctl_flush(self) -> None:
        """Send the control frames Python wrote (caller holds the lock)."""
        lane = self.lane
        if lane is None:
            return
        self._ctl_dirty = False
        if self._ctl_backlog:
            lane.flush()  # frees send buffers the outboxes hold
            backlog = self._ctl_backlog
            k = 0
            while k < len(backlog) and lane.control(*backlog[k]):
                k += 1
            del backlog[:k]
        lane.flush()

    def _on_control_event(self, source: int, raw: bytes) -> None:
        """A control frame the lane handed up: its handler, as for any frame of its type."""
        if source in self.bad_peers and source not in self._left:
            return  # refused: the rest of what it sent is not trusted
        handler = self._handlers.get(raw[0])
        if handler is None:
            return
        self.stats.frames_received += 1
        counts = self.stats.lane_control
        counts[raw[0]] = counts.get(raw[0], 0) + 1
        f = _FRAME.unpack_from(raw, 0)
        handler(source, f, np.frombuffer(raw, dtype=np.uint8), L.FRAME_SIZE)

    def _unknown_op(self, source: int, f: tuple[int, ...], key: OpKey) -> bool:
        """A frame of an op not in the lane's table: True if it was dealt with (the op
        failed here, or finished here and the ranks disagree about its pattern)."""
        if key in self.failed or key in self._early_errors:
            return True
        done = self.completed.get(key)
        if done is None:
            return False
        (name, gen), _, hints = done[0], done[1], done[2]
        what = describe_op(name, gen)
        step = f[F_STEP]
        if step < len(hints):
            detail = hints[step].format(sender=source, me=self.rank)
        else:
            detail = (
                f"rank {source} sends to rank {self.rank} at step {step} (segment "
                f"{f[F_SEGMENT]}), but rank {self.rank} finished the op without that exchange "
                "(the ranks disagree on the op's pattern: root, topology, weights, group or "
                "algorithm)"
            )
        msg = f"{what}: {detail}"
        self._on_error(key, msg, ERROR_MISMATCH, source)
        self._error_frame(key, source, msg, ERROR_MISMATCH)
        return True

"""The control frames: ERROR, PROBE, HAVE, BYE, GONE and JOIN, in the lane's messages.

:class:`ControlFrames` is an object of :class:`~.loop.CommLoop`'s (``loop.control``) that
owns the control frames Python writes and the table of their handlers.
:meth:`~ControlFrames.send` is the one send point: the frame goes into the peer's outbox in
the lane's send buffer (sent with the next message to that peer; :meth:`~ControlFrames.flush`
at the end of a pass), or, when no send buffer is free, waits in order in a backlog
(``waiting`` says so).  The lane hands each control frame it receives up as an
``EV_CONTROL`` event (:meth:`~ControlFrames.on_event`), and the handler of its type runs:
ERROR ``loop.failures``' (``failing.py``), BYE, GONE and JOIN ``loop.peers``'
(``peers.py``), PROBE and HAVE ``loop.stalls``' (``stalls.py``).
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

from .. import protocol as L
from ..lane.payload import OpKey
from ..protocol import BYE, ERROR, GONE, HAVE, JOIN, PROBE
from .parts import Handler, Loop

_FRAME = struct.Struct(L.FRAME_FORMAT)


class ControlFrames:
    """The control frames, both ways (see the module docstring)."""

    def __init__(self, loop: Loop) -> None:
        self._loop = loop
        #: Control frames for the lane's outboxes that found no free send buffer (our own:
        #: each a frame Python chose to send), in order; :meth:`flush` tries them again.
        self._backlog: list[tuple[Any, ...]] = []
        #: Frames were written since the last :meth:`flush`.
        self.dirty = False
        #: Control frames written and not handed to the lane's send buffers yet (the
        #: backlog is not empty; a plain word, as the express paths look at it per op).
        self.waiting = False
        #: What each control frame type does.
        self._handlers: dict[int, Handler] = {
            ERROR: loop.failures.on_error_frame,
            BYE: loop.peers.on_bye,
            GONE: loop.peers.on_gone,
            JOIN: loop.peers.on_join,
            PROBE: loop.stalls.on_probe,
            HAVE: loop.stalls.on_have,
        }

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
    ) -> None:
        """Queue a control frame (ERROR to JOIN) for ``dest``: written into its outbox in
        the lane at once (sent with that peer's next message), or kept in order until a
        send buffer is free."""
        loop = self._loop
        lane = loop.lane
        if lane is None:
            raise AssertionError("a control frame before the lane was attached")
        if ftype not in L.CONTROL_FRAME_TYPES:
            raise ValueError(f"frame type {ftype} is not a control frame")
        frame = (dest, ftype, shape, key, aux, step, segment, body)
        if self._backlog or not lane.control(*frame):
            self._backlog.append(frame)
            self.waiting = True
        self.dirty = True
        loop.stats.frames_sent += 1

    def flush(self) -> None:
        """Send the control frames Python wrote (caller holds the lock)."""
        lane = self._loop.lane
        if lane is None:
            return
        self.dirty = False
        if self._backlog:
            lane.flush()  # frees send buffers the outboxes hold
            backlog = self._backlog
            k = 0
            while k < len(backlog) and lane.control(*backlog[k]):
                k += 1
            del backlog[:k]
            self.waiting = bool(backlog)
        lane.flush()

    def on_event(self, source: int, raw: bytes) -> None:
        """A control frame the lane handed up: its handler, as for any frame of its type."""
        loop = self._loop
        if loop.peers.refused(source):
            return  # refused: the rest of what it sent is not trusted
        handler = self._handlers.get(raw[0])
        if handler is None:
            return
        stats = loop.stats
        stats.frames_received += 1
        counts = stats.lane_control
        counts[raw[0]] = counts.get(raw[0], 0) + 1
        f = _FRAME.unpack_from(raw, 0)
        handler(source, f, np.frombuffer(raw, dtype=np.uint8), L.FRAME_SIZE)

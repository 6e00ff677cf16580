"""Repeats entered into the lane by compiled code outside the engine: a node service's loop.

A daemon's node service runs its clients' repeated allreduces among the nodes on an
ordinary engine of its own (:mod:`totalreduce.daemon.service_loop`).  For a repeat of a
lane shape its compiled loop enters the op and drives it itself (the buffers a shape
needs beside its input and output, its own), with
:func:`lane_repeat` (what ``Lane.now`` does in two compiled calls, in one), so that no
Python runs between a client's descriptor and its completion word.  What the engine's
Python must know of those ops, and the conditions under which compiled code may enter
them at all, are the engine's (its loop's ``ops``, seen through :class:`Engine`);
:class:`ServiceRepeats` is what the compiled loop's caller holds (the engine's lock held
meanwhile, as ``LaneOps.now`` holds it for one op).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
from numba import njit

from .lane_core import lane_drive, lane_enter
from .payload import OpSpec

if TYPE_CHECKING:
    from .lane import Lane, LaneOp

#: A compiled repeat's first try in the lane (``Lane.now``'s): an op not ended by then goes
#: on as a handle of the engine's express path.
TRY_NS = 200_000


@njit(nogil=True, cache=True)
def lane_repeat(mem, prog, arena, b, fields, addrs, gen, prio, urgent, try_ns, spin_ns, take):  # type: ignore[no-untyped-def]
    """Enter a repeat of a plain shape (``fields``, as ``Lane.shape_of`` made them; its
    buffers' addresses in ``addrs``) and drive it for up to ``try_ns`` as ``Lane.now``
    does: (slot, submission, ``lane_drive``'s answer: 2 when it ended well and left the
    table); slot -1 when the table is full (nothing entered)."""
    slot, seq, pending = lane_enter(mem, prog, arena, b, fields, addrs, gen, prio, urgent)
    if slot < 0:
        return -1, 0, 0
    return slot, seq, lane_drive(mem, prog, arena, b, slot, seq, try_ns, spin_ns, take)


class EngineRepeats(Protocol):
    """What the engine offers a compiled loop that enters repeats into its lane (the loop's
    ``ops``: ``totalreduce.engine.lane_loop.LaneOps``, which holds the conditions)."""

    @property
    def spin_ns(self) -> int: ...

    def hold_for_repeats(self, plans_epoch: int) -> bool: ...

    def release_repeats(self) -> None: ...

    def repeats_ended(
        self, name: int, wid: int, first: int, k: int, group: tuple[int, ...]
    ) -> None: ...

    def repeat_adopted(self, spec: OpSpec, slot: int, seq: int) -> LaneOp: ...

    def repeats_settle(self) -> None: ...


class Engine(Protocol):
    """The engine's loop (``totalreduce.engine.loop.CommLoop``) as :class:`ServiceRepeats`
    sees it: its lane and its ops' side for compiled repeats."""

    lane: Lane | None

    @property
    def ops(self) -> EngineRepeats: ...


class ServiceRepeats:
    """The engine's side of a compiled loop that enters repeats into its lane.

    ``begin()`` takes the loop's lock when nothing the engine's Python looks at stands in
    the way of a repeat (``LaneOps.hold_for_repeats``: ``LaneOps.now``'s conditions, for
    any key: nothing of the loop in flight, no error, no frame or op of any key in Python's
    tables); ``ended(...)`` records what the compiled code ran; ``adopt(...)`` makes the
    handle of a repeat it entered and did not end; ``end()`` gives the lock back.

    ``make(svc, express_record, name, generation, buf, out, result, priority, urgent)``
    makes a repeat's handle and spec (the service's express path, ``service.express._make``:
    given by the caller, which sits above the service layer).

    The caller's copies of lane fields hold plan and group offsets, which a compaction of
    the lane's plans moves (``LanePlans.plans_epoch``): once one came, ``begin()`` refuses
    until the caller, its copies dropped or made anew, says of which epoch they are
    (:meth:`renew`)."""

    def __init__(self, svc: Any, make: Callable[..., tuple[Any, Any]]) -> None:
        self.svc = svc
        self.loop: Engine = svc.loop
        self._make = make
        #: The lane's ``plans_epoch`` the caller's fields are of (:meth:`renew`).
        self.plans_epoch = 0

    def renew(self, epoch: int) -> None:
        """The caller's copies of lane fields are of the lane's ``plans_epoch`` ``epoch``
        (taken under the loop's lock with them, or before any was made)."""
        self.plans_epoch = epoch

    def lane_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
        """The lane's arrays (``mem``, ``prog``, ``arena``, ``b``), under the lock (a lane
        that grew has new ones)."""
        lane = self.loop.lane
        if lane is None:
            return None
        return lane.mem, lane.prog, lane.arena, lane.b

    def spin_ns(self) -> int:
        return int(self.loop.ops.spin_ns)

    def begin(self) -> bool:
        """Take the loop's lock for compiled repeats; False (nothing held) when anything
        the engine's Python would have to see first stands in the way."""
        if self.svc._closed:
            return False
        return self.loop.ops.hold_for_repeats(self.plans_epoch)

    def ended(self, name: int, wid: int, first: int, k: int, group: tuple[int, ...]) -> None:
        """``k`` repeats of ``name`` (wire id ``wid``, generations ``first``...) ended well
        in compiled code: recorded as ``LaneOps.now`` records its op (a late error about one
        names it)."""
        self.loop.ops.repeats_ended(name, wid, first, k, group)

    def adopt(self, ex: Any, name: int, gen: int, buf: np.ndarray, prio: int, slot: int,
              seq: int, keep: Any = None, out: np.ndarray | None = None) -> Any:  # fmt: skip
        """The handle of repeat ``gen`` of ``ex`` (in place on ``buf``, or from ``buf``
        into ``out``, its result) that compiled code entered in lane slot ``slot``
        (submission ``seq``) and that did not end in its try (``LaneOps.now``'s way with
        such an op); its generation is in flight from now.  ``keep``: the buffers the op
        uses beside ``buf`` (kept alive until it ends)."""
        o = buf if out is None else out
        handle, spec = self._make(self.svc, ex, name, gen, buf, o, o, prio, True)
        spec.context = getattr(ex, "context", 0)  # (a group's record has its group's)
        lop = handle._lop = self.loop.ops.repeat_adopted(spec, slot, seq)
        lop.keep = keep
        return handle

    def settle(self) -> None:
        """After compiled passes: what they filled grown, their events and ended ops
        handled (the lock held)."""
        self.loop.ops.repeats_settle()

    def end(self) -> None:
        self.loop.ops.release_repeats()

"""The compiled lane's ops failing: its events into errors, and lane ops failed with the rest.

:class:`LaneErrors` is an object of :class:`~.loop.CommLoop`'s (``loop.lane_errors``),
next to ``loop.ops`` (:class:`~.lane_loop.LaneOps`: ops into the lane and out of it).  It
turns the lane's events into the errors the loop raises (the same words, sent to the same
ranks: :meth:`~LaneErrors.on_event`), fails a lane op here and on its group
(:meth:`~LaneErrors.fail`), and takes lane ops through everything that fails ops: peers
gone (:meth:`~LaneErrors.fail_with`, ``loop.peers``), errors from peers and aborts
(``loop.failures``), shutdown and fatal errors (:meth:`~LaneErrors.fail_all`); the stall
inspector (:mod:`.stalls`) fails stalled ones through :meth:`~LaneErrors.fail`.  It holds
no state of its own: the lane op holds its error.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Callable
from typing import TYPE_CHECKING

from .. import protocol as L
from ..errors import FrameError, OpFailedError, OpMismatchError, TotalReduceError
from ..lane.payload import OpSpec, mismatch_text
from .parts import Loop

if TYPE_CHECKING:
    from ..lane.lane import LaneOp

log = logging.getLogger("totalreduce.engine")

_FRAME = struct.Struct(L.FRAME_FORMAT)

_MALFORMED = L.MALFORMED_TEXTS


class LaneErrors:
    """Lane ops failing, for the loop (see the module docstring)."""

    def __init__(self, loop: Loop) -> None:
        self._loop = loop

    # ------------------------------------------------------------------ one op, events

    def fail(self, lop: LaneOp, error: BaseException, *, tell_peers: bool, also: int = -1) -> None:
        """Fail a lane op here (and, with ``tell_peers``, on its group and rank ``also``)."""
        loop = self._loop
        lane = loop.lane
        assert lane is not None
        if lane.state(lop) != L.S_ACTIVE or lop.error is not None:
            return
        lop.error = error
        lane.fail(lop)
        self._tell(lop.spec, error, tell_peers, also)
        loop.ops.drain()

    def _tell(self, spec: OpSpec, error: BaseException, tell_peers: bool, also: int) -> None:
        if tell_peers:
            self._loop.failures.tell_group(spec.key, spec.group, also, error)
        rank = self._loop.rank
        text = str(error)
        log.error("%s", text if text.startswith(f"rank {rank}:") else f"rank {rank}: {text}")

    def on_event(self, kind: int, slot: int, source: int, a: int, b: int, raw: bytes) -> None:
        """One event the lane handed up (``Lane.take_events``)."""
        loop = self._loop
        lane = loop.lane
        assert lane is not None
        rank = loop.rank
        lop = lane.ops.get(slot) if slot >= 0 else None
        if kind == L.EV_CONTROL:
            loop.control.on_event(source, raw)
        elif kind in (L.EV_MISMATCH, L.EV_UNEXPECTED, L.EV_SIZE) and lop is not None:
            f = _FRAME.unpack(raw)
            error: TotalReduceError = OpMismatchError(
                self._mismatch_text(kind, lop, f, source, a, b)
            )
            lop.error = error
            self._tell(lop.spec, error, True, source)
        elif kind == L.EV_LATE:
            f = _FRAME.unpack(raw)
            key = (f[11], f[12])
            if key in loop.failures.completed:
                loop.failures.late_frame(source, f, key)
        elif kind == L.EV_MALFORMED:
            loop.peers.mark_bad(
                source,
                FrameError(
                    f"rank {rank}: message from rank {source} refused: "
                    f"{_MALFORMED.get(a, 'malformed')} ({b})"
                ),
            )
        elif kind == L.EV_MPI:
            from ..transport import mpi_native

            rec = lane.b
            if rec is not None and int(rec[mpi_native.B_KIND]) == mpi_native.KIND_LOCAL:
                from ..transport.local_native import error_text

                text = error_text(-a)
            else:
                text = mpi_native.error_text(-a)
            err = TotalReduceError(
                f"rank {rank}: MPI call of the compiled lane failed"
                + (f" with rank {source}" if source >= 0 else "")
                + f": {text}"
            )
            if source >= 0:
                loop.peers.mark_bad(source, err)
            else:
                raise err
        elif kind in (L.EV_KERNEL, L.EV_LOST) and lop is not None:
            error = OpFailedError(
                f"{lop.spec.describe()}: the compiled lane could not run it on rank {rank} "
                f"(event {kind}, {a}, {b}): a bug, please report it"
            )
            lop.error = error
            if lane.state(lop) == L.S_ACTIVE:
                lane.fail(lop)
            self._tell(lop.spec, error, True, -1)

    def _mismatch_text(
        self, kind: int, lop: LaneOp, f: tuple[int, ...], source: int, a: int, b: int
    ) -> str:
        spec = lop.spec
        rank = self._loop.rank
        who = self._loop.peers.who
        if kind == L.EV_MISMATCH:
            full = (f[0], f[1], f[2], f[3], f[4], f[5], f[6], f[7], f[8], f[9], f[10],
                    f[11], f[12], f[13], f[14], f[15], f[16])  # fmt: skip
            why = mismatch_text(spec, full, who(source), who(rank))
            if why is not None:
                return why
        if kind == L.EV_SIZE:
            from ..lane.lane_plans import DIRECT_KINDS

            if spec.kind in DIRECT_KINDS:  # a part's size is the two ranks' own business
                isz = spec.dtype.itemsize
                return (
                    f"{spec.describe()}: step {f[8]}: rank {rank} expects {b // isz} "
                    f"elements from rank {source}, which sends {a // isz} (the two ranks "
                    "disagree on the size of what passes between them: splits, recv_splits, "
                    "counts or shapes)"
                )
            return (
                f"{spec.describe()}: step {f[8]} segment {f[9]}: rank {rank} expects {b} "
                f"bytes, rank {source} sends {a} (do the ranks use the same micro_bytes?)"
            )
        hints = spec.schedule.unexpected
        step = f[L.F_STEP]
        peer = spec.group.index(source) if source in spec.group else None
        known = peer is not None and (step, peer, f[L.F_SEGMENT]) in spec.plan.recv_index
        if not known and step < len(hints):  # what the pattern says of a frame at this step
            return f"{spec.describe()}: {hints[step].format(sender=source, me=rank)}"
        return (
            f"{spec.describe()}: rank {rank} got an unexpected frame from rank {source} for "
            f"step {step} segment {f[L.F_SEGMENT]} (do the ranks use the same algorithm, group "
            "and micro_bytes?)"
        )

    # ------------------------------------------------------------------ every lane op

    def fail_with(
        self, peer: int, make: Callable[[OpSpec], BaseException], *, only_needed: bool = False
    ) -> None:
        """Fail the lane ops with world rank ``peer`` (``make(spec)`` is the error; with
        ``only_needed``, only those that still need a frame from it)."""
        lane = self._loop.lane
        if lane is None:
            return
        for lop in list(lane.ops.values()):
            if peer in lop.spec.group and (not only_needed or lane.needs(lop, peer)):
                self.fail(lop, make(lop.spec), tell_peers=True)

    def fail_all(self, error: BaseException) -> None:
        """Fail every lane op here (shutdown, a fatal error), telling no peer."""
        lane = self._loop.lane
        if lane is None:
            return
        for lop in list(lane.ops.values()):
            self.fail(lop, error, tell_peers=False)

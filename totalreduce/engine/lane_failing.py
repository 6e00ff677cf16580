"""The compiled lane's ops failing: its events into errors, and lane ops failed with the rest.

:class:`LaneFailHooks` is a base of :class:`~.loop.CommLoop`, next to
:class:`~.lane_loop.LaneHooks` (the lane's routing, driving and waiting).  It turns
the lane's events into the errors the main loop raises for its own ops (the same
words, sent to the same ranks: ``_lane_event``), fails a lane op here and on its
group (``_lane_fail``), and takes lane ops through everything that fails ops:
peers gone (``_lane_fail_with``), shutdown and fatal errors (``_lane_fail_all``); the
stall inspector (:mod:`.stalls`) fails stalled ones through ``_lane_fail``.  It
declares what it uses of the other bases as class
annotations; it does not import :mod:`.loop`.
"""

from __future__ import annotations

import logging
import struct
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .. import protocol as L
from ..errors import FrameError, OpFailedError, OpMismatchError, TotalReduceError
from ..lane.payload import OpKey, OpSpec, mismatch_text

if TYPE_CHECKING:
    from ..lane.lane import Lane, LaneOp

log = logging.getLogger("totalreduce.engine")

_FRAME = struct.Struct(L.FRAME_FORMAT)

_MALFORMED = L.MALFORMED_TEXTS


class LaneFailHooks:
    """Lane ops failing, for the main loop (see the module docstring)."""

    lane: Lane | None
    rank: int
    completed: OrderedDict[OpKey, tuple[Any, ...]]

    # provided by CommLoop
    _error_frame: Callable[[OpKey, int, str, int], None]
    _tell_group: Callable[[OpKey, tuple[int, ...], int, BaseException], None]
    _who: Callable[[int], str]
    _lane_drain: Callable[[], None]
    _unknown_op: Callable[[int, Any, OpKey], bool]
    _bad_peer: Callable[..., None]
    _control: Callable[..., None]
    _on_control_event: Callable[[int, bytes], None]
    # ------------------------------------------------------------------ one op, events

    def _lane_fail(
        self, lop: LaneOp, error: BaseException, *, tell_peers: bool, also: int = -1
    ) -> None:
        """Fail a lane op here (and, with ``tell_peers``, on its group and rank ``also``)."""
        lane = self.lane
        assert lane is not None
        if lane.state(lop) != L.S_ACTIVE or lop.error is not None:
            return
        lop.error = error
        lane.fail(lop)
        self._lane_tell(lop.spec, error, tell_peers, also)
        self._lane_drain()

    def _lane_tell(self, spec: OpSpec, error: BaseException, tell_peers: bool, also: int) -> None:
        if tell_peers:
            self._tell_group(spec.key, spec.group, also, error)
        text = str(error)
        log.error(
            "%s", text if text.startswith(f"rank {self.rank}:") else f"rank {self.rank}: {text}"
        )

    def _lane_event(self, kind: int, slot: int, source: int, a: int, b: int, raw: bytes) -> None:
        lane = self.lane
        assert lane is not None
        lop = lane.ops.get(slot) if slot >= 0 else None
        if kind == L.EV_CONTROL:
            self._on_control_event(source, raw)
        elif kind in (L.EV_MISMATCH, L.EV_UNEXPECTED, L.EV_SIZE) and lop is not None:
            f = _FRAME.unpack(raw)
            error: TotalReduceError = OpMismatchError(
                self._lane_mismatch_text(kind, lop, f, source, a, b)
            )
            lop.error = error
            self._lane_tell(lop.spec, error, True, source)
        elif kind == L.EV_LATE:
            f = _FRAME.unpack(raw)
            key = (f[11], f[12])
            if key in self.completed:
                self._unknown_op(source, f, key)
        elif kind == L.EV_MALFORMED:
            self._bad_peer(
                source,
                FrameError(
                    f"rank {self.rank}: message from rank {source} refused: "
                    f"{_MALFORMED.get(a, 'malformed')} ({b})"
                ),
            )
        elif kind == L.EV_MPI:
            from ..transport import mpi_native

            rec = None if self.lane is None else self.lane.b
            if rec is not None and int(rec[mpi_native.B_KIND]) == mpi_native.KIND_LOCAL:
                from ..transport.local_native import error_text

                text = error_text(-a)
            else:
                text = mpi_native.error_text(-a)
            err = TotalReduceError(
                f"rank {self.rank}: MPI call of the compiled lane failed"
                + (f" with rank {source}" if source >= 0 else "")
                + f": {text}"
            )
            if source >= 0:
                self._bad_peer(source, err)
            else:
                raise err
        elif kind in (L.EV_KERNEL, L.EV_LOST, L.EV_FOREIGN) and lop is not None:
            error = OpFailedError(
                f"{lop.spec.describe()}: the compiled lane could not run it on rank {self.rank} "
                f"(event {kind}, {a}, {b}): a bug, please report it"
            )
            lop.error = error
            if lane.state(lop) == L.S_ACTIVE:
                lane.fail(lop)
            self._lane_tell(lop.spec, error, True, -1)

    def _lane_mismatch_text(
        self, kind: int, lop: LaneOp, f: tuple[int, ...], source: int, a: int, b: int
    ) -> str:
        spec = lop.spec
        if kind == L.EV_MISMATCH:
            full = (f[0], f[1], f[2], f[3], f[4], f[5], f[6], f[7], f[8], f[9], f[10],
                    f[11], f[12], f[13], f[14], f[15], f[16])  # fmt: skip
            why = mismatch_text(spec, full, self._who(source), self._who(self.rank))
            if why is not None:
                return why
        if kind == L.EV_SIZE:
            from ..lane.lane_plans import DIRECT_KINDS

            if spec.kind in DIRECT_KINDS:  # a part's size is the two ranks' own business
                isz = spec.dtype.itemsize
                return (
                    f"{spec.describe()}: step {f[8]}: rank {self.rank} expects {b // isz} "
                    f"elements from rank {source}, which sends {a // isz} (the two ranks "
                    "disagree on the size of what passes between them: splits, recv_splits, "
                    "counts or shapes)"
                )
            return (
                f"{spec.describe()}: step {f[8]} segment {f[9]}: rank {self.rank} expects {b} "
                f"bytes, rank {source} sends {a} (do the ranks use the same micro_bytes?)"
            )
        hints = spec.schedule.unexpected
        step = f[L.F_STEP]
        peer = spec.group.index(source) if source in spec.group else None
        known = peer is not None and (step, peer, f[L.F_SEGMENT]) in spec.plan.recv_index
        if not known and step < len(hints):  # what the pattern says of a frame at this step
            return f"{spec.describe()}: {hints[step].format(sender=source, me=self.rank)}"
        return (
            f"{spec.describe()}: rank {self.rank} got an unexpected frame from rank {source} for "
            f"step {step} segment {f[L.F_SEGMENT]} (do the ranks use the same algorithm, group "
            "and micro_bytes?)"
        )

    # ------------------------------------------------------------------ every lane op

    def _lane_fail_with(self, peer: int, make: Any, *, only_needed: bool = False) -> None:
        """Fail the lane ops with world rank ``peer`` (``make(spec)`` is the error)."""
        lane = self.lane
        if lane is None:
            return
        for lop in list(lane.ops.values()):
            if peer in lop.spec.group and (not only_needed or lane.needs(lop, peer)):
                self._lane_fail(lop, make(lop.spec), tell_peers=True)

    def _lane_fail_all(self, error: BaseException) -> None:
        lane = self.lane
        if lane is None:
            return
        for lop in list(lane.ops.values()):
            self._lane_fail(lop, error, tell_peers=False)

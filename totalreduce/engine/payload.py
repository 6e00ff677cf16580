"""The payload table: every op this rank has submitted and not finished.

A :class:`Payload` is the seed's "message" in the message list: one collective
instance on this rank, with its buffers, its compiled schedule cut into
segments, and its own progress.  There is no global state of an op: each rank
keeps its own, and the ranks' states may be at different steps at any moment.
The table is keyed by ``(wire id, generation)``, the collective op id that
every frame carries.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..algorithms.codes import AlgorithmCode, OpKind
from ..algorithms.schedule import Buffer, Schedule, SegmentPlan
from ..dtypes import DType, ReduceOp
from . import wire

OpKey = tuple[int, int]  # (wire id, generation)


class OpState(enum.IntEnum):
    PREPARING = 1  # prologue running
    ACTIVE = 2  # steps in progress
    FINISHING = 3  # epilogue running
    DONE = 4
    FAILED = 5


@dataclass(eq=False, slots=True)
class OpSpec:
    """What a client submits: the op's identity, arguments, buffers and schedule."""

    name: str | int
    wire_id: int
    generation: int
    kind: OpKind
    algorithm: AlgorithmCode
    dtype: DType
    count: int
    op: ReduceOp
    priority: int
    inbuf: np.ndarray
    outbuf: np.ndarray
    schedule: Schedule
    plan: SegmentPlan
    group: tuple[int, ...]  # world rank of each group rank
    context: int = 0
    param: int = 0
    in_place: bool = False
    urgent: bool = False  # someone waits on it: set by the client, read by the sender
    #: Start only once this op (of this rank) completed; fail if it fails (a chain of
    #: schedules: a later phase reads what an earlier one wrote).
    after: tuple[int, int] | None = None
    #: A standing receive (a window's): it waits for a peer to act whenever that peer
    #: chooses, so it is never a stall, keeps no loop busy and is not "in flight" at
    #: shutdown (its owner cancels it).
    passive: bool = False
    on_done: Callable[[BaseException | None], None] | None = None

    @property
    def key(self) -> OpKey:
        return (self.wire_id, self.generation)

    def describe(self) -> str:
        return describe_op(self.name, self.generation)


#: Completed and failed ops a loop remembers (for a late frame or error about one).
REMEMBERED = 4096


def describe_op(name: str | int, generation: int) -> str:
    """How errors name an op: ``op 'fc1.grad' generation 7``."""
    return f"op {name!r} generation {generation}"


_SHAPE_FIELDS = ("dtype", "kind", "algorithm", "reduce op", "count", "param", "group")


class Payload:
    """Run-time state of one op on this rank; touched only by the thread running the loop."""

    __slots__ = (
        "spec",
        "key",
        "seq",
        "bufs",
        "bytes",
        "isz",
        "shape",
        "group_rank",
        "send_waits",
        "recv_waits",
        "sends_left",
        "recvs_left",
        "state",
        "local_left",
        "ready",
        "arrived",
        "pending",
        "parked",
        "posted",
        "awaiting",
        "version",
        "hot",
        "last_progress",
        "warned",
        "heard",
        "have",
        "probed",
        "sent_any",
        "got",
        "sent",
        "precleared",
        "early",
        "tagged",
        "given_up",
    )

    def __init__(self, spec: OpSpec, seq: int, bufs: dict[Buffer, np.ndarray]) -> None:
        plan = spec.plan
        self.spec = spec
        self.key: OpKey = (spec.wire_id, spec.generation)
        self.seq = seq
        self.bufs = bufs
        # Byte views of the buffers: frames slice these, no view built per frame.
        self.bytes = {b: a.view(np.uint8) for b, a in bufs.items()}
        self.isz = spec.dtype.itemsize
        #: What every frame of this op carries and every receiver checks.
        self.shape = (
            int(spec.dtype),
            int(spec.kind),
            int(spec.algorithm),
            int(spec.op),
            spec.count,
            spec.param,
            spec.context,
        )
        self.group_rank = {w: g for g, w in enumerate(spec.group)}
        self.send_waits = list(plan.send_waits)
        self.recv_waits = list(plan.recv_waits)
        self.sends_left = len(plan.sends)
        self.recvs_left = len(plan.recvs)
        self.state = OpState.PREPARING
        self.local_left = 0
        self.ready: set[int] = set()  # send segments whose turn came, not sent yet
        self.arrived: set[int] = set()  # receive segments whose frame came
        self.pending: dict[int, np.ndarray] = {}  # arrived, not applicable yet
        self.parked: dict[int, list[int]] = {}  # peer -> send segments it refused for now
        self.posted: set[Any] = set()  # body receives posted for this op
        self.awaiting: set[int] = set()  # send segments announced, not cleared yet
        self.version = 0  # bumped when its urgency rises (stale heap entries)
        self.hot = spec.urgent  # someone waits for it, here or (NEED) on a peer
        self.last_progress = time.monotonic()
        self.warned = False
        self.heard: set[int] = set()  # world ranks a frame of this op came from
        self.have: set[int] = set()  # world ranks that answered a probe: submitted it
        self.probed = False
        self.sent_any = False  # for the timeline's "first_send"
        self.got = bytearray(len(plan.recvs))  # receive segments whose body is here
        self.sent = bytearray(len(plan.sends))  # send segments complete
        self.precleared: dict[int, int] = {}  # receive segment -> tag, cleared unasked
        self.early: dict[int, int] = {}  # send segment -> tag of a clear that came unasked
        self.tagged: set[int] = set()  # send segments cleared, body not sent yet
        self.given_up: tuple[float, str] | None = None  # a sender gave up a body: when, why

    def sort_key(self) -> tuple[int, int, int]:
        """Heap order of the sender: priority, then someone waiting, then submission order."""
        return (-self.spec.priority, 0 if self.hot else 1, self.seq)

    def region(self, buffer: Buffer, offset: int, count: int) -> np.ndarray:
        return self.bufs[buffer][offset : offset + count]

    def mismatch(self, f: wire.Frame, sender: str, me: str) -> str | None:
        """Describe how a peer's frame disagrees with this op, or None (``sender`` and
        ``me`` name the two ranks, e.g. ``"rank 3"``)."""
        theirs = (
            f[wire.F_DTYPE],
            f[wire.F_KIND],
            f[wire.F_ALGO],
            f[wire.F_OP],
            f[wire.F_COUNT],
            f[wire.F_PARAM],
            f[wire.F_CONTEXT],
        )
        if theirs == self.shape:
            return None
        # Causes before consequences: a group or count difference changes the algorithm.
        for k in (1, 6, 0, 4, 3, 5, 2):
            what, mine, other = _SHAPE_FIELDS[k], self.shape[k], theirs[k]
            if mine != other:
                return (
                    f"{self.spec.describe()}: {me} has {what} {_show(what, mine, self)}, "
                    f"{sender} has {what} {_show(what, other, self)}"
                )
        return None  # pragma: no cover - some field differs

    def missing(self, my_rank: int) -> list[int]:
        """Ranks of the group not known to have submitted the op (after a probe)."""
        known = self.heard | self.have
        return [w for w in self.spec.group if w != my_rank and w not in known]

    def needs(self, peer: int) -> bool:
        """Does this op still expect a body from, or owe a segment to, world rank ``peer``?"""
        plan = self.spec.plan
        grp = self.spec.group
        g = self.group_rank.get(peer)
        if g is None:
            return False
        return (
            any(s.peer == g and not self.sent[i] for i, s in enumerate(plan.sends))
            or any(r.peer == g and not self.got[q] for q, r in enumerate(plan.recvs))
            or any(grp[plan.sends[i].peer] == peer for i in self.awaiting)
        )

    def waiting_on(self) -> tuple[list[int], list[int]]:
        """World ranks this op still expects frames from, and still sends to."""
        plan = self.spec.plan
        grp = self.spec.group
        recv_from = sorted({grp[r.peer] for q, r in enumerate(plan.recvs) if q not in self.arrived})
        send_to = sorted({grp[plan.sends[i].peer] for i in self.ready})
        send_to += [p for p in self.parked if p not in send_to]
        return recv_from, sorted(send_to)


#: Kinds whose parameter is the root.
_ROOTED = frozenset({OpKind.BROADCAST, OpKind.REDUCE, OpKind.GATHER, OpKind.SCATTER})


def _show(what: str, value: int, p: Payload) -> str:
    """A shape field in words (the codes are ints on the wire)."""
    try:
        if what == "dtype":
            return DType(value).name.lower()
        if what == "kind":
            return OpKind(value).name.lower()
        if what == "algorithm":
            return AlgorithmCode(value).name.lower()
        if what == "reduce op":
            return ReduceOp(value).name.lower()
    except ValueError:
        return f"code {value}"
    if what == "group":
        mine = value == p.spec.context
        return f"{list(p.spec.group)} (context {value:#x})" if mine else f"context {value:#x}"
    if what == "param" and p.spec.kind in _ROOTED:
        return f"{value} (the root)"
    if what == "param" and p.spec.kind is OpKind.ALLGATHER and value:
        return f"{value} (a digest of its counts=, every rank's part size)"
    return str(value)

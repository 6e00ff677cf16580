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
import heapq
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..algorithms.schedule import Buffer, Schedule, SegmentPlan
from ..dtypes import DType, ReduceOp
from .wire import AlgorithmCode, Header, OpKind

OpKey = tuple[int, int]  # (wire id, generation)


class OpState(enum.IntEnum):
    PREPARING = 1  # prologue running on the reducer
    ACTIVE = 2  # steps in progress
    FINISHING = 3  # epilogue running
    DONE = 4
    FAILED = 5


@dataclass(eq=False)
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
    on_done: Callable[[BaseException | None], None] | None = None

    @property
    def key(self) -> OpKey:
        return (self.wire_id, self.generation)

    def describe(self) -> str:
        return f"op {self.name!r} generation {self.generation}"


@dataclass(eq=False)
class Payload:
    """Run-time state of one op on this rank; touched only by the comm thread."""

    spec: OpSpec
    seq: int
    bufs: dict[Buffer, np.ndarray]
    group_rank: dict[int, int]  # world rank -> group rank
    send_waits: list[int]
    recv_waits: list[int]
    sends_left: int
    recvs_left: int
    state: OpState = OpState.PREPARING
    local_left: int = 0  # prologue / epilogue ops outstanding
    ready: list[int] = field(default_factory=list)  # heap of send segment ids
    arrived: set[int] = field(default_factory=set)  # receive segments whose frame came
    pending: dict[int, np.ndarray] = field(default_factory=dict)  # arrived, not applicable yet
    error: BaseException | None = None
    started: float = field(default_factory=time.monotonic)
    last_progress: float = field(default_factory=time.monotonic)
    warned: bool = False

    @classmethod
    def create(cls, spec: OpSpec, seq: int, bufs: dict[Buffer, np.ndarray]) -> Payload:
        plan = spec.plan
        return cls(
            spec=spec,
            seq=seq,
            bufs=bufs,
            group_rank={w: g for g, w in enumerate(spec.group)},
            send_waits=list(plan.send_waits),
            recv_waits=list(plan.recv_waits),
            sends_left=len(plan.sends),
            recvs_left=len(plan.recvs),
        )

    @property
    def key(self) -> OpKey:
        return self.spec.key

    def urgency(self) -> tuple[int, bool, int]:
        """Sort key of the sender: priority, then someone waiting, then submission order."""
        return (self.spec.priority, self.spec.urgent, -self.seq)

    def push_ready(self, i: int) -> None:
        heapq.heappush(self.ready, i)

    def pop_ready(self) -> int:
        return heapq.heappop(self.ready)

    def view(self, buffer: Buffer, offset: int, count: int) -> np.ndarray:
        return self.bufs[buffer][offset : offset + count]

    def mismatch(self, h: Header, my_rank: int) -> str | None:
        """Describe how a peer's frame disagrees with this op, or None."""
        s = self.spec
        checks = (
            ("kind", s.kind.name.lower(), h.kind.name.lower()),
            ("group", f"{list(s.group)} (context {s.context:#x})", f"context {h.context:#x}"),
            ("dtype", s.dtype.name.lower(), h.dtype.name.lower()),
            ("count", s.count, h.count),
            ("reduce op", s.op.name.lower(), h.op.name.lower()),
            ("algorithm", s.algorithm.name.lower(), h.algorithm.name.lower()),
            ("param", s.param, h.param),
        )
        for what, mine, theirs in checks:
            differs = s.context != h.context if what == "group" else mine != theirs
            if differs:
                return (
                    f"{s.describe()}: rank {my_rank} has {what} {mine}, "
                    f"rank {h.sender} has {what} {theirs}"
                )
        return None

    def waiting_on(self) -> tuple[list[int], list[int]]:
        """World ranks this op still expects frames from, and still sends to."""
        plan = self.spec.plan
        grp = self.spec.group
        recv_from = sorted({grp[r.peer] for q, r in enumerate(plan.recvs) if q not in self.arrived})
        send_to = sorted({grp[plan.sends[i].peer] for i in self.ready})
        return recv_from, send_to

"""What an op is, as a client submits it (:class:`OpSpec`), and how errors name it.

An op is keyed by ``(wire id, generation)`` (:data:`OpKey`), the collective op id
that every frame carries; each rank keeps its own state of it in the compiled lane's
table (:mod:`.lane`), and the ranks' states may be at different steps at any moment.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from ..algorithms.codes import AlgorithmCode, OpKind
from ..algorithms.schedule import Schedule, SegmentPlan
from ..dtypes import DType, ReduceOp
from ..protocol import F_ALGO, F_CONTEXT, F_COUNT, F_DTYPE, F_KIND, F_OP, F_PARAM

OpKey = tuple[int, int]  # (wire id, generation)

#: The shape fields of a control frame that is about no op's shape (dtype, kind,
#: algorithm, reduce op, count, param, context).
NO_SHAPE = (0, 0, 0, 0, 0, 0, 0)


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
    #: The express record a repeat's op was made from (``service/handle.ExpressOp``'s);
    #: a spec built the whole way has none.
    _ex: ClassVar[Any] = None

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


def mismatch_text(spec: OpSpec, f: tuple[int, ...], sender: str, me: str) -> str | None:
    """Describe how a peer's frame ``f`` (unpacked) disagrees with op ``spec``, or None
    (``sender`` and ``me`` name the two ranks, e.g. ``"rank 3"``)."""
    mine_all = (
        int(spec.dtype), int(spec.kind), int(spec.algorithm), int(spec.op), spec.count,
        spec.param, spec.context,
    )  # fmt: skip
    theirs = (
        f[F_DTYPE],
        f[F_KIND],
        f[F_ALGO],
        f[F_OP],
        f[F_COUNT],
        f[F_PARAM],
        f[F_CONTEXT],
    )
    if theirs == mine_all:
        return None
    # Causes before consequences: a group or count difference changes the algorithm.
    for k in (1, 6, 0, 4, 3, 5, 2):
        what, mine, other = _SHAPE_FIELDS[k], mine_all[k], theirs[k]
        if mine != other:
            return (
                f"{spec.describe()}: {me} has {what} {_show(what, mine, spec)}, "
                f"{sender} has {what} {_show(what, other, spec)}"
            )
    return None  # pragma: no cover - some field differs


#: Kinds whose parameter is the root.
_ROOTED = frozenset({OpKind.BROADCAST, OpKind.REDUCE, OpKind.GATHER, OpKind.SCATTER})


def _show(what: str, value: int, spec: OpSpec) -> str:
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
        mine = value == spec.context
        return f"{list(spec.group)} (context {value:#x})" if mine else f"context {value:#x}"
    if what == "param" and spec.kind in _ROOTED:
        return f"{value} (the root)"
    if what == "param" and spec.kind is OpKind.ALLGATHER and value:
        return f"{value} (a digest of its counts=, every rank's part size)"
    return str(value)

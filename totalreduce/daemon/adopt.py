"""How a node's service joins the hierarchical ops its clients start, from a frame.

A node's service never submits an op.  The first frame of an op that reaches
it (a client's contribution, a clear or a body from another node) says
everything the op is: kind, algorithm, dtype, count, reduce op, root and the
cross-node algorithm (in ``param``), wire id and generation.  The engine
calls :func:`relay_adopter`'s function with that frame; it compiles this
relay's part of the hierarchical schedule and returns the op's spec, and the
engine runs it like any other op, at the priority the frame carries.  Frames
of other algorithms are not the relay's (it only forwards them), so the
function returns None for them.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..algorithms.codes import AlgorithmCode, OpKind
from ..algorithms.hierarchical import NodeLayout, hierarchical_schedule, split_param
from ..dtypes import DType, ReduceOp
from ..engine import wire
from ..engine.payload import OpSpec
from ..errors import InvalidArgumentError
from ..service.ops import plan_for

#: Largest op a relay allocates buffers for on a frame's word (64 GiB).
MAX_OP_BYTES = 1 << 36
#: Kinds with a hierarchical schedule.
KINDS = frozenset({OpKind.ALLREDUCE, OpKind.BROADCAST, OpKind.BARRIER})


def relay_adopter(
    layout: NodeLayout, rank: int, segment_bytes: int, max_op_bytes: int
) -> Callable[[int, wire.Frame], OpSpec | None]:
    """The engine's ``adopt`` hook of the relay ``rank`` of ``layout``.

    An op larger than ``max_op_bytes`` is refused (the frame names an op the
    relay would have to allocate that much for).
    """
    world = tuple(range(layout.world))

    def adopt(source: int, f: wire.Frame) -> OpSpec | None:
        if f[wire.F_ALGO] != AlgorithmCode.HIERARCHICAL:
            return None
        kind = OpKind(f[wire.F_KIND])
        if kind not in KINDS:
            raise InvalidArgumentError(f"{kind.name.lower()} has no hierarchical schedule")
        dtype = DType(f[wire.F_DTYPE])
        op = ReduceOp(f[wire.F_OP])
        count = int(f[wire.F_COUNT])
        if count * dtype.itemsize > max_op_bytes:
            raise InvalidArgumentError(
                f"{count} elements of {dtype.name.lower()} exceed the service's limit of "
                f"{max_op_bytes} bytes per op"
            )
        param = int(f[wire.F_PARAM])
        root, cross, bcast = split_param(param)
        schedule = hierarchical_schedule(
            kind, rank, layout, count, op_average=op is ReduceOp.AVG, root=root, cross=cross,
            broadcast_cross=bcast,
        )  # fmt: skip
        wid, gen = f[wire.F_WID], f[wire.F_GEN]
        return OpSpec(
            name=f"#{wid:016x}",
            wire_id=wid,
            generation=gen,
            kind=kind,
            algorithm=AlgorithmCode.HIERARCHICAL,
            dtype=dtype,
            count=count,
            op=op,
            priority=wire.priority_of(f),
            inbuf=np.empty(schedule.count, dtype.numpy),
            outbuf=np.empty(schedule.out_count, dtype.numpy),
            schedule=schedule,
            plan=plan_for(schedule, max(1, segment_bytes // dtype.itemsize)),
            group=world,
            context=int(f[wire.F_CONTEXT]),
            param=param,
            joined=True,
        )

    return adopt

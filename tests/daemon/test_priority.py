"""Frames carry their op's priority; a node's service runs the ops it joins at it."""

from __future__ import annotations

import numpy as np
import pytest

from totalreduce.algorithms.codes import AlgorithmCode, OpKind
from totalreduce.algorithms.hierarchical import NodeLayout, join_param
from totalreduce.daemon.adopt import MAX_OP_BYTES, relay_adopter
from totalreduce.dtypes import DType, ReduceOp
from totalreduce.engine import wire
from totalreduce.errors import InvalidArgumentError
from totalreduce.service import checks


@pytest.mark.parametrize("prio", [0, 7, -5, (1 << 31) - 1, -(1 << 31)])
def test_a_relay_joins_an_op_at_the_priority_its_frame_carries(prio: int) -> None:
    shape = (DType.INT64, OpKind.ALLREDUCE, AlgorithmCode.HIERARCHICAL, ReduceOp.SUM, 10,
             join_param(), 0)  # fmt: skip
    buf = bytearray()
    wire.pack_frame(buf, wire.DATA, shape, 0, 0, 0, 0, (123, 4), 80, prio)
    f = wire.FRAME.unpack(bytes(buf))
    assert wire.priority_of(f) == prio
    layout = NodeLayout(2, 2)
    spec = relay_adopter(layout, layout.relay_of(0), 1 << 20, MAX_OP_BYTES)(0, f)
    assert spec is not None and spec.priority == prio and spec.key == (123, 4)
    assert spec.outbuf.size == 10 and spec.joined


def test_priorities_beyond_32_bits_are_refused_at_the_call() -> None:
    assert checks.priority(np.int64(3)) == 3
    with pytest.raises(InvalidArgumentError, match="32 bits"):
        checks.priority(1 << 40)

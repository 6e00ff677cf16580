"""Frames carry their op's priority, and a priority must fit in their 32 bits."""

from __future__ import annotations

import numpy as np
import pytest

from totalreduce.algorithms.codes import AlgorithmCode, OpKind
from totalreduce.dtypes import DType, ReduceOp
from totalreduce.engine import wire
from totalreduce.errors import InvalidArgumentError
from totalreduce.service import checks


@pytest.mark.parametrize("prio", [0, 7, -5, (1 << 31) - 1, -(1 << 31)])
def test_a_frame_carries_its_ops_priority(prio: int) -> None:
    shape = (DType.INT64, OpKind.ALLREDUCE, AlgorithmCode.RING, ReduceOp.SUM, 10, 0, 0)
    buf = bytearray()
    wire.pack_frame(buf, wire.DATA, shape, 0, 0, 0, 0, (123, 4), 80, prio)
    f = wire.FRAME.unpack(bytes(buf))
    assert wire.priority_of(f) == prio
    assert (f[wire.F_WID], f[wire.F_GEN]) == (123, 4)


def test_priorities_beyond_32_bits_are_refused_at_the_call() -> None:
    assert checks.priority(np.int64(3)) == 3
    with pytest.raises(InvalidArgumentError, match="32 bits"):
        checks.priority(1 << 40)

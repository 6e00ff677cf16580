"""Frames carry their op's priority, and a priority must fit in their 32 bits."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from totalreduce import protocol as L
from totalreduce.algorithms.codes import AlgorithmCode, OpKind
from totalreduce.dtypes import DType, ReduceOp
from totalreduce.engine import wire
from totalreduce.errors import InvalidArgumentError
from totalreduce.service import checks


@pytest.mark.parametrize("prio", [0, 7, -5, (1 << 31) - 1, -(1 << 31)])
def test_a_frame_carries_its_ops_priority(prio: int) -> None:
    """As the lane writes a frame's priority (its low 32 bits, ``FH_PRIO``)."""
    raw = bytearray(L.FRAME_SIZE)
    frame = struct.Struct(L.FRAME_FORMAT)
    frame.pack_into(raw, 0, L.DATA, DType.INT64, OpKind.ALLREDUCE, AlgorithmCode.RING,
                    ReduceOp.SUM, 0, 0, 0, 0, 0, 0, 123, 4, 80, 10, 0, 0)  # fmt: skip
    struct.pack_into("<I", raw, L.FH_PRIO, prio & 0xFFFFFFFF)
    f = frame.unpack(bytes(raw))
    assert wire.priority_of(f) == prio
    assert (f[L.F_WID], f[L.F_GEN]) == (123, 4)


def test_priorities_beyond_32_bits_are_refused_at_the_call() -> None:
    assert checks.priority(np.int64(3)) == 3
    with pytest.raises(InvalidArgumentError, match="32 bits"):
        checks.priority(1 << 40)

"""Malformed, oversized, truncated and forged messages: a FrameError naming the peer.

A rogue rank sends raw bytes to a service, on the compiled lane's tag through the
transport (the lane reads it with ``MPI_Improbe``/``MPI_Mrecv``).  The service refuses
the message, fails what involved that peer with a :class:`FrameError` that names it,
allocates nothing the message asks for, and its loop keeps running.  (Every frame type,
malformed, is in ``test_lane_hostile.py``.)
"""

from __future__ import annotations

import struct
import time

import numpy as np
import pytest

import totalreduce as tr
from totalreduce import protocol as L
from totalreduce.algorithms.codes import AlgorithmCode, OpKind
from totalreduce.dtypes import DType, ReduceOp
from totalreduce.engine.wire import wire_id
from totalreduce.service.config import Config
from totalreduce.service.service import Service
from totalreduce.transport.local import LocalWorld

POOL = 1 << 20
SHAPE = (int(DType.FLOAT64), int(OpKind.ALLREDUCE), int(AlgorithmCode.RING), int(ReduceOp.SUM))
SHAPE += (4, 0, 0)


_MSG = struct.Struct(L.MSG_FORMAT)
_FRAME = struct.Struct(L.FRAME_FORMAT)


def _message(ftype: int, nbytes: int, body: bytes = b"", nframes: int | None = None) -> bytes:
    dt, kind, algo, op, count, param, ctx = SHAPE
    head = _FRAME.pack(ftype, dt, kind, algo, op, 0, 0, 0, 0, 0, 0, wire_id("x"), 0, nbytes,
                       count, param, ctx)  # fmt: skip
    n = 1 if nframes is None else nframes
    return _MSG.pack(L.LANE_MAGIC, L.LANE_VERSION, 0, n, 1, 0, 0) + head + body


GARBAGE = {
    "bad magic": b"\x00garbage" * 12,
    "truncated": _message(L.DATA, 32, b"\x01" * 8),
    "frame count": _message(L.CTS, 0, nframes=5),
    "oversized": b"\x00" * (1 << 20),
    "forged huge body": _message(L.ERROR, 1 << 33),
    "forged eager size": _message(L.DATA, 1 << 30),
}


def _send_to_lane(world: LocalWorld, raw: np.ndarray) -> np.ndarray:
    """Rank 1 sends ``raw`` on the compiled lane's tag through the world's compiled layer
    (the lane reads it with ``MPI_Improbe``/``MPI_Mrecv``); returns the request."""
    from totalreduce.lane.lane import LANE_TAG
    from totalreduce.transport import mpi_native

    b = world.native().binding(1)
    req = mpi_native.request_array(b, 1)
    rc = mpi_native.mpi_isend(b, raw.ctypes.data, raw.nbytes, 0, LANE_TAG, req.ctypes.data)
    assert rc == 0
    return req


@pytest.mark.parametrize("what", sorted(GARBAGE))
def test_bad_message_is_a_frame_error_and_the_loop_lives(what: str) -> None:
    world = LocalWorld(2)
    svc = Service(world.transport(0), Config.load(env={}, floating_pool_bytes=POOL))
    try:
        raw = np.frombuffer(GARBAGE[what], dtype=np.uint8).copy()  # read when received
        assert svc.loop.lane is not None
        _send_to_lane(world, raw)
        deadline = time.monotonic() + 5
        while 1 not in svc.loop.peers.bad and time.monotonic() < deadline:
            time.sleep(0.01)
        assert 1 in svc.loop.peers.bad, f"{what}: the message was not refused"
        # An op with that peer fails with a FrameError naming it; nothing hangs.
        h = svc.allreduce_async(np.ones(4), name="x")
        with pytest.raises(tr.FrameError, match="from rank 1"):
            h.wait(timeout=5)
        assert svc.loop.fatal is None  # the loop lives on
        assert svc.loop.floating_bytes <= POOL
        # ... and ops that do not involve the peer still run.
        me = tr.Group([0])
        np.testing.assert_array_equal(svc.allreduce(np.arange(3.0), group=me), np.arange(3.0))
    finally:
        svc.shutdown(timeout=1)

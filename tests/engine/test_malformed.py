"""Malformed, oversized, truncated and forged messages: a FrameError naming the peer.

A rogue rank sends raw bytes to a service.  The service refuses the message, fails
what involved that peer with a :class:`FrameError` that names it, allocates nothing
the message asks for, and its loop keeps running.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

import totalreduce as tr
from totalreduce.algorithms.codes import AlgorithmCode, OpKind
from totalreduce.dtypes import DType, ReduceOp
from totalreduce.engine import wire
from totalreduce.service.config import Config
from totalreduce.service.service import Service
from totalreduce.transport.local import LocalWorld

POOL = 1 << 20
SHAPE = (int(DType.FLOAT64), int(OpKind.ALLREDUCE), int(AlgorithmCode.RING), int(ReduceOp.SUM))
SHAPE += (4, 0, 0)


def _message(ftype: int, nbytes: int, body: bytes = b"", nframes: int | None = None) -> bytes:
    buf = bytearray(wire.MSG_SIZE)
    wire.pack_frame(buf, ftype, SHAPE, 0, 0, 0, 0, (wire.wire_id("x"), 0), nbytes)
    buf += body
    wire.pack_message_header(buf, 1 if nframes is None else nframes, 1, 0, 0)
    return bytes(buf)


GARBAGE = {
    "bad magic": b"\x00garbage" * 12,
    "truncated": _message(wire.DATA, 32, b"\x01" * 8),
    "frame count": _message(wire.CTS, 0, nframes=5),
    "oversized": b"\x00" * (1 << 20),
    "forged huge body": _message(wire.RTS, 1 << 33),
    "forged eager size": _message(wire.DATA, 1 << 30),
}


def _send_to_lane(world: LocalWorld, raw: np.ndarray) -> np.ndarray:
    """Rank 1 sends ``raw`` on the compiled lane's tag through the world's compiled layer
    (the lane reads it with ``MPI_Improbe``/``MPI_Mrecv``); returns the request."""
    from totalreduce.engine.lane import LANE_TAG
    from totalreduce.transport import mpi_native

    b = world.native().binding(1)
    req = mpi_native.request_array(b, 1)
    rc = mpi_native.mpi_isend(b, raw.ctypes.data, raw.nbytes, 0, LANE_TAG, req.ctypes.data)
    assert rc == 0
    return req


@pytest.mark.parametrize("path", ["main loop", "lane"])
@pytest.mark.parametrize("what", sorted(GARBAGE))
def test_bad_message_is_a_frame_error_and_the_loop_lives(what: str, path: str) -> None:
    """``path``: on the main loop's tag, or on the compiled lane's (its event to Python)."""
    world = LocalWorld(2)
    svc = Service(world.transport(0), Config.load(env={}, floating_pool_bytes=POOL))
    rogue = world.transport(1)
    try:
        raw = np.frombuffer(GARBAGE[what], dtype=np.uint8).copy()  # read when received
        if path == "lane":
            assert svc.loop.lane is not None
            _send_to_lane(world, raw)
        else:
            rogue.isend(raw, 0, wire.CONTROL_TAG)
        deadline = time.monotonic() + 5
        while 1 not in svc.loop.bad_peers and time.monotonic() < deadline:
            time.sleep(0.01)
        assert 1 in svc.loop.bad_peers, f"{what}: the message was not refused"
        # An op with that peer fails with a FrameError naming it; nothing hangs.
        h = svc.allreduce_async(np.ones(4), name="x")
        with pytest.raises(tr.FrameError, match="from rank 1"):
            h.wait(timeout=5)
        assert svc.loop.fatal is None  # the loop lives on
        assert svc.loop.floating.held <= POOL
        # ... and ops that do not involve the peer still run.
        me = tr.Group([0])
        np.testing.assert_array_equal(svc.allreduce(np.arange(3.0), group=me), np.arange(3.0))
    finally:
        svc.shutdown(timeout=1)

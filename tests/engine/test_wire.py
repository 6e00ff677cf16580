"""Wire protocol v2: messages of frames, packed and validated in one place."""

from __future__ import annotations

import numpy as np
import pytest

from totalreduce.algorithms.codes import AlgorithmCode, OpKind
from totalreduce.dtypes import DType, ReduceOp
from totalreduce.engine import wire
from totalreduce.errors import FrameError

SHAPE = (int(DType.FLOAT32), int(OpKind.ALLREDUCE), int(AlgorithmCode.RING), int(ReduceOp.SUM))
SHAPE += (1000, 0, 0)
KEY = (wire.wire_id("fc1.grad"), 3)


def message(*frames: tuple[int, int, bytes], sender: int = 1, ctl: int = 0, eager: int = 0):
    """A message of (type, nbytes, body) frames, as the loop builds it."""
    buf = bytearray(wire.MSG_SIZE)
    for ftype, nbytes, body in frames:
        wire.pack_frame(buf, ftype, SHAPE, 0, 7, 2, 5, KEY, nbytes)
        buf += body + bytes(wire.padded(len(body)) - len(body))
    wire.pack_message_header(buf, len(frames), sender, ctl, eager)
    return buf


def test_layout_sizes() -> None:
    assert wire.MSG_SIZE == 24 and wire.FRAME_SIZE == 72


def test_round_trip_of_coalesced_frames() -> None:
    body = np.arange(3, dtype=np.float32).tobytes()  # 12 bytes: padded to 16
    raw = message((wire.DATA, 12, body), (wire.RTS, 4096, b""), (wire.CTS, 0, b""), ctl=99)
    ctl, eager, frames = wire.split(raw, 1, size=4, micro_bytes=1024)
    assert (ctl, eager) == (99, 0)
    assert [f[wire.F_TYPE] for f, _ in frames] == [wire.DATA, wire.RTS, wire.CTS]
    f, off = frames[0]
    assert (f[wire.F_WID], f[wire.F_GEN]) == KEY
    assert (f[wire.F_STEP], f[wire.F_SEGMENT], f[wire.F_AUX], f[wire.F_NBYTES]) == (2, 5, 7, 12)
    assert bytes(raw[off : off + 12]) == body
    assert frames[1][1] == -1  # an announcement carries no body


def test_wire_id_is_stable_and_typed() -> None:
    assert wire.wire_id("fc1.grad") == wire.wire_id("fc1.grad")
    assert wire.wire_id("1") != wire.wire_id(1)
    assert wire.wire_id("fc1.grad") == int.from_bytes(
        __import__("hashlib").blake2b(b"s:fc1.grad", digest_size=8).digest(), "little"
    )
    with pytest.raises(TypeError):
        wire.wire_id(1.5)  # type: ignore[arg-type]


FRAME0 = wire.MSG_SIZE  # offset of the first frame


@pytest.mark.parametrize(
    "offset,value,needle",
    [
        (0, 0xDEADBEEF, "bad magic"),
        (4, 99, "version"),
        (FRAME0 + 0, 77, "frame type"),
        (FRAME0 + 1, 0, "dtype"),
        (FRAME0 + 2, 200, "kind"),
        (FRAME0 + 3, 200, "algorithm"),
        (FRAME0 + 4, 9, "reduce op"),
        (FRAME0 + 5, 4, "flags"),
    ],
)
def test_bad_fields(offset: int, value: int, needle: str) -> None:
    raw = message((wire.DATA, 8, b"\x00" * 8))
    if offset == 0:
        raw[0:4] = value.to_bytes(4, "little")
    else:
        raw[offset] = value
    with pytest.raises(FrameError, match=needle):
        wire.split(raw, 1, size=4, micro_bytes=1024)


def test_impossible_values() -> None:
    with pytest.raises(FrameError, match="says sender 1, came from rank 2"):
        wire.split(message((wire.CTS, 0, b"")), 2, size=4, micro_bytes=1024)
    with pytest.raises(FrameError, match="exceeds"):
        wire.split(message((wire.RTS, wire.MAX_BODY_BYTES + 8, b"")), 1, 4, 1024)
    with pytest.raises(FrameError, match="whole number"):
        wire.split(message((wire.RTS, 4097, b"")), 1, size=4, micro_bytes=1024)


def test_short_truncated_and_stray_bytes() -> None:
    with pytest.raises(FrameError, match="shorter"):
        wire.split(b"\x00" * 10, 1, size=2, micro_bytes=64)
    raw = message((wire.DATA, 8, b"\x00" * 8))
    with pytest.raises(FrameError, match="truncated"):
        wire.split(raw[:-8], 1, size=4, micro_bytes=64)
    with pytest.raises(FrameError, match="truncated"):
        wire.split(raw[: wire.MSG_SIZE + 10], 1, size=4, micro_bytes=64)
    with pytest.raises(FrameError, match="micro_bytes"):
        wire.split(message((wire.DATA, 4096, b"\x00" * 4096)), 1, size=4, micro_bytes=64)
    with pytest.raises(FrameError, match="stray"):
        wire.split(raw + b"xx", 1, size=4, micro_bytes=64)


def test_random_garbage_never_crashes() -> None:
    rng = np.random.default_rng(0)
    for n in range(0, 400, 3):
        junk = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        with pytest.raises(FrameError):
            wire.split(junk, 1, size=4, micro_bytes=64)

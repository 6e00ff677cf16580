"""Frames: round trip, stable ids, and a clear error for every malformed field."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from totalreduce.dtypes import DType, ReduceOp
from totalreduce.engine import wire
from totalreduce.errors import FrameError


def header(**kw) -> wire.Header:
    base = dict(
        frame_type=wire.FrameType.DATA,
        dtype=DType.FLOAT32,
        kind=wire.OpKind.ALLREDUCE,
        algorithm=wire.AlgorithmCode.RING,
        op=ReduceOp.SUM,
        flags=0,
        sender=1,
        body_tag=wire.BODY_TAG_BASE + 5,
        wire_id=wire.wire_id("fc1.grad"),
        generation=7,
        step=3,
        segment=2,
        nbytes=4096,
        count=100000,
        param=0,
        context=0,
    )
    base.update(kw)
    return wire.Header(**base)


def packed(h: wire.Header, body: bytes = b"") -> bytearray:
    return bytearray(wire.encode(h) + body)


def test_round_trip() -> None:
    h = header()
    raw = packed(h)
    assert len(raw) == wire.HEADER_SIZE == 80
    assert wire.decode(raw, len(raw), size=4, micro_bytes=1024) == h


def test_inline_round_trip() -> None:
    h = header(flags=wire.FLAG_INLINE, nbytes=8, body_tag=0)
    raw = packed(h, b"\x01" * 8)
    assert wire.decode(raw, len(raw), size=4, micro_bytes=1024).inline


def test_wire_id_is_stable_and_typed() -> None:
    assert wire.wire_id("fc1.grad") == wire.wire_id("fc1.grad")
    assert wire.wire_id("1") != wire.wire_id(1)
    # a fixed value: equal on every rank, every run, every platform
    assert wire.wire_id("fc1.grad") == int.from_bytes(
        __import__("hashlib").blake2b(b"s:fc1.grad", digest_size=8).digest(), "little"
    )
    with pytest.raises(TypeError):
        wire.wire_id(1.5)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "offset,value,needle",
    [
        (0, 0xDEADBEEF, "bad magic"),
        (4, 99, "version"),
        (5, 77, "frame type"),
        (6, 0, "dtype"),
        (7, 200, "kind"),
        (8, 200, "algorithm"),
        (9, 9, "reduce op"),
    ],
)
def test_bad_fields(offset: int, value: int, needle: str) -> None:
    raw = packed(header())
    if offset == 0:
        raw[0:4] = value.to_bytes(4, "little")
    else:
        raw[offset] = value
    with pytest.raises(FrameError, match=needle):
        wire.decode(raw, len(raw), size=4, micro_bytes=1024)


@pytest.mark.parametrize(
    "change,needle",
    [
        (dict(sender=9), "sender rank 9"),
        (dict(nbytes=wire.MAX_BODY_BYTES + 8), "exceeds"),
        (dict(nbytes=4097), "whole number"),
        (dict(body_tag=3), "body tag"),
        (dict(flags=4), "flags"),
    ],
)
def test_impossible_values(change: dict, needle: str) -> None:
    raw = packed(dataclasses.replace(header(), **change))
    with pytest.raises(FrameError, match=needle):
        wire.decode(raw, len(raw), size=4, micro_bytes=1024)


def test_short_and_inconsistent_lengths() -> None:
    with pytest.raises(FrameError, match="shorter"):
        wire.decode(b"\x00" * 10, 10, size=2, micro_bytes=64)
    inline = header(flags=wire.FLAG_INLINE, nbytes=8, body_tag=0)
    raw = packed(inline, b"\x00" * 4)
    with pytest.raises(FrameError, match="announces"):
        wire.decode(raw, len(raw), size=4, micro_bytes=64)
    big = header(flags=wire.FLAG_INLINE, nbytes=4096, body_tag=0)
    raw = packed(big, b"\x00" * 4096)
    with pytest.raises(FrameError, match="micro_bytes"):
        wire.decode(raw, len(raw), size=4, micro_bytes=64)
    raw = packed(header(), b"xx")
    with pytest.raises(FrameError, match="stray"):
        wire.decode(raw, len(raw), size=4, micro_bytes=64)


def test_random_garbage_never_crashes() -> None:
    rng = np.random.default_rng(0)
    for n in range(0, 200, 3):
        junk = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        with pytest.raises(FrameError):
            wire.decode(junk, len(junk), size=4, micro_bytes=64)

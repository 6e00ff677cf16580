"""Wire frames: the self-describing header every transfer starts with.

A frame is the seed's "isend message head" grown into a fixed layout: it says
which op (wire id and generation), which step and segment, what kind of data
and how much, so the receiver can place it without any agreement on order
with the sender (a "self-guided message").  A body of at most ``micro_bytes``
travels in the same message right after the header; a larger body follows as
its own message on the tag the header names, so several bodies can be in
flight between two ranks at once.

Layout (little-endian, ``HEADER_SIZE`` = 80 bytes)::

    magic u32 | version u8 | frame type u8 | dtype u8 | kind u8 |
    algorithm u8 | reduce op u8 | flags u16 | sender i32 | body tag i32 |
    wire id u64 | generation u64 | step u32 | segment u32 |
    byte count u64 | element count u64 | param i64 | context u64 | reserved u32

``element count`` is the op's whole element count and ``param`` an op
parameter (the root of a broadcast): both let a receiver detect two ranks
that submitted the same name and generation with different arguments.
``context`` identifies the group of ranks the op runs over.

:func:`decode` validates every field and raises :class:`FrameError` on
anything malformed, so garbage never reaches an allocation or a buffer.
"""

from __future__ import annotations

import enum
import hashlib
import struct
from dataclasses import dataclass
from typing import TypeVar

from ..algorithms.codes import AlgorithmCode, OpKind
from ..dtypes import DType, ReduceOp
from ..errors import FrameError

MAGIC = 0x31445254  # b"TRD1" read as little-endian u32
VERSION = 1
_LAYOUT = struct.Struct("<IBBBBBBHiiQQIIQQqQI")
HEADER_SIZE = _LAYOUT.size
assert HEADER_SIZE == 80

HEADER_TAG = 1
BODY_TAG_BASE = 16
BODY_TAG_SPAN = 1 << 20  # body tags rotate through this many values per peer

FLAG_INLINE = 1

#: Largest body a frame may announce; anything above is malformed.
MAX_BODY_BYTES = 1 << 34


class FrameType(enum.IntEnum):
    """What a frame carries."""

    DATA = 1  # a segment of an op's step
    ERROR = 2  # the op failed on the sender; the body is the UTF-8 message


def wire_id(name: str | int) -> int:
    """Stable 64-bit id of an op name: the same on every rank, no coordination.

    >>> wire_id("fc1.grad") == wire_id("fc1.grad")
    True
    """
    if isinstance(name, bool) or not isinstance(name, (str, int)):
        raise TypeError(f"op names are str or int, got {type(name).__name__} {name!r}")
    raw = (b"s:" + name.encode()) if isinstance(name, str) else b"i:%d" % name
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little")


@dataclass(frozen=True)
class Header:
    """A decoded frame header."""

    frame_type: FrameType
    dtype: DType
    kind: OpKind
    algorithm: AlgorithmCode
    op: ReduceOp
    flags: int
    sender: int
    body_tag: int
    wire_id: int
    generation: int
    step: int
    segment: int
    nbytes: int
    count: int
    param: int
    context: int

    @property
    def inline(self) -> bool:
        return bool(self.flags & FLAG_INLINE)

    def describe(self) -> str:
        return (
            f"{self.frame_type.name} frame from rank {self.sender}: op {self.wire_id:#018x} "
            f"generation {self.generation} step {self.step} segment {self.segment} "
            f"({self.nbytes} bytes)"
        )


def encode(h: Header, into: bytearray | memoryview | None = None) -> bytes | None:
    """Pack a header; into a buffer when given (its first HEADER_SIZE bytes)."""
    fields = (
        MAGIC,
        VERSION,
        int(h.frame_type),
        int(h.dtype),
        int(h.kind),
        int(h.algorithm),
        int(h.op),
        h.flags,
        h.sender,
        h.body_tag,
        h.wire_id,
        h.generation,
        h.step,
        h.segment,
        h.nbytes,
        h.count,
        h.param,
        h.context,
        0,
    )
    if into is None:
        return _LAYOUT.pack(*fields)
    _LAYOUT.pack_into(into, 0, *fields)
    return None


_E = TypeVar("_E", bound=enum.IntEnum)


def _enum(cls: type[_E], value: int, what: str) -> _E:
    try:
        return cls(value)
    except ValueError:
        raise FrameError(f"malformed frame: unknown {what} code {value}") from None


def decode(buf: bytes | bytearray | memoryview, length: int, size: int, micro_bytes: int) -> Header:
    """Decode and validate the header of a received message of ``length`` bytes.

    ``size`` is the number of ranks (bounds the sender) and ``micro_bytes``
    the largest inline body this rank accepts.
    """
    if length < HEADER_SIZE:
        raise FrameError(
            f"malformed frame: {length} bytes, shorter than a {HEADER_SIZE}-byte header"
        )
    (
        magic,
        version,
        ftype,
        dtype,
        kind,
        algo,
        op,
        flags,
        sender,
        tag,
        wid,
        gen,
        step,
        segment,
        nbytes,
        count,
        param,
        context,
        _reserved,
    ) = _LAYOUT.unpack_from(buf, 0)
    if magic != MAGIC:
        raise FrameError(f"malformed frame: bad magic {magic:#010x} (expected {MAGIC:#010x})")
    if version != VERSION:
        raise FrameError(f"frame version {version} from a peer; this rank speaks {VERSION}")
    frame_type = _enum(FrameType, ftype, "frame type")
    h_dtype = _enum(DType, dtype, "dtype")
    h_kind = _enum(OpKind, kind, "kind")
    h_algo = _enum(AlgorithmCode, algo, "algorithm")
    h_op = _enum(ReduceOp, op, "reduce op")
    if flags & ~FLAG_INLINE:
        raise FrameError(f"malformed frame: unknown flags {flags:#x}")
    if not 0 <= sender < size:
        raise FrameError(f"malformed frame: sender rank {sender} outside 0..{size - 1}")
    if nbytes > MAX_BODY_BYTES:
        raise FrameError(f"malformed frame: body of {nbytes} bytes exceeds {MAX_BODY_BYTES}")
    if frame_type is FrameType.DATA and nbytes % h_dtype.itemsize:
        raise FrameError(
            f"malformed frame: {nbytes} bytes is not a whole number of {h_dtype.name} elements"
        )
    if flags & FLAG_INLINE:
        if nbytes > micro_bytes:
            raise FrameError(
                f"malformed frame: inline body of {nbytes} bytes exceeds micro_bytes={micro_bytes} "
                "(do all ranks use the same micro_bytes?)"
            )
        if length != HEADER_SIZE + nbytes:
            raise FrameError(
                f"malformed frame: message of {length} bytes, header announces {nbytes} inline"
            )
    else:
        if length != HEADER_SIZE:
            raise FrameError(f"malformed frame: {length - HEADER_SIZE} stray bytes after header")
        if not BODY_TAG_BASE <= tag < BODY_TAG_BASE + BODY_TAG_SPAN:
            raise FrameError(f"malformed frame: body tag {tag} outside the body tag range")
    return Header(
        frame_type=frame_type,
        dtype=h_dtype,
        kind=h_kind,
        algorithm=h_algo,
        op=h_op,
        flags=flags,
        sender=sender,
        body_tag=tag,
        wire_id=wid,
        generation=gen,
        step=step,
        segment=segment,
        nbytes=nbytes,
        count=count,
        param=param,
        context=context,
    )

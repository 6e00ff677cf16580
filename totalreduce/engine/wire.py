"""Wire protocol v2: messages of self-describing frames.

Everything a rank sends on the control tag is a **message**: a 24-byte message
header followed by one or more **frames** (coalescing: all frames ready for one
peer in one pass of the loop travel together, fusion without negotiation).  A
frame is the seed's "isend message head" grown into a fixed 72-byte layout that
says which op (wire id and generation), which step and segment, and the op's
shape (kind, algorithm, dtype, count, reduce op, param, group context), so any
receiver can place it without agreeing on order with the sender and can detect
two ranks that disagree about the op.

Message header (little-endian, ``MSG_SIZE`` = 24 bytes)::

    magic u32 | version u8 | reserved u8 | frame count u16 | sender i32 |
    control credit returned u32 | eager credit returned u64

Frame header (``FRAME_SIZE`` = 72 bytes)::

    type u8 | dtype u8 | kind u8 | algorithm u8 | reduce op u8 | flags u8 | reserved u16 |
    aux u32 | step u32 | segment u32 | priority i32 (as u32) |
    wire id u64 | generation u64 | byte count u64 | element count u64 | param i64 |
    context u64

Frame types:

- ``DATA``: an eager body of ``byte count`` bytes follows the header (padded
  to 8 bytes).  Only bodies up to ``micro_bytes`` travel eagerly.
- ``RTS`` (ready to send): a larger body waits at the sender; the receiver
  answers ``CTS`` (clear to send, ``aux`` = the tag the body must use) once it
  has a place for it, or ``REJECT`` when it has none (the op is not submitted
  there and the pool is full).  ``READY`` later says "submitted now, send again".
- ``NEED``: the sender is blocked waiting for the op; raise it.
- ``ERROR``: the op failed; the body is the UTF-8 message, ``param`` its code.
- ``PROBE`` / ``HAVE``: a rank whose op made no progress for a while asks its
  group who has submitted it; ranks that have answer ``HAVE``, so the stall
  warning can name the ranks that have not.
- ``BYE``: the sender's service shut down; its ops in flight will never finish.
- ``GONE`` (daemon mode, from a node's service): the process of client rank
  ``aux`` died; treat it as if it had said ``BYE``.
- ``JOIN`` (daemon mode, from a node's service): a new process has client rank
  ``aux``; if the old one left (``BYE`` or ``GONE``), forget it: its credits and
  tags start afresh.  With ``step`` 1: the node's session ended.  Both carry the
  node's session number as their generation and the name under which that session
  agreed with the others as their wire id (0: not yet).

:func:`split` validates every field of a message and its frames in one place
and raises :class:`FrameError` on anything malformed, so garbage never reaches
an allocation or a buffer.
"""

from __future__ import annotations

import functools
import hashlib
import struct

import numpy as np

from ..algorithms.codes import AlgorithmCode, OpKind
from ..dtypes import DType, ReduceOp
from ..errors import FrameError
from ..protocol import (  # the protocol's numbers, declared there once
    BODY_TAG_BASE,
    BODY_TAG_SPAN,
    BYE,
    CONTROL_TAG,
    CTS,
    DATA,
    ERROR,
    F_ALGO,
    F_AUX,
    F_CONTEXT,
    F_COUNT,
    F_DTYPE,
    F_FLAGS,
    F_GEN,
    F_KIND,
    F_NBYTES,
    F_OP,
    F_PARAM,
    F_PRIO,
    F_SEGMENT,
    F_STEP,
    F_TYPE,
    F_WID,
    FLAG_NEED,
    FRAME_FORMAT,
    FRAME_SIZE,
    GONE,
    HAVE,
    JOIN,
    MAIN_FRAME_TYPES,
    MAX_BODY_BYTES,
    MSG_FORMAT,
    MSG_SIZE,
    NEED,
    PROBE,
    READY,
    REJECT,
    RTS,
    FrameType,
)
from ..protocol import MAIN_MAGIC as MAGIC
from ..protocol import MAIN_VERSION as VERSION

MSG = struct.Struct(MSG_FORMAT)
FRAME = struct.Struct(FRAME_FORMAT)
assert MSG.size == MSG_SIZE and FRAME.size == FRAME_SIZE

#: The main loop's frame types, by name (for messages).
FRAME_TYPES = {int(t): t.name for t in FrameType if int(t) in MAIN_FRAME_TYPES}

__all__ = [
    "BODY_TAG_BASE", "BODY_TAG_SPAN", "BYE", "CONTROL_TAG", "CTS", "DATA", "ERROR", "F_ALGO",
    "F_AUX", "F_CONTEXT", "F_COUNT", "F_DTYPE", "F_FLAGS", "F_GEN", "F_KIND", "F_NBYTES",
    "F_OP", "F_PARAM", "F_PRIO", "F_SEGMENT", "F_STEP", "F_TYPE", "F_WID", "FLAG_NEED",
    "FRAME", "FRAME_SIZE", "FRAME_TYPES", "GONE", "HAVE", "JOIN", "MAGIC", "MAX_BODY_BYTES",
    "MSG", "MSG_SIZE", "NEED", "PROBE", "READY", "REJECT", "RTS", "SESSION_ID", "VERSION",
    "Frame", "pack_frame", "pack_message_header", "padded", "priority_of", "split",
    "wire_id",
]  # fmt: skip

_DTYPES = {int(d): d for d in DType}
_KINDS = frozenset(int(k) for k in OpKind)
_ALGOS = frozenset(int(a) for a in AlgorithmCode)
_OPS = frozenset(int(o) for o in ReduceOp)


Frame = tuple  # the 17 fields of FRAME, as unpacked


@functools.lru_cache(maxsize=65536, typed=True)
def wire_id(name: str | int) -> int:
    """Stable 64-bit id of an op name: the same on every rank, no coordination.

    >>> wire_id("fc1.grad") == wire_id("fc1.grad")
    True
    """
    if isinstance(name, bool) or not isinstance(name, (str, int)):
        raise TypeError(f"op names are str or int, got {type(name).__name__} {name!r}")
    raw = (b"s:" + name.encode()) if isinstance(name, str) else b"i:%d" % name
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little")


#: Daemon mode: the op by which a job's clients agree on their session at start.  Every
#: job starts with it, so no rank keeps a memory of it (see CommLoop._remember).
SESSION_ID = wire_id("\0totalreduce session")


def padded(nbytes: int) -> int:
    """Bytes an eager body takes in a message (frames start 8-byte aligned)."""
    return (nbytes + 7) & ~7


def pack_frame(
    buf: bytearray,
    ftype: int,
    shape: tuple[int, ...],
    flags: int,
    aux: int,
    step: int,
    segment: int,
    key: tuple[int, int],
    nbytes: int,
    priority: int = 0,
) -> None:
    """Append a frame header to ``buf``; ``shape`` is an op's (dtype, kind, algorithm,
    op, count, param, context), all ints; ``priority`` the op's (a node's service in
    daemon mode runs the op it joins at the priority its frames carry)."""
    dt, kind, algo, op, count, param, ctx = shape
    buf += FRAME.pack(
        ftype, dt, kind, algo, op, flags, 0, aux, step, segment, priority & 0xFFFFFFFF, key[0],
        key[1], nbytes, count, param, ctx,
    )  # fmt: skip


def priority_of(f: Frame) -> int:
    """The op priority a frame carries (a signed 32-bit value)."""
    v = f[F_PRIO]
    return v - (1 << 32) if v >= 1 << 31 else v


def pack_message_header(buf: bytearray, nframes: int, sender: int, ctl: int, eager: int) -> None:
    """Write the message header into the first ``MSG_SIZE`` bytes of ``buf``."""
    MSG.pack_into(buf, 0, MAGIC, VERSION, 0, nframes, sender, ctl, eager)


def split(
    buf: np.ndarray | bytes | bytearray,
    source: int,
    size: int,
    micro_bytes: int,
) -> tuple[int, int, list[tuple[Frame, int]]]:
    """Validate a message from rank ``source``: (control credit, eager credit, frames).

    Each frame comes with the offset of its body in ``buf`` (eager DATA and
    ERROR bodies; ``-1`` for frames without one).  ``size`` bounds ranks and
    ``micro_bytes`` the eager bodies this rank accepts.
    """
    view = memoryview(buf)  # type: ignore[arg-type]  # numpy arrays export the buffer protocol
    length = view.nbytes
    if length < MSG_SIZE:
        raise FrameError(f"malformed message: {length} bytes, shorter than its header")
    magic, version, _r, nframes, sender, ctl, eager = MSG.unpack_from(view, 0)
    if magic != MAGIC:
        raise FrameError(f"malformed message: bad magic {magic:#010x} (expected {MAGIC:#010x})")
    if version != VERSION:
        raise FrameError(f"protocol version {version} from a peer; this rank speaks {VERSION}")
    if sender != source:
        raise FrameError(f"malformed message: says sender {sender}, came from rank {source}")
    frames: list[tuple[Frame, int]] = []
    off = MSG_SIZE
    for _ in range(nframes):
        if off + FRAME_SIZE > length:
            raise FrameError(f"truncated message: {length} bytes, frame {len(frames)} missing")
        f = FRAME.unpack_from(view, off)
        off += FRAME_SIZE
        ftype, dt, nbytes = f[0], f[1], f[13]
        if ftype not in FRAME_TYPES:
            raise FrameError(f"malformed frame: unknown frame type {ftype}")
        if f[F_FLAGS] & ~FLAG_NEED:
            raise FrameError(f"malformed frame: unknown flags {f[F_FLAGS]:#x}")
        if nbytes > MAX_BODY_BYTES:
            raise FrameError(f"malformed frame: body of {nbytes} bytes exceeds {MAX_BODY_BYTES}")
        body = -1
        if ftype == DATA or ftype == RTS:
            dtype = _DTYPES.get(dt)
            if dtype is None:
                raise FrameError(f"malformed frame: unknown dtype code {dt}")
            if f[F_KIND] not in _KINDS:
                raise FrameError(f"malformed frame: unknown kind code {f[F_KIND]}")
            if f[F_ALGO] not in _ALGOS:
                raise FrameError(f"malformed frame: unknown algorithm code {f[F_ALGO]}")
            if f[F_OP] not in _OPS:
                raise FrameError(f"malformed frame: unknown reduce op code {f[F_OP]}")
            if nbytes % dtype.itemsize:
                raise FrameError(
                    f"malformed frame: {nbytes} bytes is not a whole number of "
                    f"{dtype.name.lower()} elements"
                )
        if ftype == DATA or ftype == ERROR:
            if ftype == DATA and nbytes > micro_bytes:
                raise FrameError(
                    f"malformed frame: eager body of {nbytes} bytes exceeds "
                    f"micro_bytes={micro_bytes} (do all ranks use the same micro_bytes?)"
                )
            if off + nbytes > length:
                raise FrameError(
                    f"truncated message: frame announces {nbytes} body bytes, {length - off} left"
                )
            body = off
            off += padded(nbytes)
        frames.append((f, body))
    if off < length:
        raise FrameError(f"malformed message: {length - off} stray bytes after {nframes} frames")
    return ctl, eager, frames

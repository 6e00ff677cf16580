"""Control messages between a training process and its node's service: framing and validation.

This module owns the wire format of the Unix socket.  A message is a 4-byte
little-endian length followed by that many bytes of UTF-8 JSON holding one
object whose ``"t"`` field names its type.  Messages are small: gradients travel
through shared memory, the socket only says where they are.  A length over
:data:`MAX_MESSAGE` is refused before anything is allocated.

File descriptors (the shared memory a client registers) ride along as
``SCM_RIGHTS`` ancillary data of the ``sendmsg`` carrying the message's first
byte; the reader queues them in arrival order and the message that expects one
takes the oldest.

Messages from a client: ``hello`` (with the control block's descriptor),
``register`` (with a region's descriptor), ``unregister``, ``op`` and ``bye``.
From the service: ``welcome``, ``registered`` and ``error``.  :class:`Fields`
checks every field of a decoded message and names the field and the value it
refuses.
"""

from __future__ import annotations

import array
import json
import os
import socket
import struct
from collections import deque
from typing import Any

from ..errors import TotalReduceError

#: Protocol version a hello carries; a service refuses any other.
VERSION = 1
#: Largest message body in bytes (the length prefix excluded).
MAX_MESSAGE = 64 << 10
#: Most descriptors one ``sendmsg`` may carry.
MAX_FDS = 2
_LEN = struct.Struct("<I")
_ANCILLARY = socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)

#: Largest count of elements, offset or region size a message may name (1 TiB).
MAX_SIZE = 1 << 40
#: Longest op name (characters).
MAX_NAME = 1024


class ProtocolError(TotalReduceError):
    """A control message is malformed, oversized or not allowed now.

    ``fatal`` means the byte stream can no longer be followed (a bad length
    prefix): the connection must be closed after the error reply.
    """

    def __init__(self, message: str, *, fatal: bool = False) -> None:
        super().__init__(message)
        self.fatal = fatal


def encode(msg: dict[str, Any]) -> bytes:
    """The framed bytes of ``msg``."""
    body = json.dumps(msg, separators=(",", ":"), allow_nan=False).encode()
    if len(body) > MAX_MESSAGE:
        raise ProtocolError(f"a {msg.get('t')!r} message of {len(body)} bytes exceeds the limit")
    return _LEN.pack(len(body)) + body


def send(sock: socket.socket, msg: dict[str, Any], fds: tuple[int, ...] = ()) -> None:
    """Send one message (and ``fds`` with its first byte) on a blocking socket."""
    data = memoryview(encode(msg))
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    sent = sock.sendmsg([data], anc)
    while sent < len(data):
        data = data[sent:]
        sent = sock.send(data)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")


def decode(body: bytes) -> dict[str, Any]:
    """One message body to its object; ProtocolError if it is not a JSON object with a type."""
    try:
        msg = json.loads(body.decode("utf-8"), parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:
        raise ProtocolError(f"message is not valid UTF-8 JSON ({exc})") from None
    if not isinstance(msg, dict):
        raise ProtocolError(f"message is a JSON {type(msg).__name__}, expected an object")
    t = msg.get("t")
    if not isinstance(t, str):
        raise ProtocolError("message has no string field 't' (its type)")
    return msg


class MessageReader:
    """Reassembles framed messages from a byte stream and queues the descriptors received."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self.fds: deque[int] = deque()

    def feed(self, data: bytes, fds: list[int]) -> None:
        self._buf += data
        self.fds.extend(fds)

    def next(self) -> dict[str, Any] | None:
        """The next complete message, or None; ProtocolError for a bad one."""
        if len(self._buf) < _LEN.size:
            return None
        (n,) = _LEN.unpack_from(self._buf)
        if n == 0 or n > MAX_MESSAGE:
            self._buf.clear()
            raise ProtocolError(f"message length {n} is outside 1..{MAX_MESSAGE} bytes", fatal=True)
        if len(self._buf) < _LEN.size + n:
            return None
        body = bytes(self._buf[_LEN.size : _LEN.size + n])
        del self._buf[: _LEN.size + n]
        return decode(body)

    def take_fd(self, what: str) -> int:
        """The oldest descriptor received, for ``what``; ProtocolError if none came."""
        if not self.fds:
            raise ProtocolError(f"{what} came without its file descriptor")
        return self.fds.popleft()

    def close_fds(self) -> None:
        while self.fds:
            try:
                os.close(self.fds.popleft())
            except OSError:
                pass


def receive(sock: socket.socket, reader: MessageReader, limit: int = 256 << 10) -> bool:
    """Read what the socket has into ``reader``; False at end of stream.

    Raises ProtocolError (fatal) when descriptors were cut off, and the socket's
    own errors (``BlockingIOError`` when a non-blocking socket has nothing).
    """
    data, anc, flags, _ = sock.recvmsg(limit, _ANCILLARY)
    fds: list[int] = []
    for level, kind, payload in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            usable = len(payload) - len(payload) % array.array("i").itemsize
            fds.extend(array.array("i", payload[:usable]))
    reader.feed(data, fds)
    if flags & socket.MSG_CTRUNC:
        raise ProtocolError(f"more than {MAX_FDS} file descriptors in one message", fatal=True)
    return bool(data)


def read_message(sock: socket.socket, reader: MessageReader) -> dict[str, Any]:
    """Block (within the socket's timeout) until one whole message arrived; return it."""
    while True:
        msg = reader.next()
        if msg is not None:
            return msg
        if not receive(sock, reader):
            raise ConnectionError("the peer closed the connection")


class Fields:
    """Checked access to a message's fields; every error names the field and the value."""

    def __init__(self, msg: dict[str, Any], allowed: frozenset[str]) -> None:
        self.msg = msg
        self.t = str(msg.get("t"))
        extra = set(msg) - allowed - {"t"}
        if extra:
            raise ProtocolError(f"{self.t!r} message has unknown fields {sorted(extra)}")

    def _bad(self, name: str, want: str) -> ProtocolError:
        value = repr(self.msg.get(name))
        if len(value) > 80:
            value = value[:77] + "..."
        return ProtocolError(f"{self.t!r} message: field {name!r} must be {want}, got {value}")

    def int(self, name: str, lo: int = 0, hi: int = MAX_SIZE) -> int:
        v = self.msg.get(name)
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise self._bad(name, f"an integer in {lo}..{hi}")
        return v

    def opt_int(self, name: str, lo: int = 0, hi: int = MAX_SIZE) -> int | None:
        if self.msg.get(name) is None:
            return None
        return self.int(name, lo, hi)

    def choice(self, name: str, choices: tuple[str, ...]) -> str:
        v = self.msg.get(name)
        if not isinstance(v, str) or v not in choices:
            raise self._bad(name, f"one of {', '.join(choices)}")
        return v

    def opt_str(self, name: str, max_len: int = 64) -> str | None:
        v = self.msg.get(name)
        if v is None:
            return None
        if not isinstance(v, str) or not 0 < len(v) <= max_len:
            raise self._bad(name, f"a string of 1..{max_len} characters or null")
        return v

    def name(self, key: str = "name") -> str | int | None:
        """An op name: a string, an integer (64-bit) or null (unnamed)."""
        v = self.msg.get(key)
        if v is None:
            return None
        if isinstance(v, str) and 0 < len(v) <= MAX_NAME:
            return v
        if isinstance(v, int) and not isinstance(v, bool) and -(1 << 63) <= v < (1 << 63):
            return v
        raise self._bad(key, f"a string of 1..{MAX_NAME} characters, a 64-bit integer or null")

    def place(self, name: str) -> tuple[int, int] | None:
        """A ``[region, offset]`` pair or null."""
        v = self.msg.get(name)
        if v is None:
            return None
        if (
            isinstance(v, list)
            and len(v) == 2
            and all(isinstance(e, int) and not isinstance(e, bool) for e in v)
            and 0 < v[0] <= MAX_SIZE
            and 0 <= v[1] <= MAX_SIZE
        ):
            return int(v[0]), int(v[1])
        raise self._bad(name, "null or [region id >= 1, byte offset >= 0]")

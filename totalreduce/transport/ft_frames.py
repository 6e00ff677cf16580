"""Messages between a fault-tolerant member and its node's service (docs/fault_tolerance.md).

One message: a 4-byte little-endian length of a UTF-8 JSON object (at most 64 KiB), an
8-byte little-endian length of a payload (an op's bytes; at most ``MAX_PAYLOAD``), the
object, the payload.  The socket is the node's ``ft{n}.sock`` beside its ``node{n}.sock``.
A message without payload may pass one descriptor with its first bytes (``SCM_RIGHTS``:
:func:`send_fd`): a member's memory shared for its averages (``{"kind": "shm"}``).
"""

from __future__ import annotations

import json
import os
import socket
import struct
from pathlib import Path
from typing import Any

from .. import protocol as P
from ..errors import TotalReduceError

#: The protocol's version, in the hello.
VERSION = P.FT_VERSION
MAX_HEADER = P.FT_MAX_HEADER
MAX_PAYLOAD = P.FT_MAX_PAYLOAD
_LENS = struct.Struct("<IQ")
#: A payload up to this size goes in the same write as its header.
_SMALL = 64 << 10


class FrameError(TotalReduceError):
    """A malformed message, or the connection ended."""


def ft_socket(directory: Path, node: int) -> Path:
    return Path(directory) / f"ft{node}.sock"


def frame(header: dict[str, Any]) -> bytes:
    """The bytes of a message without payload."""
    raw = json.dumps(header, separators=(",", ":")).encode()
    return _LENS.pack(len(raw), 0) + raw


def send(sock: socket.socket, header: dict[str, Any], payload: Any = b"") -> None:
    raw = json.dumps(header, separators=(",", ":")).encode()
    view = memoryview(payload).cast("B") if len(payload) else memoryview(b"")
    if view.nbytes and view.nbytes <= _SMALL:  # one write: one wakeup of the reader
        sock.sendall(b"".join((_LENS.pack(len(raw), view.nbytes), raw, view)))
        return
    sock.sendall(_LENS.pack(len(raw), view.nbytes) + raw)
    if view.nbytes:
        sock.sendall(view)


def _exact(sock: socket.socket, n: int, into: bytearray | None = None) -> bytearray:
    buf = bytearray(n) if into is None else into
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise FrameError("the connection ended")
        got += k
    return buf


def send_fd(sock: socket.socket, header: dict[str, Any], fd: int) -> None:
    """A message without payload that passes the descriptor ``fd`` (``SCM_RIGHTS``)."""
    data = frame(header)
    sent = socket.send_fds(sock, [data], [fd])
    if sent < len(data):
        sock.sendall(data[sent:])


def recv(sock: socket.socket, fds: list[int] | None = None) -> tuple[dict[str, Any], bytearray]:
    """One message: (header, payload).  Raises :class:`FrameError` on a bad one.  With
    ``fds``, the descriptors a message passes (:func:`send_fd`) are appended to it."""
    if fds is None:
        lens = bytes(_exact(sock, _LENS.size))
    else:
        first, got, _flags, _addr = socket.recv_fds(sock, _LENS.size, 4)
        fds.extend(got)
        if not first:
            raise FrameError("the connection ended")
        if len(first) < _LENS.size:
            first += bytes(_exact(sock, _LENS.size - len(first)))
        lens = first
    h, p = _LENS.unpack(lens)
    if h > MAX_HEADER or p > MAX_PAYLOAD:
        raise FrameError(f"a message of {h} header bytes and {p} payload bytes is too large")
    try:
        header = json.loads(bytes(_exact(sock, h)))
    except ValueError as exc:
        raise FrameError(f"a message's header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise FrameError("a message's header is not a JSON object")
    return header, _exact(sock, p) if p else bytearray()


def find_ft_socket(explicit: str | os.PathLike[str] | None = None) -> Path:
    """The member's socket: ``explicit``, ``$TOTALREDUCE_FT_SOCKET``, else the only
    ``ft*.sock`` of the default directory."""
    from .hello import default_dir

    path = explicit or os.environ.get("TOTALREDUCE_FT_SOCKET")
    if path:
        return Path(path)
    directory = default_dir()
    found = sorted(directory.glob("ft*.sock")) if directory.is_dir() else []
    if len(found) != 1:
        raise TotalReduceError(
            f"fault-tolerant mode needs its node's service: found {len(found)} ft*.sock in "
            f"{directory} ({[str(f) for f in found]}); start the services with "
            "'totalreduce serve --fault-tolerant' and set TOTALREDUCE_FT_SOCKET (embedded mode, "
            "with no service, has no fault tolerance: a dead rank ends the job)"
        )
    return found[0]

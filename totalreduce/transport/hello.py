"""The daemon's socket: hello, welcome and goodbye between a client process and its node's service.

This module owns the Unix socket's wire format and the client's side of it.
The socket carries only what sets up and tears down a client's place at its
node's service: ``hello`` (client), ``welcome`` with the node's arena and two
eventfds (the client's and the service's) as ``SCM_RIGHTS`` descriptors
(service), ``error`` (service) and ``bye`` (client).  Ops and data never cross
it: they travel through the arena (:mod:`totalreduce.transport.arena`).  The
connection stays open while the client lives: its end tells the service the
client is gone, and the service's end tells the client.

A message is a 4-byte little-endian length followed by that many bytes of
UTF-8 JSON holding one object whose ``"t"`` field names its type.  A length
over :data:`MAX_MESSAGE` is refused before anything is allocated, and
:class:`Fields` checks every field of a decoded message, naming the field and
the value it refuses.

Paths: the socket of node ``n`` is ``node{n}.sock`` in a directory that is
``$XDG_RUNTIME_DIR/totalreduce`` (else ``/tmp/totalreduce-$UID``) unless the
service was given another; a client finds it from ``socket=``,
``$TOTALREDUCE_SOCKET``, or the one socket of the default directory.
"""

from __future__ import annotations

import array
import json
import os
import socket
import struct
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import TotalReduceError

#: Protocol version a hello carries; a service refuses any other (5: the arena's meeting
#: place, and clients that sleep on a futex word of their control block).
VERSION = 5
#: Largest message body in bytes (the length prefix excluded).
MAX_MESSAGE = 64 << 10
#: Most descriptors one ``sendmsg`` may carry.
MAX_FDS = 3
_LEN = struct.Struct("<I")
_ANCILLARY = socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)

#: Largest count of elements, offset or region size a message may name (1 TiB).
MAX_SIZE = 1 << 40
ENV_SOCKET = "TOTALREDUCE_SOCKET"


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


_Int = int  # Fields has a method named int: its later annotations use this name


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

    def opt_int(self, name: str, lo: _Int = 0, hi: _Int = MAX_SIZE) -> _Int | None:
        if self.msg.get(name) is None:
            return None
        return self.int(name, lo, hi)

    def int_in(self, obj: dict[str, Any], name: str, lo: _Int = 0, hi: _Int = MAX_SIZE) -> _Int:
        v = obj.get(name)
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise self._bad(name, f"an integer in {lo}..{hi}")
        return v

    def choice(self, name: str, choices: tuple[str, ...]) -> str:
        v = self.msg.get(name)
        if not isinstance(v, str) or v not in choices:
            raise self._bad(name, f"one of {', '.join(choices)}")
        return v

    def opt_str(self, name: str, max_len: _Int = 64) -> str | None:
        v = self.msg.get(name)
        if v is None:
            return None
        if not isinstance(v, str) or not 0 < len(v) <= max_len:
            raise self._bad(name, f"a string of 1..{max_len} characters or null")
        return v


# ---------------------------------------------------------------------- paths


def default_dir() -> Path:
    """The directory of the services' sockets when none is given."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return Path(runtime) / "totalreduce"
    return Path("/tmp") / f"totalreduce-{os.getuid()}"


def node_socket(directory: Path, node: int) -> Path:
    return directory / f"node{node}.sock"


def find_socket(explicit: str | os.PathLike[str] | None = None) -> Path:
    """The socket a client uses: ``explicit``, ``$TOTALREDUCE_SOCKET``, or the one in the
    default directory (an error if it holds none or several)."""
    chosen = explicit if explicit is not None else os.environ.get(ENV_SOCKET)
    if chosen:
        return Path(chosen)
    directory = default_dir()
    found = sorted(directory.glob("node*.sock")) if directory.is_dir() else []
    if len(found) == 1:
        return found[0]
    if not found:
        raise TotalReduceError(
            f"no totalreduce service socket in {directory}: start one with "
            "`mpiexec -n NODES totalreduce serve`, or pass socket=PATH (or set "
            f"{ENV_SOCKET})"
        )
    names = ", ".join(str(p) for p in found)
    raise TotalReduceError(
        f"several service sockets in {directory} ({names}): pass socket=PATH or set {ENV_SOCKET}"
    )


# ---------------------------------------------------------------------- the client's side

#: Engine options every rank of a daemon world must share; the service's values win.
SHARED_OPTIONS = ("segment_bytes", "micro_bytes", "floating_pool_bytes")

HELLO_FIELDS = frozenset({"version", "pid", "local_rank"})
WELCOME_FIELDS = frozenset(
    {"rank", "size", "node", "nodes", "local", "local_clients", "epoch", "pid", "options",
     "incarnation", "arena_bytes"}
)  # fmt: skip


@dataclass(frozen=True)
class Welcome:
    """Where a client stands in its daemon world, as its node's service told it."""

    rank: int
    size: int
    node: int
    nodes: int
    local: int
    local_clients: int
    epoch: int
    pid: int
    options: dict[str, int]
    #: Which process of its rank this client is (increases with every client a node
    #: admits): a goodbye or death notice of an earlier process of the rank that arrives
    #: late is told apart from this one's.
    incarnation: int = 0
    #: Bytes of the node's arena (its memory file is the welcome's first descriptor).
    arena_bytes: int = 0


def parse_welcome(msg: dict[str, Any]) -> Welcome:
    f = Fields(msg, WELCOME_FIELDS)
    nodes = f.int("nodes", 1, 1 << 20)
    local_clients = f.int("local_clients", 1, 1024)
    options = msg.get("options")
    if not isinstance(options, dict) or set(options) != set(SHARED_OPTIONS):
        raise f._bad("options", f"an object with exactly {', '.join(SHARED_OPTIONS)}")
    for k in SHARED_OPTIONS:
        f.int_in(options, k)
    w = Welcome(
        rank=f.int("rank", 0, nodes * local_clients - 1),
        size=f.int("size", 1, nodes * local_clients),
        node=f.int("node", 0, nodes - 1),
        nodes=nodes,
        local=f.int("local", 0, local_clients - 1),
        local_clients=local_clients,
        epoch=f.int("epoch", 0, 1 << 40),
        pid=f.int("pid", 1, 1 << 31),
        options={k: int(options[k]) for k in SHARED_OPTIONS},
        incarnation=f.int("incarnation", 1, 1 << 62),
        arena_bytes=f.int("arena_bytes", 1, MAX_SIZE),
    )
    if w.rank != w.node * local_clients + w.local:
        raise ProtocolError(f"welcome: rank {w.rank} is not node {w.node}, local {w.local}")
    return w


def attach(
    path: str | os.PathLike[str] | None = None,
    local_rank: int | None = None,
    timeout: float = 30.0,
) -> Any:
    """Say hello to the node's service at ``path``; this client's :class:`DaemonClient`.

    ``local_rank`` asks for a slot (default: the lowest free one).  Raises
    :class:`TotalReduceError` naming the path when no service answers or it
    refuses (all slots taken, the slot busy, another protocol version).
    """
    where = find_socket(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    reader = MessageReader()
    try:
        try:
            sock.connect(str(where))
        except OSError as exc:
            raise TotalReduceError(
                f"no totalreduce service answers on {where} ({exc.strerror or exc}); start "
                "one with `mpiexec -n NODES totalreduce serve`"
            ) from None
        send(sock, {"t": "hello", "version": VERSION, "pid": os.getpid(),
                    "local_rank": local_rank})  # fmt: skip
        msg = read_message(sock, reader)
        if msg.get("t") == "error":
            raise TotalReduceError(f"the service on {where} refused: {msg.get('message')}")
        if msg.get("t") != "welcome":
            raise ProtocolError(f"the service on {where} answered {msg.get('t')!r}, not welcome")
        w = parse_welcome(msg)
        arena_fd = reader.take_fd("welcome (arena)")
        own_fd = reader.take_fd("welcome (client's eventfd)")
        service_fd = reader.take_fd("welcome (service's eventfd)")
    except BaseException:
        reader.close_fds()
        sock.close()
        raise
    from .arena import Arena

    try:
        arena = Arena.attach(arena_fd, w.arena_bytes)
    except BaseException:
        for fd in (own_fd, service_fd):
            os.close(fd)
        _goodbye(sock)
        raise
    # What the thin path (service/thin.py) takes over: the node's arena, this client's
    # and the service's eventfds, the socket (whose end says the service is gone).
    return DaemonClient(w, str(where), ArenaLink(arena, w, own_fd, service_fd, sock, str(where)))


@dataclass
class ArenaLink:
    """What a thin client needs of its node's service, from the welcome."""

    arena: Any
    welcome: Welcome
    eventfd: int
    service_eventfd: int
    sock: socket.socket
    where: str


class DaemonClient:
    """A daemon client's place in its world, as its node's service told it (what a
    :class:`~totalreduce.service.service.Service` takes instead of a transport: it runs
    no engine, and its ops go through ``arena``)."""

    #: a daemon's client (``totalreduce.torch.horovod.mpi_enabled`` says no MPI here)
    daemon = True

    def __init__(self, welcome: Welcome, socket_path: str, arena: ArenaLink) -> None:
        self.welcome = welcome
        self.rank, self.size = welcome.rank, welcome.size
        self.epoch = welcome.epoch
        self.options = dict(welcome.options)
        self.socket_path = socket_path
        self.arena = arena
        self.description = (
            f"daemon (rank {welcome.rank} of {welcome.size}: local client {welcome.local} of "
            f"{welcome.local_clients} of node {welcome.node} of {welcome.nodes}; shared memory "
            f"arena of the service pid {welcome.pid}, {socket_path})"
        )

    def node_layout(self) -> tuple[int, int, int, int]:
        """(local_rank, local_size, cross_rank, cross_size): the node's clients and the
        nodes."""
        w = self.welcome
        return w.local, w.local_clients, w.node, w.nodes

    def close(self) -> None:
        """Say bye and leave (the thin client let go of the arena and eventfds)."""
        _goodbye(self.arena.sock)


def _goodbye(sock: socket.socket) -> None:
    """Say bye and leave."""
    if sock.fileno() < 0:
        return
    try:
        send(sock, {"t": "bye"})
    except OSError:
        pass
    sock.close()

"""The per-node service's main thread: clients, jobs, local phases, faults and shutdown.

A :class:`Daemon` owns the listening socket, one :class:`Client` per
connection, the :class:`~.rendezvous.Rendezvous` of the ops in flight and the
notices exchanged with the other nodes' services.  It runs an event loop on a
selector; the engine (an embedded :class:`~totalreduce.Service` of this node)
runs in its own threads, and its completion callbacks only queue the op and
wake the loop (with one local client they also flip the client's completion
flag, which is all there is to deliver).

**Jobs.** The ``N`` local clients (``--local-clients N``) of a job each hold a
local rank.  The k-th submission of name ``n`` by every local client forms one
rendezvous, which becomes generation k of engine op ``e{job}/n`` (the job
number prefixes engine names, so a new job starts its generations at 0 on every
node).  A job ends on a node when all its clients have left; the next client to
attach starts the next job.

**Faults.** A client that dies (its connection closes without ``bye``) or
leaves with ops in flight *fails the job* on its node: every op still waiting
for local clients fails at once, on this node and, through the engine's abort,
on every node; ops already running across nodes get ``abort_timeout`` seconds
to finish; every later submission of the job fails at once; and the other
nodes are told, so their ops of the job fail the same way instead of waiting.
A client that says ``bye`` with nothing in flight just leaves; an op that would
need it afterwards fails at once.  Nothing a client sends can stop the
service: a malformed message gets an error reply and a log line.

**Shutdown** (SIGTERM/SIGINT, or a notice that another node's service
stopped): stop accepting, fail the ops waiting for local clients, give running
ops ``drain_timeout`` seconds (none if a peer stopped), abort the rest, tell the
other nodes, close every connection, stop the engine.
"""

from __future__ import annotations

import logging
import os
import selectors
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..dtypes import DType, ReduceOp
from ..errors import (
    InvalidArgumentError,
    OpFailedError,
    OpMismatchError,
    TotalReduceError,
)
from ..group import Group
from ..service.handle import Handle
from ..service.service import Service
from . import protocol, shm
from .peers import PeerChannel
from .protocol import Fields, ProtocolError
from .rendezvous import DTYPES, OPS, Contribution, NameKey, OpShape, Rendezvous, State
from .sockets import peer_credentials

log = logging.getLogger("totalreduce.daemon.server")

FREE, ATTACHED, LEFT = "free", "attached", "left"
HELLO_TIMEOUT_S = 10.0
MAX_REGIONS = 1 << 16
MAX_PROTOCOL_ERRORS = 16
NOTICE_POLL_S = 0.005
# The engine's abort tells other nodes an op failed, not why; a local mismatch says so in
# its text, and the other nodes' services raise it to their clients as a mismatch too.
MISMATCH = "mismatch between local clients"
_OP_FIELDS = frozenset(
    {
        "slot",
        "seq",
        "kind",
        "name",
        "gen",
        "dtype",
        "count",
        "op",
        "root",
        "prio",
        "algo",
        "in",
        "out",
    }
)


@dataclass(eq=False)
class Client:
    """One connection to the service and, once it said hello, one local client of the job."""

    id: int
    sock: socket.socket
    pid: int
    uid: int
    reader: protocol.MessageReader = field(default_factory=protocol.MessageReader)
    local_rank: int | None = None
    rank: int = -1
    epoch: int = -1
    control: shm.ControlBlock | None = None
    regions: dict[int, shm.SharedRegion] = field(default_factory=dict)
    unfinished: set[Rendezvous] = field(default_factory=set)
    submitted: int = 0
    errors: int = 0
    closed: bool = False
    connected: float = field(default_factory=time.monotonic)
    wake_fd: int | None = None
    wake_lock: threading.Lock = field(default_factory=threading.Lock)

    def signal(self) -> None:
        """Wake the client's threads blocked in ``wait()`` (if any) after a slot ended."""
        control = self.control
        if control is None or control.waiters <= 0:
            return
        with self.wake_lock:  # never write to a descriptor number closed and reused since
            if self.wake_fd is not None:
                try:
                    os.eventfd_write(self.wake_fd, 1)
                except OSError:
                    pass

    def close_wake(self) -> None:
        with self.wake_lock:
            if self.wake_fd is not None:
                os.close(self.wake_fd)
                self.wake_fd = None

    def describe(self) -> str:
        who = f"client {self.id} (pid {self.pid}, uid {self.uid}"
        if self.local_rank is not None:
            who += f", rank {self.rank}, local rank {self.local_rank}"
        return who + ")"


class Daemon:
    """The service of one node (see the module docstring).

    ``service`` is this node's engine; ``peers`` the notice channel to the
    other nodes; ``listener`` the bound, listening socket at ``path``.
    """

    def __init__(
        self,
        service: Service,
        peers: PeerChannel,
        listener: socket.socket,
        path: Path,
        *,
        local_clients: int,
        abort_timeout: float = 10.0,
        drain_timeout: float = 10.0,
    ) -> None:
        self.svc = service
        self.peers = peers
        self.listener: socket.socket | None = listener
        self.path = path
        self._path_ino = os.stat(path).st_ino
        self.node = service.rank
        self.nodes = service.size
        self.n = local_clients
        self.abort_timeout = abort_timeout
        self.drain_timeout = drain_timeout
        self.stall_warning_s = service.config.stall_warning_s

        self.sel = selectors.DefaultSelector()
        self.wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.sel.register(listener, selectors.EVENT_READ, "listen")
        self.sel.register(self.wake_fd, selectors.EVENT_READ, "wake")
        self.completions: deque[tuple[Rendezvous, BaseException | None]] = deque()
        self.clients: dict[int, Client] = {}
        self._next_client = 1

        # the current job on this node
        self.epoch = 0
        self.used = False
        self.failed_reason: str | None = None
        self.notice_sent = False
        self.slot_state = [FREE] * self.n
        self.slot_client: list[Client | None] = [None] * self.n
        self.left_reason: list[str] = [""] * self.n
        self.next_gen: list[dict[NameKey, int]] = [{} for _ in range(self.n)]
        self.unnamed: list[int] = [0] * self.n
        self.engine_next: dict[str, int] = {}
        self.remote_closed: dict[int, str] = {}

        self.rdvs: dict[tuple[int, NameKey, int], Rendezvous] = {}
        self.stopping = False
        self.stop_reason = ""
        self.stop_deadline = 0.0
        self.signal: str | None = None
        self._next_timer = 0.0

    # ------------------------------------------------------------------ loop

    def wake(self) -> None:
        try:
            os.eventfd_write(self.wake_fd, 1)
        except OSError:
            pass

    def on_signal(self, name: str) -> None:
        """Called from a signal handler: only records it and wakes the loop."""
        self.signal = name
        self.wake()

    def run(self) -> int:
        """Serve until stopped; returns the exit status."""
        # Sockets, completions (an eventfd) and signals wake the selector; only the
        # notices of other nodes and the timers need polling, every few milliseconds,
        # so the main thread leaves the interpreter lock to the engine's threads.
        next_notices = 0.0
        while True:
            now = time.monotonic()
            timeout = max(0.0, min(next_notices, self._next_timer) - now)
            events = self.sel.select(timeout)
            for key, _ in events:
                try:
                    self._dispatch(key.data)
                except Exception:  # never let one connection stop the service
                    log.exception("node %d: error while handling an event", self.node)
            try:
                if self.signal is not None:
                    name, self.signal = self.signal, None
                    self.request_stop(f"received {name}")
                while self.completions:
                    rdv, error = self.completions.popleft()
                    self._finished(rdv, error)
                now = time.monotonic()
                if now >= next_notices:
                    next_notices = now + NOTICE_POLL_S
                    for notice in self.peers.poll():
                        self._on_notice(notice)
                if now >= self._next_timer:
                    self._next_timer = now + 0.05
                    self._timers(now)
                if self.stopping and self._shutdown_ready(now):
                    break
            except Exception:  # a bug must not stop the service: log it and go on
                log.exception("node %d: error in the service loop", self.node)
        self._close_all()
        return 0

    def _dispatch(self, data: Any) -> None:
        if data == "listen":
            self._accept()
        elif data == "wake":
            try:
                os.eventfd_read(self.wake_fd)
            except BlockingIOError:
                pass
        else:
            self._readable(data)

    # ------------------------------------------------------------------ connections

    def _accept(self) -> None:
        assert self.listener is not None
        try:
            sock, _ = self.listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        pid, uid, _gid = peer_credentials(sock)
        if uid != os.getuid():
            log.warning(
                "node %d: refused a connection from pid %d of uid %d (this service belongs to "
                "uid %d)",
                self.node,
                pid,
                uid,
                os.getuid(),
            )
            _reply_and_close(
                sock,
                {
                    "t": "error",
                    "fatal": True,
                    "message": f"refused: uid {uid} is not the service's user (uid {os.getuid()})",
                },
            )
            return
        sock.setblocking(False)
        client = Client(self._next_client, sock, pid, uid)
        self._next_client += 1
        self.clients[client.id] = client
        self.sel.register(sock, selectors.EVENT_READ, client)
        log.debug("node %d: connection %d from pid %d", self.node, client.id, pid)

    def _readable(self, client: Client) -> None:
        try:
            more = protocol.receive(client.sock, client.reader)
        except (BlockingIOError, InterruptedError):
            return
        except ProtocolError as exc:
            self._protocol_error(client, exc)
            return
        except OSError as exc:
            self._depart(client, f"lost its connection ({exc})", clean=False)
            return
        while not client.closed:
            try:
                msg = client.reader.next()
                if msg is None:
                    break
                self._handle(client, msg)
            except ProtocolError as exc:
                self._protocol_error(client, exc)
            except Exception as exc:  # a bug here must not take the service down
                log.exception(
                    "node %d: handling a message of %s failed", self.node, client.describe()
                )
                self._protocol_error(client, ProtocolError(f"internal error: {exc}"))
        if not more and not client.closed:
            self._depart(client, "disconnected without saying goodbye", clean=False)

    def _send(self, client: Client, msg: dict[str, Any]) -> None:
        if client.closed:
            return
        data = protocol.encode(msg)
        try:
            sent = client.sock.send(data)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError as exc:
            self._depart(client, f"lost its connection ({exc})", clean=False)
            return
        if sent != len(data):
            self._depart(client, "does not read its replies", clean=False)

    def _protocol_error(self, client: Client, exc: ProtocolError) -> None:
        client.errors += 1
        # before its hello a connection is nobody: any bad message ends it
        fatal = exc.fatal or client.local_rank is None or client.errors > MAX_PROTOCOL_ERRORS
        log.warning(
            "node %d: %s sent a bad message: %s%s",
            self.node,
            client.describe(),
            exc,
            " (closing the connection)" if fatal else "",
        )
        self._send(client, {"t": "error", "message": str(exc), "fatal": fatal})
        if fatal and not client.closed:
            self._depart(client, f"was disconnected after a bad message ({exc})", clean=False)

    # ------------------------------------------------------------------ messages

    def _handle(self, client: Client, msg: dict[str, Any]) -> None:
        t = msg["t"]
        if client.local_rank is None:
            if t != "hello":
                raise ProtocolError(f"the first message must be 'hello', not {t!r}", fatal=True)
            self._hello(client, msg)
            return
        # Descriptors arrive with the read holding their message's first byte, which may
        # also hold earlier messages: each message that needs one takes the oldest.  A
        # client sending stray descriptors only confuses its own registrations.
        if len(client.reader.fds) > 4 * protocol.MAX_FDS:
            raise ProtocolError("too many file descriptors without a message", fatal=True)
        if t == "op":
            self._op(client, msg)
        elif t == "register":
            self._register(client, msg)
        elif t == "unregister":
            f = Fields(msg, frozenset({"region"}))
            rid = f.int("region", 1, 1 << 31)
            if client.regions.pop(rid, None) is None:
                raise ProtocolError(f"region {rid} is not registered")
        elif t == "bye":
            Fields(msg, frozenset())
            self._depart(client, "said goodbye", clean=True)
        elif t == "hello":
            raise ProtocolError("'hello' was already sent on this connection")
        else:
            raise ProtocolError(f"unknown message type {t!r}")

    def _hello(self, client: Client, msg: dict[str, Any]) -> None:
        f = Fields(msg, frozenset({"v", "pid", "local_rank", "slots"}))
        version = f.int("v", 0, 1 << 16)
        if version != protocol.VERSION:
            raise ProtocolError(
                f"client speaks protocol {version}, this service {protocol.VERSION}", fatal=True
            )
        f.int("pid", 0, 1 << 31)
        slots = f.int("slots", 1, shm.MAX_SLOTS)
        want = f.opt_int("local_rank", 0, 1 << 31)
        fd = client.reader.take_fd("hello")
        wake = client.reader.take_fd("hello")
        client.wake_fd = wake  # closed with the connection from here on
        if self.stopping:
            os.close(fd)
            raise ProtocolError("the service is shutting down", fatal=True)
        try:
            control = shm.ControlBlock.attach(fd, slots)
            if os.readlink(f"/proc/self/fd/{wake}") != "anon_inode:[eventfd]":
                raise TotalReduceError("the wake-up descriptor is not an eventfd")
            os.set_blocking(wake, False)
        except (TotalReduceError, OSError, ValueError) as exc:
            raise ProtocolError(f"bad control block: {exc}", fatal=True) from None
        if not any(s == ATTACHED for s in self.slot_state) and (
            self.used or self.failed_reason is not None or self.epoch in self.remote_closed
        ):
            self._end_job()
        s = self._choose_slot(want)
        client.control = control
        client.local_rank = s
        client.rank = self.node * self.n + s
        client.epoch = self.epoch
        self.slot_state[s] = ATTACHED
        self.slot_client[s] = client
        log.info("node %d: %s attached (job %d)", self.node, client.describe(), self.epoch)
        self._send(
            client,
            {
                "t": "welcome",
                "client": client.id,
                "rank": client.rank,
                "size": self.nodes * self.n,
                "node": self.node,
                "nodes": self.nodes,
                "local_rank": s,
                "local_size": self.n,
                "job": self.epoch,
            },
        )

    def _choose_slot(self, want: int | None) -> int:
        if self.failed_reason is not None:
            raise ProtocolError(
                f"this node's job {self.epoch} failed ({self.failed_reason}); a new job starts "
                f"once its clients ({self._attached_text()}) have left",
                fatal=True,
            )
        if want is not None:
            if want >= self.n:
                raise ProtocolError(
                    f"local rank {want} is outside 0..{self.n - 1} (the service was started "
                    f"with --local-clients {self.n})",
                    fatal=True,
                )
            if self.slot_state[want] == ATTACHED:
                other = self.slot_client[want]
                raise ProtocolError(
                    f"local rank {want} is taken by {other.describe() if other else '?'}",
                    fatal=True,
                )
            if self.slot_state[want] == LEFT:
                raise ProtocolError(
                    f"local rank {want} of job {self.epoch} was left ({self.left_reason[want]}); "
                    f"a new job starts once its clients ({self._attached_text()}) have left",
                    fatal=True,
                )
            return want
        for s, state in enumerate(self.slot_state):
            if state == FREE:
                return s
        raise ProtocolError(
            f"all {self.n} local ranks are taken or used by job {self.epoch} "
            f"({self._attached_text()}); start the service with a larger --local-clients",
            fatal=True,
        )

    def _attached_text(self) -> str:
        who = [c.describe() for c in self.slot_client if c is not None]
        return ", ".join(who) or "none attached"

    def _register(self, client: Client, msg: dict[str, Any]) -> None:
        f = Fields(msg, frozenset({"region", "size"}))
        rid = f.int("region", 1, 1 << 31)
        size = f.int("size", 1, protocol.MAX_SIZE)
        fd = client.reader.take_fd("register")
        try:
            if rid in client.regions:
                os.close(fd)
                raise TotalReduceError(f"region {rid} is already registered")
            if len(client.regions) >= MAX_REGIONS:
                os.close(fd)
                raise TotalReduceError(f"more than {MAX_REGIONS} regions registered")
            region = shm.SharedRegion.attach(fd, size)
        except (TotalReduceError, OSError, ValueError) as exc:
            log.warning(
                "node %d: %s: region %d refused: %s", self.node, client.describe(), rid, exc
            )
            self._send(
                client,
                {
                    "t": "error",
                    "region": rid,
                    "fatal": False,
                    "message": f"region {rid} refused: {exc}",
                },
            )
            return
        client.regions[rid] = region
        self._send(client, {"t": "registered", "region": rid})

    # ------------------------------------------------------------------ ops

    def _op(self, client: Client, msg: dict[str, Any]) -> None:
        assert client.control is not None and client.local_rank is not None
        f = Fields(msg, _OP_FIELDS)
        slot = f.int("slot", 0, client.control.slots - 1)
        seq = f.int("seq", 0, 1 << 62)
        s = client.local_rank
        kind = f.choice("kind", ("allreduce", "broadcast", "barrier"))
        name = f.name()
        gen = f.int("gen", 0, 1 << 62)
        if name is None:
            key: NameKey = ("u", self.unnamed[s])
            expected = self.unnamed[s]
        else:
            key = ("i" if isinstance(name, int) else "s", name)
            expected = self.next_gen[s].get(key, 0)
        if gen != expected:
            err = ProtocolError(
                f"{client.describe()}: op {name!r} has generation {gen} here, the service counts "
                f"{expected}"
            )
            client.control.fail(slot, seq, shm.ERROR_INVALID, str(err))
            raise err
        # From here the op counts as this client's submission of (key, gen), even if it is
        # refused: every local client must see the same generations.
        if name is None:
            self.unnamed[s] += 1
        else:
            self.next_gen[s][key] = gen + 1
        generation = 0 if name is None else gen
        self.used = True
        client.submitted += 1
        try:
            shape, src, dst, prio = self._parse_op(client, f, kind)
        except ProtocolError as exc:
            shape, src, dst, prio = None, None, None, 0
            refusal: BaseException | None = InvalidArgumentError(
                f"{_label(key, gen)} from {client.describe()} was refused by the service: {exc}"
            )
        else:
            refusal = None
        rdv = self._rendezvous(key, generation, shape)
        rdv.seen += 1
        c = Contribution(client, slot, seq, src, dst)
        if rdv.state is State.FAILED:
            assert rdv.error is not None
            c.fail(rdv.error)
            self._forget_if_seen(rdv)
            return
        reason = self._refusal()
        if refusal is None and reason is not None:
            refusal = OpFailedError(f"{rdv.label} failed: {reason}")
        if refusal is None and shape is not None and rdv.shape != shape:
            other = next(iter(rdv.contributions.values()), None)
            refusal = OpMismatchError(
                f"{rdv.label}: {MISMATCH} of node {self.node}: {client.describe()} submitted "
                f"{shape.text()}, but "
                f"{other.client.describe() if other else 'another local client'} submitted "
                f"{rdv.shape.text()}"
            )
        rdv.contributions[s] = c
        client.unfinished.add(rdv)
        rdv.priority = max(rdv.priority, prio) if len(rdv.contributions) > 1 else prio
        if refusal is not None:
            self._fail(rdv, refusal)
            return
        if len(rdv.contributions) == self.n:
            self._launch(rdv)

    def _parse_op(
        self, client: Client, f: Fields, kind: str
    ) -> tuple[OpShape, np.ndarray | None, np.ndarray | None, int]:
        prio = f.int("prio", -(1 << 31), 1 << 31)
        algo = f.opt_str("algo", 32)
        if kind == "barrier":
            shape = OpShape("barrier", DType.INT64, 0, ReduceOp.SUM, 0, algo)
            return shape, None, None, prio
        dtype = DTYPES[f.choice("dtype", tuple(DTYPES))]
        count = f.int("count", 0, protocol.MAX_SIZE)
        if kind == "allreduce":
            op = OPS[f.choice("op", tuple(OPS))]
            root = 0
        else:
            op = ReduceOp.SUM
            root = f.int("root", 0, self.nodes * self.n - 1)
        src = self._view(client, f, "in", dtype, count)
        dst = self._view(client, f, "out", dtype, count)
        if src is None or dst is None:
            raise ProtocolError(f"a {kind} needs both 'in' and 'out'")
        same = src.ctypes.data == dst.ctypes.data
        if not same and count and np.shares_memory(src, dst):
            raise ProtocolError("'out' overlaps 'in' without being the same buffer")
        return OpShape(kind, dtype, count, op, root, algo), src, dst, prio

    def _view(
        self, client: Client, f: Fields, field_name: str, dtype: DType, count: int
    ) -> np.ndarray | None:
        place = f.place(field_name)
        if place is None:
            return None
        rid, offset = place
        region = client.regions.get(rid)
        if region is None:
            raise ProtocolError(f"{field_name!r} names region {rid}, which is not registered")
        nbytes = count * dtype.itemsize
        if offset % dtype.itemsize or offset + nbytes > region.size:
            raise ProtocolError(
                f"{field_name!r}: {nbytes} bytes at offset {offset} do not fit region {rid} of "
                f"{region.size} bytes (or are not aligned to {dtype.itemsize})"
            )
        if count == 0:
            return np.empty(0, dtype=dtype.numpy)
        return region.array(offset, count, dtype.numpy)

    def _rendezvous(self, key: NameKey, generation: int, shape: OpShape | None) -> Rendezvous:
        k = (self.epoch, key, generation)
        rdv = self.rdvs.get(k)
        if rdv is None:
            if key[0] == "u":
                engine_name = f"__unnamed__.e{self.epoch}.{key[1]}"
            elif key[0] == "i":
                engine_name = f"e{self.epoch}/#{key[1]}"
            else:
                engine_name = f"e{self.epoch}/{key[1]}"
            if shape is None:  # a refused first contribution: any shape, it fails anyway
                shape = OpShape("barrier", DType.INT64, 0, ReduceOp.SUM, 0, None)
            rdv = Rendezvous(self.epoch, key, generation, engine_name, shape)
            self.rdvs[k] = rdv
        return rdv

    def _forget_if_seen(self, rdv: Rendezvous) -> None:
        """Drop a failed rendezvous once every local client has submitted its op."""
        if rdv.seen >= self.n or rdv.epoch != self.epoch:
            self.rdvs.pop((rdv.epoch, rdv.key, rdv.generation), None)

    def _refusal(self) -> str | None:
        """Why no new op of the current job can run on this node, if so."""
        if self.stopping:
            return f"the service of node {self.node} is shutting down ({self.stop_reason})"
        if self.failed_reason is not None:
            return f"the job failed on node {self.node}: {self.failed_reason}"
        if self.epoch in self.remote_closed:
            return f"the job ended on {self.remote_closed[self.epoch]}"
        for s, state in enumerate(self.slot_state):
            if state == LEFT:
                return self.left_reason[s]
        return None

    def _fail(self, rdv: Rendezvous, error: BaseException) -> None:
        """Fail a rendezvous that is still waiting for local clients, here and on every node."""
        if rdv.state is not State.PENDING:
            return
        log.error("node %d: %s", self.node, error)
        rdv.fail_all(error)
        self._abort_engine(rdv, str(error))
        self._forget_if_seen(rdv)

    def _abort_engine(self, rdv: Rendezvous, reason: str) -> None:
        try:
            self.svc.abort(rdv.engine_name, rdv.engine_generation, reason)
        except Exception:  # the engine may be stopping
            log.exception("node %d: aborting %s failed", self.node, rdv.label)

    # ------------------------------------------------------------------ engine ops

    def _launch(self, rdv: Rendezvous) -> None:
        s = rdv.shape
        name = rdv.engine_name
        gen = rdv.engine_generation
        if rdv.key[0] != "u" and self.engine_next.get(name, 0) < gen:
            try:
                self._fill_gaps(rdv, self.engine_next.get(name, 0))
            except Exception as exc:  # generations would no longer line up: end the job
                log.exception("node %d: using up generations of %r failed", self.node, name)
                self._job_failed(f"the engine refused to skip failed generations of {name!r}")
                self._fail(rdv, OpFailedError(f"{rdv.label} failed: {exc}"))
                return
        try:
            handle = self._submit(rdv)
        except InvalidArgumentError as exc:
            self._fail(rdv, InvalidArgumentError(f"{rdv.label}: {exc}"))
            return
        except Exception as exc:  # the engine refused the op: fail it everywhere
            log.exception("node %d: the engine refused %s", self.node, rdv.label)
            self._fail(rdv, OpFailedError(f"{rdv.label}: the engine refused it: {exc}"))
            return
        if rdv.key[0] != "u":
            self.engine_next[name] = gen + 1
        rdv.state = State.RUNNING
        log.debug("node %d: %s (%s) started as engine op %r", self.node, rdv.label, s.text(), name)
        handle.add_done_callback(lambda h, r=rdv: self._engine_done(r, h))

    def _submit(self, rdv: Rendezvous) -> Handle:
        s = rdv.shape
        name = rdv.engine_name
        kw: dict[str, Any] = {"dtype": "bfloat16"} if s.dtype is DType.BFLOAT16 else {}
        if s.kind == "barrier":
            return self.svc.barrier_async(
                name, priority=rdv.priority, algorithm=s.algorithm or "all_to_all"
            )
        root_node, root_local = divmod(s.root, self.n)
        if self.n == 1:
            c = rdv.contributions[0]
            rdv.direct = True
            if s.kind == "allreduce":
                return self.svc.allreduce_async(
                    c.src,
                    name=name,
                    op=s.op,
                    out=c.dst,
                    priority=rdv.priority,
                    algorithm=s.algorithm,
                    **kw,
                )
            return self.svc.broadcast_async(
                c.src,
                root=root_node,
                name=name,
                out=c.dst,
                priority=rdv.priority,
                algorithm=s.algorithm or "one_to_all",
                **kw,
            )
        buf = rdv.gather()
        if s.kind == "allreduce":
            op = ReduceOp.SUM if s.op is ReduceOp.AVG else s.op
            return self.svc.allreduce_async(
                buf,
                name=name,
                op=op,
                out=buf,
                priority=rdv.priority,
                algorithm=s.algorithm,
                **kw,
            )
        if root_node == self.node:
            rdv.seed_root(root_local)
        return self.svc.broadcast_async(
            buf,
            root=root_node,
            name=name,
            out=buf,
            priority=rdv.priority,
            algorithm=s.algorithm or "one_to_all",
            **kw,
        )

    def _fill_gaps(self, rdv: Rendezvous, have: int) -> None:
        """Use up engine generations of ops that failed before reaching the engine.

        Generation g of an engine name is the g-th submission of that name on
        this node, so a generation whose op failed while still waiting for local
        clients (and was aborted on every node) is consumed here by an op over
        this node alone, which sends nothing.  It runs once the aborts were
        handled: the engine takes aborts and ops from one queue, in order, so the
        op fails at once against the recorded abort.
        """
        me = Group([self.node])
        s = rdv.shape
        kw: dict[str, Any] = {"dtype": "bfloat16"} if s.dtype is DType.BFLOAT16 else {}
        for _ in range(have, rdv.engine_generation):
            if s.kind == "barrier":
                self.svc.barrier_async(rdv.engine_name, group=me)
                continue
            dummy = np.zeros(s.count, dtype=s.dtype.numpy)
            if s.kind == "allreduce":
                self.svc.allreduce_async(
                    dummy, name=rdv.engine_name, op=s.op, out=dummy, group=me, **kw
                )
            else:
                self.svc.broadcast_async(
                    dummy, root=0, name=rdv.engine_name, out=dummy, group=me, **kw
                )
        self.engine_next[rdv.engine_name] = rdv.engine_generation

    def _engine_done(self, rdv: Rendezvous, handle: Handle) -> None:
        """Completion callback, on the engine's comm thread: keep it short."""
        error = handle.exception()
        if rdv.direct:
            c = rdv.contributions[0]
            if error is None:
                c.complete()
            else:
                c.fail(_rename(error, rdv))
        self.completions.append((rdv, error))
        self.wake()

    def _finished(self, rdv: Rendezvous, error: BaseException | None) -> None:
        """Phase 3 (on the main thread): deliver the result, or the error, to every client."""
        if rdv.state is not State.RUNNING:  # reported twice by a racing callback registration
            return
        if error is None:
            rdv.state = State.DONE
            if not rdv.direct:
                try:
                    rdv.scatter(self.n * self.nodes)
                except Exception as exc:
                    log.exception("node %d: delivering %s failed", self.node, rdv.label)
                    error = OpFailedError(f"{rdv.label}: delivering the result failed: {exc}")
                    for c in rdv.contributions.values():
                        c.fail(error)
        else:
            rdv.state = State.FAILED
            error = _rename(error, rdv)
            rdv.error = error
            if not rdv.direct:
                for c in rdv.contributions.values():
                    c.fail(error)
        for c in rdv.contributions.values():
            c.client.unfinished.discard(rdv)
        rdv.release()
        self.rdvs.pop((rdv.epoch, rdv.key, rdv.generation), None)

    # ------------------------------------------------------------------ jobs and faults

    def _depart(self, client: Client, how: str, *, clean: bool) -> None:
        if client.closed:
            return
        client.closed = True
        try:
            self.sel.unregister(client.sock)
        except (KeyError, ValueError):
            pass
        client.sock.close()
        client.reader.close_fds()
        client.close_wake()
        self.clients.pop(client.id, None)
        client.regions.clear()  # mappings live on only in the views of running ops
        s = client.local_rank
        if s is None:
            log.debug("node %d: connection %d closed before hello", self.node, client.id)
            return
        self.slot_client[s] = None
        in_flight = sorted(
            (r for r in client.unfinished if r.state in (State.PENDING, State.RUNNING)),
            key=lambda r: r.created,
        )
        who = f"{client.describe()} {how}"
        if client.epoch != self.epoch:
            log.info("node %d: %s (job %d)", self.node, who, client.epoch)
        elif not clean or in_flight:
            self.slot_state[s] = LEFT
            ops = ", ".join(r.label for r in in_flight[:5])
            more = f" and {len(in_flight) - 5} more" if len(in_flight) > 5 else ""
            reason = who + (f" with {ops}{more} in flight" if in_flight else "")
            self.left_reason[s] = reason
            self._job_failed(reason)
        elif client.submitted == 0:
            self.slot_state[s] = FREE
            log.info("node %d: %s", self.node, who)
        else:
            self.slot_state[s] = LEFT
            self.left_reason[s] = f"{client.describe()} left the job"
            log.info("node %d: %s", self.node, who)
            for rdv in self._of_job(self.epoch, State.PENDING):
                self._fail(
                    rdv,
                    OpFailedError(
                        f"{rdv.label} failed: {client.describe()} left the job "
                        "without submitting it"
                    ),
                )
        if all(st != ATTACHED for st in self.slot_state):
            self._end_job()

    def _of_job(self, epoch: int, state: State) -> list[Rendezvous]:
        return [r for r in self.rdvs.values() if r.epoch == epoch and r.state is state]

    def _job_failed(self, reason: str) -> None:
        """A client broke the current job: fail its ops here, tell the other nodes."""
        if self.failed_reason is not None:
            log.error("node %d: also: %s", self.node, reason)
            return
        self.failed_reason = reason
        log.error("node %d: job %d failed: %s", self.node, self.epoch, reason)
        for rdv in self._of_job(self.epoch, State.PENDING):
            self._fail(rdv, OpFailedError(f"{rdv.label} failed: {reason}"))
        self._give_deadline(
            self.epoch, f"the job failed on node {self.node}: {reason}", self.abort_timeout
        )
        self.peers.broadcast(
            {
                "t": "closed",
                "epoch": self.epoch,
                "failed": True,
                "reason": f"the job failed: {reason}",
            }
        )
        self.notice_sent = True

    def _give_deadline(self, epoch: int, reason: str, delay: float) -> None:
        at = time.monotonic() + delay
        for rdv in self._of_job(epoch, State.RUNNING):
            if rdv.deadline is None or rdv.deadline > at:
                rdv.deadline = at
                rdv.deadline_reason = reason

    def _end_job(self) -> None:
        """All clients of the current job left: the next one to attach starts a new job."""
        if self.used or self.failed_reason is not None or self.epoch in self.remote_closed:
            if not self.notice_sent:
                self.peers.broadcast(
                    {
                        "t": "closed",
                        "epoch": self.epoch,
                        "failed": False,
                        "reason": "the job's clients have all left",
                    }
                )
            for rdv in self._of_job(self.epoch, State.PENDING):
                self._fail(rdv, OpFailedError(f"{rdv.label} failed: the job's clients left"))
            for k in [k for k, r in self.rdvs.items() if r.state is State.FAILED]:
                del self.rdvs[k]
            log.info("node %d: job %d ended", self.node, self.epoch)
            self.epoch += 1
            self.engine_next.clear()
        self.used = False
        self.failed_reason = None
        self.notice_sent = False
        self.slot_state = [FREE] * self.n
        self.left_reason = [""] * self.n
        self.next_gen = [{} for _ in range(self.n)]
        self.unnamed = [0] * self.n

    def _on_notice(self, notice: dict[str, Any]) -> None:
        node = notice.get("node")
        t = notice.get("t")
        reason = str(notice.get("reason", "?"))[:2000]
        if t == "closed":
            epoch = notice.get("epoch")
            if not isinstance(epoch, int):
                return
            text = f"node {node}: {reason}"
            log.info("node %d: job %d: %s", self.node, epoch, text)
            self.remote_closed[epoch] = text
            while len(self.remote_closed) > 256:
                del self.remote_closed[min(self.remote_closed)]
            for rdv in self._of_job(epoch, State.PENDING):
                self._fail(rdv, OpFailedError(f"{rdv.label} failed: the job ended on {text}"))
            self._give_deadline(epoch, f"the job ended on {text}", self.abort_timeout)
        elif t == "stop":
            self.request_stop(f"the service of node {node} stopped ({reason})", from_peer=True)

    def _timers(self, now: float) -> None:
        for rdv in list(self.rdvs.values()):
            if rdv.state is State.RUNNING and rdv.deadline is not None and not rdv.aborted:
                if now >= rdv.deadline:
                    rdv.aborted = True
                    log.error("node %d: aborting %s: %s", self.node, rdv.label, rdv.deadline_reason)
                    self._abort_engine(rdv, f"{rdv.label} failed: {rdv.deadline_reason}")
            elif (
                rdv.state is State.PENDING
                and not rdv.warned
                and now - rdv.created > self.stall_warning_s
            ):
                rdv.warned = True
                missing = [s for s in range(self.n) if s not in rdv.contributions]
                log.warning(
                    "node %d: %s waited %.0f s for local ranks %s (has %s)",
                    self.node,
                    rdv.label,
                    now - rdv.created,
                    missing,
                    ", ".join(c.client.describe() for c in rdv.contributions.values()),
                )
        for client in list(self.clients.values()):
            if client.local_rank is None and now - client.connected > HELLO_TIMEOUT_S:
                self._protocol_error(
                    client, ProtocolError(f"no hello within {HELLO_TIMEOUT_S:.0f} s", fatal=True)
                )

    # ------------------------------------------------------------------ shutdown

    def request_stop(self, reason: str, *, from_peer: bool = False) -> None:
        """Begin the shutdown (see the module docstring); safe to call more than once."""
        now = time.monotonic()
        if self.stopping:
            if from_peer:
                self._give_deadline_all(reason, 0.0)
            return
        self.stopping = True
        self.stop_reason = reason
        log.warning("node %d: stopping: %s", self.node, reason)
        self._stop_listening()
        for rdv in [r for r in self.rdvs.values() if r.state is State.PENDING]:
            self._fail(
                rdv,
                OpFailedError(
                    f"{rdv.label} failed: the service of node {self.node} is shutting "
                    f"down ({reason})"
                ),
            )
        grace = 0.0 if from_peer else self.drain_timeout
        self._give_deadline_all(
            f"the service of node {self.node} is shutting down ({reason})", grace
        )
        self.stop_deadline = now + grace + 5.0

    def _give_deadline_all(self, reason: str, delay: float) -> None:
        for epoch in {r.epoch for r in self.rdvs.values()}:
            self._give_deadline(epoch, reason, delay)

    def _stop_listening(self) -> None:
        if self.listener is None:
            return
        try:
            self.sel.unregister(self.listener)
        except (KeyError, ValueError):
            pass
        self.listener.close()
        self.listener = None
        try:
            if os.stat(self.path).st_ino == self._path_ino:
                os.unlink(self.path)
        except OSError:
            pass

    def _shutdown_ready(self, now: float) -> bool:
        running = any(r.state is State.RUNNING for r in self.rdvs.values())
        return not running or now > self.stop_deadline

    def _close_all(self) -> None:
        self.peers.broadcast({"t": "stop", "reason": self.stop_reason})
        bye = protocol.encode(
            {
                "t": "error",
                "fatal": True,
                "message": f"the service of node {self.node} stopped ({self.stop_reason})",
            }
        )
        for client in list(self.clients.values()):
            try:
                client.sock.send(bye)
            except OSError:
                pass  # gone already
            self._depart(client, "was disconnected by the shutdown", clean=True)
        left = [r for r in self.rdvs.values() if r.state is State.RUNNING]
        for rdv in left:
            log.error("node %d: %s still running at shutdown", self.node, rdv.label)
        self.sel.close()
        os.close(self.wake_fd)


def _label(key: NameKey, gen: int) -> str:
    if key[0] == "u":
        return f"unnamed op #{key[1]}"
    return f"op {key[1]!r} generation {gen}"


def _rename(error: BaseException, rdv: Rendezvous) -> BaseException:
    """The engine's error as the clients see it: their op name, and a mismatch kept a mismatch."""
    text = str(error)
    kind = OpMismatchError if MISMATCH in text else type(error)
    if rdv.engine_name in text:
        name = rdv.key[1]
        shown = f"unnamed op #{name}" if rdv.key[0] == "u" else repr(name)
        text = text.replace(repr(rdv.engine_name), shown).replace(rdv.engine_name, shown)
    elif kind is type(error):
        return error
    try:
        return kind(text)
    except Exception:
        return OpFailedError(text)


def _reply_and_close(sock: socket.socket, msg: dict[str, Any]) -> None:
    try:
        sock.settimeout(0.5)
        sock.sendall(protocol.encode(msg))
    except OSError:
        pass
    finally:
        sock.close()

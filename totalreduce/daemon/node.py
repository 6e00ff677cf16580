"""A node's service: accept, hello, register and teardown of the node's client processes.

The clients' ops are the arena thread's (:class:`~.thin.ThinService`): a client
hands them over in the node's shared-memory arena.  What is left to this module
is the socket:

- **hello**: a client connects (only the service's own user is admitted,
  checked with ``SO_PEERCRED``), says hello with its pid and the slot it wants;
  the service gives it a slot and an eventfd, attaches the slot to the arena
  thread (which tells the other nodes' services that the slot's rank is a new
  process of this node's session: JOIN, through the engine among the services),
  and answers ``welcome`` with the arena's memory file and the two eventfds;
- **liveness**: the connection stays open while the client lives.  Its end
  detaches the slot.  With ``bye`` first the client exited cleanly; without,
  the process died, and the ops that rank was part of fail, here and (GONE,
  through the engine among the services) on every node whose session agreed
  with this one, with an error naming it;
- **teardown**: a detached slot's part of the arena is reset when the next
  client takes it.

Sessions.  A node's clients form a session from the first hello after the node
had none until the last one leaves.  A session in which a client died admits no
new client (its survivors' ops with that rank failed; a job restarts as a
whole): the next session, once they have left, does.  Every node counts its own
sessions (``epoch``): a job is one session of every node, and the sessions it is
made of name its clients' agreement among the services (:mod:`.thin_session`), so a
death, an error or a frame of one job never meets another.  The agreed number is mixed
into every op's wire id, so a new job that reuses op names never meets what the
engine remembers of the previous job's ops.
"""

from __future__ import annotations

import logging
import os
import selectors
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..transport import hello
from ..transport.hello import Fields, MessageReader, ProtocolError
from . import sockets

log = logging.getLogger("totalreduce.daemon")


@dataclass
class _Conn:
    sock: socket.socket
    pid: int
    reader: MessageReader = field(default_factory=MessageReader)
    slot: int | None = None
    said_bye: bool = False
    incarnation: int = 0


class Node:
    """The socket side of one node's service (runs on the service's main thread)."""

    def __init__(
        self,
        listener: socket.socket,
        path: Path,
        *,
        node: int,
        nodes: int,
        local_clients: int,
        options: dict[str, int],
        thin: Any,
        drain_timeout: float = 0.0,
    ) -> None:
        self.listener = listener
        self.path = path
        self.node = node
        self.nodes = nodes
        self.local_clients = local_clients
        self.options = options
        #: the arena thread (daemon/thin.py): the clients' ops, and what the other
        #: nodes' services hear of this node's clients and sessions
        self.thin = thin
        self.drain_timeout = drain_timeout
        self.slots: list[_Conn | None] = [None] * local_clients
        self.epoch = 0
        self.sessions = 0
        self.admitted = 0  # clients admitted so far: each one's incarnation
        self.failed: str | None = None  # why this session admits no new client
        self._stop = threading.Event()
        self._sel = selectors.DefaultSelector()
        self._sel.register(listener, selectors.EVENT_READ, None)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")

    # ------------------------------------------------------------------ the loop

    def stop(self, why: str = "") -> None:
        """End :meth:`run` (any thread, signal handlers included)."""
        if why:
            log.info("stopping: %s", why)
        self._stop.set()
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    def run(self) -> int:
        """Serve until :meth:`stop`; 0 after a clean stop."""
        try:
            while not self._stop.is_set():
                for key, _ in self._sel.select(timeout=1.0):
                    if key.data is None:
                        self._accept()
                    elif key.data == "wake":
                        try:
                            os.read(self._wake_r, 64)
                        except BlockingIOError:
                            pass
                    else:
                        self._readable(key.data)
        finally:
            # running ops may end (up to --drain-timeout) before their clients are let go
            deadline = time.monotonic() + self.drain_timeout
            while self.thin.busy() and time.monotonic() < deadline:
                time.sleep(0.05)
            for conn in [c for c in self.slots if c is not None]:
                self._drop(conn, "was disconnected: the service stops")
            self._sel.close()
            os.close(self._wake_r)
            os.close(self._wake_w)
        return 0

    # ------------------------------------------------------------------ connections

    def _accept(self) -> None:
        try:
            sock, _ = self.listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        pid, uid, _gid = sockets.peer_credentials(sock)
        if uid != os.getuid():
            log.warning("refused a connection from pid %d of uid %d", pid, uid)
            sock.close()
            return
        sock.setblocking(False)
        conn = _Conn(sock, pid)
        self._sel.register(sock, selectors.EVENT_READ, conn)

    def _readable(self, conn: _Conn) -> None:
        try:
            alive = hello.receive(conn.sock, conn.reader)
        except BlockingIOError:
            return
        except (OSError, ProtocolError) as exc:
            self._refuse(conn, str(exc))
            return
        try:
            while (msg := conn.reader.next()) is not None:
                self._message(conn, msg)
        except ProtocolError as exc:
            self._refuse(conn, str(exc))
            return
        if not alive:
            self._close(conn)

    def _message(self, conn: _Conn, msg: dict[str, Any]) -> None:
        t = msg.get("t")
        if t == "hello" and conn.slot is None:
            f = Fields(msg, hello.HELLO_FIELDS)
            version = f.int("version", 0, 1 << 16)
            if version != hello.VERSION:
                raise ProtocolError(
                    f"protocol version {version}, this service speaks {hello.VERSION} "
                    "(client and service come from different totalreduce versions)",
                    fatal=True,
                )
            pid = f.int("pid", 1, 1 << 31)
            want = f.opt_int("local_rank", 0, self.local_clients - 1)
            self._hello(conn, pid, want)
        elif t == "bye" and conn.slot is not None:
            Fields(msg, frozenset())
            conn.said_bye = True
        else:
            state = "before hello" if conn.slot is None else "after hello"
            raise ProtocolError(f"unexpected {t!r} message {state}", fatal=True)

    def _hello(self, conn: _Conn, pid: int, want: int | None) -> None:
        free = [k for k, c in enumerate(self.slots) if c is None]
        if want is None:
            if not free:
                raise ProtocolError(
                    f"all {self.local_clients} local client slots of node {self.node} are "
                    "taken (start the service with more --local-clients?)",
                    fatal=True,
                )
            slot = free[0]
        elif self.slots[want] is not None:
            holder = self.slots[want]
            raise ProtocolError(
                f"local rank {want} of node {self.node} is taken by pid "
                f"{holder.pid if holder else '?'}",
                fatal=True,
            )
        else:
            slot = want
        if self.failed is not None:
            holders = [c.pid for c in self.slots if c is not None]
            raise ProtocolError(
                f"node {self.node}'s session {self.epoch} failed ({self.failed}); a new job "
                f"starts when its clients have left (still attached: pids {holders})",
                fatal=True,
            )
        if not any(self.slots):
            self.sessions += 1
            self.epoch = self.sessions
            log.info("session %d starts", self.epoch)
            self.thin.new_session(self.epoch)  # what the last job's ranks did no longer counts
        from ..transport.shm import new_eventfd

        rank = self.node * self.local_clients + slot
        self.admitted += 1
        conn.incarnation = self.admitted
        conn.slot = slot
        self.slots[slot] = conn
        thin_efd = new_eventfd()
        self.thin.attach(slot, conn.incarnation, os.dup(thin_efd))
        welcome = {
            "t": "welcome",
            "rank": rank,
            "size": self.nodes * self.local_clients,
            "node": self.node,
            "nodes": self.nodes,
            "local": slot,
            "local_clients": self.local_clients,
            "epoch": self.epoch,
            "pid": os.getpid(),
            "options": self.options,
            "incarnation": conn.incarnation,
            "arena_bytes": self.thin.arena.size,
        }
        # The client gets its own copies of the descriptors; the arena thread owns ours.
        fds = (self.thin.arena.fd, thin_efd, self.thin.eventfd)
        try:
            hello.send(conn.sock, welcome, fds)
        finally:
            os.close(thin_efd)
        log.info("client pid %d is rank %d (local %d)", pid, rank, slot)

    def _refuse(self, conn: _Conn, why: str) -> None:
        log.warning("client pid %d: %s", conn.pid, why)
        try:
            conn.sock.setblocking(True)
            conn.sock.settimeout(1.0)
            hello.send(conn.sock, {"t": "error", "message": why})
        except OSError:
            pass
        self._close(conn)

    def _close(self, conn: _Conn) -> None:
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        self._drop(conn, "left" if conn.said_bye else "died (its connection ended without bye)")

    def _drop(self, conn: _Conn, how: str) -> None:
        conn.reader.close_fds()
        conn.sock.close()
        slot = conn.slot
        if slot is None or self.slots[slot] is not conn:
            return
        rank = self.node * self.local_clients + slot
        level = logging.INFO if conn.said_bye else logging.ERROR
        if self._stop.is_set():
            level = logging.WARNING
        log.log(level, "rank %d (pid %d) %s", rank, conn.pid, how)
        if not conn.said_bye:  # its ops fail everywhere now (the arena thread tells)
            self.failed = self.failed or f"rank {rank} (pid {conn.pid}) died"
        self.thin.detach(slot, None if conn.said_bye else how)
        self.slots[slot] = None
        if not any(self.slots):
            log.info("session %d ends", self.epoch)
            self.failed = None
            self.thin.end_session()

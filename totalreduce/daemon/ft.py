"""A node's service in fault-tolerant mode: its members, the rounds, the quorum's data ops.

``totalreduce serve --fault-tolerant`` starts one more thread in every node's service,
:class:`FtService`, listening on ``ft{n}.sock`` beside ``node{n}.sock``.  Training
processes that attach there are *members* (replicas): unlike the clients of a session
(:mod:`.thin_session`), which are a fixed set of slots that a death fails for good, a
member comes and goes between steps, and the job goes on (docs/fault_tolerance.md).

The thread loops:

1. it reads its members' messages (:mod:`totalreduce.transport.ft_frames`): a hello, an
   ask for the next quorum (with the member's committed step), a vote on the current
   step (which may carry the next ask: one round a step), a data op's part (an allreduce,
   or the state a member sends one behind it), a heartbeat; a member silent for longer
   than its timeout (hung, stopped) is dropped as if it had died;
2. it runs a *round*: every service writes its row of what its members said into a table
   and the services sum it among themselves with the engine among the services (an
   allreduce, ``"\\0ft round"``; on one node, the row alone);
3. :meth:`~.ft_quorum.Quorums.advance` turns the table into decisions, the same on every
   service (a quorum formed, a step committed or not, a quorum broken by a death), and
   the thread answers its own members;
4. a data op whose local parts have all come is reduced on the node (the kernels, in the
   members' rank order), then run among the services over the nodes of the quorum's
   members (the engine, under a name of its own: the quorum and the op's key), and
   divided by the quorum's size: every member gets the same bytes.  An op needs no
   round: once its local parts came, the loop waits for it among the services (the
   wait drives the engine) and answers it as soon as it ends.  A state transfer
   is two broadcasts among the nodes of its sender and receivers (the length, then the
   bytes).  A quorum broken (a member gone, or a newer quorum) fails its data ops on
   every service: those among the services are aborted there, so no survivor waits.

The data plane of a quorum is not a session of the arena: a member hands a small part
over the socket, and a part of more than 64 KiB through memory it shares with its
service (a memfd it passes once, sealed against shrinking; the average is written back
there).  A member that leaves cleanly before it took part in its quorum's step is shown
one more round (``F_LEFT``), in which the services re-form the quorum without it
(:mod:`.ft_quorum`); its peers' ops of the old quorum are answered "again".
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import selectors
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .. import protocol as P
from ..dtypes import DType, ReduceOp
from ..group import Group
from ..kernels import copy_into, finish_average, reduce_into
from ..transport import ft_frames as F
from . import ft_quorum as Q
from . import sockets

log = logging.getLogger("totalreduce.daemon")

#: The round's name among the services.
ROUND = "\0ft round"
#: A round's pause while a member somewhere waits for an answer (an ask, a vote, an op; a
#: message of its own members ends it); within ``AWAKE_S`` of one, rounds follow each
#: other without a pause.
IDLE_S = float(os.environ.get("TOTALREDUCE_FT_IDLE_S", 0.002))
AWAKE_S = float(os.environ.get("TOTALREDUCE_FT_AWAKE_S", 0.0))
#: The pause while no member anywhere waits (they compute): a round every 2 ms took the
#: CPU of the members' compute (a 2 ms MLP step ran 2-3 times slower beside it on 2 cores).
#: The first message after such a stretch waits at most this for the other services' next
#: round, unless their own members' messages wake them too (as in a synchronous step).
QUIET_S = float(os.environ.get("TOTALREDUCE_FT_QUIET_S", 0.02))
#: The pause while no node has a member (a hello waits at most this for its first round).
EMPTY_S = 0.05
#: A member's message is read whole once it starts; it may not stall longer.
READ_TIMEOUT_S = 30.0
_KINDS = ("allreduce", "xfer")
_WAKE = "wake"
#: ``TOTALREDUCE_FT_ROUNDED_OPS=1``: an op's part and an op's end run a round, as before
#: (the bench's "before" in the same run).
ROUNDED_OPS = os.environ.get("TOTALREDUCE_FT_ROUNDED_OPS", "0") == "1"
_NO_ROUND = ("beat",) if ROUNDED_OPS else ("beat", "op")


@dataclass
class _Conn:
    sock: socket.socket
    pid: int = 0
    token: int = 0
    slot: int = -1
    replica_id: str = ""
    step: int = 0
    ask: int = 0
    asking: bool = False
    min_size: int = 1
    timeout_ms: int = 60000
    vote_q: int = 0
    vote_ok: int = 0
    voting: int = 0  # the quorum whose decision it waits for
    in_op: bool = False
    cond: bool = False  # it asked with its vote: its step counts the voted step if it commits
    beat_s: float = 60.0  # silent this long (no message, heartbeats included): dropped
    heard: float = 0.0  # when its last message came (monotonic)
    hung: bool = False  # dropped for silence: shown one last round (F_HUNG), then closed
    left: bool = False  # said bye before any part in its quorum's step: one last round (F_LEFT)
    took_part: int = 0  # the last quorum it sent an op's part or a vote in
    moved: bool = False  # its vote came in a quorum since re-formed: its answer says so
    shm: Any = None  # the memory it shares for its averages (an mmap of its memfd)


@dataclass
class _Op:
    q: int
    key: str
    kind: str
    local: list[int]  # tokens of this node that take part, in rank order
    nodes: list[int]
    root: int  # the sender's token (xfer), else 0
    got: dict[int, tuple[dict[str, Any], bytearray]] = field(default_factory=dict)
    state: str = "gather"  # gather, engine, done, failed
    why: str = ""
    handle: Any = None
    stage: int = 0
    buf: Any = None
    data: Any = None  # a transfer's bytes, where its sender is local
    names: list[str] = field(default_factory=list)


class FtService:
    """One node's fault-tolerant members and its part of the rounds (module docstring)."""

    def __init__(
        self,
        path: Path,
        node: int,
        nodes: int,
        engine: Any,
        join_timeout_s: float = 1.0,
        first_quorum: int = 0,
    ) -> None:
        self.first_quorum = int(first_quorum)
        self.path, self.node, self.nodes, self.engine = Path(path), node, nodes, engine
        self.quorums = Q.Quorums(int(join_timeout_s * 1000))
        self._listener = sockets.listen(self.path)
        self._listener.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, None)
        # an op among the services that ends wakes the loop (its answer goes out at once,
        # not after the round's pause): its handle's callback writes a byte here
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, _WAKE)
        self._conns: dict[int, _Conn] = {}  # by token
        self._slots: list[int] = [0] * Q.MAX_MEMBERS  # token per slot, 0: free
        self._serial = 0
        self._ops: dict[tuple[int, str], _Op] = {}
        self._awake_until = 0.0
        # a vote came and the round that carried it did not decide: the next round at once
        # (the other services' members vote at about the same time; their round may have
        # been one of their pauses' rounds), once, then the pauses again
        self._eager = False
        self._started = False  # an op among the services started since the last look
        self._due = False  # a message that needs a round came since the last round
        self._busy = False  # a member of some node waited for an answer in the last round
        self._anyone = False
        self._last_ids: list[str] = []
        self._stopping = False
        self.rounds = 0
        self._thread = threading.Thread(target=self._run, name="totalreduce-ft", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        self._stopping = True
        self._thread.join(timeout)

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    # ------------------------------------------------------------------ the loop

    def _run(self) -> None:
        why = "the node's service stops"
        try:
            while not self._stopping:
                eager, self._eager = self._eager, False
                flying = None if ROUNDED_OPS else self._flying()
                if flying is not None:
                    if not self._drive(flying, IDLE_S):
                        self._eager = eager
                        continue  # an average ended and is answered: no round for it
                    self._started = False
                elif time.monotonic() < self._awake_until or (
                    eager and any(c.voting for c in self._conns.values())
                ):
                    self._poll(0.0)
                elif not self._anyone:
                    self._poll(EMPTY_S)
                elif self._busy or any(
                    c.asking or c.voting or c.in_op for c in self._conns.values()
                ):
                    self._poll(IDLE_S)
                else:
                    self._poll(max(IDLE_S, QUIET_S))
                if self._started and not self._due:  # an op among the services started:
                    self._started = False  # wait for it first (the round comes after)
                    self._eager = eager
                    continue
                self._started = self._due = False
                self._silent()
                table = self._round()
                ev = self.quorums.advance(table)
                self._apply(ev)
                self._progress()
        except Exception as exc:  # the rounds failed: a service died or stops
            if not self._stopping:
                log.error("fault-tolerant rounds stopped: %s", exc)
                why = f"the fault-tolerant rounds among the services failed: {exc}"
        finally:
            for conn in list(self._conns.values()):
                self._reply(conn, {"error": why})
                self._drop(conn, None)
            for c in [k.fileobj for k in self._sel.get_map().values()]:
                if isinstance(c, socket.socket) and c is not self._listener:
                    c.close()
            self._wake_w.close()
            self._sel.close()
            self._listener.close()
            try:
                self.path.unlink()
            except OSError:
                pass

    def _round(self) -> np.ndarray:
        table = np.zeros(self.nodes * Q.ROW, np.int64)
        row = table[self.node * Q.ROW : (self.node + 1) * Q.ROW]
        if self.node == 0:
            row[Q.CLOCK] = int(time.monotonic() * 1000)
            row[Q.FIRST] = self.first_quorum
        row[Q.ACTIVE] = sum(1 for c in self._conns.values() if c.asking or c.voting or c.in_op)
        for c in self._conns.values():
            flags = (
                (Q.F_NEXT if c.cond else 0) | (Q.F_HUNG if c.hung else 0)
                | (Q.F_LEFT if c.left else 0)
            )  # fmt: skip
            Q.write_member(
                row, c.slot,
                Q.Member(c.token, c.step, c.ask, c.min_size,
                         int(c.beat_s * 1000) if c.hung else c.timeout_ms, c.vote_q, c.vote_ok,
                         c.replica_id, flags),
            )  # fmt: skip
        if self.engine is not None:
            self.engine.allreduce(table, name=ROUND, op="sum", out=table)
        self.rounds += 1
        for c in [c for c in self._conns.values() if c.hung or c.left]:  # every service saw it
            if c.left:
                self._forget_conn(c, None)
            else:
                self._drop(c, f"no message within its timeout of {c.beat_s:g} s (hung or stopped)")
        out = table.reshape(self.nodes, Q.ROW)
        self._anyone = bool(out[:, Q.HEADER :: Q.FIELDS].any())  # a token in some slot
        now = time.monotonic()
        self._busy = bool(out[:, Q.ACTIVE].any()) or any(
            op.handle is not None for op in self._ops.values()
        )
        if self._busy:
            self._awake_until = now + AWAKE_S
        return out

    # ------------------------------------------------------------------ members' messages

    def _poll(self, timeout: float) -> None:
        """Read the members' messages for up to ``timeout`` s; a message that needs a
        round ends the wait.  A heartbeat only says "alive", and an op's part starts the
        op (among the services, a collective of its own): neither needs a round, and an op
        that ends among the services is answered at once, here (a round decides only
        asks, votes, arrivals and departures)."""
        end = time.monotonic() + timeout
        while not self._poll_once(timeout) and not self._started:
            timeout = end - time.monotonic()
            if timeout <= 0:
                return

    def _poll_once(self, timeout: float) -> bool:
        said = False
        for key, _ in self._sel.select(timeout):
            if key.data is None:
                self._accept()
                said = True
            elif key.data is _WAKE:
                try:
                    self._wake_r.recv(4096)
                except BlockingIOError:
                    pass
                if ROUNDED_OPS:
                    said = True
                else:
                    self._progress()
            else:
                conn = key.data
                conn.heard = time.monotonic()
                fds: list[int] = []
                try:
                    header, payload = F.recv(conn.sock, fds)
                except (OSError, F.FrameError) as exc:
                    for fd in fds:
                        os.close(fd)
                    self._drop(conn, f"its connection ended without bye ({exc})")
                    said = True
                    continue
                conn.heard = time.monotonic()  # (a long message, the state, counts whole)
                said = said or header.get("kind") not in _NO_ROUND
                try:
                    if fds or header.get("kind") == "shm":
                        self._map(conn, header, fds)
                    else:
                        self._message(conn, header, payload)
                except (KeyError, TypeError, ValueError, OSError) as exc:
                    self._reply(conn, {"error": f"bad message {header!r}: {exc}"})
                    self._drop(conn, f"it sent a bad message ({exc})")
        self._due = self._due or said
        return said

    def _accept(self) -> None:
        try:
            sock, _ = self._listener.accept()
        except BlockingIOError:
            return
        pid, uid, _gid = sockets.peer_credentials(sock)
        if uid != os.getuid():
            log.warning("fault-tolerant member pid %d of uid %d refused (not this user)", pid, uid)
            sock.close()
            return
        sock.setblocking(True)
        sock.settimeout(READ_TIMEOUT_S)
        conn = _Conn(sock, pid=pid, heard=time.monotonic())
        self._sel.register(sock, selectors.EVENT_READ, conn)

    def _message(self, conn: _Conn, h: dict[str, Any], payload: bytearray) -> None:
        kind = h["kind"]
        if kind == "hello":
            return self._hello(conn, h)
        if not conn.token:
            raise ValueError(f"a {kind!r} before the hello")
        if kind == "beat":
            return
        if kind == "bye":
            self._bye(conn)
        elif kind == "quorum":
            if conn.asking:
                raise ValueError("an ask while its last one is not answered")
            self._ask(conn, h)
        elif kind == "vote":
            conn.vote_q, conn.vote_ok = int(h["q"]), 1 if h["ok"] else 0
            moved = self._moved(conn.vote_q, conn)
            if moved:  # a step with no op, re-formed (a member left): the vote counts there
                conn.vote_q = self.quorums.now(conn.vote_q)
            conn.took_part = conn.vote_q
            done = self.quorums.decision(conn.vote_q)
            nxt = h.get("next")
            if nxt is not None:  # the next quorum's ask, with the vote
                if conn.asking:
                    raise ValueError("an ask while its last one is not answered")
                self._ask(conn, nxt)
                conn.step += 1 if done else 0
                conn.cond = done is None
            conn.moved = moved
            if done is None:
                conn.voting = conn.vote_q
                self._eager = not ROUNDED_OPS
            else:
                self._reply(conn, self._commit_answer(conn, conn.vote_q, done))
        elif kind == "op":
            self._op_part(conn, h, payload)
        else:
            raise ValueError(f"unknown kind {kind!r}")

    def _map(self, conn: _Conn, h: dict[str, Any], fds: list[int]) -> None:
        """A member passes the memory it shares for its averages: a memfd sealed against
        shrinking (so no read of it here can fault), at least ``size`` bytes."""
        try:
            if h.get("kind") != "shm" or len(fds) != 1 or not conn.token:
                raise ValueError(f"{len(fds)} descriptor(s) passed with a {h.get('kind')!r}")
            size = int(h["size"])
            seals = fcntl.fcntl(fds[0], fcntl.F_GET_SEALS)
            if not seals & fcntl.F_SEAL_SHRINK or os.fstat(fds[0]).st_size < size or size < 1:
                raise ValueError(f"shared memory of {size} bytes not sealed against shrinking")
            conn.shm = mmap.mmap(fds[0], size)
        finally:
            for fd in fds:
                os.close(fd)

    def _ask(self, conn: _Conn, h: dict[str, Any]) -> None:
        conn.step, conn.min_size = int(h["step"]), max(1, int(h["min_size"]))
        conn.timeout_ms = max(1, int(h["timeout_ms"]))
        conn.ask += 1
        conn.asking = True

    def _silent(self) -> None:
        """Drop the members silent for longer than their timeout (hung or stopped): each
        is told why (if its socket takes it) and shown flagged for one last round."""
        now = time.monotonic()
        for c in self._conns.values():
            if c.hung or c.left or now - c.heard <= c.beat_s:
                continue
            c.hung = True
            why = (
                f"member {c.replica_id} was dropped by the service of node {self.node}: no "
                f"message (heartbeats included) within its timeout of {c.beat_s:g} s (hung or "
                "stopped); attach again to rejoin as a new member"
            )
            log.warning("member %s (pid %d) is silent: %s", c.replica_id, c.pid, why)
            try:  # never block on a stopped member's full socket
                c.sock.send(F.frame({"kind": "dropped", "error": why}), socket.MSG_DONTWAIT)
            except OSError:
                pass

    def _hello(self, conn: _Conn, h: dict[str, Any]) -> None:
        if conn.token:
            raise ValueError("a second hello")
        if h.get("version") != F.VERSION:
            raise ValueError(f"protocol version {h.get('version')!r}, not {F.VERSION}")
        rid = str(h["replica_id"])
        if len(rid.encode()) > Q.RID_BYTES:
            raise ValueError(f"replica id {rid!r} is longer than {Q.RID_BYTES} bytes")
        if 0 not in self._slots:
            self._reply(conn, {"error": f"node {self.node} holds {Q.MAX_MEMBERS} members already"})
            return self._drop(conn, None)
        self._serial += 1
        conn.token = self.node << P.FT_TOKEN_NODE_SHIFT | self._serial
        conn.slot = self._slots.index(0)
        conn.replica_id = rid
        conn.pid = int(h.get("pid", conn.pid))
        conn.beat_s = max(0.05, float(h.get("timeout", conn.beat_s)))
        self._slots[conn.slot] = conn.token
        self._conns[conn.token] = conn
        log.info("member %s (pid %d) attached: token %#x (round %d)", rid, conn.pid, conn.token,
                 self.rounds)  # fmt: skip
        self._reply(conn, {"kind": "welcome", "token": conn.token, "node": self.node,
                           "nodes": self.nodes})  # fmt: skip

    def _bye(self, conn: _Conn) -> None:
        """A member leaves.  One of the current quorum that took no part in its step yet
        (no op, no vote) is shown one more round flagged ``F_LEFT``, so that the services
        may re-form the quorum without it (:meth:`.ft_quorum.Quorums._reform`); any other
        leave is at once what a death is."""
        qm = self.quorums.current
        if (
            qm is None or conn.token not in qm.members or conn.took_part == qm.qid
            or conn.in_op or conn.voting or qm.qid in self.quorums.broken
        ):  # fmt: skip
            return self._drop(conn, None)
        conn.left = True
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()

    def _reply(self, conn: _Conn, h: dict[str, Any], payload: Any = b"") -> None:
        if conn.hung or conn.left:
            return
        try:
            F.send(conn.sock, h, payload)
        except OSError as exc:
            self._drop(conn, f"a reply to it failed ({exc})")

    def _drop(self, conn: _Conn, how: str | None) -> None:
        if conn.sock.fileno() < 0:
            return
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()
        self._forget_conn(conn, how)

    def _forget_conn(self, conn: _Conn, how: str | None) -> None:
        if conn.token and self._conns.get(conn.token) is conn:
            self._conns.pop(conn.token, None)
            self._slots[conn.slot] = 0
            if how is None:
                log.info("member %s (pid %d) left (round %d)", conn.replica_id, conn.pid,
                         self.rounds)  # fmt: skip
            else:
                log.warning("member %s (pid %d) died (%s)", conn.replica_id, conn.pid, how)

    # ------------------------------------------------------------------ decisions

    def _apply(self, ev: Q.Events) -> None:
        for qid, why in ev.broken.items():
            for op in [op for op in self._ops.values() if op.q == qid]:
                self._fail(op, why, again=qid in ev.reformed)
        for t, why in ev.refused.items():
            conn = self._conns.get(t)
            if conn is not None:
                conn.asking = False
                self._reply(conn, {"kind": "quorum", "error": why})
        qm = ev.formed
        if qm is not None:
            changed = bool(qm.heal) or self._last_ids != qm.replica_ids or bool(ev.reformed)
            log.log(
                logging.INFO if changed else logging.DEBUG,
                "quorum %d: %d members %s, step %d%s%s", qm.qid, len(qm.members), qm.replica_ids,
                qm.step, f", state to {len(qm.heal)}" if qm.heal else "",
                "".join(f" (quorum {a} re-formed: a member left)" for a in ev.reformed),
            )  # fmt: skip
            self._last_ids = qm.replica_ids
        for qid, ok in ev.decided.items():
            for conn in list(self._conns.values()):
                if conn.voting == qid:
                    conn.voting = 0
                    head = self._commit_answer(conn, qid, ok)
                    if conn.cond:
                        conn.cond = False
                        conn.step += 1 if ok else 0
                        if qm is not None and conn.asking and conn.token in qm.members:
                            conn.asking = False  # the next quorum formed in the same round
                            head["quorum"] = self._quorum_answer(qm, conn.token)
                    self._reply(conn, head)
        if qm is not None:
            for t in qm.members:
                conn = self._conns.get(t)
                if conn is None or not conn.asking:
                    continue
                conn.asking = False
                self._reply(conn, self._quorum_answer(qm, t))
            # ops of older quorums are over (failed or answered): forget them
            for k in [k for k, op in self._ops.items() if op.q < qm.qid and op.handle is None]:
                del self._ops[k]

    def _commit_answer(self, conn: _Conn, qid: int, ok: bool) -> dict[str, Any]:
        head: dict[str, Any] = {"kind": "commit", "q": qid, "ok": ok}
        if not ok:
            head["why"] = self.quorums.broken.get(qid, f"quorum {qid} is over")
        if conn.moved:  # it voted in a quorum re-formed into this one: its new place
            conn.moved = False
            qm = self.quorums.current
            if qm is not None and qm.qid == qid:
                head["again"] = self._quorum_answer(qm, conn.token)
        return head

    def _moved(self, qid: int, conn: _Conn) -> bool:
        """Whether quorum ``qid`` was re-formed (a member left) into the current one,
        which holds ``conn``."""
        qm = self.quorums.current
        return (
            qm is not None and qid != qm.qid and self.quorums.now(qid) == qm.qid
            and conn.token in qm.members
        )  # fmt: skip

    def _quorum_answer(self, qm: Q.Quorum, t: int) -> dict[str, Any]:
        src = qm.heal.get(t)
        return {
            "kind": "quorum", "q": qm.qid, "rank": qm.rank(t), "size": len(qm.members),
            "replica_ids": qm.replica_ids, "step": qm.step,
            "heal_from": -1 if src is None else qm.rank(src),
            "heal_to": [qm.rank(d) for d, s in qm.heal.items() if s == t],
        }  # fmt: skip

    # ------------------------------------------------------------------ data ops

    def _op_part(self, conn: _Conn, h: dict[str, Any], payload: bytearray) -> None:
        qid, key, kind = int(h["q"]), str(h["key"]), str(h["op"])
        if kind not in _KINDS:
            raise ValueError(f"unknown op {kind!r}")
        qm = self.quorums.current
        conn.took_part = qid
        if self._moved(qid, conn):  # its quorum was re-formed (a member left): again
            assert qm is not None
            return self._reply(conn, self._again(qm, conn.token, key))
        op = self._ops.get((qid, key))
        if op is None:
            why = ""
            if qm is None or qid != qm.qid:
                why = f"quorum {qid} is over (the current one is {qm.qid if qm else 'none'})"
            elif qid in self.quorums.broken:
                why = self.quorums.broken[qid]
            elif conn.token not in qm.members:
                why = f"member {conn.replica_id} is not in quorum {qid}"
            if why:
                return self._reply(
                    conn, {"kind": "op", "key": key, "error": f"{kind} {key!r}: {why}"}
                )
            assert qm is not None
            if kind == "allreduce":
                parts, root = list(qm.members), 0
            else:
                root = qm.members[int(h["src"])]
                parts = [root] + [d for d, s in qm.heal.items() if s == root]
            local = [t for t in qm.members if t in parts and Q.token_node(t) == self.node]
            nodes = sorted({Q.token_node(t) for t in parts})
            op = self._ops[(qid, key)] = _Op(qid, key, kind, local, nodes, root)
        if op.state == "failed":
            return self._reply(conn, {"kind": "op", "key": key, "error": op.why})
        if conn.token not in op.local or conn.token in op.got or kind != op.kind:
            why = f"{kind} {key!r} of quorum {qid}: member {conn.replica_id} takes no part in it"
            return self._reply(conn, {"kind": "op", "key": key, "error": why})
        if "shm" in h:  # its part is in the memory it shares
            n = int(h["shm"])
            width = np.dtype(str(h["dtype"])).itemsize * int(h["count"])
            if kind != "allreduce" or conn.shm is None or not 0 < n == width <= len(conn.shm):
                raise ValueError(f"a part of {n} bytes in shared memory it did not pass")
            payload = memoryview(conn.shm)[:n]  # type: ignore[assignment]
        op.got[conn.token] = (h, payload)
        conn.in_op = True
        if len(op.got) == len(op.local):
            self._start(op)

    def _name(self, op: _Op, stage: str = "") -> str:
        name = f"\0ft {op.q} {op.key}{stage}"
        op.names.append(name)
        return name

    def _start(self, op: _Op) -> None:
        qm = self.quorums.current
        assert qm is not None
        first, _ = op.got[op.local[0]]
        if op.kind == "allreduce":
            shapes = {(str(h["dtype"]), int(h["count"])) for h, _ in op.got.values()}
            if len(shapes) != 1:
                why = f"allreduce {op.key!r} of quorum {op.q}: the members gave different arrays"
                return self._fail(op, f"{why} {sorted(shapes)}", abort=True)
            dt = np.dtype(str(first["dtype"]))
            code = DType.of(dt)
            parts = [np.frombuffer(op.got[t][1], dt) for t in op.local]
            if any(len(p) != int(first["count"]) for p in parts):
                return self._fail(op, f"allreduce {op.key!r}: a part's bytes differ from its count")
            buf = np.empty(len(parts[0]), dt)
            copy_into(buf, parts[0], code)
            for p in parts[1:]:
                reduce_into(buf, p, ReduceOp.SUM, code)
            op.buf = buf
            if len(op.nodes) > 1:
                op.state = "engine"
                op.handle = self._watch(
                    self.engine.allreduce_async(
                        buf, name=self._name(op), op="sum", out=buf, group=Group(op.nodes)
                    )
                )
            else:
                self._finish(op)
        else:
            here = Q.token_node(op.root) == self.node
            data = np.frombuffer(op.got[op.root][1], np.uint8) if here else None
            if len(op.nodes) == 1:
                op.buf = data
                return self._finish(op)
            op.state = "engine"
            op.buf = np.array([0 if data is None else len(data)], np.int64)
            root = op.nodes.index(Q.token_node(op.root))
            op.handle = self._watch(
                self.engine.broadcast_async(
                    op.buf, root, name=self._name(op, " length"), out=op.buf, group=Group(op.nodes)
                )
            )
            op.stage = 1
            op.data = data

    def _flying(self) -> Any:
        """The handle of an op among the services still in flight, or None."""
        for op in self._ops.values():
            if op.handle is not None and not op.handle.done():
                return op.handle
        return None

    def _drive(self, handle: Any, span: float) -> bool:
        """Wait for ``handle``'s op up to ``span`` s (its wait drives the engine, as a
        round's does; left to the comm thread alone a small op among the services ends
        late), having read the members' messages first.  True when a round is due (a
        message needs one, or the op did not end in time); False once the op ended
        (answered here: no round needed)."""
        if self._poll_once(0.0):
            return True
        try:
            handle.wait(span)
        except TimeoutError:
            return True
        except Exception:  # noqa: S110 (the op failed: _progress says why to its members)
            pass
        self._progress()
        return self._poll_once(0.0)

    def _watch(self, handle: Any) -> Any:
        """``handle``, whose end wakes the loop (from the thread that ends it)."""
        self._started = not ROUNDED_OPS
        handle.add_done_callback(self._woken)
        return handle

    def _woken(self, _handle: Any) -> None:
        try:
            self._wake_w.send(b"w")
        except OSError:  # full (the loop is awake anyway) or closed (it stopped)
            pass

    def _progress(self) -> None:
        for op in list(self._ops.values()):
            h = op.handle
            if h is None or not h.done():
                continue
            op.handle = None
            try:
                h.wait()
            except Exception as exc:  # the engine's op failed (an abort, a mismatch, a node)
                self._fail(op, f"{op.kind} {op.key!r} of quorum {op.q}: {exc}")
            if op.state != "engine":
                self._forget(op)
                continue
            if op.kind == "xfer" and op.stage == 1:
                n = int(op.buf[0])
                data = op.data
                buf = np.empty(n, np.uint8) if data is None else data.copy()
                root = op.nodes.index(Q.token_node(op.root))
                op.buf, op.stage = buf, 2
                op.handle = self._watch(
                    self.engine.broadcast_async(
                        buf, root, name=self._name(op), out=buf, group=Group(op.nodes)
                    )
                )
                continue
            self._finish(op)
            self._forget(op)

    def _forget(self, op: _Op) -> None:
        if self.engine is not None:
            for name in op.names:
                self.engine.forget_name(name)
        op.names.clear()

    def _finish(self, op: _Op) -> None:
        qm = self.quorums.current
        op.state = "done"
        if op.kind == "allreduce":
            assert qm is not None
            dt = op.buf.dtype
            finish_average(op.buf, len(qm.members), DType.of(dt))
            head = {"kind": "op", "key": op.key, "dtype": str(dt), "count": len(op.buf)}
            for t in op.local:
                conn = self._conns.get(t)
                if conn is not None and "shm" in op.got[t][0] and conn.shm is not None:
                    np.copyto(np.frombuffer(conn.shm, dt, len(op.buf)), op.buf)
                    self._answer(t, {**head, "shm": op.buf.nbytes}, b"")
                else:
                    self._answer(t, head, op.buf)
        else:
            for t in op.local:
                if t == op.root:
                    self._answer(t, {"kind": "op", "key": op.key}, b"")
                else:
                    self._answer(t, {"kind": "op", "key": op.key}, op.buf)
        op.got.clear()

    def _answer(self, token: int, head: dict[str, Any], payload: Any) -> None:
        conn = self._conns.get(token)
        if conn is not None:
            conn.in_op = False
            self._reply(conn, head, payload)

    def _again(self, qm: Q.Quorum, token: int, key: str) -> dict[str, Any]:
        """The answer to an op of a quorum re-formed into ``qm``: send it again there."""
        return {"kind": "op", "key": key, "again": self._quorum_answer(qm, token)}

    def _fail(self, op: _Op, why: str, abort: bool = False, again: bool = False) -> None:
        """Fail ``op`` on this service (aborted among the services if it started there);
        ``again``: its quorum was re-formed, its members send it again in the new one."""
        if op.state in ("done", "failed"):
            return
        if self.engine is not None and len(op.nodes) > 1 and (op.handle is not None or abort):
            name = op.names[-1] if op.names else self._name(op)
            self.engine.abort(name, 0, why)
        op.state, op.why = "failed", why
        qm = self.quorums.current
        for t in op.got:
            if again and qm is not None and t in qm.members:
                self._answer(t, self._again(qm, t, op.key), b"")
            else:
                self._answer(t, {"kind": "op", "key": op.key, "error": why}, b"")
        op.got.clear()

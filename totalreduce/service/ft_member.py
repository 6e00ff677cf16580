"""A fault-tolerant member: one training process (replica) of a job that survives deaths.

A :class:`Member` talks to its node's service on ``ft{n}.sock`` (``totalreduce serve
--fault-tolerant``; docs/fault_tolerance.md).  It asks for a quorum at the start of a
step (:meth:`Member.start_quorum`: the members, its rank among them, the step to resume,
and whom it sends state to or receives it from), runs the step's averages among the
quorum (:meth:`Member.allreduce`), sends or receives state (:meth:`Member.send_state`,
:meth:`Member.recv_state`), and votes at the end (:meth:`Member.should_commit`: the
same answer on every member).  No torch here: :mod:`totalreduce.torch.ft` builds
torchft's names on it.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import socket
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import OpFailedError, TotalReduceError
from ..transport import ft_frames as F

#: An average of more bytes than this goes through shared memory (a memfd this member
#: passes to its service once, sealed against shrinking), not through the socket:
#: ``TOTALREDUCE_FT_SHM=0`` keeps every op on the socket.
SHM_FROM = 64 << 10
SHM = os.environ.get("TOTALREDUCE_FT_SHM", "1") != "0" and hasattr(os, "memfd_create")


class QuorumError(TotalReduceError):
    """No quorum could be formed (fewer members than ``min_replica_size`` in time)."""


class MemberDroppedError(TotalReduceError):
    """The service dropped this member: it sent nothing (heartbeats included) within its
    timeout (it was hung or stopped).  It is no member any more; attach again (a new
    :class:`Member`) to rejoin, receiving the state at the next quorum."""


class StepFailedError(OpFailedError):
    """An op of the current step failed: a member died or left, or a newer quorum formed.
    The step will not commit anywhere; ask for the next quorum."""


@dataclass(frozen=True)
class QuorumInfo:
    """A formed quorum as this member sees it."""

    qid: int
    rank: int
    size: int
    replica_ids: tuple[str, ...]
    step: int  # the step every member resumes at (the largest any member had)
    heal_from: int  # the rank that sends this member the state, -1: none
    heal_to: tuple[int, ...]  # the ranks this member sends the state to


class Member:
    """One member's connection to its node's service (module docstring)."""

    def __init__(
        self,
        replica_id: str,
        socket_path: str | os.PathLike[str] | None = None,
        timeout: float = 60.0,
        heartbeat: float | None = None,
    ) -> None:
        """``timeout``: how long an answer may take, and how long the service waits for a
        message of this member (a thread sends one every ``heartbeat`` seconds, default
        ``min(0.1, timeout / 4)``) before it drops it as hung."""
        self.path = F.find_ft_socket(socket_path)
        self.replica_id = str(replica_id)
        self.timeout = float(timeout)
        self.heartbeat = min(0.1, self.timeout / 4) if heartbeat is None else float(heartbeat)
        self._send_lock = threading.Lock()
        self._dropped: str | None = None
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.connect(str(self.path))
        except OSError as exc:
            self._sock.close()
            raise TotalReduceError(
                f"no fault-tolerant service answers on {self.path} ({exc}): start the services "
                "with 'totalreduce serve --fault-tolerant'"
            ) from None
        self._sock.settimeout(self.timeout)
        w = self._ask({"kind": "hello", "version": F.VERSION, "replica_id": self.replica_id,
                       "pid": os.getpid(), "timeout": self.timeout})[0]  # fmt: skip
        self.token, self.node = int(w["token"]), int(w["node"])
        self.quorum: QuorumInfo | None = None
        #: why the last vote did not commit (None after a commit)
        self.failure: str | None = None
        self._seq = 0
        #: an ask sent with the last vote: (the step it asked at, the quorum's answer if it
        #: came with the vote's)
        self._asked: tuple[int, dict[str, Any] | None] | None = None
        self._shm: mmap.mmap | None = None  # shared with the service (SHM_FROM)
        self._stop = threading.Event()
        self._beats = threading.Thread(target=self._beat, name="totalreduce-ft-beat", daemon=True)
        self._beats.start()

    def _beat(self) -> None:
        """Tell the service this member lives, every ``heartbeat`` seconds (a member that
        stops, hung or stopped, stops this too: its service drops it after ``timeout``)."""
        beat = F.frame({"kind": "beat"})
        while not self._stop.wait(self.heartbeat):
            sock = self._sock
            if sock is None:
                return
            try:
                with self._send_lock:
                    sock.sendall(beat)
            except OSError:
                return

    # ------------------------------------------------------------------ the socket

    def _ask(
        self, header: dict[str, Any], payload: Any = b"", timeout: float | None = None
    ) -> tuple[dict[str, Any], bytearray]:
        if self._sock is None:
            raise TotalReduceError(f"member {self.replica_id} is closed")
        if self._dropped is not None:
            raise MemberDroppedError(self._dropped)
        self._sock.settimeout(self.timeout if timeout is None else timeout)
        try:
            with self._send_lock:
                F.send(self._sock, header, payload)
        except OSError as exc:
            self._lost(header, exc)
        return self._read(header, timeout)

    def _read(
        self, header: dict[str, Any], timeout: float | None = None
    ) -> tuple[dict[str, Any], bytearray]:
        """The service's answer to ``header``."""
        self._sock.settimeout(self.timeout if timeout is None else timeout)
        try:
            reply, data = F.recv(self._sock)
        except TimeoutError:
            raise TimeoutError(
                f"member {self.replica_id}: no answer to {header['kind']!r} from the service "
                f"on {self.path} within {self._sock.gettimeout()} s"
            ) from None
        except (OSError, F.FrameError) as exc:
            self._lost(header, exc)
        if reply.get("kind") == "dropped":
            self._dropped = str(reply["error"])
            raise MemberDroppedError(self._dropped)
        if "error" in reply and reply.get("kind") not in ("op", "quorum"):
            raise TotalReduceError(f"the service on {self.path} refused: {reply['error']}")
        return reply, data

    def _lost(self, header: dict[str, Any], exc: Exception) -> Any:
        """The connection failed: raise why (the service's last word, if it dropped us)."""
        try:  # a "dropped" message may wait unread before the end of the connection
            self._sock.settimeout(0.05)
            reply, _ = F.recv(self._sock)
            if reply.get("kind") == "dropped":
                self._dropped = str(reply["error"])
        except (OSError, F.FrameError):
            pass
        if self._dropped is not None:
            raise MemberDroppedError(self._dropped) from None
        raise TotalReduceError(
            f"member {self.replica_id}: the service on {self.path} is gone while it sent "
            f"{header['kind']!r} ({exc})"
        ) from None

    def close(self) -> None:
        self._stop.set()
        if self._sock is not None:
            try:
                with self._send_lock:
                    F.send(self._sock, {"kind": "bye"})
            except OSError:
                pass
            self._sock.close()
            self._sock = None  # type: ignore[assignment]

    # ------------------------------------------------------------------ a step

    def start_quorum(
        self, step: int, min_replica_size: int = 1, timeout: float | None = None
    ) -> QuorumInfo:
        """Ask for the next quorum, having committed ``step`` steps; returns it once the
        services formed it (raises :class:`QuorumError` below ``min_replica_size``)."""
        t = self.timeout if timeout is None else float(timeout)
        if self._asked is not None:  # asked with the vote: the answer came with it or comes
            want, got = self._asked
            self._asked = None
            if int(step) != want:
                raise TotalReduceError(
                    f"member {self.replica_id}: start_quorum(step={step}), but its vote asked "
                    f"for this quorum at step {want}"
                )
            h = got if got is not None else self._read({"kind": "quorum"}, timeout=t + 5.0)[0]
        else:
            h, _ = self._ask(
                {"kind": "quorum", "step": int(step), "min_size": int(min_replica_size),
                 "timeout_ms": max(1, int(t * 1000))},
                timeout=t + 5.0,
            )  # fmt: skip
        if "error" in h:
            raise QuorumError(f"member {self.replica_id}: {h['error']}")
        self._seq = 0
        return self._requorum(h)

    def _requorum(self, h: dict[str, Any]) -> QuorumInfo:
        """This member's quorum is the one ``h`` describes (a new one, or the current one
        re-formed without a member that left before the step started: the same step)."""
        self.quorum = QuorumInfo(
            int(h["q"]), int(h["rank"]), int(h["size"]), tuple(h["replica_ids"]),
            int(h["step"]), int(h["heal_from"]), tuple(h["heal_to"]),
        )  # fmt: skip
        return self.quorum

    def _q(self, what: str) -> QuorumInfo:
        if self.quorum is None:
            raise TotalReduceError(f"member {self.replica_id}: {what} before start_quorum()")
        return self.quorum

    def _op(self, header: dict[str, Any], payload: Any, what: str) -> tuple[dict[str, Any], Any]:
        q = self._q(what)
        if "key" not in header:  # the quorum's allreduces, counted alike on every member
            self._seq += 1
            header["key"] = f"{self._seq}"
        header.update(kind="op", q=q.qid)
        h, data = self._ask(header, payload)
        while "again" in h:  # a member left before the step started: the quorum re-formed
            q = self._requorum(h["again"])
            header["q"] = q.qid
            h, data = self._ask(header, payload)
        if "error" in h:
            raise StepFailedError(f"member {self.replica_id} (rank {q.rank}): {h['error']}")
        return h, data

    def allreduce(self, x: np.ndarray) -> np.ndarray:
        """The average of ``x`` over the quorum's members (a new array, ``x``'s shape).
        Every member must call it in the same order with the same shape and type."""
        a = np.ascontiguousarray(x)
        head: dict[str, Any] = {"op": "allreduce", "dtype": a.dtype.str, "count": a.size}
        if SHM and a.nbytes > SHM_FROM:  # through the memory shared with the service
            shm = self._shared(a.nbytes)
            np.copyto(np.frombuffer(shm, a.dtype, a.size), a.reshape(-1))
            head["shm"] = a.nbytes
            h, _ = self._op(head, b"", "allreduce")
            return np.frombuffer(shm, a.dtype, a.size).reshape(a.shape).copy()
        h, data = self._op(head, a.reshape(-1).view(np.uint8), "allreduce")
        return np.frombuffer(data, np.dtype(h["dtype"])).reshape(a.shape)

    def _shared(self, nbytes: int) -> mmap.mmap:
        """This member's memory shared with its service, at least ``nbytes`` long: a
        memfd passed once (again when it must grow), sealed so it cannot shrink under
        the service's reads."""
        if self._shm is not None and len(self._shm) >= nbytes:
            return self._shm
        size = max(nbytes, 2 * len(self._shm) if self._shm is not None else 0)
        size = -(-size // mmap.PAGESIZE) * mmap.PAGESIZE
        fd = os.memfd_create("totalreduce-ft", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL)
            shm = mmap.mmap(fd, size)
            if self._sock is None:
                raise TotalReduceError(f"member {self.replica_id} is closed")
            try:
                with self._send_lock:
                    F.send_fd(self._sock, {"kind": "shm", "size": size}, fd)
            except OSError as exc:
                self._lost({"kind": "shm"}, exc)
        finally:
            os.close(fd)
        self._shm = shm
        return shm

    def send_state(self, data: bytes | bytearray | memoryview) -> None:
        """Send ``data`` (the state) to the members this one heals (``heal_to``)."""
        q = self._q("send_state")
        if not q.heal_to:
            return
        self._op({"op": "xfer", "src": q.rank, "key": f"state {q.rank}"}, data, "send_state")

    def recv_state(self) -> bytearray:
        """The state the member ``heal_from`` sends this one."""
        q = self._q("recv_state")
        if q.heal_from < 0:
            raise TotalReduceError(f"member {self.replica_id} has no one to receive state from")
        _, data = self._op(
            {"op": "xfer", "src": q.heal_from, "key": f"state {q.heal_from}"}, b"", "recv_state"
        )  # fmt: skip
        return data

    def should_commit(
        self,
        ok: bool = True,
        timeout: float | None = None,
        *,
        ask_next: int | None = None,
        min_replica_size: int = 1,
        quorum_timeout: float | None = None,
    ) -> bool:
        """Vote on the quorum's step; True only if every member voted ok while alive
        (the same answer on every member).

        ``ask_next``: the step this member had committed before this vote; the vote then
        also asks for the next quorum (with ``min_replica_size`` and ``quorum_timeout``),
        at that step plus one if this one commits.  When every member of the quorum does,
        the round that decides the commit forms the next quorum too (one round a step, not
        two); the next :meth:`start_quorum` (whose ``step`` must be that one) returns it.
        The member is then in the next quorum: if it dies or leaves before that step ends,
        that step fails on every member."""
        q = self._q("should_commit")
        if self._asked is not None:
            raise TotalReduceError(
                f"member {self.replica_id}: should_commit() twice without start_quorum()"
            )
        head: dict[str, Any] = {"kind": "vote", "q": q.qid, "ok": bool(ok)}
        if ask_next is not None:
            t = self.timeout if quorum_timeout is None else float(quorum_timeout)
            head["next"] = {"step": int(ask_next), "min_size": int(min_replica_size),
                            "timeout_ms": max(1, int(t * 1000))}  # fmt: skip
        h, _ = self._ask(head, timeout=timeout)
        if "again" in h:  # the quorum re-formed (a member left) before any op of this step
            self._requorum(h["again"])
        self.failure = None if h["ok"] else str(h.get("why") or "a member voted no")
        if ask_next is not None:
            self._asked = (int(ask_next) + (1 if h["ok"] else 0), h.get("quorum"))
        return bool(h["ok"])


def default_socket(directory: str | os.PathLike[str], node: int) -> Path:
    return F.ft_socket(Path(directory), node)

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

import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import OpFailedError, TotalReduceError
from ..transport import ft_frames as F


class QuorumError(TotalReduceError):
    """No quorum could be formed (fewer members than ``min_replica_size`` in time)."""


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
    ) -> None:
        self.path = F.find_ft_socket(socket_path)
        self.replica_id = str(replica_id)
        self.timeout = float(timeout)
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
                       "pid": os.getpid()})[0]  # fmt: skip
        self.token, self.node = int(w["token"]), int(w["node"])
        self.quorum: QuorumInfo | None = None
        self._seq = 0

    # ------------------------------------------------------------------ the socket

    def _ask(
        self, header: dict[str, Any], payload: Any = b"", timeout: float | None = None
    ) -> tuple[dict[str, Any], bytearray]:
        if self._sock is None:
            raise TotalReduceError(f"member {self.replica_id} is closed")
        self._sock.settimeout(self.timeout if timeout is None else timeout)
        try:
            F.send(self._sock, header, payload)
            reply, data = F.recv(self._sock)
        except TimeoutError:
            raise TimeoutError(
                f"member {self.replica_id}: no answer to {header['kind']!r} from the service "
                f"on {self.path} within {self._sock.gettimeout()} s"
            ) from None
        except (OSError, F.FrameError) as exc:
            raise TotalReduceError(
                f"member {self.replica_id}: the service on {self.path} is gone ({exc})"
            ) from None
        if "error" in reply and reply.get("kind") not in ("op", "quorum"):
            raise TotalReduceError(f"the service on {self.path} refused: {reply['error']}")
        return reply, data

    def close(self) -> None:
        if self._sock is not None:
            try:
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
        h, _ = self._ask(
            {"kind": "quorum", "step": int(step), "min_size": int(min_replica_size),
             "timeout_ms": max(1, int(t * 1000))},
            timeout=t + 5.0,
        )  # fmt: skip
        if "error" in h:
            raise QuorumError(f"member {self.replica_id}: {h['error']}")
        self.quorum = QuorumInfo(
            int(h["q"]), int(h["rank"]), int(h["size"]), tuple(h["replica_ids"]),
            int(h["step"]), int(h["heal_from"]), tuple(h["heal_to"]),
        )  # fmt: skip
        self._seq = 0
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
        if "error" in h:
            raise StepFailedError(f"member {self.replica_id} (rank {q.rank}): {h['error']}")
        return h, data

    def allreduce(self, x: np.ndarray) -> np.ndarray:
        """The average of ``x`` over the quorum's members (a new array, ``x``'s shape).
        Every member must call it in the same order with the same shape and type."""
        a = np.ascontiguousarray(x)
        head = {"op": "allreduce", "dtype": a.dtype.str, "count": a.size}
        h, data = self._op(head, a.reshape(-1).view(np.uint8), "allreduce")
        return np.frombuffer(data, np.dtype(h["dtype"])).reshape(a.shape)

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

    def should_commit(self, ok: bool = True, timeout: float | None = None) -> bool:
        """Vote on the quorum's step; True only if every member voted ok while alive
        (the same answer on every member)."""
        q = self._q("should_commit")
        h, _ = self._ask({"kind": "vote", "q": q.qid, "ok": bool(ok)}, timeout=timeout)
        return bool(h["ok"])


def default_socket(directory: str | os.PathLike[str], node: int) -> Path:
    return F.ft_socket(Path(directory), node)

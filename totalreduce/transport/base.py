"""The transport protocol: the few non-blocking point-to-point calls the comm thread needs.

Only the comm thread calls a transport.  Buffers are contiguous ``uint8``
numpy arrays (or views); a request is whatever the transport returns and is
only ever handed back to the same transport.  Matching follows MPI: messages
from one sender on one tag are received in the order they were sent
(non-overtaking), and a receive may name a source or take any.
"""

from __future__ import annotations

import os
from typing import Any, Protocol

import numpy as np

from ..errors import TransportError

ANY_SOURCE = -1


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # an exited process its parent has not reaped yet
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


class OversizeMessage(TransportError):
    """A message longer than the receiver allows arrived; it was consumed and dropped."""

    def __init__(self, source: int, nbytes: int, limit: int) -> None:
        super().__init__(
            f"message of {nbytes} bytes from rank {source} exceeds the {limit}-byte limit"
        )
        self.source = source
        self.nbytes = nbytes


class Transport(Protocol):
    """Non-blocking messaging among ``size`` ranks; this end is ``rank``."""

    rank: int
    #: The number of ranks, 0..size-1.
    size: int
    #: Human-readable description for logs and the benchmark.
    description: str

    def isend(self, buf: np.ndarray, dest: int, tag: int) -> Any:
        """Start sending ``buf``; it must not change until the request completes."""

    def irecv(self, buf: np.ndarray, source: int, tag: int) -> Any:
        """Start receiving into ``buf`` from ``source`` (or ``ANY_SOURCE``)."""

    def test(self, req: Any) -> tuple[bool, int, int]:
        """(done, source, bytes received) of a receive; for a send only ``done`` matters."""

    def testsome(self, reqs: list[Any], counts: list[int] | None = None) -> list[int]:
        """Indices of the requests in ``reqs`` that completed since the last call.

        With ``counts`` (a list), the bytes each completed receive got are appended
        to it, in the order of the indices.  If some requests failed, raises
        :class:`TransportError` with ``done`` (the indices that completed, and
        ``counts`` filled for them), ``failed`` (their indices) and ``peer``.
        """

    def poll_message(self, tag: int, limit: int) -> tuple[int, np.ndarray] | None:
        """Take the next whole message on ``tag`` from any source, if one has arrived.

        Returns ``(source, bytes)`` without blocking, or None.  A message longer
        than ``limit`` bytes is consumed and refused with :class:`OversizeMessage`,
        so one bad message never blocks the ones behind it.
        """

    def alive(self, peer: int) -> bool | None:
        """Whether rank ``peer``'s process still runs: True/False, or None if unknown."""

    def cancel(self, req: Any) -> None:
        """Cancel a receive that has not matched; it then completes in ``testsome``."""

    def node_layout(self) -> tuple[int, int, int, int]:
        """(local rank, local size, node, nodes) of this rank."""

    def close(self) -> None:
        """Release the transport's resources; no call may follow."""

"""Notices between the services of different nodes.

A service tells the others when its node's part of a job is over (its clients
all left, or one died with work in flight) and when it stops, so that no op on
another node waits forever for a contribution that will never come.  Notices
are small JSON objects sent to every other node over a transport of their own
(a second duplicate of the world communicator), so they never mix with the
engine's frames.  Only the service's main thread uses a :class:`PeerChannel`.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import numpy as np

from ..transport.base import ANY_SOURCE, Transport

log = logging.getLogger("totalreduce.daemon.peers")

TAG = 11
MAX_NOTICE = 16 << 10


class PeerChannel:
    """Send a notice to every other node; collect the notices that arrived."""

    def __init__(self, transport: Transport) -> None:
        self.t = transport
        self.rank = transport.rank
        self.size = transport.size
        self._buf = np.empty(MAX_NOTICE, dtype=np.uint8)
        self._recv: Any = None
        self._sends: list[tuple[Any, np.ndarray]] = []
        self._post()

    def _post(self) -> None:
        if self.size > 1:
            self._recv = self.t.irecv(self._buf, ANY_SOURCE, TAG)

    def broadcast(self, notice: dict[str, Any]) -> None:
        raw = json.dumps(dict(notice, node=self.rank), allow_nan=False).encode()[:MAX_NOTICE]
        for peer in range(self.size):
            if peer == self.rank:
                continue
            msg = np.frombuffer(raw, dtype=np.uint8).copy()
            self._sends.append((self.t.isend(msg, peer, TAG), msg))

    def poll(self) -> list[dict[str, Any]]:
        """Notices received since the last call (each has the sender's ``node``)."""
        out: list[dict[str, Any]] = []
        while self._recv is not None:
            done, source, nbytes = self.t.test(self._recv)
            if not done:
                break
            try:
                notice = json.loads(bytes(self._buf[:nbytes]).decode())
                if isinstance(notice, dict):
                    notice["node"] = source
                    out.append(notice)
            except ValueError:
                log.error("ignoring a malformed notice of %d bytes from node %d", nbytes, source)
            self._post()
        if self._sends:
            left = self.t.testsome([r for r, _ in self._sends])
            if left:
                gone = set(left)
                self._sends = [s for i, s in enumerate(self._sends) if i not in gone]
        return out

    def close(self, timeout: float = 2.0) -> None:
        """Let sent notices leave (up to ``timeout``), cancel the receive, free the transport."""
        deadline = time.monotonic() + timeout
        while self._sends and time.monotonic() < deadline:
            self.poll()
            time.sleep(0.001)
        if self._recv is not None:
            try:
                self.t.cancel(self._recv)
            except Exception as exc:  # the job may be tearing down
                log.debug("cancelling the notice receive failed: %s", exc)
            self._recv = None
        self.t.close()

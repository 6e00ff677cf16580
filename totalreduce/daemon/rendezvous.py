"""One op as the node's local clients submit it: the local half of the three phases.

A :class:`Rendezvous` gathers the contributions of the ``N`` local clients to one
op (same name, same generation), checks they agree on what the op is, and once
all are in becomes one engine op.  With several local clients the service
reduces the inputs into a scratch buffer (phase 1), the engine reduces the
nodes' scratch buffers around the ring (phase 2), and the service copies the
result to every client's output (phase 3).  With one local client the engine
reads the client's input and writes its output in place: no copy at all.

This module holds the data and the arithmetic of the local phases (with the
Numba kernels); :mod:`.server` decides when they run.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ..dtypes import DType, ReduceOp
from ..errors import InvalidArgumentError, OpFailedError, OpMismatchError
from ..kernels import copy_into, finish_average, reduce_into
from . import shm

if TYPE_CHECKING:
    from .server import Client

#: What keys a rendezvous: ("s", name), ("i", name) or ("u", k) for the k-th unnamed op.
NameKey = tuple[str, Any]

KINDS = ("allreduce", "broadcast", "barrier")
DTYPES = {d.name.lower(): d for d in DType}
OPS = {o.name.lower(): o for o in ReduceOp}


class State(enum.Enum):
    PENDING = "waiting for local clients"
    RUNNING = "running across nodes"
    DONE = "done"
    FAILED = "failed"


@dataclass(frozen=True)
class OpShape:
    """What every contribution to one op must agree on."""

    kind: str
    dtype: DType
    count: int
    op: ReduceOp
    root: int
    algorithm: str | None

    def text(self) -> str:
        if self.kind == "barrier":
            return "a barrier"
        what = f"{self.kind} of {self.count} {self.dtype.name.lower()}"
        if self.kind == "allreduce":
            return f"{what} (op {self.op.name.lower()})"
        return f"{what} (root {self.root})"


@dataclass(eq=False)
class Contribution:
    """One client's part: its completion slot and its buffers (views of its shared memory)."""

    client: Client
    slot: int
    seq: int
    src: np.ndarray | None
    dst: np.ndarray | None

    def complete(self) -> None:
        control = self.client.control
        if control is not None and control.complete(self.slot, self.seq):
            self.client.signal()

    def fail(self, error: BaseException) -> None:
        control = self.client.control
        if control is not None and control.fail(self.slot, self.seq, error_kind(error), str(error)):
            self.client.signal()


def error_kind(error: BaseException) -> int:
    if isinstance(error, OpMismatchError):
        return shm.ERROR_MISMATCH
    if isinstance(error, InvalidArgumentError):
        return shm.ERROR_INVALID
    if isinstance(error, OpFailedError):
        return shm.ERROR_FAILED
    return shm.ERROR_OTHER


@dataclass(eq=False)
class Rendezvous:
    """The local clients' contributions to op ``key`` generation ``generation`` of one job."""

    epoch: int
    key: NameKey
    generation: int
    engine_name: str
    shape: OpShape
    created: float = field(default_factory=time.monotonic)
    contributions: dict[int, Contribution] = field(default_factory=dict)
    seen: int = 0  # local clients that submitted it (contributed or refused)
    priority: int = 0
    state: State = State.PENDING
    error: BaseException | None = None
    scratch: np.ndarray | None = None
    direct: bool = False
    deadline: float | None = None
    deadline_reason: str = ""
    aborted: bool = False
    warned: bool = False

    @property
    def label(self) -> str:
        """The op as its clients name it."""
        kind, name = self.key
        if kind == "u":
            return f"unnamed {self.shape.kind} #{name}"
        return f"op {name!r} generation {self.generation}"

    @property
    def engine_generation(self) -> int:
        return 0 if self.key[0] == "u" else self.generation

    def fail_all(self, error: BaseException) -> None:
        """End every contribution with ``error`` (each client sees it in its slot)."""
        self.state = State.FAILED
        self.error = error
        for c in self.contributions.values():
            c.fail(error)
            c.client.unfinished.discard(self)
        self.release()

    def release(self) -> None:
        """Forget the buffers and the clients once the op ended.

        The engine may keep a reference to its last op for a while; this keeps
        that from holding on to clients (and their shared memory) that left.
        """
        self.scratch = None
        for c in self.contributions.values():
            c.src = c.dst = None
        self.contributions.clear()

    # ------------------------------------------------------------------ local phases

    def gather(self) -> np.ndarray:
        """Phase 1 with several local clients: the scratch buffer the engine reduces."""
        s = self.shape
        buf = np.empty(s.count, dtype=s.dtype.numpy)
        parts = [self.contributions[i] for i in sorted(self.contributions)]
        if s.kind == "allreduce":
            first = parts[0].src
            assert first is not None
            copy_into(buf, first, s.dtype)
            op = ReduceOp.SUM if s.op is ReduceOp.AVG else s.op
            for c in parts[1:]:
                assert c.src is not None
                reduce_into(buf, c.src, op, s.dtype)
        self.scratch = buf
        return buf

    def seed_root(self, local_rank: int) -> None:
        """Broadcast from a client of this node: its input is what the engine sends."""
        src = self.contributions[local_rank].src
        assert self.scratch is not None and src is not None
        copy_into(self.scratch, src, self.shape.dtype)

    def scatter(self, contributors: int) -> None:
        """Phase 3: finish an average and copy the result to every live client's output."""
        s = self.shape
        buf = self.scratch
        if buf is not None and s.kind == "allreduce" and s.op is ReduceOp.AVG:
            finish_average(buf, contributors, s.dtype)
        for c in self.contributions.values():
            if c.client.closed:
                continue
            if buf is not None and c.dst is not None:
                copy_into(c.dst, buf, s.dtype)
            c.complete()

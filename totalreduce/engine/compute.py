"""The computation list and the reducer that drains it.

A received segment that must be reduced (or copied, or accumulated) becomes a
:class:`ComputeRequest`; so do the local operations of a schedule's prologue and
epilogue.  The loop runs small requests itself, through the same kernels
(``inline_compute_bytes``, 1 MiB by default: one default segment), because on the
machines measured a thread hand-off costs more than reducing one segment; larger
ones go on the :class:`ComputeList`, which the reducer (``service/reducer.py``, the
reduce thread) drains in order with the Numba kernels, which release the
interpreter lock, so big prologues and epilogues overlap the op's traffic.  Either
way a finished request comes back through ``done`` for the loop.
"""

from __future__ import annotations

import enum
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..dtypes import DType, ReduceOp


class ComputeKind(enum.IntEnum):
    COPY = 1  # dst = src
    REDUCE = 2  # dst = dst (op) src
    ACCUMULATE = 3  # dst = dst + weight * src
    SCALE = 4  # dst = weight * src (src may be dst)
    AVERAGE = 5  # dst = dst / divisor


@dataclass(eq=False)
class ComputeRequest:
    """One unit of arithmetic: the seed's computation-list entry.

    ``owner`` and ``token`` tell the comm thread what finished (a payload and
    a receive segment, or a local op); ``scratch`` is a pool buffer to return.
    """

    kind: ComputeKind
    dtype: DType
    dst: np.ndarray
    src: np.ndarray | None
    op: ReduceOp = ReduceOp.SUM
    weight: float = 1.0
    divisor: int = 1
    owner: Any = None
    token: int = -1
    scratch: np.ndarray | None = None
    error: BaseException | None = None
    base: np.ndarray | None = None  # REDUCE: dst = base (op) src, when given


class ComputeList:
    """A FIFO of compute requests between the comm thread and the reducer."""

    def __init__(self) -> None:
        self._todo: deque[ComputeRequest] = deque()
        self._cv = threading.Condition()
        self.done: deque[ComputeRequest] = deque()
        self._closed = False

    def put(self, req: ComputeRequest) -> None:
        with self._cv:
            self._todo.append(req)
            self._cv.notify()

    def get(self) -> ComputeRequest | None:
        """Next request, blocking; None once closed and drained."""
        with self._cv:
            while not self._todo:
                if self._closed:
                    return None
                self._cv.wait()
            return self._todo.popleft()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    def __len__(self) -> int:
        return len(self._todo)

"""The reduce thread: drains the computation list with the Numba kernels.

Requests run strictly in the order they were queued, so the local operations
of one op (prologue copy, then its receives, then its epilogue) never race.
The kernels release the interpreter lock, so reduction overlaps the comm
thread and the training thread.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from .. import kernels
from ..engine.compute import ComputeKind, ComputeList, ComputeRequest

log = logging.getLogger("totalreduce.service.reducer")


def execute(req: ComputeRequest) -> None:
    """Run one compute request."""
    dt, dst, src = req.dtype, req.dst, req.src
    kind = req.kind
    if kind is ComputeKind.REDUCE:
        if req.base is not None:
            kernels.copy_into(dst, req.base, dt)
        kernels.reduce_into(dst, src, req.op, dt)
    elif kind is ComputeKind.COPY:
        if src is not None and src.ctypes.data != dst.ctypes.data:
            kernels.copy_into(dst, src, dt)
    elif kind is ComputeKind.ACCUMULATE:
        kernels.axpy_into(dst, src, req.weight, dt)
    elif kind is ComputeKind.SCALE:
        if src is not None and src.ctypes.data != dst.ctypes.data:
            kernels.copy_into(dst, src, dt)
        kernels.scale_into(dst, req.weight, dt)
    elif kind is ComputeKind.AVERAGE:
        kernels.finish_average(dst, req.divisor, dt)
    else:  # pragma: no cover - the enum is closed
        raise ValueError(f"unknown compute kind {kind!r}")


class Reducer:
    """Body of the reduce thread."""

    def __init__(self, work: ComputeList, notify: Callable[[], None]) -> None:
        self.work = work
        self.notify = notify
        self.elements = 0

    def run(self) -> None:
        while True:
            req = self.work.get()
            if req is None:
                return
            try:
                execute(req)
                self.elements += req.dst.size
            except Exception as exc:  # handed to the op's owner, never lost
                log.exception("compute request failed")
                req.error = exc
            self.work.done.append(req)
            self.notify()

"""The reduce thread: drains the computation list with the Numba kernels.

Requests run strictly in the order they were queued, so the local operations
of one op (prologue copy, then its receives, then its epilogue) never race.
The kernels release the interpreter lock, so reduction overlaps the comm
thread and the training thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

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
        self.trace: Any = None  # the timeline recorder, when one is on

    def run(self) -> None:
        while True:
            req = self.work.get()
            if req is None:
                return
            t0 = time.perf_counter_ns()
            try:
                execute(req)
                self.elements += req.dst.size
                if self.trace is not None:
                    spec = req.owner.spec
                    self.trace.compute(
                        spec.name,
                        spec.generation,
                        req.kind.name.lower(),
                        req.dst.nbytes,
                        t0,
                        time.perf_counter_ns(),
                    )
            except Exception as exc:  # handed to the op's owner, never lost
                log.exception("compute request failed")
                req.error = exc
            self.work.done.append(req)
            self.notify()

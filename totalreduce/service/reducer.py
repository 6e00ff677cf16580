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


def run(
    kind: ComputeKind,
    dt: Any,
    dst: Any,
    src: Any,
    op: Any = None,
    weight: float = 1.0,
    divisor: int = 1,
    base: Any = None,
) -> None:
    """Run one unit of arithmetic (the loop calls this directly for small segments)."""
    if kind is ComputeKind.REDUCE:
        if base is not None:
            kernels.copy_into(dst, base, dt)
        kernels.reduce_into(dst, src, op, dt)
    elif kind is ComputeKind.COPY:
        if src is not None and src.ctypes.data != dst.ctypes.data:
            kernels.copy_into(dst, src, dt)
    elif kind is ComputeKind.ACCUMULATE:
        kernels.axpy_into(dst, src, weight, dt)
    elif kind is ComputeKind.SCALE:
        if src is not None and src.ctypes.data != dst.ctypes.data:
            kernels.copy_into(dst, src, dt)
        kernels.scale_into(dst, weight, dt)
    elif kind is ComputeKind.AVERAGE:
        kernels.finish_average(dst, divisor, dt)
    else:  # pragma: no cover - the enum is closed
        raise ValueError(f"unknown compute kind {kind!r}")


def execute(req: ComputeRequest) -> None:
    """Run one compute request."""
    run(req.kind, req.dtype, req.dst, req.src, req.op, req.weight, req.divisor, req.base)


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
                trace = self.trace  # read once: start/stop_timeline may swap it
                if trace is not None:
                    spec = req.owner.spec
                    trace.compute(
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

"""Reductions and local work of the main loop's ops, and what each one done releases.

:class:`ReduceHooks` is a base of :class:`~.loop.CommLoop`.  A body that arrived is
applied to its op (copied, reduced or accumulated into its place) once the
segments it waits for are done; a prologue or epilogue step of an op is run in
order.  Small ones run right here, through the kernels the service hands in
(``_execute``, ``_run``), sparing two thread hand-offs; large ones go to the reducer
thread (``compute``) and come back through ``compute.done``.  Each one done counts
down what waits for it: sends that may go, receives that may apply, the op's start
or completion.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from ..algorithms.schedule import Action, LocalKind, LocalOp
from ..errors import OpFailedError
from .compute import ComputeKind, ComputeList, ComputeRequest
from .floating import BufferPool
from .payload import OpState, Payload

_LOCAL_KIND = {
    LocalKind.COPY: ComputeKind.COPY,
    LocalKind.SCALE: ComputeKind.SCALE,
    LocalKind.AVERAGE: ComputeKind.AVERAGE,
    LocalKind.ACCUMULATE: ComputeKind.ACCUMULATE,
}
_RECV_KIND = {
    Action.COPY: ComputeKind.COPY,
    Action.REDUCE: ComputeKind.REDUCE,
    Action.ACCUMULATE: ComputeKind.ACCUMULATE,
}


class ReduceHooks:
    """Reductions and local work of the main loop (see the module docstring)."""

    rank: int
    cfg: Any  # totalreduce.config.Config
    trace: Any
    pool: BufferPool
    compute: ComputeList
    _execute: Callable[[ComputeRequest], None] | None
    _run: Callable[..., None] | None
    _inline: deque[tuple[Payload, int, np.ndarray, bool]]
    _draining: bool

    # provided by CommLoop and its other bases
    _fail: Callable[..., None]
    _push: Callable[[Payload, int], None]
    _start: Callable[[Payload], None]
    _maybe_finish: Callable[[Payload], None]
    _complete: Callable[[Payload], None]

    # ------------------------------------------------------------------ local work

    def _run_locals(self, reqs: list[ComputeRequest]) -> None:
        """Run a prologue or epilogue in order: inline when small, else on the reducer."""
        inline = sum(r.dst.nbytes for r in reqs) <= self.cfg.inline_compute_bytes
        for req in reqs:
            self._compute(req, inline)

    def _compute(self, req: ComputeRequest, inline: bool) -> None:
        """Run a request here (small) or queue it for the reduce thread (large).

        Either way it comes back through ``compute.done``, so finishing it never
        recurses into the code that queued it.
        """
        if inline and self._execute is not None:
            t0 = time.perf_counter_ns() if self.trace is not None else 0
            try:
                self._execute(req)
            except Exception as exc:  # handed to the op, as the reducer would
                req.error = exc
            if self.trace is not None:
                spec = req.owner.spec
                self.trace.compute(
                    spec.name, spec.generation, req.kind.name.lower(), req.dst.nbytes, t0,
                    time.perf_counter_ns(),
                )  # fmt: skip
            self.compute.done.append(req)
        else:
            self.compute.put(req)

    def _local_request(self, p: Payload, lop: LocalOp) -> ComputeRequest:
        d = lop.dst
        dst = p.region(d.buffer, d.offset, d.count)
        src = None if lop.src is None else p.region(lop.src.buffer, lop.src.offset, lop.src.count)
        return ComputeRequest(
            _LOCAL_KIND[lop.kind],
            p.spec.dtype,
            dst,
            src,
            op=p.spec.op,
            weight=lop.weight,
            divisor=lop.divisor,
            owner=p,
            token=-1,
        )

    # ------------------------------------------------------------------ bodies applied

    def _on_body(self, p: Payload, q: int, body: np.ndarray) -> None:
        """A body for receive segment ``q`` is in a scratch buffer."""
        p.got[q] = 1
        if p.state is OpState.ACTIVE and p.recv_waits[q] == 0:
            self._apply(p, q, body)
        else:
            p.pending[q] = body

    def _apply(self, p: Payload, q: int, body: np.ndarray, scratch: bool = True) -> None:
        if self._run is not None and body.nbytes <= self.cfg.inline_compute_bytes:
            # Reduce right here, in order, without recursing through the segments it
            # releases (a chain of pending segments can be long).
            self._inline.append((p, q, body, scratch))
            if not self._draining:
                self._drain_inline()
            return
        seg = p.spec.plan.recvs[q]
        reg = seg.region
        dst = p.region(reg.buffer, reg.offset, reg.count)
        src = body.view(p.spec.dtype.numpy)
        req = ComputeRequest(
            _RECV_KIND[seg.action],
            p.spec.dtype,
            dst,
            src,
            op=p.spec.op,
            weight=seg.weight,
            owner=p,
            token=q,
            scratch=body if scratch else None,
        )
        if seg.src is not None:
            req.base = p.region(seg.src.buffer, seg.src.offset, seg.src.count)
        self._compute(req, body.nbytes <= self.cfg.inline_compute_bytes)

    def _drain_inline(self) -> None:
        self._draining = True
        run = self._run
        trace = self.trace
        try:
            while self._inline:
                p, q, body, scratch = self._inline.popleft()
                if p.state is not OpState.ACTIVE:
                    if scratch:
                        self.pool.give(body)
                    continue
                seg = p.spec.plan.recvs[q]
                reg = seg.region
                dst = p.bufs[reg.buffer][reg.offset : reg.end]
                src = body.view(p.spec.dtype.numpy)
                base = None
                if seg.src is not None:
                    base = p.bufs[seg.src.buffer][seg.src.offset : seg.src.end]
                t0 = time.perf_counter_ns() if trace is not None else 0
                try:
                    run(  # type: ignore[misc]  # _apply queues here only with a kernel
                        _RECV_KIND[seg.action],
                        p.spec.dtype,
                        dst,
                        src,
                        p.spec.op,
                        seg.weight,
                        1,
                        base,
                    )
                except Exception as exc:  # handed to the op, as the reducer would
                    if scratch:
                        self.pool.give(body)
                    self._fail(
                        p,
                        OpFailedError(
                            f"{p.spec.describe()}: reduction failed on rank {self.rank}: {exc}"
                        ),
                        tell_peers=True,
                    )
                    continue
                if trace is not None:
                    trace.compute(
                        p.spec.name, p.spec.generation, seg.action.name.lower(), dst.nbytes, t0,
                        time.perf_counter_ns(),
                    )  # fmt: skip
                if scratch:
                    self.pool.give(body)
                self._applied(p, q)
        finally:
            self._draining = False

    def _applied(self, p: Payload, q: int) -> None:
        p.recvs_left -= 1
        p.last_progress = time.monotonic()
        if self.trace is not None and not p.recvs_left:
            self.trace.op(p.spec.name, p.spec.generation, "reduced", p.spec.priority)
        for is_send, idx in p.spec.plan.after_recv[q]:
            if is_send:
                p.send_waits[idx] -= 1
                if p.send_waits[idx] == 0:
                    self._push(p, idx)
            else:
                p.recv_waits[idx] -= 1
                if p.recv_waits[idx] == 0 and idx in p.pending:
                    self._apply(p, idx, p.pending.pop(idx))
        self._maybe_finish(p)

    # ------------------------------------------------------------------ compute results

    def _on_computed(self, req: ComputeRequest) -> None:
        p: Payload = req.owner
        if req.scratch is not None:
            self.pool.give(req.scratch)
        if p.state in (OpState.FAILED, OpState.DONE):
            return
        if req.error is not None:
            self._fail(
                p,
                OpFailedError(
                    f"{p.spec.describe()}: reduction failed on rank {self.rank}: {req.error}"
                ),
                tell_peers=True,
            )
            return
        if req.token >= 0:
            self._applied(p, req.token)
            return
        p.local_left -= 1
        if p.local_left:
            return
        if p.state is OpState.PREPARING:
            self._start(p)
        elif p.state is OpState.FINISHING:
            self._complete(p)

"""The big loop: the communication thread's whole life.

Each pass of :meth:`CommLoop.run_once` does, in this order:

1. take new submissions from the client queue and turn them into payloads,
   resolving floating frames that now belong to them;
2. take finished compute requests back from the reducer and release what
   waited for them;
3. while a send slot is free, pick the most urgent ready segment (priority,
   then someone waiting, then submission order) and post its frame;
4. test the posted header receive; for each header that arrived, place its
   body: into the op's buffer, a scratch buffer, or a floating buffer;
5. test posted sends and body receives; advance the ops they belong to;
6. now and then, warn about ops that made no progress for a long time.

:meth:`CommLoop.run` repeats that and, when a pass made no progress, backs off
(sleeping from microseconds up to a millisecond, longer when no op is in
flight), so an idle service costs next to no CPU.  Nothing here blocks in the
transport.  The loop knows no algorithm: it executes the segment plans of
schedules.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..algorithms.schedule import Action, Buffer, LocalKind, LocalOp
from ..dtypes import DType, ReduceOp
from ..errors import FrameError, OpFailedError, OpMismatchError, TotalReduceError
from ..transport.base import ANY_SOURCE, Transport
from . import wire
from .compute import ComputeKind, ComputeList, ComputeRequest
from .floating import BufferPool, FloatingFrame, FloatingList
from .payload import OpKey, OpSpec, OpState, Payload
from .wire import FrameType, Header

log = logging.getLogger("totalreduce.engine")

ERROR_MISMATCH = 1
ERROR_FAILED = 2

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


@dataclass
class LoopConfig:
    """The loop's knobs (see ``service/config.py`` for their documentation)."""

    micro_bytes: int = 16384
    max_inflight_sends: int = 8
    floating_pool_bytes: int = 256 << 20
    stall_warning_s: float = 60.0
    backoff_min_s: float = 1e-6
    backoff_max_s: float = 1e-3
    idle_backoff_max_s: float = 5e-3
    urgent_backoff_max_s: float = 5e-5
    spin_s: float = 2e-4
    inline_compute_bytes: int = 1 << 20


@dataclass(eq=False)
class _InflightSend:
    payload: Payload
    index: int
    parts: int
    header: np.ndarray


@dataclass(eq=False)
class _BodyRecv:
    payload: Payload | None  # None: floating or discarded
    index: int  # receive segment, or -1
    buf: np.ndarray
    header: Header
    scratch: bool  # buf came from the pool
    discard: bool = False


@dataclass
class LoopStats:
    frames_sent: int = 0
    frames_received: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    floating_frames: int = 0
    ops_completed: int = 0
    ops_failed: int = 0
    passes: int = 0
    idle_sleeps: int = 0


class CommLoop:
    """Executes payloads' segment plans over a transport; runs in the comm thread."""

    def __init__(
        self,
        transport: Transport,
        config: LoopConfig | None = None,
        execute: Callable[[ComputeRequest], None] | None = None,
    ) -> None:
        self.t = transport
        # Small reductions run right here (through the kernels the service hands
        # in), sparing two thread hand-offs; big ones go to the reducer thread.
        self._execute = execute
        self.rank = transport.rank
        self.size = transport.size
        self.cfg = config or LoopConfig()
        # Ops and aborts in one queue, so an abort and a later resubmission of the
        # same op are seen in the order they were asked for.
        self.submissions: deque[OpSpec | tuple[OpKey, str, str]] = deque()
        self.compute = ComputeList()
        self.wake = threading.Event()
        self.pool = BufferPool(self.cfg.floating_pool_bytes)
        self.floating = FloatingList(self.pool)
        self.table: dict[OpKey, Payload] = {}
        self.failed: dict[OpKey, str] = {}
        # Ops finished here, remembered for a while: a frame for one of them
        # means a peer disagrees about the op (it expects data we never send).
        self.completed: dict[OpKey, str] = {}
        self.sendable: set[Payload] = set()
        self.stats = LoopStats()
        self._seq = 0
        self._inflight: list[_InflightSend] = []
        self._reqs: list[Any] = []  # parallel to _owners
        self._owners: list[tuple[str, Any]] = []
        self._deferred: deque[Header] = deque()
        self._next_tag = [0] * self.size
        self._header_cap = wire.HEADER_SIZE + self.cfg.micro_bytes
        self._header_buf = np.empty(self._header_cap, dtype=np.uint8)
        self._header_req: Any = None
        self._last_stall_check = time.monotonic()
        self.fatal: BaseException | None = None
        self.bad_peers: dict[int, FrameError] = {}
        self.stopping = False

    # ------------------------------------------------------------------ client side

    def submit(self, spec: OpSpec) -> None:
        """Queue an op (any thread)."""
        self.submissions.append(spec)
        self.wake.set()

    def notify(self) -> None:
        self.wake.set()

    @property
    def busy(self) -> bool:
        return bool(self.table or self.submissions or self._inflight or len(self.compute))

    # ------------------------------------------------------------------ the loop

    def run(self, stop: threading.Event) -> None:
        """The big loop: progress until ``stop`` is set; back off when idle."""
        cfg = self.cfg
        delay = cfg.backoff_min_s
        last = time.perf_counter()
        try:
            self._post_header_recv()
            while not stop.is_set():
                if self.run_once():
                    delay = cfg.backoff_min_s
                    last = time.perf_counter()
                    continue
                if self.busy and time.perf_counter() - last < cfg.spin_s:
                    # Just made progress with ops in flight: the next frame is
                    # likely microseconds away; yield the interpreter, no sleep.
                    time.sleep(0)
                    continue
                self.stats.idle_sleeps += 1
                self.wake.wait(delay)
                self.wake.clear()
                if not self.busy:
                    ceiling = cfg.idle_backoff_max_s
                elif any(p.spec.urgent for p in self.table.values()):
                    ceiling = cfg.urgent_backoff_max_s  # someone is blocked on us
                else:
                    ceiling = cfg.backoff_max_s
                delay = min(delay * 2, ceiling)
        except BaseException as exc:  # never die silently: fail every op
            log.exception("rank %d: comm loop stopped by an error", self.rank)
            self.fatal = exc
            self._fail_all(exc)
            raise
        finally:
            self._cancel_header_recv()

    def run_once(self) -> bool:
        """One pass of the big loop; True when anything progressed."""
        self.stats.passes += 1
        progressed = False
        while self.submissions:
            spec = self.submissions.popleft()
            progressed = True
            if isinstance(spec, tuple):
                self._abort(*spec)
                continue
            try:
                self._activate(spec)
            except Exception as exc:  # one bad op must not stop the loop
                log.exception("rank %d: activating %s failed", self.rank, spec.describe())
                p = self.table.get(spec.key)
                err = OpFailedError(
                    f"{spec.describe()}: rank {self.rank} could not start it: {exc}"
                )
                if p is not None and p.spec is spec:
                    self._fail(p, err, tell_peers=True)
                else:
                    self._finish_spec(spec, err)
        done = self.compute.done
        while done:
            self._on_computed(done.popleft())
            progressed = True
        if self._deferred and self._retry_deferred():
            progressed = True
        if self._post_sends():
            progressed = True
        if self._poll_headers():
            progressed = True
        if self._reqs and self._poll_requests():
            progressed = True
        now = time.monotonic()
        if now - self._last_stall_check > 1.0:
            self._last_stall_check = now
            self._check_stalls(now)
        return progressed

    # ------------------------------------------------------------------ activation

    def _activate(self, spec: OpSpec) -> None:
        key = spec.key
        if self.fatal is not None:
            self._finish_spec(spec, self.fatal)
            return
        bad = [self.bad_peers[w] for w in spec.group if w in self.bad_peers]
        if bad:
            self._finish_spec(spec, bad[0])
            return
        if key in self.table:
            self._finish_spec(
                spec, OpFailedError(f"{spec.describe()} submitted twice on rank {self.rank}")
            )
            return
        s = spec.schedule
        dtype = spec.dtype.numpy
        inbuf = spec.inbuf
        bufs = {Buffer.INPUT: inbuf, Buffer.OUTPUT: spec.outbuf}
        bufs[Buffer.WORK] = self.pool.take_work(s.work_count * spec.dtype.itemsize).view(dtype)
        prologue: list[LocalOp | tuple[np.ndarray, np.ndarray]] = list(s.prologue)
        if spec.in_place and s.reads_input:
            private = np.empty_like(inbuf)
            bufs[Buffer.INPUT] = private
            prologue.insert(0, (private, inbuf))
        self._seq += 1
        p = Payload.create(spec, self._seq, bufs)
        self.table[key] = p
        err = self.floating.take_error(key)
        frames = self.floating.take(key)
        if err is not None:
            msg, code = err
            for f in frames:
                self.pool.give(f.body)
            self._fail(p, _error_from_peer(msg, code), tell_peers=False)
            return
        for f in frames:
            if not self._file_frame(p, f.header, f.body):
                return
        p.local_left = len(prologue)
        if not prologue:
            self._start(p)
            return
        reqs = []
        for lop in prologue:
            if isinstance(lop, tuple):
                dst, src = lop
                reqs.append(ComputeRequest(ComputeKind.COPY, spec.dtype, dst, src, owner=p))
            else:
                reqs.append(self._local_request(p, lop))
        self._run_locals(reqs)

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
            try:
                self._execute(req)
            except Exception as exc:  # handed to the op, as the reducer would
                req.error = exc
            self.compute.done.append(req)
        else:
            self.compute.put(req)

    def _local_request(self, p: Payload, lop: LocalOp) -> ComputeRequest:
        d = lop.dst
        dst = p.view(d.buffer, d.offset, d.count)
        src = None if lop.src is None else p.view(lop.src.buffer, lop.src.offset, lop.src.count)
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

    def _start(self, p: Payload) -> None:
        """Prologue done: sends may go, arrived frames may apply."""
        if p.state is not OpState.PREPARING:
            return
        p.state = OpState.ACTIVE
        for i, w in enumerate(p.send_waits):
            if w == 0:
                p.push_ready(i)
        if p.ready:
            self.sendable.add(p)
        for q in [q for q in p.pending if p.recv_waits[q] == 0]:
            self._apply(p, q, p.pending.pop(q))
        self._maybe_finish(p)

    def _maybe_finish(self, p: Payload) -> None:
        if p.state is not OpState.ACTIVE or p.sends_left or p.recvs_left:
            return
        epilogue = p.spec.schedule.epilogue
        p.state = OpState.FINISHING
        if not epilogue:
            self._complete(p)
            return
        p.local_left = len(epilogue)
        self._run_locals([self._local_request(p, lop) for lop in epilogue])

    def _release_work(self, p: Payload) -> None:
        work = p.bufs.get(Buffer.WORK)
        if work is not None and work.size:
            self.pool.give_work(work.view(np.uint8))
            p.bufs[Buffer.WORK] = work[:0]

    def _complete(self, p: Payload) -> None:
        self._release_work(p)
        self.completed[p.key] = p.spec.describe()
        if len(self.completed) > 4096:
            self.completed.pop(next(iter(self.completed)))
        p.state = OpState.DONE
        self.table.pop(p.key, None)
        self.sendable.discard(p)
        self.stats.ops_completed += 1
        self._finish_spec(p.spec, None)

    @staticmethod
    def _finish_spec(spec: OpSpec, error: BaseException | None) -> None:
        if spec.on_done is not None:
            try:
                spec.on_done(error)
            except Exception:  # a user callback must not kill the comm thread
                log.exception("completion callback of %s failed", spec.describe())

    # ------------------------------------------------------------------ failures

    def _fail(self, p: Payload, error: BaseException, *, tell_peers: bool) -> None:
        if p.state in (OpState.DONE, OpState.FAILED):
            return
        p.state = OpState.FAILED
        p.error = error
        if not any(rec.payload is p for rec in self._inflight):
            self._release_work(p)  # else a send may still read it: let it go to the GC
        self.table.pop(p.key, None)
        self.sendable.discard(p)
        p.ready.clear()
        for buf in p.pending.values():
            self.pool.give(buf)
        p.pending.clear()
        self.failed[p.key] = str(error)
        if len(self.failed) > 4096:
            self.failed.pop(next(iter(self.failed)))
        self.stats.ops_failed += 1
        if tell_peers:
            code = ERROR_MISMATCH if isinstance(error, OpMismatchError) else ERROR_FAILED
            self._send_error(p, str(error), code)
        log.error("rank %d: %s", self.rank, error)
        self._finish_spec(p.spec, error)

    def _fail_all(self, error: BaseException) -> None:
        for p in list(self.table.values()):
            self._fail(p, error, tell_peers=False)
        while self.submissions:
            item = self.submissions.popleft()
            if not isinstance(item, tuple):  # an abort needs no answer
                self._finish_spec(item, error)

    def _send_error(self, p: Payload, message: str, code: int) -> None:
        for world in p.spec.group:
            if world != self.rank:
                self._error_frame(p.key, world, message, code)

    def _error_frame(self, key: OpKey, dest: int, message: str, code: int) -> None:
        """Tell rank ``dest`` that op ``key`` failed (an inline ERROR frame)."""
        body = message.encode()[: self.cfg.micro_bytes]
        h = Header(
            frame_type=FrameType.ERROR,
            dtype=DType.INT64,
            kind=wire.OpKind.ALLREDUCE,
            algorithm=wire.AlgorithmCode.NONE,
            op=ReduceOp.SUM,
            flags=wire.FLAG_INLINE,
            sender=self.rank,
            body_tag=0,
            wire_id=key[0],
            generation=key[1],
            step=0,
            segment=0,
            nbytes=len(body),
            count=0,
            param=code,
            context=0,
        )
        msg = np.empty(wire.HEADER_SIZE + len(body), dtype=np.uint8)
        wire.encode(h, memoryview(msg))
        msg[wire.HEADER_SIZE :] = np.frombuffer(body, dtype=np.uint8)
        self._track(self.t.isend(msg, dest, wire.HEADER_TAG), ("ctl", msg))

    def request_abort(self, key: OpKey, name: str, reason: str) -> None:
        """Fail an op here and on every rank, submitted or not (any thread)."""
        self.submissions.append((key, name, reason))
        self.wake.set()

    def _abort(self, key: OpKey, name: str, reason: str) -> None:
        err = OpFailedError(reason)
        p = self.table.get(key)
        if p is not None:
            self._fail(p, err, tell_peers=True)
            return
        # Not submitted here (yet): remember, and tell every rank.
        for f in self.floating.take(key):
            self.pool.give(f.body)
        self.floating.add_error(key, reason, ERROR_FAILED)
        for world in range(self.size):
            if world != self.rank:
                self._error_frame(key, world, reason, ERROR_FAILED)
        log.error("rank %d: op %r generation %d aborted: %s", self.rank, name, key[1], reason)

    # ------------------------------------------------------------------ sending

    def _header(
        self, p: Payload, ftype: FrameType, *, step: int, segment: int, nbytes: int, tag: int
    ) -> Header:
        s = p.spec
        return Header(
            frame_type=ftype,
            dtype=s.dtype,
            kind=s.kind,
            algorithm=s.algorithm,
            op=s.op,
            flags=wire.FLAG_INLINE if tag == 0 else 0,
            sender=self.rank,
            body_tag=tag,
            wire_id=s.wire_id,
            generation=s.generation,
            step=step,
            segment=segment,
            nbytes=nbytes,
            count=s.count,
            param=s.param,
            context=s.context,
        )

    def _pick(self) -> Payload | None:
        if not self.sendable:
            return None
        if len(self.sendable) == 1:
            return next(iter(self.sendable))
        return max(self.sendable, key=Payload.urgency)

    def _post_sends(self) -> bool:
        posted = False
        while len(self._inflight) < self.cfg.max_inflight_sends:
            p = self._pick()
            if p is None:
                break
            i = p.pop_ready()
            if not p.ready:
                self.sendable.discard(p)
            self._send_segment(p, i)
            posted = True
        return posted

    def _send_segment(self, p: Payload, i: int) -> None:
        seg = p.spec.plan.sends[i]
        reg = seg.region
        body = p.view(reg.buffer, reg.offset, reg.count).view(np.uint8)
        dest = p.spec.group[seg.peer]
        n = body.nbytes
        if n <= self.cfg.micro_bytes:
            h = self._header(p, FrameType.DATA, step=seg.step, segment=seg.segment, nbytes=n, tag=0)
            msg = np.empty(wire.HEADER_SIZE + n, dtype=np.uint8)
            wire.encode(h, memoryview(msg))
            msg[wire.HEADER_SIZE :] = body
            rec = _InflightSend(p, i, 1, msg)
            self._track(self.t.isend(msg, dest, wire.HEADER_TAG), ("send", rec))
        else:
            tag = wire.BODY_TAG_BASE + self._next_tag[dest]
            self._next_tag[dest] = (self._next_tag[dest] + 1) % wire.BODY_TAG_SPAN
            h = self._header(
                p, FrameType.DATA, step=seg.step, segment=seg.segment, nbytes=n, tag=tag
            )
            msg = np.empty(wire.HEADER_SIZE, dtype=np.uint8)
            wire.encode(h, memoryview(msg))
            rec = _InflightSend(p, i, 2, msg)
            self._track(self.t.isend(msg, dest, wire.HEADER_TAG), ("send", rec))
            self._track(self.t.isend(body, dest, tag), ("send", rec))
        self._inflight.append(rec)
        self.stats.frames_sent += 1
        self.stats.bytes_sent += n

    def _on_sent(self, rec: _InflightSend) -> None:
        rec.parts -= 1
        if rec.parts:
            return
        self._inflight.remove(rec)
        p = rec.payload
        if p.state in (OpState.FAILED, OpState.DONE):
            return
        p.sends_left -= 1
        p.last_progress = time.monotonic()
        self._release(p, p.spec.plan.after_send[rec.index])
        self._maybe_finish(p)

    # ------------------------------------------------------------------ receiving

    def _track(self, req: Any, owner: tuple[str, Any]) -> None:
        self._reqs.append(req)
        self._owners.append(owner)

    def _post_header_recv(self) -> None:
        self._header_req = self.t.irecv(self._header_buf, ANY_SOURCE, wire.HEADER_TAG)

    def _cancel_header_recv(self) -> None:
        if self._header_req is not None:
            try:
                self.t.cancel(self._header_req)
            except Exception as exc:  # tearing down: nothing more to do
                log.debug("cancelling the header receive failed: %s", exc)
            self._header_req = None

    def _poll_headers(self) -> bool:
        got = False
        for _ in range(64):
            done, source, length = self.t.test(self._header_req)
            if not done:
                break
            got = True
            # Copy out before re-posting: the buffer is reused at once.
            raw = self._header_buf[:length].copy()
            self._post_header_recv()
            self._on_header(raw, length, source)
        return got

    def _on_header(self, raw: np.ndarray, length: int, source: int) -> None:
        try:
            h = wire.decode(raw, length, self.size, self.cfg.micro_bytes)
            if h.sender != source:
                raise FrameError(f"malformed frame: says sender {h.sender}, came from {source}")
        except FrameError as exc:
            err = FrameError(f"rank {self.rank}: frame from rank {source} rejected: {exc}")
            log.error("%s", err)
            # A peer speaking garbage cannot be trusted for any op it is part of.
            for p in [p for p in self.table.values() if source in p.group_rank]:
                self._fail(p, err, tell_peers=True)
            self.bad_peers[source] = err
            return
        self.stats.frames_received += 1
        if h.frame_type is FrameType.ERROR:
            self._on_error_frame(h, raw)
            return
        inline = raw[wire.HEADER_SIZE :] if h.inline else None
        self._place(h, inline)

    def _on_error_frame(self, h: Header, raw: np.ndarray) -> None:
        msg = bytes(raw[wire.HEADER_SIZE : wire.HEADER_SIZE + h.nbytes]).decode(errors="replace")
        key = (h.wire_id, h.generation)
        p = self.table.get(key)
        if p is not None:
            self._fail(p, _error_from_peer(msg, h.param), tell_peers=False)
        elif key not in self.failed:
            for f in self.floating.take(key):
                self.pool.give(f.body)
            self.floating.add_error(key, msg, h.param)

    def _place(self, h: Header, inline: np.ndarray | None, retry: bool = False) -> bool:
        """Find a home for a data frame's body; False if it must wait for pool space."""
        key = (h.wire_id, h.generation)
        p = self.table.get(key)
        if p is None:
            if key in self.failed:
                self._receive_discard(h, inline)
                return True
            if key in self.completed:
                what = self.completed[key]
                kind = "receives from" if h.step == 0 and h.nbytes == 0 else "sends to"
                msg = (
                    f"{what}: rank {h.sender} {kind} rank {self.rank} at step {h.step}, but rank "
                    f"{self.rank} finished the op without that exchange (the ranks disagree on "
                    "the op's pattern: topology, weights, group or algorithm)"
                )
                log.error("rank %d: %s", self.rank, msg)
                self._error_frame(key, h.sender, msg, ERROR_MISMATCH)
                self._receive_discard(h, inline)
                return True
            if inline is not None:
                body = self.pool.take(h.nbytes)
                body[:] = inline
                self.floating.add(key, FloatingFrame(h, body))
                self.stats.floating_frames += 1
                return True
            if not self.pool.can_float(h.nbytes):
                if not retry:
                    self._deferred.append(h)
                return False
            body = self.pool.take(h.nbytes)
            self.pool.floating_bytes += h.nbytes  # reserved until filed
            req = self.t.irecv(body, h.sender, h.body_tag)
            self._track(req, ("body", _BodyRecv(None, -1, body, h, True)))
            self.stats.floating_frames += 1
            return True
        q = self._check_frame(p, h)
        if q is None:
            self._receive_discard(h, inline)
            return True
        p.arrived.add(q)
        p.last_progress = time.monotonic()
        if inline is not None:
            body = self.pool.take(h.nbytes)
            body[:] = inline
            self._on_body(p, q, body)
            return True
        seg = p.spec.plan.recvs[q]
        if seg.action is Action.COPY and p.recv_waits[q] == 0 and p.state is OpState.ACTIVE:
            dst = p.view(seg.region.buffer, seg.region.offset, seg.region.count).view(np.uint8)
            req = self.t.irecv(dst, h.sender, h.body_tag)
            self._track(req, ("body", _BodyRecv(p, q, dst, h, False)))
        else:
            body = self.pool.take(h.nbytes)
            req = self.t.irecv(body, h.sender, h.body_tag)
            self._track(req, ("body", _BodyRecv(p, q, body, h, True)))
        return True

    def _receive_discard(self, h: Header, inline: np.ndarray | None) -> None:
        """Receive a body nobody needs, so its sender is not left hanging."""
        if inline is not None or h.nbytes == 0:
            return
        body = self.pool.take(h.nbytes)
        req = self.t.irecv(body, h.sender, h.body_tag)
        self._track(req, ("body", _BodyRecv(None, -1, body, h, True, discard=True)))

    def _check_frame(self, p: Payload, h: Header) -> int | None:
        """The receive segment a frame fills, or None after failing the op."""
        why = p.mismatch(h, self.rank)
        if why is not None:
            self._fail(p, OpMismatchError(why), tell_peers=True)
            return None
        peer = p.group_rank.get(h.sender)
        q = None if peer is None else p.spec.plan.recv_index.get((h.step, peer, h.segment))
        if q is None or q in p.arrived:
            if p.spec.algorithm is wire.AlgorithmCode.NEIGHBOR and q is None and h.step == 0:
                # The announce step: the sender expects data this rank does not send.
                why = (
                    f"{p.spec.describe()}: rank {h.sender} receives from rank {self.rank}, but "
                    f"rank {self.rank} does not send to rank {h.sender} (check the topology or "
                    "src_weights / dst_weights)"
                )
            elif p.spec.algorithm is wire.AlgorithmCode.NEIGHBOR and q is None:
                why = (
                    f"{p.spec.describe()}: rank {h.sender} sends to rank {self.rank}, but "
                    f"rank {self.rank} does not receive from rank {h.sender} (check the topology "
                    "or src_weights / dst_weights)"
                )
            else:
                why = (
                    f"{p.spec.describe()}: rank {self.rank} got an unexpected frame from rank "
                    f"{h.sender} for step {h.step} segment {h.segment} (do the ranks use the "
                    "same algorithm, group and segment_bytes?)"
                )
            self._fail(p, OpMismatchError(why), tell_peers=True)
            return None
        want = p.spec.plan.recvs[q].region.count * p.spec.dtype.itemsize
        if h.nbytes != want:
            self._fail(
                p,
                OpMismatchError(
                    f"{p.spec.describe()}: step {h.step} segment {h.segment}: rank {self.rank} "
                    f"expects {want} bytes, rank {h.sender} sent {h.nbytes} (do the ranks use "
                    "the same segment_bytes?)"
                ),
                tell_peers=True,
            )
            return None
        return q

    def _file_frame(self, p: Payload, h: Header, body: np.ndarray) -> bool:
        """A floating frame whose op was just submitted; False if the op failed."""
        q = self._check_frame(p, h)
        if q is None:
            self.pool.give(body)
            return False
        p.arrived.add(q)
        self._on_body(p, q, body)
        return True

    def _on_body(self, p: Payload, q: int, body: np.ndarray) -> None:
        """A body for receive segment ``q`` is in a scratch buffer."""
        if p.state is OpState.ACTIVE and p.recv_waits[q] == 0:
            self._apply(p, q, body)
        else:
            p.pending[q] = body

    def _apply(self, p: Payload, q: int, body: np.ndarray) -> None:
        seg = p.spec.plan.recvs[q]
        reg = seg.region
        dst = p.view(reg.buffer, reg.offset, reg.count)
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
            scratch=body,
        )
        if seg.src is not None:
            req.base = p.view(seg.src.buffer, seg.src.offset, seg.src.count)
        self._compute(req, body.nbytes <= self.cfg.inline_compute_bytes)

    def _applied(self, p: Payload, q: int) -> None:
        p.recvs_left -= 1
        p.last_progress = time.monotonic()
        self._release(p, p.spec.plan.after_recv[q])
        self._maybe_finish(p)

    def _release(self, p: Payload, whom: list[tuple[bool, int]]) -> None:
        for is_send, idx in whom:
            if is_send:
                p.send_waits[idx] -= 1
                if p.send_waits[idx] == 0:
                    p.push_ready(idx)
                    self.sendable.add(p)
            else:
                p.recv_waits[idx] -= 1
                if p.recv_waits[idx] == 0 and idx in p.pending:
                    self._apply(p, idx, p.pending.pop(idx))

    def _on_body_received(self, rec: _BodyRecv) -> None:
        h = rec.header
        self.stats.bytes_received += h.nbytes
        if rec.discard:
            self.pool.give(rec.buf)
            return
        p = rec.payload
        if p is None:
            key = (h.wire_id, h.generation)
            self.pool.floating_bytes -= h.nbytes  # the reservation becomes the filing
            live = self.table.get(key)
            if live is not None:  # submitted while the body was on its way
                q = self._check_frame(live, h)
                if q is None:
                    self.pool.give(rec.buf)
                else:
                    live.arrived.add(q)
                    self._on_body(live, q, rec.buf)
            elif key in self.failed:
                self.pool.give(rec.buf)
            else:
                self.floating.add(key, FloatingFrame(h, rec.buf))
            return
        if p.state in (OpState.FAILED, OpState.DONE):
            if rec.scratch:
                self.pool.give(rec.buf)
            return
        if rec.scratch:
            self._on_body(p, rec.index, rec.buf)
        else:
            self._applied(p, rec.index)

    def _retry_deferred(self) -> bool:
        moved = False
        while self._deferred:
            if not self._place(self._deferred[0], None, retry=True):
                break
            self._deferred.popleft()
            moved = True
        return moved

    def _poll_requests(self) -> bool:
        idx = self.t.testsome(self._reqs)
        if not idx:
            return False
        done = set(idx)
        owners = [self._owners[i] for i in idx]
        self._reqs = [r for i, r in enumerate(self._reqs) if i not in done]
        self._owners = [o for i, o in enumerate(self._owners) if i not in done]
        for what, obj in owners:
            if what == "send":
                self._on_sent(obj)
            elif what == "body":
                self._on_body_received(obj)
        return True

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

    # ------------------------------------------------------------------ stalls

    def _check_stalls(self, now: float) -> None:
        limit = self.cfg.stall_warning_s
        for p in self.table.values():
            if p.warned or now - p.last_progress < limit:
                continue
            p.warned = True
            recv_from, send_to = p.waiting_on()
            log.warning(
                "rank %d: %s made no progress for %.0f s; waiting for frames from ranks %s%s",
                self.rank,
                p.spec.describe(),
                now - p.last_progress,
                recv_from,
                f", ready to send to ranks {send_to}" if send_to else "",
            )

    def stalled(self) -> list[str]:
        """Descriptions of the ops in flight and whom they wait for (for error messages)."""
        out = []
        for p in self.table.values():
            recv_from, _ = p.waiting_on()
            out.append(f"{p.spec.describe()} waits for ranks {recv_from}")
        return out


def _error_from_peer(message: str, code: int) -> TotalReduceError:
    if code == ERROR_MISMATCH:
        return OpMismatchError(message)
    return OpFailedError(message)

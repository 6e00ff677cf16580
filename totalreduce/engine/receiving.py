"""The receive side of the main loop: control messages in, frames to their ops.

:class:`ReceiveHooks` is a base of :class:`~.loop.CommLoop`.  Each pass takes every
control message that arrived (``_poll_messages``) and hands each frame to the
handler of its type (``_frame_handlers``: the handlers of other jobs live with
them: CTS, REJECT, READY and NEED in ``sending.py``, BYE, GONE and JOIN in
``peers.py``, PROBE and HAVE in ``stalls.py``, ERROR in ``failing.py``).  Here:
eager bodies (DATA) are applied or filed as floating frames, announcements (RTS)
answered with clear-to-send into the op's buffer or a pool buffer, or refused when
the op is not submitted here and the pool is full; large bodies are cleared before
they are announced (``_preclear``); a frame is matched to its receive segment
(``_match``) or, for an op not in the table, to what this rank knows of the op
(``_unknown_op``).  Then the posted body sends and receives are tested
(``_poll_requests``) and the bodies received go to their ops.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ..algorithms.schedule import Action
from ..errors import FrameError, OpMismatchError, TotalReduceError, TransportError
from ..transport.base import OversizeMessage, Transport
from . import wire
from .failures import ERROR_MISMATCH
from .floating import BufferPool, FloatingFrame, FloatingList
from .link import Link
from .payload import OpKey, OpSpec, OpState, Payload, describe_op
from .sending import _NO_SHAPE, _RECV, _SEND
from .wire import (
    BYE,
    CTS,
    DATA,
    ERROR,
    F_FLAGS,
    F_GEN,
    F_NBYTES,
    F_SEGMENT,
    F_STEP,
    F_WID,
    FLAG_NEED,
    FRAME_SIZE,
    GONE,
    HAVE,
    JOIN,
    NEED,
    PROBE,
    READY,
    REJECT,
    RTS,
)

if TYPE_CHECKING:
    from .lane import Lane


class _BodyRecv:
    """A posted body receive: into an op's place (payload set) or a floating pool buffer."""

    __slots__ = ("payload", "index", "buf", "frame", "scratch", "source", "req")

    def __init__(
        self,
        payload: Payload | None,
        index: int,
        buf: np.ndarray,
        frame: wire.Frame,
        scratch: bool,
        source: int,
    ) -> None:
        self.payload = payload
        self.index = index
        self.buf = buf
        self.frame = frame
        self.scratch = scratch
        self.source = source
        self.req: Any = None


class ReceiveHooks:
    """The receive side of the main loop (see the module docstring)."""

    rank: int
    world: int
    t: Transport
    cfg: Any  # totalreduce.config.Config
    stats: Any  # LoopStats
    trace: Any
    lane: Lane | None
    table: dict[OpKey, Payload]
    failed: OrderedDict[OpKey, str]
    completed: OrderedDict[OpKey, tuple[Any, ...]]
    floating: FloatingList
    pool: BufferPool
    bad_peers: dict[int, TotalReduceError]
    fatal: BaseException | None
    _left: set[int]
    _msg_cap: int
    _links: list[Link]
    _tag_span: int
    _rejected: dict[OpKey, set[int]]
    _bodies_inflight: int
    _reqs: list[Any]
    _owners: list[tuple[int, Any]]
    _handlers: dict[int, Callable[[int, wire.Frame, np.ndarray, int], None]]

    # provided by CommLoop and its other bases
    _activate: Callable[[OpSpec], None]
    _fail: Callable[..., None]
    _bad_peer: Callable[..., None]
    _error_frame: Callable[[OpKey, int, str, int], None]
    _on_error: Callable[[OpKey, str, int, int], None]
    _lane_fail: Callable[..., None]
    _who: Callable[[int], str]
    _control: Callable[..., None]
    _owe: Callable[[int, int, int], None]
    _credit: Callable[[int, int, int], None]
    _track: Callable[[Any, int, Any], None]
    _raise: Callable[[Payload], None]
    _sent: Callable[[Payload, int], None]
    _apply: Callable[..., None]
    _applied: Callable[[Payload, int], None]
    _on_body: Callable[[Payload, int, np.ndarray], None]
    _on_cts: Callable[[int, wire.Frame, np.ndarray, int], None]
    _on_reject: Callable[[int, wire.Frame, np.ndarray, int], None]
    _on_ready: Callable[[int, wire.Frame, np.ndarray, int], None]
    _on_need: Callable[[int, wire.Frame, np.ndarray, int], None]
    _on_bye: Callable[[int, wire.Frame, np.ndarray, int], None]
    _on_gone: Callable[[int, wire.Frame, np.ndarray, int], None]
    _on_join: Callable[[int, wire.Frame, np.ndarray, int], None]
    _on_probe: Callable[[int, wire.Frame, np.ndarray, int], None]
    _on_have: Callable[[int, wire.Frame, np.ndarray, int], None]
    _on_error_frame: Callable[[int, wire.Frame, np.ndarray, int], None]

    # ------------------------------------------------------------------ messages and frames

    def _poll_messages(self) -> bool:
        got = False
        limit = self._msg_cap
        micro = self.cfg.micro_bytes
        for _ in range(64):
            try:
                msg = self.t.poll_message(wire.CONTROL_TAG, limit)
            except OversizeMessage as exc:
                self._bad_peer(
                    exc.source,
                    FrameError(f"rank {self.rank}: message from rank {exc.source} refused: {exc}"),
                )
                got = True
                continue
            except TransportError as exc:
                peer = getattr(exc, "peer", None)
                if peer is None:
                    raise
                self._bad_peer(peer, exc)
                continue
            if msg is None:
                break
            got = True
            source, buf = msg
            if source in self.bad_peers:
                continue
            try:
                ctl, eager, frames = wire.split(buf, source, self.world, micro)
            except FrameError as exc:
                self._bad_peer(
                    source,
                    FrameError(f"rank {self.rank}: message from rank {source} refused: {exc}"),
                )
                continue
            self.stats.messages_received += 1
            if ctl or eager:
                self._credit(source, ctl, eager)
            if frames:
                self._owe(source, len(buf), 0)
                self._on_frames(source, buf, frames)
        return got

    def _frame_handlers(self) -> dict[int, Callable[[int, wire.Frame, np.ndarray, int], None]]:
        """What each frame type does: ``handler(source, frame, message, offset of its body)``."""
        return {
            DATA: self._on_data,
            RTS: self._on_rts,
            CTS: self._on_cts,
            REJECT: self._on_reject,
            READY: self._on_ready,
            NEED: self._on_need,
            BYE: self._on_bye,
            GONE: self._on_gone,
            JOIN: self._on_join,
            PROBE: self._on_probe,
            HAVE: self._on_have,
            ERROR: self._on_error_frame,
        }

    def _on_frames(
        self, source: int, buf: np.ndarray, frames: list[tuple[wire.Frame, int]]
    ) -> None:
        handlers = self._handlers
        for f, off in frames:
            if source in self.bad_peers and source not in self._left:
                return  # refused in the middle of this message: the rest is not trusted
            self.stats.frames_received += 1
            handler = handlers.get(f[0])
            if handler is not None:
                handler(source, f, buf, off)

    def _on_data(self, source: int, f: wire.Frame, buf: np.ndarray, off: int) -> None:
        key = (f[F_WID], f[F_GEN])
        n = f[F_NBYTES]
        charge = FRAME_SIZE + n
        self.stats.bytes_received += n
        p = self.table.get(key)
        if p is not None:
            self._owe(source, 0, charge)
            q = self._match(p, f, source)
            if q is None:
                return
            if self.trace is not None:
                t = time.perf_counter_ns()
                self.trace.segment(p.spec.name, p.spec.generation, "recv", source, n, t, t)
            body = buf[off : off + n]
            p.got[q] = 1
            if p.state is OpState.ACTIVE and p.recv_waits[q] == 0:
                self._apply(p, q, body, scratch=False)
            else:
                copy = self.pool.take(n)
                copy[:] = body
                p.pending[q] = copy
            return
        if self._unknown_op(source, f, key):
            self._owe(source, 0, charge)
            return
        fl = self.floating
        if fl.eager_held[source] + charge > fl.eager_share:
            self._owe(source, 0, charge)
            self._bad_peer(
                source,
                FrameError(
                    f"rank {self.rank}: message from rank {source} refused: {charge} eager bytes "
                    "beyond its credit "
                    f"(do all ranks use the same floating_pool_bytes and micro_bytes?)"
                ),
            )
            return
        copy = buf[off : off + n].copy()  # exact size: the pool bound counts these bytes
        fl.add(key, FloatingFrame(f, copy, source, charge))
        self.stats.floating_frames += 1

    def _on_rts(self, source: int, f: wire.Frame, buf: np.ndarray, off: int) -> None:
        key = (f[F_WID], f[F_GEN])
        n = f[F_NBYTES]
        if n > self.cfg.segment_bytes:
            self._bad_peer(
                source,
                FrameError(
                    f"rank {self.rank}: message from rank {source} refused: it announces a body "
                    f"of {n} bytes, larger than "
                    f"segment_bytes={self.cfg.segment_bytes} (do all ranks use the same "
                    "segment_bytes?)"
                ),
            )
            return
        p = self.table.get(key)
        link = self._links[source]
        tag = wire.BODY_TAG_BASE + link.body_tag()
        if p is not None and p.precleared:
            g = p.group_rank.get(source)
            q = None if g is None else p.spec.plan.recv_index.get((f[F_STEP], g, f[F_SEGMENT]))
            if q is not None and q in p.precleared:
                # Cleared already (the clear and this announcement crossed, or the sender
                # had not submitted the op then): answer with the same tag.
                why = p.mismatch(f, self._who(source), self._who(self.rank))
                if why is not None:
                    self._fail(p, OpMismatchError(why), tell_peers=True, also=source)
                    return
                step, segment = f[F_STEP], f[F_SEGMENT]
                self._control(source, CTS, _NO_SHAPE, key, aux=p.precleared[q], step=step,
                              segment=segment)  # fmt: skip
                return
        if p is not None:
            q = self._match(p, f, source)
            if q is None:
                return
            seg = p.spec.plan.recvs[q]
            reg = seg.region
            if (
                seg.action is Action.COPY
                and p.recv_waits[q] == 0
                and p.state is OpState.ACTIVE
                and seg.src is None
            ):
                dst = p.bytes[reg.buffer][reg.offset * p.isz : reg.end * p.isz]
                rec = _BodyRecv(p, q, dst, f, False, source)
            else:
                rec = _BodyRecv(p, q, self.pool.take(n), f, True, source)
            if not self._post_body(rec, tag):
                return
            p.posted.add(rec)
        elif self._unknown_op(source, f, key):
            return
        elif self.floating.reserve(n):
            body = np.empty(n, dtype=np.uint8)  # exact size: the pool bound counts these bytes
            if not self._post_body(_BodyRecv(None, -1, body, f, True, source), tag):
                self.floating.release(n)
                return
            self.stats.floating_frames += 1
        else:
            # No room for an op not submitted here: the sender keeps the body until
            # this rank submits the op (READY then).
            self._control(source, REJECT, _NO_SHAPE, key, step=f[F_STEP], segment=f[F_SEGMENT])
            self._rejected.setdefault(key, set()).add(source)
            self.stats.rejected += 1
            return
        link.tag_used(self._tag_span)
        self._control(source, CTS, _NO_SHAPE, key, aux=tag, step=f[F_STEP], segment=f[F_SEGMENT])

    def _post_body(self, rec: _BodyRecv, tag: int) -> bool:
        try:
            req = self.t.irecv(rec.buf, rec.source, tag)
        except TransportError as exc:
            self._bad_peer(rec.source, exc)
            return False
        rec.req = req
        self._track(req, _RECV, (rec, time.perf_counter_ns()))
        return True

    def _preclear(self, p: Payload) -> None:
        """Clear every large body of ``p`` to be sent before it is announced.

        The receive goes up now (into the op's buffer or a scratch buffer of the op) and
        the clear travels unasked, so the sender sends the body the moment its segment is
        ready: no announcement round trip on the critical path.  A sender that has not
        submitted the op yet ignores the clear and announces later; the answer to that
        announcement names the same tag.
        """
        micro = self.cfg.micro_bytes
        plan = p.spec.plan
        for q, seg in enumerate(plan.recvs):
            n = seg.region.count * p.isz
            if n <= micro or q in p.arrived:
                continue
            source = p.spec.group[seg.peer]
            if source in self.bad_peers:
                continue
            reg = seg.region
            frame = (DATA, *p.shape[:4], 0, 0, 0, seg.step, seg.segment, 0, *p.key, n, *p.shape[4:])
            if seg.action is Action.COPY and p.recv_waits[q] == 0 and seg.src is None:
                rec = _BodyRecv(p, q, p.bytes[reg.buffer][reg.offset * p.isz : reg.end * p.isz],
                                frame, False, source)  # fmt: skip
            else:
                rec = _BodyRecv(p, q, self.pool.take(n), frame, True, source)
            link = self._links[source]
            tag = wire.BODY_TAG_BASE + link.body_tag()
            if not self._post_body(rec, tag):
                continue
            link.tag_used(self._tag_span)
            p.posted.add(rec)
            p.precleared[q] = tag
            self._control(
                source, CTS, _NO_SHAPE, p.key, aux=tag, step=seg.step, segment=seg.segment
            )

    # ------------------------------------------------------------------ matching frames to ops

    def _match(self, p: Payload, f: wire.Frame, source: int) -> int | None:
        """The receive segment frame ``f`` fills, or None after failing the op."""
        why = p.mismatch(f, self._who(source), self._who(self.rank))
        if why is not None:
            self._fail(p, OpMismatchError(why), tell_peers=True, also=source)
            return None
        peer = p.group_rank.get(source)
        plan = p.spec.plan
        q = None if peer is None else plan.recv_index.get((f[F_STEP], peer, f[F_SEGMENT]))
        if q is None or q in p.arrived:
            hints = p.spec.schedule.unexpected
            step = f[F_STEP]
            if q is None and step < len(hints):
                detail = hints[step].format(sender=source, me=self.rank)
            else:
                detail = (
                    f"rank {self.rank} got an unexpected frame from rank {source} for step "
                    f"{step} segment {f[F_SEGMENT]} (do the ranks use the same algorithm, group "
                    "and segment_bytes?)"
                )
            self._fail(
                p, OpMismatchError(f"{p.spec.describe()}: {detail}"), tell_peers=True, also=source
            )
            return None
        want = plan.recvs[q].region.count * p.isz
        if f[F_NBYTES] != want:
            self._fail(
                p,
                OpMismatchError(
                    f"{p.spec.describe()}: step {f[F_STEP]} segment {f[F_SEGMENT]}: rank "
                    f"{self.rank} expects {want} bytes, rank {source} sends {f[F_NBYTES]} (do the "
                    "ranks use the same segment_bytes?)"
                ),
                tell_peers=True,
                also=source,
            )
            return None
        p.arrived.add(q)
        p.heard.add(source)
        p.last_progress = time.monotonic()
        if self.trace is not None and len(p.arrived) == len(plan.recvs):
            self.trace.op(p.spec.name, p.spec.generation, "last_recv", p.spec.priority)
        if f[F_FLAGS] & FLAG_NEED and not p.hot:
            self._raise(p)
        return q

    def _unknown_op(self, source: int, f: wire.Frame, key: OpKey) -> bool:
        """A frame for an op not in the table: True if it was dealt with (failed/finished)."""
        if key in self.failed or self.floating.has_error(key):
            return True
        lop = None if self.lane is None else self.lane.by_key.get(key)
        if lop is not None:
            self._lane_fail(
                lop,
                OpMismatchError(
                    f"{lop.spec.describe()}: ranks disagree about the op (its dtype, count, "
                    f"reduce op or algorithm): {self._who(source)} runs it in the main loop, "
                    f"{self._who(self.rank)} in the compiled lane"
                ),
                tell_peers=True,
                also=source,
            )
            return True
        done = self.completed.get(key)
        if done is None:
            return False
        (name, gen), _, hints, cleared = done
        what = describe_op(name, gen)
        step = f[F_STEP]
        if f[0] == RTS and (step, source, f[F_SEGMENT]) in cleared:
            return True  # it crossed the clear this rank sent unasked; the body came
        if step < len(hints):
            detail = hints[step].format(sender=source, me=self.rank)
        else:
            detail = (
                f"rank {source} sends to rank {self.rank} at step {step}, but rank {self.rank} "
                "finished the op without that exchange (the ranks disagree on the op's pattern: "
                "root, topology, weights, group or algorithm)"
            )
        msg = f"{what}: {detail}"
        self._on_error(key, msg, ERROR_MISMATCH, source)
        self._error_frame(key, source, msg, ERROR_MISMATCH)
        return True

    def _drop_floating(self, ff: FloatingFrame) -> None:
        if ff.eager:
            self._owe(ff.source, 0, ff.eager)
        self.pool.give(ff.body)

    # ------------------------------------------------------------------ posted requests done

    def _poll_requests(self) -> bool:
        reqs = self._reqs
        counts: list[int] = []
        failed: list[int] = []
        try:
            idx = self.t.testsome(reqs, counts)
        except TransportError as exc:
            idx = list(getattr(exc, "done", ()))
            failed = list(getattr(exc, "failed", ()))
            peer = getattr(exc, "peer", None)
            if not failed or peer is None or peer < 0:
                raise
            self._bad_peer(peer, exc, reachable=False)
        if not idx and not failed:
            return False
        owners = self._owners
        done = [(owners[i], counts[k] if k < len(counts) else 0) for k, i in enumerate(idx)]
        for i in sorted(idx + failed, reverse=True):  # swap-remove: O(1) each
            last = len(reqs) - 1
            if i != last:
                reqs[i] = reqs[last]
                owners[i] = owners[last]
            reqs.pop()
            owners.pop()
        for (what, obj), nbytes in done:
            if what == _SEND:
                p, i, n, dest, t0 = obj
                self._bodies_inflight -= 1
                self.stats.bytes_sent += n
                if self.trace is not None:
                    self.trace.segment(
                        p.spec.name, p.spec.generation, "send", dest, n, t0, time.perf_counter_ns()
                    )
                self._sent(p, i)
            elif what == _RECV:
                rec, t0 = obj
                if rec.payload is not None:
                    rec.payload.posted.discard(rec)
                self._on_body_received(rec, t0, nbytes)
        return True

    def _on_body_received(self, rec: _BodyRecv, t0: int, got: int) -> None:
        f = rec.frame
        n = f[F_NBYTES]
        p = rec.payload
        if got != n:
            # The sender gave up (its op failed, or it left) or the receive was cancelled:
            # nothing usable came.
            if p is None:
                self.floating.release(n)
            elif p.given_up is None and p.state in (OpState.ACTIVE, OpState.PREPARING):
                # Its error (or goodbye), with the reason, is on its way: fail with that.
                # Only if none comes does the stall check fail the op with this.
                p.given_up = (
                    time.monotonic(),
                    f"{p.spec.describe()}: rank {rec.source} gave up sending step {f[F_STEP]} "
                    f"segment {f[F_SEGMENT]} to rank {self.rank} (the op failed or stopped on "
                    f"rank {rec.source})",
                )
            if rec.scratch:
                self.pool.give(rec.buf)
            return
        self.stats.bytes_received += n
        if p is None:  # a floating body: file it, or hand it to its op if submitted since
            key = (f[F_WID], f[F_GEN])
            live = self.table.get(key)
            if live is not None:
                self.floating.release(n)
                q = self._match(live, f, rec.source)
                if q is None:
                    self.pool.give(rec.buf)
                else:
                    self._on_body(live, q, rec.buf)
            elif key in self.failed or self.floating.has_error(key):
                self.floating.release(n)
                self.pool.give(rec.buf)
            else:
                self.floating.add(key, FloatingFrame(f, rec.buf, rec.source, 0))
            return
        if p.state in (OpState.FAILED, OpState.DONE):
            if rec.scratch:
                self.pool.give(rec.buf)
            return
        if rec.index in p.precleared and rec.index not in p.arrived:
            p.arrived.add(rec.index)  # cleared unasked: its arrival is the body's
            p.heard.add(rec.source)
            p.last_progress = time.monotonic()
            if self.trace is not None and len(p.arrived) == len(p.spec.plan.recvs):
                self.trace.op(p.spec.name, p.spec.generation, "last_recv", p.spec.priority)
        if self.trace is not None:
            self.trace.segment(
                p.spec.name, p.spec.generation, "recv", rec.source, n, t0, time.perf_counter_ns()
            )
        if rec.scratch:
            self._on_body(p, rec.index, rec.buf)
        else:
            p.got[rec.index] = 1
            self._applied(p, rec.index)

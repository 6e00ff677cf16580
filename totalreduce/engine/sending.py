"""The send side of the main loop: scheduling sends, outgoing messages, credit.

:class:`SendHooks` is a base of :class:`~.loop.CommLoop`.  Send segments whose
inputs are ready wait in a priority heap (priority, then someone waiting here or on
the peer, then submission order); each pass (``_schedule_sends``) sends the bodies
cleared to send first, up to ``max_inflight_sends``, then packs eager bodies and
announcements (RTS) into each peer's outgoing message; ``_flush`` sends those
messages within the peer's control credit, with the credit this rank owes it
attached.  It also holds what a sender does with the receiver's answers
(clear-to-send, refusal, READY, someone waits: NEED) and the list of posted
transport requests that each pass tests.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import TotalReduceError, TransportError
from ..protocol import CONTROL_FRAME_TYPES
from ..transport.base import Transport
from . import wire
from .link import Link
from .payload import OpKey, OpState, Payload
from .wire import DATA, F_GEN, F_SEGMENT, F_STEP, F_WID, FLAG_NEED, FRAME_SIZE, MSG_SIZE, NEED, RTS

if TYPE_CHECKING:
    from .floating import FloatingList
    from .lane import Lane

#: The shape field of a control frame about no op's shape (CTS, REJECT, HAVE, BYE...).
_NO_SHAPE = (0, 0, 0, 0, 0, 0, 0)

#: What a posted transport request is (``_track``): a body send, a body receive, or a
#: control message (or an empty body: a send given up).
_SEND, _RECV, _CTL = 0, 1, 2


class SendHooks:
    """The send side of the main loop (see the module docstring)."""

    rank: int
    t: Transport
    cfg: Any  # totalreduce.config.Config
    stats: Any  # LoopStats
    trace: Any
    lane: Lane | None
    lock: threading.Lock
    table: dict[OpKey, Payload]
    failed: OrderedDict[OpKey, str]
    floating: FloatingList
    bad_peers: dict[int, TotalReduceError]
    _left: set[int]
    _unreachable: set[int]
    _needed: OrderedDict[OpKey, bool]
    _heap: list[tuple[int, int, int, int, int, Payload]]
    _cleared: list[tuple[int, int, int, int, Payload, int, int]]
    _bodies_inflight: int
    _links: list[Link]
    _dirty: set[int]
    _ctl_window: int
    _reqs: list[Any]
    _owners: list[tuple[int, Any]]

    # provided by CommLoop and its other bases
    _remember: Callable[[Any, OpKey, Any], None]
    _fail: Callable[..., None]
    _bad_peer: Callable[..., None]
    _abandon: Callable[[int, int], None]
    _lane_control: Callable[..., None]
    _apply: Callable[..., None]
    _maybe_finish: Callable[[Payload], None]

    # ------------------------------------------------------------------ scheduling

    def _push(self, p: Payload, i: int) -> None:
        """Send segment ``i`` of ``p`` may go: into the heap."""
        p.ready.add(i)
        prio, hot, seq = p.sort_key()
        heapq.heappush(self._heap, (prio, hot, seq, i, p.version, p))

    def _raise(self, p: Payload) -> None:
        """Someone waits for ``p`` (here or on a peer): its ready segments move up."""
        if p.hot:
            return
        p.hot = True
        p.version += 1  # the entries already in the heap go stale
        for i in list(p.ready):
            self._push(p, i)
        if any(e[4] is p for e in self._cleared):
            self._cleared = [(e[0], 0, *e[2:]) if e[4] is p else e for e in self._cleared]
            heapq.heapify(self._cleared)

    def _ask(self, key: OpKey) -> None:
        """A waiter still waits: ask the ranks it expects frames from to raise the op."""
        p = self.table.get(key)
        if p is None:
            return
        recv_from, _ = p.waiting_on()
        for peer in recv_from:
            if peer != self.rank:
                self._control(peer, NEED, p.shape, key)

    def _schedule_sends(self) -> bool:
        progressed = False
        cleared = self._cleared
        limit = self.cfg.max_inflight_sends
        while cleared and self._bodies_inflight < limit:
            _, _, _, i, p, dest, tag = heapq.heappop(cleared)
            if p.state is not OpState.ACTIVE:
                continue
            if dest in self.bad_peers:
                err = self.bad_peers[dest]
                self._fail(p, type(err)(f"{p.spec.describe()}: {err}"), tell_peers=True)
                continue
            seg = p.spec.plan.sends[i]
            reg = seg.region
            body = p.bytes[reg.buffer][reg.offset * p.isz : reg.end * p.isz]
            try:
                req = self.t.isend(body, dest, tag)
            except TransportError as exc:
                self._bad_peer(dest, exc)
                continue
            self._bodies_inflight += 1
            if self.trace is not None and not p.sent_any:
                p.sent_any = True
                self.trace.op(p.spec.name, p.spec.generation, "first_send", p.spec.priority)
            self._track(req, _SEND, (p, i, body.nbytes, dest, time.perf_counter_ns()))
            progressed = True
        heap = self._heap
        micro = self.cfg.micro_bytes
        while heap:
            entry = heap[0]
            p = entry[5]
            i = entry[3]
            if entry[4] != p.version or i not in p.ready or p.state is not OpState.ACTIVE:
                heapq.heappop(heap)
                continue
            seg = p.spec.plan.sends[i]
            dest = p.spec.group[seg.peer]
            reg = seg.region
            n = reg.count * p.isz
            if p.early and i in p.early:  # cleared unasked: the body goes, no announcement
                heapq.heappop(heap)
                p.ready.discard(i)
                p.tagged.add(i)
                prio, hot, seq = p.sort_key()
                heapq.heappush(self._cleared, (prio, hot, seq, i, p, dest, p.early.pop(i)))
                progressed = True
                continue
            charge = FRAME_SIZE + n
            link = self._links[dest]
            if n <= micro and link.eager_credit >= charge:
                size = FRAME_SIZE + wire.padded(n)
                if not link.room(size):
                    link.blocked.append(heapq.heappop(heap))
                    continue
                heapq.heappop(heap)
                p.ready.discard(i)
                link.eager_credit -= charge
                body = p.bytes[reg.buffer][reg.offset * p.isz : reg.end * p.isz]
                self._frame(dest, DATA, p, seg.step, seg.segment, n, body)
                self.stats.bytes_sent += n
                if self.trace is not None:
                    t = time.perf_counter_ns()
                    self.trace.segment(p.spec.name, p.spec.generation, "send", dest, n, t, t)
                self._sent(p, i)  # the body is copied: the region is free again
            else:
                if not link.room(FRAME_SIZE):
                    link.blocked.append(heapq.heappop(heap))
                    continue
                heapq.heappop(heap)
                p.ready.discard(i)
                p.awaiting.add(i)
                self._frame(dest, RTS, p, seg.step, seg.segment, n, None)
            progressed = True
        return progressed

    # ------------------------------------------------------------------ messages and credit

    def _frame(
        self, dest: int, ftype: int, p: Payload, step: int, segment: int, n: int, body: Any
    ) -> None:
        if self.trace is not None and not p.sent_any:
            p.sent_any = True
            self.trace.op(p.spec.name, p.spec.generation, "first_send", p.spec.priority)
        carried = 0 if body is None else wire.padded(n)
        link = self._links[dest]
        ob = link.outbox(FRAME_SIZE + carried)
        self._dirty.add(dest)
        wire.pack_frame(
            ob,
            ftype,
            p.shape,
            FLAG_NEED if p.hot else 0,
            0,
            step,
            segment,
            p.key,
            n,
            p.spec.priority,
        )
        if body is not None:
            ob += body.data
            if carried > n:
                ob += bytes(carried - n)
        link.out_frames += 1
        self.stats.frames_sent += 1

    def _control(
        self,
        dest: int,
        ftype: int,
        shape: tuple[int, ...],
        key: OpKey,
        *,
        aux: int = 0,
        step: int = 0,
        segment: int = 0,
        body: bytes = b"",
    ) -> None:
        """Queue a control frame for ``dest`` (never refused: its credit comes back).  With
        a lane, ERROR to JOIN travel in the lane's messages (``_lane_control``)."""
        if self.lane is not None and ftype in CONTROL_FRAME_TYPES:
            self._lane_control(dest, ftype, shape, key, aux, step, segment, body)
            return
        n = len(body)
        link = self._links[dest]
        ob = link.outbox(FRAME_SIZE + wire.padded(n))
        self._dirty.add(dest)
        wire.pack_frame(ob, ftype, shape, 0, aux, step, segment, key, n)
        if n:
            ob += body
            ob += bytes(wire.padded(n) - n)
        link.out_frames += 1
        self.stats.frames_sent += 1

    def _owe(self, peer: int, ctl: int, eager: int) -> None:
        self._links[peer].owe(ctl, eager)
        self._dirty.add(peer)

    def _flush(self) -> None:
        """Send each peer's outgoing messages within its credit, with credit owed attached."""
        half = self._ctl_window // 2
        eager_half = max(1, self.floating.eager_share // 2)
        for dest in list(self._dirty):
            link = self._links[dest]
            link.close()
            while (ready := link.next_message()) is not None:
                self._send_message(dest, *ready)
            # Credit owed travels on its own (costing no credit) when a lot is owed, or
            # when messages of ours wait for credit (Link.owes).
            if link.owes(half, eager_half, bool(link.backlog)):
                self._send_message(dest, bytearray(MSG_SIZE), 0)
            if not link.backlog:
                self._dirty.discard(dest)

    def _send_message(self, dest: int, msg: bytearray, nframes: int) -> None:
        link = self._links[dest]
        if dest in self._unreachable or dest in self._left:
            link.queued = 0
            return
        wire.pack_message_header(msg, nframes, self.rank, *link.take_owed())
        link.charge(len(msg), nframes)
        buf = np.frombuffer(msg, dtype=np.uint8)
        try:
            req = self.t.isend(buf, dest, wire.CONTROL_TAG)
        except TransportError as exc:
            self._bad_peer(dest, exc, reachable=False)
            return
        self._track(req, _CTL, buf)
        self.stats.messages_sent += 1

    # ------------------------------------------------------------------ completions

    def _sent(self, p: Payload, i: int) -> None:
        """Send segment ``i`` of ``p`` is complete (eager: copied; body: on the wire)."""
        p.tagged.discard(i)
        if p.state is not OpState.ACTIVE:
            return
        p.sends_left -= 1
        p.sent[i] = 1
        p.last_progress = time.monotonic()
        for is_send, idx in p.spec.plan.after_send[i]:
            if is_send:  # pragma: no cover - sends never wait for sends
                continue
            p.recv_waits[idx] -= 1
            if p.recv_waits[idx] == 0 and idx in p.pending:
                self._apply(p, idx, p.pending.pop(idx))
        self._maybe_finish(p)

    def _credit(self, peer: int, ctl: int, eager: int) -> None:
        link = self._links[peer]
        for entry in link.credit(ctl, eager):
            heapq.heappush(self._heap, entry)
        if link.backlog:
            self._dirty.add(peer)

    def _track(self, req: Any, what: int, obj: Any) -> None:
        self._reqs.append(req)
        self._owners.append((what, obj))

    # ------------------------------------------------------------------ the receiver's answers

    def _on_cts(self, source: int, f: wire.Frame, buf: np.ndarray, off: int) -> None:
        key = (f[F_WID], f[F_GEN])
        p = self.table.get(key)
        i = self._send_index(p, f, source)
        if p is None or i is None:
            if p is None and key in self.failed:
                self._abandon(source, f[wire.F_AUX])  # its receive is posted: end it
            return
        if i not in p.awaiting:
            # A clear that came before the announcement: keep it for when the segment is
            # ready (once: an announcement crossing it gets the same tag back).
            if not p.sent[i] and i not in p.tagged and i not in p.early:
                p.early[i] = f[wire.F_AUX]
                if i in p.ready:
                    # It may wait for control credit to be announced; cleared, it needs
                    # none: back into the heap, where the clear is taken first.
                    self._push(p, i)
            return
        p.awaiting.discard(i)
        p.tagged.add(i)
        prio, hot, seq = p.sort_key()
        heapq.heappush(self._cleared, (prio, hot, seq, i, p, source, f[wire.F_AUX]))

    def _on_reject(self, source: int, f: wire.Frame, buf: np.ndarray, off: int) -> None:
        """The receiver has no room for an announced body: park it until READY."""
        p = self.table.get((f[F_WID], f[F_GEN]))
        i = self._send_index(p, f, source)
        if p is not None and i is not None and i in p.awaiting:
            p.awaiting.discard(i)
            p.parked.setdefault(source, []).append(i)

    def _on_ready(self, source: int, f: wire.Frame, buf: np.ndarray, off: int) -> None:
        """The receiver submitted the op: the announcements it refused go again."""
        p = self.table.get((f[F_WID], f[F_GEN]))
        if p is not None:
            for i in p.parked.pop(source, ()):
                self._push(p, i)

    def _on_need(self, source: int, f: wire.Frame, buf: np.ndarray, off: int) -> None:
        """Someone on ``source`` waits for the op: raise it here (or when submitted)."""
        key = (f[F_WID], f[F_GEN])
        p = self.table.get(key)
        if p is not None:
            self._raise(p)
        elif self.lane is not None and key in self.lane.by_key:
            self.lane.set_urgent(self.lane.by_key[key])
        else:
            self._remember(self._needed, key, True)

    def _send_index(self, p: Payload | None, f: wire.Frame, peer: int) -> int | None:
        if p is None:
            return None
        g = p.group_rank.get(peer)
        return None if g is None else p.spec.plan.send_index.get((f[F_STEP], g, f[F_SEGMENT]))

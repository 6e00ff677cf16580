"""A window's channels: its messages sent, its standing receives, and arrivals applied.

:class:`WindowChannels` is the base of :class:`~.windows.Windows` that moves a
window's messages (:mod:`.windows` says how windows work): ``_send`` writes one
(as pieces on the sender thread, in daemon mode, for a large window), ``_listen``
posts a channel's standing receive, and what completes is applied under the
window's lock, in the order sent, by the thread that completed it or the window
thread (``_on_done``, ``_run``, ``_drain``, ``_arrived``; ``_message`` gathers a
pieced message).  Everything it uses of :class:`~.windows.Windows` is declared
below as annotations; it does not import :mod:`.windows`.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

from ..dtypes import DType
from ..group import Group
from ..kernels import axpy_into, copy_into, scale_into
from .window_parts import (
    _EMPTY,
    _KINDS,
    ACCUMULATE,
    CH_DATA,
    FREE,
    GET,
    HEADER,
    PIECE_BYTES,
    REPLY,
    THIN_MESSAGE_BYTES,
    Window,
    _channel,
    _Gathering,
    _Pieces,
)

log = logging.getLogger("totalreduce.windows")


class WindowChannels:
    """The messages of a service's windows (see the module docstring)."""

    # the state, made by Windows.__init__
    svc: Any
    rank: int
    _lock: threading.Lock
    _queue: queue.SimpleQueue[Any]
    _outbox: queue.SimpleQueue[_Pieces | None]
    _sender: threading.Thread | None

    def _send(self, win: Window, dst: int, chan: int, kind: int, p: float, body: Any) -> Any:
        """Send one message (``body``: ``(data, weight)`` or None); its handle.  The data
        is copied (times the weight) now: the caller may change it at once."""
        pieced = win.pieced and chan == CH_DATA
        if pieced:
            count = 1 if body is None else -(-win.nbytes // PIECE_BYTES)
            msgs = np.zeros((count, THIN_MESSAGE_BYTES), dtype=np.uint8)
        else:
            msgs = np.zeros((1, HEADER + (win.nbytes if chan == CH_DATA else 0)), dtype=np.uint8)
        for i, msg in enumerate(msgs):
            msg[:8].view(np.int32)[:] = kind, i  # the piece's index, where pieced
            msg[8:16].view(np.float64)[0] = p
        if body is not None:
            data, weight = body
            each = (msgs.shape[1] - HEADER) // win.dtype.itemsize
            for i, msg in enumerate(msgs):
                part = data[i * each : (i + 1) * each]
                out = msg[HEADER : HEADER + part.nbytes].view(win.dtype.numpy)
                copy_into(out, part, win.dtype)
                if weight != 1.0:
                    scale_into(out, weight, win.dtype)
        grp = Group(sorted((self.rank, dst)))
        name = _channel(win.name, self.rank, dst, chan)

        def send(msg: np.ndarray) -> Any:
            return self.svc._point(msg, _EMPTY, DType.UINT8, grp, self.rank, name, 0, None)

        if not pieced:
            return send(msgs[0])
        job = _Pieces(f"{name} ({len(msgs)} pieces)", send, msgs)
        with self._lock:
            if self._sender is None:
                self._sender = threading.Thread(
                    target=self._send_pieces, name=f"totalreduce-win-send-{self.rank}", daemon=True
                )
                self._sender.start()
        self._outbox.put(job)
        return job

    def _send_pieces(self) -> None:
        """The sender thread: the pieced messages, one after another, in the order sent."""
        while True:
            job = self._outbox.get()
            if job is None:
                return
            job.run()

    def _listen(self, win: Window, src: int, chan: int, buf: np.ndarray) -> None:
        grp = Group(sorted((self.rank, src)))
        name = _channel(win.name, src, self.rank, chan)
        h = self.svc._point(
            np.empty(0, np.uint8),
            buf,
            DType.UINT8,
            grp,
            src,
            name,
            0,
            buf,
            passive=True,
        )
        h.add_done_callback(lambda h: self._on_done(win, (src, chan, h, buf)))

    def _on_done(self, win: Window, item: tuple[int, int, Any, np.ndarray]) -> None:
        """A standing receive ended (on the thread that completed it, in the engine's pass).

        Applied here and now when the window is free, so that a sender whose put has
        completed can count on it having landed (a barrier, then ``update``, sees it);
        while someone holds the window, it waits in ``pending``, which the holder's
        next ``update`` or the window thread applies, in order.
        """
        win.pending.append(item)
        if not win.held and win.lock.acquire(blocking=False):
            try:
                self._drain(win)
            finally:
                win.lock.release()
        else:
            self._queue.put(win)

    def _run(self) -> None:
        while True:
            win = self._queue.get()
            if win is None:
                return
            with win.lock:
                self._drain(win)

    @contextlib.contextmanager
    def _applied(self, win: Window) -> Iterator[None]:
        """``win``'s lock, held once what arrived for it is applied.  In daemon mode the
        client's ops whose completion words are set but that no thread has looked at yet
        end first, so that their callbacks run: a message that landed before this call (a
        put whose sender saw it complete, then a barrier) is applied before the caller
        reads the window."""
        thin = getattr(self.svc, "_thin", None)
        if thin is not None:
            for h in thin.in_flight():
                thin.check(h)
        with win.lock:
            self._drain(win)
            yield

    def _drain(self, win: Window) -> None:
        """Apply what arrived for ``win``, in order (its lock held)."""
        while win.pending:
            peer, chan, h, buf = win.pending.pop(0)
            try:
                self._arrived(win, peer, chan, h, buf)
            except Exception:  # a bug here must not stop every window
                log.exception("rank %d: window %r: a message failed", self.rank, win.name)

    def _arrived(self, win: Window, peer: int, chan: int, h: Any, buf: np.ndarray) -> None:
        err = h.exception()
        if err is not None:
            win.error = win.error or err
            win.closed[chan].add(peer)
            for g in win.gets.get(peer, []) if chan == CH_DATA else []:
                g.error = err
                g.event.set()
            win.changed.notify_all()
            return
        kind, index = (int(v) for v in buf[:8].view(np.int32))
        p = float(buf[8:16].view(np.float64)[0])
        if kind not in _KINDS[chan]:
            log.error(
                "rank %d: window %r: rank %d sent message kind %d on its %s channel; dropped",
                self.rank, win.name, peer, kind, "data" if chan == CH_DATA else "get",
            )  # fmt: skip
        elif kind == FREE:
            win.closed[chan].add(peer)
            win.changed.notify_all()
            return  # the channel ends: no receive after its FREE
        elif kind == GET:
            reply = self._send(win, peer, CH_DATA, REPLY, win.p * p, (win.mine, p))
            win.sends = [s for s in win.sends if not s.done()] + [reply]
        elif (data := self._message(win, peer, kind, index, buf)) is not None:
            slot = win.slots[peer]
            if kind == ACCUMULATE:
                axpy_into(slot, data, 1.0, win.dtype)
                win.slot_p[peer] += p
            else:
                copy_into(slot, data, win.dtype)
                win.slot_p[peer] = p
            win.versions[peer] += 1
            if kind == REPLY and win.gets[peer]:
                win.gets[peer].pop(0).event.set()
        self._listen(win, peer, chan, buf)

    def _message(
        self, win: Window, peer: int, kind: int, index: int, buf: np.ndarray
    ) -> np.ndarray | None:
        """The window's data that ``buf`` completes (a PUT, ACCUMULATE or REPLY from
        ``peer``), or None while pieces of it are still to come."""
        if not win.pieced:
            return buf[HEADER:].view(win.dtype.numpy)
        got = win.gathering.get(peer)
        if index == 0:
            body = win.bodies.get(peer)
            if body is None:
                body = win.bodies[peer] = np.empty(win.nbytes, np.uint8)
            got = win.gathering[peer] = _Gathering(kind, body)
        if got is None or index != got.next or kind != got.kind:
            log.error(
                "rank %d: window %r: rank %d sent piece %d of a kind-%d message, expected "
                "piece %s; dropped",
                self.rank, win.name, peer, index, kind, "0" if got is None else
                f"{got.next} of a kind-{got.kind} message",
            )  # fmt: skip
            win.gathering.pop(peer, None)
            return None
        at = index * PIECE_BYTES
        n = min(PIECE_BYTES, win.nbytes - at)
        got.body[at : at + n] = buf[HEADER : HEADER + n]
        got.next += 1
        if at + n < win.nbytes:
            return None
        del win.gathering[peer]
        return got.body.view(win.dtype.numpy)

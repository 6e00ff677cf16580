"""Windows: one-sided put, get and accumulate into the neighbours' memory (BlueFog's window ops).

A window is one array per rank (the one :meth:`Windows.create` registered) and, on
every rank, one *slot* per in-neighbour of the window's topology.  A rank writes
into its out-neighbours' slots for it (``put`` overwrites, ``accumulate`` adds)
or reads its in-neighbours' arrays into its own slots (``get``), and those
neighbours call nothing: the transfer is theirs to receive on their own.
``update`` then combines, here and whenever this rank likes, its own array
with what the slots hold (weights, optional reset).

How, on the engine.  For each ordered pair of neighbours a window has two
channels, each a sequence of two-rank messages (the engine's point-to-point op,
matched by generation):

- the *data* channel ``src -> dst`` (``dst`` an out-neighbour of ``src``)
  carries PUT, ACCUMULATE, the REPLY to a get, and FREE; every message is a
  16-byte header (kind, the associated ``p``) and the window's bytes;
- the *get* channel ``src -> dst`` (``dst`` an in-neighbour of ``src``) carries
  GET (the weight the reply is to be scaled by) and FREE: 16 bytes each.

Every rank keeps one standing receive posted on each channel into it (an op
marked ``passive``: it is no stall and keeps no loop busy).  When one completes,
the comm thread hands it to this service's window thread, which applies it
under the window's lock (arithmetic by :mod:`totalreduce.kernels`), answers a
GET with a REPLY, and posts the next receive.  So arrivals apply in the order
sent, one at a time, atomically with respect to ``update``: what BlueFog's
``require_mutex`` asks for holds always.  A put completes once its receive
is posted at the target (the engine's synchronous send): at most one message
per channel waits in the target's pool beyond the one being applied.

``free`` is collective among neighbours: each rank first closes its get
channels (so no GET comes after it answers the last), waits until its
out-neighbours did the same, then closes its data channels and waits for
its in-neighbours' FREE.  A peer that dies fails its channels; the window
reports that error from every later call on it and frees without it.

Daemon mode.  A standing receive's buffer lies in the client's part of the
node's arena for the window's life, so a message on a window's channel is at
most :data:`~.window_parts.THIN_MESSAGE_BYTES`.  A larger window sends each data-channel
message as pieces of that size (its header says which), in order, at most
:data:`~.window_parts.PIECES_IN_FLIGHT` of them at a time; the receiver gathers them in
memory of its own and applies the message when the last one comes, so an
arrival still applies whole, in the order sent.  Pieces are submitted by this
service's sender thread, never by the thread that applies arrivals: a
submission may wait for arena room that other sends hold, and those end only
when their targets post their next receives, which nothing may hold up.

Where.  :class:`Windows` (here) holds the windows and the calls on them; its
base :class:`~.window_channels.WindowChannels` sends, receives and applies the
messages; :mod:`.window_parts` holds a window's state, the messages' format and
the handles.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from ..dtypes import DType
from ..errors import InvalidArgumentError, OpTimeoutError, TotalReduceError
from ..kernels import axpy_into, copy_into, scale_into
from ..topology import MixingTopology
from .checks import as_array
from .weights import DEFAULT_TOPOLOGY, graph_weights, resolve_topology, weight_map
from .window_channels import WindowChannels
from .window_parts import (
    _FLOATS,
    ACCUMULATE,
    CH_ASK,
    CH_DATA,
    FREE,
    GET,
    HEADER,
    PUT,
    THIN_MESSAGE_BYTES,
    Window,
    WinHandle,
    _Get,
    _Pieces,
    _weight,
)

log = logging.getLogger("totalreduce.windows")

__all__ = ["WinHandle", "Window", "Windows"]


class Windows(WindowChannels):
    """The windows of one service (``service.windows``) and the thread that applies arrivals
    (their messages: :class:`~.window_channels.WindowChannels`)."""

    def __init__(self, service: Any) -> None:
        self.svc = service
        self.rank: int = service.rank
        self.size: int = service.size
        self.associated_p = False
        self._windows: dict[str, Window] = {}
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._outbox: queue.SimpleQueue[_Pieces | None] = queue.SimpleQueue()
        self._sender: threading.Thread | None = None

    # ------------------------------------------------------------------ lookup

    def window(self, name: Any, what: str) -> Window:
        with self._lock:
            win = self._windows.get(str(name))
            names = sorted(self._windows)
        if win is None:
            raise InvalidArgumentError(
                f"{what}: rank {self.rank} has no window {name!r} (create it with win_create; "
                f"windows here: {names})"
            )
        return win

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._windows)

    # ------------------------------------------------------------------ create

    def create(
        self,
        x: Any,
        name: str,
        zero_init: bool = False,
        topology: Any = None,
        dtype: str | None = None,
    ) -> bool:
        """Register ``x`` as this rank's array of window ``name`` (collective)."""
        if not isinstance(name, str) or not name:
            raise InvalidArgumentError(
                f"win_create: the window name must be a non-empty string, got {name!r}"
            )
        arr, dt = as_array(x, f"win_create({name!r}): x", dtype)
        if dt not in _FLOATS:
            raise InvalidArgumentError(
                f"win_create({name!r}): windows hold floating arrays (float16, bfloat16, "
                f"float32, float64), got {dt.name.lower()}"
            )
        if not arr.flags.writeable:
            raise InvalidArgumentError(f"win_create({name!r}): x is read-only (update writes it)")
        topo = self._topology(topology, name)
        with self._lock:
            if name in self._windows:
                raise InvalidArgumentError(
                    f"win_create: window {name!r} exists on rank {self.rank}"
                )
        # Every rank must agree on the size and type: one allreduce of both and their negatives.
        mine = np.array([arr.size, int(dt), -arr.size, -int(dt)], dtype=np.int64)
        seen = self.svc.allreduce(mine, name=f"win_create {name}", op="max")
        if seen[0] != -seen[2] or seen[1] != -seen[3]:
            raise InvalidArgumentError(
                f"win_create({name!r}): ranks disagree on the window: sizes from {-seen[2]} to "
                f"{seen[0]} elements, dtypes {DType(-int(seen[3])).name.lower()} to "
                f"{DType(int(seen[1])).name.lower()} (rank {self.rank} has {arr.size} "
                f"{dt.name.lower()})"
            )
        self_w, src_w, dst_w = graph_weights(topo, self.rank, 0)
        in_ranks = tuple(sorted(src_w))
        out_ranks = tuple(sorted(dst_w))
        flat = arr.reshape(-1)
        slots = {}
        for r in in_ranks:
            slot = np.zeros_like(flat)
            if not zero_init:
                copy_into(slot, flat, dt)
            slots[r] = slot
        win = Window(
            name=name,
            dtype=dt,
            shape=tuple(arr.shape),
            mine=flat,
            in_ranks=in_ranks,
            out_ranks=out_ranks,
            slots=slots,
            weights=(self_w, src_w),
            slot_p={r: 0.0 if zero_init else 1.0 for r in in_ranks},
            versions=dict.fromkeys(in_ranks, 0),
            gets={r: [] for r in in_ranks},
            pieced=getattr(self.svc, "_thin", None) is not None
            and HEADER + arr.nbytes > THIN_MESSAGE_BYTES,
        )
        with self._lock:
            self._windows[name] = win
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name=f"totalreduce-windows-{self.rank}", daemon=True
                )
                self._thread.start()
        # In daemon mode the thin path's standing receives have their buffers in the node's
        # arena: what arrives lands there without a copy.
        for r in in_ranks:
            self._listen(win, r, CH_DATA, self.svc.empty(win.message_bytes, np.uint8))
        for r in out_ranks:
            self._listen(win, r, CH_ASK, self.svc.empty(HEADER, np.uint8))
        return True

    def _topology(self, topology: Any, name: str) -> MixingTopology:
        topo = resolve_topology(topology or DEFAULT_TOPOLOGY, self.size)
        if not isinstance(topo, MixingTopology):
            raise InvalidArgumentError(
                f"win_create({name!r}): windows need a static topology (RingGraph, "
                f"ExponentialTwoGraph, ... or a name), got {topology!r}"
            )
        if topo.world_size != self.size:
            raise InvalidArgumentError(
                f"win_create({name!r}): the topology has {topo.world_size} ranks, the world "
                f"{self.size}"
            )
        return topo

    # ------------------------------------------------------------------ the calls

    def _targets(
        self, win: Window, weights: Any, allowed: tuple[int, ...], what: str, role: str
    ) -> dict[int, float]:
        if weights is None:
            return dict.fromkeys(allowed, 1.0)
        try:
            out = weight_map(weights)
        except (TypeError, ValueError):
            raise InvalidArgumentError(
                f"{what}: weights are a mapping rank -> weight or a list of ranks, got {weights!r}"
            ) from None
        for r, w in out.items():
            _weight(w, f"{what}: the weight of rank {r}")
        bad = sorted(set(out) - set(allowed))
        if bad:
            raise InvalidArgumentError(
                f"{what}: ranks {bad} are not {role} of rank {self.rank} in window "
                f"{win.name!r} ({role}: {list(allowed)})"
            )
        return out

    def _array(self, win: Window, x: Any, what: str) -> np.ndarray:
        arr, dt = as_array(x, what, "bfloat16" if win.dtype is DType.BFLOAT16 else None)
        if dt is not win.dtype or arr.size != win.mine.size:
            raise InvalidArgumentError(
                f"{what}: window {win.name!r} holds {win.mine.size} {win.dtype.name.lower()}, "
                f"got {arr.size} {dt.name.lower()}"
            )
        return arr.reshape(-1)

    def put_async(
        self, x: Any, name: str, self_weight: Any = None, dst_weights: Any = None,
        accumulate: bool = False,
    ) -> WinHandle:  # fmt: skip
        """Write (or add, with ``accumulate``) ``x`` times each weight into the out-neighbours'
        slots for this rank; then, with ``self_weight``, scale ``x`` (and ``p``) in place."""
        what = f"win_{'accumulate' if accumulate else 'put'}({name!r})"
        win = self.window(name, what)
        win.check_open(what)
        data = self._array(win, x, what)
        dsts = self._targets(win, dst_weights, win.out_ranks, what, "out-neighbours")
        sw = None if self_weight is None else _weight(self_weight, f"{what}: self_weight")
        if sw is not None and not data.flags.writeable:
            raise InvalidArgumentError(f"{what}: self_weight scales x, which is read-only")
        kind = ACCUMULATE if accumulate else PUT
        with win.lock:
            handles = [
                self._send(win, r, CH_DATA, kind, win.p * w, (data, w)) for r, w in dsts.items()
            ]
            if sw is not None:
                scale_into(data, sw, win.dtype)
                if self.associated_p:
                    win.p *= sw
        return WinHandle(what, handles, [])

    def get_async(self, name: str, src_weights: Any = None) -> WinHandle:
        """Read the in-neighbours' arrays (times each weight) into this rank's slots."""
        what = f"win_get({name!r})"
        win = self.window(name, what)
        win.check_open(what)
        srcs = self._targets(win, src_weights, win.in_ranks, what, "in-neighbours")
        handles, gets = [], []
        with win.lock:
            for r, w in srcs.items():
                g = _Get()
                win.gets[r].append(g)
                gets.append(g)
                handles.append(self._send(win, r, CH_ASK, GET, w, None))
        return WinHandle(what, handles, gets)

    def update(
        self, name: str, self_weight: Any = None, neighbor_weights: Any = None,
        reset: bool = False, clone: bool = False, topology_weights: bool = False,
    ) -> np.ndarray:  # fmt: skip
        """``self_weight * x + sum(w_r * slot_r)``, into the registered array (or a new one
        with ``clone``); ``reset`` zeroes the slots it read.  Returns it, in the window's shape.
        Without weights: the plain average of the array and every slot, or with
        ``topology_weights`` the window topology's own."""
        what = f"win_update({name!r})"
        win = self.window(name, what)
        win.check_open(what)
        if (self_weight is None) != (neighbor_weights is None):
            raise InvalidArgumentError(
                f"{what}: give both self_weight and neighbor_weights, or neither (got "
                f"self_weight={self_weight!r}, neighbor_weights={neighbor_weights!r})"
            )
        if self_weight is None and topology_weights:
            sw, nw = win.weights[0], dict(win.weights[1])
        elif self_weight is None:
            sw = 1.0 / (len(win.in_ranks) + 1)
            nw = dict.fromkeys(win.in_ranks, sw)
        else:
            sw = _weight(self_weight, f"{what}: self_weight")
            if not isinstance(neighbor_weights, Mapping):
                raise InvalidArgumentError(
                    f"{what}: neighbor_weights must map in-neighbour ranks to weights, got "
                    f"{neighbor_weights!r}"
                )
            nw = self._targets(win, neighbor_weights, win.in_ranks, what, "in-neighbours")
        with self._applied(win):
            out = win.mine if not clone else np.empty_like(win.mine)
            if clone:
                copy_into(out, win.mine, win.dtype)
            scale_into(out, sw, win.dtype)
            p = sw * win.p
            for r, w in nw.items():
                axpy_into(out, win.slots[r], w, win.dtype)
                p += w * win.slot_p[r]
            if self.associated_p and not clone:
                win.p = p
            if reset:
                zero = np.zeros_like(win.mine)
                for r in nw:
                    copy_into(win.slots[r], zero, win.dtype)
                    win.slot_p[r] = 0.0
            for r in nw:
                win.versions[r] = 0
        return out.reshape(win.shape)

    def update_then_collect(self, name: str) -> np.ndarray:
        """Push-sum's collect: add every slot into the array (weights 1) and reset them."""
        win = self.window(name, f"win_update_then_collect({name!r})")
        return self.update(name, 1.0, dict.fromkeys(win.in_ranks, 1.0), reset=True)

    def version(self, name: str) -> dict[int, int]:
        """Per in-neighbour: messages applied to its slot since this rank's last update."""
        win = self.window(name, f"get_win_version({name!r})")
        with self._applied(win):
            return dict(win.versions)

    def p(self, name: str) -> float:
        """The window's associated scalar (push-sum's weight)."""
        win = self.window(name, f"win_associated_p({name!r})")
        with self._applied(win):
            return win.p

    def set_p(self, name: str, value: float) -> None:
        win = self.window(name, f"win_set_associated_p({name!r})")
        with win.lock:
            win.p = _weight(value, "the associated p")

    def slot(self, name: str, rank: int) -> np.ndarray:
        """A copy of what in-neighbour ``rank``'s slot holds now."""
        win = self.window(name, f"win_slot({name!r})")
        if rank not in win.slots:
            raise InvalidArgumentError(
                f"win_slot({name!r}): rank {rank} is not an in-neighbour of rank {self.rank} "
                f"(in-neighbours: {list(win.in_ranks)})"
            )
        with self._applied(win):
            return win.slots[rank].copy().reshape(win.shape)

    @contextlib.contextmanager
    def mutex(self, name: str) -> Iterator[None]:
        """Hold this rank's window: no arrival applies to it until the block ends (this
        rank's own calls on it still work, and apply what arrived first)."""
        win = self.window(name, f"win_mutex({name!r})")
        with win.lock:
            win.held += 1
            try:
                yield
            finally:
                win.held -= 1
                self._drain(win)

    def hold(self, name: str, for_self: bool = False) -> contextlib.AbstractContextManager[None]:
        """``win_mutex``: this rank's window held with ``for_self``; other ranks' windows
        need no holding (arrivals apply there atomically), so nothing is held for them."""
        if for_self:
            return self.mutex(name)
        self.window(name, f"win_mutex({name!r})")  # it must exist
        return contextlib.nullcontext()

    def set_associated_p(self, on: bool) -> None:
        """Whether puts, accumulates and updates carry and combine the associated ``p``."""
        self.associated_p = bool(on)

    # ------------------------------------------------------------------ free

    def free(self, name: str | None = None, timeout: float | None = None) -> bool:
        """Free window ``name`` (every window if None) with its neighbours (see the module)."""
        names = [name] if name is not None else self.names()
        deadline = None if timeout is None else time.monotonic() + timeout
        for n in names:
            win = self.window(n, f"win_free({n!r})")
            self._free(win, deadline)
            with self._lock:
                self._windows.pop(win.name, None)
        return True

    def _free(self, win: Window, deadline: float | None) -> None:
        with win.lock:
            win.freeing = True
            asks = [self._send(win, r, CH_ASK, FREE, 0.0, None) for r in win.in_ranks]
        self._until(win, CH_ASK, win.out_ranks, deadline)
        with win.lock:  # every GET has been answered: the replies precede the FREE
            frees = [self._send(win, r, CH_DATA, FREE, 0.0, None) for r in win.out_ranks]
        self._until(win, CH_DATA, win.in_ranks, deadline)
        for h in asks + frees + win.sends:
            if not h.done() and win.error is None:
                h.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def _until(
        self, win: Window, chan: int, peers: tuple[int, ...], deadline: float | None
    ) -> None:
        with self._applied(win):
            while not set(peers) <= win.closed[chan]:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    missing = sorted(set(peers) - win.closed[chan])
                    raise OpTimeoutError(
                        f"win_free({win.name!r}): ranks {missing} have not freed the window "
                        f"on rank {self.rank}'s side (did they call win_free?)"
                    )
                win.changed.wait(0.5 if left is None else min(left, 0.5))
                self._drain(win)

    def close(self, timeout: float) -> None:
        """At shutdown: free what is left (up to ``timeout`` s), stop the window thread."""
        try:
            if self.names():
                self.free(None, timeout)
        except TotalReduceError as exc:
            log.warning("rank %d: windows not freed at shutdown: %s", self.rank, exc)
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=5)
            self._thread = None
        if self._sender is not None:
            self._outbox.put(None)
            self._sender.join(timeout=5)
            self._sender = None

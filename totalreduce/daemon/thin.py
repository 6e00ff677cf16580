"""The node's side of the thin path: its clients' hierarchical ops, run from the arena.

One thread (``totalreduce-arena``) reads every attached client's submission ring
(:mod:`~totalreduce.transport.arena`).  An op starts when all ``L`` local clients
have submitted it (the same wire id and generation):

1. **on the node**: the clients' inputs are reduced into the first client's output,
   in place in the arena, with the kernels of :mod:`totalreduce.kernels`;
2. **among the nodes**: that buffer is allreduced (broadcast from the root's node;
   a barrier) over MPI by ``engine``, an ordinary embedded service whose ranks are the
   nodes' services (the compiled lane runs it); on one node there is no such step;
3. **back**: ``avg`` divides, the result is copied into the other clients' outputs and
   every client's completion word is set (its eventfd written if it sleeps).

Ranks that disagree on an op's shape fail it on every rank with an error naming
them.  A client that dies fails the ops of its session on every node (the
engine's abort, and, on the other nodes, its rank's GONE through the relay
engine: :meth:`ThinService.peer_left`); the session's later ops fail at once.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import deque
from typing import Any

import numpy as np

from ..algorithms.codes import OpKind
from ..dtypes import DType, ReduceOp
from ..engine.wire import SESSION_ID
from ..errors import OpMismatchError, TransportError
from ..kernels import copy_into, finish_average, reduce_into
from ..transport import arena as A
from ..transport.shm import fence, new_eventfd, signal_eventfd, sleep_on

log = logging.getLogger("totalreduce.daemon")

#: The session agreement's wire id, as a descriptor's signed word holds it.
_SESSION = A.signed(SESSION_ID)
#: How long the arena thread keeps looking after its last descriptor before it sleeps.
SPIN_S = 50e-6
#: With ops among the services in flight: how long it drives their engine at a time.
DRIVE_S = 100e-6
_SHAPE = (A.D_KIND, A.D_DTYPE, A.D_COUNT, A.D_OP, A.D_ROOT, A.D_FLAGS)
_KINDS = {int(OpKind.ALLREDUCE): "allreduce", int(OpKind.BROADCAST): "broadcast",
          int(OpKind.BARRIER): "barrier"}  # fmt: skip


#: How the engine among the services starts an op's error, and names a service.
_ENGINE_PREFIX = re.compile(r"^(rank \d+: )?op -?\d+ generation \d+: ")
_ENGINE_RANK = re.compile(r"\brank (\d+)")


def _error_kind(error: BaseException) -> int:
    if isinstance(error, OpMismatchError):
        return A.E_MISMATCH
    if isinstance(error, TransportError):
        return A.E_TRANSPORT
    return A.E_FAILED


class _Op:
    """One op of the node: the descriptors of its local clients, as they come."""

    __slots__ = ("key", "descs", "seen", "incarnations", "handle", "node_buf", "over", "why",
                 "fail_kind", "since", "warned")  # fmt: skip

    def __init__(self, key: tuple[int, int], slots: int) -> None:
        self.key = key
        self.since = time.monotonic()
        self.warned = 0.0  # when its last stall warning went out
        self.descs: list[np.ndarray | None] = [None] * slots
        self.incarnations = [0] * slots
        self.seen = 0
        self.handle: Any = None
        self.node_buf: np.ndarray | None = None
        self.over = False  # answered: its clients' words are set (once, by whoever ends it)
        self.why, self.fail_kind = "", 0  # why it failed


def _shape_text(d: np.ndarray) -> str:
    kind = _KINDS.get(int(d[A.D_KIND]), f"kind {int(d[A.D_KIND])}")
    try:
        dt = DType(int(d[A.D_DTYPE])).name.lower()
    except ValueError:
        dt = f"dtype {int(d[A.D_DTYPE])}"
    text = f"{kind}, count {int(d[A.D_COUNT])} {dt}"
    if int(d[A.D_KIND]) == int(OpKind.ALLREDUCE):
        try:
            text += f" (op {ReduceOp(int(d[A.D_OP])).name.lower()})"
        except ValueError:
            text += f" (op {int(d[A.D_OP])})"
    if int(d[A.D_KIND]) == int(OpKind.BROADCAST):
        text += f" from root {int(d[A.D_ROOT])}"
    return text


class ThinService:
    """The arena thread of one node's service."""

    def __init__(
        self, arena: A.Arena, node: int, nodes: int, engine: Any, stall_warning_s: float = 60.0
    ) -> None:
        self.arena = arena
        self.stall_warning_s = stall_warning_s
        self._next_look = time.monotonic() + 1.0
        self.node, self.nodes = node, nodes
        self.slots = arena.slots
        self.size = nodes * self.slots
        self.engine = engine
        self.eventfd = new_eventfd()
        self._ctl = [arena.control(k) for k in range(self.slots)]
        self._ring = [c[A.RING_WORD : A.DONE_WORD].reshape(A.RING, A.D_WORDS) for c in self._ctl]
        self._words = [c[A.DONE_WORD : A.DONE_WORD + A.RING] for c in self._ctl]
        self._efd: list[int | None] = [None] * self.slots
        self._inc = [0] * self.slots  # the incarnation attached to each slot, 0 if none
        self._head = [0] * self.slots
        self._pending: dict[tuple[int, int], _Op] = {}
        self._running: dict[tuple[int, int], _Op] = {}
        self._events: deque[tuple[Any, ...]] = deque()
        self._gone: dict[int, str] = {}  # client ranks that left or died, and how
        self._answering = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="totalreduce-arena", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ from other threads

    def attach(self, slot: int, incarnation: int, efd: int) -> None:
        """A client took ``slot`` (its control block is zeroed here, before its welcome)."""
        self.arena.reset(slot)
        self._events.append(("attach", slot, incarnation, efd))
        self._kick()

    def detach(self, slot: int, why: str | None) -> None:
        """The client of ``slot`` left (``why`` is None) or died (``why`` says how)."""
        self._events.append(("detach", slot, why))
        self._kick()

    def peer_left(self, rank: int, how: str) -> None:
        """A client rank of any node ``"left"`` (it said goodbye) or ``"died"`` (the relay
        engine heard it)."""
        if 0 <= rank < self.size:
            died = how == "died"
            why = "died (its process ended without saying goodbye)" if died else "left"
            self._events.append(("left", rank, why, died))
            self._kick()

    def peer_joined(self, rank: int) -> None:
        """A new process has client rank ``rank`` (the relay engine heard its JOIN)."""
        if 0 <= rank < self.size:
            self._events.append(("joined", rank))
            self._kick()

    def new_session(self) -> None:
        self._events.append(("session",))
        self._kick()

    def stop(self, why: str = "the node's service stops") -> None:
        """Fail what is in flight (saying ``why``), then end the thread."""
        self._events.append(("left", -1, why, True))
        self._kick()
        deadline = time.monotonic() + 5
        while self._events and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.001)
        self._stop.set()
        signal_eventfd(self.eventfd)
        self._thread.join(timeout=5)

    def _kick(self) -> None:
        signal_eventfd(self.eventfd)

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        header = self.arena.header
        last = time.perf_counter()
        while not self._stop.is_set():
            try:
                if self._events:
                    self._event(self._events.popleft())
                    continue
                if time.monotonic() >= self._next_look:
                    self._look_for_stalls()
                if self._drain():
                    last = time.perf_counter()
                    continue
                oldest = next(iter(self._running.values()), None)
                h = None if oldest is None else oldest.handle
                if h is not None:
                    # Ops among the services: this thread drives their engine, as a thread
                    # in wait() does (compiled passes for the lane's ops; the comm thread
                    # steps aside), DRIVE_S at a time between looks at the rings.
                    h.drive(DRIVE_S)
                    continue
                if time.perf_counter() - last < SPIN_S:
                    continue
                header[A.H_SERVICE_SLEEPING] = 1
                fence()
                if not self._events and not self._drain():
                    sleep_on(self.eventfd, 0.5)
                header[A.H_SERVICE_SLEEPING] = 0
                last = time.perf_counter()
            except Exception:
                log.exception("the arena thread failed")
                time.sleep(0.01)

    def _event(self, ev: tuple[Any, ...]) -> None:
        if ev[0] == "attach":
            _, slot, inc, efd = ev
            self._inc[slot], self._efd[slot], self._head[slot] = inc, efd, 0
            self._gone.pop(self.node * self.slots + slot, None)
        elif ev[0] == "detach":
            _, slot, why = ev
            self._inc[slot] = 0
            self._efd[slot] = None
            rank = self.node * self.slots + slot
            if why is not None:
                self._left(rank, why, died=True)
            else:  # ops waiting for it here never complete: they fail, on every node
                self._left(rank, "left", died=False)
        elif ev[0] == "left":
            _, rank, why, died = ev
            self._left(rank, why, died)
        elif ev[0] == "joined":
            self._gone.pop(ev[1], None)
        elif ev[0] == "session":
            self._gone.clear()
            self._pending.clear()  # what the last job left unfinished

    def _drain(self) -> bool:
        got = False
        for slot in range(self.slots):
            if not self._inc[slot]:
                continue
            ctl = self._ctl[slot]
            tail = int(ctl[A.C_TAIL])
            head = self._head[slot]
            ring = self._ring[slot]
            while head < tail:
                d = ring[head % A.RING].copy()
                head += 1
                self._head[slot] = head
                ctl[A.C_HEAD] = head
                got = True
                self._take(slot, d)
        return got

    # ------------------------------------------------------------------ ops

    def _malformed(self, d: np.ndarray) -> str:
        """What is wrong with a descriptor as a client wrote it, or ""."""
        kind, count = int(d[A.D_KIND]), int(d[A.D_COUNT])
        if kind not in _KINDS:
            return f"kind {kind} is not an allreduce, broadcast or barrier"
        try:
            dt = DType(int(d[A.D_DTYPE]))
            ReduceOp(int(d[A.D_OP]))
        except ValueError:
            return f"dtype {int(d[A.D_DTYPE])} or reduce op {int(d[A.D_OP])} is unknown"
        if not 0 <= count <= self.arena.data_bytes // dt.itemsize:
            return f"count {count} does not fit a client's part of the arena"
        if kind == int(OpKind.BROADCAST) and not 0 <= int(d[A.D_ROOT]) < self.size:
            return f"root {int(d[A.D_ROOT])} is outside 0..{self.size - 1}"
        if int(d[A.D_GEN]) < 0 or int(d[A.D_TICKET]) <= 0:
            return f"generation {int(d[A.D_GEN])} or ticket {int(d[A.D_TICKET])} is negative"
        return ""

    def _take(self, slot: int, d: np.ndarray) -> None:
        bad = self._malformed(d)
        if bad:
            log.warning("rank %d: a malformed descriptor: %s", self.node * self.slots + slot, bad)
            self._answer(slot, self._inc[slot], d, A.E_INVALID, f"a malformed descriptor: {bad}")
            return
        key = (int(d[A.D_WIRE]), int(d[A.D_GEN]))
        op = self._pending.get(key)
        if op is None:
            op = self._pending[key] = _Op(key, self.slots)
        if op.descs[slot] is not None:
            self._answer(slot, self._inc[slot], d, A.E_INVALID, "submitted twice by this rank")
            return
        op.descs[slot] = d
        op.incarnations[slot] = self._inc[slot]
        op.seen += 1
        if op.seen == self.slots:
            del self._pending[key]
        if op.over:  # failed before this rank's part came: it fails the same way
            self._answer(slot, op.incarnations[slot], d, op.fail_kind, op.why)
            return
        other = next((x for x in op.descs if x is not None and x is not d), d)
        if any(int(other[f]) != int(d[f]) for f in _SHAPE):
            shapes = [
                f"rank {self.node * self.slots + k}: {_shape_text(x)}"
                for k, x in enumerate(op.descs)
                if x is not None
            ]
            self._fail(op, A.E_MISMATCH, "the ranks disagree: " + "; ".join(shapes))
        elif self._gone:
            rank, why = next(iter(self._gone.items()))
            self._fail(op, A.E_FAILED, f"rank {rank} {why}" if rank >= 0 else why)
        elif op.seen == self.slots:
            self._start(op)

    def _start(self, op: _Op) -> None:
        d = op.descs[0]
        assert d is not None
        kind = int(d[A.D_KIND])
        try:
            dt = DType(int(d[A.D_DTYPE]))
            count = int(d[A.D_COUNT])
            bufs = self._buffers(op, dt, count) if kind != int(OpKind.BARRIER) else []
        except (ValueError, IndexError) as exc:
            self._fail(op, A.E_INVALID, f"a malformed descriptor ({exc})")
            return
        rop = ReduceOp(int(d[A.D_OP])) if kind == int(OpKind.ALLREDUCE) else ReduceOp.SUM
        if rop is ReduceOp.AVG:
            rop = ReduceOp.SUM  # summed here and among the nodes, divided at the end
        if kind == int(OpKind.ALLREDUCE):
            ins, outs = bufs
            node_buf = outs[0]
            try:
                if ins[0] is not node_buf:
                    copy_into(node_buf, ins[0], dt)
                for k in range(1, self.slots):
                    reduce_into(node_buf, ins[k], rop, dt)
            except (TypeError, ValueError) as exc:  # only a client's garbage gets here
                self._fail(op, A.E_INVALID, f"the node could not reduce it: {exc}")
                return
        elif kind == int(OpKind.BROADCAST):
            ins, outs = bufs
            root_node, root_slot = divmod(int(d[A.D_ROOT]), self.slots)
            if root_node == self.node:
                node_buf = outs[root_slot]
                if ins[root_slot] is not node_buf:
                    copy_into(node_buf, ins[root_slot], dt)
            else:
                node_buf = outs[0]
        else:
            node_buf = None
        op.node_buf = node_buf
        if self.nodes == 1 or self.engine is None:
            self._finish(op, None)
            return
        self._running[op.key] = op
        for late in self.engine.take_late_errors():  # about ops answered already
            log.warning("an op among the services failed elsewhere after it ended here: %s", late)
        try:
            op.handle = self._among_nodes(op, kind, node_buf, rop, dt, d)
        except Exception as exc:
            self._running.pop(op.key, None)
            self._fail(op, A.E_FAILED, f"the services could not start it: {exc}")
            return
        op.handle.add_done_callback(lambda h: self._finish(op, h.exception()))

    def _among_nodes(
        self, op: _Op, kind: int, buf: np.ndarray | None, rop: ReduceOp, dt: DType, d: np.ndarray
    ) -> Any:
        eng = self.engine
        name = op.key[0]  # the client's wire id: its session is mixed in, unnamed ops' too
        prio = int(d[A.D_PRIO])
        bf = "bfloat16" if dt is DType.BFLOAT16 else None
        if kind == int(OpKind.ALLREDUCE):
            return eng.allreduce_async(buf, name=name, op=rop, out=buf, priority=prio, dtype=bf)
        if kind == int(OpKind.BROADCAST):
            root = int(d[A.D_ROOT]) // self.slots
            return eng.broadcast_async(buf, root=root, name=name, out=buf, priority=prio, dtype=bf)
        return eng.barrier_async(name=name, priority=prio)

    def _buffers(self, op: _Op, dt: DType, count: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
        npdt = dt.numpy
        nbytes = count * npdt.itemsize
        ins: list[np.ndarray] = []
        outs: list[np.ndarray] = []
        for k, d in enumerate(op.descs):
            assert d is not None
            lo = self.arena.data_start(k)
            hi = lo + self.arena.data_bytes
            at_in, at_out = int(d[A.D_IN]), int(d[A.D_OUT])
            for at in (at_in, at_out):
                if not lo <= at <= hi - nbytes:
                    raise ValueError(
                        f"rank {self.node * self.slots + k}'s buffer [{at}, {at + nbytes}) is "
                        "outside its part of the arena"
                    )
            out = self.arena.view(at_out, count, npdt)
            outs.append(out)
            ins.append(out if at_in == at_out else self.arena.view(at_in, count, npdt))
        return ins, outs

    def _finish(self, op: _Op, error: BaseException | None) -> None:
        """The op ended among the nodes (any thread): results back, words set."""
        self._running.pop(op.key, None)
        d0 = op.descs[0]
        if op.handle is not None and d0 is not None and int(d0[A.D_FLAGS]) & A.F_UNNAMED:
            # its wire id comes once, but for the session agreement's (once per job)
            session = op.key[0] == _SESSION
            self.engine.forget_name(op.handle.name, op.handle.generation if session else None)
        if error is not None:
            self._fail(op, _error_kind(error), self._among_nodes_text(error))
            return
        if not self._claim(op):
            return  # failed meanwhile (the service stops)
        try:
            self._results_back(op)
        except Exception as exc:  # never leave the clients waiting
            log.exception("the arena thread could not hand back %s", op.key)
            op.over = False
            self._fail(op, A.E_FAILED, f"the node's service could not hand the result back: {exc}")
            return
        for k, x in enumerate(op.descs):
            if x is not None:
                self._answer(k, op.incarnations[k], x, 0, "")

    def _results_back(self, op: _Op) -> None:
        d = op.descs[0]
        assert d is not None
        buf = op.node_buf
        if buf is not None:
            dt = DType(int(d[A.D_DTYPE]))
            if int(d[A.D_FLAGS]) & A.F_AVG:
                finish_average(buf, self.size, dt)
            for k, x in enumerate(op.descs):
                assert x is not None
                at = int(x[A.D_OUT])
                if self.arena.offset_of(buf) != at and self._inc[k] == op.incarnations[k]:
                    copy_into(self.arena.view(at, buf.size, buf.dtype), buf, dt)

    def _among_nodes_text(self, error: BaseException) -> str:
        """The engine's error among the services, told in the clients' terms: the op is
        named by the client, and a service's rank is its node's ranks."""
        text = _ENGINE_PREFIX.sub("", str(error), count=1)

        def node(m: re.Match[str]) -> str:
            n = int(m.group(1))
            if n >= self.nodes:
                return m.group(0)
            lo, hi = n * self.slots, n * self.slots + self.slots - 1
            return f"node {n} (rank {lo})" if lo == hi else f"node {n} (ranks {lo}..{hi})"

        return _ENGINE_RANK.sub(node, text)

    def _claim(self, op: _Op) -> bool:
        """Whether this caller ends ``op`` (its engine callback and a failure may race)."""
        with self._answering:
            if op.over:
                return False
            op.over = True
            return True

    def _fail(self, op: _Op, kind: int, why: str) -> None:
        """Fail ``op`` on this node's clients and on every node: an op the services run is
        aborted there; for one this node never started, the services' engine takes its
        next generation of the name and fails it everywhere (so every node counts it)."""
        if not self._claim(op):
            return
        op.why, op.fail_kind = why, kind
        h = op.handle
        d = next((x for x in op.descs if x is not None), None)
        if h is None and d is not None and self.nodes > 1 and self.engine is not None:
            try:
                self.engine.abort_next(op.key[0], why, kind == A.E_MISMATCH)
                if int(d[A.D_FLAGS]) & A.F_UNNAMED:
                    self.engine.forget_name(op.key[0])
            except Exception:
                log.debug("no abort for %s", op.key, exc_info=True)
        if h is not None and not h.done():
            try:
                self.engine.abort(h.name, h.generation, why, kind == A.E_MISMATCH)
            except Exception:
                log.debug("abort of %r failed", h.name, exc_info=True)
        for k, x in enumerate(op.descs):
            if x is not None:
                self._answer(k, op.incarnations[k], x, kind, why)

    def _answer(self, slot: int, inc: int, d: np.ndarray, kind: int, why: str) -> None:
        if self._inc[slot] != inc or not inc:
            return  # that client is gone: nobody reads its words
        ctl = self._ctl[slot]
        ticket = int(d[A.D_TICKET])
        with self._answering:  # the arena thread and the engine's callbacks
            if kind:
                A.write_error(ctl, ticket, kind, why)
            self._words[slot][(ticket - 1) % A.RING] = -ticket if kind else ticket
        fence()
        efd = self._efd[slot]
        if ctl[A.C_SLEEPING] and efd is not None:
            signal_eventfd(efd)

    def _look_for_stalls(self) -> None:
        """Warn about ops some of the node's clients submitted long ago and others never
        did (once per ``stall_warning_s``), naming both."""
        now = time.monotonic()
        self._next_look = now + 1.0
        for op in list(self._pending.values()):
            if op.over or now - max(op.since, op.warned) < self.stall_warning_s:
                continue
            op.warned = now
            d = next(x for x in op.descs if x is not None)
            base = self.node * self.slots
            have = [base + k for k, x in enumerate(op.descs) if x is not None]
            missing = [base + k for k, x in enumerate(op.descs) if x is None]
            log.warning(
                "%s #%016x generation %d has waited %.0f s on node %d: ranks %s submitted it, "
                "ranks %s have not", _shape_text(d), op.key[0] & ((1 << 64) - 1), op.key[1],
                now - op.since, self.node, have, missing,
            )  # fmt: skip

    def _left(self, rank: int, why: str, died: bool) -> None:
        """Client rank ``rank`` left or died (-1: the service stops).

        The ops this node has not started need it and fail, and so do later ones until
        a new process takes the rank.  Those the services run fail too if it died (or
        the service stops); if it left, it took part in every op it submitted, so they
        go on.
        """
        if rank in self._gone and not died:
            return
        self._gone[rank] = why
        why = f"rank {rank} {why}" if rank >= 0 else why
        if self._pending or (died and self._running):
            log.info("the arena's ops in flight fail: %s", why)
        if died:
            for op in list(self._running.values()):
                self._fail(op, A.E_FAILED, why)
        for op in list(self._pending.values()):  # kept: the parts still to come fail too
            self._fail(op, A.E_FAILED, why)

"""The node's side of the thin path: its clients' hierarchical ops, run from the arena.

One thread (``totalreduce-arena``) reads every attached client's submission ring
(:mod:`~totalreduce.transport.arena`), through the compiled pass of :mod:`.arena_pass`:
the world's allreduces, broadcasts and barriers of the raw kernels' types run there
(on several nodes, this module starts their step among the nodes and hands the result
back through it); everything else comes here, in order, as below.  An op (an
allreduce, broadcast, barrier, reduce-scatter or all-gather, over the world or a group)
starts when all the node's clients in its group have submitted it (the same wire id,
generation and group):

1. **on the node**: the clients' inputs are reduced into the first client's output,
   in place in the arena, with the kernels of :mod:`totalreduce.kernels` (a
   reduce-scatter's into a buffer of the service's; an all-gather's parts are joined);
2. **among the nodes**: that buffer is allreduced (broadcast from the root's node;
   a barrier; reduce-scattered or all-gathered with the nodes' parts) over MPI by
   ``engine``, an ordinary embedded service whose ranks are the nodes' services (the
   compiled lane runs it), over the nodes the group spans; an op whose group lies on
   one node has no such step;
3. **back**: ``avg`` divides, the result (or each client's part of it) is copied into
   the clients' outputs and every client's completion word is set (its eventfd written
   if it sleeps).

Ranks that disagree on an op's shape fail it on every rank with an error naming
them.  A client that dies fails the ops of its session on every node (the
engine's abort, and, on the other nodes, its rank's GONE, which its node's service
sends them through ``engine``: :meth:`ThinService.client_notice`); the session's
later ops fail at once.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections import deque
from typing import Any

import numpy as np

from ..algorithms.codes import AlgorithmCode, OpKind
from ..algorithms.rooted import offsets
from ..dtypes import DType, ReduceOp
from ..engine.wire import SESSION_ID
from ..errors import OpMismatchError, TransportError
from ..group import Group
from ..kernels import copy_into, finish_average, reduce_into
from ..transport import arena as A
from ..transport.shm import fence, new_eventfd, signal_eventfd, sleep_on
from . import arena_pass

log = logging.getLogger("totalreduce.daemon")

#: The session agreement's wire id, as a descriptor's signed word holds it.
_SESSION = A.signed(SESSION_ID)
#: How long the arena thread keeps looking after its last descriptor before it sleeps.
SPIN_S = 50e-6
#: With ops among the services in flight: how long it drives their engine at a time.
DRIVE_S = 100e-6
_SHAPE = (A.D_KIND, A.D_DTYPE, A.D_COUNT, A.D_OP, A.D_ROOT, A.D_ALGO)  # and D_FLAGS
#: The algorithms a descriptor may name among the services, by kind.
_ALGOS = {
    int(OpKind.ALLREDUCE): {AlgorithmCode.RING, AlgorithmCode.RING_CHUNKED,
                            AlgorithmCode.HALVING_DOUBLING, AlgorithmCode.RECURSIVE_DOUBLING,
                            AlgorithmCode.BCUBE},
    int(OpKind.BROADCAST): {AlgorithmCode.ONE_TO_ALL, AlgorithmCode.PIPELINED},
    int(OpKind.BARRIER): {AlgorithmCode.ALL_TO_ALL, AlgorithmCode.ALL_TO_ONE},
}  # fmt: skip
_RS, _AG, _A2A = int(OpKind.REDUCE_SCATTER), int(OpKind.ALLGATHER), int(OpKind.ALLTOALL)
_KINDS = {int(OpKind.ALLREDUCE): "allreduce", int(OpKind.BROADCAST): "broadcast",
          int(OpKind.BARRIER): "barrier", _RS: "reduce-scatter", _AG: "all-gather",
          _A2A: "all-to-all"}  # fmt: skip
#: Kinds whose descriptor has parts (D_AUX); an all-to-all's are its splits, then its receives.
_PARTED = (_RS, _AG, _A2A)
#: Mixed into a group's context to name its ops among the services (2^64 / golden ratio).
_GOLDEN = 0x9E37_79B9_7F4A_7C15
_MASK = (1 << 64) - 1
_I64 = np.dtype(np.int64)


#: How the engine among the services starts an op's error, and names a service.
_ENGINE_PREFIX = re.compile(r"^(rank \d+: )?op -?\d+ generation \d+: ")
_ENGINE_RANK = re.compile(r"\brank (\d+)")
#: Starts a reason this node gives the services' engine in its clients' terms (an abort):
#: what follows it is not told again in nodes' terms.
_CLIENT_TERMS = "\x1f"


def _error_kind(error: BaseException) -> int:
    if isinstance(error, OpMismatchError):
        return A.E_MISMATCH
    if isinstance(error, TransportError):
        return A.E_TRANSPORT
    return A.E_FAILED


class _Grp:
    """What a node knows of an op's group: its ranks, and where they live."""

    __slots__ = ("ranks", "ctx", "rankset", "local", "slots", "nodes", "where", "members",
                 "order", "identity", "engine_group")  # fmt: skip

    def __init__(self, ranks: tuple[int, ...], ctx: int, node: int, per_node: int) -> None:
        self.ranks, self.ctx = ranks, ctx
        self.rankset = frozenset(ranks)
        #: (group rank, slot) of this node's members, in group order
        self.local = [(g, r % per_node) for g, r in enumerate(ranks) if r // per_node == node]
        self.slots = frozenset(k for _, k in self.local)
        #: the nodes it spans, and this node's place among them
        self.nodes = sorted({r // per_node for r in ranks})
        self.where = self.nodes.index(node) if node in self.nodes else -1
        by_node: dict[int, list[int]] = {n: [] for n in self.nodes}
        for g, r in enumerate(ranks):
            by_node[r // per_node].append(g)
        #: each node's group ranks (node order, then group order): how the nodes' parts lie
        self.members = [by_node[n] for n in self.nodes]
        self.order = [g for m in self.members for g in m]
        self.identity = self.order == list(range(len(ranks)))
        #: the services' group (None: all of them, for the world); its context is the
        #: clients' group's, so services that disagree on it raise a mismatch
        self.engine_group: Group | None = None
        if ctx:
            self.engine_group = Group(self.nodes)
            self.engine_group.context = ctx & _MASK


class _Ended:
    """What an answered op keeps of its handle among the services: the name to forget."""

    __slots__ = ("name", "generation")

    def __init__(self, name: Any, generation: int) -> None:
        self.name, self.generation = name, generation

    def done(self) -> bool:
        return True

    def drive(self, span: float) -> bool:
        return True  # nothing to drive: the arena thread looks at its next op


class _Mismatch(Exception):
    """Ranks disagree on an op (found when its data came): it fails as a mismatch."""


class _Op:
    """One op of the node: the descriptors of its local clients, as they come."""

    __slots__ = ("key", "grp", "expect", "parts", "descs", "seen", "incarnations", "handle",
                 "node_buf", "ins", "plan", "over", "why", "fail_kind", "since",
                 "warned", "standing")  # fmt: skip

    def __init__(self, key: tuple[int, int, int], slots: int, grp: _Grp) -> None:
        self.key = key
        self.grp = grp
        self.expect = len(grp.local)
        self.since = time.monotonic()
        self.warned = 0.0  # when its last stall warning went out
        self.descs: list[np.ndarray | None] = [None] * slots
        self.parts: list[tuple[int, ...] | None] = [None] * slots
        self.incarnations = [0] * slots
        self.seen = 0
        self.handle: Any = None
        self.node_buf: np.ndarray | None = None
        self.ins: list[np.ndarray] = []  # an all-to-all's inputs (copies where in place)
        self.plan: Any = None  # an all-to-all's bytes to and from each node, its outputs
        self.over = False  # answered: its clients' words are set (once, by whoever ends it)
        self.why, self.fail_kind = "", 0  # why it failed
        self.standing = False  # running, and passive: the arena thread does not drive it

    def release(self) -> None:
        """It is answered: drop its buffers (it stays a while among the collected ops, for
        what a late descriptor of its name meets; the engine keeps what it still uses)."""
        self.node_buf, self.ins, self.plan = None, [], None
        h = self.handle
        if h is not None:  # the engine's handle holds its buffers: keep its name only
            self.handle = _Ended(h.name, h.generation)

    @property
    def passive(self) -> bool:
        """Only windows' standing receives of this node are in it so far: it may wait for
        ever (no stall warning; the arena thread does not drive it)."""
        return all(x is None or int(x[A.D_FLAGS]) & A.F_PASSIVE for x in self.descs)

    def first(self) -> np.ndarray:
        """The descriptor of its first local member (its shape, once all agree)."""
        d = self.descs[self.grp.local[0][1]]
        assert d is not None
        return d


def _shape_text(d: np.ndarray, parts: tuple[int, ...] | None = None) -> str:
    kind = _KINDS.get(int(d[A.D_KIND]), f"kind {int(d[A.D_KIND])}")
    try:
        dt = DType(int(d[A.D_DTYPE])).name.lower()
    except ValueError:
        dt = f"dtype {int(d[A.D_DTYPE])}"
    text = f"{kind}, count {int(d[A.D_COUNT])} {dt}"
    if int(d[A.D_KIND]) in (int(OpKind.ALLREDUCE), _RS):
        try:
            text += f" (op {ReduceOp(int(d[A.D_OP])).name.lower()})"
        except ValueError:
            text += f" (op {int(d[A.D_OP])})"
    if int(d[A.D_KIND]) == int(OpKind.BROADCAST):
        text += f" from root {int(d[A.D_ROOT])}"
    if parts is not None:
        text += f", parts {list(parts)}"
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
        self._words = [c[A.DONE_WORD : A.DONE_WORD + A.RING] for c in self._ctl]
        self._efd: list[int | None] = [None] * self.slots
        self._inc = [0] * self.slots  # the incarnation attached to each slot, 0 if none
        #: the compiled pass (arena_pass.py): the world's common ops, no Python on one
        #: node; on several, Python only starts them among the nodes and hears them end
        self._fast = fast = arena_pass.Table(self.slots, nodes, node, arena.data_bytes)
        fast.lo[:] = [arena.data_start(k) for k in range(self.slots)]
        fast.cw[:] = [arena.slot_start(k) // 8 for k in range(self.slots)]
        fast.st[arena_pass.S_ON] = 1
        self._head = fast.heads  # descriptors taken from each slot's ring
        self._mem = arena.bytes.view(np.int64)
        #: the pass's ops running among the nodes: token -> [entry, engine handle, the
        #: _Op that Python made of it once it took the op over (an event came), or None]
        self._fast_running: dict[int, list[Any]] = {}
        self._fast_tokens = 0
        #: (token, handle) of those that ended on another thread, for this one to finish
        self._fast_ended: deque[tuple[int, Any]] = deque()
        arena_pass.prepare()
        self._world = _Grp(tuple(range(self.size)), 0, node, self.slots)
        self._groups: dict[tuple[int, int, int], _Grp] = {}  # (slot, offset, context) -> group
        #: ops still collecting their local members' descriptors, by (wire id, generation):
        #: one per group of that name (two only when ranks disagree on it, or groups differ)
        self._pending: dict[tuple[int, int], list[_Op]] = {}
        self._running: dict[tuple[int, int, int], _Op] = {}
        #: ops whose local descriptors all came, lately, by (wire id, generation): a rank's
        #: descriptor of the name with another group meets them (it waits for ranks that
        #: will not submit it again)
        self._collected: dict[tuple[int, int], _Op] = {}
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

    def busy(self) -> bool:
        """Whether ops run here (every local client submitted them; windows' standing
        receives aside): a stopping service gives them time to end."""
        return bool(self._fast_running) or any(not o.standing for o in list(self._running.values()))

    def client_notice(self, kind: str, rank: int) -> None:
        """Another node's service says its client rank ``rank`` ``"died"`` or that a new
        process has it (``"joined"``): the engine among the services carries it."""
        if kind == "died":
            self.peer_left(rank, "died")
        else:
            self.peer_joined(rank)

    def peer_left(self, rank: int, how: str) -> None:
        """A client rank of any node ``"left"`` (it said goodbye) or ``"died"``."""
        if 0 <= rank < self.size:
            died = how == "died"
            why = "died (its process ended without saying goodbye)" if died else "left"
            self._events.append(("left", rank, why, died))
            self._kick()

    def peer_joined(self, rank: int) -> None:
        """A new process has client rank ``rank`` (its node's service said so)."""
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
                while self._fast_ended:
                    self._fast_end(*self._fast_ended.popleft())
                if self._events:
                    self._eject(None)  # Python's tables have every op when it handles one
                    self._event(self._events.popleft())
                    self._fast.st[arena_pass.S_ON] = 0 if self._gone else 1
                    continue
                if time.monotonic() >= self._next_look:
                    self._look_for_stalls()
                if self._drain():
                    last = time.perf_counter()
                    continue
                oldest = next((o for o in self._running.values() if not o.standing), None)
                h = None if oldest is None else oldest.handle
                if h is None and self._fast_running:
                    h = next(iter(self._fast_running.values()))[1]
                if h is not None:
                    # Ops among the services: this thread drives their engine, as a thread
                    # in wait() does (compiled passes for the lane's ops; the comm thread
                    # steps aside), DRIVE_S at a time between looks at the rings.
                    h.drive(DRIVE_S)
                    continue
                if time.perf_counter() - last < SPIN_S:
                    os.sched_yield()
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
            self._close_efd(slot)
            self._inc[slot], self._efd[slot], self._head[slot] = inc, efd, 0
            self._fast.incs[slot] = inc
            self._gone.pop(self.node * self.slots + slot, None)
        elif ev[0] == "detach":
            _, slot, why = ev
            self._inc[slot] = self._fast.incs[slot] = 0
            self._close_efd(slot)
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
            self._collected.clear()

    def _close_efd(self, slot: int) -> None:
        with self._answering:
            efd, self._efd[slot] = self._efd[slot], None
        if efd is not None:
            os.close(efd)

    def _drain(self) -> bool:
        """Take what the clients submitted: the compiled pass takes and runs the common
        ops; what it hands over (arena_pass.py says what) Python takes in order."""
        fast = self._fast
        if not arena_pass.arena_pass(fast.tab, self._mem, self.arena.base):
            return False
        st = fast.st
        self._wake_sleepers()
        self._take_queued()
        for i in range(int(st[arena_pass.S_NSTART])):
            self._fast_start(int(fast.starts[i]))
        return True

    def _wake_sleepers(self) -> None:
        fast = self._fast
        for i in range(int(fast.st[arena_pass.S_NSIG])):
            efd = self._efd[int(fast.sig[i])]
            if efd is not None:
                signal_eventfd(efd)

    def _take_queued(self) -> None:
        fast = self._fast
        for i in range(int(fast.st[arena_pass.S_NOUT])):
            self._take(int(fast.outslot[i]), fast.outq[i].copy())

    def _eject(self, older_s: float | None) -> None:
        """Hand Python the compiled pass's ops waiting in its table (those waiting
        ``older_s`` seconds, or all); with ``None``, those running among the nodes too."""
        fast = self._fast
        if older_s is None:
            for item in self._fast_running.values():
                if item[2] is None:
                    item[2] = self._take_over(item[0], item[1])
        if not fast.st[arena_pass.S_LIVE]:
            return
        now = arena_pass.clock_ns()
        before = now if older_s is None else now - int(older_s * 1e9)
        while True:
            left = arena_pass.arena_eject(fast.tab, before)
            self._take_queued()
            if not left:
                return

    # ------------------------------------------------------------------ the pass's ops
    # among the nodes

    def _entry_op(self, e: int) -> _Op:
        """Python's _Op of the pass's entry ``e`` (complete here: its local part done)."""
        fast = self._fast
        op = _Op((int(fast.keys[e, 0]), int(fast.keys[e, 1]), 0), self.slots, self._world)
        for i in range(int(fast.seen[e])):
            k = int(fast.order[e, i])
            op.descs[k] = fast.descs[e, k].copy()
            op.incarnations[k] = self._inc[k]
            op.seen += 1
        return op

    def _fast_start(self, e: int) -> None:
        """Entry ``e`` of the pass is complete here, its node's part in its node buffer:
        start it among the nodes (:meth:`_engine_op`, over the world)."""
        fast = self._fast
        d = fast.descs[e, 0]
        kind, wire = int(d[A.D_KIND]), int(fast.keys[e, 0])
        for late in self.engine.take_late_errors():  # about ops answered already
            log.warning("an op among the services failed elsewhere after it ended here: %s", late)
        try:
            dt = DType(int(d[A.D_DTYPE]))
            buf = None
            if kind != int(OpKind.BARRIER):
                at = int(arena_pass.node_buffer(fast.st, fast.descs, e))
                buf = self.arena.view(at, int(d[A.D_COUNT]), dt.numpy)
            rop = ReduceOp(int(d[A.D_OP]))
            if rop is ReduceOp.AVG:
                rop = ReduceOp.SUM  # divided at the end
            h = self._engine_op((wire, int(fast.keys[e, 1]), 0), self._world, kind, buf, rop, dt, d)
        except Exception as exc:
            op = self._entry_op(e)
            arena_pass.arena_release(fast.tab, e)
            self._fail(op, A.E_FAILED, f"the services could not start it: {exc}")
            return
        self._fast_tokens += 1
        token = self._fast_tokens
        self._fast_running[token] = [e, h, None]
        me = self._thread.ident

        def ended(h: Any) -> None:
            if threading.get_ident() == me:
                self._fast_end(token, h)
            else:  # the engine's comm thread: the arena thread finishes it
                self._fast_ended.append((token, h))
                self._kick()

        h.add_done_callback(ended)

    def _fast_end(self, token: int, h: Any) -> None:
        """The pass's op ``token`` ended among the nodes (on this thread)."""
        item = self._fast_running.pop(token, None)
        if item is None:
            return
        e, _, op = item
        if op is not None:  # Python took it over: it ends the Python way
            self._finish(op, h.exception(), h)
            return
        fast = self._fast
        self._forget_unnamed(int(fast.keys[e, 0]), fast.descs[e, 0], h)
        error = h.exception()
        if error is not None:
            op = self._entry_op(e)
            arena_pass.arena_release(fast.tab, e)
            op.handle = _Ended(h.name, h.generation)
            self._fail(op, _error_kind(error), self._among_nodes_text(error))
            return
        arena_pass.arena_finish(fast.tab, self._mem, self.arena.base, e)
        self._wake_sleepers()

    def _take_over(self, e: int, h: Any) -> _Op:
        """Python's tables take the pass's running entry ``e`` (an event is coming that
        may fail it): an _Op in ``_running`` with the engine's handle, as _start makes."""
        op = self._entry_op(e)
        fast = self._fast
        at = int(arena_pass.node_buffer(fast.st, fast.descs, e))
        d = fast.descs[e, 0]
        if at >= 0:
            op.node_buf = self.arena.view(at, int(d[A.D_COUNT]), DType(int(d[A.D_DTYPE])).numpy)
        op.handle = h
        self._running[op.key] = op
        arena_pass.arena_release(fast.tab, e)
        return op

    # ------------------------------------------------------------------ ops

    def _malformed(self, d: np.ndarray) -> str:
        """What is wrong with a descriptor as a client wrote it, or ""."""
        kind, count = int(d[A.D_KIND]), int(d[A.D_COUNT])
        if kind not in _KINDS:
            return f"kind {kind} is not an op of the thin path"
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
        algo = int(d[A.D_ALGO])
        if algo and algo not in _ALGOS.get(kind, ()):
            return f"algorithm {algo} is not one for {_KINDS[kind]}"
        return ""

    def _words_at(self, slot: int, at: int, what: str) -> tuple[tuple[int, ...], str]:
        """The int64 words [n, v...] a client placed at ``at`` (its group, its parts)."""
        lo = self.arena.data_start(slot)
        hi = lo + self.arena.data_bytes
        if not (lo <= at <= hi - 8 and at % 8 == 0):
            return (), f"its {what} at {at} is outside its part of the arena"
        n = int(self.arena.view(at, 1, _I64)[0])
        if not 1 <= n <= 2 * self.size or at + 8 * (n + 1) > hi:  # an all-to-all's: 2 per rank
            return (), f"its {what} has {n} entries (a world of {self.size})"
        return tuple(int(v) for v in self.arena.view(at + 8, n, _I64)), ""

    def _group_of(self, slot: int, d: np.ndarray) -> tuple[_Grp | None, str]:
        """The op's group (the world for context 0), or what is wrong with it."""
        ctx = int(d[A.D_CTX])
        if ctx == 0:
            return self._world, ""
        key = (slot, int(d[A.D_GROUP]), ctx)
        grp = self._groups.get(key)
        if grp is not None:
            return grp, ""
        ranks, bad = self._words_at(slot, int(d[A.D_GROUP]), "group")
        if bad:
            return None, bad
        if any(not 0 <= r < self.size for r in ranks) or len(set(ranks)) != len(ranks):
            return None, f"its group {list(ranks)} is not distinct ranks of 0..{self.size - 1}"
        if Group(ranks).context != ctx & _MASK:
            return None, f"its group's context does not match its ranks {list(ranks)}"
        me = self.node * self.slots + slot
        if me not in ranks:
            return None, f"rank {me} is not a member of its group {list(ranks)}"
        if len(self._groups) >= 4096:
            self._groups.clear()
        grp = self._groups[key] = _Grp(ranks, ctx, self.node, self.slots)
        return grp, ""

    def _parts_of(self, slot: int, d: np.ndarray, grp: _Grp) -> tuple[tuple[int, ...], str]:
        """A reduce-scatter's or all-gather's parts (elements per group rank), checked."""
        parts, bad = self._words_at(slot, int(d[A.D_AUX]), "parts")
        if bad:
            return (), bad
        count = int(d[A.D_COUNT])
        g = len(grp.ranks)
        if int(d[A.D_KIND]) == _A2A:
            me = grp.ranks.index(self.node * self.slots + slot)
            if len(parts) != 2 * g or any(c < 0 for c in parts):
                return (), f"its splits {list(parts)} are not {2 * g} counts >= 0"
            if sum(parts[:g]) != count or parts[me] != parts[g + me]:
                return (), f"its splits {list(parts[:g])} do not sum to its count {count}"
            if sum(parts[g:]) > self.arena.data_bytes // DType(int(d[A.D_DTYPE])).itemsize:
                return (), f"its receives {list(parts[g:])} do not fit a client's part of the arena"
            return parts, ""
        if len(parts) != g or any(c < 0 for c in parts):
            return (), f"its parts {list(parts)} are not {g} counts >= 0"
        if int(d[A.D_KIND]) == _RS and sum(parts) != count:
            return (), f"its parts {list(parts)} do not sum to its count {count}"
        if int(d[A.D_KIND]) == _AG:
            me = grp.ranks.index(self.node * self.slots + slot)
            if parts[me] != count:
                return (), f"its parts give it {parts[me]} elements, its count is {count}"
            if sum(parts) > self.arena.data_bytes // DType(int(d[A.D_DTYPE])).itemsize:
                return (), f"its parts {list(parts)} do not fit a client's part of the arena"
        return parts, ""

    def _take(self, slot: int, d: np.ndarray) -> None:
        rank = self.node * self.slots + slot
        bad = self._malformed(d)
        grp: _Grp | None = None
        parts: tuple[int, ...] | None = None
        if not bad:
            grp, bad = self._group_of(slot, d)
        if grp is not None and not bad:
            kind = int(d[A.D_KIND])
            if kind == int(OpKind.BROADCAST) and int(d[A.D_ROOT]) >= len(grp.ranks):
                bad = f"root {int(d[A.D_ROOT])} is outside its group of {len(grp.ranks)}"
            elif kind in _PARTED:
                parts, bad = self._parts_of(slot, d, grp)
        if bad or grp is None:
            log.warning("rank %d: a malformed descriptor: %s", rank, bad)
            self._answer(slot, self._inc[slot], d, A.E_INVALID, f"a malformed descriptor: {bad}")
            return
        wire, gen, ctx = int(d[A.D_WIRE]), int(d[A.D_GEN]), int(d[A.D_CTX])
        ops = self._pending.setdefault((wire, gen), [])
        op = next((o for o in ops if o.key[2] == ctx), None)
        if op is None:
            op = _Op((wire, gen, ctx), self.slots, grp)
            ops.append(op)
        if op.descs[slot] is not None:
            self._answer(slot, self._inc[slot], d, A.E_INVALID, "submitted twice by this rank")
            return
        op.descs[slot] = d
        op.parts[slot] = parts
        op.incarnations[slot] = self._inc[slot]
        op.seen += 1
        # Ranks of this node that disagree on the group: each expected the other's op.
        clash = [
            o for o in ops
            if o is not op and (slot in o.grp.slots or any(o.descs[k] is not None
                                                           for k in op.grp.slots))
        ]  # fmt: skip
        if op.seen == op.expect:
            ops.remove(op)
            if not ops:
                del self._pending[wire, gen]
            collected = self._collected
            collected[wire, gen] = op
            if len(collected) > 4 * A.RING:
                del collected[next(iter(collected))]
        done = self._collected.get((wire, gen))
        if done is not None and done is not op and done.key[2] != ctx:
            if any(done.descs[k] is not None for k in op.grp.slots):
                clash.append(done)
        if op.over:  # failed before this rank's part came: it fails the same way
            self._answer(slot, op.incarnations[slot], d, op.fail_kind, op.why)
            return
        if clash:
            texts = sorted(
                (self.node * self.slots + k, f"group {list(o.grp.ranks)}")
                for o in [op, *clash]
                for k, x in enumerate(o.descs)
                if x is not None
            )
            why = "the ranks disagree on the group: " + "; ".join(
                f"rank {r}: {t}" for r, t in texts
            )
            for o in [op, *clash]:
                if o.over and not o.fail_kind:  # it completed: its ranks hear it late
                    self._late(o, A.E_MISMATCH, why)
                else:
                    self._fail(o, A.E_MISMATCH, why)
            return
        other = next((x for x in op.descs if x is not None and x is not d), d)
        k_other = next(k for k, x in enumerate(op.descs) if x is other)
        kind = int(d[A.D_KIND])
        fields = _SHAPE if kind not in (_AG, _A2A) else tuple(f for f in _SHAPE if f != A.D_COUNT)
        same_parts = kind == _A2A or op.parts[k_other] == parts  # an all-to-all's differ
        # (a message's sender and its standing receiver differ in F_PASSIVE only)
        flags = (int(other[A.D_FLAGS]) ^ int(d[A.D_FLAGS])) & ~A.F_PASSIVE
        if flags or any(int(other[f]) != int(d[f]) for f in fields) or not same_parts:
            shapes = [
                f"rank {self.node * self.slots + k}: {_shape_text(x, op.parts[k])}"
                for k, x in enumerate(op.descs)
                if x is not None
            ]
            self._fail(op, A.E_MISMATCH, "the ranks disagree: " + "; ".join(shapes))
            return
        gone = next((r for r in self._gone if r < 0 or r in grp.rankset), None)
        if gone is not None:
            why = self._gone[gone]
            self._fail(op, A.E_FAILED, f"rank {gone} {why}" if gone >= 0 else why)
        elif op.seen == op.expect:
            self._start(op)

    def _start(self, op: _Op) -> None:
        d = op.first()
        g = op.grp
        kind = int(d[A.D_KIND])
        parts = op.parts[g.local[0][1]]
        try:
            dt = DType(int(d[A.D_DTYPE]))
            count = int(d[A.D_COUNT])
            bufs = self._buffers(op, dt, count) if kind != int(OpKind.BARRIER) else ([], [])
        except (ValueError, IndexError) as exc:
            self._fail(op, A.E_INVALID, f"a malformed descriptor ({exc})")
            return
        rop = ReduceOp(int(d[A.D_OP])) if kind in (int(OpKind.ALLREDUCE), _RS) else ReduceOp.SUM
        if rop is ReduceOp.AVG:
            rop = ReduceOp.SUM  # summed here and among the nodes, divided at the end
        ins, outs = bufs
        node_buf: np.ndarray | None = None
        try:
            if kind == int(OpKind.ALLREDUCE):
                node_buf = outs[0]
                self._reduce(node_buf, ins, rop, dt)
            elif kind == _RS:
                node_buf = np.empty(count, dtype=dt.numpy)
                self._reduce(node_buf, ins, rop, dt)
                assert parts is not None
                if not g.identity:  # each node's parts together, in node order
                    at = offsets(parts)
                    node_buf = np.concatenate([node_buf[at[i] : at[i] + parts[i]] for i in g.order])
            elif kind == _AG:
                node_buf = ins[0] if len(ins) == 1 else np.concatenate(ins)
            elif kind == _A2A:
                node_buf = self._alltoall_out(op, ins, outs)
            elif kind == int(OpKind.BROADCAST):
                root = g.ranks[int(d[A.D_ROOT])]
                if root // self.slots == self.node:
                    at_root = next(i for i, (_, k) in enumerate(g.local) if k == root % self.slots)
                    node_buf = outs[at_root]
                    if ins[at_root] is not node_buf:
                        copy_into(node_buf, ins[at_root], dt)
                else:
                    node_buf = outs[0]
        except (TypeError, ValueError) as exc:  # only a client's garbage gets here
            self._fail(op, A.E_INVALID, f"the node could not reduce it: {exc}")
            return
        except _Mismatch as exc:
            self._fail(op, A.E_MISMATCH, str(exc))
            return
        op.node_buf = node_buf
        if len(g.nodes) == 1 or self.engine is None:
            self._finish(op, None)
            return
        op.standing = op.passive  # all its local members are in: it stays so
        self._running[op.key] = op
        for late in self.engine.take_late_errors():  # about ops answered already
            log.warning("an op among the services failed elsewhere after it ended here: %s", late)
        try:
            handle = op.handle = self._among_nodes(op, kind, node_buf, rop, dt, d, parts)
        except Exception as exc:
            self._running.pop(op.key, None)
            self._fail(op, A.E_FAILED, f"the services could not start it: {exc}")
            return
        handle.add_done_callback(lambda h: self._finish(op, h.exception(), h))

    def _alltoall_out(
        self, op: _Op, ins: list[np.ndarray], outs: list[np.ndarray]
    ) -> np.ndarray | None:
        """An all-to-all's bytes for the other nodes: to each, per pair (sender here,
        receiver there) the counts both sides were given, then the blocks.  Pairs on this
        node are checked here (and copied at the end)."""
        g = op.grp
        G = len(g.ranks)
        here = g.members[g.where]
        at, parts = self._by_group_rank(op)
        for s in here:
            for r in here:
                if parts[s][r] != parts[r][G + s]:
                    raise _Mismatch(self._pair_text(g, s, r, parts[s][r], parts[r][G + s]))
        # inputs that an output overlaps (in place) are read from copies
        op.ins = [x.copy() if any(np.shares_memory(x, o) for o in outs) else x for x in ins]
        item = ins[0].itemsize if ins else 1
        off = {s: offsets(parts[s][:G]) for s in here}
        send, recv, chunks = [], [], []
        for y, there in enumerate(g.members):
            if y == g.where:
                send.append(0)
                recv.append(0)
                continue
            pairs = [(s, r) for s in here for r in there]
            words = [parts[s][r] for s, r in pairs] + [parts[s][G + r] for s, r in pairs]
            words.append(int(op.first()[A.D_DTYPE]))  # bytes travel: the element type too
            chunks.append(np.array(words, dtype=np.int64).view(np.uint8))
            for s, r in pairs:
                c = parts[s][r]
                chunks.append(op.ins[at[s]][off[s][r] : off[s][r] + c].view(np.uint8))
            send.append(sum(c.nbytes for c in chunks[len(chunks) - 1 - len(pairs) :]))
            recv.append(
                8 * (2 * len(pairs) + 1) + item * sum(parts[r][G + s] for s in there for r in here)
            )
        op.plan = (send, recv, outs)
        return np.concatenate(chunks) if chunks else None

    @staticmethod
    def _by_group_rank(op: _Op) -> tuple[dict[int, int], dict[int, tuple[int, ...]]]:
        """Of the node's members of an all-to-all, by group rank: where each is in the
        inputs and outputs (group order), and its counts (splits, then receives)."""
        at = {gi: i for i, (gi, _) in enumerate(op.grp.local)}
        return at, {gi: op.parts[k] or () for gi, k in op.grp.local}

    def _pair_text(self, g: _Grp, s: int, r: int, sends: int, expects: int) -> str:
        return (
            f"the ranks disagree: rank {g.ranks[s]} sends rank {g.ranks[r]} {sends} elements "
            f"(its splits), rank {g.ranks[r]} expects {expects} (its recv_splits)"
        )

    def _alltoall_back(self, op: _Op, got: np.ndarray | None, dt: DType) -> None:
        """Every pair's block into its receiver's output, the other nodes' counts checked
        against this node's first."""
        g = op.grp
        G = len(g.ranks)
        here = g.members[g.where]
        at, parts = self._by_group_rank(op)
        _, _, outs = op.plan
        soff = {s: offsets(parts[s][:G]) for s in here}
        roff = {r: offsets(parts[r][G:]) for r in here}
        item = outs[0].itemsize if outs else 1
        blocks: list[tuple[int, int, np.ndarray]] = []  # (receiver, sender, block)
        pos = 0
        for y, there in enumerate(g.members):
            if y == g.where or got is None:
                continue
            pairs = [(s, r) for s in there for r in here]  # as the sender there laid them
            nw = 2 * len(pairs) + 1
            words = np.frombuffer(got[pos : pos + 8 * nw].tobytes(), dtype=np.int64)
            pos += 8 * nw
            if int(words[-1]) != int(dt):
                ranks = [g.ranks[q] for q in there]
                try:
                    theirs = DType(int(words[-1])).name.lower()
                except ValueError:
                    theirs = f"dtype {int(words[-1])}"
                raise _Mismatch(
                    f"the ranks disagree: ranks {ranks} send {theirs}, ranks "
                    f"{[g.ranks[q] for q in here]} {dt.name.lower()}"
                )
            for i, (s, r) in enumerate(pairs):
                sends, expects = int(words[i]), parts[r][G + s]
                if sends != expects:
                    raise _Mismatch(self._pair_text(g, s, r, sends, expects))
                if int(words[len(pairs) + i]) != parts[r][s]:
                    raise _Mismatch(
                        self._pair_text(g, r, s, parts[r][s], int(words[len(pairs) + i]))
                    )
            for s, r in pairs:
                c = parts[r][G + s]
                blocks.append((r, s, got[pos : pos + c * item].view(outs[0].dtype)))
                pos += c * item
        for s in here:
            for r in here:
                c = parts[s][r]
                if c:
                    src = op.ins[at[s]][soff[s][r] : soff[s][r] + c]
                    copy_into(outs[at[r]][roff[r][s] : roff[r][s] + c], src, dt)
        for r, s, block in blocks:
            if block.size:
                copy_into(outs[at[r]][roff[r][s] : roff[r][s] + block.size], block, dt)

    def _reduce(self, dst: np.ndarray, ins: list[np.ndarray], rop: ReduceOp, dt: DType) -> None:
        """``dst`` = the local members' inputs reduced (in group order)."""
        if ins[0] is not dst:
            copy_into(dst, ins[0], dt)
        for x in ins[1:]:
            reduce_into(dst, x, rop, dt)

    def _engine_name(self, key: tuple[int, int, int]) -> int:
        """The name among the services of the op of ``key`` (wire id, generation, context):
        the client's wire id (its session is mixed in, unnamed ops' too), and the group's
        context for a group's (groups may share names)."""
        wire, _, ctx = key
        if not ctx:
            return wire
        return A.signed((wire ^ (ctx * _GOLDEN)) & _MASK)

    def _among_nodes(
        self, op: _Op, kind: int, buf: np.ndarray | None, rop: ReduceOp, dt: DType,
        d: np.ndarray, parts: tuple[int, ...] | None,
    ) -> Any:  # fmt: skip
        if kind not in (_A2A, _RS, _AG):
            return self._engine_op(op.key, op.grp, kind, buf, rop, dt, d)
        eng = self.engine
        g = op.grp
        name = self._engine_name(op.key)
        prio = int(d[A.D_PRIO])
        bf = "bfloat16" if dt is DType.BFLOAT16 else None
        grp = g.engine_group
        if kind == _A2A:
            send, recv, _ = op.plan
            if op.passive:  # a window's standing receive: it may wait for ever there too
                x = np.empty(0, np.uint8) if buf is None else buf
                o = np.empty(sum(recv), np.uint8)
                return eng._alltoall(
                    x, DType.UINT8, o, False, name, prio, eng._group(grp)[0], send, recv, o,
                    False, passive=True,
                )  # fmt: skip
            return eng.alltoall_async(
                buf, name=name, splits=send, recv_splits=recv, group=grp, priority=prio
            )
        assert parts is not None
        per_node = [sum(parts[i] for i in m) for m in g.members]
        if kind == _RS:
            return eng.reduce_scatter_async(
                buf, name=name, op=rop, group=grp, counts=per_node, priority=prio, dtype=bf
            )
        return eng.allgather_async(
            buf, name=name, group=grp, counts=per_node, priority=prio, dtype=bf
        )

    def _engine_op(
        self, key: tuple[int, int, int], g: _Grp, kind: int, buf: np.ndarray | None,
        rop: ReduceOp, dt: DType, d: np.ndarray,
    ) -> Any:  # fmt: skip
        """Start an allreduce, broadcast or barrier among the services: the op of ``key``,
        over the nodes of group ``g``, its node's part in ``buf`` (None for a barrier)."""
        eng = self.engine
        name = self._engine_name(key)
        prio = int(d[A.D_PRIO])
        bf = "bfloat16" if dt is DType.BFLOAT16 else None
        grp = g.engine_group
        code = int(d[A.D_ALGO])
        algo = AlgorithmCode(code).name.lower() if code else "auto"
        if kind == int(OpKind.ALLREDUCE):
            return eng.allreduce_async(
                buf, name=name, op=rop, out=buf, priority=prio, dtype=bf, group=grp,
                algorithm=algo,
            )  # fmt: skip
        if kind == int(OpKind.BROADCAST):
            root = g.nodes.index(g.ranks[int(d[A.D_ROOT])] // self.slots)
            return eng.broadcast_async(
                buf, root=root, name=name, out=buf, priority=prio, dtype=bf, group=grp,
                algorithm=algo,
            )  # fmt: skip
        return eng.barrier_async(name=name, priority=prio, group=grp, algorithm=algo)

    def _buffers(self, op: _Op, dt: DType, count: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """The local members' input and output buffers (group order), checked to lie in
        their parts of the arena."""
        npdt = dt.numpy
        kind = int(op.first()[A.D_KIND])
        ins: list[np.ndarray] = []
        outs: list[np.ndarray] = []
        for g, k in op.grp.local:
            d = op.descs[k]
            assert d is not None
            n_in = n_out = count
            parts = op.parts[k]
            if kind == _RS:
                assert parts is not None
                n_out = parts[g]
            elif kind == _AG:
                assert parts is not None
                n_in, n_out = parts[g], sum(parts)
            elif kind == _A2A:  # each rank's input its own size
                assert parts is not None
                n_in, n_out = int(d[A.D_COUNT]), sum(parts[len(op.grp.ranks) :])
            lo = self.arena.data_start(k)
            hi = lo + self.arena.data_bytes
            at_in, at_out = int(d[A.D_IN]), int(d[A.D_OUT])
            for at, n in ((at_in, n_in), (at_out, n_out)):
                if not lo <= at <= hi - n * npdt.itemsize:
                    raise ValueError(
                        f"rank {self.node * self.slots + k}'s buffer [{at}, "
                        f"{at + n * npdt.itemsize}) is outside its part of the arena"
                    )
            out = self.arena.view(at_out, n_out, npdt)
            outs.append(out)
            ins.append(
                out if at_in == at_out and n_in == n_out else self.arena.view(at_in, n_in, npdt)
            )
        return ins, outs

    def _finish(self, op: _Op, error: BaseException | None, h: Any = None) -> None:
        """The op ended among the nodes (any thread): results back, words set."""
        self._running.pop(op.key, None)
        d0 = op.first()
        if op.handle is not None:
            self._forget_unnamed(op.key[0], d0, op.handle)
        result = None
        if error is None and h is not None and int(d0[A.D_KIND]) in _PARTED:
            try:
                result = h.wait(0)
            except Exception as exc:
                error = exc
        if error is not None:
            self._fail(op, _error_kind(error), self._among_nodes_text(error))
            return
        if not self._claim(op):
            return  # failed meanwhile (the service stops)
        try:
            self._results_back(op, result)
        except _Mismatch as exc:
            op.over = False
            self._fail(op, A.E_MISMATCH, str(exc))
            return
        except Exception as exc:  # never leave the clients waiting
            log.exception("the arena thread could not hand back %s", op.key)
            op.over = False
            self._fail(op, A.E_FAILED, f"the node's service could not hand the result back: {exc}")
            return
        for k, x in enumerate(op.descs):
            if x is not None:
                self._answer(k, op.incarnations[k], x, 0, "")
        op.release()

    def _forget_unnamed(self, wire: int, d: np.ndarray, h: Any) -> None:
        """An unnamed op ended among the services (its handle ``h``): its wire id comes
        once, but for the session agreement's (once per job), so the engine forgets it."""
        if int(d[A.D_FLAGS]) & A.F_UNNAMED:
            self.engine.forget_name(h.name, h.generation if wire == _SESSION else None)

    def _results_back(self, op: _Op, result: np.ndarray | None) -> None:
        d = op.first()
        g = op.grp
        kind = int(d[A.D_KIND])
        if kind == int(OpKind.BARRIER):
            return
        dt = DType(int(d[A.D_DTYPE]))
        if kind == _A2A:
            self._alltoall_back(op, result, dt)
            return
        avg = bool(int(d[A.D_FLAGS]) & A.F_AVG)
        parts = op.parts[g.local[0][1]]
        buf = op.node_buf if result is None else result
        assert buf is not None
        if kind == _RS:
            assert parts is not None
            if avg:
                finish_average(buf, len(g.ranks), dt)
            at = 0
            for gi in g.members[g.where]:  # this node's block: its members' parts in order
                k = g.ranks[gi] % self.slots
                self._put(op, k, buf[at : at + parts[gi]], dt)
                at += parts[gi]
            return
        if kind == _AG:
            assert parts is not None
            if not g.identity:  # back to group order
                whole = np.empty(sum(parts), dtype=buf.dtype)
                starts, pos = offsets(parts), 0
                for gi in g.order:
                    whole[starts[gi] : starts[gi] + parts[gi]] = buf[pos : pos + parts[gi]]
                    pos += parts[gi]
                buf = whole
        elif avg:
            finish_average(buf, len(g.ranks), dt)
        for _, k in g.local:
            self._put(op, k, buf, dt)

    def _put(self, op: _Op, slot: int, src: np.ndarray, dt: DType) -> None:
        """The result ``src`` into slot ``slot``'s output (unless it is there already)."""
        x = op.descs[slot]
        assert x is not None
        at = int(x[A.D_OUT])
        if self.arena.offset_of(src) != at and self._inc[slot] == op.incarnations[slot]:
            copy_into(self.arena.view(at, src.size, src.dtype), src, dt)

    def _among_nodes_text(self, error: BaseException) -> str:
        """The engine's error among the services, told in the clients' terms: the op is
        named by the client, and a service's rank is its node's ranks."""
        text, _, told = _ENGINE_PREFIX.sub("", str(error), count=1).partition(_CLIENT_TERMS)

        def node(m: re.Match[str]) -> str:
            n = int(m.group(1))
            if n >= self.nodes:
                return m.group(0)
            lo, hi = n * self.slots, n * self.slots + self.slots - 1
            return f"node {n} (rank {lo})" if lo == hi else f"node {n} (ranks {lo}..{hi})"

        return _ENGINE_RANK.sub(node, text) + told

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
        if h is None and d is not None and len(op.grp.nodes) > 1 and self.engine is not None:
            try:
                name = self._engine_name(op.key)
                self.engine.abort_next(name, _CLIENT_TERMS + why, kind == A.E_MISMATCH)
                if int(d[A.D_FLAGS]) & A.F_UNNAMED:
                    self.engine.forget_name(name)
            except Exception:
                log.debug("no abort for %s", op.key, exc_info=True)
        if h is not None and not h.done():
            try:
                self.engine.abort(h.name, h.generation, _CLIENT_TERMS + why, kind == A.E_MISMATCH)
            except Exception:
                log.debug("abort of %r failed", h.name, exc_info=True)
        for k, x in enumerate(op.descs):
            if x is not None:
                self._answer(k, op.incarnations[k], x, kind, why)
        self._running.pop(op.key, None)  # the engine's abort ends it there; nothing to drive
        op.release()

    def _late(self, op: _Op, kind: int, why: str) -> None:
        """``op`` completed here, but it fails: each of its clients raises at its next call
        (the late errors of embedded mode)."""
        for k, x in enumerate(op.descs):
            if x is None or self._inc[k] != op.incarnations[k] or not self._inc[k]:
                continue
            ctl = self._ctl[k]
            with self._answering:
                n = int(ctl[A.C_LATE]) + 1
                A.write_error(ctl, -n, kind, f"{int(x[A.D_TICKET])}\x1e{why}")
                fence()
                ctl[A.C_LATE] = n

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
        if ctl[A.C_SLEEPING]:
            with self._answering:  # a detach closes the eventfd under it
                efd = self._efd[slot]
                if efd is not None:
                    signal_eventfd(efd)

    def _look_for_stalls(self) -> None:
        """Warn about ops some of the node's clients submitted long ago and others never
        did (once per ``stall_warning_s``), naming both."""
        self._eject(1.0)  # ops waiting that long: Python's inspector looks at them too
        now = time.monotonic()
        self._next_look = now + 1.0
        for op in [o for ops in self._pending.values() for o in ops]:
            if op.over or op.passive or now - max(op.since, op.warned) < self.stall_warning_s:
                continue
            op.warned = now
            d = next(x for x in op.descs if x is not None)
            base = self.node * self.slots
            have = [base + k for k, x in enumerate(op.descs) if x is not None]
            missing = [base + k for _, k in op.grp.local if op.descs[k] is None]
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
                if rank < 0 or rank in op.grp.rankset:
                    self._fail(op, A.E_FAILED, why)
        for ops in list(self._pending.values()):  # kept: the parts still to come fail too
            for op in ops:
                if rank < 0 or rank in op.grp.rankset:
                    self._fail(op, A.E_FAILED, why)

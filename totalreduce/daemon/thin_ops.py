"""The arena thread's ops: what a node knows of one op, and the checks of a descriptor.

:class:`_Op` is one op of the node (its local clients' descriptors as they come);
:class:`_Grp` what the node knows of an op's group; :class:`Descriptors`, a base of
:class:`~.thin.ThinService`, checks what a client wrote before the service reads or
writes anything for it.  The constants name the kinds, the algorithms a descriptor may
name, and how the engine among the services words its errors.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..algorithms.codes import AlgorithmCode, OpKind
from ..dtypes import DType, ReduceOp
from ..engine.wire import SESSION_ID
from ..errors import OpFailedError, OpMismatchError, TransportError
from ..group import Group
from ..transport import arena as A

#: The session agreement's wire id, as a descriptor's signed word holds it.
_SESSION = A.signed(SESSION_ID)
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
    """What an answered op keeps of its handle among the services: the names to forget
    (``names``: all of a segmented op's, its own name first)."""

    __slots__ = ("name", "generation", "names")

    def __init__(self, name: Any, generation: int, names: tuple[Any, ...] = ()) -> None:
        self.name, self.generation = name, generation
        self.names = names or (name,)

    def done(self) -> bool:
        return True

    def drive(self, span: float, outer: bool = False) -> bool:
        return True  # nothing to drive: the arena thread looks at its next op


def _is_mismatch(error: BaseException | None) -> bool:
    return isinstance(error, OpMismatchError)


def _segment_failed(error: BaseException | None) -> str:
    """The reason a segmented op's other segments fail with, when one failed."""
    return "another segment of it failed: " + _ENGINE_PREFIX.sub("", str(error), count=1)


def ended_of(h: Any) -> _Ended:
    """What an op keeps of its handle ``h`` among the services once it ended."""
    if isinstance(h, (_Ended, _Segments)):
        return h.ended() if isinstance(h, _Segments) else h
    return _Ended(h.name, h.generation)


class _Segments:
    """An allreduce or broadcast among the services, run in segments (see
    :data:`.arena_pass.PIPE_MIN_BYTES`); it stands where the engine's handle of an op
    stands.

    Each segment is an op among the services over a group of the op's nodes whose
    context no client's group has: the first under the op's own name (so a service that
    runs the op whole, because its clients gave another count, meets a group it
    disagrees with, and both fail), the others under names made from it
    (:attr:`names`), each at the first's generation (so a generation one service never
    started is one no service starts again).  At most :data:`IN_FLIGHT` run at once
    (the engine moves two large ops as fast as one; eight at once took twice as long):
    :meth:`~.thin_nodes.AmongNodes._start_segments` starts the next as one ends, first
    making its node's part (``local``), and hands each result back (``back``) as it
    comes.  Each segment's end calls :attr:`on_segment` (any thread); the whole ends when
    all of them ended.  The first error is the whole's, and fails the segments still
    running or not started, here and on the other services."""

    #: Segments among the services at once.
    IN_FLIGHT = 2

    def __init__(self, engine: Any, names: list[int], ranges: list[tuple[int, int]]) -> None:
        self.engine = engine
        self.names = names  # the op's own, then each further segment's
        self.ranges = ranges  # each segment's elements [lo, hi)
        self.handles: list[Any] = []  # the engine's handles, in the order of ``names``
        self.backed = [False] * len(ranges)  # whose result went back to the clients
        self.on_segment: Callable[[int], None] | None = None
        #: (set by whoever starts it) segment i's op among the services, from its index;
        #: its node's part, made before it starts; its result back, once it ended
        self.start: Callable[[int], Any] | None = None
        self.local: Callable[[int, int], None] | None = None
        self.back: Callable[[int], None] | None = None
        self.ended_count = 0
        self._left = len(names)
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[Any], None]] = []
        self._error: BaseException | None = None
        self._skipped = False

    @property
    def name(self) -> Any:
        return self.names[0]

    @property
    def generation(self) -> int:
        return int(self.handles[0].generation) if self.handles else -1

    @property
    def running(self) -> int:
        return len(self.handles) - self.ended_count

    def add(self, h: Any) -> None:
        """The engine's handle of the next of :attr:`names`."""
        with self._lock:
            i = len(self.handles)
            self.handles.append(h)
            error = self._error
        h.add_done_callback(lambda h: self._ended(i, h))
        if error is not None and not h.done():  # another failed meanwhile
            self.engine.abort(h.name, h.generation, _segment_failed(error), _is_mismatch(error))

    @property
    def failed(self) -> bool:
        return self._error is not None

    def skip_rest(self, error: BaseException | None = None) -> None:
        """No more segments start here (one failed, or ``error`` came starting the next):
        the rest fail, here and on every service."""
        with self._lock:
            first = self._error is None and error is not None
            if first:
                self._error = error
            reason = self._error
            running = [x for x in self.handles if not x.done()] if first else []
            rest = [] if self._skipped else self.names[len(self.handles) :]
            self._skipped = True
        for x in running:
            self.engine.abort(x.name, x.generation, _segment_failed(reason), _is_mismatch(reason))
        for name in rest:
            self.engine.abort(name, self.generation, _segment_failed(reason), _is_mismatch(reason))
        self._count_ended(len(rest))

    def _ended(self, i: int, h: Any) -> None:
        error = h.exception()
        with self._lock:
            first = error is not None and self._error is None
            if first:
                self._error = error
            running = [x for x in self.handles if not x.done()] if first else []
            self.ended_count += 1
        for x in running:  # the segments still running fail too, on every service
            self.engine.abort(x.name, x.generation, _segment_failed(error), _is_mismatch(error))
        if self.on_segment is not None:
            self.on_segment(i)
        self._count_ended(1)

    def _count_ended(self, n: int) -> None:
        with self._lock:
            self._left -= n
            callbacks = self._callbacks if self._left == 0 and n else []
        for cb in callbacks:
            cb(self)

    def add_done_callback(self, cb: Callable[[Any], None]) -> None:
        with self._lock:
            if self._left:
                self._callbacks.append(cb)
                return
        cb(self)

    def done(self) -> bool:
        return self._left == 0

    def exception(self) -> BaseException | None:
        return self._error if self._left == 0 else None

    def drive(self, span: float, outer: bool = False) -> bool:
        h = next((h for h in self.handles if not h.done()), None)
        return True if h is None else bool(h.drive(span, outer))

    def abort(self, reason: str, mismatch: bool) -> None:
        """Fail it, here and on every service: what runs, and what has not started."""
        with self._lock:
            if self._error is None:
                self._error = OpMismatchError(reason) if mismatch else OpFailedError(reason)
        for h in list(self.handles):
            if not h.done():
                self.engine.abort(h.name, h.generation, reason, mismatch)
        self.skip_rest()

    def ended(self) -> _Ended:
        return _Ended(self.name, self.generation, tuple(self.names))


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
        if h is not None:  # the engine's handle holds its buffers: keep its names only
            self.handle = ended_of(h)

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


class Descriptors:
    """The checks of a descriptor a client wrote (a base of :class:`~.thin.ThinService`)."""

    arena: Any
    size: int
    node: int
    slots: int
    _world: _Grp
    _groups: dict[tuple[int, int, int], _Grp]
    _fast: Any

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
        self._fast.put_group(ctx, ranks)  # its later ops: the compiled pass's (if a row is free)
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

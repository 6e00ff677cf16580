"""The compiled lane's plans: which ops it runs and how their schedules are cut.

:meth:`LanePlans.plan_of` decides from what every rank of an op agrees on (kind,
algorithm, element type, count, reduce op, group size) and the configuration, never from
the rank's own schedule, and writes the op's plan into ``prog`` once per schedule and
element size: its send and receive segments (their waits and successors), its local ops,
and for a large op where each large receive lands (the op's scratch, or in place).

What ``prog`` keeps is bounded (``Config.lane_plan_bytes``): past the bound the least
recently used plans and groups are dropped and ``prog`` is compacted (:meth:`LanePlans.
_compact`), keeping those of ops in the lane's table (moved, their offsets in the table
rewritten) and the most recently used.  ``plans_epoch`` counts compactions: an offset kept
outside (a ``LaneShape``'s fields, a node service's rows) is stale once it moved.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .. import protocol as L
from ..algorithms.codes import AlgorithmCode, OpKind
from ..algorithms.schedule import Action, Schedule, SegmentPlan, plan_segments
from ..dtypes import DType
from .payload import OpSpec

#: Ops of at most this many eager segments (``micro_bytes``) are cut into eager segments
#: (frames with their bodies); larger ones into segments of ``segment_bytes`` or more
#: (see :func:`large_segment_bytes`), whose bodies above ``micro_bytes`` travel on tags
#: of their own once the receiver has posted the receive (rendezvous).
LANE_MAX_SEGMENTS = 8
#: Largest segment of a large op in the lane (``segment_bytes`` if smaller): measured on
#: a 2-core machine at P=2, 4 MiB ring allreduces took 1.16 ms in 256 KiB segments with
#: 64 bodies in flight, 1.29-1.39 ms with 8-16, 1.59 ms in 1 MiB segments.
LANE_SEGMENT_BYTES = 256 << 10
#: Most send (or receive) segments of one op in a group of up to 24 ranks in the lane
#: (:func:`segment_cap` for larger ones): small ops stay below (an eager ring at 24 ranks:
#: 2 * 24 regions, and 56 more at most), large ones are cut to fit (``large_segment_bytes``).
SEGCAP = 128


def segment_cap(group_size: int) -> int:
    """Most send (or receive) segments of one op of a group of ``group_size`` ranks in the
    lane: ``SEGCAP``, or 4 per rank and 32 more in a group of more than 24 ranks, since
    some schedules have a region per rank and more (a pipelined broadcast's chain and its
    tokens: 3P + 2, a ring allreduce's 2P), each one segment at least, and an eager op
    adds at most ``LANE_MAX_SEGMENTS`` times what it moves (:func:`_bound`).  A function of
    the group's size only, so every rank of an op cuts it alike; a lane's table holds this
    many per op for its world's size (every group fits: the cap grows with the size)."""
    return max(SEGCAP, 4 * group_size + 32)


#: The allreduce algorithms whose schedules the lane runs, on every rank.
LANE_ALGORITHMS = frozenset(
    {
        AlgorithmCode.RING,
        AlgorithmCode.RING_CHUNKED,
        AlgorithmCode.HALVING_DOUBLING,
        AlgorithmCode.BCUBE,
        AlgorithmCode.RECURSIVE_DOUBLING,
    }
)

#: The other kinds the lane runs, and the algorithms of theirs: reduce-scatters and
#: all-gathers (ring: their frames carry what every rank agrees on, an all-gather's count
#: being its whole output) and broadcasts (one-to-all and the pipelined chain, with their
#: confirmation tokens), and barriers (tokens alone).  Any size: a large one is cut as
#: :func:`large_segment_bytes` says.
LANE_KINDS: dict[OpKind, frozenset[AlgorithmCode]] = {
    OpKind.REDUCE_SCATTER: frozenset({AlgorithmCode.RING}),
    OpKind.ALLGATHER: frozenset({AlgorithmCode.RING}),
    OpKind.BROADCAST: frozenset({AlgorithmCode.ONE_TO_ALL, AlgorithmCode.PIPELINED}),
    OpKind.BARRIER: frozenset({AlgorithmCode.ALL_TO_ALL, AlgorithmCode.ALL_TO_ONE}),
}

#: Kinds whose schedules move whole regions straight to their destinations (one step of
#: data, no pipeline to keep): rooted ops, all-to-all (equal or uneven parts), send/recv,
#: the pairwise exchange, neighbor ops (BlueFog's weighted neighbours, Decent-DP's edges: a
#: ring among the edge's ranks, then its weighted epilogue).  Each region is one segment
#: (cut at ``DIRECT_SEGMENT_BYTES``): eager up to ``micro_bytes``, else a body on its own
#: tag.  The two ends of a transfer agree on its size whatever the op's other parts are, so
#: an uneven all-to-all's ranks cut alike without knowing each other's parts.
DIRECT_KINDS: dict[OpKind, frozenset[AlgorithmCode]] = {
    OpKind.REDUCE: frozenset({AlgorithmCode.DIRECT}),
    OpKind.GATHER: frozenset({AlgorithmCode.DIRECT}),
    OpKind.SCATTER: frozenset({AlgorithmCode.DIRECT}),
    OpKind.ALLTOALL: frozenset({AlgorithmCode.DIRECT}),
    OpKind.SEND_RECV: frozenset({AlgorithmCode.DIRECT}),
    OpKind.PAIRWISE_EXCHANGE: frozenset({AlgorithmCode.PAIRWISE}),
    OpKind.NEIGHBOR_ALLGATHER: frozenset({AlgorithmCode.NEIGHBOR}),
    OpKind.NEIGHBOR_ALLREDUCE: frozenset({AlgorithmCode.NEIGHBOR, AlgorithmCode.EDGE}),
}
#: Largest segment of a direct kind's region (an MPI count is a C int).
DIRECT_SEGMENT_BYTES = 1 << 30
#: The kinds whose schedules do arithmetic on data (reductions, averages, weights): their
#: element type must be one the lane's kernels take.  The others only move bytes, so every
#: element type runs in the lane.
_ARITHMETIC = frozenset(
    {
        OpKind.ALLREDUCE,
        OpKind.REDUCE_SCATTER,
        OpKind.REDUCE,
        OpKind.NEIGHBOR_ALLREDUCE,
    }
)

#: The element types the lane reduces (``kernels/raw.py``): all of them.
LANE_TYPES = frozenset(DType)
_FLOAT_TYPES = frozenset({DType.FLOAT32, DType.FLOAT64, DType.FLOAT16, DType.BFLOAT16})


def _bound(kind: OpKind, algorithm: AlgorithmCode | None, group_size: int) -> tuple[int, int]:
    """What any rank of an op of this kind and algorithm in a group of ``group_size`` moves
    at most, in units of the op's ``nbytes`` (its count's bytes), and in at most how many
    regions (step and buffer place): cut into segments of ``seg`` bytes, no rank has more
    than ``regions + ceil(moved * nbytes / seg)`` send or receive segments, since each
    region gains at most one segment from rounding up."""
    q = max(1, group_size - 1)
    if kind is OpKind.ALLREDUCE:  # no algorithm of the lane moves more, in 2 (P - 1) steps
        return 2 + (group_size - 1).bit_length(), 2 * q + 2
    if kind is OpKind.BROADCAST:
        if algorithm is AlgorithmCode.ONE_TO_ALL:  # the root sends the whole to each rank
            return q, 2 * q + 2  # and receives P - 1 tokens, then sends as many releases
        return 1, 3 * group_size + 2  # a chain of at most 2P pieces, and the tokens
    if kind is OpKind.BARRIER:  # a token to (from) each rank, or P - 1 in and as many out
        return 1, 2 * q + 2
    return 1, q + 2  # reduce-scatter, all-gather: a part in each of P - 1 steps


def large_segment_bytes(
    nbytes: int,
    group_size: int,
    segment_bytes: int,
    isz: int,
    kind: OpKind = OpKind.ALLREDUCE,
    algorithm: AlgorithmCode | None = None,
) -> int:
    """Segment size of a large op of ``nbytes`` (its count's bytes) in a group of
    ``group_size``: ``segment_bytes``, or more where that would cut some rank's schedule
    into more than :func:`segment_cap` send or receive segments (:func:`_bound`).  A
    function of the op's shape only, so every rank cuts alike."""
    moved, regions = _bound(kind, algorithm, group_size)
    spare = segment_cap(group_size) - regions
    seg = max(segment_bytes, -(-moved * nbytes // max(1, spare)))
    return max(isz, seg - seg % isz)


def fits_eager(nbytes: int, group_size: int, micro: int, kind: OpKind,
               algorithm: AlgorithmCode) -> bool:  # fmt: skip
    """Whether an op of at most ``LANE_MAX_SEGMENTS`` eager segments also fits
    :func:`segment_cap` in them (a one-to-all broadcast to many ranks may not: it then
    goes large)."""
    moved, regions = _bound(kind, algorithm, group_size)
    return regions + -(-moved * nbytes // micro) <= segment_cap(group_size)


#: Bytes a plan is charged beyond its words in ``prog``: the ``Schedule`` it was made from,
#: which the plan keeps alive (a small allreduce's: 3-4 KiB).
PLAN_CHARGE = 4096
#: ... and a group beyond its words: its tuple and the table's entry.
GROUP_CHARGE = 256
#: ``prog``'s first size (words), and the least it is compacted to.
PROG_WORDS = 1 << 16


class _Kept:
    """A plan (or a group: ``sched`` None) in ``prog``: where, how long, when last used."""

    __slots__ = ("sched", "at", "words", "used", "charge")

    def __init__(self, sched: Schedule | None, at: int, words: int, used: int) -> None:
        self.sched = sched
        self.at = at
        self.words = words
        self.used = used
        self.charge = words * 8 + (GROUP_CHARGE if sched is None else PLAN_CHARGE)


def _bits(weight: float) -> int:
    """A weight as the lane keeps it: the bits of a float64, in an int64 word."""
    return int(np.float64(weight).view(np.int64))


def _waits_on_the_step_before(plan: SegmentPlan) -> list[bool]:
    """For each receive segment: does it wait for a segment of the step just before its own
    (or of its own step)?"""
    near = [False] * len(plan.recvs)
    for segs, after in ((plan.sends, plan.after_send), (plan.recvs, plan.after_recv)):
        for seg, succ in zip(segs, after, strict=True):
            for is_send, q in succ:
                if not is_send and plan.recvs[q].step - seg.step <= 1:
                    near[q] = True
    return near


class LanePlans:
    """``prog``: the compiled plans and groups of a lane, appended as new shapes come, and
    compacted past ``plan_bytes`` (the least recently used dropped)."""

    need_kernels: Callable[[DType], None]  # the lane's: a type's kernels into its table
    mem: np.ndarray  # the lane's tables (a Lane's; absent from bare plans)

    def __init__(
        self, micro_bytes: int, segment_bytes: int, body_tag: int, plan_bytes: int = 64 << 20
    ) -> None:
        self.micro = micro_bytes
        self.segment_bytes = segment_bytes
        #: First tag of the large segments' bodies; -1: this lane runs no large op.
        self.body_tag = body_tag
        #: The transport's largest tag (``why_not``'s words when ``body_tag`` is -1).
        self.tag_ub = 0
        #: What plans and groups may be charged (``_Kept.charge``) before a compaction.
        self.plan_bytes = plan_bytes
        self.prog = np.zeros(PROG_WORDS, dtype=np.int64)
        self._prog_len = 0
        self._plans: dict[tuple[int, int], _Kept] = {}
        self._groups: dict[tuple[int, ...], _Kept] = {}
        self._charged = 0  # the kept entries' charges
        self._tick = 0  # uses so far: an entry's ``used`` is the tick of its last use
        #: Compactions so far: offsets into ``prog`` taken before the last one are stale.
        self.plans_epoch = 0
        #: Called (under the lane's lock) after each compaction, as ``plans_epoch`` moves:
        #: whoever keeps plan or group offsets outside the lane drops or renews them.
        self.on_compact: list[Callable[[], None]] = []

    # ------------------------------------------------------------------ eligibility

    @staticmethod
    def unrunnable(spec: OpSpec) -> str | None:
        """Why no engine can run ``spec`` (arithmetic its element type has not: weights
        on integers, bitwise ops on floats), or None.  The API refuses these before any op;
        an op that still comes fails on every rank of its group with these words, as the
        main loop's kernels failed it when it ran them."""
        if spec.kind not in _ARITHMETIC:
            return None
        dt = spec.dtype
        if spec.kind is OpKind.NEIGHBOR_ALLREDUCE and dt not in _FLOAT_TYPES:
            return (
                f"neighbor averaging needs a floating dtype, got {dt.name}: integer buffers "
                "cannot be scaled by a fractional weight"
            )
        if spec.op.bitwise and dt in _FLOAT_TYPES:
            return f"a bitwise reduce op needs an integer dtype, got {dt.name}"
        return None

    def why_not(self, spec: OpSpec) -> str:
        """Why :meth:`plan_of` gives ``spec`` no plan (it returned -1): the same on every
        rank of the op, which all refuse it with these words."""
        kind, algo = spec.kind, spec.algorithm
        if kind is OpKind.ALLREDUCE:
            known: frozenset[AlgorithmCode] = LANE_ALGORITHMS
        else:
            known = DIRECT_KINDS.get(kind) or LANE_KINDS.get(kind) or frozenset()
        if algo not in known:
            have = ", ".join(sorted(a.name.lower() for a in known)) or "none"
            return (
                f"the compiled lane has no {getattr(algo, 'name', algo)!s} algorithm for "
                f"{kind.name.lower()} (it runs: {have})"
            )
        if self.body_tag < 0:
            top = L.BODY_TAG_BASE + L.LANE_BODY_SPAN - 1
            return (
                f"its bodies need MPI tags {L.BODY_TAG_BASE}..{top} "
                f"and this MPI's MPI_TAG_UB is {self.tag_ub}: only ops whose every segment "
                f"fits micro_bytes ({self.micro}) run there (a smaller op, or a larger "
                "micro_bytes, does)"
            )
        return f"the compiled lane does not run it ({spec.dtype.name}, {spec.op.name})"

    def plan_of(self, spec: OpSpec) -> int:
        """The offset of the op's compiled plan in ``prog``, or -1 if the lane does not
        run it: allreduces of the lane's algorithms, reduce-scatters, all-gathers and
        broadcasts of theirs (:data:`LANE_KINDS`), of any size.

        The decision depends only on what every rank of the op agrees on (kind,
        algorithm, element type, count, reduce op, group size) and the configuration,
        never on this rank's own schedule: ranks that agree on an op always send its
        frames the same way."""
        allreduce = spec.kind is OpKind.ALLREDUCE
        direct = spec.kind in DIRECT_KINDS
        if allreduce:
            if spec.algorithm not in LANE_ALGORITHMS:
                return -1
        elif direct:
            if spec.algorithm not in DIRECT_KINDS[spec.kind] or self.body_tag < 0:
                return -1  # (a region may be large: its body needs a tag of its own)
        elif spec.algorithm not in LANE_KINDS.get(spec.kind, ()):
            return -1
        dt = spec.dtype
        op = spec.op
        if spec.kind in _ARITHMETIC:
            if dt not in LANE_TYPES:
                return -1
            if op.bitwise and dt in _FLOAT_TYPES:
                return -1
            if spec.kind is OpKind.NEIGHBOR_ALLREDUCE and dt not in _FLOAT_TYPES:
                return -1  # (weights: the main loop says what it does with integers)
            self.need_kernels(dt)
        isz = dt.itemsize
        nbytes = spec.count * isz
        seg = max(self.micro, 8)
        p = len(spec.group)
        if direct:
            seg = DIRECT_SEGMENT_BYTES - DIRECT_SEGMENT_BYTES % isz
        elif nbytes > LANE_MAX_SEGMENTS * seg or not (
            allreduce or fits_eager(nbytes, p, seg, spec.kind, spec.algorithm)
        ):
            if self.body_tag < 0:
                return -1
            seg = large_segment_bytes(
                nbytes, p, min(self.segment_bytes, LANE_SEGMENT_BYTES), isz, spec.kind,
                spec.algorithm,
            )  # fmt: skip
        sched = spec.schedule
        key = (id(sched), isz)
        self._tick += 1
        hit = self._plans.get(key)
        if hit is not None and hit.sched is sched:
            hit.used = self._tick
            self._use_group(spec.group, hit.at)
            return hit.at
        if self._charged >= self.plan_bytes:  # room first: a compaction moves plans
            self._compact(-1)
        at = self._compile(sched, isz, seg, segment_cap(p))
        if at < 0:  # the limits above promise a plan: a bug, not a routing choice
            raise RuntimeError(
                f"the compiled lane cannot run {spec.describe()} ({spec.algorithm.name.lower()}, "
                f"{spec.count} x {dt.name.lower()}, {len(spec.group)} ranks) although its "
                "limits admit it"
            )
        kept = _Kept(sched, at, self._prog_len - at, self._tick)
        self._plans[key] = kept
        self._charged += kept.charge
        self._use_group(spec.group, kept.at)
        return kept.at

    def _use_group(self, group: tuple[int, ...], plan: int) -> None:
        """The op's group into ``prog`` (where ``_fields_of`` finds it), compacting first
        when it is new and the bound is reached (the op's plan, at ``plan``, is kept:
        :meth:`plan_of` returns where it is then)."""
        g = self._groups.get(group)
        if g is not None:
            g.used = self._tick
            return
        if self._charged >= self.plan_bytes:
            self._compact(plan)
        self._group(group)

    def _grow_prog(self, need: int) -> None:
        if self._prog_len + need > self.prog.size:
            bigger = np.zeros(max(2 * self.prog.size, self._prog_len + need), dtype=np.int64)
            bigger[: self._prog_len] = self.prog[: self._prog_len]
            self.prog = bigger

    def _compile(self, sched: Schedule, isz: int, seg_bytes: int, cap: int = SEGCAP) -> int:
        """Write the plan of ``sched`` (segments of at most ``seg_bytes``) into ``prog``;
        -1 if it uses what the lane does not run, or more than ``cap`` send or receive
        segments.  Receive segments above ``micro_bytes`` get a place in the op's scratch."""
        if any(r.src is not None and r.action is not Action.REDUCE
               for st in sched.steps for r in st.recvs):  # fmt: skip
            return -1
        locs = list(sched.prologue) + list(sched.epilogue)
        plan = plan_segments(sched, max(1, seg_bytes // isz))
        ns, nr = len(plan.sends), len(plan.recvs)
        if ns > cap or nr > cap:
            return -1
        nsucc = sum(len(x) for x in plan.after_send) + sum(len(x) for x in plan.after_recv)
        need = L.PL_N + (ns + nr) * L.G_N + nsucc + len(locs) * L.L_N
        self._grow_prog(need)
        p = self.prog
        at = self._prog_len
        s0 = at + L.PL_N
        r0 = s0 + ns * L.G_N
        succ = r0 + nr * L.G_N
        l0 = succ + nsucc
        p[at + L.PL_NS] = ns
        p[at + L.PL_NR] = nr
        p[at + L.PL_NPRO] = len(sched.prologue)
        p[at + L.PL_NEPI] = len(sched.epilogue)
        p[at + L.PL_SENDS] = s0
        p[at + L.PL_RECVS] = r0
        p[at + L.PL_LOCS] = l0
        p[at + L.PL_ISZ] = isz
        scratch = 0

        def successors(lst: list[tuple[bool, int]]) -> tuple[int, int]:
            nonlocal succ
            first = succ
            for is_send, idx in lst:
                p[succ] = idx if is_send else -idx - 1
                succ += 1
            return first, len(lst)

        for i, s in enumerate(plan.sends):
            g = s0 + i * L.G_N
            p[g + L.G_STEP], p[g + L.G_SEG], p[g + L.G_PEER] = s.step, s.segment, s.peer
            p[g + L.G_BUF], p[g + L.G_OFF] = int(s.region.buffer), s.region.offset * isz
            p[g + L.G_NBYTES], p[g + L.G_ACTION] = s.region.count * isz, 0
            p[g + L.G_SBUF] = -1
            p[g + L.G_SCR] = -1
            p[g + L.G_NWAIT] = plan.send_waits[i]
            p[g + L.G_SUCC], p[g + L.G_NSUCC] = successors(plan.after_send[i])
        near = _waits_on_the_step_before(plan)
        for q, r in enumerate(plan.recvs):
            g = r0 + q * L.G_N
            p[g + L.G_STEP], p[g + L.G_SEG], p[g + L.G_PEER] = r.step, r.segment, r.peer
            p[g + L.G_BUF], p[g + L.G_OFF] = int(r.region.buffer), r.region.offset * isz
            p[g + L.G_NBYTES], p[g + L.G_ACTION] = r.region.count * isz, int(r.action)
            p[g + L.G_SBUF] = -1 if r.src is None else int(r.src.buffer)
            p[g + L.G_SOFF] = 0 if r.src is None else r.src.offset * isz
            p[g + L.G_NWAIT] = plan.recv_waits[q]
            p[g + L.G_SUCC], p[g + L.G_NSUCC] = successors(plan.after_recv[q])
            p[g + L.G_SCR] = -1
            p[g + L.G_W] = _bits(r.weight)
            if r.region.count * isz > self.micro:
                if r.action is Action.COPY and r.src is None and not near[q]:
                    # Whatever reads its elements waits for it, and it is posted once
                    # what it waits for (what touched them before) is over: the body
                    # lands in place, and no copy follows (an in-place ring's all-gather
                    # half at P > 2).  Not when it waits for the step just before it (an
                    # in-place ring at P = 2): its clear would leave only once the send
                    # of those elements had completed, and the peer's body, ready by
                    # then, would wait for a chain of four messages each side must poll
                    # for; landing in scratch, its clear leaves when the op starts.
                    p[g + L.G_SCR] = L.SCR_DIRECT
                else:
                    p[g + L.G_SCR] = scratch
                    scratch += (r.region.count * isz + 63) & ~63
        p[at + L.PL_SCR] = scratch
        p[at + L.PL_NLARGE] = sum(int(p[r0 + q * L.G_N + L.G_SCR] != -1) for q in range(nr))
        for k, lop in enumerate(locs):
            g = l0 + k * L.L_N
            p[g + L.L_KIND] = int(lop.kind)
            p[g + L.L_DBUF], p[g + L.L_DOFF] = int(lop.dst.buffer), lop.dst.offset * isz
            src = lop.dst if lop.src is None else lop.src  # (a scale in place)
            p[g + L.L_SBUF], p[g + L.L_SOFF] = int(src.buffer), src.offset * isz
            p[g + L.L_NBYTES] = lop.dst.count * isz
            p[g + L.L_DIV] = lop.divisor
            p[g + L.L_W] = _bits(lop.weight)
        self._prog_len = l0 + len(locs) * L.L_N
        return at

    def _group(self, group: tuple[int, ...]) -> int:
        """Where ``group`` is in ``prog`` (appended if new: never a compaction, so offsets
        taken just before stay good)."""
        g = self._groups.get(group)
        if g is None:
            self._grow_prog(len(group))
            at = self._prog_len
            self.prog[at : at + len(group)] = group
            self._prog_len += len(group)
            g = self._groups[group] = _Kept(None, at, len(group), self._tick)
            self._charged += g.charge
        return g.at

    # ------------------------------------------------------------------ the bound

    def _in_table(self) -> np.ndarray:
        """The slots of the lane's op table in use (ops in flight, not yet ended)."""
        mem = getattr(self, "mem", None)
        if mem is None:
            return np.zeros(0, dtype=np.int64)
        nops = int(mem[L.C_NOPS])
        free = mem[mem[L.C_FREEOP] : mem[L.C_FREEOP] + mem[L.C_NFREEOP]]
        used = np.ones(nops, dtype=bool)
        used[free] = False
        return mem[L.C_OPS] + np.flatnonzero(used) * L.O_N

    def _compact(self, keep: int) -> None:
        """Drop the least recently used plans and groups, keeping the most recently used
        up to half of ``plan_bytes``, the ones of ops in the lane's table and the plan at
        ``keep`` (-1: none), and move the kept ones to the front of a new ``prog``: the
        offsets inside a plan (its send, receive and local ops, its segments' successors)
        and the table's ``O_PLAN`` and ``O_GROUP`` words follow them.  The dropped plans'
        schedules are let go."""
        ops = self._in_table()
        mem = getattr(self, "mem", None)
        pinned = {keep}
        if ops.size:
            pinned.update(mem[ops + L.O_PLAN].tolist())
            pinned.update(mem[ops + L.O_GROUP].tolist())
        budget = self.plan_bytes // 2
        entries = sorted([*self._plans.items(), *self._groups.items()], key=lambda kv: -kv[1].used)
        charged = recent = 0
        kept: list[_Kept] = []
        for key, e in entries:  # the most recent first, up to the first that does not fit
            recent += e.charge
            if e.at in pinned or recent <= budget:
                charged += e.charge
                kept.append(e)
            elif e.sched is None:
                del self._groups[key]  # type: ignore[arg-type]
            else:
                del self._plans[key]  # type: ignore[arg-type]
        words = sum(e.words for e in kept)
        size = PROG_WORDS
        while size < 2 * words:
            size *= 2
        old, new = self.prog, np.zeros(size, dtype=np.int64)
        moved: dict[int, int] = {}
        pos = 0
        for e in sorted(kept, key=lambda e: e.at):
            new[pos : pos + e.words] = old[e.at : e.at + e.words]
            d = pos - e.at
            if e.sched is not None and d:
                new[pos + L.PL_SENDS] += d
                new[pos + L.PL_RECVS] += d
                new[pos + L.PL_LOCS] += d
                nseg = int(new[pos + L.PL_NS] + new[pos + L.PL_NR])
                at = int(new[pos + L.PL_SENDS]) + L.G_SUCC
                new[at : at + nseg * L.G_N : L.G_N] += d
            moved[e.at] = pos
            e.at = pos
            pos += e.words
        if ops.size:
            for col in (L.O_PLAN, L.O_GROUP):
                mem[ops + col] = [moved[int(v)] for v in mem[ops + col]]
        self.prog = new
        self._prog_len = pos
        self._charged = charged
        self.plans_epoch += 1
        for hook in self.on_compact:
            hook()

"""The compiled lane's Python side: which plan runs an op, its tables, its events.

The control plane (:mod:`totalreduce.engine`) hands every op to the lane: its schedule,
compiled once per shape into ``prog`` (:meth:`Lane.plan_of`), runs in compiled code over
MPI or the in-process transport, for every kind, element type and group.  Small segments
travel in eager frames; larger ones as bodies on tags of their own once the receiver
posted the receive (rendezvous).  An op the lane cannot run (an integer
``neighbor_allreduce``, a bitwise op on floats) fails on every rank of its group, naming
the op and why.

Python does here what is rare: compiling plans into ``prog`` once per shape, growing
the pool, turning events into errors with the words the ranks share, and finishing
completed ops' handles.  :mod:`.lane_core` does the rest.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from .. import protocol as L
from ..dtypes import DType
from ..protocol import LANE_BODY_SPAN, LANE_TAG  # noqa: F401 - also named here
from ..transport import mpi_native
from . import lane_core as core
from .lane_grow import LaneGrowth, _status_words
from .lane_plans import (  # noqa: F401 - the lane's limits, also named here
    LANE_ALGORITHMS,
    LANE_MAX_SEGMENTS,
    LANE_SEGMENT_BYTES,
    LANE_TYPES,
    SEGCAP,
    LanePlans,
    large_segment_bytes,
    segment_cap,
)
from .lane_pool import BufferPool
from .payload import OpSpec

log = logging.getLogger("totalreduce.engine")

#: How long a thread waits for an op before its peers are asked to raise it, until
#: :meth:`Lane.need_after` says (``Config.need_after_s``'s default).
LANE_NEED_AFTER_S = 5e-4

#: Body sends in flight to one peer at most; ready ones wait in priority order.
LANE_BODY_CAP = 16

#: Body requests (sends and receives of large segments) the table holds at first; bodies
#: beyond it wait, in order, while Python doubles it (``Lane.grow``).
LANE_BODY_REQUESTS = 1 << 12
#: A receive of a failed op stays posted this long for its sender's body or empty message
#: (a sender that held its clear always sends one of them, so no send is left unmatched),
#: then it is cancelled: nothing will come (the sender never held the clear).
LANE_ORPHAN_S = 2.0
#: Empty messages owed at once (clears held by ops that failed here; a bound, not a need).
LANE_ABANDONS = 4096
#: Words of the per-op segment table at most (pages are touched only as ops use them): in
#: a world so large that ``nops`` ops' rows would need more, the op table holds fewer.
_SEGMENT_TABLE_WORDS = 1 << 25
#: The largest WORK buffer (elements) a blocking repeat's shape keeps (``LaneShape.spare``).
_SPARE_MAX = 64
#: In-place inputs of at least this many bytes are copied into pooled buffers.
_POOLED_BYTES = 64 << 10
#: Pooled buffers kept per size: as many as were in use at once, at least this many
#: (lane_pool.py); and at most this many bytes in all.
_POOLED_PER_SIZE = 4
_POOLED_MAX = 512 << 20
_NO_POOLED: list[np.ndarray] = []
#: How long a blocking repeat's first try drives its op (``Lane.now``), as a waiter's does.
_NOW_NS = 200_000


def _by_priority(item: tuple[LaneOp, bool]) -> int:
    return -item[0].spec.priority


def _signed(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


#: A lane op's ``have`` until a rank answers a probe (a set is made then).
_NOBODY: frozenset[int] = frozenset()
_NO_BODY = np.zeros(0, dtype=np.uint8)


class LaneOp:
    """Python's record of an op in the lane: its spec, and what keeps its buffers alive."""

    __slots__ = (
        "spec", "key", "slot", "seq", "keep", "pooled", "t0", "probed", "warned", "have", "error",
    )  # fmt: skip
    slot: int
    seq: int
    keep: Any
    pooled: list[np.ndarray]
    t0: float
    probed: bool
    warned: bool
    have: set[int] | frozenset[int]
    error: BaseException | None

    def __init__(self, spec: OpSpec, slot: int, seq: int, keep: Any) -> None:
        self.spec = spec
        self.key = (spec.wire_id, spec.generation)
        entered(self, slot, seq, keep)


def entered(lop: Any, slot: int, seq: int, keep: Any) -> None:
    """Set the lane's fields of ``lop`` (a :class:`LaneOp`, or an op that is its own lane op:
    see :func:`lane_op`), which entered in ``slot`` as submission ``seq``."""
    lop.slot = slot
    lop.seq = seq
    lop.keep = keep
    lop.pooled = _NO_POOLED  # its scratch and input copy, from the lane's pool
    lop.t0 = time.monotonic()
    lop.probed = False
    lop.warned = False
    lop.have = _NOBODY  # ranks that answered a probe (rare: a set then)
    lop.error = None


def lane_op(spec: Any, slot: int, seq: int, keep: Any) -> LaneOp:
    """The lane op of ``spec``, entered in ``slot`` as submission ``seq``: a new
    :class:`LaneOp`, or ``spec`` itself where it is one already: an async repeat's handle
    (``service/handle.ExpressOp``) is its op's spec and its lane op too, so a repeat makes
    one object (it has :class:`LaneOp`'s fields, ``spec`` and ``key`` as properties)."""
    if spec.__class__ is OpSpec:
        return LaneOp(spec, slot, seq, keep)
    entered(spec, slot, seq, keep)
    return spec  # type: ignore[no-any-return]


class OpsByKey:
    """The lane's ops in flight by key (wire id, generation), as a dict of dicts: wire id,
    then generation.  Entering an op stores the two ints it already holds, so a repeat
    makes no key (a dict keyed by the pair would take a new tuple per op).  A wire id's
    emptied dict is kept for its next op while few are kept (:data:`_KEPT_IDS`)."""

    __slots__ = ("_by_wid", "_n")

    def __init__(self) -> None:
        self._by_wid: dict[int, dict[int, LaneOp]] = {}
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def __bool__(self) -> bool:
        return self._n != 0

    def __contains__(self, key: tuple[int, int]) -> bool:
        d = self._by_wid.get(key[0])
        return d is not None and key[1] in d

    def get(self, key: tuple[int, int], default: Any = None) -> Any:
        d = self._by_wid.get(key[0])
        return default if d is None else d.get(key[1], default)

    def __getitem__(self, key: tuple[int, int]) -> LaneOp:
        return self._by_wid[key[0]][key[1]]

    def values(self) -> list[LaneOp]:
        return [lop for d in self._by_wid.values() for lop in d.values()]

    def put(self, wid: int, gen: int, lop: Any) -> None:
        d = self._by_wid.get(wid)
        if d is None:
            d = self._by_wid[wid] = {}
        if gen not in d:
            self._n += 1
        d[gen] = lop

    def drop(self, wid: int, gen: int) -> None:
        d = self._by_wid.get(wid)
        if d is not None and d.pop(gen, None) is not None:
            self._n -= 1
            if not d and len(self._by_wid) > _KEPT_IDS:
                del self._by_wid[wid]


#: Wire ids whose emptied dict :class:`OpsByKey` keeps (a training step's names).
_KEPT_IDS = 4096


class LaneShape:
    """The lane's fields of an op shape (all but generation, priority and urgency), kept by
    whoever submits that shape again and again (:meth:`Lane.shape_of`)."""

    __slots__ = (
        "fields", "copy_in", "work", "scratch", "plain", "f16", "quick", "spare", "epoch",
    )  # fmt: skip

    def __init__(
        self, fields: np.ndarray, copy_in: bool, work: int, scratch: int, f16: bool = False,
        epoch: int = 0,
    ) -> None:  # fmt: skip
        self.fields = fields
        #: The lane's ``plans_epoch`` its plan and group offsets (``fields``) are of: a
        #: compaction since moved them, and the lane refuses the shape (made anew then).
        self.epoch = epoch
        self.copy_in = copy_in  # in place, and the schedule reads the input after writing
        self.work = work  # elements of the schedule's WORK buffer each op needs (0: none)
        self.scratch = scratch  # bytes of scratch for its large receives (0: none)
        self.f16 = f16  # float16 data, which compiled code takes as uint16 views
        #: Nothing to copy or allocate per op: :meth:`Lane.enter`'s short way.
        self.plain = not copy_in and not work and not scratch
        #: :meth:`Lane.now` takes it: plain, or with a WORK buffer of a few elements only
        #: (a rooted op's confirmation token), which the shape keeps (``spare``) between
        #: the blocking repeats that end in their call.
        self.quick = not copy_in and not scratch and work <= _SPARE_MAX
        self.spare: tuple[np.ndarray, int] | None = None


class Lane(LanePlans, LaneGrowth):
    """The lane's arrays and the Python half of its protocol (the caller holds the
    main loop's lock for every method)."""

    def __init__(
        self,
        b: np.ndarray,
        rank: int,
        world: int,
        micro_bytes: int,
        *,
        nops: int = 1 << 14,
        pool_bytes: int = 32 << 20,
        nsb: int = 64,
        segment_bytes: int = 1 << 20,
        body_tag: int = -1,
        body_requests: int = 0,
        plan_bytes: int = 64 << 20,
    ) -> None:
        core.compile_all()  # here, not in a first op (cached on disk after the first time)
        self.b = b  # transport.mpi_native.binding of the transport's communicator
        self.rank = rank
        self.world = world
        LanePlans.__init__(self, micro_bytes, segment_bytes, body_tag, plan_bytes)
        # Each op's row of segment state holds what any op of any group of this world may
        # need (lane_plans.segment_cap: more than SEGCAP past 24 ranks).
        segcap = segment_cap(world)
        nops = min(nops, max(1024, _SEGMENT_TABLE_WORDS // (L.D_N * segcap)))
        hcap = 1
        while hcap < 2 * nops:
            hcap *= 2
        slot_bytes = L.FRAME_SIZE + ((micro_bytes + 7) & ~7)
        peers = max(1, world - 1)
        # What peers may make this rank hold for ops it has not submitted, within
        # ``pool_bytes`` whatever they send: credited frames, at most half of it (and at
        # most 1024 slots), shared equally (0 credit: every early frame is announced);
        # announcements, a quarter of it at ANN_CHARGE each (and at most a quarter of
        # the floating hash).  The pool's other slots stage bodies of submitted ops
        # waiting for their turn; the pool grows only for those (``Lane.grow``).
        credit = min(1024, pool_bytes // 2 // slot_bytes) // peers
        nslots = max(16, credit * peers + 16, min(2048, pool_bytes // slot_bytes))
        self.pool_bytes = pool_bytes
        outcap = L.MSG_SIZE + 4 * slot_bytes
        evcap = 1024
        stkcap = 1 << 17
        failcap = 4096
        rqcap = 1 << 16
        breqcap = max(4, body_requests or LANE_BODY_REQUESTS)
        anncap = max(0, min(hcap // 4, pool_bytes // 4 // L.ANN_CHARGE))
        pqcap = 1 << 16
        sizes = [
            ("ops", nops * L.O_N),
            ("hash", hcap * 3),
            ("fhash", hcap * 3),
            ("dyn", nops * L.D_N * segcap),
            ("meta", nslots * L.M_N),
            ("freeslot", nslots),
            ("freeop", nops),
            ("peers", world * L.P_N),
            ("evq", evcap * L.E_N),
            ("doneq", nops),
            ("stk", 1 + stkcap * 2 + 1 + stkcap * 4),
            ("sbstate", nsb),
            ("failq", failcap * 2),
            ("rq", rqcap * 4),
            ("breq", breqcap * L.BR_N),
            ("breqh", breqcap),
            ("bidx", (breqcap + 1) // 2),
            ("bst", breqcap * _status_words(b)),
            ("pq", pqcap * 3),
            ("aq", LANE_ABANDONS * 2),
            ("defer", stkcap * 2),
            ("ann", anncap * L.A_N),
            ("annfree", anncap),
            ("ktab", L.K_KINDS * L.K_TYPES),
        ]
        off = L.C_LEN
        at = {}
        for name, n in sizes:
            at[name] = off
            off += n
        mem = np.zeros(off, dtype=np.int64)
        mem[L.C_RANK] = rank
        mem[L.C_WORLD] = world
        mem[L.C_NOPS] = nops
        mem[L.C_HCAP] = hcap
        mem[L.C_NSLOTS] = nslots
        mem[L.C_SLOT] = slot_bytes
        mem[L.C_OUTCAP] = outcap
        mem[L.C_NSB] = nsb
        mem[L.C_CREDIT] = credit
        mem[L.C_ANN] = at["ann"]
        mem[L.C_ANNCAP] = anncap
        mem[L.C_ANNFREE] = at["annfree"]
        mem[L.C_KTAB] = at["ktab"]
        #: Element types whose kernels are in the table (``need_kernels``).
        self._kernel_types: set[int] = set()
        mem[L.C_MICRO] = micro_bytes
        mem[L.C_TAG] = LANE_TAG
        mem[L.C_SEGCAP] = segcap
        mem[L.C_WATCH] = -1
        mem[L.C_NEED_NS] = int(LANE_NEED_AFTER_S * 1e9)  # (attach_lane: the configuration's)
        mem[L.C_OPS] = at["ops"]
        mem[L.C_HASH] = at["hash"]
        mem[L.C_FHASH] = at["fhash"]
        mem[L.C_DYN] = at["dyn"]
        mem[L.C_META] = at["meta"]
        mem[L.C_FREESLOT] = at["freeslot"]
        mem[L.C_FREEOP] = at["freeop"]
        mem[L.C_PEERS] = at["peers"]
        mem[L.C_EVQ] = at["evq"]
        mem[L.C_EVCAP] = evcap
        mem[L.C_DONEQ] = at["doneq"]
        mem[L.C_STK] = at["stk"] + 1
        mem[L.C_STKCAP] = stkcap
        mem[L.C_SBSTATE] = at["sbstate"]
        mem[L.C_FAILQ] = at["failq"]
        mem[L.C_FAILCAP] = failcap
        mem[L.C_RQ] = at["rq"]
        mem[L.C_RQCAP] = rqcap
        mem[L.C_BTAG] = body_tag
        mem[L.C_BSPAN] = LANE_BODY_SPAN
        mem[L.C_BREQ] = at["breq"]
        mem[L.C_BREQCAP] = breqcap
        mem[L.C_BREQH] = at["breqh"]
        mem[L.C_BIDX] = at["bidx"]
        mem[L.C_BST] = at["bst"]
        mem[L.C_PQ] = at["pq"]
        mem[L.C_PQCAP] = pqcap
        mem[L.C_AQ] = at["aq"]
        mem[L.C_AQCAP] = LANE_ABANDONS
        mem[L.C_ORPHAN_NS] = int(LANE_ORPHAN_S * 1e9)
        mem[L.C_BODYCAP] = LANE_BODY_CAP
        mem[L.C_DEFER] = at["defer"]
        mem[at["hash"] + 2 : at["hash"] + hcap * 3 : 3] = L.H_EMPTY
        mem[at["fhash"] + 2 : at["fhash"] + hcap * 3 : 3] = L.H_EMPTY
        mem[at["freeslot"] : at["freeslot"] + nslots] = np.arange(nslots)[::-1]
        mem[L.C_NFREE] = nslots
        mem[at["freeop"] : at["freeop"] + nops] = np.arange(nops)[::-1]
        mem[L.C_NFREEOP] = nops
        for peer in range(world):
            mem[at["peers"] + peer * L.P_N + L.P_CREDIT] = mem[L.C_CREDIT]
            mem[at["peers"] + peer * L.P_N + L.P_OUTSB] = -1
        # The arena: requests and status first, then send buffers (a peer's outbox is
        # written in one), landing, event frames.  The pool's slots are an array of their
        # own (``C_POOL``): growing it never moves what MPI may read.
        a = 0
        mem[L.C_A_REQ] = a
        a += nsb * 8
        mem[L.C_A_STATUS] = a
        a += mpi_native.STATUS_MAX
        mem[L.C_A_MSG] = a
        a += 64
        mem[L.C_A_SB] = a
        a += nsb * outcap
        mem[L.C_A_LAND] = a
        a += outcap
        mem[L.C_A_EVB] = a
        a += evcap * L.FRAME_SIZE
        mem[L.C_CTLB] = a  # the control frames' bodies (CONTROL_BODY_BYTES, fixed)
        a += L.CONTROL_BODY_BYTES
        mem[L.C_A_SLOTS] = -1  # (the pool's slots: C_POOL)
        self.mem = mem
        self.arena = np.zeros(a, dtype=np.uint8)
        self.pool = np.zeros(nslots * slot_bytes, dtype=np.uint8)
        mem[L.C_POOL] = self.pool.ctypes.data
        self.ops: dict[int, LaneOp] = {}  # slot -> op
        self.by_key = OpsByKey()
        self._fields = np.zeros(16, dtype=np.int64)
        self._ctl_fields = np.zeros(15, dtype=np.int64)
        self._addrs = np.zeros(8, dtype=np.int64)  # [4:7]: core.lane_once's answers
        self._plain_addrs = np.zeros(8, dtype=np.int64)
        #: the addresses :meth:`now` last entered an op with that did not end (``adopt``)
        self._now_at = self._plain_addrs
        #: The WORK buffer of what :meth:`now` entered and did not end, for :meth:`adopt`.
        self._now_keep: np.ndarray | None = None
        #: After :meth:`enter`: whether ops ended or events wait for Python.
        self.pending = False
        #: After :meth:`wait` or :meth:`wait_own` with ``outer``: whether it returned
        #: because the outer words moved (:meth:`watch_outer`), its op not ended.
        self.outer_moved = False
        #: Scratch and input copies of large ops, by size, for the next op of that size.
        self._pool = BufferPool(_POOLED_MAX, _POOLED_PER_SIZE)
        self._take = self._pool.take
        self._give = self._pool.give
        #: What failed ops with bodies still posted keep alive (until ``C_ORPHANS`` is 0).
        self._orphans: list[Any] = []

    # ------------------------------------------------------------------ ops

    def submit(self, spec: OpSpec, plan: int, work: int) -> LaneOp | None:
        """Enter ``spec`` (its plan from :meth:`plan_of`); None when the table is full."""
        return self._enter(spec, self._fields_of(spec, plan, self._fields), work, None)

    def shape_of(self, spec: OpSpec) -> LaneShape | None:
        """What :meth:`enter` needs of ``spec`` and of every later op of its shape (the same
        name, group, dtype, count, reduce op, schedule): None if the lane does not run it."""
        plan = self.plan_of(spec)
        if plan < 0:
            return None
        sched = spec.schedule
        return LaneShape(
            self._fields_of(spec, plan, np.zeros(16, dtype=np.int64)),
            spec.in_place and sched.reads_input,
            sched.work_count,
            int(self.prog[plan + L.PL_SCR]),
            spec.dtype is DType.FLOAT16,
            self.plans_epoch,
        )

    def enter(self, spec: OpSpec, shape: LaneShape) -> LaneOp | None:
        """Enter a repeat of the shape ``shape`` was made for (its generation, priority,
        urgency and buffers are this op's); None when the table is full.  ``pending``
        then says whether ops ended or events wait for Python.  A shape made before the
        last compaction (its offsets moved) is not entered either: None."""
        if shape.epoch != self.plans_epoch:
            return None
        if not shape.plain:
            return self._enter(spec, shape.fields, shape.work, shape)
        # What _enter does, less what a plain shape never needs (copies, buffers).
        a = self._plain_addrs  # its WORK and SCRATCH addresses stay 0
        if shape.f16:
            core.buffer_addresses(spec.inbuf.view(np.uint16), spec.outbuf.view(np.uint16), a)
        else:
            core.buffer_addresses(spec.inbuf, spec.outbuf, a)
        # the blocking form's entry too (``now``), not driven here: the route is one
        if core.lane_once(
            self.mem, self.prog, self.arena, self.b, shape.fields, a,
            spec.generation, spec.priority, 1 if spec.urgent else 0, -1, 0,
        ) < 0:  # fmt: skip
            return None
        slot, seq = int(a[4]), int(a[5])
        self.pending = a[6] != 0
        lop = lane_op(spec, slot, seq, None)
        self.ops[slot] = lop
        self.by_key.put(spec.wire_id, spec.generation, lop)
        return lop

    def now(
        self, shape: LaneShape, inbuf: np.ndarray, outbuf: np.ndarray, generation: int,
        priority: int, spin_ns: int,
    ) -> int:  # fmt: skip
        """Enter a repeat of a quick shape (``LaneShape.quick``) for a blocking call, urgent,
        and drive it for up to 200 µs as :meth:`wait_own` does, in one compiled call
        (``lane_core.lane_once``, :meth:`enter`'s too) after the one that reads the
        buffers' addresses, nothing made in Python: 2 when it ended well and left the
        table; -1 when the table is full; else 0 or 1: entered, to be adopted
        (:meth:`adopt`) before anything drains the lane.  A shape with a WORK buffer lends
        its spare one, which an op that did not end takes with it.  A shape made before
        the last compaction is not entered: -1."""
        if shape.epoch != self.plans_epoch:
            return -1
        if shape.work:
            spare = shape.spare
            if spare is None:
                buf = np.empty(shape.work, dtype=inbuf.dtype)
                spare = shape.spare = (buf, buf.__array_interface__["data"][0])
            a = self._addrs
            a[2] = spare[1]
            a[3] = 0
        else:
            a = self._plain_addrs
        if shape.f16:
            core.buffer_addresses(inbuf.view(np.uint16), outbuf.view(np.uint16), a)
        else:
            core.buffer_addresses(inbuf, outbuf, a)
        r = core.lane_once(
            self.mem, self.prog, self.arena, self.b, shape.fields, a, generation, priority, 1,
            _NOW_NS, spin_ns,
        )  # fmt: skip
        if r < 0:
            return -1
        if r != 2:
            self.pending = a[6] != 0
            self._now_at = a
            if shape.work:  # its WORK buffer goes with the op (``adopt``)
                self._now_keep = shape.spare[0]  # type: ignore[index]
                shape.spare = None
        return r

    def adopt(self, spec: OpSpec, slot: int = -1, seq: int = 0) -> LaneOp:
        """The lane op of what :meth:`now` entered and did not end (``slot`` -1), or of
        what compiled code entered in ``slot`` (submission ``seq``) and did not end."""
        if slot < 0:
            a = self._now_at
            slot, seq = int(a[4]), int(a[5])
        lop = lane_op(spec, slot, seq, self._now_keep)
        self._now_keep = None
        self.ops[slot] = lop
        self.by_key.put(spec.wire_id, spec.generation, lop)
        return lop

    def _fields_of(self, spec: OpSpec, plan: int, f: np.ndarray) -> np.ndarray:
        g = spec.group
        f[0] = _signed(spec.wire_id)
        f[1] = spec.generation
        f[2] = int(spec.dtype)
        f[3] = int(spec.kind)
        f[4] = int(spec.algorithm)
        f[5] = int(spec.op)
        f[6] = spec.count
        f[7] = spec.param
        f[8] = _signed(spec.context)
        f[9] = spec.priority
        f[10] = plan
        f[11] = self._group(g)
        f[12] = len(g)
        f[13] = g.index(self.rank) if self.rank in g else -1
        f[14] = 1 if spec.urgent else 0
        f[15] = 1 if spec.passive else 0
        return f

    def _enter(
        self, spec: OpSpec, f: np.ndarray, work_count: int, shape: LaneShape | None
    ) -> LaneOp | None:
        inbuf = spec.inbuf
        keep: Any = None
        pooled = _NO_POOLED  # buffers from the pool, back to it when the op ends (a list then)
        copy_in = (spec.in_place and spec.schedule.reads_input) if shape is None else shape.copy_in
        if copy_in:
            if inbuf.nbytes >= _POOLED_BYTES:  # a large op in place: no fresh pages each time
                raw = self._take(inbuf.nbytes)
                pooled = [raw]
                copy = raw.view(inbuf.dtype).reshape(inbuf.shape)
                np.copyto(copy, inbuf)
                inbuf = copy
            else:
                inbuf = inbuf.copy()
            keep = inbuf
        work = None
        if work_count:  # the schedule's WORK buffer (a reduce-scatter's is the whole count)
            nbytes = work_count * spec.dtype.itemsize
            if nbytes >= _POOLED_BYTES:
                raw = self._take(nbytes)
                pooled = [*pooled, raw]
                work = raw.view(spec.dtype.numpy)
            else:
                work = np.empty(work_count, dtype=spec.dtype.numpy)
            keep = (keep, work)
        a = self._addrs
        if spec.dtype is DType.FLOAT16:
            core.buffer_addresses(inbuf.view(np.uint16), spec.outbuf.view(np.uint16), a)
        else:
            core.buffer_addresses(inbuf, spec.outbuf, a)
        a[2] = 0 if work is None else work.__array_interface__["data"][0]
        mem = self.mem
        prog = self.prog
        nscr = int(prog[f[10] + L.PL_SCR]) if shape is None else shape.scratch
        a[3] = 0
        if nscr:
            scratch = self._take(nscr)
            pooled = [*pooled, scratch]
            a[3] = scratch.__array_interface__["data"][0]
        slot, seq, self.pending = core.lane_enter(
            mem, prog, self.arena, self.b, f, a, spec.generation, spec.priority,
            1 if spec.urgent else 0,
        )  # fmt: skip
        if slot < 0:
            for raw in pooled:
                self._give(raw)
            return None
        lop = lane_op(spec, slot, seq, keep)
        if pooled:
            lop.pooled = pooled
        self.ops[slot] = lop
        self.by_key.put(spec.wire_id, spec.generation, lop)
        return lop

    def need_after(self, need_after_s: float) -> None:
        """How long a thread waits for an op before it asks the ranks the op still expects
        frames from to raise it (``Config.need_after_s``): NEED frames, which a rank that
        has not submitted the op yet keeps (``lane_receive._needed``)."""
        self.mem[L.C_NEED_NS] = int(need_after_s * 1e9)

    def naps(self, nap_s: float) -> None:
        """How a thread waiting in the lane's compiled passes for a large op whose peers
        are silent waits (``Config.nap_s``): sleeps of ``nap_s`` between polls, or (0)
        yields its core between them (``lane_core._drive``)."""
        self.mem[L.C_NAP_NS] = int(nap_s * 1e9)

    def pump(self) -> int:
        """One compiled pass (receive, send, return credit)."""
        return int(core.lane_pass(self.mem, self.prog, self.arena, self.b, 64))

    def watch_outer(self, at: int, stride: int, n: int, seen: int, flag: int) -> None:
        """Words outside the lane that end a waiter's drive when they move (a waiter that
        asks: :meth:`wait`'s ``outer``): the sum of ``n`` int64 words ``stride`` bytes
        apart from address ``at`` differs from the int64 at address ``seen``, or the
        int64 at address ``flag`` is not 0.  A node service's arena thread drives its
        ops among the nodes so, and is back at its clients' rings as soon as one writes
        there.  The memory must outlive every such wait; ``n`` 0 watches nothing."""
        if n < 0 or (n > 0 and not (at and seen and flag and stride > 0)):
            raise ValueError(f"outer words: at={at} stride={stride} n={n} seen={seen} flag={flag}")
        mem = self.mem
        mem[L.C_OUTER_AT], mem[L.C_OUTER_STRIDE] = at, stride
        mem[L.C_OUTER_SEEN], mem[L.C_OUTER_FLAG] = seen, flag
        mem[L.C_OUTER_N] = n

    def wait(self, lop: LaneOp, max_s: float, spin_s: float, outer: bool = False) -> bool:
        """Drive passes until ``lop`` ended or something needs Python; True if it ended.
        ``outer``: also until the outer words moved (:attr:`outer_moved` says so)."""
        r = core.lane_drive(
            self.mem, self.prog, self.arena, self.b, lop.slot, lop.seq,
            int(max_s * 1e9), int(spin_s * 1e9), core.DRIVE_OUTER if outer else 0,
        )  # fmt: skip
        self.outer_moved = r == core.OUTER
        return r == 1

    def wait_own(self, lop: LaneOp, max_ns: int, spin_ns: int, outer: bool = False) -> bool:
        """:meth:`wait`, then the op taken out (``lane_core.lane_own``), in one compiled
        call: True when ``lop`` ended well as the one op done (it left the table then);
        False, nothing taken, when it did not end, or something else waits for Python."""
        slot = lop.slot
        if self.ops.get(slot) is not lop:
            return False
        take = core.DRIVE_TAKE | (core.DRIVE_OUTER if outer else 0)
        r = core.lane_drive(
            self.mem, self.prog, self.arena, self.b, slot, lop.seq, max_ns, spin_ns, take
        )
        self.outer_moved = r == core.OUTER
        if r != 2:
            return False
        del self.ops[slot]
        spec = lop.spec
        self.by_key.drop(spec.wire_id, spec.generation)
        if lop.pooled:
            for raw in lop.pooled:
                self._give(raw)
            lop.pooled = _NO_POOLED
        return True

    def drive(self, max_s: float, spin_s: float) -> bool:
        """The comm thread's compiled passes without the interpreter lock (see
        ``lane_core.lane_drive``); True when something needs Python.  The caller clears
        ``C_KICK`` before it checks its own queues, so a kick after the check is seen."""
        return bool(
            core.lane_drive(
                self.mem, self.prog, self.arena, self.b, -1, 0,
                int(max_s * 1e9), int(spin_s * 1e9), 0,
            )
        )  # fmt: skip

    def control(
        self,
        dest: int,
        ftype: int,
        shape: tuple[int, ...],
        key: tuple[int, int],
        aux: int,
        step: int,
        segment: int,
        body: bytes,
    ) -> bool:
        """Write a control frame (ERROR to JOIN) for ``dest`` into the lane's outbox; the
        next pass (or :meth:`flush`) sends it.  False when no send buffer is free now."""
        if len(body) > L.MAX_CONTROL_BODY:
            raise ValueError(f"a control frame's body of {len(body)} bytes")
        dt, kind, algo, op, count, param, ctx = shape
        f = self._ctl_fields
        f[:] = (ftype, dt, kind, algo, op, 0, aux, step, segment, 0,
                _signed(key[0]), _signed(key[1]), count, param, _signed(ctx))  # fmt: skip
        raw = np.frombuffer(body, dtype=np.uint8) if body else _NO_BODY
        return bool(core.control_frame(self.mem, self.arena, self.b, dest, f, raw, len(body)))

    def flush(self) -> None:
        """Send every outbox with frames now (the control frames Python wrote)."""
        core.flush_all(self.mem, self.arena, self.b)

    def kick(self) -> None:
        """Bring the comm thread back from :meth:`drive` (any thread; no lock needed)."""
        self.mem[L.C_KICK] = 1

    def state(self, lop: LaneOp) -> int:
        o = self.mem[L.C_OPS] + lop.slot * L.O_N
        if self.mem[o + L.O_SEQ] != lop.seq:
            return L.S_FREE
        return int(self.mem[o + L.O_STATE])

    def take_events(self) -> list[tuple[int, int, int, int, int, bytes]]:
        """Events queued by compiled code since the last call (type, slot, source, a, b,
        frame header bytes; a control frame's, ``EV_CONTROL``, followed by its body)."""
        mem = self.mem
        n = int(mem[L.C_NEV])
        if n == 0:
            return []
        out = []
        q = int(mem[L.C_EVQ])
        evb = int(mem[L.C_A_EVB])
        ctlb = int(mem[L.C_CTLB])
        for i in range(n):
            e = q + i * L.E_N
            raw = bytes(self.arena[evb + i * L.FRAME_SIZE : evb + (i + 1) * L.FRAME_SIZE])
            if mem[e + L.E_TYPE] == L.EV_CONTROL:  # the frame, then its body
                at = ctlb + int(mem[e + L.E_A])
                raw += bytes(self.arena[at : at + int(mem[e + L.E_B])])
            out.append(
                (
                    int(mem[e + L.E_TYPE]), int(mem[e + L.E_SLOT]), int(mem[e + L.E_SOURCE]),
                    int(mem[e + L.E_A]), int(mem[e + L.E_B]), raw,
                )
            )  # fmt: skip
        mem[L.C_NEV] = 0
        mem[L.C_NCTL] = 0
        mem[L.C_CTLBLEN] = 0
        return out

    def take_done(self) -> list[tuple[LaneOp, bool]]:
        """Ops that left the table since the last call, and whether each succeeded; those of
        one call in priority order (highest first), so that their callbacks run in it."""
        mem = self.mem
        n = int(mem[L.C_NDONE])
        if n == 0:
            return []
        d = int(mem[L.C_DONEQ])
        slots = mem[d : d + n].tolist()
        mem[L.C_NDONE] = 0
        states = mem[L.C_OPS] + L.O_STATE
        ops, by_key = self.ops, self.by_key
        out = []
        for slot in slots:
            lop = ops.pop(slot, None)
            if lop is None:
                continue
            spec = lop.spec
            by_key.drop(spec.wire_id, spec.generation)
            ok = mem[states + slot * L.O_N] == L.S_DONE
            if not ok and mem[states - L.O_STATE + slot * L.O_N + L.O_NREQ]:
                # bodies still posted into its buffers: they live until those end
                self._orphans.append((lop.keep, lop.spec.inbuf, lop.spec.outbuf, lop.pooled))
            elif lop.pooled:
                for raw in lop.pooled:
                    self._give(raw)
            lop.pooled = _NO_POOLED
            out.append((lop, ok))
        if len(out) > 1:  # ops that ended in the same passes: the more urgent first
            out.sort(key=_by_priority)
        if self._orphans and not mem[L.C_ORPHANS]:
            for orphan in self._orphans:  # MPI let go of their buffers: free again
                for raw in orphan[3]:
                    self._give(raw)
            self._orphans.clear()
        return out

    def fail(self, lop: LaneOp) -> None:
        core.lane_fail(self.mem, self.prog, self.arena, lop.slot)

    def key_state(self, key: tuple[int, int]) -> int:
        """The lane's hash value for ``key``: a slot (>= 0), or one of the ``H_*`` marks."""
        return int(core.hash_value(self.mem, self.mem[L.C_HASH], _signed(key[0]), key[1]))

    def forget(self, key: tuple[int, int]) -> None:
        """Forget that ``key`` finished or failed here: its frames, should the key come
        again, are kept for the next op of that key instead of dropped as late."""
        e = core.hash_find(self.mem, self.mem[L.C_HASH], _signed(key[0]), key[1])
        if e >= 0 and self.mem[e + 2] in (L.H_DONE, L.H_FAILED):
            self.mem[e + 2] = L.H_TOMB

    def has_floating(self, key: tuple[int, int]) -> bool:
        return core.hash_value(self.mem, self.mem[L.C_FHASH], _signed(key[0]), key[1]) >= 0

    def drop_floating(self, key: tuple[int, int]) -> int:
        return int(core.lane_drop_floating(self.mem, _signed(key[0]), key[1]))

    def need_kernels(self, dtype: DType) -> None:
        """Put the kernels of ``dtype`` in the lane's table: compiled (or loaded from Numba's
        cache) the first time this process reduces that type (``kernels/raw_calls.py``)."""
        dt = int(dtype)
        if dt in self._kernel_types:
            return
        from ..kernels.raw_calls import addresses

        for kind, addr in addresses(dt).items():
            self.mem[int(self.mem[L.C_KTAB]) + kind * L.K_TYPES + dt] = addr
        self._kernel_types.add(dt)

    def drop_peer(self, peer: int) -> int:
        """``peer`` is bad: its messages are dropped from now on, and what it left
        floating here is freed; how many frames and announcements that was."""
        return int(core.lane_drop_peer(self.mem, peer))

    @property
    def floating_bytes(self) -> int:
        """Bytes held now for ops not submitted here (slots and announcements)."""
        return int(self.mem[L.C_FLOATBYTES])

    @property
    def floating_peak_bytes(self) -> int:
        """The most of those held at once."""
        return int(self.mem[L.C_FLOATPEAK])

    def remember_failed(self, key: tuple[int, int]) -> None:
        core.remember_failed(self.mem, _signed(key[0]), key[1])

    def set_urgent(self, lop: LaneOp) -> None:
        self.mem[self.mem[L.C_OPS] + lop.slot * L.O_N + L.O_URGENT] = 1

    def needs(self, lop: LaneOp, peer: int) -> bool:
        """Does the op still expect a frame from, or owe one to, world rank ``peer``?"""
        return peer in self.waiting_on(lop, sends=True)

    def waiting_on(self, lop: LaneOp, sends: bool = False) -> list[int]:
        """World ranks the op still expects frames from (and, with ``sends``, owes
        frames to)."""
        mem, prog = self.mem, self.prog
        o = int(mem[L.C_OPS]) + lop.slot * L.O_N
        plan = int(mem[o + L.O_PLAN])
        g0 = int(mem[o + L.O_GROUP])
        segcap = int(mem[L.C_SEGCAP])
        dyn = int(mem[L.C_DYN]) + lop.slot * L.D_N * segcap
        out = set()
        r0 = int(prog[plan + L.PL_RECVS])
        for q in range(int(prog[plan + L.PL_NR])):
            if mem[dyn + L.D_RS * segcap + q] in (L.RS_WAIT, L.RS_POSTED):
                out.add(int(prog[g0 + prog[r0 + q * L.G_N + L.G_PEER]]))
        if sends:
            s0 = int(prog[plan + L.PL_SENDS])
            for i in range(int(prog[plan + L.PL_NS])):
                if mem[dyn + L.D_SS * segcap + i] & 7 != L.SS_SENT:
                    out.add(int(prog[g0 + prog[s0 + i * L.G_N + L.G_PEER]]))
        return sorted(out)

    @property
    def inflight(self) -> int:
        """Ops in the lane that someone waits for: standing receives (a window's) wait as
        long as their peers like, and keep no thread polling."""
        return int(self.mem[L.C_INFLIGHT] - self.mem[L.C_PASSIVE])

    @property
    def passive(self) -> int:
        """Standing receives in the lane."""
        return int(self.mem[L.C_PASSIVE])

    @property
    def sends_busy(self) -> bool:
        return bool(self.mem[L.C_NSBBUSY] > 0) or bool(
            any(self.mem[self.mem[L.C_PEERS] + p * L.P_N + L.P_OUTLEN] for p in range(self.world))
        )

    @property
    def full(self) -> bool:
        """Compiled code waits for Python to :meth:`grow` the pool or the body requests."""
        return bool(self.mem[L.C_FULL]) or bool(self.mem[L.C_BFULL])

    def stats(self) -> dict[str, int]:
        m = self.mem
        return {
            "ops_in_flight": int(m[L.C_INFLIGHT]),
            "standing_receives": int(m[L.C_PASSIVE]),
            "ops_done": int(m[L.C_OPS_DONE]),
            "floating_frames": int(m[L.C_FLOATING]),
            "floating_bytes": int(m[L.C_FLOATBYTES]),
            "floating_peak_bytes": int(m[L.C_FLOATPEAK]),
            "announcements": int(m[L.C_ANNS]),
            "announcements_not_kept": int(m[L.C_ANNDROPS]),
            "needs_kept": int(m[L.C_NEEDS_KEPT]),
            "needs_used": int(m[L.C_NEEDS_USED]),
            "credit": int(m[L.C_CREDIT]),
            "pool_slots": int(m[L.C_NSLOTS]),
            "pool_peak_slots": int(m[L.C_PEAK]),
            "messages_sent": int(m[L.C_SENT_MSGS]),
            "frames_sent": int(m[L.C_SENT_FRAMES]),
            "messages_received": int(m[L.C_RECV_MSGS]),
            "bodies_sent": int(m[L.C_BODIES_SENT]),
            "bodies_received": int(m[L.C_BODIES_RECV]),
            "bodies_in_flight": int(m[L.C_NBREQ]),
            "receives_waiting": int(m[L.C_NPQ]),
            "body_request_slots": int(m[L.C_BREQCAP]),
        }

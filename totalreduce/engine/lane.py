"""The compiled lane's control plane: which ops it runs, its tables, its events.

The main loop (:mod:`.loop`) hands an op to the lane when the lane can run all of it
in compiled code (:meth:`Lane.plan_of` says which): an allreduce of an element type and
reduce operation the raw kernels know, by an algorithm whose schedule the lane runs, on
the MPI transport.  Small ones travel in eager segments; larger ones in segments whose
bodies go on tags of their own once the receiver posted the receive (rendezvous).  The decision depends only on the op's shape and the configuration,
so ranks that agree on an op agree on who runs it; ranks that disagree are caught
(a frame for an op the other side runs is an event, ``EV_FOREIGN``).

Python does here what is rare: compiling plans into ``prog`` once per shape, growing
the pool, turning events into errors with the same words the main loop uses, and
finishing completed ops' handles.  :mod:`.lane_core` does the rest.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from ..algorithms.codes import AlgorithmCode, OpKind
from ..algorithms.schedule import Action, LocalKind, Schedule, plan_segments
from ..dtypes import DType
from ..transport import mpi_native
from . import lane_core as core
from . import lane_layout as L
from .payload import OpSpec

log = logging.getLogger("totalreduce.engine")

#: The lane's tag on the transport's communicator (the main loop uses 1 and 16 up).
LANE_TAG = 3
#: Ops of at most this many eager segments (``micro_bytes``) are cut into eager segments
#: (frames with their bodies); larger ones into segments of ``segment_bytes`` or more
#: (see :func:`large_segment_bytes`), whose bodies above ``micro_bytes`` travel on tags
#: of their own once the receiver has posted the receive (rendezvous).
LANE_MAX_SEGMENTS = 8
#: Body sends in flight to one peer at most; ready ones wait in priority order.
LANE_BODY_CAP = 16
#: Largest segment of a large op in the lane (``segment_bytes`` if smaller): measured on
#: a 2-core machine at P=2, 4 MiB ring allreduces took 1.16 ms in 256 KiB segments with
#: 64 bodies in flight, 1.29-1.39 ms with 8-16, 1.59 ms in 1 MiB segments.
LANE_SEGMENT_BYTES = 256 << 10
#: Body tags per peer: a receive's tag is reused after this many later receives from the
#: same peer (the main loop's bodies use tags below the lane's).
LANE_BODY_SPAN = 1 << 20
#: Largest group the lane takes.
LANE_MAX_GROUP = 32
#: Most send (or receive) segments of one op in the lane: what the limits above allow
#: any rank of any of ``LANE_ALGORITHMS`` (a ring at 32 ranks: 16 + 2 * 32 at most).
SEGCAP = 128
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

#: The element types the lane reduces (``kernels/raw.py``); others stay with the main loop.
LANE_TYPES = frozenset(
    {DType.FLOAT32, DType.FLOAT64, DType.INT32, DType.INT64, DType.FLOAT16, DType.BFLOAT16}
)
_FLOAT_TYPES = frozenset({DType.FLOAT32, DType.FLOAT64, DType.FLOAT16, DType.BFLOAT16})


def large_segment_bytes(nbytes: int, group_size: int, segment_bytes: int, isz: int) -> int:
    """Segment size of a large op of ``nbytes`` per rank in a group of ``group_size``:
    ``segment_bytes``, or more where that would cut some rank's schedule into more than
    ``SEGCAP`` send or receive segments.  A function of the op's shape only, so every
    rank cuts alike.  The bound: no allreduce algorithm of the lane moves more than
    ``(2 + ceil(log2 P)) * nbytes`` from one rank in at most ``2 (P - 1)`` steps, and each
    region of a step gains at most one segment from rounding up."""
    logp = max(0, (group_size - 1).bit_length())
    spare = SEGCAP - 2 * max(1, group_size - 1) - 2
    seg = max(segment_bytes, -(-(2 + logp) * nbytes // max(1, spare)))
    return max(isz, seg - seg % isz)


#: In-place inputs of at least this many bytes are copied into pooled buffers.
_POOLED_BYTES = 64 << 10
#: Pooled buffers kept per size (a few large ops of one size in flight at once), and in all.
_POOLED_PER_SIZE = 4
_POOLED_MAX = 512 << 20
_NO_POOLED: list[np.ndarray] = []


def _signed(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


class LaneOp:
    """Python's record of an op in the lane: its spec, and what keeps its buffers alive."""

    __slots__ = (
        "spec", "key", "slot", "seq", "keep", "pooled", "t0", "probed", "warned", "have", "error",
    )  # fmt: skip

    def __init__(self, spec: OpSpec, slot: int, seq: int, keep: Any) -> None:
        self.spec = spec
        self.key = (spec.wire_id, spec.generation)
        self.slot = slot
        self.seq = seq
        self.keep = keep
        self.pooled = _NO_POOLED  # its scratch and input copy, from the lane's pool
        self.t0 = time.monotonic()
        self.probed = False
        self.warned = False
        self.have: set[int] = set()
        self.error: BaseException | None = None


class LaneShape:
    """The lane's fields of an op shape (all but generation, priority and urgency), kept by
    whoever submits that shape again and again (:meth:`Lane.shape_of`)."""

    __slots__ = ("fields", "copy_in", "work", "scratch")

    def __init__(self, fields: np.ndarray, copy_in: bool, work: int, scratch: int) -> None:
        self.fields = fields
        self.copy_in = copy_in  # in place, and the schedule reads the input after writing
        self.work = work  # elements of the schedule's WORK buffer each op needs (0: none)
        self.scratch = scratch  # bytes of scratch for its large receives (0: none)


class Lane:
    """The lane's arrays and the Python half of its protocol (the caller holds the
    main loop's lock for every method)."""

    def __init__(
        self,
        b: np.ndarray,
        rank: int,
        world: int,
        micro_bytes: int,
        *,
        ctl_tag: int = -1,
        nops: int = 1 << 14,
        pool_bytes: int = 32 << 20,
        nsb: int = 64,
        segment_bytes: int = 1 << 20,
        body_tag: int = -1,
    ) -> None:
        core.compile_all()  # here, not in a first op (cached on disk after the first time)
        self.b = b  # transport.mpi_native.binding of the transport's communicator
        self.rank = rank
        self.world = world
        self.micro = micro_bytes
        self.segment_bytes = segment_bytes
        #: First tag of the large segments' bodies; -1: this lane runs no large op.
        self.body_tag = body_tag
        hcap = 1
        while hcap < 2 * nops:
            hcap *= 2
        slot_bytes = L.FRAME_SIZE + ((micro_bytes + 7) & ~7)
        # The pool: its credited half holds early frames (within floating_pool_bytes, at
        # most 2048 slots to start with); bodies of submitted ops waiting for their turn
        # take the rest, and a pool that runs out grows.
        nslots = max(16, min(2048, pool_bytes // slot_bytes))
        outcap = L.MSG_SIZE + 4 * slot_bytes
        evcap = 1024
        stkcap = 1 << 17
        failcap = 4096
        rqcap = 1 << 16
        breqcap = 1 << 14
        sizes = [
            ("ops", nops * L.O_N),
            ("hash", hcap * 3),
            ("fhash", hcap * 3),
            ("dyn", nops * L.D_N * SEGCAP),
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
            ("defer", stkcap * 2),
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
        mem[L.C_CREDIT] = max(4, nslots // (2 * max(1, world - 1)))
        mem[L.C_MICRO] = micro_bytes
        mem[L.C_TAG] = LANE_TAG
        mem[L.C_SEGCAP] = SEGCAP
        mem[L.C_CTL_TAG] = ctl_tag
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
        # The arena: requests and status first, then outboxes, send buffers, landing,
        # event frames, and the pool's slots last (so the pool can grow in place).
        a = 0
        mem[L.C_A_REQ] = a
        a += nsb * 8
        mem[L.C_A_STATUS] = a
        a += mpi_native.STATUS_MAX
        mem[L.C_A_BREQ] = a
        a += breqcap * 8
        mem[L.C_A_BIDX] = a
        a += breqcap * 4
        mem[L.C_A_BST] = a
        a += breqcap * int(b[mpi_native.B_STATUS_BYTES])
        a = (a + 63) & ~63
        mem[L.C_A_MSG] = a
        a += 64
        mem[L.C_A_OUT] = a
        a += world * outcap
        mem[L.C_A_SB] = a
        a += nsb * outcap
        mem[L.C_A_LAND] = a
        a += outcap
        mem[L.C_A_EVB] = a
        a += evcap * L.FRAME_SIZE
        a = (a + 63) & ~63
        mem[L.C_A_SLOTS] = a
        a += nslots * slot_bytes
        self.mem = mem
        self.arena = np.zeros(a, dtype=np.uint8)
        self._old_arenas: list[np.ndarray] = []  # sends may still read them
        self.prog = np.zeros(1 << 16, dtype=np.int64)
        self._prog_len = 0
        self._plans: dict[tuple[int, int], tuple[Schedule, int]] = {}
        self._groups: dict[tuple[int, ...], int] = {}
        self.ops: dict[int, LaneOp] = {}  # slot -> op
        self.by_key: dict[tuple[int, int], LaneOp] = {}
        self._fields = np.zeros(16, dtype=np.int64)
        self._addrs = np.zeros(4, dtype=np.int64)
        #: Scratch and input copies of large ops, by size, for the next op of that size.
        self._pool: dict[int, list[np.ndarray]] = {}
        self._pooled_bytes = 0
        #: What failed ops with bodies still posted keep alive (until ``C_ORPHANS`` is 0).
        self._orphans: list[Any] = []

    # ------------------------------------------------------------------ eligibility

    def plan_of(self, spec: OpSpec) -> int:
        """The offset of the op's compiled plan in ``prog``, or -1 if the lane does not
        run it.

        The decision depends only on what every rank of the op agrees on (kind,
        algorithm, element type, count, reduce op, group size) and the configuration,
        never on this rank's own schedule: ranks that agree on an op always send its
        frames the same way."""
        if spec.kind is not OpKind.ALLREDUCE or spec.after is not None or spec.passive:
            return -1
        if spec.joined or spec.algorithm not in LANE_ALGORITHMS:
            return -1
        if len(spec.group) > LANE_MAX_GROUP:
            return -1
        dt = spec.dtype
        op = spec.op
        if dt not in LANE_TYPES:
            return -1
        if op.bitwise and dt in _FLOAT_TYPES:
            return -1
        isz = dt.itemsize
        nbytes = spec.count * isz
        seg = max(self.micro, 8)
        if nbytes > LANE_MAX_SEGMENTS * seg:
            if self.body_tag < 0:
                return -1
            seg = large_segment_bytes(
                nbytes, len(spec.group), min(self.segment_bytes, LANE_SEGMENT_BYTES), isz
            )
        sched = spec.schedule
        key = (id(sched), isz)
        hit = self._plans.get(key)
        if hit is not None and hit[0] is sched:
            return hit[1]
        at = self._compile(sched, isz, seg)
        if at < 0:  # the limits above promise a plan: a bug, not a routing choice
            raise RuntimeError(
                f"the compiled lane cannot run {spec.describe()} ({spec.algorithm.name.lower()}, "
                f"{spec.count} x {dt.name.lower()}, {len(spec.group)} ranks) although its "
                "limits admit it"
            )
        self._plans[key] = (sched, at)
        return at

    def _grow_prog(self, need: int) -> None:
        if self._prog_len + need > self.prog.size:
            bigger = np.zeros(max(2 * self.prog.size, self._prog_len + need), dtype=np.int64)
            bigger[: self._prog_len] = self.prog[: self._prog_len]
            self.prog = bigger

    def _compile(self, sched: Schedule, isz: int, seg_bytes: int) -> int:
        """Write the plan of ``sched`` (segments of at most ``seg_bytes``) into ``prog``;
        -1 if it uses what the lane does not run.  Receive segments above ``micro_bytes``
        get a place in the op's scratch."""
        if any(r.action not in (Action.COPY, Action.REDUCE)
               or (r.src is not None and r.action is not Action.REDUCE)
               for st in sched.steps for r in st.recvs):  # fmt: skip
            return -1
        locs = list(sched.prologue) + list(sched.epilogue)
        if any(lop.kind not in (LocalKind.COPY, LocalKind.AVERAGE) for lop in locs):
            return -1
        plan = plan_segments(sched, max(1, seg_bytes // isz))
        ns, nr = len(plan.sends), len(plan.recvs)
        if ns > SEGCAP or nr > SEGCAP:
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
            if r.region.count * isz > self.micro:
                if r.action is Action.COPY and r.src is None and not plan.recv_waits[q]:
                    # Nothing before it touches its elements, and whatever reads them
                    # waits for it: the body may land in place.
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
            if lop.src is not None:
                p[g + L.L_SBUF], p[g + L.L_SOFF] = int(lop.src.buffer), lop.src.offset * isz
            p[g + L.L_NBYTES] = lop.dst.count * isz
            p[g + L.L_DIV] = lop.divisor
        self._prog_len = l0 + len(locs) * L.L_N
        return at

    def _group(self, group: tuple[int, ...]) -> int:
        at = self._groups.get(group)
        if at is None:
            self._grow_prog(len(group))
            at = self._prog_len
            self.prog[at : at + len(group)] = group
            self._prog_len += len(group)
            self._groups[group] = at
        return at

    # ------------------------------------------------------------------ ops

    def submit(self, spec: OpSpec, plan: int, work: np.ndarray | None) -> LaneOp | None:
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
        )

    def enter(self, spec: OpSpec, shape: LaneShape) -> LaneOp | None:
        """Enter a repeat of the shape ``shape`` was made for (its generation, priority,
        urgency and buffers are this op's); None when the table is full."""
        f = shape.fields
        f[1] = spec.generation
        f[9] = spec.priority
        f[14] = 1 if spec.urgent else 0
        work = np.empty(shape.work, dtype=spec.dtype.numpy) if shape.work else None
        return self._enter(spec, f, work, shape)

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
        return f

    def _enter(
        self, spec: OpSpec, f: np.ndarray, work: np.ndarray | None, shape: LaneShape | None
    ) -> LaneOp | None:
        inbuf = spec.inbuf
        keep: Any = None
        pooled: list[np.ndarray] = []  # buffers from the pool, back to it when the op ends
        copy_in = (spec.in_place and spec.schedule.reads_input) if shape is None else shape.copy_in
        if copy_in:
            if inbuf.nbytes >= _POOLED_BYTES:  # a large op in place: no fresh pages each time
                raw = self._take(inbuf.nbytes)
                pooled.append(raw)
                copy = raw.view(inbuf.dtype).reshape(inbuf.shape)
                np.copyto(copy, inbuf)
                inbuf = copy
            else:
                inbuf = inbuf.copy()
            keep = inbuf
        if work is not None:
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
            pooled.append(scratch)
            a[3] = scratch.__array_interface__["data"][0]
        slot = core.lane_submit(mem, prog, self.arena, self.b, f, a)
        if slot < 0:
            for raw in pooled:
                self._give(raw)
            return None
        lop = LaneOp(spec, slot, int(mem[L.C_SEQ]), keep)  # the seq lane_submit just gave
        lop.pooled = pooled
        self.ops[slot] = lop
        self.by_key[lop.key] = lop
        return lop

    def pump(self) -> int:
        """One compiled pass (receive, send, return credit)."""
        return int(core.lane_pass(self.mem, self.prog, self.arena, self.b, 64))

    def wait(self, lop: LaneOp, max_s: float, spin_s: float) -> bool:
        """Drive passes until ``lop`` ended or something needs Python; True if it ended."""
        return bool(
            core.lane_wait(
                self.mem, self.prog, self.arena, self.b, lop.slot, lop.seq,
                int(max_s * 1e9), int(spin_s * 1e9),
            )
        )  # fmt: skip

    def drive(self, max_s: float, spin_s: float) -> bool:
        """The comm thread's compiled passes without the interpreter lock (see
        ``lane_core.lane_drive``); True when something needs Python.  The caller clears
        ``C_KICK`` before it checks its own queues, so a kick after the check is seen."""
        return bool(
            core.lane_drive(
                self.mem, self.prog, self.arena, self.b, int(max_s * 1e9), int(spin_s * 1e9)
            )
        )

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
        frame header bytes)."""
        mem = self.mem
        n = int(mem[L.C_NEV])
        if n == 0:
            return []
        out = []
        q = int(mem[L.C_EVQ])
        evb = int(mem[L.C_A_EVB])
        for i in range(n):
            e = q + i * L.E_N
            raw = bytes(self.arena[evb + i * L.FRAME_SIZE : evb + (i + 1) * L.FRAME_SIZE])
            out.append(
                (
                    int(mem[e + L.E_TYPE]), int(mem[e + L.E_SLOT]), int(mem[e + L.E_SOURCE]),
                    int(mem[e + L.E_A]), int(mem[e + L.E_B]), raw,
                )
            )  # fmt: skip
        mem[L.C_NEV] = 0
        return out

    def take_done(self) -> list[tuple[LaneOp, bool]]:
        """Ops that left the table since the last call, and whether each succeeded."""
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
            by_key.pop(lop.key, None)
            ok = mem[states + slot * L.O_N] == L.S_DONE
            if not ok and mem[states - L.O_STATE + slot * L.O_N + L.O_NREQ]:
                # bodies still posted into its buffers: they live until those end
                self._orphans.append((lop.keep, lop.spec.inbuf, lop.spec.outbuf, lop.pooled))
            elif lop.pooled:
                for raw in lop.pooled:
                    self._give(raw)
            lop.pooled = _NO_POOLED
            out.append((lop, ok))
        if self._orphans and not mem[L.C_ORPHANS]:
            self._orphans.clear()
        return out

    def _take(self, nbytes: int) -> np.ndarray:
        free = self._pool.get(nbytes)
        if free:
            self._pooled_bytes -= nbytes
            return free.pop()
        return np.empty(nbytes, dtype=np.uint8)

    def _give(self, raw: np.ndarray) -> None:
        free = self._pool.setdefault(raw.size, [])
        if len(free) < _POOLED_PER_SIZE and self._pooled_bytes + raw.size <= _POOLED_MAX:
            free.append(raw)
            self._pooled_bytes += raw.size

    def fail(self, lop: LaneOp) -> None:
        core.lane_fail(self.mem, self.prog, self.arena, lop.slot)

    def key_state(self, key: tuple[int, int]) -> int:
        """The lane's hash value for ``key``: a slot (>= 0), or one of the ``H_*`` marks."""
        return int(core.hash_value(self.mem, self.mem[L.C_HASH], _signed(key[0]), key[1]))

    def set_foreign(self, key: tuple[int, int], on: bool) -> None:
        """Mark ``key`` as an op the main loop runs (or no longer runs)."""
        wid = _signed(key[0])
        if on:
            core.hash_put(self.mem, self.mem[L.C_HASH], wid, key[1], L.H_FOREIGN)
        else:
            e = core.hash_find(self.mem, self.mem[L.C_HASH], wid, key[1])
            if e >= 0 and self.mem[e + 2] == L.H_FOREIGN:
                self.mem[e + 2] = L.H_TOMB

    def has_floating(self, key: tuple[int, int]) -> bool:
        return core.hash_value(self.mem, self.mem[L.C_FHASH], _signed(key[0]), key[1]) >= 0

    def drop_floating(self, key: tuple[int, int]) -> int:
        return int(core.lane_drop_floating(self.mem, _signed(key[0]), key[1]))

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

    def grow(self) -> None:
        """The pool is out of slots: double it (the old arena stays alive: sends posted
        from it may still read it)."""
        mem = self.mem
        old = int(mem[L.C_NSLOTS])
        slot_bytes = int(mem[L.C_SLOT])
        arena = np.zeros(int(mem[L.C_A_SLOTS]) + 2 * old * slot_bytes, dtype=np.uint8)
        arena[: self.arena.size] = self.arena
        self._old_arenas.append(self.arena)
        self.arena = arena
        meta = int(mem[L.C_META])
        free = int(mem[L.C_FREESLOT])
        # meta and the free stack live in mem with room for ``old`` slots: move both to
        # a larger mem.
        extra_meta = old * L.M_N
        extra_free = old
        end = mem.size
        bigger = np.zeros(end + 2 * old * L.M_N + 2 * old, dtype=np.int64)
        bigger[:end] = mem
        new_meta = end
        new_free = end + 2 * old * L.M_N
        bigger[new_meta : new_meta + old * L.M_N] = mem[meta : meta + old * L.M_N]
        nfree = int(mem[L.C_NFREE])
        bigger[new_free : new_free + nfree] = mem[free : free + nfree]
        bigger[new_free + nfree : new_free + nfree + old] = np.arange(2 * old - 1, old - 1, -1)
        bigger[L.C_META] = new_meta
        bigger[L.C_FREESLOT] = new_free
        bigger[L.C_NFREE] = nfree + old
        bigger[L.C_NSLOTS] = 2 * old
        del extra_meta, extra_free
        self.mem = bigger
        log.info("rank %d: the lane's pool grew to %d slots", self.rank, 2 * old)

    @property
    def inflight(self) -> int:
        return int(self.mem[L.C_INFLIGHT])

    @property
    def ctl_waiting(self) -> bool:
        return bool(self.mem[L.C_CTL_WAITING] > 0)

    @property
    def sends_busy(self) -> bool:
        return bool(self.mem[L.C_NSBBUSY] > 0) or bool(
            any(self.mem[self.mem[L.C_PEERS] + p * L.P_N + L.P_OUTLEN] for p in range(self.world))
        )

    @property
    def full(self) -> bool:
        return bool(self.mem[L.C_FULL])

    def stats(self) -> dict[str, int]:
        m = self.mem
        return {
            "ops_in_flight": int(m[L.C_INFLIGHT]),
            "ops_done": int(m[L.C_OPS_DONE]),
            "floating_frames": int(m[L.C_FLOATING]),
            "pool_slots": int(m[L.C_NSLOTS]),
            "pool_peak_slots": int(m[L.C_PEAK]),
            "messages_sent": int(m[L.C_SENT_MSGS]),
            "frames_sent": int(m[L.C_SENT_FRAMES]),
            "messages_received": int(m[L.C_RECV_MSGS]),
            "bodies_sent": int(m[L.C_BODIES_SENT]),
            "bodies_received": int(m[L.C_BODIES_RECV]),
            "bodies_in_flight": int(m[L.C_NBREQ]),
        }

"""The arena thread's ops among the nodes' services: starting them on the engine among
the services, all-to-alls as bytes between the nodes, and their errors in clients' terms.

:class:`AmongNodes` is a base of :class:`~.thin.ThinService`.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from ..algorithms.codes import AlgorithmCode, OpKind
from ..algorithms.rooted import offsets
from ..dtypes import DType, ReduceOp
from ..errors import OpMismatchError
from ..group import Group
from ..kernels import copy_into
from ..lane.payload import OpSpec
from ..service import express, tuning
from ..transport import arena as A
from . import arena_pass
from .thin_ops import (
    _A2A,
    _AG,
    _CLIENT_TERMS,
    _ENGINE_PREFIX,
    _ENGINE_RANK,
    _GOLDEN,
    _MASK,
    _RS,
    _Grp,
    _Mismatch,
    _Op,
    _Segments,
    _shape_text,
)

#: Mixed into an op's name among the services, times its segment's number plus one, to
#: name the segment (a segmented op: :class:`~.thin_ops._Segments`).
_SEGMENT_MIX = 0xC2B2_AE3D_27D4_EB4F
#: Mixed into a group's context (0: the world's) for its segmented ops' segments.
_SEGMENT_CONTEXT = 0x1656_67B1_9E37_79F9
_SEGMENTED = (int(OpKind.ALLREDUCE), int(OpKind.BROADCAST))
#: Mixed into a reduce-scatter's or all-gather's group context (0: the world's), times its
#: parts' digest, for its op among the services: services whose clients gave other parts
#: meet another context, and both fail (the per-node sums they run by may agree).
_PARTS_CONTEXT = 0x27D4_EB2F_1656_67C5
#: A group's kinds whose repeats run in the compiled loop (:mod:`.service_loop`).
_REPEATED = (int(OpKind.ALLREDUCE), int(OpKind.BROADCAST), int(OpKind.BARRIER))
#: A barrier's buffer.
_NO_DATA = np.empty(0, np.int64)


class GroupExpress(express.Express):
    """An express record of a group's op among the services: the engine's record, with the
    group's context (the engine keeps records of ops given no group only)."""

    __slots__ = ("context",)

    def __init__(self, spec: OpSpec, x: np.ndarray, sig: tuple[Any, ...], epoch: int) -> None:
        super().__init__(spec, x, sig, epoch)
        self.context = spec.context


def parts_word(parts: tuple[int, ...]) -> int:
    """:func:`.arena_pass.parts_digest` of ``parts`` (the same word, from Python)."""
    h = len(parts)
    for c in parts:
        h = ((h ^ c) * _GOLDEN) & _MASK
        h ^= (h >> 29) & 0x7FFF_FFFF
    return A.signed(h)


def group_start(
    svc: Any, ex: GroupExpress, name: int, x: np.ndarray, priority: int,
    out: np.ndarray | None = None,
) -> Any:  # fmt: skip
    """A repeat of a group's op ``ex`` on the services' engine ``svc``, in place on ``x``
    (``out`` None: into a new array, a reduce-scatter's or all-gather's; ``express.start``'s
    way, its spec with the group's context); None when anything unusual needs the whole
    way."""
    loop = svc.loop
    if svc._closed or loop.fatal is not None or loop.late_errors or ex.epoch != tuning.EPOCH[0]:
        return None
    if not -(1 << 31) <= priority < 1 << 31:
        return None
    o = np.empty(ex.out_count, ex.npdt) if out is None else out
    return express.submit_record(svc, ex, name, priority, x, o, o, ex.context)


class AmongNodes:
    """Ops among the nodes' services (a base of :class:`~.thin.ThinService`)."""

    engine: Any
    node: int
    nodes: int
    slots: int
    size: int
    arena: Any
    _segment_groups: dict[int, Group]
    pipe_min_bytes: int
    _on_arena_thread: Any
    _note_name: Any
    _loop_shape: Any

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

    def _engine_name(self, key: tuple[int, int, int]) -> int:
        """The name among the services of the op of ``key`` (wire id, generation, context):
        the client's wire id (its session is mixed in, unnamed ops' too), and the group's
        context for a group's (groups may share names)."""
        wire, _, ctx = key
        name = wire if not ctx else A.signed((wire ^ (ctx * _GOLDEN)) & _MASK)
        self._note_name(name)  # forgotten when the session ends
        return name

    def _among_nodes(
        self, op: _Op, kind: int, buf: np.ndarray | None, rop: ReduceOp, dt: DType,
        d: np.ndarray, parts: tuple[int, ...] | None,
    ) -> Any:  # fmt: skip
        if kind not in (_A2A, _RS, _AG):
            segs = self._segmented(op.key, op.grp, d) if buf is not None else None
            return self._engine_op(op.key, op.grp, kind, buf, rop, dt, d, segs)
        eng = self.engine
        g = op.grp
        name = self._engine_name(op.key)
        prio = int(d[A.D_PRIO])
        bf = "bfloat16" if dt is DType.BFLOAT16 else None
        grp = g.engine_group
        if kind != _A2A:
            assert parts is not None
            grp = self._parts_group(g, parts_word(parts))
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
        assert parts is not None and buf is not None
        per_node = [sum(parts[i] for i in m) for m in g.members]
        shape = self._group_shape(name, g, kind, buf, dt, d, parts)
        if shape is not None:  # a group's: a repeat starts from its record
            h = self._group_repeat(shape, buf, prio)
            if h is not None:
                return h
        if kind == _RS:
            h = eng.reduce_scatter_async(
                buf, name=name, op=rop, group=grp, counts=per_node, priority=prio, dtype=bf
            )
        else:
            h = eng.allgather_async(
                buf, name=name, group=grp, counts=per_node, priority=prio, dtype=bf
            )
        if shape is not None:
            self._group_remember(shape, buf, h, g)
        return h

    def _segmented(self, key: tuple[int, int, int], g: _Grp, d: np.ndarray) -> _Segments | None:
        """The segments among the services of the op of ``key`` over group ``g`` whose
        shape is descriptor ``d``'s (None: it runs whole): an allreduce or broadcast of
        at least :data:`~.arena_pass.PIPE_MIN_BYTES` over several nodes, on services of
        several clients (every service decides the same from the same shape; the
        compiled pass by :func:`~.arena_pass.pipelined`)."""
        kind = int(d[A.D_KIND])
        if kind not in _SEGMENTED or self.slots < 2 or len(g.nodes) < 2:
            return None
        count = int(d[A.D_COUNT])
        if count * DType(int(d[A.D_DTYPE])).numpy.itemsize < self.pipe_min_bytes:
            return None
        name = self._engine_name(key)
        n = arena_pass.SEGMENTS
        names = [name] + [A.signed((name ^ (i * _SEGMENT_MIX)) & _MASK) for i in range(1, n)]
        for x in names[1:]:
            self._note_name(x)
        ranges = [(i * count // n, (i + 1) * count // n) for i in range(n)]
        return _Segments(self.engine, names, ranges)

    def _parts_group(self, g: _Grp, digest: int) -> Group:
        """The services' group a reduce-scatter or all-gather over ``g`` whose parts'
        digest is ``digest`` runs over: ``g``'s nodes, its context mixed with the digest
        (the per-node sums the services run by may agree where parts differ)."""
        key = (g.ctx, digest)
        groups = self.__dict__.setdefault("_parts_groups", {})
        group = groups.get(key)
        if group is None:
            if len(groups) >= 4096:
                groups.clear()
            group = groups[key] = Group(g.nodes)
            group.context = ((g.ctx ^ (digest * _PARTS_CONTEXT)) & _MASK) or 1
        return group  # type: ignore[no-any-return]

    def _segment_group(self, g: _Grp) -> Group:
        """The services' group a segmented op's segments run over: ``g``'s nodes, with a
        context no client's group has (its own, mixed)."""
        group = self._segment_groups.get(g.ctx)
        if group is None:
            group = self._segment_groups[g.ctx] = Group(g.nodes)
            group.context = (g.ctx ^ _SEGMENT_CONTEXT) & _MASK
        return group

    def _engine_op(
        self, key: tuple[int, int, int], g: _Grp, kind: int, buf: np.ndarray | None,
        rop: ReduceOp, dt: DType, d: np.ndarray, segs: _Segments | None = None,
    ) -> Any:  # fmt: skip
        """Start an allreduce, broadcast or barrier among the services: the op of ``key``,
        over the nodes of group ``g``, its node's part in ``buf`` (None for a barrier).

        With ``segs`` (:meth:`_segmented`'s, which the caller asked once) it returns
        that :class:`~.thin_ops._Segments`, its first segments started (its ``local`` and
        ``back``, if set, make each one's node's part just before it starts, and hand
        its result back once it ended, so the node's work overlaps the nodes' step)."""
        eng = self.engine
        name = self._engine_name(key)
        prio = int(d[A.D_PRIO])
        bf = "bfloat16" if dt is DType.BFLOAT16 else None
        grp = g.engine_group
        code = int(d[A.D_ALGO])
        algo = AlgorithmCode(code).name.lower() if code else "auto"
        shape = self._group_shape(name, g, kind, buf, dt, d) if segs is None else None
        if shape is not None:  # a group's whole op: a repeat starts from its record
            h = self._group_repeat(shape, _NO_DATA if buf is None else buf, prio)
            if h is not None:
                return h
        if kind == int(OpKind.BARRIER):
            h = eng.barrier_async(name=name, priority=prio, group=grp, algorithm=algo)
            if shape is not None:
                self._group_remember(shape, _NO_DATA, h, g)
            return h
        assert buf is not None
        root = 0
        if kind == int(OpKind.BROADCAST):
            root = g.nodes.index(g.ranks[int(d[A.D_ROOT])] // self.slots)

        def start(name: int, x: np.ndarray, grp: Group | None) -> Any:
            if kind == int(OpKind.ALLREDUCE):
                return eng.allreduce_async(
                    x, name=name, op=rop, out=x, priority=prio, dtype=bf, group=grp,
                    algorithm=algo,
                )  # fmt: skip
            return eng.broadcast_async(
                x, root=root, name=name, out=x, priority=prio, dtype=bf, group=grp,
                algorithm=algo,
            )  # fmt: skip

        if segs is None:
            h = start(name, buf, grp)
            if shape is not None:
                self._group_remember(shape, buf, h, g)
            return h
        sgrp = self._segment_group(g)
        ranges, names, s = segs.ranges, segs.names, segs
        s.start = lambda i: start(names[i], buf[ranges[i][0] : ranges[i][1]], sgrp)
        s.on_segment = lambda i: self._on_arena_thread(lambda: self._segment_ended(s, i), False)
        self._start_segments(segs)
        return segs

    # ------------------------------------------------------------------ a group's repeats

    def _group_shape(
        self, name: int, g: _Grp, kind: int, buf: np.ndarray | None, dt: DType, d: np.ndarray,
        parts: tuple[int, ...] | None = None,
    ) -> tuple[int, ...] | None:  # fmt: skip
        """The shape of a group's whole allreduce, broadcast, barrier, reduce-scatter or
        all-gather among the nodes (its name among the services, dtype, count, reduce op,
        algorithm, node buffer's offset or the parts' digest, kind, a broadcast's root in
        the group), as the compiled loop's rows key it (``service_loop._row_for``); None for
        the world's (the pass's own), an algorithm named, an unnamed op, or a bfloat16 one but
        a broadcast.  (A reduce-scatter's or all-gather's node's part lies in node order
        where the group's order interleaves the nodes, in the loop as here.)"""
        if not g.ctx or int(d[A.D_ALGO]) or int(d[A.D_FLAGS]) & A.F_UNNAMED:
            return None
        if dt is DType.BFLOAT16 and kind != int(OpKind.BROADCAST):
            return None
        if kind in (_RS, _AG):
            if parts is None:
                return None
            return (name, int(d[A.D_DTYPE]), int(d[A.D_COUNT]), int(d[A.D_OP]), 0,
                    parts_word(parts), kind, 0)  # fmt: skip
        if kind not in _REPEATED:
            return None
        at = -1 if buf is None else self.arena.offset_of(buf)
        if buf is not None and at < 0:
            return None
        root = int(d[A.D_ROOT]) if kind == int(OpKind.BROADCAST) else 0
        return (name, int(d[A.D_DTYPE]), int(d[A.D_COUNT]), int(d[A.D_OP]), 0, at, kind, root)

    def _group_records(self) -> dict[tuple[int, ...], Any]:
        records = self.__dict__.get("_group_express")
        if records is None:
            records = self.__dict__["_group_express"] = {}
        return records

    def _group_remember(self, shape: tuple[int, ...], buf: np.ndarray, h: Any, g: _Grp) -> None:
        """After a group's whole op among the nodes (its handle ``h``, just started): the
        engine's express record of it, with its group's context, for its repeats (the
        engine keeps none for an op given a group)."""
        spec = getattr(h, "_spec", None)  # (None: it ended already; the next one)
        if spec is None or not spec.context or spec.kind.value != shape[6]:
            return
        sig = (spec.kind.name.lower(), spec.dtype.name.lower(), int(buf.size),
               spec.op.name.lower(), spec.param)  # fmt: skip
        if shape[6] == _AG:  # (``allgather_async``'s signature)
            sig = ("allgather", spec.dtype.name.lower(), -1, "sum", 0)
        ex = GroupExpress(spec, buf, sig, tuning.EPOCH[0])
        records = self._group_records()
        if len(records) >= express.MAX_RECORDS:
            records.clear()
        records[shape] = ex

    def _group_repeat(self, shape: tuple[int, ...], buf: np.ndarray, prio: int) -> Any:
        """Start a repeat of a group's whole op of ``shape`` from its record (None: it has
        none, or the engine wants the whole way); once the lane has its fields, the
        compiled loop has a row for its later repeats (``PassOps._loop_shape``)."""
        ex = self._group_records().get(shape)
        if ex is None or ex.npdt is not buf.dtype or ex.shape != buf.shape:
            return None
        out = None if shape[6] in (_RS, _AG) else buf  # (a new array: the parts' result)
        h = group_start(self.engine, ex, shape[0], buf, prio, out)
        if h is not None:
            self._loop_shape(shape, buf, ex)
        return h

    def _start_segments(self, segs: _Segments) -> None:
        """Start ``segs``'s next segments, while fewer than ``IN_FLIGHT`` run (the first
        one's failure to start raises: nothing started)."""
        while len(segs.handles) < len(segs.names) and segs.running < segs.IN_FLIGHT:
            i = len(segs.handles)
            if segs.failed:
                segs.skip_rest()
                return
            try:
                if segs.local is not None:
                    segs.local(*segs.ranges[i])
                if i:
                    self.engine.start_name_at(segs.names[i], segs.generation)
                assert segs.start is not None
                h = segs.start(i)
            except Exception as exc:
                if not i:
                    raise
                segs.skip_rest(exc)
                return
            segs.add(h)

    def _segment_ended(self, segs: _Segments, i: int) -> None:
        """Segment ``i`` of ``segs`` ended among the nodes (on the arena thread): its
        result back, the next one started."""
        if segs.back is not None and not segs.failed:
            segs.back(i)
        self._start_segments(segs)

    def _among_nodes_text(
        self, error: BaseException, h: Any = None, d: Any = None, ctx: int = 0
    ) -> str:
        """The engine's error among the services, told in the clients' terms: the op is
        named by the client, and a service's rank is its node's ranks.  Where nodes
        disagree about an op (of shape ``d``, its group's context ``ctx``) that one of
        them cut into segments (``h``, here), the text says so: the engine speaks of a
        part, or of the parts' group."""
        text, _, told = _ENGINE_PREFIX.sub("", str(error), count=1).partition(_CLIENT_TERMS)
        if d is not None and isinstance(error, OpMismatchError):
            how = f"ops of {self.pipe_min_bytes} bytes or more are"
            if isinstance(h, _Segments):
                text = (
                    f"the nodes disagree about it: node {self.node} cut its {_shape_text(d)} "
                    f"into {len(h.ranges)} parts among the nodes ({how}), and another node's "
                    f"op differs in count, dtype or kind: {text}"
                )
            elif int(d[A.D_KIND]) in (_RS, _AG):
                at = int(d[A.D_AUX])
                parts = tuple(int(c) for c in self.arena.view(
                    at + 8, int(self.arena.view(at, 1, np.int64)[0]), np.int64))  # fmt: skip
                mine = ((ctx ^ (parts_word(parts) * _PARTS_CONTEXT)) & _MASK) or 1
                if f"{mine:#x}" in text:  # the parts' context: the parts differ
                    text = (
                        f"the nodes disagree about its parts: node {self.node} has "
                        f"{_shape_text(d, parts)}, another node has other parts (whatever their "
                        f"sums per node); {text}"
                    )
            elif f"{(ctx ^ _SEGMENT_CONTEXT) & _MASK:#x}" in text:
                text = (
                    f"the nodes disagree about it: node {self.node} runs its {_shape_text(d)} "
                    f"whole among the nodes, and another node cut its op into parts ({how}): "
                    f"their count, dtype or kind differ; {text}"
                )

        def node(m: re.Match[str]) -> str:
            n = int(m.group(1))
            if n >= self.nodes:
                return m.group(0)
            lo, hi = n * self.slots, n * self.slots + self.slots - 1
            return f"node {n} (rank {lo})" if lo == hi else f"node {n} (ranks {lo}..{hi})"

        return _ENGINE_RANK.sub(node, text) + told

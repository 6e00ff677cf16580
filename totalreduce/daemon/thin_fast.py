"""The arena thread's side of its compiled pass (:mod:`.arena_pass`): taking what the
pass took, handing Python the ops it must see, and the pass's ops among the nodes
(started on the services' engine, segment by segment for a segmented one, and finished
when they end there).

:class:`PassOps` is a base of :class:`~.thin.ThinService`.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from ..algorithms.codes import AlgorithmCode, OpKind
from ..dtypes import DType, ReduceOp
from ..lane.lane_core import DRIVE_OUTER, DRIVE_TAKE
from ..service import express, tuning
from ..transport import arena as A
from ..transport.meeting import wake_client
from . import arena_pass, service_loop
from . import service_loop as SL
from .thin_nodes import GroupExpress, group_start
from .thin_ops import _SESSION, _error_kind, _Grp, _Op, _Segments, ended_of

log = logging.getLogger("totalreduce.daemon")

_ALLREDUCE, _BROADCAST, _BARRIER = int(OpKind.ALLREDUCE), int(OpKind.BROADCAST), int(OpKind.BARRIER)
_RS, _AG = int(OpKind.REDUCE_SCATTER), int(OpKind.ALLGATHER)
#: The kinds whose repeats start from the engine's express record, and run in the compiled
#: loop once the lane has their fields (:mod:`.service_loop`): the pass's kinds.
_REPEATED = (_ALLREDUCE, _BROADCAST, _BARRIER, _RS, _AG)
#: Of those, the kinds whose node's part and result have buffers of their own (not a
#: client's output): the pass's reduce-scatters and all-gathers among the nodes.
_PARTED = (_RS, _AG)
#: A barrier's buffer, and its name's signature among the services (``OpSubmitter._simple``'s).
_NO_DATA = np.empty(0, np.int64)
_BARRIER_SIG = ("barrier", "int64", 0, "sum", 0)
#: The compiled loop's span (it returns to Python at least this often), its spin after
#: its last work (as the arena thread's Python spins, ``thin.SPIN_S``), and the shortest
#: first try of an op in the lane (a drive of ``thin.DRIVE_S``, as the Python path drives
#: an op among the nodes between looks at the rings: a client's descriptor or another
#: thread's kick ends it sooner).
LOOP_NS, LOOP_SPIN_NS, LOOP_TRY_NS = 1_000_000, 50_000, 1_000_000


class PassOps:
    """The compiled pass's ops (a base of :class:`~.thin.ThinService`)."""

    arena: Any
    engine: Any
    slots: int
    size: int
    nodes: int
    _fast: arena_pass.Table
    _mem: np.ndarray
    _efd: list[int | None]
    _ctl_at: list[int]
    _inc: list[int]
    _world: _Grp
    node: int
    _thread: threading.Thread
    _running: dict[tuple[int, int, int], _Op]
    _fast_running: dict[int, list[Any]]
    _fast_tokens: int
    #: The engine's express record of each whole op among the nodes the pass started,
    #: with the view of its node buffer (a reduce-scatter's or all-gather's: its first
    #: one, for its type and size), by (wire id, dtype, count, reduce op, algorithm, node
    #: buffer's offset or parts' digest, kind, root): a repeat starts from them
    #: (:meth:`_fast_repeat`)
    _fast_shapes: dict[tuple[int, ...], tuple[np.ndarray, Any]]
    _fast_ended: deque[Callable[[], None]]
    #: The compiled loop's shapes and the engine's side of it (None: off,
    #: :mod:`.service_loop`)
    _loop_shapes: service_loop.Shapes | None
    _repeats: Any
    _take: Any
    _fail: Any
    _finish: Any
    _forget_unnamed: Any
    _segmented: Any
    _engine_op: Any
    _among_nodes_text: Any
    _engine_name: Any
    _kick: Any
    _is_session: Any
    _session_start: Any
    _group_of: Any
    _parts_group: Any

    def _drain(self, spin: bool = False) -> bool:
        """Take what the clients submitted: the compiled pass takes and runs the common
        ops (on several nodes, the compiled loop runs the repeats it has rows for to their
        end, and with ``spin`` waits ``LOOP_SPIN_NS`` for more: :meth:`_loop_run`); what
        they hand over (arena_pass.py says what) Python takes in order."""
        fast = self._fast
        first = 0
        shapes = self._loop_shapes
        if (
            shapes is not None
            and shapes.kept
            and not self._fast_running
            and shapes.epoch == tuning.EPOCH[0]
            and self._repeats.begin()
        ):
            taken, first = self._loop_run(spin)
            if not taken:
                return False
        elif not arena_pass.arena_pass(fast.buf, fast.lay, self._mem, self.arena.base):
            return False
        st = fast.st
        self._wake_sleepers()
        self._take_queued()
        for i in range(first, int(st[arena_pass.S_NSTART])):
            self._fast_start(int(fast.starts[i]))
        return True

    def _loop_run(self, spin: bool) -> tuple[int, int]:
        """The compiled loop (:func:`.service_loop.service_pass`), the engine's lock held
        (``_repeats.begin()`` took it; given back here): then the names' generations and
        the engine's records of the repeats it ran, and the handle of one it entered and
        did not end.  (descriptors taken, the first of the pass's starts left to Python)"""
        rep = self._repeats
        shapes = self._loop_shapes
        assert shapes is not None
        io, fast = shapes.io, self._fast
        names = self.engine._names
        adopted = None
        try:
            if names.version != shapes.names_seen:  # generations taken by Python since
                shapes.names_seen = names.version
                for n, (wire, _) in shapes.named.items():
                    shapes.names[n, SL.N_GEN] = names.next_generation(wire)
            mem, prog, larena, b = rep.lane_arrays()
            io[SL.IO_MAX_NS] = LOOP_NS
            io[SL.IO_SPIN_NS] = LOOP_SPIN_NS if spin else 0
            io[SL.IO_LSPIN_NS] = rep.spin_ns()
            io[SL.IO_TRY_NS] = LOOP_TRY_NS
            io[SL.IO_TAKE] = DRIVE_TAKE | DRIVE_OUTER  # a client's descriptor ends a drive
            service_loop.service_pass(
                fast.buf, fast.lay, self._mem, self.arena.base, shapes.rows, shapes.names,
                shapes.fields, mem, prog, larena, b, shapes.addrs, io,
            )  # fmt: skip
            for j in range(int(io[SL.IO_NTOUCHED])):
                n = int(io[SL.IO_TOUCHED + j])
                k, first = int(shapes.names[n, SL.N_DONE]), int(shapes.names[n, SL.N_FIRST])
                shapes.names[n, SL.N_DONE] = 0
                wire, ex = shapes.named[n]
                if not names.advance(wire, first, k):
                    log.error("the compiled loop ran %d repeats of %d from generation %d, "
                              "which its name had not", k, wire, first)  # fmt: skip
                rep.ended(wire, ex.wid, first, k, ex.group)
            if io[SL.IO_WHY] == SL.WHY_ADOPT:  # entered, not ended in its try
                r, gen = int(io[SL.IO_ROW]), int(io[SL.IO_GEN])
                wire, buf, ex, own, out = shapes.kept[r]
                names.advance(wire, gen, 1, 1)
                h = rep.adopt(ex, wire, gen, buf, int(io[SL.IO_PRIO]), int(io[SL.IO_SLOT]),
                              int(io[SL.IO_SEQ]), own, out)  # fmt: skip
                self._fast_tokens += 1
                adopted = (self._fast_tokens, int(io[SL.IO_ENTRY]), h)
                self._fast_running[adopted[0]] = [adopted[1], h, None]
            rep.settle()
        finally:
            rep.end()
        if adopted is not None:
            token, h = adopted[0], adopted[2]
            h.add_done_callback(lambda h: self._on_arena_thread(lambda: self._fast_end(token, h)))
        return int(io[SL.IO_TAKEN]), int(io[SL.IO_FIRST])

    def _wake_sleepers(self) -> None:
        fast = self._fast
        for i in range(int(fast.st[arena_pass.S_NSIG])):
            wake_client(self._ctl_at[int(fast.sig[i])])

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
            left = arena_pass.arena_eject(fast.buf, fast.lay, before)
            self._take_queued()
            if not left:
                return

    # ------------------------------------------------------------------ the pass's ops
    # among the nodes

    def _entry_op(self, e: int) -> _Op:
        """Python's _Op of the pass's entry ``e`` (complete here: its local part done), over
        the world or its group."""
        fast = self._fast
        ctx, grp = int(fast.descs[e, 0, A.D_CTX]), self._world
        if ctx:
            k = int(fast.order[e, 0])
            grp = self._group_of(k, fast.descs[e, k])[0] or grp
        op = _Op((int(fast.keys[e, 0]), int(fast.keys[e, 1]), ctx), self.slots, grp)
        for i in range(int(fast.seen[e])):
            k = int(fast.order[e, i])
            op.descs[k] = fast.descs[e, k].copy()
            op.incarnations[k] = self._inc[k]
            op.seen += 1
            if int(fast.descs[e, k, A.D_KIND]) in _PARTED:  # (checked by the pass)
                op.parts[k] = self._parts(fast.descs[e, k])
        return op

    def _pass_done(self, wire: int, gen: int) -> _Op | None:
        """A group's op of (wire id, generation) the compiled pass answered (so Python
        never had it), as an answered _Op with its members' tickets: what a rank that
        submits the name and generation over another group meets (its ranks then hear of
        the mismatch late, :meth:`_late`), or None."""
        got = self._fast.done_of(wire, gen)
        if got is None:
            return None
        ctx, ranks, took = got
        op = _Op((wire, gen, ctx), self.slots, _Grp(ranks, ctx, self.node, self.slots))
        for k, (ticket, inc) in took.items():
            d = np.zeros(A.D_WORDS, np.int64)
            d[A.D_TICKET], d[A.D_WIRE], d[A.D_GEN], d[A.D_CTX] = ticket, wire, gen, ctx
            op.descs[k] = d
            op.incarnations[k] = inc
            op.seen += 1
        op.over = True  # it completed here
        return op

    def _parts(self, d: np.ndarray) -> tuple[int, ...]:
        """A reduce-scatter's or all-gather's parts, as the pass checked them."""
        at = int(d[A.D_AUX])
        n = int(self.arena.view(at, 1, np.int64)[0])
        return tuple(int(c) for c in self.arena.view(at + 8, n, np.int64))

    def _fast_start(self, e: int) -> None:
        """Entry ``e`` of the pass is complete here: start it among the nodes
        (:meth:`_engine_op`, over the world; a group's only if segmented).  Its node's part
        is in its node buffer, but for a segmented op (:func:`.arena_pass.pipelined`), whose
        node's part is made here segment by segment (compiled), as each starts."""
        fast = self._fast
        d = fast.descs[e, 0]
        kind, wire = int(d[A.D_KIND]), int(fast.keys[e, 0])
        ctx = int(d[A.D_CTX])
        key = (wire, int(fast.keys[e, 1]), ctx)
        # (a group's start is a segmented op's: the loop and Python take its others)
        grp = self._entry_op(e).grp if ctx else self._world
        if wire == _SESSION:  # the job's agreement: Python's, under a name of its sessions
            op = self._entry_op(e)
            if self._is_session(op):
                at = int(arena_pass.node_buffer(fast.st, fast.descs, e))
                op.node_buf = self.arena.view(at, 1, np.int64)
                arena_pass.arena_release(fast.buf, fast.lay, e)
                self._session_start(op)
                return
        for late in self.engine.take_late_errors():  # about ops answered already
            log.warning("an op among the services failed elsewhere after it ended here: %s", late)
        self._fast_tokens += 1
        token = self._fast_tokens
        shape: tuple[int, ...] | None = None
        if kind in _PARTED:
            self._parted_start(token, e, d)
            return
        try:
            at = -1 if kind == _BARRIER else int(arena_pass.entry_buffer(fast.buf, fast.lay, e))
            if kind in _REPEATED and not ctx:
                root = int(d[A.D_ROOT]) if kind == _BROADCAST else 0
                shape = (wire, int(d[A.D_DTYPE]), int(d[A.D_COUNT]), int(d[A.D_OP]),
                         int(d[A.D_ALGO]), at, kind, root)  # fmt: skip
                if self._fast_repeat(token, e, d, shape):
                    return
            dt = DType(int(d[A.D_DTYPE]))
            buf = None
            if kind != _BARRIER:
                buf = self.arena.view(at, int(d[A.D_COUNT]), dt.numpy)
            rop = ReduceOp(int(d[A.D_OP]))
            if rop is ReduceOp.AVG:
                rop = ReduceOp.SUM  # divided at the end
            segs = self._segmented(key, grp, d) if buf is not None else None
            if segs is None and ctx and buf is not None:  # (not expected: the pass cut it)
                arena_pass.arena_local(fast.buf, fast.lay, self.arena.base, e, 0, buf.size)
            if segs is not None:  # its node's part made, and handed back, by segments
                tb, lay, base = fast.buf, fast.lay, self.arena.base
                segs.local = lambda lo, hi: arena_pass.arena_local(tb, lay, base, e, lo, hi)
                segs.back = lambda i: self._fast_segment(token, i)
                self._fast_running[token] = [e, segs, None]
            h = self._engine_op(key, grp, kind, buf, rop, dt, d, segs)
        except Exception as exc:
            self._fast_running.pop(token, None)
            op = self._entry_op(e)
            arena_pass.arena_release(fast.buf, fast.lay, e)
            self._fail(op, A.E_FAILED, f"the services could not start it: {exc}")
            return
        if segs is None:
            self._fast_running[token] = [e, h, None]
            if shape is not None and (dt is not DType.BFLOAT16 or kind == _BROADCAST):
                self._remember_shape(shape, _NO_DATA if buf is None else buf, rop, h)
        # a segmented op ends after its segments' ends, in the order they came
        run = segs is None
        h.add_done_callback(lambda h: self._on_arena_thread(lambda: self._fast_end(token, h), run))

    def _parted_start(self, token: int, e: int, d: np.ndarray) -> None:
        """Entry ``e`` of the pass, a reduce-scatter or all-gather over the world, is
        complete here: its node's part made in a buffer of its own, and started among the
        nodes (each node's part the sum of its ranks' parts, in node order: the world's
        ranks are node after node), from the engine's express record of its shape if any."""
        fast = self._fast
        kind, wire = int(d[A.D_KIND]), int(fast.keys[e, 0])
        key = (wire, int(fast.keys[e, 1]), 0)
        dt = DType(int(d[A.D_DTYPE]))
        rop = ReduceOp(int(d[A.D_OP])) if kind == _RS else ReduceOp.SUM
        if rop is ReduceOp.AVG:
            rop = ReduceOp.SUM  # divided at the end
        try:
            n_in, _ = arena_pass.node_counts(fast.buf, fast.lay, self._mem, e)
            buf = np.empty(int(n_in), dt.numpy)
            arena_pass.arena_local_parts(
                fast.buf, fast.lay, self._mem, self.arena.base, e, buf.ctypes.data
            )
            digest = int(arena_pass.parts_digest(self._mem, d, self.size))
            shape = (wire, int(d[A.D_DTYPE]), int(d[A.D_COUNT]), int(d[A.D_OP]),
                     int(d[A.D_ALGO]), digest, kind, 0)  # fmt: skip
            if dt is not DType.BFLOAT16 and self._fast_repeat(token, e, d, shape, buf):
                return
            parts = self._parts(d)
            per_node = [
                sum(parts[i * self.slots : (i + 1) * self.slots]) for i in range(self.nodes)
            ]
            eng = self.engine
            name = self._engine_name(key)
            prio = int(d[A.D_PRIO])
            bf = "bfloat16" if dt is DType.BFLOAT16 else None
            grp = self._parts_group(self._world, digest)  # (the nodes compare the parts)
            if kind == _RS:
                h = eng.reduce_scatter_async(
                    buf, name=name, op=rop, counts=per_node, priority=prio, dtype=bf, group=grp
                )
            else:
                h = eng.allgather_async(
                    buf, name=name, counts=per_node, priority=prio, dtype=bf, group=grp
                )
        except Exception as exc:
            op = self._entry_op(e)
            arena_pass.arena_release(fast.buf, fast.lay, e)
            self._fail(op, A.E_FAILED, f"the services could not start it: {exc}")
            return
        self._fast_running[token] = [e, h, None]
        if dt is not DType.BFLOAT16:
            self._remember_shape(shape, buf, rop, h)
        h.add_done_callback(lambda h: self._on_arena_thread(lambda: self._fast_end(token, h)))

    def _fast_repeat(self, token: int, e: int, d: np.ndarray, shape: tuple[int, ...],
                     made: np.ndarray | None = None) -> bool:  # fmt: skip
        """Start entry ``e``, a whole allreduce, broadcast or barrier among the nodes of a
        shape started before, straight from the engine's express record of it (what
        ``_engine_op`` comes to through ``allreduce_async`` and the others, less the
        conversions and the lookups on its way); False when there is no record, or the
        engine wants the whole way (its checks are made here all the same:
        :func:`~totalreduce.service.express.start`).  ``made``: a reduce-scatter's or
        all-gather's node's part (its result is a new array, handed back from there)."""
        rec = self._fast_shapes.get(shape)
        if rec is None:
            return False
        buf, ex = rec
        out: np.ndarray | None = buf
        if made is not None:
            if made.dtype is not buf.dtype or made.shape != buf.shape:
                return False
            buf, out = made, None
        prio = int(d[A.D_PRIO])
        h = None
        if isinstance(ex, GroupExpress):  # a reduce-scatter's or all-gather's, its context
            h = group_start(self.engine, ex, shape[0], buf, prio, out)
        elif not self._fast_running and not int(d[A.D_FLAGS]) & A.F_UNNAMED:
            # Nothing else among the nodes: this thread drives the op to its end at once
            # (at most the engine's first try, 200 µs, then it is a handle like any), so a
            # small op between nodes makes no handle, spec or lane op, and no callback
            # hands its end back to this thread.
            r = express.now(self.engine, ex, shape[0], buf, out, prio)
            if r is not None:
                if r[1] is None:
                    fast = self._fast
                    if made is None:
                        arena_pass.arena_finish(
                            fast.buf, fast.lay, self._mem, self.arena.base, e, 1
                        )
                    else:
                        arena_pass.arena_finish_parts(
                            fast.buf, fast.lay, self._mem, self.arena.base, e, r[0].ctypes.data
                        )
                    self._wake_sleepers()
                    self._loop_shape(shape, buf, ex)
                    return True
                h = r[1]
        if h is None:
            if isinstance(ex, GroupExpress):  # (express.start knows no context)
                return False
            h = express.start(self.engine, ex, shape[0], buf, out, prio)
            if h is None:
                return False
        self._loop_shape(shape, buf, ex)
        self._fast_running[token] = [e, h, None]
        h.add_done_callback(lambda h: self._on_arena_thread(lambda: self._fast_end(token, h)))
        return True

    def _loop_shape(self, shape: tuple[int, ...], buf: np.ndarray, ex: Any) -> None:
        """A repeat of ``shape`` started from the engine's express record ``ex``: once the
        lane has its fields, the compiled loop runs its later repeats."""
        shapes = self._loop_shapes
        if shapes is None:
            return
        lane_shape = ex.lane_shape
        if lane_shape is None or lane_shape is False:
            return
        lane = self.engine.loop.lane
        if lane is not None and lane_shape.epoch != lane.plans_epoch:
            return  # made before a compaction: its next repeat's express route makes it anew
        if lane_shape.epoch != shapes.plans_epoch:
            # the lane's plans were compacted since the rows were made: their offsets moved.
            # The rows go, and the loop takes those of this epoch (a shape made before it is
            # made anew by its next repeat's express route); a compaction after this one
            # stops the loop again (``ServiceRepeats.begin``) until a row of its epoch comes.
            shapes.clear()
            shapes.plans_epoch = lane_shape.epoch
            self._repeats.renew(lane_shape.epoch)
        r = shapes.find(shape)
        if r >= 0 and r in shapes.kept and shapes.kept[r][2] is ex:
            return  # (a repeat of it Python started: the names' generations follow)
        if shapes.epoch != tuning.EPOCH[0]:
            shapes.clear()
            shapes.epoch = tuning.EPOCH[0]
        shapes.put(shape, buf, ex, self.engine._names.next_generation(shape[0]))
        shapes.names_seen = -1  # every row's generation looked at again

    def _remember_shape(self, shape: tuple[int, ...], buf: np.ndarray, rop: ReduceOp,
                        h: Any) -> None:  # fmt: skip
        """After a whole allreduce, broadcast or barrier among the nodes (its handle
        ``h``): keep the engine's express record of it (made by that call, under the key
        ``_engine_op``'s call gave it; a barrier's, which the engine keeps none of, made
        here of the op's spec) for its repeats."""
        eng = self.engine
        algo, kind = shape[4], shape[6]
        name = AlgorithmCode(algo).name.lower() if algo else "auto"
        table = getattr(eng, "_express", None)
        ex: Any = None
        if table is None:
            return
        if kind == _ALLREDUCE:
            ex = table.get((shape[0], rop, True, name))
        elif kind == _BROADCAST:  # the root among the services: the root's node
            ex = table.get(("bc", shape[0], shape[7] // self.slots, True, name))
            spec = getattr(h, "_spec", None)
            if ex is None and name == "auto" and spec is not None and not spec.context:
                # bfloat16 (a dtype argument: the engine keeps no record), only bytes moved
                if spec.kind is OpKind.BROADCAST and spec.dtype is DType.BFLOAT16:
                    sig_bc = ("broadcast", "bfloat16", int(buf.size), "sum", spec.param)
                    ex = express.Express(spec, buf, sig_bc, tuning.EPOCH[0])
        elif name == "auto":
            spec = getattr(h, "_spec", None)  # (None: it ended already; the next one)
            if spec is None or (spec.context and kind not in _PARTED):
                return
            if kind == _BARRIER and spec.kind is OpKind.BARRIER:
                sig: tuple[Any, ...] = _BARRIER_SIG
            elif kind == _RS and spec.kind is OpKind.REDUCE_SCATTER:  # (``_simple``'s)
                sig = ("reduce_scatter", spec.dtype.name.lower(), int(buf.size),
                       spec.op.name.lower(), spec.param)  # fmt: skip
            elif kind == _AG and spec.kind is OpKind.ALLGATHER:  # (``allgather_async``'s)
                sig = ("allgather", spec.dtype.name.lower(), -1, "sum", 0)
            else:
                return
            if spec.context:  # a reduce-scatter's or all-gather's: its parts' context
                ex = GroupExpress(spec, buf, sig, tuning.EPOCH[0])
            else:
                ex = express.Express(spec, buf, sig, tuning.EPOCH[0])
        if (
            ex is None
            or (ex.__class__ is not express.Express and ex.__class__ is not GroupExpress)
            or ex.npdt is not buf.dtype
            or ex.shape != buf.shape
        ):
            return  # (a record of this name's other shape: the next whole call makes one)
        shapes = self._fast_shapes
        if len(shapes) >= express.MAX_RECORDS:
            shapes.clear()
        shapes[shape] = (buf, ex)

    def _on_arena_thread(self, fn: Callable[[], None], run: bool = True) -> None:
        """Call ``fn`` on this thread: now if here and ``run``, else in its turn."""
        if run and threading.get_ident() == self._thread.ident:
            fn()
            return
        self._fast_ended.append(fn)
        if threading.get_ident() != self._thread.ident:
            self._kick()

    def _fast_segment(self, token: int, i: int) -> None:
        """Segment ``i`` of the pass's segmented op ``token`` ended among the nodes: its
        result goes back to the clients (unless Python took the op over)."""
        item = self._fast_running.get(token)
        if item is None or item[2] is not None:
            return
        e, segs, _ = item
        lo, hi = segs.ranges[i]
        arena_pass.arena_back(self._fast.buf, self._fast.lay, self.arena.base, e, lo, hi)
        segs.backed[i] = True

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
            arena_pass.arena_release(fast.buf, fast.lay, e)
            op.handle = ended_of(h)
            text = self._among_nodes_text(error, h, op.first())
            self._fail(op, _error_kind(error), text)
            return
        if arena_pass.parted(fast.descs[e, 0]):  # its result: the engine's new array
            try:
                got = h.wait(0)
            except Exception as exc:  # (ended well: not expected)
                op = self._entry_op(e)
                arena_pass.arena_release(fast.buf, fast.lay, e)
                self._fail(op, _error_kind(exc), str(exc))
                return
            arena_pass.arena_finish_parts(
                fast.buf, fast.lay, self._mem, self.arena.base, e, got.ctypes.data
            )
            self._wake_sleepers()
            return
        back = 0 if isinstance(h, _Segments) else 1  # a segmented op's went back already
        arena_pass.arena_finish(fast.buf, fast.lay, self._mem, self.arena.base, e, back)
        self._wake_sleepers()

    def _take_over(self, e: int, h: Any) -> _Op:
        """Python's tables take the pass's running entry ``e`` (an event is coming that
        may fail it): an _Op in ``_running`` with the engine's handle, as _start makes."""
        op = self._entry_op(e)
        fast = self._fast
        at = int(arena_pass.entry_buffer(fast.buf, fast.lay, e))
        d = fast.descs[e, 0]
        if at >= 0:
            op.node_buf = self.arena.view(at, int(d[A.D_COUNT]), DType(int(d[A.D_DTYPE])).numpy)
        op.handle = h
        if isinstance(h, _Segments) and h.local is not None:
            # its segments not started yet: their node's part now, while the entry is ours
            for lo, hi in h.ranges[len(h.handles) :]:
                h.local(lo, hi)
            h.local = None
        self._running[op.key] = op
        arena_pass.arena_release(fast.buf, fast.lay, e)
        return op

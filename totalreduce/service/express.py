"""The express path of an op a training loop repeats (an allreduce, reduce-scatter,
broadcast, all-gather, neighbor averaging or all-gather, reduce, gather, scatter or
all-to-all): one lookup instead of the checks.

A training step submits the same gradients under the same names every step: same
array shape and dtype, same reduce op, same algorithm.  The first submission of a
(name, op, in place or not, algorithm) goes the whole way (argument checks, algorithm
choice, schedule, name signature) and leaves an :class:`Express` record.  A later call
with the same name, op and algorithm, ``out`` of the same form, an array of the same
shape and dtype, and no ``group``/``dtype`` argument reuses it: the name's next
generation, a handle and the op's spec straight from the record; an op the compiled
lane runs then enters the lane from the calling thread, with the lane's fields of the
shape kept in the record too
(:meth:`~totalreduce.engine.lane_loop.LaneOps.express`), and any other is
queued for the comm thread as usual.  A reduce-scatter without partition, axes, group or
dtype arguments has records too, under ("rs", name, op), a broadcast without group or
dtype under ("bc", name, root, in place, algorithm), and an all-gather given ``counts``
(one op) without partition, axes, group or dtype under ("ag", name, counts).  The other
kinds' keys are made by their modules (``neighbors.py``: ("nar", ...), ("nag", ...) with
the weights or ranks given; ``rooted.py``: ("red", ...), ("ga", ...), ("sc", ...),
("a2a", name)), and their blocking forms call :func:`run`; docs/architecture.md has the
table.  Keys of different kinds differ in their first item or their length.

In daemon mode the records keep the descriptor the whole way wrote instead, and a blocking
repeat is submitted and waited for in one compiled call: an allreduce's, a named
barrier's and an in-place broadcast's (:func:`thin_now`, :func:`thin_barrier`), and a
reduce-scatter's, an all-gather's given its counts and a broadcast's into another array
(:func:`thin_parted_now`, staged in the arena as the whole way stages them); an
all-gather's without counts in two, its sizes then its data (:func:`thin_sized_now`).
Each over the world or over a group (the key then ends with the group's ranks).

Nothing is skipped that could differ between calls: the array's type, dtype, shape
and layout, ``out`` (the same checks as :func:`.checks.output`), the priority, the
service's state and the tuning epoch are looked at on every call, and anything
unusual goes the whole way (which raises what it raises there).  So the express
path changes how fast an op starts, never what it does.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ..algorithms.codes import AlgorithmCode, OpKind
from ..algorithms.schedule import Schedule, SegmentPlan
from ..dtypes import DType, ReduceOp
from ..errors import TotalReduceError
from ..lane.payload import OpSpec
from ..transport import arena as A
from . import checks, tuning
from .handle import ExpressOp, Handle
from .thin import ThinHandle as _ThinHandle

if TYPE_CHECKING:
    from ..lane.lane import LaneShape
    from .thin import ThinHandle

#: Where tables of records bounded by count clear themselves (the daemon's; the service's
#: own table stays below it, within ``Config.express_bytes``: ``records.Records``).
MAX_RECORDS = 1 << 15
#: Kinds whose result is a new flat array, whatever the input's shape.
_FLAT = frozenset({OpKind.REDUCE_SCATTER, OpKind.ALLGATHER})
#: A record's ``rshape`` when a new result is the flat output itself.
_SAME: Any = object()
#: ``Express``'s ``result`` when the kind says the shape (the records made before others').
BY_KIND: Any = object()


class Express:
    """What a repeat of one (name, op, in-place) allreduce needs (see the module docstring)."""

    __slots__ = (
        "npdt", "shape", "dt", "rop", "sig", "code", "sched", "plan", "count",
        "wid", "group", "in_place", "epoch", "lane_shape", "kind", "out_count", "param",
        "rshape", "into_x", "nothing", "used", "ended_row", "ended_epoch",
    )  # fmt: skip

    def __init__(
        self, spec: OpSpec, x: np.ndarray, sig: tuple[Any, ...], epoch: int,
        result: Any = BY_KIND, into_x: bool = False,
    ) -> None:  # fmt: skip
        self.npdt = x.dtype
        self.shape = x.shape
        self.dt: DType = spec.dtype
        self.rop: ReduceOp = spec.op
        self.sig = sig
        self.code: AlgorithmCode = spec.algorithm
        self.sched: Schedule = spec.schedule  # the in-place form already, if in place
        self.plan: SegmentPlan = spec.plan
        self.count = spec.count
        self.kind: OpKind = spec.kind
        self.out_count = spec.outbuf.size  # a reduce-scatter's part, else the count
        self.param = spec.param  # a broadcast's root
        self.wid = spec.wire_id
        self.group = spec.group
        self.in_place = spec.in_place
        self.epoch = epoch
        #: The shape of a new result (``out`` None): the whole way's result's (``result``;
        #: None: this rank gets None, a reduce's or a gather's off the root), or by the
        #: kind (a flat array, or ``x``'s shape); ``_SAME`` where that is the flat output.
        if result is BY_KIND:
            rshape: Any = (self.out_count,) if x.ndim == 1 or self.kind in _FLAT else x.shape
        else:
            rshape = None if result is None else tuple(result.shape)
        self.rshape = _SAME if rshape == (self.out_count,) else rshape
        #: A scatter's receiver: ``x`` is where its part lands, and its input is empty.
        self.into_x = into_x
        self.nothing = np.empty(0, dtype=x.dtype) if into_x else None
        #: The lane's part, made by the lane at the first repeat: None until then, False
        #: when the lane does not run this shape.
        self.lane_shape: LaneShape | bool | None = None
        #: A repeat found it since the table's last sweep (``records.Records``: kept then).
        self.used = False
        #: Its repeats' row in the loop's ring of ended ops, of the ring's ``ended_epoch``
        #: (``engine/ended.py``; ``LaneOps.ended_row`` keeps it here).
        self.ended_row = 0
        self.ended_epoch = -1


def lookup(table: dict[tuple[Any, ...], Express], key: tuple[Any, ...], x: Any) -> Express | None:
    """The record under ``key`` if ``x`` is an array of its dtype and shape, else None (an
    unhashable name or op too: the whole way says what is wrong)."""
    try:
        ex = table.get(key)
    except TypeError:
        return None
    if ex is not None and x.__class__ is np.ndarray and x.dtype is ex.npdt and x.shape == ex.shape:
        ex.used = True
        return ex
    return None


def _make(svc: Any, ex: Express, op_name: str | int, gen: int, flat: np.ndarray, o: np.ndarray,
          result: Any, priority: int, urgent: bool) -> tuple[ExpressOp, Any]:  # fmt: skip
    """The handle and spec of a repeat whose generation is taken: one object, an
    :class:`~.handle.ExpressOp` (its own spec, and its lane op once it enters)."""
    op = ExpressOp(ex, op_name, gen, result, svc.loop, svc._names, priority, flat, o, urgent)
    return op, op


def _launch(svc: Any, ex: Express, op_name: str | int, gen: int, flat: np.ndarray,
            o: np.ndarray, result: Any, priority: int) -> Handle:  # fmt: skip
    """A repeat whose generation is taken, entered into the lane from this thread or
    submitted the usual way."""
    op = ExpressOp(ex, op_name, gen, result, svc.loop, svc._names, priority, flat, o, False)
    loop = svc.loop
    if loop.ops.express(op, ex) is None:  # (entered: the op is its own lane op)
        loop.submit(op)
    return op


def start(svc: Any, ex: Express, name: str | int, x: np.ndarray, out: Any,
          priority: Any) -> Handle | None:  # fmt: skip
    """Start a repeat of ``ex`` with array ``x`` (its type, dtype and shape checked by the
    caller) on service ``svc`` (a ``submit.OpSubmitter``); None when something unusual
    needs the whole way.  (``_launch``'s work is written out here, and ``run`` writes
    out these checks: a training step's repeats pay for every call, measured at 1-2 µs
    per submission for two more.)"""
    loop = svc.loop
    if (
        svc._closed
        or loop.fatal is not None
        or loop.failures.late
        or ex.epoch != tuning.EPOCH[0]
        or not x.flags.c_contiguous
    ):
        return None
    if priority.__class__ is not int or not -(1 << 31) <= priority < 1 << 31:
        return None
    flat: Any = x if x.ndim == 1 else x.reshape(-1)  # (a scatter receiver: its empty input)
    result: Any
    if out is None:
        if ex.into_x:  # a scatter's receiver: its part lands in x
            if not x.flags.writeable:
                return None
            o, flat, result = flat, ex.nothing, x.reshape(ex.shape)
        else:
            o = np.empty(ex.out_count, dtype=ex.npdt)
            rs = ex.rshape
            result = o if rs is _SAME else None if rs is None else o.reshape(rs)
    else:
        o, in_place = checks.output(x, out)  # as the whole way checks it
        if in_place != ex.in_place:
            return None
        result = o if o.shape == ex.shape else o.reshape(ex.shape)
        if o.ndim != 1:
            o = o.reshape(-1)
    return submit_record(svc, ex, name, priority, flat, o, result, 0)


def submit_record(
    svc: Any, ex: Any, name: Any, priority: int, inbuf: Any, outbuf: Any, result: Any,
    context: int,
) -> Handle:  # fmt: skip
    """Submit a repeat of the express record ``ex`` (its checks passed): the name's next
    generation, its handle and spec (``context``: a group's among the nodes, else 0),
    straight into the lane when it takes it, else to the loop."""
    loop = svc.loop
    names = svc._names
    op_name, gen = names.name(name, ex.sig)
    op = ExpressOp(ex, op_name, gen, result, loop, names, priority, inbuf, outbuf, False, context)
    if loop.ops.express(op, ex) is None:  # (entered: the op is its own lane op)
        loop.submit(op)
    return op


#: What :func:`run` returns when nothing was taken (a result may be None: a reduce's
#: off the root).
MISSED: Any = object()


def run(svc: Any, ex: Express, name: str | int, x: np.ndarray, out: Any, priority: Any) -> Any:
    """A blocking repeat of ``ex`` (the blocking ``allreduce``, ``broadcast``, ``reduce``,
    ...): its result, or :data:`MISSED` when something unusual needs the whole way
    (nothing was taken then).

    An op of a quick lane shape (no copy of its input, no scratch, a WORK buffer of a few
    elements at most: ``LaneShape.quick``) is entered into the lane and driven to its end
    in one hold of the loop's lock and one compiled call, with no handle, spec or lane op
    made for it and its generation never counted in flight (:func:`now`), as
    ``MPI_Allreduce`` makes no request.  One that does not end there (its peers are late,
    or anything needs Python) gets them then, and is waited for as ``start(...).wait()``
    would."""
    r = _go(svc, ex, name, x, out, priority)
    return r.wait() if r.__class__ is ExpressOp else r


def now(svc: Any, ex: Express, name: str | int, x: np.ndarray, out: Any,
        priority: Any) -> tuple[Any, Handle | None] | None:  # fmt: skip
    """Try a repeat of ``ex`` to its end now, without waiting past that try: ``(result,
    None)`` when it ended well (``LaneOps.now``: entered and driven in one hold of
    the loop's lock, nothing made for it in Python); ``(result, handle)`` when it is on
    its way (entered and not ended, or started the way :func:`start` starts it); None
    when something unusual needs the whole way (nothing was taken then).  A thread that
    must not block on one op (the daemon's arena thread) takes the handle and goes on."""
    r = _go(svc, ex, name, x, out, priority)
    if r is MISSED:
        return None
    if r.__class__ is ExpressOp:
        return r._result, r
    return r, None


def _make_held(
    svc: Any, ex: Express, op_name: str | int, gen: int, flat: np.ndarray, o: np.ndarray,
    result: Any, priority: int, urgent: bool,
) -> tuple[ExpressOp, Any]:  # fmt: skip
    """:func:`_make` for a generation :meth:`.names.NameTable.take` gave, which is in
    flight from now (its handle's end gives it back)."""
    svc._names.hold(op_name)
    return _make(svc, ex, op_name, gen, flat, o, result, priority, urgent)


def _go(svc: Any, ex: Express, name: str | int, x: np.ndarray, out: Any, priority: Any) -> Any:
    """:func:`run` and :func:`now`'s way: the result when the repeat ended in its call,
    the handle of one on its way, or :data:`MISSED` (nothing taken).  (The checks are
    ``start``'s, written out for the reason ``start`` gives.)"""
    shape = ex.lane_shape
    loop = svc.loop
    if (
        shape is None
        or shape is False
        or not shape.quick  # type: ignore[union-attr]
        or svc._closed
        or loop.fatal is not None
        or loop.failures.late
        or ex.epoch != tuning.EPOCH[0]
        or not x.flags.c_contiguous
    ):
        return MISSED
    if priority.__class__ is not int or not -(1 << 31) <= priority < 1 << 31:
        return MISSED
    flat: Any = x if x.ndim == 1 else x.reshape(-1)  # (a scatter receiver: its empty input)
    result: Any
    if out is None:
        if ex.into_x:  # a scatter's receiver: its part lands in x
            if not x.flags.writeable:
                return MISSED
            o, flat, result = flat, ex.nothing, x.reshape(ex.shape)
        else:
            o = np.empty(ex.out_count, dtype=ex.npdt)
            rs = ex.rshape
            result = o if rs is _SAME else None if rs is None else o.reshape(rs)
    else:
        o, in_place = checks.output(x, out)  # as the whole way checks it
        if in_place != ex.in_place:
            return MISSED
        result = o if o.shape == ex.shape else o.reshape(ex.shape)
        if o.ndim != 1:
            o = o.reshape(-1)
    # The name's next generation, not counted in flight: one hold of the name table's
    # lock for an op that ends in this call (``_make_held`` counts one that does not).
    gen = svc._names.take(name, ex.sig)
    r = loop.ops.now(
        shape, name, ex.wid, gen, ex.group, priority, flat, o, _make_held, ex, svc, result
    )
    if r is True:
        return result
    if r is None:  # not entered: the way start goes
        svc._names.hold(name)
        return _launch(svc, ex, name, gen, flat, o, result, priority)
    return r  # entered, not ended: a handle of the express path


def remember(svc: Any, key: tuple[Any, ...], spec: OpSpec, x: np.ndarray,
             sig: tuple[Any, ...], result: Any = BY_KIND,
             into_x: bool = False) -> None:  # fmt: skip
    """After a whole-way op: keep its record if a repeat can take the express path
    (``result``: the whole way's result, whose shape a repeat's new result takes)."""
    try:
        hash(key)
    except TypeError:  # something given was unhashable (a 0-d array as a weight): no record
        return
    # (the table keeps its records within ``Config.express_bytes``: ``records.Records``)
    svc._express[key] = Express(spec, x, sig, tuning.EPOCH[0], result, into_x)


# ---------------------------------------------------------------- daemon mode (thin path)

#: The first item of a thin record's key (the same table as the engine's records).
THIN = "thin"
#: ... of a broadcast's (in place, among several nodes: :func:`thin_bcast_remember`).
THIN_BC = "thinbc"


class ThinExpress:
    """What a repeat of one in-place allreduce in daemon mode needs: the array's dtype and
    shape, the name's signature, the descriptor the whole way wrote, and its record at the
    node's meeting (None where the op does not meet there)."""

    __slots__ = ("npdt", "shape", "sig", "row", "meet", "epoch", "last", "last_at", "ended",
                 "hold", "what", "last_out", "last_out_at")  # fmt: skip

    def __init__(
        self, x: np.ndarray, sig: tuple[Any, ...], row: np.ndarray, meet: np.ndarray | None
    ) -> None:
        self.npdt = x.dtype
        self.shape = x.shape
        self.sig = sig
        self.row = row
        self.meet = meet
        self.epoch = tuning.EPOCH[0]
        #: The last array of the arena the op was given, weakly, and its arena offset: a
        #: training loop hands the same buffer every step, and finding an array's place
        #: (``__array_interface__``) costs a microsecond.  An array of the arena is a view
        #: of its mapping, which cannot be resized: the same object, the same place.
        self.last: weakref.ref[np.ndarray] | None = None
        self.last_at = -1
        #: What a repeat's handle calls when it ends (its name's generation is no longer in
        #: flight): made at the first repeat and shared by the later ones, not a closure
        #: per op for the garbage collector to track (a repeat is named: its op's name is
        #: the record's).
        self.ended: Callable[[], None] | None = None
        #: What a blocking repeat calls when its op does not end in its one compiled call:
        #: its generation is in flight from then on (:func:`thin_now`).
        self.hold: Callable[[], None] | None = None
        #: The client's index of the op's kind and name, which the ops that end in a
        #: compiled call among the nodes keep (:meth:`~.thin.ThinClient.what`); -1: none yet.
        self.what = -1
        #: A blocking repeat's last ``out`` of the arena (not ``x``), weakly, and its place.
        self.last_out: weakref.ref[np.ndarray] | None = None
        self.last_out_at = -1


def thin_remember(
    svc: Any, key: tuple[Any, ...], x: Any, h: ThinHandle, ranks: tuple[int, ...] | None = None
) -> None:
    """After a whole-way allreduce in daemon mode (in place, or into a new array): keep a
    record if a repeat can take the express path (one op, not pieces, no finalizer), its
    descriptor this thread's last.  ``ranks``: the op's group's (None: the world), whose
    block the client keeps (:func:`_row_is`)."""
    thin = svc._thin
    if (
        h.__class__ is not _ThinHandle
        or h._finalize is not None
        or h._ticket == 0
        or x.__class__ is not np.ndarray
        or not x.flags.c_contiguous
    ):
        return
    try:
        row = thin.last_row()
        sig = svc._names.signature(h.name)
    except (TypeError, KeyError):
        return
    if not _row_is(svc, row, h, x.size, ranks):
        return
    table = svc._express
    if len(table) >= MAX_RECORDS:
        table.clear()
    table[key] = ThinExpress(x, sig, row, thin.last_meet())


def _row_is(svc: Any, row: np.ndarray, h: Any, count: int, ranks: tuple[int, ...] | None) -> bool:
    """Whether descriptor ``row`` is the one op ``h`` (of ``count`` elements) wrote, whole
    (not a piece of a large op), over the world (``ranks`` None) or over the group of
    ``ranks`` through a block of them that the client keeps (a repeat's descriptor points
    there: :meth:`~.thin_buffers.ThinBuffers.kept_block`)."""
    if (
        int(row[A.D_WIRE]) != A.signed(svc._wire_id(h.name))
        or int(row[A.D_GEN]) != h.generation
        or int(row[A.D_COUNT]) != count
    ):
        return False
    if ranks is None:
        return int(row[A.D_CTX]) == 0
    return int(row[A.D_CTX]) != 0 and svc._thin.kept_block(int(row[A.D_GROUP])) == ranks


def _thin_record(
    svc: Any, key: tuple[Any, ...], cls: type, x: Any, priority: Any, contiguous: bool
) -> Any:
    """The record of class ``cls`` under ``key`` if a repeat on ``x`` (a numpy array of
    its dtype and shape; C-contiguous if ``contiguous``) at ``priority`` (a 32-bit int) may
    take it, in this tuning epoch, on an open service; else None."""
    try:
        rec = svc._express.get(key)
    except TypeError:  # (a key of something unhashable: not a repeat)
        return None
    if (
        rec is None
        or rec.__class__ is not cls
        or x.__class__ is not np.ndarray
        or x.dtype is not rec.npdt
        or x.shape != rec.shape
        or (contiguous and not x.flags.c_contiguous)
        or priority.__class__ is not int
        or not -(1 << 31) <= priority < 1 << 31
        or rec.epoch != tuning.EPOCH[0]
        or svc._closed
    ):
        return None
    return rec


def thin_start(
    svc: Any, key: tuple[Any, ...], x: Any, out: Any, priority: Any
) -> ThinHandle | None:
    """A repeat of the allreduce under ``key`` with array ``x``, in place (``out`` is
    ``x``) or into a new array (``out`` None): its descriptor is the record's, with the
    new generation, priority and place.  The place is ``x`` itself for an in-place array
    of the arena, else a staging block filled from ``x`` (the result is copied out of it
    into ``x``, or into the new array), as the whole way places it.  None when anything
    differs or is unusual (the whole way then checks, and raises what it raises)."""
    in_place = out is x
    rec = _thin_record(svc, key, ThinExpress, x, priority, True)
    if rec is None or not (in_place or out is None) or (in_place and not x.flags.writeable):
        return None
    thin = svc._thin
    if thin.busy():
        return None
    at = -1
    if in_place:
        last = rec.last
        if last is not None and last() is x:
            at = rec.last_at
        else:
            at = thin.arena.offset_of(x)
            if at >= 0:
                rec.last, rec.last_at = weakref.ref(x), at
    back: np.ndarray | None = None
    result: np.ndarray = x
    if at < 0:  # staged: one copy in, one out (the result's)
        if not x.size or not thin.takes(x.nbytes):
            return None
        at = thin.stage(x.nbytes, x)
        if in_place:
            back = x
        else:
            back = np.empty(x.size, dtype=x.dtype)
            result = back if x.ndim == 1 else back.reshape(x.shape)
    names = svc._names
    try:
        op_name, gen = names.name(key[1], rec.sig)
    except BaseException:
        if back is not None:
            thin.space.free(at)
        raise
    ended = rec.ended
    if ended is None:
        ended = rec.ended = functools.partial(names.ended, op_name)
    h = _ThinHandle(thin, op_name, gen, OpKind.ALLREDUCE, result, ended)
    if back is not None:
        h.hold((at,), back, at)
    return thin.submit_again(h, rec.row, priority, at, rec.meet)


def thin_now(
    svc: Any, key: tuple[Any, ...], x: Any, priority: Any, out: Any = None,
    kind: OpKind = OpKind.ALLREDUCE,
) -> Any:  # fmt: skip
    """A blocking repeat of the allreduce under ``key`` on ``x``, an array of the arena, in
    place (``out`` is ``x``) or into ``out``, another array of the arena of the same dtype
    and shape, or (``out`` None, several nodes) into a new array, ``x`` staged in a block
    of the arena (:func:`_thin_now_staged`): one compiled call, with no handle, lock or
    ticket table in Python.  Its op
    meets the node's other clients in the arena on a one-node service (in place only:
    :meth:`~.thin.ThinClient.now`), or is submitted into the ring and waited for
    (:meth:`~.thin.ThinClient.ring_now`) on a service of several nodes.  Its result
    (``x``, or ``out``), or None when anything differs or is unusual (the caller then goes
    ``allreduce_async(...).wait()``, which checks and raises what it raises).  The name's
    generation is taken with one hold of the name table's lock, and is in flight only if
    the op does not end in the call.  ``kind`` BROADCAST: a broadcast's repeat in place
    (its record from :func:`thin_bcast_remember`).  A record of an op over a group (its
    key names the group's ranks) meets at a one-node service's meeting place where its
    first call did, else goes into the ring."""
    rec = _thin_record(svc, key, ThinExpress, x, priority, False)
    if rec is None:
        return None
    in_place = out is x
    if kind is not OpKind.ALLREDUCE and not in_place:
        return None
    if out is None:
        return _thin_now_staged(svc, rec, key[1], x, priority)
    if in_place:
        if not x.flags.writeable:
            return None
    elif (
        rec.meet is not None
        or out.__class__ is not np.ndarray
        or out.dtype is not rec.npdt
        or out.shape != rec.shape
        or not out.flags.writeable
    ):
        return None
    thin = svc._thin
    last = rec.last
    if last is not None and last() is x:
        at = rec.last_at
    else:
        if not x.flags.c_contiguous or (at := thin.arena.offset_of(x)) < 0:
            return None
        rec.last, rec.last_at = weakref.ref(x), at
    at_out = at
    if not in_place:
        last = rec.last_out
        if last is not None and last() is out:
            at_out = rec.last_out_at
        else:
            if not out.flags.c_contiguous or (at_out := thin.arena.offset_of(out)) < 0:
                return None
            rec.last_out, rec.last_out_at = weakref.ref(out), at_out
        if abs(at_out - at) < x.nbytes:  # overlapping buffers: the whole way says what
            return None
    if thin.busy():
        return None
    names = svc._names
    op_name = key[1]
    gen = names.take(op_name, rec.sig)
    ended, hold = rec.ended, rec.hold
    if ended is None or hold is None:
        ended = rec.ended = functools.partial(names.ended, op_name)
        hold = rec.hold = functools.partial(names.hold, op_name)
    if rec.meet is not None:
        return thin.now(op_name, gen, rec.row, rec.meet, x, at, priority, ended, hold, kind)
    what = rec.what
    if what < 0:
        what = rec.what = thin.what(kind, op_name)
    return thin.ring_now(
        op_name, gen, rec.row, out, x.nbytes, at, at_out, priority, hold, ended, what, kind
    )


def thin_bcast_remember(
    svc: Any, key: tuple[Any, ...], x: Any, h: ThinHandle, ranks: tuple[int, ...] | None = None
) -> None:
    """After a broadcast in place went the whole way in daemon mode: keep a record (as
    :func:`thin_remember`) if ``x`` lives in the arena, for :func:`thin_now` to repeat it
    in one compiled call (at the node's meeting place, or into the ring)."""
    thin = svc._thin
    if x.__class__ is np.ndarray and thin.arena.offset_of(x) >= 0:
        thin_remember(svc, key, x, h, ranks)


def _thin_now_staged(
    svc: Any, rec: ThinExpress, op_name: str | int, x: np.ndarray, priority: int
) -> np.ndarray | None:
    """:func:`thin_now` with ``out`` None on a service of several nodes: ``x`` copied into a
    staging block, reduced there in one compiled call (:meth:`~.thin.ThinClient.ring_now`),
    and the result copied into a new array, the copies the whole way makes; the block is
    freed once the op ended (or failed).  None where the whole way would not stage."""
    thin = svc._thin
    if (
        rec.meet is not None
        or not x.size
        or not x.flags.c_contiguous
        or not thin.takes(x.nbytes)
        or thin.busy()
    ):
        return None
    names = svc._names
    at = thin.stage(x.nbytes, x)
    submitted = False
    try:
        gen = names.take(op_name, rec.sig)
        ended, hold = rec.ended, rec.hold
        if ended is None or hold is None:
            ended = rec.ended = functools.partial(names.ended, op_name)
            hold = rec.hold = functools.partial(names.hold, op_name)
        what = rec.what
        if what < 0:
            what = rec.what = thin.what(OpKind.ALLREDUCE, op_name)
        submitted = True
        thin.ring_now(op_name, gen, rec.row, None, x.nbytes, at, at, priority, hold, ended, what)
    except TotalReduceError:  # the op ended (failed), or never went: nothing writes there
        thin.space.free(at)
        raise
    except BaseException:
        # an interrupt while the op may be on its way: the service may still write the
        # block, so it is not given back (a handle's would be, when its op ends)
        if not submitted:
            thin.space.free(at)
        raise
    result: np.ndarray = thin.arena.view(at, x.size, x.dtype).copy()
    thin.space.free(at)
    return result if x.ndim == 1 else result.reshape(x.shape)


class ThinBarrier:
    """What a repeat of a named barrier of the world in daemon mode needs: its name's
    signature, and the descriptor and meeting record its first call wrote."""

    __slots__ = ("sig", "row", "meet", "epoch", "ended", "hold", "what")

    def __init__(self, sig: tuple[Any, ...], row: np.ndarray, meet: np.ndarray | None) -> None:
        self.sig, self.row, self.meet = sig, row, meet
        self.epoch = tuning.EPOCH[0]
        self.ended: Callable[[], None] | None = None
        self.hold: Callable[[], None] | None = None
        #: As :attr:`ThinExpress.what` (a barrier among the nodes); -1: none yet.
        self.what = -1


_NOTHING = np.empty(0, dtype=np.int64)


def thin_barrier(
    svc: Any, name: str | int, priority: Any, ranks: tuple[int, ...] | None = None
) -> bool:
    """A blocking repeat of the named barrier ``name`` of the world (or of the group of
    ``ranks``): one compiled call, that meets the node's other clients in the arena on a
    one-node service (:meth:`~.thin.ThinClient.now`; the world's, and a group's), or
    submits into the
    ring and waits (:meth:`~.thin.ThinClient.ring_now`); True once it ended, False when it
    has no record yet or anything is unusual (the caller then goes
    ``barrier_async(...).wait()`` and calls :func:`thin_barrier_remember`)."""
    try:
        rec = svc._express.get(("thinbar", name) if ranks is None else ("thinbar", name, ranks))
    except TypeError:
        return False
    if (
        rec is None
        or rec.__class__ is not ThinBarrier
        or priority.__class__ is not int
        or not -(1 << 31) <= priority < 1 << 31
        or rec.epoch != tuning.EPOCH[0]
        or svc._closed
    ):
        return False
    thin = svc._thin
    if thin.busy():
        return False
    names = svc._names
    gen = names.take(name, rec.sig)
    ended, hold = rec.ended, rec.hold
    if ended is None or hold is None:
        ended = rec.ended = functools.partial(names.ended, name)
        hold = rec.hold = functools.partial(names.hold, name)
    if rec.meet is not None:
        thin.now(name, gen, rec.row, rec.meet, _NOTHING, -1, priority, ended, hold,
                 OpKind.BARRIER)  # fmt: skip
        return True
    what = rec.what
    if what < 0:
        what = rec.what = thin.what(OpKind.BARRIER, name)
    at_in, at_out = int(rec.row[A.D_IN]), int(rec.row[A.D_OUT])
    thin.ring_now(name, gen, rec.row, None, 0, at_in, at_out, priority, hold, ended, what,
                  OpKind.BARRIER)  # fmt: skip
    return True


def thin_barrier_remember(
    svc: Any, name: str | int, h: Any, ranks: tuple[int, ...] | None = None
) -> None:
    """After a named barrier of the world (or of the group of ``ranks``) went the whole
    way: keep its record if it met the node's clients in the arena, or went into the ring
    (on a service of several nodes; a group's on any), its descriptor this thread's last."""
    thin = svc._thin
    meet = thin.last_meet()
    if h.__class__ is not _ThinHandle:
        return
    if meet is not None and h._meet < 0 and ranks is not None:
        meet = None  # a group's barrier that took the ring: its repeats take it too
    if (thin.meet_world and ranks is None) or meet is not None:
        if meet is None or h._meet < 0:
            return
    elif h._ticket == 0:
        return
    try:
        row = thin.last_row()
        sig = svc._names.signature(h.name)
    except (TypeError, KeyError):
        return
    if not _row_is(svc, row, h, 0, ranks):
        return
    table = svc._express
    if len(table) >= MAX_RECORDS:
        table.clear()
    key = ("thinbar", name) if ranks is None else ("thinbar", name, ranks)
    table[key] = ThinBarrier(sig, row, meet)


#: The first items of the keys of :class:`ThinParted` records: a reduce-scatter's, an
#: all-gather's (``counts`` given) and a broadcast's into another array (``out`` not ``x``).
THIN_RS, THIN_AG, THIN_BCO = "thinrs", "thinag", "thinbco"
#: Where a staged result starts after its input in one block (bytes; the arena's words).
_ALIGN = 64


class ThinParted:
    """What a blocking repeat of a reduce-scatter, an all-gather or a broadcast into
    another array in daemon mode needs, over the world and without partition or dtype
    arguments: the input's dtype and shape, the result's elements, the name's signature,
    and the descriptor the whole way wrote (its parts' block, for a reduce-scatter or an
    all-gather, one the client keeps: :meth:`~.thin_buffers.ThinBuffers.kept_block`).
    Its repeats stage the input in one block of the arena with room for the result after
    it (a broadcast's result is the block itself), and go into the ring in one compiled
    call (:meth:`~.thin.ThinClient.ring_now`), as the whole way's staging does."""

    __slots__ = ("kind", "npdt", "shape", "out_count", "fill", "sig", "row", "epoch",
                 "ended", "hold", "what", "meet")  # fmt: skip

    def __init__(self, kind: OpKind, x: np.ndarray, out_count: int, fill: bool,
                 sig: tuple[Any, ...], row: np.ndarray,
                 meet: np.ndarray | None = None) -> None:  # fmt: skip
        self.kind = kind
        #: a broadcast's meeting record on a one-node service (its clients meet in the
        #: arena, in place on their staging blocks), else None: the ring
        self.meet = meet
        self.npdt = x.dtype
        self.shape = x.shape
        self.out_count = out_count
        #: whether the input goes into the block (a broadcast's receivers send nothing)
        self.fill = fill
        self.sig = sig
        self.row = row
        self.epoch = tuning.EPOCH[0]
        #: as :class:`ThinExpress`'s
        self.ended: Callable[[], None] | None = None
        self.hold: Callable[[], None] | None = None
        self.what = -1


def thin_parted_remember(
    svc: Any, key: tuple[Any, ...], x: Any, h: Any, kind: OpKind, root: int = 0,
    ranks: tuple[int, ...] | None = None,
) -> None:  # fmt: skip
    """After a reduce-scatter, an all-gather with ``counts`` or a broadcast into another
    array went the whole way in daemon mode (its handle ``h``, not waited for yet): keep a
    record under ``key`` if the op was one descriptor of the world (or of the group of
    ``ranks``), this thread's last, into the ring of the node's service (or, a broadcast
    of the world on a one-node service, to its meeting place), whose parts' and group's
    blocks the client keeps."""
    thin = svc._thin
    meets = kind is OpKind.BROADCAST and (
        thin.meet_world if ranks is None else thin.last_meet() is not None
    )
    if (
        h.__class__ is not _ThinHandle
        or h._ticket == 0
        or (h._meet >= 0) != meets
        or x.__class__ is not np.ndarray
        or not x.flags.c_contiguous
    ):
        return
    try:
        row = thin.last_row()
        sig = svc._names.signature(h.name)
    except (TypeError, KeyError):
        return
    meet = thin.last_meet() if meets else None
    if int(row[A.D_KIND]) != int(kind) or not _row_is(svc, row, h, x.size, ranks):
        return  # another op's (pieces of a large one, a group's not kept)
    if meets and meet is None:
        return
    world = tuple(range(svc.size)) if ranks is None else ranks
    me = world.index(svc.rank)
    if kind is OpKind.BROADCAST:
        out_count = x.size
    else:
        parts = thin.kept_block(int(row[A.D_AUX]))
        if parts is None or len(parts) != len(world):
            return
        out_count = parts[me] if kind is OpKind.REDUCE_SCATTER else sum(parts)
    fill = kind is not OpKind.BROADCAST or me == root
    table = svc._express
    if len(table) >= MAX_RECORDS:
        table.clear()
    table[key] = ThinParted(kind, x, out_count, fill, sig, row, meet)


def thin_parted_now(svc: Any, key: tuple[Any, ...], x: Any, priority: Any, out: Any = None) -> Any:
    """A blocking repeat of the op of :class:`ThinParted` record ``key`` on ``x``: one
    compiled call (:meth:`~.thin.ThinClient.ring_now`).  Its result: a new flat array (a
    reduce-scatter's or an all-gather's), a broadcast's new array of ``x``'s shape, or its
    ``out`` (an array of ``x``'s dtype and shape); None when there is no record or
    anything differs or is unusual (the caller then goes the whole way, which checks and
    raises what it raises)."""
    rec = _thin_record(svc, key, ThinParted, x, priority, True)
    if rec is None:
        return None
    kind = rec.kind
    if out is not None and (
        kind is not OpKind.BROADCAST
        or out is x
        or out.__class__ is not np.ndarray
        or out.dtype is not rec.npdt
        or out.shape != rec.shape
        or not out.flags.writeable
    ):
        return None
    thin = svc._thin
    isz = x.itemsize
    at_out_rel = 0 if kind is OpKind.BROADCAST else -(-x.nbytes // _ALIGN) * _ALIGN
    nbytes = at_out_rel + rec.out_count * isz
    if not thin.takes(nbytes) or thin.busy():
        return None
    names = svc._names
    op_name = key[1]
    at = thin.stage(max(nbytes, 1), x if rec.fill else None)
    submitted = False
    try:
        gen = names.take(op_name, rec.sig)
        ended, hold = rec.ended, rec.hold
        if ended is None or hold is None:
            ended = rec.ended = functools.partial(names.ended, op_name)
            hold = rec.hold = functools.partial(names.hold, op_name)
        submitted = True
        if rec.meet is not None:  # a broadcast at the meeting place, in place on the block
            view = thin.arena.view(at, rec.out_count, x.dtype)
            thin.now(op_name, gen, rec.row, rec.meet, view, at, priority, ended, hold, kind)
        else:
            what = rec.what
            if what < 0:
                what = rec.what = thin.what(kind, op_name)
            thin.ring_now(op_name, gen, rec.row, None, nbytes, at, at + at_out_rel, priority,
                          hold, ended, what, kind)  # fmt: skip
    except TotalReduceError:  # the op ended (failed), or never went: nothing writes there
        thin.space.free(at)
        raise
    except BaseException:
        # an interrupt while the op may be on its way: the service may still write the
        # block, so it is not given back (a handle's would be, when its op ends)
        if not submitted:
            thin.space.free(at)
        raise
    got = thin.arena.view(at + at_out_rel, rec.out_count, x.dtype)
    if out is not None:
        out.reshape(-1)[:] = got
        result = out
    else:
        result = got.copy()
        if kind is OpKind.BROADCAST:
            result = result.reshape(x.shape)
    thin.space.free(at)
    return result


#: The first item of the keys of :class:`ThinSized` records (an all-gather without counts).
THIN_AGV = "thinagv"


class ThinSized:
    """What a blocking repeat of an all-gather without ``counts`` in daemon mode needs, over
    the world or a group and without partition or dtype arguments, on an array of its first
    call's element type (of any shape and size: the result is flat).  As the whole way, its
    ranks first gather their parts' sizes (the op ``<name>#counts``), then the data with
    those parts; each is one compiled call into the ring (:meth:`~.thin.ThinClient.ring_now`),
    in the caller's thread, with no handle and no watcher thread.  It keeps both ops'
    descriptors (the counts' as the whole way writes it; the data's with its parts' block
    set per call, the last one kept), both names' signatures, and the group (None: the
    world) for a data op that must go the whole way (too large for one op)."""

    __slots__ = (
        "npdt", "shape", "dt", "size", "group", "sig", "csig", "count_name", "crow", "drow",
        "epoch", "ended", "hold", "what", "cended", "chold", "cwhat", "last_sizes", "last_row",
    )  # fmt: skip

    def __init__(
        self, x: np.ndarray, dt: DType, group: Any, size: int, sig: tuple[Any, ...],
        csig: tuple[Any, ...], count_name: str, crow: np.ndarray, drow: np.ndarray,
    ) -> None:  # fmt: skip
        self.npdt, self.shape, self.dt = x.dtype, x.shape, dt
        self.size, self.group = size, group
        self.sig, self.csig, self.count_name = sig, csig, count_name
        self.crow, self.drow = crow, drow
        self.epoch = tuning.EPOCH[0]
        #: as :class:`ThinExpress`'s, of the data op and (``c...``) of the counts op
        self.ended: Callable[[], None] | None = None
        self.hold: Callable[[], None] | None = None
        self.what = -1
        self.cended: Callable[[], None] | None = None
        self.chold: Callable[[], None] | None = None
        self.cwhat = -1
        #: the last sizes whose parts' block the client keeps, and the data op's
        #: descriptor that points there
        self.last_sizes: tuple[int, ...] | None = None
        self.last_row: np.ndarray | None = None


def thin_sized_remember(
    svc: Any, key: tuple[Any, ...], x: Any, h: Any, ranks: tuple[int, ...] | None
) -> None:
    """After an all-gather without counts went the whole way in daemon mode and ended
    well (its handle ``h``): keep a :class:`ThinSized` record under ``key`` if it was the
    thin path's two ops, over the world (``ranks`` None) or the group of ``ranks``, whose
    group's and count parts' blocks the client keeps."""
    from ..group import Group
    from .thin import descriptor

    thin = svc._thin
    if h.__class__ is not _ThinHandle or x.__class__ is not np.ndarray:
        return
    if not x.flags.c_contiguous or not isinstance(h.name, (str, int)):
        return
    res = h._result
    if res.__class__ is np.ndarray and not thin.takes(
        -(-x.nbytes // _ALIGN) * _ALIGN + res.nbytes
    ):  # too large for one op: its repeats go the whole way's pieces, sizes and all
        return
    size = svc.size if ranks is None else len(ranks)
    at_group, ctx = -1, 0
    if ranks is not None:
        at_group = thin.kept_at((size, *ranks))
        ctx = Group(ranks).context
        if at_group < 0:
            return
    at_ones = thin.kept_at((size, *(1 for _ in range(size))))
    if at_ones < 0:
        return
    count_name = f"{h.name}#counts"
    try:
        sig = svc._names.signature(h.name)
        csig = svc._names.signature(count_name)
        dt = DType.of(x.dtype)
    except (KeyError, TypeError, ValueError, TotalReduceError):
        return
    wire, cwire = svc._wire_id(h.name), svc._wire_id(count_name)
    crow = descriptor(int(OpKind.ALLGATHER), cwire, DType.INT64, 1, ReduceOp.SUM, 0, 0,
                      at_group, ctx, at_ones, 0)  # fmt: skip
    drow = descriptor(int(OpKind.ALLGATHER), wire, dt, int(x.size), ReduceOp.SUM, 0, 0,
                      at_group, ctx, -1, 0)  # fmt: skip
    group = None if ranks is None else Group(ranks)
    table = svc._express
    if len(table) >= MAX_RECORDS:
        table.clear()
    table[key] = ThinSized(x, dt, group, size, sig, csig, count_name, crow, drow)


def thin_sized_now(svc: Any, key: tuple[Any, ...], x: Any, priority: Any) -> Any:
    """A blocking repeat of the all-gather without counts of :class:`ThinSized` record
    ``key`` on ``x``: the sizes gathered in one compiled call, then the data in another
    (both staged in the arena as the whole way stages them).  The gathered flat array, or
    None when there is no record or anything differs or is unusual (the caller then goes
    the whole way).  A data op too large for one op of the arena goes the whole way's
    data phase (pieces) once the sizes are known."""
    try:
        rec = svc._express.get(key)
    except TypeError:  # (a key of something unhashable: not a repeat)
        return None
    if (  # as _thin_record's checks, but for the shape: its parts may change every call
        rec is None
        or rec.__class__ is not ThinSized
        or x.__class__ is not np.ndarray
        or x.dtype is not rec.npdt
        or not x.flags.c_contiguous
        or priority.__class__ is not int
        or not -(1 << 31) <= priority < 1 << 31
        or rec.epoch != tuning.EPOCH[0]
        or svc._closed
    ):
        return None
    thin = svc._thin
    if thin.busy():
        return None
    names = svc._names
    op_name, count_name, size = key[1], rec.count_name, rec.size
    gen = names.take(op_name, rec.sig)
    cgen = names.take(count_name, rec.csig)
    if rec.ended is None or rec.hold is None or rec.cended is None or rec.chold is None:
        rec.ended = functools.partial(names.ended, op_name)
        rec.hold = functools.partial(names.hold, op_name)
        rec.cended = functools.partial(names.ended, count_name)
        rec.chold = functools.partial(names.hold, count_name)
        rec.what = thin.what(OpKind.ALLGATHER, op_name)
        rec.cwhat = thin.what(OpKind.ALLGATHER, count_name)
    # the sizes: this rank's in, every rank's out (_ALIGN bytes on)
    cat = thin.stage(_ALIGN + 8 * size, None)
    thin.arena.view(cat, 1, np.dtype(np.int64))[0] = x.size
    submitted = False
    try:
        submitted = True
        thin.ring_now(count_name, cgen, rec.crow, None, 8, cat, cat + _ALIGN, priority,
                      rec.chold, rec.cended, rec.cwhat, OpKind.ALLGATHER)  # fmt: skip
    except TotalReduceError:
        thin.space.free(cat)
        raise
    except BaseException:
        if not submitted:
            thin.space.free(cat)
        raise
    sizes = tuple(thin.arena.view(cat + _ALIGN, size, np.dtype(np.int64)).tolist())
    thin.space.free(cat)
    total = sum(sizes)
    isz = x.itemsize
    rel = -(-x.nbytes // _ALIGN) * _ALIGN
    nbytes = rel + total * isz
    if not thin.takes(nbytes):  # the whole way's data phase (in pieces), with a handle
        names.hold(op_name)
        out = np.empty(total, dtype=x.dtype)
        final = _ThinHandle(thin, op_name, gen, OpKind.ALLGATHER, out, rec.ended)
        try:
            svc._thin_op(
                OpKind.ALLGATHER, x.reshape(-1), rec.dt, out, False, op_name, ReduceOp.SUM,
                priority, 0, out, group=rec.group, parts=sizes, reserved=(op_name, gen),
                handle=final,
            )  # fmt: skip
        except BaseException as exc:
            if not final._done:  # (its end ends the name's generation)
                thin.settle(final, None, exc)
            raise
        return final.wait()
    own = -1
    row = rec.last_row
    if sizes != rec.last_sizes or row is None:
        aux, own = thin.const_block((size, *sizes))
        row = rec.drow.copy()
        row[A.D_AUX], row[A.D_COUNT] = aux, x.size
        if own < 0:  # kept: the next call with these sizes points there too
            rec.last_sizes, rec.last_row = sizes, row
    at = thin.stage(max(nbytes, 1), x)
    submitted = False
    try:
        submitted = True
        thin.ring_now(op_name, gen, row, None, nbytes, at, at + rel, priority, rec.hold,
                      rec.ended, rec.what, OpKind.ALLGATHER)  # fmt: skip
    except TotalReduceError:  # the op ended (failed), or never went: nothing reads there
        thin.space.free(at)
        if own >= 0:
            thin.space.free(own)
        raise
    except BaseException:
        if not submitted:
            thin.space.free(at)
            if own >= 0:
                thin.space.free(own)
        raise
    result: np.ndarray = thin.arena.view(at + rel, total, x.dtype).copy()
    thin.space.free(at)
    if own >= 0:
        thin.space.free(own)
    return result

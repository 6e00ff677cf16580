"""The service as one compiled loop: a repeat among the nodes with no Python on the way.

On a service of several nodes, the arena thread's compiled pass (:mod:`.arena_pass`)
takes the clients' descriptors and makes the node's part of an op; the op then runs
among the services on their engine.  For the first occurrences of a shape Python starts
it there (``PassOps._fast_start``), and once the engine's express record of the shape
has the lane's fields the shape gets a *row* here: its key (wire id, kind, element type,
count, reduce op, a broadcast's root, node buffer's offset; a reduce-scatter's or
all-gather's parts' digest instead), the lane's fields, the buffers beside its input the
lane needs for it (the row's own; a reduce-scatter's or all-gather's node's part and
result too), and its name's entry in a table of names, which holds the name's next
generation among the services (a name's shapes share it).  The shapes are the compiled
pass's: allreduces, broadcasts, barriers, reduce-scatters and all-gathers over the world,
and the same kinds over a group that spans nodes (a reduce-scatter's or all-gather's node's
part in node order where the group's order interleaves the nodes; keyed by their name among
the services,
:func:`engine_name`, which mixes in the group's context; a broadcast's root a rank of the
group; an all-gather's count its first member's; their records carry the group's context,
``thin_nodes.GroupExpress``, and Python starts their first occurrences from
``AmongNodes._engine_op`` and ``_among_nodes``), whole among the nodes (a segmented one,
:func:`.arena_pass.pipelined`, stays Python's: docs/daemon.md says why), of any element
type but bfloat16 (a broadcast's too).  A group's op runs among the services of the nodes
it spans (the lane's fields have their group); the pass makes its node's part only once
its row is found, and hands the descriptors of one without a row to Python untouched.

From then on :func:`service_pass` runs a repeat of the shape whole: it takes the
descriptors (the pass), reduces the node's buffers (the pass), enters the op into the
services' lane and drives it for its first try (``lane.lane_service.lane_repeat``),
copies the result into every client's output, sets the completion words and wakes the
clients asleep (``arena_pass.arena_finish``, ``transport.meeting.wake_client``), then
looks at the rings again, until nothing came for ``spin`` or ``max`` passed.  It
holds the engine's lock meanwhile (``ServiceRepeats.begin``: taken only when nothing of
the engine's Python waits), and returns to Python, for it to take in order as before:

- anything the pass hands over (its out-queue; an op complete here whose shape has no
  row): ``WHY_PASS``, with the
  first of the pass's starts Python must take (the world's: a group's without a row go
  to the out-queue, :func:`.arena_pass.arena_hand_over`);
- a repeat that did not end in its try (the other nodes are late): ``WHY_ADOPT``,
  Python makes its handle, as ``LaneOps.now`` (``loop.ops.now``) does, and it goes on as any;
- the lane's events, a message of its main loop, a full table, a kick of another
  thread (an event, an op ended on the comm thread): ``WHY_LOOK``.

Python keeps the first occurrence of a shape, errors, stalls, membership and timeouts.
What the loop ran Python records when it returns (the names' generations, the engine's
completed ops), under the same hold of the lock.  ``TOTALREDUCE_SERVICE_LOOP=0`` in the
service's environment turns it off (every repeat then starts from Python, as before).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
from numba import njit

from ..kernels.raw import DT_BF16, copy_raw
from ..lane import lane_cache
from ..lane.lane_core import lane_pass  # noqa: F401 - (its cache directory: the probe's)
from ..lane.lane_service import TRY_NS, lane_repeat
from ..native.libc import now_ns, yield_cpu
from ..protocol import C_BFULL, C_FULL, C_NDONE, C_NEV, C_NFREEOP
from ..transport import arena as A
from ..transport.meeting import wake_client
from .arena_pass import (
    G_SIZE,
    S_KICKED,
    S_LOOPING,
    S_NOUT,
    S_NSIG,
    S_NSTART,
    _entry_to_python,
    _local,
    _member,
    _node_buffer,
    _tab,
    arena_finish,
    arena_finish_parts,
    arena_hand_over,
    arena_local_parts,
    arena_pass,
    parted,
    parts_digest,
    pipelined,
)

# ---------------------------------------------------------------- rows: the shapes
#: Rows (a power of two; a full table is cleared, as the engine's express records are).
ROWS = 4096
#: a row's words: in use, the name's wire id, the shape (element type, count, reduce op,
#: node buffer's offset: -1 for a barrier), its name's entry in the names' table (R_NAME:
#: the name's generations are its shapes' together), two words unused, the addresses of the
#: row's own buffers for a shape that needs them (0: none): the input's copy (an in-place
#: schedule that reads its input after writing it; of R_NBYTES), the schedule's work
#: buffer, the scratch of its large receives; and the rest of the shape: the kind
#: (allreduce, broadcast, barrier) and a broadcast's root (the client's rank)
(R_USED, R_WIRE, R_DTYPE, R_COUNT, R_OP, R_AT, R_NAME, _R_FREE1, _R_FREE2, R_COPY, R_WORK,
 R_SCR, R_NBYTES, R_KIND, R_ROOT) = range(15)  # fmt: skip
#: a reduce-scatter's or all-gather's row: the addresses of its own buffers for the node's
#: part and the nodes' result here (its R_AT: the digest of its parts, arena_pass.parts_digest)
R_IN, R_OUT = 15, 16
ROW_WORDS = 20
#: The names' table (as many entries as rows): in use, the wire id, the name's next
#: generation among the services, the repeats its shapes ran since Python last looked and
#: the first of their generations.  A name has a row per shape (a broadcast's roots, say)
#: and one generation counter, so a name whose shapes alternate stays in the loop.
(N_USED, N_WIRE, N_GEN, N_DONE, N_FIRST) = range(5)  # fmt: skip
NAME_WORDS = 8
#: The most bytes of such buffers the rows keep in all (more: those shapes stay Python's).
ROW_BUFFER_BYTES = 512 << 20
_HASH = 0x9E3779B97F4A7C15 - (1 << 64)
_D_CTX = A.D_CTX

# ---------------------------------------------------------------- io: Python's words
#: in: the call's span, the spin after its last work, the lane's first try, the lane's
#: spin, lane_drive's take bits, urgency (1), the least and most priority
(IO_MAX_NS, IO_SPIN_NS, IO_TRY_NS, IO_LSPIN_NS, IO_TAKE, IO_URGENT, IO_PRIO_LO,
 IO_PRIO_HI) = range(8)  # fmt: skip
#: out: why it returned, the first of the pass's starts Python takes, and for WHY_ADOPT the
#: entry, row, lane slot, submission, generation and priority; repeats ended, descriptors
#: taken, names that ran repeats (their entries, listed from IO_TOUCHED)
(IO_WHY, IO_FIRST, IO_ENTRY, IO_ROW, IO_SLOT, IO_SEQ, IO_GEN, IO_PRIO, IO_RAN, IO_TAKEN,
 IO_NTOUCHED) = range(8, 19)  # fmt: skip
#: in: the longest first try in the lane (a large op's try lasts a nanosecond a byte, at
#: least ``IO_TRY_NS``; a client's next descriptor ends it sooner: the lane's outer words)
IO_TRY_MAX_NS = 30
IO_TOUCHED = 32
TOUCHED = 64
IO_WORDS = IO_TOUCHED + TOUCHED
WHY_IDLE, WHY_PASS, WHY_ADOPT, WHY_LOOK = 0, 1, 2, 3

_AR, _BC, _BAR, _RS, _AG = 1, 2, 3, 4, 5  # OpKind's: the pass's kinds
_D_KIND, _D_WIRE, _D_DTYPE, _D_COUNT, _D_OP, _D_PRIO, _D_FLAGS, _D_ALGO, _D_ROOT = (
    A.D_KIND, A.D_WIRE, A.D_DTYPE, A.D_COUNT, A.D_OP, A.D_PRIO, A.D_FLAGS, A.D_ALGO, A.D_ROOT,
)  # fmt: skip
_F_UNNAMED = A.F_UNNAMED
_H_LOOP_RAN, _H_LOOP_ENTERED = A.H_LOOP_RAN, A.H_LOOP_ENTERED
_C_SLEEPING = A.C_SLEEPING


def service_loop_default() -> bool:
    """Whether a service of several nodes runs its repeats in its compiled loop
    (``TOTALREDUCE_SERVICE_LOOP``, in the service's environment: ``0`` turns it off)."""
    return os.environ.get("TOTALREDUCE_SERVICE_LOOP", "1").strip().lower() not in (
        "0", "off", "no",
    )  # fmt: skip


@njit(nogil=True, cache=True)
def _home(wire):  # type: ignore[no-untyped-def]
    return ((wire * _HASH) >> 20) & (ROWS - 1)


@njit(nogil=True, cache=True)
def name_of(names, wire, make):  # type: ignore[no-untyped-def]
    """The entry of name ``wire`` in the names' table; with ``make``, a free one made for
    it; -1 when none (or the table is full)."""
    h = _home(wire)
    for i in range(ROWS):
        n = (h + i) & (ROWS - 1)
        if names[n, N_USED] == 0:
            if make:
                names[n, N_USED] = 1
                names[n, N_WIRE] = wire
                return n
            return -1
        if names[n, N_WIRE] == wire:
            return n
    return -1


@njit(nogil=True, cache=True)
def row_of(rows, wire, dtype, count, op, at, kind, root, make):  # type: ignore[no-untyped-def]
    """The row of a shape of name ``wire`` (one per shape); with ``make``, a free one made
    for it (its shape set); -1 when none (or the table is full)."""
    h = _home(wire ^ ((((kind * 31 + root) * 31 + dtype) * 1_000_003 + count) * 31 + op) ^ at)
    for i in range(ROWS):
        r = (h + i) & (ROWS - 1)
        if rows[r, R_USED] == 0:
            if make:
                rows[r, R_USED] = 1
                rows[r, R_WIRE], rows[r, R_DTYPE], rows[r, R_COUNT] = wire, dtype, count
                rows[r, R_OP], rows[r, R_AT], rows[r, R_KIND] = op, at, kind
                rows[r, R_ROOT] = root
                return r
            return -1
        if (
            rows[r, R_WIRE] == wire and rows[r, R_DTYPE] == dtype and rows[r, R_COUNT] == count
            and rows[r, R_OP] == op and rows[r, R_AT] == at and rows[r, R_KIND] == kind
            and rows[r, R_ROOT] == root
        ):  # fmt: skip
            return r
    return -1


@njit(nogil=True, cache=True)
def engine_name(wire, ctx):  # type: ignore[no-untyped-def]
    """The name among the services of a client's op of wire id ``wire`` over the group of
    context ``ctx`` (0: the world): ``AmongNodes._engine_name``'s, as a signed word."""
    if ctx == 0:
        return wire
    return wire ^ (ctx * _HASH)


@njit(nogil=True, cache=True)
def _row_for(rows, st, groups, egrp, amem, descs, e, io):  # type: ignore[no-untyped-def]
    """The row that runs entry ``e`` (complete here) among the nodes, or -1 (Python's): a
    whole allreduce, broadcast, barrier, reduce-scatter or all-gather over the world or a
    group, of a shape the row has (a group's op: under its name among the services,
    :func:`engine_name`; a broadcast's root: a rank of its group; an all-gather's count:
    its first member's, in group order, as Python's ``_Op.first``)."""
    d0 = descs[e, 0]
    kind = d0[_D_KIND]
    if kind != _AR and kind != _BC and kind != _BAR and kind != _RS and kind != _AG:
        return -1
    if d0[_D_ALGO] != 0 or (d0[_D_FLAGS] & _F_UNNAMED) != 0:
        return -1
    if (d0[_D_DTYPE] == DT_BF16 and kind != _BC) or pipelined(st, d0):  # (a bf16 row: bytes)
        return -1
    if not (io[IO_PRIO_LO] <= d0[_D_PRIO] <= io[IO_PRIO_HI]):
        return -1
    root = d0[_D_ROOT] if kind == _BC else 0
    at = _where(st, groups, egrp, amem, descs, e)
    wire = engine_name(d0[_D_WIRE], d0[_D_CTX])
    count = descs[e, _member(st, groups, egrp[e], 0), _D_COUNT]  # (an all-gather's: its first's)
    return row_of(rows, wire, d0[_D_DTYPE], count, d0[_D_OP], at, kind, root, False)


@njit(nogil=True, cache=True)
def _where(st, groups, egrp, amem, descs, e):  # type: ignore[no-untyped-def]
    """What a row keys entry ``e`` on beside its kind and sizes: its node buffer's offset,
    or a reduce-scatter's or all-gather's parts (their digest: its buffers are the row's)."""
    if parted(descs[e, 0]):
        return parts_digest(amem, descs[e, 0], groups[egrp[e], G_SIZE])
    return _node_buffer(st, groups, egrp, descs, e)


@njit(nogil=True, cache=True)
def _wake(st, sig, cw, abase):  # type: ignore[no-untyped-def]
    """Wake the clients the last pass or finish listed (none left for Python)."""
    for i in range(st[S_NSIG]):
        wake_client(abase + 8 * cw[sig[i]])
    st[S_NSIG] = 0


@njit(nogil=True, cache=True)
def _lane_waits(lmem):  # type: ignore[no-untyped-def]
    return (
        lmem[C_NEV] != 0 or lmem[C_FULL] != 0
        or lmem[C_BFULL] != 0 or lmem[C_NDONE] != 0
    )  # fmt: skip


@njit(nogil=True, cache=True)
def service_pass(fbuf, flay, amem, abase, rows, names, fields, lmem, prog, larena, b, addrs, io):  # type: ignore[no-untyped-def]
    """Take the clients' descriptors and run every repeat they complete whose shape has a
    row, to its completion words, until Python must look (``io[IO_WHY]``, see the module
    docstring) or nothing came for ``io[IO_SPIN_NS]``, at most ``io[IO_MAX_NS]``.
    ``fbuf``/``flay``: the pass's table; ``amem``, ``abase``: the arena as words and its
    address; ``rows``, ``names``, ``fields``: the shapes and their names; ``lmem``...``b``:
    the services' lane (its lock held); ``addrs``: 4 words of scratch.  The pass's starts
    it leaves to Python are the world's (a group's go to the out-queue,
    :func:`.arena_pass.arena_hand_over`)."""
    st = _tab(fbuf, flay)[0]
    st[S_LOOPING] = 1
    _service_pass(fbuf, flay, amem, abase, rows, names, fields, lmem, prog, larena, b, addrs, io)
    st[S_LOOPING] = 0
    if io[IO_WHY] == WHY_PASS or io[IO_WHY] == WHY_ADOPT:
        arena_hand_over(fbuf, flay, io[IO_FIRST])


@njit(nogil=True, cache=True)
def _service_pass(fbuf, flay, amem, abase, rows, names, fields, lmem, prog, larena, b, addrs, io):  # type: ignore[no-untyped-def]
    tab = _tab(fbuf, flay)
    st, cw, descs, sig, starts = tab[0], tab[4], tab[8], tab[15], tab[17]
    groups, egrp = tab[19], tab[20]
    t0 = now_ns()
    last = t0
    io[IO_WHY] = WHY_IDLE
    io[IO_FIRST] = 0
    io[IO_RAN] = 0
    io[IO_TAKEN] = 0
    io[IO_NTOUCHED] = 0
    while True:
        taken = arena_pass(fbuf, flay, amem, abase)
        if taken > 0:
            io[IO_TAKEN] += taken
            last = now_ns()
            _wake(st, sig, cw, abase)
            if st[S_NOUT] > 0:
                io[IO_WHY] = WHY_PASS
                return
            for i in range(st[S_NSTART]):
                e = starts[i]
                # (a group's segmented op is a start for Python, as the world's)
                grouped = egrp[e] != 0 and not pipelined(st, descs[e, 0])
                r = _row_for(rows, st, groups, egrp, amem, descs, e, io)
                if (
                    r < 0
                    or (names[rows[r, R_NAME], N_DONE] == 0 and io[IO_NTOUCHED] >= TOUCHED)
                    or (grouped and lmem[C_NFREEOP] == 0)  # (the lane's table is full)
                ):
                    if grouped:  # Python starts it, from its descriptors
                        _entry_to_python(tab, e)
                        continue
                    io[IO_WHY] = WHY_PASS
                    io[IO_FIRST] = i
                    return
                split = rows[r, R_KIND] == _RS or rows[r, R_KIND] == _AG  # own buffers
                if grouped and not split:  # its node's part: made now that it runs here
                    _local(st, groups, egrp, abase, descs, e, 0, descs[e, 0, _D_COUNT])
                at = abase + max(rows[r, R_AT], 0)  # (a barrier's: no byte of it is read)
                if split:
                    arena_local_parts(fbuf, flay, amem, abase, e, rows[r, R_IN])
                    at = rows[r, R_IN]
                addrs[0] = at
                addrs[1] = rows[r, R_OUT] if split else at
                if rows[r, R_COPY] != 0:  # the schedule reads its input after writing it
                    copy_raw(rows[r, R_COPY], at, rows[r, R_NBYTES])
                    addrs[0] = rows[r, R_COPY]
                addrs[2] = rows[r, R_WORK]
                addrs[3] = rows[r, R_SCR]
                nm = rows[r, R_NAME]
                gen = names[nm, N_GEN]
                prio = descs[e, 0, _D_PRIO]
                try_ns = max(io[IO_TRY_NS], min(rows[r, R_NBYTES], io[IO_TRY_MAX_NS]))
                slot, seq, res = lane_repeat(
                    lmem, prog, larena, b, fields[r], addrs, gen, prio, io[IO_URGENT],
                    try_ns, io[IO_LSPIN_NS], io[IO_TAKE],
                )  # fmt: skip
                if slot < 0:  # the lane's table is full: Python's way (a group's: not here)
                    io[IO_WHY] = WHY_PASS
                    io[IO_FIRST] = i
                    return
                names[nm, N_GEN] = gen + 1
                amem[_H_LOOP_ENTERED] += 1
                if res != 2:  # entered, not ended: Python makes its handle
                    io[IO_WHY] = WHY_ADOPT
                    io[IO_ENTRY] = e
                    io[IO_ROW] = r
                    io[IO_SLOT] = slot
                    io[IO_SEQ] = seq
                    io[IO_GEN] = gen
                    io[IO_PRIO] = prio
                    io[IO_FIRST] = i + 1
                    return
                if names[nm, N_DONE] == 0:
                    names[nm, N_FIRST] = gen
                    io[IO_TOUCHED + io[IO_NTOUCHED]] = nm
                    io[IO_NTOUCHED] += 1
                names[nm, N_DONE] += 1
                if split:
                    arena_finish_parts(fbuf, flay, amem, abase, e, rows[r, R_OUT])
                else:
                    arena_finish(fbuf, flay, amem, abase, e, 1)
                _wake(st, sig, cw, abase)
                amem[_H_LOOP_RAN] += 1
                io[IO_RAN] += 1
                last = now_ns()
            st[S_NSTART] = 0
            if st[S_NOUT] > 0:  # a group's op the loop has no row for: Python's
                io[IO_WHY] = WHY_PASS
                io[IO_FIRST] = 0
                return
            if _lane_waits(lmem):
                io[IO_WHY] = WHY_LOOK
                return
            continue
        if st[S_KICKED] != 0 or _lane_waits(lmem):
            io[IO_WHY] = WHY_LOOK
            return
        t = now_ns()
        if t - t0 > io[IO_MAX_NS] or t - last > io[IO_SPIN_NS]:
            return
        yield_cpu()


class Shapes:
    """The rows of :func:`service_pass` and what Python keeps beside them: per row, the
    node buffer's view and the engine's express record (for a repeat Python adopts)."""

    def __init__(self) -> None:
        self.rows = np.zeros((ROWS, ROW_WORDS), np.int64)
        self.names = np.zeros((ROWS, NAME_WORDS), np.int64)
        #: name entry -> (wire id, an express record of the name: its wire id and group)
        self.named: dict[int, tuple[int, Any]] = {}
        self.fields = np.zeros((ROWS, 16), np.int64)
        self.addrs = np.zeros(4, np.int64)
        self.io = np.zeros(IO_WORDS, np.int64)
        self.io[IO_TRY_NS] = TRY_NS
        self.io[IO_TRY_MAX_NS] = 100_000_000
        self.io[IO_URGENT] = 1
        self.io[IO_PRIO_LO], self.io[IO_PRIO_HI] = -(1 << 31), (1 << 31) - 1
        #: row -> (wire id, node buffer's view, express record, the row's own buffers, the
        #: result's view: the node buffer's, but a reduce-scatter's or all-gather's own)
        self.kept: dict[int, tuple[int, np.ndarray, Any, tuple[np.ndarray, ...], np.ndarray]] = {}
        self.buffer_bytes = 0
        self.names_seen = -1  # the name table's version the rows' generations are of
        self.epoch = -1  # the tuning epoch of the records
        #: The engine lane's ``plans_epoch`` the rows' lane fields (plan and group offsets) are
        #: of: a compaction of its plans moves them, and the rows go (``PassOps._loop_shape``).
        self.plans_epoch = 0

    def put(self, shape: tuple[int, ...], buf: np.ndarray, ex: Any, gen: int) -> bool:
        """Give ``shape`` (wire id, dtype, count, reduce op, algorithm, node buffer's
        offset, or a reduce-scatter's or all-gather's parts' digest, kind, a broadcast's
        root; algorithm 0), whose lane fields ``ex.lane_shape`` has, its row (beside its
        name's other shapes': ``gen``, the name's next generation, is theirs too); False
        when its buffers would pass
        :data:`ROW_BUFFER_BYTES` (it stays Python's).  A reduce-scatter's or all-gather's
        ``buf`` is only its node's part's type and size: the row has buffers of its own for
        it and its result."""
        ls = ex.lane_shape
        split = shape[6] in (_RS, _AG)
        sizes = (
            buf.nbytes if ls.copy_in else 0,
            ls.work * buf.itemsize,
            ls.scratch,
            buf.nbytes if split else 0,
            ex.out_count * buf.itemsize if split else 0,
        )
        need = sum(sizes)
        wire = shape[0]
        key = (wire, shape[1], shape[2], shape[3], shape[5], shape[6], shape[7])
        r = int(row_of(self.rows, *key, False))
        old = self.kept.pop(r, None) if r >= 0 else None
        if old is not None:
            self.buffer_bytes -= sum(b.nbytes for b in old[3])
            self.rows[r, R_IN] = self.rows[r, R_OUT] = 0
        if self.buffer_bytes + need > ROW_BUFFER_BYTES:
            if r >= 0:
                self.rows[r, R_DTYPE] = -1  # (no descriptor has it: the row runs nothing)
            return False
        if r < 0:
            if len(self.kept) >= ROWS // 2:
                self.clear()
            r = int(row_of(self.rows, *key, True))
        n = int(name_of(self.names, wire, True))
        if n not in self.named:
            self.names[n, N_DONE] = 0
        self.named[n] = (wire, ex)
        self.names[n, N_GEN] = gen
        own = tuple(np.empty((n + 7) // 8, np.int64) for n in sizes if n)
        self.buffer_bytes += need
        row = self.rows[r]
        row[R_NAME], row[R_NBYTES] = n, buf.nbytes
        it = iter(own)
        mine: list[np.ndarray] = []
        for col, n in zip((R_COPY, R_WORK, R_SCR, R_IN, R_OUT), sizes, strict=True):
            b = next(it) if n else None
            row[col] = 0 if b is None else b.ctypes.data
            mine.append(b.view(buf.dtype)[: n // buf.itemsize] if b is not None else buf)
        out = buf
        if split:
            buf, out = mine[3], mine[4]
        self.fields[r] = ls.fields
        self.kept[r] = (wire, buf, ex, own, out)
        return True

    def find(self, shape: tuple[int, ...]) -> int:
        """The row of ``shape`` (:meth:`put`'s), or -1."""
        return int(
            row_of(self.rows, shape[0], shape[1], shape[2], shape[3], shape[5], shape[6],
                   shape[7], False)
        )  # fmt: skip

    def clear(self) -> None:
        self.rows[:] = 0
        self.names[:] = 0
        self.named.clear()
        self.kept.clear()
        self.buffer_bytes = 0


#: What the loop's machine code is made of (a change to any flushes its cached code): its
#: own modules and the node's memory, and everything the lane's code is made of.
SOURCES = (
    "daemon/service_loop.py",
    "daemon/arena_pass.py",
    "lane/lane_service.py",
    "transport/meeting.py",
    "transport/arena.py",
    *lane_cache.SOURCES,
)
_MODULES = ("daemon.service_loop", "lane.lane_service")


def _compile() -> None:
    from numba import types

    from ..lane.plain_constants import plain_constants

    i64 = types.int64
    v1 = types.Array(types.int64, 1, "C")
    v2 = types.Array(types.int64, 2, "C")
    u8 = types.Array(types.uint8, 1, "C")
    with plain_constants():
        service_pass.compile((v1, v2, v1, i64, v2, v2, v2, v1, v1, u8, v1, v1, v1))
        engine_name.compile((i64, i64))
        parts_digest.compile((v1, v1, i64))
        row_of.compile((v2, i64, i64, i64, i64, i64, i64, i64, types.boolean))
        name_of.compile((v2, i64, types.boolean))


def prepare() -> None:
    """Compile the loop (or load it from Numba's cache): in the service's start.  It
    links the services' lane into itself: the first time, about as long again as the
    lane's own compile."""
    from ..lane.compile_once import compile_once
    from ..lane.lane_cache import cache_is_current, forget_stale_cache
    from . import arena_pass

    # The pass's functions first (their stale cache dropped, then compiled and saved): the
    # loop links them in, and a check of theirs after that would drop what it just saved,
    # which every later process then compiled again.
    arena_pass.prepare()
    compile_once(
        _compile,
        service_pass,
        name="service_loop",
        what="the service's compiled loop",
        takes="about half a minute on a small machine",
        current=lambda: cache_is_current(service_pass, SOURCES, "service_loop.sources"),
        forget=lambda: forget_stale_cache(service_pass, SOURCES, _MODULES, "service_loop.sources"),
    )

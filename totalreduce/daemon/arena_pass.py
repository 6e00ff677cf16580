"""The arena thread's compiled pass: the common op of one node runs without Python.

The arena thread of a node's service (:mod:`.thin`) reads its clients' submission
rings.  Most of what it reads is the same few ops again and again: an allreduce, a
broadcast or a barrier over the whole world, of a gradient's element type.  On a
service with one node, :func:`arena_pass` takes such descriptors into a table of
arrays, and when every local client has submitted one it reduces the buffers in place
in the arena (the kernels of :mod:`totalreduce.kernels.raw`, the same bits as the
Python path), copies the result into the other clients' outputs and sets their
completion words.  No Python object is made per op.  On a service of several nodes it
takes reduce-scatters and all-gathers over the world too: their parts (one count per
rank, in a block of words each client's descriptor names) are checked and compared among
the node's clients, and their node's part goes to a buffer of the caller's
(:func:`arena_local_parts`), their result back from one (:func:`arena_finish_parts`).

It takes a group's allreduces, broadcasts and barriers too, and its reduce-scatters and
all-gathers (their parts one per group rank: the node's part its members' inputs reduced or
joined in group order, laid out in node order where the group's order interleaves the nodes,
``G_IDENT`` 0; one whose group lies on this node, the world's on a service of one node,
runs here from the members' inputs to their outputs, :func:`_one_node_parts`), once the
group has a row of its table
of groups (``groups``: by context, the digest of the group's ranks; row 0 is
the world's; Python gives a group its row at its first op, ``Table.put_group``, so a
descriptor carries only the context to find it by): an op waits for the node's members
only, its node's part is their inputs reduced in group order into the first member's
output (Python's order, ``ThinService._reduce``), and only they are answered, an ``avg``
divided by the group's size.  A group whose members all live on this node ends here
(counted in the arena's header, ``AR_H_PASS_GROUP``).  One that spans nodes is a start
for the service's compiled loop (:mod:`.service_loop`, ``st[S_LOOPING]``), which makes
its node's part once it has its row; without one, and whenever the pass runs outside the
loop, its descriptors go to Python untouched (:func:`arena_hand_over`).  An entry's
``descs[e, 0]`` always has the op's shape (a copy of a member's where slot 0 is none).

Everything else goes to Python, in order, through an *out-queue* of descriptors that
``ThinService`` takes one by one as before:

- a descriptor that is not such an op (a group's the table has no row for or whose
  slot is no member of it; an algorithm named, a window's, a dtype the raw kernels do not
  take; a reduce-scatter or all-gather run here whose output overlaps its input), or that
  is wrong in any way (Python finds what, and says it);
- one of a name and generation the pass answered over another group that has a member
  here in common with its group (:data:`DONES`): Python fails it and tells those members;
- one whose (wire id, generation) Python has had before (:data:`PYKEYS`, a cache of
  them): its other parts go where it went;
- one that meets an op of the table it does not agree with (two groups under one name
  and generation too), or that its client submitted twice: the op's descriptors in the
  table go out first, in the order they came, so Python sees them as if it had taken
  them all;
- an op complete on a service of several nodes (the services' engine runs it; the pass
  has made its node's part, but for an op run in segments, :func:`pipelined`, whose
  node's part Python makes and hands back segment by segment, with :func:`arena_local`
  and :func:`arena_back`);
- and, by :func:`arena_eject`, the whole table before Python handles an event (a
  client attached, left or died, a new session, the service stops) and every op that
  has waited a second (the stall inspector's, and the rare key the cache forgot).

The pass is on only while no rank is gone (``st[S_ON]``): Python owns every op then.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ..kernels.raw import (
    DT_BF16,
    DT_F16,
    DT_F32,
    DT_F64,
    DT_I32,
    DT_I64,
    ITEMSIZE,
    average_raw,
    copy_raw,
    reduce3_raw,
    reduce_raw,
)
from ..native.intrinsics import fence
from ..native.libc import now_ns
from ..protocol import AR_H_PASS_GROUP
from ..transport import arena as A

# ---------------------------------------------------------------- st: the pass's scalars
#: on (no rank gone), slots, world size, nodes, the slot's first rank (node * slots),
#: data bytes per slot, live entries, out-queue rows, slots to wake, descriptors taken,
#: the first free entry, ops to start among the nodes, the least bytes of a segmented op,
#: the sum of the rings' tails the last pass saw, and a flag another thread sets when it
#: leaves the arena thread work (the last two are the outer words of the services'
#: lane: a drive among the nodes ends when either moves, ``ThinService``)
(S_ON, S_SLOTS, S_SIZE, S_NODES, S_BASE_RANK, S_DATA, S_LIVE, S_NOUT, S_NSIG, S_TAKEN,
 S_FREE, S_NSTART, S_PIPE, S_TAILS, S_KICKED) = range(15)  # fmt: skip
#: set while the service's compiled loop (:mod:`.service_loop`) runs the pass: a group's op
#: among the nodes complete here goes to its starts then (else, to Python's out-queue)
S_LOOPING = 15
#: the descriptors of this pass's starts that are a group's (Python's, if the loop has no
#: row for them: the out-queue keeps room for them)
S_GPEND = 16
ST_WORDS = 18

#: Groups the table knows (row 0: the world); a group's op whose group has no row is Python's.
GROUPS = 64
#: a group's row: its context (the digest of its ranks: ``Group.context``, signed), its
#: members on this node, its size, the nodes it spans, in use; then per slot its place
#: among the node's members (-1: none), the node's members' slots in group order, and
#: each group rank's world rank, and the node's members' group ranks (group order)
G_CTX, G_LOCAL, G_SIZE, G_NODES, G_USED = range(5)
#: whether the group's ranks lie node after node in group order (Python's ``_Grp.identity``:
#: a reduce-scatter's or all-gather's parts then need no reordering between the nodes)
G_IDENT = 5
G_HEAD = 8

#: Ops the table holds at most (more wait in Python's tables).
CAP = 1024
#: Hash buckets of the table (a power of two).
BUCKETS = 2048
#: Keys Python took, remembered direct-mapped (a power of two).
PYKEYS = 4096
#: Descriptors the out-queue holds (and two per slot).
QCAP = 256
#: A group's ops the pass answered, remembered direct-mapped by (wire id, generation) (a
#: power of two): a rank of the node that submits one of those names and generations later,
#: over another group that has a member who took part, goes to Python, which fails it and
#: posts the late errors of the ranks that completed it (:meth:`Table.done_of`).
DONES = 1024
#: a remembered op's words: wire id, generation, its group's context; then per slot the
#: ticket of its descriptor (0: no member) and the slot's incarnation then
DN_WIRE, DN_GEN, DN_CTX, DN_HEAD = 0, 1, 2, 3
#: An allreduce or broadcast among the nodes of at least this many bytes, on a service
#: of several clients, runs in :data:`SEGMENTS` segments (every service of a job must
#: take the same: ``ThinService``'s ``pipe_min_bytes``, for tests): the node's part of segment
#: ``i + 1`` is made while segment ``i`` crosses between the nodes, and each segment's
#: result goes back to the clients as soon as it comes (:mod:`.thin_nodes`).
PIPE_MIN_BYTES = 4 << 20
#: How many segments such an op runs in (each its own op among the services).
SEGMENTS = 8

# kinds and flags, as constants of the compiled code
_AR, _BC, _BAR = 1, 2, 3  # OpKind.ALLREDUCE, BROADCAST, BARRIER (checked below)
_RS, _AG = 4, 5  # OpKind.REDUCE_SCATTER, ALLGATHER
_OP_SUM, _OP_AVG, _OP_BXOR = 1, 2, 8
_SIMPLE_FLAGS = A.F_AVG | A.F_UNNAMED
_HASH = 0x9E3779B97F4A7C15 - (1 << 64)  # 2^64 / golden ratio, as a signed word

_RING_WORD, _DONE_WORD, _RING, _DW = A.RING_WORD, A.DONE_WORD, A.RING, A.D_WORDS
_C_TAIL, _C_HEAD, _C_SLEEPING = A.C_TAIL, A.C_HEAD, A.C_SLEEPING
_H_PASS_GROUP = AR_H_PASS_GROUP
(_D_TICKET, _D_KIND, _D_WIRE, _D_GEN, _D_DTYPE, _D_COUNT, _D_OP, _D_ROOT, _D_PRIO, _D_IN,
 _D_OUT, _D_FLAGS, _D_GROUP, _D_CTX, _D_AUX, _D_ALGO) = range(16)  # fmt: skip


class Table:
    """The pass's arrays: shared by Python (which makes and reads them) and the pass.

    They are views of one int64 buffer, :attr:`buf`; :attr:`lay` says where each lies
    (offset and shape, in :data:`_TAB`'s order).  The compiled functions Python calls
    take those two arrays and make the views themselves (:func:`_tab`): a tuple of the
    twenty-one arrays, as an argument, cost 1.7 µs of Numba's dispatch per call."""

    def __init__(
        self, slots: int, nodes: int, node: int, data_bytes: int,
        pipe_min_bytes: int = PIPE_MIN_BYTES,
    ) -> None:  # fmt: skip
        shapes = {
            "st": (ST_WORDS,),
            "heads": (slots,),  # descriptors taken from each ring
            "incs": (slots,),  # each slot's incarnation, 0: none attached
            "lo": (slots,),  # each slot's data region (arena offsets)
            "cw": (slots,),  # each slot's control block (arena words)
            "keys": (CAP, 2),  # (wire id, generation)
            "seen": (CAP,),  # descriptors come
            "order": (CAP, slots),  # the slots, in the order they came
            "descs": (CAP, slots, _DW),
            "born": (CAP,),  # now_ns() of its first descriptor
            "bucket": (BUCKETS,),
            "next": (CAP,),  # the bucket's chain; the free list
            "pykeys": (PYKEYS, 2),
            "outq": (QCAP + 2 * slots, _DW),
            "outslot": (QCAP + 2 * slots,),
            "sig": (slots,),  # slots whose client sleeps: wake them
            "wake": (slots,),  # 1: in sig already
            "starts": (CAP,),  # ops complete here, to run among the nodes
            "tmp": (_DW,),
            "groups": (GROUPS, G_HEAD + 3 * slots + nodes * slots),
            "egrp": (CAP,),  # each entry's group row (0: the world)
            "dones": (DONES, DN_HEAD + 2 * slots),  # a group's ops answered (DONES)
        }
        self.lay = lay = np.zeros((len(_TAB), 4), np.int64)
        at = 0
        for i, name in enumerate(_TAB):
            shape = shapes[name]
            lay[i, 0] = at
            lay[i, 1 : 1 + len(shape)] = shape
            at += int(np.prod(shape))
        self.buf = buf = np.zeros(at, np.int64)
        for i, name in enumerate(_TAB):
            shape = shapes[name]
            o = int(lay[i, 0])
            setattr(self, name, buf[o : o + int(np.prod(shape))].reshape(shape))
        st = self.st
        st[S_SLOTS], st[S_SIZE], st[S_NODES] = slots, nodes * slots, nodes
        st[S_PIPE] = pipe_min_bytes
        st[S_BASE_RANK], st[S_DATA] = node * slots, data_bytes
        self.bucket[:] = -1
        self.next[:] = -1
        self.next[: CAP - 1] = np.arange(1, CAP)
        st[S_FREE] = 0
        self.pykeys[:] = -1  # generations are >= 0
        self.dones[:, DN_GEN] = -1
        self.slots, self.node = slots, node
        self.put_group(0, tuple(range(nodes * slots)))  # row 0: the world

    def done_of(
        self, wire: int, gen: int
    ) -> tuple[int, tuple[int, ...], dict[int, tuple[int, int]]] | None:
        """A group's op of (wire id, generation) the pass answered, if it still remembers
        it (:data:`DONES`): its group's context and ranks, and per member slot of the node
        its descriptor's ticket and the slot's incarnation then."""
        row = self.dones[_done_of(wire, gen)]
        if row[DN_WIRE] != wire or row[DN_GEN] != gen:
            return None
        ctx, slots = int(row[DN_CTX]), self.slots
        groups = self.groups
        for g in range(1, GROUPS):
            if groups[g, G_USED] and groups[g, G_CTX] == ctx:
                at = G_HEAD + 2 * slots
                ranks = tuple(int(r) for r in groups[g, at : at + groups[g, G_SIZE]])
                break
        else:
            return None
        took = {
            k: (int(row[DN_HEAD + k]), int(row[DN_HEAD + slots + k]))
            for k in range(slots)
            if row[DN_HEAD + k] != 0
        }
        return ctx, ranks, took

    def forget_dones(self) -> None:
        """A new session: no op of the last one is remembered."""
        self.dones[:, DN_GEN] = -1

    def put_group(self, ctx: int, ranks: tuple[int, ...]) -> int:
        """Give the group of context ``ctx`` (signed, 0: the world) and world ranks
        ``ranks`` (this node has a member) a row, if it has none and one is free: then
        the pass takes its allreduces, broadcasts and barriers.  Its row, or -1."""
        groups, slots = self.groups, self.slots
        for g in range(GROUPS):
            if groups[g, G_USED] and groups[g, G_CTX] == ctx:
                return g
            if groups[g, G_USED] == 0 and (g == 0) == (ctx == 0):
                break
        else:
            return -1
        row = groups[g]
        row[:] = 0
        pos = row[G_HEAD : G_HEAD + slots]
        mem = row[G_HEAD + slots : G_HEAD + 2 * slots]
        pos[:] = -1
        mem[:] = -1
        size = self.st[S_SIZE]
        grank = row[G_HEAD + 2 * slots + size : G_HEAD + 3 * slots + size]
        n = 0
        for j, r in enumerate(ranks):
            if r // slots == self.node:
                pos[r % slots] = n
                mem[n] = r % slots
                grank[n] = j
                n += 1
        row[G_HEAD + 2 * slots : G_HEAD + 2 * slots + len(ranks)] = ranks
        row[G_CTX], row[G_LOCAL], row[G_SIZE] = ctx, n, len(ranks)
        row[G_NODES] = len({r // slots for r in ranks})
        nodes = [r // slots for r in ranks]
        row[G_IDENT] = int(nodes == sorted(nodes))
        row[G_USED] = 1
        return g


#: The arrays of :class:`Table`, in the order of :attr:`Table.lay` (and of :func:`_tab`).
_TAB = ("st", "heads", "incs", "lo", "cw", "keys", "seen", "order", "descs", "born", "bucket",
        "next", "pykeys", "outq", "outslot", "sig", "wake", "starts", "tmp", "groups",
        "egrp", "dones")  # fmt: skip


@njit(nogil=True, cache=True)
def _v1(buf, lay, i):  # type: ignore[no-untyped-def]
    o = lay[i, 0]
    return buf[o : o + lay[i, 1]]


@njit(nogil=True, cache=True)
def _v2(buf, lay, i):  # type: ignore[no-untyped-def]
    o, n0, n1 = lay[i, 0], lay[i, 1], lay[i, 2]
    return buf[o : o + n0 * n1].reshape((n0, n1))


@njit(nogil=True, cache=True)
def _v3(buf, lay, i):  # type: ignore[no-untyped-def]
    o, n0, n1, n2 = lay[i, 0], lay[i, 1], lay[i, 2], lay[i, 3]
    return buf[o : o + n0 * n1 * n2].reshape((n0, n1, n2))


@njit(nogil=True, cache=True)
def _tab(buf, lay):  # type: ignore[no-untyped-def]
    """The table's arrays as views of ``buf`` (:attr:`Table.lay`), in :data:`_TAB`'s order."""
    return (
        _v1(buf, lay, 0), _v1(buf, lay, 1), _v1(buf, lay, 2), _v1(buf, lay, 3),
        _v1(buf, lay, 4), _v2(buf, lay, 5), _v1(buf, lay, 6), _v2(buf, lay, 7),
        _v3(buf, lay, 8), _v1(buf, lay, 9), _v1(buf, lay, 10), _v1(buf, lay, 11),
        _v2(buf, lay, 12), _v2(buf, lay, 13), _v1(buf, lay, 14), _v1(buf, lay, 15),
        _v1(buf, lay, 16), _v1(buf, lay, 17), _v1(buf, lay, 18), _v2(buf, lay, 19),
        _v1(buf, lay, 20), _v2(buf, lay, 21),
    )  # fmt: skip


# ---------------------------------------------------------------- the table


@njit(nogil=True, cache=True)
def _bucket_of(wire, gen):  # type: ignore[no-untyped-def]
    return ((wire * _HASH) ^ gen) & (BUCKETS - 1)


@njit(nogil=True, cache=True)
def _pykey_of(wire, gen):  # type: ignore[no-untyped-def]
    return ((wire * _HASH) ^ (gen * 31)) & (PYKEYS - 1)


@njit(nogil=True, cache=True)
def _find(keys, bucket, nxt, wire, gen):  # type: ignore[no-untyped-def]
    e = bucket[_bucket_of(wire, gen)]
    while e >= 0:
        if keys[e, 0] == wire and keys[e, 1] == gen:
            return e
        e = nxt[e]
    return -1


@njit(nogil=True, cache=True)
def _unhash(keys, bucket, nxt, e):  # type: ignore[no-untyped-def]
    """Take entry ``e`` out of its bucket (no descriptor meets it there any more)."""
    b = _bucket_of(keys[e, 0], keys[e, 1])
    if bucket[b] == e:
        bucket[b] = nxt[e]
    else:
        p = bucket[b]
        while nxt[p] != e:
            p = nxt[p]
        nxt[p] = nxt[e]


@njit(nogil=True, cache=True)
def _free(st, nxt, e):  # type: ignore[no-untyped-def]
    """Give entry ``e`` (out of its bucket) back."""
    nxt[e] = st[S_FREE]
    st[S_FREE] = e
    st[S_LIVE] -= 1


@njit(nogil=True, cache=True)
def _remember_python(pykeys, wire, gen):  # type: ignore[no-untyped-def]
    p = _pykey_of(wire, gen)
    pykeys[p, 0] = wire
    pykeys[p, 1] = gen


@njit(nogil=True, cache=True)
def _queue(st, outq, outslot, d, slot):  # type: ignore[no-untyped-def]
    q = st[S_NOUT]
    for i in range(_DW):
        outq[q, i] = d[i]
    outslot[q] = slot
    st[S_NOUT] = q + 1


@njit(nogil=True, cache=True)
def _to_python(tab, e, wire, gen):  # type: ignore[no-untyped-def]
    """Queue entry ``e``'s descriptors (if ``e`` >= 0) for Python, in the order they
    came, and remember that Python has the key from now on."""
    st, keys, seen, order, descs = tab[0], tab[5], tab[6], tab[7], tab[8]
    bucket, nxt, pykeys, outq, outslot = tab[10], tab[11], tab[12], tab[13], tab[14]
    if e >= 0:
        for i in range(seen[e]):
            s = order[e, i]
            _queue(st, outq, outslot, descs[e, s], s)
        _unhash(keys, bucket, nxt, e)
        _free(st, nxt, e)
    _remember_python(pykeys, wire, gen)


@njit(nogil=True, cache=True)
def _done_of(wire, gen):  # type: ignore[no-untyped-def]
    return ((wire * _HASH) ^ (gen * 31)) & (DONES - 1)


@njit(nogil=True, cache=True)
def _remember_done(tab, e):  # type: ignore[no-untyped-def]
    """Entry ``e``, a group's op, is answered: remember who took part (:data:`DONES`)."""
    st, incs, keys, descs = tab[0], tab[2], tab[5], tab[8]
    groups, egrp, dones = tab[19], tab[20], tab[21]
    g = egrp[e]
    if g == 0:
        return
    slots = st[S_SLOTS]
    wire, gen = keys[e, 0], keys[e, 1]
    row = dones[_done_of(wire, gen)]
    row[DN_WIRE], row[DN_GEN], row[DN_CTX] = wire, gen, groups[g, G_CTX]
    for k in range(slots):
        row[DN_HEAD + k] = 0
    for i in range(groups[g, G_LOCAL]):
        k = _member(st, groups, g, i)
        row[DN_HEAD + k] = descs[e, k, _D_TICKET]
        row[DN_HEAD + slots + k] = incs[k]


@njit(nogil=True, cache=True)
def _done_clash(tab, g, d):  # type: ignore[no-untyped-def]
    """Whether descriptor ``d`` (over group row ``g``) names a group's op the pass answered
    over another group, one of whose members here is a member of ``g`` too: those ranks
    completed the op the descriptor waits for them in (Python fails it, and tells them)."""
    st, incs, groups, dones = tab[0], tab[2], tab[19], tab[21]
    row = dones[_done_of(d[_D_WIRE], d[_D_GEN])]
    if row[DN_WIRE] != d[_D_WIRE] or row[DN_GEN] != d[_D_GEN] or row[DN_CTX] == d[_D_CTX]:
        return False
    slots = st[S_SLOTS]
    for k in range(slots):
        if row[DN_HEAD + k] != 0 and row[DN_HEAD + slots + k] == incs[k]:
            if groups[g, G_HEAD + k] >= 0:
                return True
    return False


# ---------------------------------------------------------------- checks


@njit(nogil=True, cache=True)
def _dtype_ok(dt, op):  # type: ignore[no-untyped-def]
    if dt == DT_I32 or dt == DT_I64:
        return 1 <= op <= _OP_BXOR
    if dt == DT_F32 or dt == DT_F64 or dt == DT_F16 or dt == DT_BF16:
        return 1 <= op <= 5  # SUM, AVG, MAX, MIN, PRODUCT: no bitwise op on floats
    return False


@njit(nogil=True, cache=True)
def _group_find(groups, ctx):  # type: ignore[no-untyped-def]
    """The row of the group of context ``ctx`` (0: the world's, row 0), or -1."""
    if ctx == 0:
        return 0
    for g in range(1, GROUPS):
        if groups[g, G_USED] == 0:
            return -1
        if groups[g, G_CTX] == ctx:
            return g
    return -1


@njit(nogil=True, cache=True)
def _member(st, groups, g, i):  # type: ignore[no-untyped-def]
    """The slot of the ``i``-th of group ``g``'s members on this node (group order)."""
    return groups[g, G_HEAD + st[S_SLOTS] + i]


@njit(nogil=True, cache=True)
def _grank(st, groups, g, i):  # type: ignore[no-untyped-def]
    """The group rank of the ``i``-th of group ``g``'s members on this node."""
    return groups[g, G_HEAD + 2 * st[S_SLOTS] + st[S_SIZE] + i]


@njit(nogil=True, cache=True)
def _root_slot(st, groups, g, root):  # type: ignore[no-untyped-def]
    """The slot of group rank ``root`` of group ``g`` if it is on this node, else -1."""
    r = groups[g, G_HEAD + 2 * st[S_SLOTS] + root] - st[S_BASE_RANK]
    return r if 0 <= r < st[S_SLOTS] else -1


@njit(nogil=True, cache=True)
def _simple(st, lo, mem, groups, d, slot):  # type: ignore[no-untyped-def]
    """The group row of ``d`` if the compiled pass takes it, else -1: a well-formed
    allreduce, broadcast, barrier, reduce-scatter or all-gather over the world or a group
    the table knows (``slot`` a member), of a raw kernel's element type, no algorithm named
    (a reduce-scatter or all-gather run on this node alone: its output apart from its input,
    or an all-gather's input its own part of its output).  (A group's op of ``st[S_PIPE]``
    bytes or more among the nodes is a start, as the world's: Python starts its segments.)"""
    if st[S_ON] == 0 or d[_D_ALGO] != 0:
        return -1
    if (d[_D_FLAGS] & ~_SIMPLE_FLAGS) != 0 or d[_D_GEN] < 0 or d[_D_TICKET] <= 0:
        return -1
    g = _group_find(groups, d[_D_CTX])
    if g < 0 or groups[g, G_HEAD + slot] < 0:
        return -1
    kind = d[_D_KIND]
    parted = kind == _RS or kind == _AG
    if kind != _AR and kind != _BC and kind != _BAR and not parted:
        return -1
    dt = d[_D_DTYPE]
    if not _dtype_ok(dt, d[_D_OP]):  # a barrier's too: Python refuses what it refuses
        return -1
    n = d[_D_COUNT]
    span = n * ITEMSIZE[dt]
    data = st[S_DATA]
    if n < 0 or span > data:
        return -1
    if kind == _BAR:
        return g
    if kind == _BC and not (0 <= d[_D_ROOT] < groups[g, G_SIZE]):
        return -1
    a, b = lo[slot], lo[slot] + data
    out_span = span
    if parted:  # its parts: one count per rank of the group (the world), each >= 0
        at = d[_D_AUX]
        size = groups[g, G_SIZE]
        if at % 8 != 0 or not (a <= at and at + 8 * (size + 1) <= b) or mem[at // 8] != size:
            return -1
        total = 0
        for r in range(size):
            c = mem[at // 8 + 1 + r]
            if c < 0:
                return -1
            total += c
        me = _grank(st, groups, g, groups[g, G_HEAD + slot])
        mine = mem[at // 8 + 1 + me]
        if kind == _RS:
            if total != n:
                return -1
            out_span = mine * ITEMSIZE[dt]
        else:
            if mine != n or total * ITEMSIZE[dt] > data:
                return -1
            out_span = total * ITEMSIZE[dt]
        if groups[g, G_NODES] == 1:  # run here, from the clients' buffers: no overlap
            i, o = d[_D_IN], d[_D_OUT]
            if not (i + span <= o or o + out_span <= i or span == 0 or out_span == 0):
                if kind == _RS:
                    return -1
                before = 0
                for r in range(me):
                    before += mem[at // 8 + 1 + r]
                if i != o + before * ITEMSIZE[dt]:  # (an all-gather in place: its own part)
                    return -1
    if a <= d[_D_IN] <= b - span and a <= d[_D_OUT] <= b - out_span:
        return g
    return -1


@njit(nogil=True, cache=True)
def parts_digest(mem, d, size):  # type: ignore[no-untyped-def]
    """A reduce-scatter's or all-gather's parts (``d``'s, checked by the pass), as one
    word: with the kind, count and element type, the op's shape among the nodes."""
    at = d[_D_AUX] // 8 + 1
    h = size
    for r in range(size):
        h = (h ^ mem[at + r]) * _HASH
        h ^= (h >> 29) & 0x7FFFFFFF
    return h


@njit(nogil=True, cache=True)
def _agrees(size, mem, d, e0):  # type: ignore[no-untyped-def]
    """Whether two ranks' descriptors of one op (over ``size`` ranks) agree on its shape
    (an all-gather's counts are each rank's own; a reduce-scatter's and an all-gather's
    parts agree)."""
    kind = d[_D_KIND]
    if not (
        kind == e0[_D_KIND] and d[_D_DTYPE] == e0[_D_DTYPE] and d[_D_CTX] == e0[_D_CTX]
        and (d[_D_COUNT] == e0[_D_COUNT] or kind == _AG) and d[_D_OP] == e0[_D_OP]
        and d[_D_ROOT] == e0[_D_ROOT] and d[_D_FLAGS] == e0[_D_FLAGS]
    ):  # fmt: skip
        return False
    if kind == _RS or kind == _AG:
        a, b = d[_D_AUX] // 8, e0[_D_AUX] // 8
        for i in range(size + 1):
            if mem[a + i] != mem[b + i]:
                return False
    return True


# ---------------------------------------------------------------- running an op


@njit(nogil=True, cache=True)
def node_buffer(st, descs, e):  # type: ignore[no-untyped-def]
    """The arena offset of op ``e``'s node buffer, where the node's part is: the first
    client's output (a broadcast's root's, if the root is here); -1 for a barrier."""
    d0 = descs[e, 0]
    kind = d0[_D_KIND]
    if kind == _AR:
        return d0[_D_OUT]
    if kind == _BC:
        r = d0[_D_ROOT] - st[S_BASE_RANK]
        if 0 <= r < st[S_SLOTS]:
            return descs[e, r, _D_OUT]
        return d0[_D_OUT]
    return -1


@njit(nogil=True, cache=True)
def _node_buffer(st, groups, egrp, descs, e):  # type: ignore[no-untyped-def]
    """:func:`node_buffer` of an entry over the world or a group: the first member's
    output (group order; a broadcast root's, if the root is here); -1 for a barrier."""
    g = egrp[e]
    kind = descs[e, 0, _D_KIND]
    if g == 0 or kind == _BAR:
        return node_buffer(st, descs, e)
    if kind == _BC:
        r = _root_slot(st, groups, g, descs[e, 0, _D_ROOT])
        if r >= 0:
            return descs[e, r, _D_OUT]
    return descs[e, _member(st, groups, g, 0), _D_OUT]


@njit(nogil=True, cache=True)
def entry_buffer(buf, lay, e):  # type: ignore[no-untyped-def]
    """The arena offset of entry ``e``'s node buffer (world or group: :func:`_node_buffer`)."""
    tab = _tab(buf, lay)
    return _node_buffer(tab[0], tab[19], tab[20], tab[8], e)


@njit(nogil=True, cache=True)
def entry_group(buf, lay, e):  # type: ignore[no-untyped-def]
    """Entry ``e``'s group: (its row, 0 for the world; its members on this node; the
    nodes it spans; its size)."""
    tab = _tab(buf, lay)
    groups, g = tab[19], tab[20][e]
    return g, groups[g, G_LOCAL], groups[g, G_NODES], groups[g, G_SIZE]


@njit(nogil=True, cache=True)
def pipelined(st, d0):  # type: ignore[no-untyped-def]
    """Whether the op of descriptor ``d0``, complete here, runs among the nodes in
    segments (Python makes the node's part segment by segment then): see
    :data:`PIPE_MIN_BYTES` (``st[S_PIPE]``)."""
    kind = d0[_D_KIND]
    if st[S_NODES] < 2 or st[S_SLOTS] < 2 or (kind != _AR and kind != _BC):
        return False
    return d0[_D_COUNT] * ITEMSIZE[d0[_D_DTYPE]] >= st[S_PIPE]


@njit(nogil=True, cache=True)
def parted(d0):  # type: ignore[no-untyped-def]
    """Whether the op of descriptor ``d0`` is a reduce-scatter or an all-gather: its
    node's part goes to a buffer of its own (:func:`arena_local_parts`), not to a
    client's output."""
    return d0[_D_KIND] == _RS or d0[_D_KIND] == _AG


@njit(nogil=True, cache=True)
def _node_parts(st, groups, g, mem, d0):  # type: ignore[no-untyped-def]
    """Of a reduce-scatter or all-gather over group ``g`` (``d0``'s parts, one per group
    rank, the group's ranks node after node): the elements of the ranks of the nodes before
    this one, of this node's, and in all."""
    at = d0[_D_AUX] // 8 + 1
    node, slots = st[S_BASE_RANK] // st[S_SLOTS], st[S_SLOTS]
    ranks = G_HEAD + 2 * slots
    before = here = total = 0
    for j in range(groups[g, G_SIZE]):
        c = mem[at + j]
        total += c
        n = groups[g, ranks + j] // slots
        if n < node:
            before += c
        elif n == node:
            here += c
    return before, here, total


@njit(nogil=True, cache=True)
def node_counts(buf, lay, mem, e):  # type: ignore[no-untyped-def]
    """Entry ``e``, a reduce-scatter or all-gather complete here: the elements of its
    node's part (what it gives the nodes' op) and of the nodes' op's result here."""
    tab = _tab(buf, lay)
    d0 = tab[8][e, 0]
    _, here, total = _node_parts(tab[0], tab[19], tab[20][e], mem, d0)
    if d0[_D_KIND] == _RS:
        return d0[_D_COUNT], here
    return here, total


@njit(nogil=True, cache=True)
def _local_parts(st, groups, egrp, mem, base, descs, e, dst):  # type: ignore[no-untyped-def]
    """A reduce-scatter's node's part at address ``dst``: its members' inputs reduced (in
    group order, the world's in slot order; ``avg`` summed); an all-gather's: its members'
    inputs one after another."""
    g = egrp[e]
    members = groups[g, G_LOCAL]
    d0 = descs[e, 0]
    dt = d0[_D_DTYPE]
    if d0[_D_KIND] == _RS:
        n = d0[_D_COUNT]
        if groups[g, G_IDENT] != 0:
            _reduce_range(st, groups, g, base, descs, e, dst, 0, n)
            return
        # a group whose order interleaves the nodes: each node's parts together, in node
        # order (Python's ``_Grp.order``), each part reduced from its place in the inputs
        isz = ITEMSIZE[dt]
        parts = d0[_D_AUX] // 8 + 1
        ranks = G_HEAD + 2 * st[S_SLOTS]
        at = dst
        for node in range(st[S_NODES]):
            off = 0
            for j in range(groups[g, G_SIZE]):
                c = mem[parts + j]
                if groups[g, ranks + j] // st[S_SLOTS] == node:
                    _reduce_range(st, groups, g, base, descs, e, at, off, c)
                    at += c * isz
                off += c
        return
    at = dst
    for i in range(members):
        k = _member(st, groups, g, i)
        span = descs[e, k, _D_COUNT] * ITEMSIZE[dt]
        copy_raw(at, base + descs[e, k, _D_IN], span)
        at += span


@njit(nogil=True, cache=True)
def _reduce_range(st, groups, g, base, descs, e, dst, lo, n):  # type: ignore[no-untyped-def]
    """Address ``dst`` = elements [lo, lo + n) of group ``g``'s members' inputs of entry
    ``e`` reduced, in group order (``avg`` summed)."""
    d0 = descs[e, 0]
    dt, op = d0[_D_DTYPE], d0[_D_OP]
    if op == _OP_AVG:
        op = _OP_SUM
    at = lo * ITEMSIZE[dt]
    src0 = base + descs[e, _member(st, groups, g, 0), _D_IN] + at
    if groups[g, G_LOCAL] == 1:
        copy_raw(dst, src0, n * ITEMSIZE[dt])
        return
    src1 = base + descs[e, _member(st, groups, g, 1), _D_IN] + at
    reduce3_raw(dt, op, dst, src0, src1, n)
    for i in range(2, groups[g, G_LOCAL]):
        reduce_raw(dt, op, dst, base + descs[e, _member(st, groups, g, i), _D_IN] + at, n)


@njit(nogil=True, cache=True)
def _one_node_parts(st, groups, egrp, mem, base, descs, e):  # type: ignore[no-untyped-def]
    """Entry ``e``, a reduce-scatter or all-gather whose group lies on this node (the
    world's, on a service of one node), complete here: each member's output made from the
    members' inputs (a reduce-scatter's part reduced in group order, ``avg`` divided by the
    group's size, as Python's node buffer is; an all-gather's parts joined in group order)."""
    g = egrp[e]
    d0 = descs[e, 0]
    dt = d0[_D_DTYPE]
    isz = ITEMSIZE[dt]
    parts = d0[_D_AUX] // 8 + 1
    if d0[_D_KIND] == _RS:
        for i in range(groups[g, G_LOCAL]):
            j = _grank(st, groups, g, i)
            off = 0
            for t in range(j):
                off += mem[parts + t]
            c = mem[parts + j]
            out = base + descs[e, _member(st, groups, g, i), _D_OUT]
            _reduce_range(st, groups, g, base, descs, e, out, off, c)
            if d0[_D_FLAGS] & A.F_AVG:
                average_raw(dt, out, c, groups[g, G_SIZE])
        return
    for i in range(groups[g, G_LOCAL]):
        out = base + descs[e, _member(st, groups, g, i), _D_OUT]
        for t in range(groups[g, G_LOCAL]):  # (a member's own part last: it may lie in place)
            if t == i:
                continue
            k = _member(st, groups, g, t)
            j = _grank(st, groups, g, t)
            at = 0
            for u in range(j):
                at += mem[parts + u]
            copy_raw(out + at * isz, base + descs[e, k, _D_IN], descs[e, k, _D_COUNT] * isz)
        j = _grank(st, groups, g, i)
        at = 0
        for u in range(j):
            at += mem[parts + u]
        src = base + descs[e, _member(st, groups, g, i), _D_IN]
        if src != out + at * isz:
            copy_raw(out + at * isz, src, descs[e, _member(st, groups, g, i), _D_COUNT] * isz)


@njit(nogil=True, cache=True)
def _back_parts(st, groups, egrp, mem, base, descs, e, src):  # type: ignore[no-untyped-def]
    """A reduce-scatter's or all-gather's result here (at address ``src``) into its
    members' outputs: each its part of a reduce-scatter's (``avg`` divided by the group's
    size first), every one the whole of an all-gather's."""
    g = egrp[e]
    d0 = descs[e, 0]
    dt = d0[_D_DTYPE]
    isz = ITEMSIZE[dt]
    before, here, total = _node_parts(st, groups, g, mem, d0)
    if d0[_D_KIND] == _RS:
        if d0[_D_FLAGS] & A.F_AVG:
            average_raw(dt, src, here, groups[g, G_SIZE])
        at = src
        parts = d0[_D_AUX] // 8 + 1
        for i in range(groups[g, G_LOCAL]):  # (the node's block: its members' parts in order)
            span = mem[parts + _grank(st, groups, g, i)] * isz
            copy_raw(base + descs[e, _member(st, groups, g, i), _D_OUT], at, span)
            at += span
        return
    if groups[g, G_IDENT] != 0:
        for i in range(groups[g, G_LOCAL]):
            copy_raw(base + descs[e, _member(st, groups, g, i), _D_OUT], src, total * isz)
        return
    # a group whose order interleaves the nodes: the result lies in node order; each part
    # back to its place in group order (Python's ``_finish``)
    parts = d0[_D_AUX] // 8 + 1
    ranks = G_HEAD + 2 * st[S_SLOTS]
    for i in range(groups[g, G_LOCAL]):
        out = base + descs[e, _member(st, groups, g, i), _D_OUT]
        at = src
        for node in range(st[S_NODES]):
            off = 0
            for j in range(groups[g, G_SIZE]):
                c = mem[parts + j]
                if groups[g, ranks + j] // st[S_SLOTS] == node:
                    copy_raw(out + off * isz, at, c * isz)
                    at += c * isz
                off += c


@njit(nogil=True, cache=True)
def _local(st, groups, egrp, base, descs, e, lo, hi):  # type: ignore[no-untyped-def]
    """Op ``e``, complete on this node: the node's part of its elements [lo, hi) in its
    node buffer (an allreduce's members' inputs reduced, in group order, the world's in
    slot order, as Python's ``_reduce`` does; a broadcast root's input)."""
    g = egrp[e]
    members = groups[g, G_LOCAL]
    d0 = descs[e, 0]
    kind = d0[_D_KIND]
    if kind == _BAR or hi <= lo:
        return
    dt = d0[_D_DTYPE]
    n, at = hi - lo, lo * ITEMSIZE[d0[_D_DTYPE]]
    if kind == _AR:
        op = d0[_D_OP]
        if op == _OP_AVG:
            op = _OP_SUM  # summed (here and among the nodes), divided at the end
        m0 = _member(st, groups, g, 0)
        dst = base + descs[e, m0, _D_OUT] + at
        if members == 1:
            src = base + descs[e, m0, _D_IN] + at
            if src != dst:
                copy_raw(dst, src, n * ITEMSIZE[dt])
        else:
            m1 = _member(st, groups, g, 1)
            src0, src1 = base + descs[e, m0, _D_IN] + at, base + descs[e, m1, _D_IN] + at
            reduce3_raw(dt, op, dst, src0, src1, n)
            for i in range(2, members):
                reduce_raw(dt, op, dst, base + descs[e, _member(st, groups, g, i), _D_IN] + at, n)
        return
    r = _root_slot(st, groups, g, d0[_D_ROOT]) if g != 0 else d0[_D_ROOT] - st[S_BASE_RANK]
    if 0 <= r < st[S_SLOTS]:  # a broadcast whose root is here
        src = base + descs[e, r, _D_IN] + at
        copy_raw(base + descs[e, r, _D_OUT] + at, src, n * ITEMSIZE[dt])


@njit(nogil=True, cache=True)
def _back(st, groups, egrp, base, descs, e, lo, hi):  # type: ignore[no-untyped-def]
    """Op ``e``'s result of elements [lo, hi) (in its node buffer) into every member's
    output here; ``avg`` divided by the group's (the world's) size first."""
    d0 = descs[e, 0]
    kind = d0[_D_KIND]
    if kind == _BAR or hi <= lo or parted(d0):  # (a parted op's: _back_parts)
        return
    g = egrp[e]
    dt = d0[_D_DTYPE]
    at = lo * ITEMSIZE[dt]
    src = base + _node_buffer(st, groups, egrp, descs, e) + at
    if kind == _AR and d0[_D_FLAGS] & A.F_AVG:
        average_raw(dt, src, hi - lo, groups[g, G_SIZE])
    span = (hi - lo) * ITEMSIZE[dt]
    for i in range(groups[g, G_LOCAL]):
        out = base + descs[e, _member(st, groups, g, i), _D_OUT] + at
        if out != src:
            copy_raw(out, src, span)


@njit(nogil=True, cache=True)
def _answer(st, mem, cw, descs, sig, wake, groups, egrp, e):  # type: ignore[no-untyped-def]
    """Set every member's completion word of op ``e``; list the sleepers to wake."""
    g = egrp[e]
    members = groups[g, G_LOCAL]
    for i in range(members):
        k = _member(st, groups, g, i)
        t = descs[e, k, _D_TICKET]
        mem[cw[k] + _DONE_WORD + (t - 1) % _RING] = t
    fence()
    for i in range(members):
        k = _member(st, groups, g, i)
        if mem[cw[k] + _C_SLEEPING] != 0 and wake[k] == 0:
            wake[k] = 1
            sig[st[S_NSIG]] = k
            st[S_NSIG] += 1


@njit(nogil=True, cache=True)
def _clear_wakes(st, wake):  # type: ignore[no-untyped-def]
    st[S_NSIG] = 0
    for k in range(st[S_SLOTS]):
        wake[k] = 0


# ---------------------------------------------------------------- what Python calls


@njit(nogil=True, cache=True)
def arena_pass(buf, lay, mem, base):  # type: ignore[no-untyped-def]
    """Take every descriptor the attached clients wrote; run the ops it completes.

    ``mem`` is the arena as int64 words, ``base`` its address.  Returns the number of
    descriptors taken (0: nothing new).  For Python: what it must take in the out-queue
    (``st[S_NOUT]`` rows of ``outq``, their slots in ``outslot``), the slots to wake in
    ``sig`` (``st[S_NSIG]``), and, on a service of several nodes, the entries complete
    here to start among the nodes in ``starts`` (``st[S_NSTART]``; their node's part is
    in their node buffer, and they stay in the table, out of its buckets, until
    :func:`arena_finish` or :func:`arena_release`).  Stops early when the out-queue may
    not hold another op.  ``buf`` and ``lay`` are the table's (:class:`Table`)."""
    tab = _tab(buf, lay)
    st, heads, incs, lo, cw, keys, seen, order, descs, born = tab[:10]
    bucket, nxt, pykeys, outq, outslot, sig, wake, starts, d, groups, egrp = tab[10:21]
    st[S_NOUT] = 0
    st[S_NSTART] = 0
    st[S_GPEND] = 0
    _clear_wakes(st, wake)
    slots = st[S_SLOTS]
    tails = 0  # what a drive among the nodes compares the tails with (S_TAILS)
    for s in range(slots):
        tails += mem[cw[s] + _C_TAIL]
    st[S_TAILS] = tails
    taken = 0
    for s in range(slots):
        if incs[s] == 0:
            continue
        tail = mem[cw[s] + _C_TAIL]
        if heads[s] >= tail:
            continue
        fence()  # the descriptors were written before the tail
        while heads[s] < tail:
            if st[S_NOUT] + st[S_GPEND] + slots + 1 > outq.shape[0]:
                return taken
            row = cw[s] + _RING_WORD + (heads[s] % _RING) * _DW
            for i in range(_DW):
                d[i] = mem[row + i]
            heads[s] += 1
            mem[cw[s] + _C_HEAD] = heads[s]
            taken += 1
            wire, gen = d[_D_WIRE], d[_D_GEN]
            e = _find(keys, bucket, nxt, wire, gen)
            p = _pykey_of(wire, gen)
            g = _simple(st, lo, mem, groups, d, s)
            ok = g >= 0 and not (pykeys[p, 0] == wire and pykeys[p, 1] == gen)
            if ok and e >= 0:
                # submitted twice by this rank, or a shape another rank does not share
                e0 = descs[e, order[e, 0]]
                ok = descs[e, s, _D_TICKET] == 0 and _agrees(groups[g, G_SIZE], mem, d, e0)
            if ok and e < 0 and _done_clash(tab, g, d):
                ok = False  # its group differs from one that completed it here: Python's
            if ok and e < 0:
                e = st[S_FREE]
                if e < 0:  # the table is full: Python's tables take the rest
                    ok = False
                else:
                    st[S_FREE] = nxt[e]
                    b = _bucket_of(wire, gen)
                    nxt[e] = bucket[b]
                    bucket[b] = e
                    st[S_LIVE] += 1
                    keys[e, 0], keys[e, 1] = wire, gen
                    seen[e] = 0
                    egrp[e] = g
                    born[e] = now_ns()
                    for k in range(slots):
                        descs[e, k, _D_TICKET] = 0
            if not ok:
                _to_python(tab, e, wire, gen)
                _queue(st, outq, outslot, d, s)
                continue
            for i in range(_DW):
                descs[e, s, i] = d[i]
            order[e, seen[e]] = s
            seen[e] += 1
            if seen[e] < groups[g, G_LOCAL]:
                continue
            if groups[g, G_HEAD] < 0:  # slot 0 is no member: its row holds the op's shape
                for i in range(_DW):
                    descs[e, 0, i] = descs[e, order[e, 0], i]
            _unhash(keys, bucket, nxt, e)
            among = groups[g, G_NODES] > 1
            if among:
                _remember_python(pykeys, wire, gen)  # a rank's second submission: Python's
            if among and g != 0 and not pipelined(st, descs[e, 0]):
                # a group's: its node's part is made by the loop, which has its row, or by
                # Python, which takes its descriptors (:func:`arena_hand_over`); a segmented
                # one's, segment by segment, as the world's (Python starts its segments)
                if st[S_LOOPING] == 0:
                    _entry_to_python(tab, e)
                    continue
                st[S_GPEND] += seen[e]
                starts[st[S_NSTART]] = e
                st[S_NSTART] += 1
                continue
            if not among and parted(descs[e, 0]):  # (a group of this node's: here)
                _one_node_parts(st, groups, egrp, mem, base, descs, e)
            elif not (among and pipelined(st, descs[e, 0])) and not parted(descs[e, 0]):
                # (else Python makes it segment by segment, or into a buffer of its own)
                _local(st, groups, egrp, base, descs, e, 0, descs[e, 0, _D_COUNT])
            if among:  # the services' engine runs it among the nodes
                starts[st[S_NSTART]] = e
                st[S_NSTART] += 1
                continue
            if g != 0:  # a group's, all of it on this node: the pass alone ran it
                mem[_H_PASS_GROUP] += 1
            _back(st, groups, egrp, base, descs, e, 0, descs[e, 0, _D_COUNT])
            _remember_done(tab, e)
            _answer(st, mem, cw, descs, sig, wake, groups, egrp, e)
            _free(st, nxt, e)
    st[S_TAKEN] += taken
    return taken


@njit(nogil=True, cache=True)
def _entry_to_python(tab, e):  # type: ignore[no-untyped-def]
    """Queue the descriptors of entry ``e`` (complete, out of its bucket, its key
    remembered as Python's, nothing made of it) for Python, and give it back."""
    st, seen, order, descs = tab[0], tab[6], tab[7], tab[8]
    nxt, outq, outslot = tab[11], tab[13], tab[14]
    for i in range(seen[e]):
        s = order[e, i]
        _queue(st, outq, outslot, descs[e, s], s)
    _free(st, nxt, e)


@njit(nogil=True, cache=True)
def arena_hand_over(buf, lay, first):  # type: ignore[no-untyped-def]
    """The pass's starts from ``first`` on, which the compiled loop leaves to Python: a
    group's whole ops go to the out-queue (Python takes their descriptors as if it had had
    them all along); the rest, the world's and segmented ones, stay starts (``st[S_NSTART]``
    of them)."""
    tab = _tab(buf, lay)
    st, starts, egrp = tab[0], tab[17], tab[20]
    n = first
    for i in range(first, st[S_NSTART]):
        e = starts[i]
        if egrp[e] != 0 and not pipelined(st, tab[8][e, 0]):  # (a segmented one: a start)
            _entry_to_python(tab, e)
        else:
            starts[n] = e
            n += 1
    st[S_NSTART] = n
    st[S_GPEND] = 0


@njit(nogil=True, cache=True)
def arena_finish(buf, lay, mem, base, e, back):  # type: ignore[no-untyped-def]
    """Entry ``e`` ended among the nodes, its node buffer holds the result: results
    back (unless ``back`` is 0: its segments went back already), every word set (the
    sleepers to wake in ``sig``), the entry given back."""
    tab = _tab(buf, lay)
    st, cw, descs, nxt, sig, wake = tab[0], tab[4], tab[8], tab[11], tab[15], tab[16]
    groups, egrp = tab[19], tab[20]
    _clear_wakes(st, wake)
    if back:
        _back(st, groups, egrp, base, descs, e, 0, descs[e, 0, _D_COUNT])
    _remember_done(tab, e)
    _answer(st, mem, cw, descs, sig, wake, groups, egrp, e)
    _free(st, nxt, e)


@njit(nogil=True, cache=True)
def arena_local_parts(buf, lay, mem, base, e, dst):  # type: ignore[no-untyped-def]
    """The node's part of entry ``e``, a reduce-scatter or all-gather complete here, at
    address ``dst`` (:func:`node_counts`' first count of elements)."""
    tab = _tab(buf, lay)
    _local_parts(tab[0], tab[19], tab[20], mem, base, tab[8], e, dst)


@njit(nogil=True, cache=True)
def arena_finish_parts(buf, lay, mem, base, e, src):  # type: ignore[no-untyped-def]
    """Entry ``e``, a reduce-scatter or all-gather, ended among the nodes with its result
    here at address ``src``: :func:`arena_finish`'s work for it."""
    tab = _tab(buf, lay)
    st, cw, descs, nxt, sig, wake = tab[0], tab[4], tab[8], tab[11], tab[15], tab[16]
    _clear_wakes(st, wake)
    _back_parts(st, tab[19], tab[20], mem, base, descs, e, src)
    _remember_done(tab, e)
    _answer(st, mem, cw, descs, sig, wake, tab[19], tab[20], e)
    _free(st, nxt, e)


@njit(nogil=True, cache=True)
def arena_local(buf, lay, base, e, lo, hi):  # type: ignore[no-untyped-def]
    """The node's part of elements [lo, hi) of entry ``e`` (a pipelined op's segment,
    before it starts among the nodes)."""
    tab = _tab(buf, lay)
    _local(tab[0], tab[19], tab[20], base, tab[8], e, lo, hi)


@njit(nogil=True, cache=True)
def arena_back(buf, lay, base, e, lo, hi):  # type: ignore[no-untyped-def]
    """Elements [lo, hi) of entry ``e``'s result back into its clients' outputs (a
    pipelined op's segment, ended among the nodes)."""
    tab = _tab(buf, lay)
    _back(tab[0], tab[19], tab[20], base, tab[8], e, lo, hi)


@njit(nogil=True, cache=True)
def arena_release(buf, lay, e):  # type: ignore[no-untyped-def]
    """Give back entry ``e``, started among the nodes, whose op Python now owns."""
    _free(_v1(buf, lay, 0), _v1(buf, lay, 11), e)


@njit(nogil=True, cache=True)
def arena_eject(buf, lay, older_ns):  # type: ignore[no-untyped-def]
    """Queue for Python the descriptors of every op waiting in the table that came
    before ``older_ns`` (``now_ns()`` for all), as many as the out-queue holds; how
    many such ops remain."""
    tab = _tab(buf, lay)
    st, keys, born, bucket, nxt, outq = tab[0], tab[5], tab[9], tab[10], tab[11], tab[13]
    st[S_NOUT] = 0
    slots = st[S_SLOTS]
    left = 0
    for b in range(BUCKETS):
        e = bucket[b]
        while e >= 0:
            nx = nxt[e]
            if born[e] <= older_ns:
                if st[S_NOUT] + slots > outq.shape[0]:
                    left += 1
                else:
                    _to_python(tab, e, keys[e, 0], keys[e, 1])
            e = nx
    return left


@njit(nogil=True, cache=True)
def clock_ns():  # type: ignore[no-untyped-def]
    """The clock of the table's ``born`` (for Python's ages)."""
    return now_ns()


#: What the pass's machine code is made of: a change to any flushes its cached code
#: (Numba checks a cached function against its own file only).
SOURCES = (
    "daemon/arena_pass.py",
    "lane/lane_cache.py",
    "kernels/raw.py",
    "kernels/numba_kernels.py",
    "native/intrinsics.py",
    "native/libc.py",
    "transport/arena.py",
)


def prepare() -> None:
    """Compile the pass (or load it from Numba's cache, dropped first if any of its
    :data:`SOURCES` changed): in the service's start, not in a client's first op."""
    from ..lane.lane_cache import forget_stale_cache

    forget_stale_cache(arena_pass, SOURCES, (__name__.split(".", 1)[1],), "arena_pass.sources")
    t = Table(1, 2, 0, 0)
    mem = np.zeros(A.ERROR_WORD, np.int64)
    arena_pass(t.buf, t.lay, mem, 0)
    arena_eject(t.buf, t.lay, 0)
    t.st[S_LIVE] = 1
    t.descs[0, 0, _D_KIND] = _BAR
    arena_finish(t.buf, t.lay, mem, 0, 0, 1)
    arena_local(t.buf, t.lay, 0, 0, 0, 0)
    arena_back(t.buf, t.lay, 0, 0, 0, 0)
    pipelined(t.st, t.descs[0, 0])
    arena_release(t.buf, t.lay, 0)
    node_buffer(t.st, t.descs, 0)
    entry_buffer(t.buf, t.lay, 0)
    entry_group(t.buf, t.lay, 0)
    arena_hand_over(t.buf, t.lay, 0)
    t.st[S_LIVE] = 1
    t.descs[0, 0, _D_KIND] = _AG
    t.descs[0, 0, _D_AUX] = 8
    mem[1] = 2
    arena_local_parts(t.buf, t.lay, mem, 0, 0, 0)
    node_counts(t.buf, t.lay, mem, 0)
    parts_digest(mem, t.descs[0, 0], 2)
    arena_finish_parts(t.buf, t.lay, mem, 0, 0, 0)
    mem[1] = 0
    clock_ns()
    t.done_of(0, 0)

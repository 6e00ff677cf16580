# ruff: noqa: F405 - the field constants come from totalreduce.protocol by a star import (Numba
# folds module globals into constants; listing ~100 names would only repeat them)
"""The compiled lane's tables: the hash tables of op keys, op and pool-slot records, the
event queue, frames written into a peer's outbox and sent (``MPI_Isend``, reaped with
``MPI_Test``), and the ready heap.  Numba functions over the arrays of
:mod:`totalreduce.protocol`; the protocol that uses them is :mod:`.lane_progress` and
:mod:`.lane_core`.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ..native.intrinsics import ld_i64, ld_u8, st_i32, st_i64, st_u8, st_u16, st_u32
from ..native.libc import memcpy
from ..protocol import *  # noqa: F403 - the protocol's words and fields
from ..transport.mpi_native import mpi_isend, mpi_test

# ------------------------------------------------------------------ hash tables


@njit(nogil=True, cache=True, inline="always")
def _mix(wid, gen):
    h = wid ^ (gen * np.int64(-7046029254386353131))
    h ^= h >> 31
    h *= np.int64(-4658895280553007687)
    return h ^ (h >> 29)


@njit(nogil=True, cache=True)
def hash_find(mem, base, wid, gen):
    """The entry of key (wid, gen) in the table at ``mem[base]``, or -1."""
    mask = mem[C_HCAP] - 1
    h = _mix(wid, gen)
    for probe in range(mem[C_HCAP]):
        e = base + ((h + probe) & mask) * 3
        v = mem[e + 2]
        if v == H_EMPTY:
            return -1
        if v != H_TOMB and mem[e] == wid and mem[e + 1] == gen:
            return e
    return -1


@njit(nogil=True, cache=True)
def hash_put(mem, base, wid, gen, val):
    """Set key (wid, gen) to ``val``; the entry, or -1 if the table is full."""
    e = hash_find(mem, base, wid, gen)
    if e >= 0:
        mem[e + 2] = val
        return e
    mask = mem[C_HCAP] - 1
    h = _mix(wid, gen)
    for probe in range(mem[C_HCAP]):
        e = base + ((h + probe) & mask) * 3
        v = mem[e + 2]
        if v == H_EMPTY or v == H_TOMB:
            mem[e] = wid
            mem[e + 1] = gen
            mem[e + 2] = val
            return e
    return -1


@njit(nogil=True, cache=True)
def hash_value(mem, base, wid, gen):
    e = hash_find(mem, base, wid, gen)
    return H_EMPTY if e < 0 else mem[e + 2]


@njit(nogil=True, cache=True)
def hash_rebuild(mem, base):
    """Drop the tombstones of the table at ``base`` (rehash its live entries)."""
    cap = mem[C_HCAP]
    live = mem[base : base + cap * 3].copy()
    for i in range(cap):
        mem[base + i * 3 + 2] = H_EMPTY
    for i in range(cap):
        v = live[i * 3 + 2]
        if v != H_EMPTY and v != H_TOMB:
            hash_put(mem, base, live[i * 3], live[i * 3 + 1], v)


# ------------------------------------------------------------------ small helpers


@njit(nogil=True, cache=True, inline="always")
def _op(mem, slot):
    return mem[C_OPS] + slot * O_N


@njit(nogil=True, cache=True, inline="always")
def _dyn(mem, slot, which):
    return mem[C_DYN] + (slot * D_N + which) * mem[C_SEGCAP]


@njit(nogil=True, cache=True, inline="always")
def _slot_addr(mem, abase, s):
    """Address of pool slot ``s`` (the pool is an array of its own: ``C_POOL``; ``abase``
    is not used, kept so that callers read alike)."""
    return mem[C_POOL] + s * mem[C_SLOT]


@njit(nogil=True, cache=True)
def slot_take(mem):
    n = mem[C_NFREE]
    if n == 0:
        return -1
    mem[C_NFREE] = n - 1
    s = mem[mem[C_FREESLOT] + n - 1]
    used = mem[C_NSLOTS] - n + 1
    if used > mem[C_PEAK]:
        mem[C_PEAK] = used
    return s


@njit(nogil=True, cache=True)
def slot_give(mem, s):
    n = mem[C_NFREE]
    mem[mem[C_FREESLOT] + n] = s
    mem[C_NFREE] = n + 1


# ------------------------------------------------------------------ floating frames
#
# Frames of ops not submitted here, by key in the floating hash (``C_FHASH``): a chain,
# newest first, of pool slots (credited DATA frames: their number) and announcement
# records (``ANN_BASE`` + their number: an RTS, or a NEED: a thread on the peer waits for
# the op, which then starts raised here).  Both are charged to ``C_FLOATBYTES``: a slot
# its size, an announcement ``ANN_CHARGE``.  Credited slots of a peer never exceed the
# credit this rank granted it (``lane_receive``), and announcements never exceed
# ``C_ANNCAP``, so what peers make this rank hold for ops it has not submitted stays
# within the lane's share of ``floating_pool_bytes`` whatever they send.


@njit(nogil=True, cache=True, inline="always")
def _chain_next(mem, x):
    if x >= ANN_BASE:
        return mem[mem[C_ANN] + (x - ANN_BASE) * A_N + A_NEXT]
    return mem[mem[C_META] + x * M_N + M_NEXT]


@njit(nogil=True, cache=True, inline="always")
def _chain_set_next(mem, x, nxt):
    if x >= ANN_BASE:
        mem[mem[C_ANN] + (x - ANN_BASE) * A_N + A_NEXT] = nxt
    else:
        mem[mem[C_META] + x * M_N + M_NEXT] = nxt


@njit(nogil=True, cache=True, inline="always")
def _chain_source(mem, x):
    if x >= ANN_BASE:
        return mem[mem[C_ANN] + (x - ANN_BASE) * A_N + A_SOURCE]
    return mem[mem[C_META] + x * M_N + M_SOURCE]


@njit(nogil=True, cache=True)
def _chain_need(mem, x):
    """Whether chain element ``x`` says a thread on its peer waits for the op (a NEED, or a
    frame with ``FLAG_NEED``: a DATA frame's header lies in its slot)."""
    if x >= ANN_BASE:
        return mem[mem[C_ANN] + (x - ANN_BASE) * A_N + A_FLAGS] & FLAG_NEED != 0
    return ld_u8(mem[C_POOL] + x * mem[C_SLOT] + FH_FLAGS) & FLAG_NEED != 0


@njit(nogil=True, cache=True)
def _float_charge(mem, nbytes):
    mem[C_FLOATBYTES] += nbytes
    if mem[C_FLOATBYTES] > mem[C_FLOATPEAK]:
        mem[C_FLOATPEAK] = mem[C_FLOATBYTES]


@njit(nogil=True, cache=True)
def float_link(mem, wid, gen, x):
    """Put chain element ``x`` first in the chain of key (wid, gen); False if the floating
    hash has no room (the caller frees ``x``)."""
    e = hash_find(mem, mem[C_FHASH], wid, gen)
    _chain_set_next(mem, x, -1 if e < 0 else mem[e + 2])
    return hash_put(mem, mem[C_FHASH], wid, gen, x) >= 0


@njit(nogil=True, cache=True)
def ann_take(mem, src, ftype, flags):
    """A free announcement record for frame type ``ftype`` (RTS or NEED) from ``src``
    (charged), as a chain element; -1 if the table is full."""
    n = mem[C_NANNFREE]
    if n > 0:
        r = mem[mem[C_ANNFREE] + n - 1]
        mem[C_NANNFREE] = n - 1
    elif mem[C_ANNTOP] < mem[C_ANNCAP]:
        r = mem[C_ANNTOP]
        mem[C_ANNTOP] = r + 1
    else:
        return -1
    a = mem[C_ANN] + r * A_N
    mem[a + A_SOURCE] = src
    mem[a + A_TYPE] = ftype
    mem[a + A_FLAGS] = flags
    mem[mem[C_PEERS] + src * P_N + P_ANN] += 1
    mem[C_ANNS] += 1
    _float_charge(mem, ANN_CHARGE)
    return ANN_BASE + r


@njit(nogil=True, cache=True)
def unfloat(mem, x, owe):
    """Free chain element ``x`` (its op was submitted or dropped, or its peer went bad):
    its charge leaves the pool; a credited frame's credit is owed back to its peer when
    ``owe``.  The chain's links are the caller's."""
    if x >= ANN_BASE:
        r = x - ANN_BASE
        src = mem[mem[C_ANN] + r * A_N + A_SOURCE]
        mem[mem[C_PEERS] + src * P_N + P_ANN] -= 1
        mem[C_ANNS] -= 1
        mem[C_FLOATBYTES] -= ANN_CHARGE
        n = mem[C_NANNFREE]
        mem[mem[C_ANNFREE] + n] = r
        mem[C_NANNFREE] = n + 1
        return
    m = mem[C_META] + x * M_N
    if mem[m + M_CREDITED]:
        pw = mem[C_PEERS] + mem[m + M_SOURCE] * P_N
        mem[pw + P_HELD] -= 1
        if owe:
            mem[pw + P_OWED] += 1
    mem[C_FLOATING] -= 1
    mem[C_FLOATBYTES] -= mem[C_SLOT]
    slot_give(mem, x)


@njit(nogil=True, cache=True)
def _event(mem, arena, kind, slot, source, a, b, frame_addr):
    """Queue an event for Python (with a copy of the frame header when given)."""
    i = mem[C_NEV]
    if i >= mem[C_EVCAP]:
        i = mem[C_EVCAP] - 1  # the last entry is overwritten: Python drains every pass
    else:
        mem[C_NEV] = i + 1
    e = mem[C_EVQ] + i * E_N
    mem[e + E_TYPE] = kind
    mem[e + E_SLOT] = slot
    mem[e + E_SOURCE] = source
    mem[e + E_A] = a
    mem[e + E_B] = b
    if frame_addr != 0:
        memcpy(arena.ctypes.data + mem[C_A_EVB] + i * FRAME_SIZE, frame_addr, FRAME_SIZE)


@njit(nogil=True, cache=True)
def _drop_front(mem, queue, count, done, width):
    """Drop the first ``done`` entries (``width`` words each) of the queue whose offset is
    control word ``queue`` and whose length is control word ``count``: the rest move to its
    front, in order, and the length goes down."""
    base = mem[queue]
    n = mem[count]
    for k in range(done * width, n * width):
        mem[base + k - done * width] = mem[base + k]
    mem[count] = n - done


@njit(nogil=True, cache=True)
def _group_rank(mem, prog, slot, world_rank):
    o = _op(mem, slot)
    g0 = mem[o + O_GROUP]
    for g in range(mem[o + O_GSIZE]):
        if prog[g0 + g] == world_rank:
            return g
    return -1


@njit(nogil=True, cache=True)
def _buf_addr(mem, slot, buf):
    return mem[_op(mem, slot) + O_IN + buf]


@njit(nogil=True, cache=True)
def _find_recv(mem, prog, slot, src, step, seg):
    g = _group_rank(mem, prog, slot, src)
    if g < 0:
        return -1
    plan = mem[_op(mem, slot) + O_PLAN]
    r0 = prog[plan + PL_RECVS]
    for q in range(prog[plan + PL_NR]):
        r = r0 + q * G_N
        if prog[r + G_PEER] == g and prog[r + G_STEP] == step and prog[r + G_SEG] == seg:
            return q
    return -1


@njit(nogil=True, cache=True)
def _same_shape(mem, slot, f):
    o = _op(mem, slot)
    return (
        ld_u8(f + FH_DTYPE) == mem[o + O_DT]
        and ld_u8(f + FH_KIND) == mem[o + O_KIND]
        and ld_u8(f + FH_ALGO) == mem[o + O_ALGO]
        and ld_u8(f + FH_ROP) == mem[o + O_ROP]
        and ld_i64(f + FH_COUNT) == mem[o + O_COUNT]
        and ld_i64(f + FH_PARAM) == mem[o + O_PARAM]
        and ld_i64(f + FH_CONTEXT) == mem[o + O_CTX]
    )


# ------------------------------------------------------------------ frames and outboxes


@njit(nogil=True, cache=True)
def _write_frame(mem, a, ftype, flags, slot, step, seg, nbytes):
    """Write the 72-byte header of a frame of op ``slot`` at address ``a``."""
    o = _op(mem, slot)
    st_u8(a + FH_TYPE, np.uint8(ftype))
    st_u8(a + FH_DTYPE, np.uint8(mem[o + O_DT]))
    st_u8(a + FH_KIND, np.uint8(mem[o + O_KIND]))
    st_u8(a + FH_ALGO, np.uint8(mem[o + O_ALGO]))
    st_u8(a + FH_ROP, np.uint8(mem[o + O_ROP]))
    st_u8(a + FH_FLAGS, np.uint8(flags))
    st_u16(a + FH_FLAGS + 1, np.uint16(0))
    st_u32(a + FH_AUX, np.uint32(0))
    st_u32(a + FH_STEP, np.uint32(step))
    st_u32(a + FH_SEGMENT, np.uint32(seg))
    st_u32(a + FH_PRIO, np.uint32(mem[o + O_PRIO] & 0xFFFFFFFF))
    st_i64(a + FH_WID, mem[o + O_WID])
    st_i64(a + FH_GEN, mem[o + O_GEN])
    st_i64(a + FH_NBYTES, nbytes)
    st_i64(a + FH_COUNT, mem[o + O_COUNT])
    st_i64(a + FH_PARAM, mem[o + O_PARAM])
    st_i64(a + FH_CONTEXT, mem[o + O_CTX])


@njit(nogil=True, cache=True)
def _reap(mem, b, abase):
    """Test the busy send buffers; those whose send completed are free again."""
    sbs = mem[C_SBSTATE]
    for i in range(mem[C_NSB]):
        if mem[sbs + i] == 1:
            r = mpi_test(b, abase + mem[C_A_REQ] + i * 8, abase + mem[C_A_STATUS])
            if r == 1:
                mem[sbs + i] = 0
                mem[C_NSBBUSY] -= 1


@njit(nogil=True, cache=True)
def _free_sb(mem, b, abase):
    """A free send buffer (testing busy ones if none is), or -1: the next free one after
    the last one taken, round the table.  The peer's core read the buffer a send just
    used (MPI may copy straight from it), so writing into that one again first takes
    its lines back across cores: on a 2-core machine a 64 KiB copy into the buffer just
    sent took 10 us, into one unused for 64 sends 2.9 us."""
    i = _next_free_sb(mem)
    if i < 0:
        _reap(mem, b, abase)
        i = _next_free_sb(mem)
    return i


@njit(nogil=True, cache=True, inline="always")
def _next_free_sb(mem):
    """The first free send buffer from ``C_SBNEXT`` on, round the table (the cursor moves
    past it), or -1."""
    sbs = mem[C_SBSTATE]
    nsb = mem[C_NSB]
    start = mem[C_SBNEXT]
    for k in range(nsb):
        i = start + k
        if i >= nsb:
            i -= nsb
        if mem[sbs + i] == 0:
            mem[C_SBNEXT] = i + 1 if i + 1 < nsb else 0
            return i
    return -1


@njit(nogil=True, cache=True)
def _flush_peer(mem, arena, b, peer):
    """Send the outbox of ``peer`` (and the credit owed to it) as one message: the send
    buffer its frames were written in (:func:`_room`), a free one for credit alone.

    False when no send buffer is free (the outbox stays as it is)."""
    abase = arena.ctypes.data
    pw = mem[C_PEERS] + peer * P_N
    n = mem[pw + P_OUTLEN]
    if n == 0:
        n = MSG_SIZE
    sb = mem[pw + P_OUTSB]
    if sb < 0:
        sb = _free_sb(mem, b, abase)
        if sb < 0:
            return False
    dst = abase + mem[C_A_SB] + sb * mem[C_OUTCAP]
    st_u32(dst + MH_MAGIC, np.uint32(LANE_MAGIC))
    st_u8(dst + MH_VERSION, np.uint8(LANE_VERSION))
    st_u8(dst + MH_VERSION + 1, np.uint8(0))
    st_u16(dst + MH_NFRAMES, np.uint16(mem[pw + P_NFRAMES]))
    st_i32(dst + MH_SENDER, np.int32(mem[C_RANK]))
    st_u32(dst + MH_RESERVED, np.uint32(0))
    st_i64(dst + MH_CREDIT, mem[pw + P_OWED])
    nframes = mem[pw + P_NFRAMES]
    mem[pw + P_OUTSB] = -1
    mem[pw + P_OWED] = 0
    mem[pw + P_OUTLEN] = 0
    mem[pw + P_NFRAMES] = 0
    mem[pw + P_OUTCTL] = 0
    rc = mpi_isend(b, dst, n, peer, mem[C_TAG], abase + mem[C_A_REQ] + sb * 8)
    if rc < 0:
        mem[mem[C_SBSTATE] + sb] = 0
        _event(mem, arena, EV_MPI, -1, peer, rc, 0, 0)
        return True
    mem[mem[C_SBSTATE] + sb] = 1
    mem[C_NSBBUSY] += 1
    mem[C_SENT_MSGS] += 1
    mem[C_SENT_FRAMES] += nframes
    return True


@njit(nogil=True, cache=True)
def _room(mem, arena, b, peer, need):
    """Address in ``peer``'s outbox for ``need`` more bytes (flushing it if full), or 0.
    The outbox is written straight into a send buffer (state 2 while it fills), so a
    frame's body is copied once on its way to MPI."""
    abase = arena.ctypes.data
    pw = mem[C_PEERS] + peer * P_N
    n = mem[pw + P_OUTLEN]
    if n == 0:
        n = MSG_SIZE
    if n + need > mem[C_OUTCAP] or mem[pw + P_NFRAMES] >= 65535:
        if not _flush_peer(mem, arena, b, peer):
            return 0
        n = MSG_SIZE
    sb = mem[pw + P_OUTSB]
    if sb < 0:
        sb = _free_sb(mem, b, abase)
        if sb < 0:
            return 0
        mem[mem[C_SBSTATE] + sb] = 2
        mem[pw + P_OUTSB] = sb
    mem[pw + P_OUTLEN] = n + need
    mem[pw + P_NFRAMES] += 1
    return abase + mem[C_A_SB] + sb * mem[C_OUTCAP] + n


@njit(nogil=True, cache=True)
def flush_all(mem, arena, b):
    """Send every outbox with frames, and credit owed past a quarter of a peer's share."""
    thr = max(1, mem[C_CREDIT] // 4)
    for peer in range(mem[C_WORLD]):
        pw = mem[C_PEERS] + peer * P_N
        if mem[pw + P_OUTLEN] > 0 or mem[pw + P_OWED] >= thr:
            _flush_peer(mem, arena, b, peer)


@njit(nogil=True, cache=True)
def control_frame(mem, arena, b, peer, fields, body, n):
    """Write a control frame (Python's: ERROR to JOIN) into ``peer``'s outbox, its 15
    header ``fields`` (type, dtype, kind, algorithm, reduce op, flags, aux, step, segment,
    priority, wire id, generation, element count, param, context) and ``n`` bytes of
    ``body``; the next pass sends it with whatever else goes to that peer.  A message
    carries at most ``CONTROL_PER_MESSAGE`` of them (the receiver's bound): one more
    starts a new message.  False when no send buffer is free (Python tries again)."""
    pw = mem[C_PEERS] + peer * P_N
    if mem[pw + P_OUTCTL] >= CONTROL_PER_MESSAGE and not _flush_peer(mem, arena, b, peer):
        return False
    size = FRAME_SIZE + ((n + 7) & ~7)
    a = _room(mem, arena, b, peer, size)
    if a == 0:
        return False
    mem[pw + P_OUTCTL] += 1
    st_u8(a + FH_TYPE, np.uint8(fields[0]))
    st_u8(a + FH_DTYPE, np.uint8(fields[1]))
    st_u8(a + FH_KIND, np.uint8(fields[2]))
    st_u8(a + FH_ALGO, np.uint8(fields[3]))
    st_u8(a + FH_ROP, np.uint8(fields[4]))
    st_u8(a + FH_FLAGS, np.uint8(fields[5]))
    st_u16(a + FH_FLAGS + 1, np.uint16(0))
    st_u32(a + FH_AUX, np.uint32(fields[6] & 0xFFFFFFFF))
    st_u32(a + FH_STEP, np.uint32(fields[7] & 0xFFFFFFFF))
    st_u32(a + FH_SEGMENT, np.uint32(fields[8] & 0xFFFFFFFF))
    st_u32(a + FH_PRIO, np.uint32(fields[9] & 0xFFFFFFFF))
    st_i64(a + FH_WID, fields[10])
    st_i64(a + FH_GEN, fields[11])
    st_i64(a + FH_NBYTES, n)
    st_i64(a + FH_COUNT, fields[12])
    st_i64(a + FH_PARAM, fields[13])
    st_i64(a + FH_CONTEXT, fields[14])
    if n > 0:
        memcpy(a + FRAME_SIZE, body.ctypes.data, n)
        for k in range(n, (n + 7) & ~7):
            st_u8(a + FRAME_SIZE + k, np.uint8(0))
    return True


# ------------------------------------------------------------------ the ready heap


@njit(nogil=True, cache=True, inline="always")
def _heap_put(mem, f, k1, k2, slot, i):
    mem[f] = k1
    mem[f + 1] = k2
    mem[f + 2] = slot
    mem[f + 3] = i


@njit(nogil=True, cache=True)
def _heap_push(mem, slot, i):
    """Send segment ``i`` of op ``slot`` is ready: into the heap (priority, then age)."""
    o = _op(mem, slot)
    k1 = -mem[o + O_PRIO] * 2 + (0 if mem[o + O_URGENT] else 1)
    k2 = mem[o + O_SEQ]
    base = mem[C_STK] + mem[C_STKCAP] * 2 + 1  # the heap (and its length) follow the stack
    n = mem[base - 1]
    if n >= mem[C_STKCAP]:
        return False
    mem[base - 1] = n + 1
    _sift_up(mem, base, n, k1, k2, slot, i)
    return True


@njit(nogil=True, cache=True)
def _sift_up(mem, base, j, k1, k2, slot, i):
    """Put entry (k1, k2, slot, i) at heap position ``j`` or above: parents with a larger
    key move down one place each until its place is found."""
    while j > 0:
        par = (j - 1) >> 1
        e = base + par * 4
        if mem[e] < k1 or (mem[e] == k1 and mem[e + 1] <= k2):
            break
        _heap_put(mem, base + j * 4, mem[e], mem[e + 1], mem[e + 2], mem[e + 3])
        j = par
    _heap_put(mem, base + j * 4, k1, k2, slot, i)


@njit(nogil=True, cache=True)
def _heap_pop(mem):
    base = mem[C_STK] + mem[C_STKCAP] * 2 + 1
    n = mem[base - 1] - 1
    mem[base - 1] = n
    last = base + n * 4
    k1, k2, s, i = mem[last], mem[last + 1], mem[last + 2], mem[last + 3]
    j = 0
    while True:
        c = 2 * j + 1
        if c >= n:
            break
        e = base + c * 4
        if c + 1 < n:
            e2 = e + 4
            if mem[e2] < mem[e] or (mem[e2] == mem[e] and mem[e2 + 1] < mem[e + 1]):
                c += 1
                e = e2
        if k1 < mem[e] or (k1 == mem[e] and k2 <= mem[e + 1]):
            break
        _heap_put(mem, base + j * 4, mem[e], mem[e + 1], mem[e + 2], mem[e + 3])
        j = c
    _heap_put(mem, base + j * 4, k1, k2, s, i)


@njit(nogil=True, cache=True)
def _heap_next(mem):
    """Take the heap's first entry: its (op slot, send segment), or (-1, -1) for one left
    by an op that failed with segments still waiting (its slot may hold a later op by
    now, whose segment of that number is another, or none: each entry names its op's
    submission, checked here)."""
    base = mem[C_STK] + mem[C_STKCAP] * 2 + 1
    seq = mem[base + 1]
    slot = mem[base + 2]
    i = mem[base + 3]
    _heap_pop(mem)
    o = _op(mem, slot)
    if mem[o + O_SEQ] != seq or mem[o + O_STATE] != S_ACTIVE:
        return np.int64(-1), np.int64(-1)
    return slot, i


@njit(nogil=True, cache=True, inline="always")
def _heap_len(mem):
    return mem[mem[C_STK] + mem[C_STKCAP] * 2]


@njit(nogil=True, cache=True)
def _raise(mem, slot):
    """Someone waits for op ``slot`` (here, or a peer's NEED): it goes first among equal
    priorities, its sends in the heap too (their keys lowered, moved up in place).  Its
    frames carry ``FLAG_NEED`` from now on.  Once per op: False if it was raised already."""
    o = _op(mem, slot)
    if mem[o + O_URGENT]:
        return False
    mem[o + O_URGENT] = 1
    k1 = -mem[o + O_PRIO] * 2
    seq = mem[o + O_SEQ]
    base = mem[C_STK] + mem[C_STKCAP] * 2 + 1
    for j in range(mem[base - 1]):
        e = base + j * 4
        if mem[e + 2] != slot or mem[e + 1] != seq:
            continue
        # Its key went down: up towards the root.  Entries that move down past j are
        # parents, seen already (a parent of this op's is raised before its child).
        _sift_up(mem, base, j, k1, seq, mem[e + 2], mem[e + 3])
    return True


@njit(nogil=True, cache=True)
def _abandon(mem, arena, peer, tag):
    """Owe ``peer`` an empty message on body ``tag``: it posted a receive there and cleared
    it to us, and our op failed before its body went.  The empty message completes that
    receive (a cancelled receive would leave a body already sent unmatched forever); the
    pass posts it (``lane_bodies._send_abandons``)."""
    n = mem[C_NAQ]
    if n >= mem[C_AQCAP]:
        _event(mem, arena, EV_LOST, -1, peer, n, 4, 0)
        return
    e = mem[C_AQ] + n * 2
    mem[e] = peer
    mem[e + 1] = tag
    mem[C_NAQ] = n + 1

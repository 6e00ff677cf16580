# ruff: noqa: F405 - the field constants come from lane_layout by a star import (Numba
# folds module globals into constants; listing ~100 names would only repeat them)
"""The compiled lane: one ``nopython``, ``nogil`` pass over MPI for the engine's small ops.

Everything here is a Numba function over the lane's three arrays (``mem``, ``prog``,
``arena``; field positions in :mod:`.lane_layout`) and the MPI record ``b`` of
:mod:`totalreduce.transport.mpi_native`.  A pass receives every message waiting on
the lane's tag (``MPI_Improbe``/``MPI_Mrecv``), places each frame by a hash of its op
key, applies bodies with the kernels of :mod:`totalreduce.kernels.raw` (or keeps
them in a pool slot until their turn, or until their op is submitted here), releases
the segments that waited for them, sends ready segments in priority order (coalesced
per peer, within credit), returns credit, and marks ops done.  No Python object is
created per frame, segment or op; what compiled code cannot decide (a mismatch, a
malformed message, an MPI error, a full pool) becomes an event for Python.

Flow control, as in the main loop: each peer may fill ``C_CREDIT`` pool slots here.
A frame that finds no credit is announced instead (``RTS``, header only); the
receiver answers ``READY`` once the op is submitted there, and the sender then sends
that op's frames without credit (they are consumed on arrival).  So early frames stay
within the credit, an op submitted everywhere always has a path, and no order of
submissions deadlocks.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ..kernels.raw import average_raw, copy_raw, reduce_raw
from ..native.intrinsics import (
    cpu_relax,
    ld_i32,
    ld_i64,
    ld_u8,
    ld_u16,
    ld_u32,
    st_i32,
    st_i64,
    st_u8,
    st_u16,
    st_u32,
)
from ..native.libc import memcpy, now_ns, yield_cpu
from ..transport.mpi_native import (
    B_ANY_SOURCE,
    mpi_get_count,
    mpi_improbe,
    mpi_iprobe,
    mpi_isend,
    mpi_mrecv,
    mpi_test,
    status_source,
)
from .lane_layout import *  # noqa: F403 - the field constants

# ------------------------------------------------------------------ hash tables


@njit(nogil=True, cache=True, inline="always")
def _mix(wid, gen):  # type: ignore[no-untyped-def]
    h = wid ^ (gen * np.int64(-7046029254386353131))
    h ^= h >> 31
    h *= np.int64(-4658895280553007687)
    return h ^ (h >> 29)


@njit(nogil=True, cache=True)
def hash_find(mem, base, wid, gen):  # type: ignore[no-untyped-def]
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
def hash_put(mem, base, wid, gen, val):  # type: ignore[no-untyped-def]
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
def hash_value(mem, base, wid, gen):  # type: ignore[no-untyped-def]
    e = hash_find(mem, base, wid, gen)
    return H_EMPTY if e < 0 else mem[e + 2]


@njit(nogil=True, cache=True)
def hash_rebuild(mem, base):  # type: ignore[no-untyped-def]
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
def _op(mem, slot):  # type: ignore[no-untyped-def]
    return mem[C_OPS] + slot * O_N


@njit(nogil=True, cache=True, inline="always")
def _dyn(mem, slot, which):  # type: ignore[no-untyped-def]
    return mem[C_DYN] + (slot * 5 + which) * mem[C_SEGCAP]


@njit(nogil=True, cache=True, inline="always")
def _slot_addr(mem, abase, s):  # type: ignore[no-untyped-def]
    return abase + mem[C_A_SLOTS] + s * mem[C_SLOT]


@njit(nogil=True, cache=True)
def slot_take(mem):  # type: ignore[no-untyped-def]
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
def slot_give(mem, s):  # type: ignore[no-untyped-def]
    n = mem[C_NFREE]
    mem[mem[C_FREESLOT] + n] = s
    mem[C_NFREE] = n + 1


@njit(nogil=True, cache=True)
def _event(mem, arena, kind, slot, source, a, b, frame_addr):  # type: ignore[no-untyped-def]
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
def _group_rank(mem, prog, slot, world_rank):  # type: ignore[no-untyped-def]
    o = _op(mem, slot)
    g0 = mem[o + O_GROUP]
    for g in range(mem[o + O_GSIZE]):
        if prog[g0 + g] == world_rank:
            return g
    return -1


@njit(nogil=True, cache=True)
def _buf_addr(mem, slot, buf):  # type: ignore[no-untyped-def]
    return mem[_op(mem, slot) + O_IN + buf]


# ------------------------------------------------------------------ frames and outboxes


@njit(nogil=True, cache=True)
def _write_frame(mem, a, ftype, flags, slot, step, seg, nbytes):  # type: ignore[no-untyped-def]
    """Write the 72-byte header of a frame of op ``slot`` at address ``a``."""
    o = _op(mem, slot)
    st_u8(a, np.uint8(ftype))
    st_u8(a + 1, np.uint8(mem[o + O_DT]))
    st_u8(a + 2, np.uint8(mem[o + O_KIND]))
    st_u8(a + 3, np.uint8(mem[o + O_ALGO]))
    st_u8(a + 4, np.uint8(mem[o + O_ROP]))
    st_u8(a + 5, np.uint8(flags))
    st_u16(a + 6, np.uint16(0))
    st_u32(a + 8, np.uint32(0))
    st_u32(a + 12, np.uint32(step))
    st_u32(a + 16, np.uint32(seg))
    st_u32(a + 20, np.uint32(mem[o + O_PRIO] & 0xFFFFFFFF))
    st_i64(a + 24, mem[o + O_WID])
    st_i64(a + 32, mem[o + O_GEN])
    st_i64(a + 40, nbytes)
    st_i64(a + 48, mem[o + O_COUNT])
    st_i64(a + 56, mem[o + O_PARAM])
    st_i64(a + 64, mem[o + O_CTX])


@njit(nogil=True, cache=True)
def _reap(mem, b, abase):  # type: ignore[no-untyped-def]
    """Test the busy send buffers; those whose send completed are free again."""
    sbs = mem[C_SBSTATE]
    for i in range(mem[C_NSB]):
        if mem[sbs + i] != 0:
            r = mpi_test(b, abase + mem[C_A_REQ] + i * 8, abase + mem[C_A_STATUS])
            if r == 1:
                mem[sbs + i] = 0
                mem[C_NSBBUSY] -= 1


@njit(nogil=True, cache=True)
def _free_sb(mem, b, abase):  # type: ignore[no-untyped-def]
    """A free send buffer (testing busy ones if none is), or -1."""
    sbs = mem[C_SBSTATE]
    for i in range(mem[C_NSB]):
        if mem[sbs + i] == 0:
            return i
    _reap(mem, b, abase)
    for i in range(mem[C_NSB]):
        if mem[sbs + i] == 0:
            return i
    return -1


@njit(nogil=True, cache=True)
def _flush_peer(mem, arena, b, peer):  # type: ignore[no-untyped-def]
    """Send the outbox of ``peer`` (and the credit owed to it) as one message.

    False when no send buffer is free (the outbox stays as it is)."""
    abase = arena.ctypes.data
    pw = mem[C_PEERS] + peer * P_N
    n = mem[pw + P_OUTLEN]
    if n == 0:
        n = MSG_SIZE
    sb = _free_sb(mem, b, abase)
    if sb < 0:
        return False
    out = abase + mem[C_A_OUT] + peer * mem[C_OUTCAP]
    dst = abase + mem[C_A_SB] + sb * mem[C_OUTCAP]
    if n > MSG_SIZE:
        memcpy(dst + MSG_SIZE, out + MSG_SIZE, n - MSG_SIZE)
    st_u32(dst, np.uint32(LANE_MAGIC))
    st_u8(dst + 4, np.uint8(LANE_VERSION))
    st_u8(dst + 5, np.uint8(0))
    st_u16(dst + 6, np.uint16(mem[pw + P_NFRAMES]))
    st_i32(dst + 8, np.int32(mem[C_RANK]))
    st_u32(dst + 12, np.uint32(0))
    st_i64(dst + 16, mem[pw + P_OWED])
    rc = mpi_isend(b, dst, n, peer, mem[C_TAG], abase + mem[C_A_REQ] + sb * 8)
    if rc < 0:
        _event(mem, arena, EV_MPI, -1, peer, rc, 0, 0)
        return True
    mem[mem[C_SBSTATE] + sb] = 1
    mem[C_NSBBUSY] += 1
    mem[C_SENT_MSGS] += 1
    mem[C_SENT_FRAMES] += mem[pw + P_NFRAMES]
    mem[pw + P_OWED] = 0
    mem[pw + P_OUTLEN] = 0
    mem[pw + P_NFRAMES] = 0
    return True


@njit(nogil=True, cache=True)
def _room(mem, arena, b, peer, need):  # type: ignore[no-untyped-def]
    """Address in ``peer``'s outbox for ``need`` more bytes (flushing it if full), or 0."""
    pw = mem[C_PEERS] + peer * P_N
    n = mem[pw + P_OUTLEN]
    if n == 0:
        n = MSG_SIZE
    if n + need > mem[C_OUTCAP] or mem[pw + P_NFRAMES] >= 65535:
        if not _flush_peer(mem, arena, b, peer):
            return 0
        n = MSG_SIZE
    mem[pw + P_OUTLEN] = n + need
    mem[pw + P_NFRAMES] += 1
    return arena.ctypes.data + mem[C_A_OUT] + peer * mem[C_OUTCAP] + n


@njit(nogil=True, cache=True)
def flush_all(mem, arena, b):  # type: ignore[no-untyped-def]
    """Send every outbox with frames, and credit owed past a quarter of a peer's share."""
    thr = max(1, mem[C_CREDIT] // 4)
    for peer in range(mem[C_WORLD]):
        pw = mem[C_PEERS] + peer * P_N
        if mem[pw + P_OUTLEN] > 0 or mem[pw + P_OWED] >= thr:
            _flush_peer(mem, arena, b, peer)


# ------------------------------------------------------------------ the ready heap


@njit(nogil=True, cache=True, inline="always")
def _heap_put(mem, f, k1, k2, slot, i):  # type: ignore[no-untyped-def]
    mem[f] = k1
    mem[f + 1] = k2
    mem[f + 2] = slot
    mem[f + 3] = i


@njit(nogil=True, cache=True)
def _heap_push(mem, slot, i):  # type: ignore[no-untyped-def]
    """Send segment ``i`` of op ``slot`` is ready: into the heap (priority, then age)."""
    o = _op(mem, slot)
    k1 = -mem[o + O_PRIO] * 2 + (0 if mem[o + O_URGENT] else 1)
    k2 = mem[o + O_SEQ]
    base = mem[C_STK] + mem[C_STKCAP] * 2 + 1  # the heap (and its length) follow the stack
    n = mem[base - 1]
    if n >= mem[C_STKCAP]:
        return False
    j = n
    mem[base - 1] = n + 1
    while j > 0:
        par = (j - 1) >> 1
        e = base + par * 4
        if mem[e] < k1 or (mem[e] == k1 and mem[e + 1] <= k2):
            break
        _heap_put(mem, base + j * 4, mem[e], mem[e + 1], mem[e + 2], mem[e + 3])
        j = par
    _heap_put(mem, base + j * 4, k1, k2, slot, i)
    return True


@njit(nogil=True, cache=True)
def _heap_pop(mem):  # type: ignore[no-untyped-def]
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


@njit(nogil=True, cache=True, inline="always")
def _heap_len(mem):  # type: ignore[no-untyped-def]
    return mem[mem[C_STK] + mem[C_STKCAP] * 2]


# ------------------------------------------------------------------ op progress


@njit(nogil=True, cache=True)
def _push_stack(mem, arena, slot, q):  # type: ignore[no-untyped-def]
    n = mem[mem[C_STK] - 1]
    if n >= mem[C_STKCAP]:
        _event(mem, arena, EV_LOST, slot, -1, q, 0, 0)
        return
    mem[mem[C_STK] + n * 2] = slot
    mem[mem[C_STK] + n * 2 + 1] = q
    mem[mem[C_STK] - 1] = n + 1


@njit(nogil=True, cache=True)
def _release(mem, prog, arena, slot, succ, nsucc):  # type: ignore[no-untyped-def]
    """One wait of each successor is over: ready sends go to the heap, staged receives to
    the work stack."""
    for k in range(nsucc):
        t = prog[succ + k]
        if t >= 0:
            w = _dyn(mem, slot, D_SW) + t
            mem[w] -= 1
            if mem[w] == 0:
                if not _heap_push(mem, slot, t):
                    _event(mem, arena, EV_LOST, slot, -1, t, 1, 0)
        else:
            q = -t - 1
            w = _dyn(mem, slot, D_RW) + q
            mem[w] -= 1
            if mem[w] == 0 and mem[_dyn(mem, slot, D_RS) + q] == RS_STAGED:
                _push_stack(mem, arena, slot, q)


@njit(nogil=True, cache=True)
def _locals(mem, prog, slot, first, n):  # type: ignore[no-untyped-def]
    """Run ``n`` local ops (prologue or epilogue) of op ``slot``; 0 or -1 (a kernel refused)."""
    o = _op(mem, slot)
    dt = mem[o + O_DT]
    isz = prog[mem[o + O_PLAN] + PL_ISZ]
    for k in range(n):
        r = first + k * L_N
        dst = mem[o + O_IN + prog[r + L_DBUF]] + prog[r + L_DOFF]
        kind = prog[r + L_KIND]
        if kind == LK_COPY:
            src = mem[o + O_IN + prog[r + L_SBUF]] + prog[r + L_SOFF]
            copy_raw(dst, src, prog[r + L_NBYTES])
        elif kind == LK_AVERAGE:
            if average_raw(dt, dst, prog[r + L_NBYTES] // isz, prog[r + L_DIV]) < 0:
                return -1
        else:
            return -1
    return 0


@njit(nogil=True, cache=True)
def _finish(mem, prog, arena, slot):  # type: ignore[no-untyped-def]
    """Every segment of op ``slot`` is done: its epilogue, then done."""
    o = _op(mem, slot)
    if mem[o + O_STATE] != S_ACTIVE or mem[o + O_SLEFT] or mem[o + O_RLEFT]:
        return
    plan = mem[o + O_PLAN]
    npro = prog[plan + PL_NPRO]
    if _locals(mem, prog, slot, prog[plan + PL_LOCS] + npro * L_N, prog[plan + PL_NEPI]) < 0:
        _fail(mem, prog, arena, slot)
        _event(mem, arena, EV_KERNEL, slot, -1, 0, 0, 0)
        return
    mem[o + O_STATE] = S_DONE
    remember_key(mem, mem[o + O_WID], mem[o + O_GEN], H_DONE)
    _end(mem, slot)


@njit(nogil=True, cache=True)
def _end(mem, slot):  # type: ignore[no-untyped-def]
    """Op ``slot`` left the table (done or failed): Python hears of it in the done queue."""
    n = mem[C_NDONE]
    mem[mem[C_DONEQ] + n] = slot
    mem[C_NDONE] = n + 1
    mem[C_INFLIGHT] -= 1
    mem[C_OPS_DONE] += 1
    fo = mem[C_NFREEOP]
    mem[mem[C_FREEOP] + fo] = slot
    mem[C_NFREEOP] = fo + 1


@njit(nogil=True, cache=True)
def _fail(mem, prog, arena, slot):  # type: ignore[no-untyped-def]
    """Op ``slot`` fails here: give back its staged slots, remember its key as failed."""
    o = _op(mem, slot)
    if mem[o + O_STATE] != S_ACTIVE:
        return
    mem[o + O_STATE] = S_FAILED
    plan = mem[o + O_PLAN]
    rs = _dyn(mem, slot, D_RS)
    rsl = _dyn(mem, slot, D_RSLOT)
    for q in range(prog[plan + PL_NR]):
        if mem[rs + q] == RS_STAGED:
            slot_give(mem, mem[rsl + q])
            mem[rs + q] = RS_DONE
    remember_key(mem, mem[o + O_WID], mem[o + O_GEN], H_FAILED)
    _end(mem, slot)


@njit(nogil=True, cache=True)
def remember_key(mem, wid, gen, mark):  # type: ignore[no-untyped-def]
    """Mark key (wid, gen) as finished here (``H_DONE``) or failed (``H_FAILED``): late
    frames for it are told apart from early ones.  The oldest of ``C_FAILCAP`` such
    marks is forgotten."""
    cap = mem[C_FAILCAP]
    head = mem[C_FAILHEAD]
    q = mem[C_FAILQ] + (head % cap) * 2
    if head >= cap:
        e = hash_find(mem, mem[C_HASH], mem[q], mem[q + 1])
        if e >= 0 and (mem[e + 2] == H_FAILED or mem[e + 2] == H_DONE):
            mem[e + 2] = H_TOMB
    mem[q] = wid
    mem[q + 1] = gen
    mem[C_FAILHEAD] = head + 1
    hash_put(mem, mem[C_HASH], wid, gen, mark)


@njit(nogil=True, cache=True)
def remember_failed(mem, wid, gen):  # type: ignore[no-untyped-def]
    remember_key(mem, wid, gen, H_FAILED)


@njit(nogil=True, cache=True)
def _applied(mem, prog, arena, slot, q):  # type: ignore[no-untyped-def]
    o = _op(mem, slot)
    mem[_dyn(mem, slot, D_RS) + q] = RS_DONE
    mem[o + O_RLEFT] -= 1
    r = prog[mem[o + O_PLAN] + PL_RECVS] + q * G_N
    _release(mem, prog, arena, slot, prog[r + G_SUCC], prog[r + G_NSUCC])


@njit(nogil=True, cache=True)
def _apply(mem, prog, arena, slot, q, body):  # type: ignore[no-untyped-def]
    """Apply the body at address ``body`` to receive segment ``q`` of op ``slot``."""
    o = _op(mem, slot)
    r = prog[mem[o + O_PLAN] + PL_RECVS] + q * G_N
    dst = mem[o + O_IN + prog[r + G_BUF]] + prog[r + G_OFF]
    n = prog[r + G_NBYTES]
    if prog[r + G_ACTION] == ACT_COPY:
        copy_raw(dst, body, n)
    else:
        if prog[r + G_SBUF] >= 0:
            copy_raw(dst, mem[o + O_IN + prog[r + G_SBUF]] + prog[r + G_SOFF], n)
        isz = prog[mem[o + O_PLAN] + PL_ISZ]
        if reduce_raw(mem[o + O_DT], mem[o + O_ROP], dst, body, n // isz) < 0:
            _fail(mem, prog, arena, slot)
            _event(mem, arena, EV_KERNEL, slot, -1, 0, 0, 0)
            return
    _applied(mem, prog, arena, slot, q)


@njit(nogil=True, cache=True)
def _drain_stack(mem, prog, arena):  # type: ignore[no-untyped-def]
    """Apply staged bodies whose turn came, and finish the ops they complete."""
    abase = arena.ctypes.data
    top = mem[C_STK] - 1
    while mem[top] > 0:
        n = mem[top] - 1
        mem[top] = n
        slot = mem[mem[C_STK] + n * 2]
        q = mem[mem[C_STK] + n * 2 + 1]
        o = _op(mem, slot)
        if mem[o + O_STATE] != S_ACTIVE:
            continue
        if q >= 0:
            if mem[_dyn(mem, slot, D_RS) + q] != RS_STAGED:
                continue
            s = mem[_dyn(mem, slot, D_RSLOT) + q]
            _apply(mem, prog, arena, slot, q, _slot_addr(mem, abase, s) + FRAME_SIZE)
            slot_give(mem, s)
        _finish(mem, prog, arena, slot)


# ------------------------------------------------------------------ sending


@njit(nogil=True, cache=True)
def _sent(mem, prog, arena, slot, i):  # type: ignore[no-untyped-def]
    o = _op(mem, slot)
    ss = _dyn(mem, slot, D_SS) + i
    mem[ss] = (mem[ss] & ~7) | SS_SENT
    mem[o + O_SLEFT] -= 1
    g = prog[mem[o + O_PLAN] + PL_SENDS] + i * G_N
    _release(mem, prog, arena, slot, prog[g + G_SUCC], prog[g + G_NSUCC])
    _push_stack(mem, arena, slot, -1)  # finish check after the release


@njit(nogil=True, cache=True)
def _mark_peer(mem, prog, slot, dest, bit):  # type: ignore[no-untyped-def]
    """Set ``bit`` on every send segment of op ``slot`` to world rank ``dest``; return how
    many of them were held (and are now ready again, with the bit CLEARED)."""
    o = _op(mem, slot)
    plan = mem[o + O_PLAN]
    s0 = prog[plan + PL_SENDS]
    ss = _dyn(mem, slot, D_SS)
    g0 = mem[o + O_GROUP]
    released = 0
    for i in range(prog[plan + PL_NS]):
        if prog[g0 + prog[s0 + i * G_N + G_PEER]] == dest:
            st = mem[ss + i] | bit
            if bit == 8 and (st & 7) == SS_HELD:
                st = st & ~7
                _heap_push(mem, slot, i)
                released += 1
            mem[ss + i] = st
    return released


@njit(nogil=True, cache=True)
def _emit(mem, prog, arena, b, slot, i):  # type: ignore[no-untyped-def]
    """Send segment ``i`` of op ``slot`` (or announce it); False: no room, try later."""
    o = _op(mem, slot)
    if mem[o + O_STATE] != S_ACTIVE:
        return True
    g = prog[mem[o + O_PLAN] + PL_SENDS] + i * G_N
    dest = prog[mem[o + O_GROUP] + prog[g + G_PEER]]
    ss = _dyn(mem, slot, D_SS) + i
    st = mem[ss]
    if (st & 7) == SS_SENT:
        return True
    flags = 0
    if not st & 8:
        pw = mem[C_PEERS] + dest * P_N
        if mem[pw + P_CREDIT] <= 0:
            if not st & 16:
                a = _room(mem, arena, b, dest, FRAME_SIZE)
                if a == 0:
                    return False
                _write_frame(mem, a, F_RTS, 0, slot, 0, 0, 0)
                _mark_peer(mem, prog, slot, dest, 16)
            mem[ss] = (mem[ss] & ~7) | SS_HELD
            return True
        flags = FLAG_CREDIT
    n = prog[g + G_NBYTES]
    a = _room(mem, arena, b, dest, FRAME_SIZE + ((n + 7) & ~7))
    if a == 0:
        return False
    if flags:
        mem[mem[C_PEERS] + dest * P_N + P_CREDIT] -= 1
    _write_frame(mem, a, F_DATA, flags, slot, prog[g + G_STEP], prog[g + G_SEG], n)
    if n:
        memcpy(a + FRAME_SIZE, mem[o + O_IN + prog[g + G_BUF]] + prog[g + G_OFF], n)
    _sent(mem, prog, arena, slot, i)
    return True


@njit(nogil=True, cache=True)
def _send_ready(mem, prog, arena, b):  # type: ignore[no-untyped-def]
    """Send ready segments in priority order while there is room."""
    while _heap_len(mem) > 0:
        base = mem[C_STK] + mem[C_STKCAP] * 2 + 1
        slot = mem[base + 2]
        i = mem[base + 3]
        _heap_pop(mem)
        if not _emit(mem, prog, arena, b, slot, i):
            _heap_push(mem, slot, i)
            return
        _drain_stack(mem, prog, arena)


# ------------------------------------------------------------------ receiving


@njit(nogil=True, cache=True)
def _owe_ready(mem, arena, slot, peer):  # type: ignore[no-untyped-def]
    """Op ``slot`` is submitted here and ``peer`` announced frames for it: answer READY
    (queued, so that no answer is lost when the outbox has no room now)."""
    n = mem[C_NRQ]
    if n >= mem[C_RQCAP]:
        _event(mem, arena, EV_LOST, slot, peer, n, 2, 0)
        return
    e = mem[C_RQ] + n * 3
    mem[e] = slot
    mem[e + 1] = mem[_op(mem, slot) + O_SEQ]
    mem[e + 2] = peer
    mem[C_NRQ] = n + 1


@njit(nogil=True, cache=True)
def _send_readies(mem, arena, b):  # type: ignore[no-untyped-def]
    """Write the READY answers owed, in order, while the outboxes have room."""
    n = mem[C_NRQ]
    done = 0
    while done < n:
        e = mem[C_RQ] + done * 3
        slot = mem[e]
        o = _op(mem, slot)
        if mem[o + O_SEQ] == mem[e + 1] and mem[o + O_STATE] == S_ACTIVE:
            a = _room(mem, arena, b, mem[e + 2], FRAME_SIZE)
            if a == 0:
                break
            _write_frame(mem, a, F_READY, 0, slot, 0, 0, 0)
        done += 1
    if done:
        rq = mem[C_RQ]
        for k in range(done, n):
            mem[rq + (k - done) * 3] = mem[rq + k * 3]
            mem[rq + (k - done) * 3 + 1] = mem[rq + k * 3 + 1]
            mem[rq + (k - done) * 3 + 2] = mem[rq + k * 3 + 2]
        mem[C_NRQ] = n - done


@njit(nogil=True, cache=True)
def _find_recv(mem, prog, slot, src, step, seg):  # type: ignore[no-untyped-def]
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
def _same_shape(mem, slot, f):  # type: ignore[no-untyped-def]
    o = _op(mem, slot)
    return (
        ld_u8(f + 1) == mem[o + O_DT]
        and ld_u8(f + 2) == mem[o + O_KIND]
        and ld_u8(f + 3) == mem[o + O_ALGO]
        and ld_u8(f + 4) == mem[o + O_ROP]
        and ld_i64(f + 48) == mem[o + O_COUNT]
        and ld_i64(f + 56) == mem[o + O_PARAM]
        and ld_i64(f + 64) == mem[o + O_CTX]
    )


@njit(nogil=True, cache=True)
def _place(mem, prog, arena, b, slot, src, f, pool_slot):  # type: ignore[no-untyped-def]
    """A DATA frame (header at ``f``) of active op ``slot`` from ``src``: apply its body,
    or stage it (in ``pool_slot`` if the frame already lies in one, else in a new slot).
    Returns False only when a new slot was needed and none is free."""
    if not _same_shape(mem, slot, f):
        _event(mem, arena, EV_MISMATCH, slot, src, 0, 0, f)
        _fail(mem, prog, arena, slot)
        if pool_slot >= 0:
            slot_give(mem, pool_slot)
        return True
    q = _find_recv(mem, prog, slot, src, ld_u32(f + 12), ld_u32(f + 16))
    if q < 0 or mem[_dyn(mem, slot, D_RS) + q] != RS_WAIT:
        _event(mem, arena, EV_UNEXPECTED, slot, src, 0, 0, f)
        _fail(mem, prog, arena, slot)
        if pool_slot >= 0:
            slot_give(mem, pool_slot)
        return True
    o = _op(mem, slot)
    n = ld_i64(f + 40)
    want = prog[prog[mem[o + O_PLAN] + PL_RECVS] + q * G_N + G_NBYTES]
    if n != want:
        _event(mem, arena, EV_SIZE, slot, src, n, want, f)
        _fail(mem, prog, arena, slot)
        if pool_slot >= 0:
            slot_give(mem, pool_slot)
        return True
    if ld_u8(f + 5) & 1:
        mem[o + O_URGENT] = 1
    if mem[_dyn(mem, slot, D_RW) + q] == 0:
        _apply(mem, prog, arena, slot, q, f + FRAME_SIZE)
        if pool_slot >= 0:
            slot_give(mem, pool_slot)
        _push_stack(mem, arena, slot, -1)
        return True
    s = pool_slot
    if s < 0:
        s = slot_take(mem)
        if s < 0:
            return False
        memcpy(_slot_addr(mem, arena.ctypes.data, s), f, FRAME_SIZE + n)
    mem[_dyn(mem, slot, D_RS) + q] = RS_STAGED
    mem[_dyn(mem, slot, D_RSLOT) + q] = s
    return True


@njit(nogil=True, cache=True)
def _float(mem, arena, src, f, ftype, credited, nbytes):  # type: ignore[no-untyped-def]
    """Keep a frame of an op not submitted here; False when no slot is free."""
    s = slot_take(mem)
    if s < 0:
        return False
    memcpy(_slot_addr(mem, arena.ctypes.data, s), f, FRAME_SIZE + nbytes)
    m = mem[C_META] + s * M_N
    mem[m + M_SOURCE] = src
    mem[m + M_TYPE] = ftype
    mem[m + M_CREDITED] = credited
    wid = ld_i64(f + 24)
    gen = ld_i64(f + 32)
    e = hash_find(mem, mem[C_FHASH], wid, gen)
    mem[m + M_NEXT] = -1 if e < 0 else mem[e + 2]
    hash_put(mem, mem[C_FHASH], wid, gen, s)
    mem[C_FLOATING] += 1
    return True


@njit(nogil=True, cache=True)
def _on_frame(mem, prog, arena, b, src, f, avail):  # type: ignore[no-untyped-def]
    """One frame at address ``f`` (``avail`` bytes left in the message); the bytes it took,
    0 when it must wait for a free slot, or -1 after a malformed-message event."""
    ftype = ld_u8(f)
    flags = ld_u8(f + 5)
    n = ld_i64(f + 40)
    size = FRAME_SIZE
    if ftype == F_DATA:
        if n < 0 or n > mem[C_MICRO]:
            _event(mem, arena, EV_MALFORMED, -1, src, MF_BODY, n, f)
            return -1
        size = FRAME_SIZE + ((n + 7) & ~7)
    elif ftype != F_RTS and ftype != F_READY:
        _event(mem, arena, EV_MALFORMED, -1, src, MF_TYPE, ftype, f)
        return -1
    if size > avail:
        _event(mem, arena, EV_MALFORMED, -1, src, MF_TRUNCATED, avail, f)
        return -1
    wid = ld_i64(f + 24)
    gen = ld_i64(f + 32)
    v = hash_value(mem, mem[C_HASH], wid, gen)
    credited = 1 if flags & FLAG_CREDIT else 0
    if ftype == F_READY:
        if v >= 0:
            _mark_peer(mem, prog, v, src, 8)
        return size
    if ftype == F_RTS:
        if v >= 0:
            _owe_ready(mem, arena, v, src)
        elif v == H_FOREIGN:
            _event(mem, arena, EV_FOREIGN, -1, src, 0, 0, f)
        elif v == H_DONE:
            _event(mem, arena, EV_LATE, -1, src, 0, 0, f)
        elif v == H_EMPTY and not _float(mem, arena, src, f, 2, 0, 0):
            return 0
        return size
    # DATA
    if v >= 0:
        if not _place(mem, prog, arena, b, v, src, f, -1):
            return 0
        if credited:
            mem[mem[C_PEERS] + src * P_N + P_OWED] += 1
        return size
    if v == H_EMPTY:
        if not credited:
            _event(mem, arena, EV_MALFORMED, -1, src, MF_CREDIT, 0, f)
            return -1
        if not _float(mem, arena, src, f, 1, 1, n):
            return 0
        return size
    if v == H_FOREIGN:
        _event(mem, arena, EV_FOREIGN, -1, src, 0, 0, f)
    elif v == H_DONE:
        _event(mem, arena, EV_LATE, -1, src, 0, 0, f)
    if credited:
        mem[mem[C_PEERS] + src * P_N + P_OWED] += 1
    return size


@njit(nogil=True, cache=True)
def _consume(mem, prog, arena, b):  # type: ignore[no-untyped-def]
    """Place the frames of the message in the landing buffer; False when it must wait
    for a free slot (``C_FULL`` set: Python grows the pool)."""
    abase = arena.ctypes.data
    land = abase + mem[C_A_LAND]
    length = mem[C_LANDLEN]
    src = mem[C_LANDSRC]
    pos = mem[C_LANDPOS]
    if pos == 0:
        if length < MSG_SIZE:
            _event(mem, arena, EV_MALFORMED, -1, src, MF_SHORT, length, 0)
            return True
        if ld_u32(land) != LANE_MAGIC or ld_u8(land + 4) != LANE_VERSION:
            _event(mem, arena, EV_MALFORMED, -1, src, MF_MAGIC, ld_u32(land), 0)
            return True
        if ld_i32(land + 8) != src:
            _event(mem, arena, EV_MALFORMED, -1, src, MF_SENDER, ld_i32(land + 8), 0)
            return True
        credit = ld_i64(land + 16)
        if credit < 0 or credit > mem[C_CREDIT]:
            _event(mem, arena, EV_MALFORMED, -1, src, MF_CREDIT, credit, 0)
            return True
        mem[mem[C_PEERS] + src * P_N + P_CREDIT] += credit
        mem[C_LANDPOS] = MSG_SIZE
        # frames left to read go in the upper bits of the position's twin
        mem[C_LANDLEN] = length | (np.int64(ld_u16(land + 6)) << 40)
    while True:
        pos = mem[C_LANDPOS]
        packed = mem[C_LANDLEN]
        length = packed & ((np.int64(1) << 40) - 1)
        left = packed >> 40
        if left == 0:
            if pos != length:
                _event(mem, arena, EV_MALFORMED, -1, src, MF_LONG, length - pos, 0)
            mem[C_LANDLEN] = 0
            mem[C_LANDPOS] = 0
            mem[C_FULL] = 0
            return True
        if pos + FRAME_SIZE > length:
            _event(mem, arena, EV_MALFORMED, -1, src, MF_TRUNCATED, length - pos, 0)
            mem[C_LANDLEN] = 0
            mem[C_LANDPOS] = 0
            mem[C_FULL] = 0
            return True
        took = _on_frame(mem, prog, arena, b, src, land + pos, length - pos)
        if took == 0:
            mem[C_FULL] = 1
            return False
        if took < 0:
            mem[C_LANDLEN] = 0
            mem[C_LANDPOS] = 0
            mem[C_FULL] = 0
            return True
        mem[C_LANDPOS] = pos + took
        mem[C_LANDLEN] = length | ((left - 1) << 40)
        _drain_stack(mem, prog, arena)


# ------------------------------------------------------------------ the pass


@njit(nogil=True, cache=True)
def lane_pass(mem, prog, arena, b, budget):  # type: ignore[no-untyped-def]
    """One pass: receive up to ``budget`` messages, send what is ready, return credit,
    test sends.  Returns the number of messages received and segments completed."""
    abase = arena.ctypes.data
    done0 = mem[C_OPS_DONE]
    got = 0
    if mem[C_FULL]:
        if not _consume(mem, prog, arena, b):
            return 0
    msg = abase + mem[C_A_MSG]
    status = abase + mem[C_A_STATUS]
    for _ in range(budget):
        r = mpi_improbe(b, b[B_ANY_SOURCE], mem[C_TAG], msg, status)
        if r < 0:
            _event(mem, arena, EV_MPI, -1, -1, r, 0, 0)
            break
        if r == 0:
            break
        src = status_source(b, status)
        count = mpi_get_count(b, status)
        got += 1
        mem[C_RECV_MSGS] += 1
        if count < 0 or count > mem[C_OUTCAP]:
            # Too long for any message a peer may send: take it, refuse it.
            mpi_mrecv(b, abase + mem[C_A_LAND], mem[C_OUTCAP], msg, status)
            _event(mem, arena, EV_MALFORMED, -1, src, MF_LONG, count, 0)
            continue
        rc = mpi_mrecv(b, abase + mem[C_A_LAND], count, msg, status)
        if rc < 0:
            _event(mem, arena, EV_MPI, -1, src, rc, 0, 0)
            continue
        mem[C_LANDLEN] = count
        mem[C_LANDSRC] = src
        mem[C_LANDPOS] = 0
        if not _consume(mem, prog, arena, b):
            break
    if mem[C_NRQ]:
        _send_readies(mem, arena, b)
    _send_ready(mem, prog, arena, b)
    flush_all(mem, arena, b)
    if mem[C_NSBBUSY]:
        _reap(mem, b, abase)
    if mem[C_CTL_TAG] >= 0:
        mem[C_CTL_WAITING] = mpi_iprobe(b, b[B_ANY_SOURCE], mem[C_CTL_TAG], status)
    return got + (mem[C_OPS_DONE] - done0)


#: Polls without progress before a waiting thread yields its core between polls.
_POLLS_BEFORE_YIELD = 64


@njit(nogil=True, cache=True)
def _drive(mem, prog, arena, b, slot, seq, max_ns, spin_ns):  # type: ignore[no-untyped-def]
    """Passes until a condition or ``max_ns``; spins ``spin_ns`` after the last progress,
    then yields the core between passes.  ``slot >= 0``: until that op (submission
    ``seq``) left the table (1), or an event or a message for the main loop waits (0).
    ``slot < 0``: until something needs Python (1: an op ended, an event, the main loop's
    message, ``C_KICK``), or nothing is left in flight (0)."""
    t0 = now_ns()
    last = t0
    idle = 0
    o = _op(mem, slot) if slot >= 0 else 0
    while True:
        if slot >= 0:
            if mem[o + O_SEQ] != seq or mem[o + O_STATE] != S_ACTIVE:
                return 1
        elif mem[C_KICK]:
            return 1
        if lane_pass(mem, prog, arena, b, 64) > 0:
            last = now_ns()
            idle = 0
        needs = mem[C_NEV] > 0 or mem[C_CTL_WAITING] > 0 or mem[C_FULL] != 0
        if slot >= 0:
            if mem[o + O_SEQ] != seq or mem[o + O_STATE] != S_ACTIVE:
                return 1
            if needs:
                return 0
        else:
            if needs or mem[C_NDONE] > 0:
                return 1
            if mem[C_INFLIGHT] == 0 and mem[C_NSBBUSY] == 0:
                return 0
        t = now_ns()
        if t - t0 > max_ns:
            return 0
        idle += 1
        # A few polls with the spin hint, then the core goes to whoever needs it (the
        # peer an op waits for may share it: more ranks than cores); after ``spin_ns``
        # without progress, only yields.
        if idle > _POLLS_BEFORE_YIELD or t - last > spin_ns:
            yield_cpu()
        else:
            cpu_relax()


@njit(nogil=True, cache=True)
def lane_wait(mem, prog, arena, b, slot, seq, max_ns, spin_ns):  # type: ignore[no-untyped-def]
    """A waiting thread's passes: until op ``slot`` (submission ``seq``) left the table
    (1), an event or a message for the main loop waits, or ``max_ns`` passed (0)."""
    return _drive(mem, prog, arena, b, slot, seq, max_ns, spin_ns)


@njit(nogil=True, cache=True)
def lane_drive(mem, prog, arena, b, max_ns, spin_ns):  # type: ignore[no-untyped-def]
    """The comm thread's passes while the lane alone has work, without the interpreter
    lock: 1 when something needs Python (an op ended, an event, the main loop's message,
    Python set ``C_KICK``), 0 when nothing is left in flight or ``max_ns`` passed."""
    return _drive(mem, prog, arena, b, -1, 0, max_ns, spin_ns)


# ------------------------------------------------------------------ submission


@njit(nogil=True, cache=True)
def buffer_addresses(inb, outb, addrs):  # type: ignore[no-untyped-def]
    """Write the data addresses of an op's input and output into ``addrs[0:2]`` (one
    compiled call: reading ``__array_interface__`` twice from Python costs more).
    Numba has no float16 arrays: those come as uint16 views."""
    addrs[0] = inb.ctypes.data
    addrs[1] = outb.ctypes.data


@njit(nogil=True, cache=True)
def lane_submit(mem, prog, arena, b, fields, addrs):  # type: ignore[no-untyped-def]
    """Enter an op: ``fields`` holds (wid, gen, dt, kind, algo, rop, count, param, ctx,
    prio, plan, group, gsize, me, urgent); ``addrs`` the INPUT, OUTPUT and WORK addresses.
    Runs its prologue, places its floating frames, answers announcements, queues its
    ready sends and sends them.  Returns the op's slot, or -1 when the table is full."""
    nf = mem[C_NFREEOP]
    if nf == 0:
        return -1
    slot = mem[mem[C_FREEOP] + nf - 1]
    mem[C_NFREEOP] = nf - 1
    o = _op(mem, slot)
    wid = fields[0]
    gen = fields[1]
    mem[o + O_WID] = wid
    mem[o + O_GEN] = gen
    mem[o + O_DT] = fields[2]
    mem[o + O_KIND] = fields[3]
    mem[o + O_ALGO] = fields[4]
    mem[o + O_ROP] = fields[5]
    mem[o + O_COUNT] = fields[6]
    mem[o + O_PARAM] = fields[7]
    mem[o + O_CTX] = fields[8]
    mem[o + O_PRIO] = fields[9]
    plan = fields[10]
    mem[o + O_PLAN] = plan
    mem[o + O_GROUP] = fields[11]
    mem[o + O_GSIZE] = fields[12]
    mem[o + O_ME] = fields[13]
    mem[o + O_URGENT] = fields[14]
    mem[o + O_IN] = addrs[0]
    mem[o + O_OUT] = addrs[1]
    mem[o + O_WORK] = addrs[2]
    ns = prog[plan + PL_NS]
    nr = prog[plan + PL_NR]
    mem[o + O_SLEFT] = ns
    mem[o + O_RLEFT] = nr
    mem[C_SEQ] += 1
    mem[o + O_SEQ] = mem[C_SEQ]
    if mem[C_SEQ] % (mem[C_HCAP] // 4) == 0:  # sweep the tombstones now and then
        hash_rebuild(mem, mem[C_HASH])
        hash_rebuild(mem, mem[C_FHASH])
    mem[o + O_STATE] = S_ACTIVE
    mem[C_INFLIGHT] += 1
    sw = _dyn(mem, slot, D_SW)
    ss = _dyn(mem, slot, D_SS)
    s0 = prog[plan + PL_SENDS]
    for i in range(ns):
        mem[sw + i] = prog[s0 + i * G_N + G_NWAIT]
        mem[ss + i] = SS_WAIT
    rw = _dyn(mem, slot, D_RW)
    rs = _dyn(mem, slot, D_RS)
    r0 = prog[plan + PL_RECVS]
    for q in range(nr):
        mem[rw + q] = prog[r0 + q * G_N + G_NWAIT]
        mem[rs + q] = RS_WAIT
    e = hash_put(mem, mem[C_HASH], wid, gen, slot)
    if e < 0:
        hash_rebuild(mem, mem[C_HASH])
        hash_put(mem, mem[C_HASH], wid, gen, slot)
    if _locals(mem, prog, slot, prog[plan + PL_LOCS], prog[plan + PL_NPRO]) < 0:
        _fail(mem, prog, arena, slot)
        _event(mem, arena, EV_KERNEL, slot, -1, 0, 0, 0)
        return slot
    for i in range(ns):  # before placing early frames: they release the rest
        if mem[sw + i] == 0:
            _heap_push(mem, slot, i)
    # Frames that came before the op: place them (their slots become its staging).
    abase = arena.ctypes.data
    fe = hash_find(mem, mem[C_FHASH], wid, gen)
    if fe >= 0:
        s = mem[fe + 2]
        mem[fe + 2] = H_TOMB
        while s >= 0:
            m = mem[C_META] + s * M_N
            nxt = mem[m + M_NEXT]
            src = mem[m + M_SOURCE]
            mem[C_FLOATING] -= 1
            if mem[m + M_CREDITED]:
                mem[mem[C_PEERS] + src * P_N + P_OWED] += 1
            if mem[m + M_TYPE] == 2:
                _owe_ready(mem, arena, slot, src)
                slot_give(mem, s)
            elif mem[o + O_STATE] == S_ACTIVE:
                _place(mem, prog, arena, b, slot, src, _slot_addr(mem, abase, s), s)
            else:
                slot_give(mem, s)
            s = nxt
    if mem[o + O_STATE] == S_ACTIVE:
        _push_stack(mem, arena, slot, -1)
        _drain_stack(mem, prog, arena)
    if mem[C_NRQ]:
        _send_readies(mem, arena, b)
    _send_ready(mem, prog, arena, b)
    flush_all(mem, arena, b)
    return slot


@njit(nogil=True, cache=True)
def lane_fail(mem, prog, arena, slot):  # type: ignore[no-untyped-def]
    """Python fails op ``slot`` (an error from a peer, a peer gone, shutdown)."""
    _fail(mem, prog, arena, slot)


@njit(nogil=True, cache=True)
def lane_drop_floating(mem, wid, gen):  # type: ignore[no-untyped-def]
    """Forget the floating frames of key (wid, gen), returning their credit; how many."""
    fe = hash_find(mem, mem[C_FHASH], wid, gen)
    if fe < 0:
        return 0
    s = mem[fe + 2]
    mem[fe + 2] = H_TOMB
    k = 0
    while s >= 0:
        m = mem[C_META] + s * M_N
        nxt = mem[m + M_NEXT]
        if mem[m + M_CREDITED]:
            mem[mem[C_PEERS] + mem[m + M_SOURCE] * P_N + P_OWED] += 1
        mem[C_FLOATING] -= 1
        slot_give(mem, s)
        k += 1
        s = nxt
    return k


#: The sources the lane's machine code is made of (paths under the package).  Numba
#: checks a cached function against its own file only, and the lane inlines functions
#: of all of these: :func:`forget_stale_cache` covers the rest.
_SOURCES = (
    "engine/lane_core.py",
    "engine/lane_layout.py",
    "kernels/raw.py",
    "kernels/numba_kernels.py",
    "transport/mpi_native.py",
    "native/intrinsics.py",
    "native/libc.py",
)
#: The modules whose cached functions inline the others (flushed together).
_CACHED = ("engine.lane_core", "kernels.raw", "transport.mpi_native", "native.libc")


def sources_digest() -> str:
    """A digest of :data:`_SOURCES` as they are now."""
    import hashlib
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for rel in _SOURCES:
        h.update(rel.encode() + b"\0")
        h.update((root / rel).read_bytes())
    return h.hexdigest()


def forget_stale_cache() -> bool:
    """Drop Numba's cached code of the lane when any of its sources changed since it was
    cached (an edited or partly upgraded installation): otherwise a function whose own file
    is unchanged would be loaded with the old code of what it inlines.  True if dropped."""
    import importlib
    from pathlib import Path

    from numba.core.registry import CPUDispatcher

    cache = getattr(lane_pass, "_cache", None)
    path = getattr(cache, "cache_path", None)
    if not path:
        return False
    stamp = Path(path) / "lane_core.sources"
    digest = sources_digest()
    try:
        if stamp.read_text() == digest:
            return False
    except OSError:
        pass
    package = __name__.rsplit(".", 2)[0]
    for name in _CACHED:
        mod = importlib.import_module(f"{package}.{name}")
        for obj in vars(mod).values():
            if isinstance(obj, CPUDispatcher) and getattr(obj, "_cache", None) is not None:
                obj._cache.flush()
    try:
        stamp.parent.mkdir(parents=True, exist_ok=True)
        stamp.write_text(digest)
    except OSError:  # an unwritable cache: Numba compiles in memory each time anyway
        pass
    return True


def compile_all() -> None:
    """Compile (or load from Numba's cache) every entry point of the lane, by signature.

    A lane calls this when it is made, so the compiling happens in ``init()`` and not
    inside a first op, where a peer's stall timer would count it.  Nothing runs."""
    from numba import types

    forget_stale_cache()

    mem = types.Array(types.int64, 1, "C")
    arena = types.Array(types.uint8, 1, "C")
    i64 = types.int64
    lane_pass.compile((mem, mem, arena, mem, i64))
    lane_submit.compile((mem, mem, arena, mem, mem, mem))
    for dt in (types.uint16, types.float32, types.float64, types.int32, types.int64):
        buf = types.Array(dt, 1, "C")
        buffer_addresses.compile((buf, buf, mem))
    lane_wait.compile((mem, mem, arena, mem, i64, i64, i64, i64))
    lane_drive.compile((mem, mem, arena, mem, i64, i64))
    lane_fail.compile((mem, mem, arena, i64))
    lane_drop_floating.compile((mem, i64, i64))
    hash_value.compile((mem, i64, i64, i64))
    hash_find.compile((mem, i64, i64, i64))
    hash_put.compile((mem, i64, i64, i64, i64))
    remember_failed.compile((mem, i64, i64))
    remember_key.compile((mem, i64, i64, i64))

# ruff: noqa: F405 - the field constants come from totalreduce.protocol by a star import (Numba
# folds module globals into constants; listing ~100 names would only repeat them)
"""The compiled lane's op progress: segments released and applied (the kernels of
:mod:`totalreduce.kernels.raw`), local ops, ops finished, failed and remembered, and ready
segments emitted to their peers.  Numba functions over the arrays of :mod:`totalreduce.protocol`;
the pass that drives them is :mod:`.lane_core`.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ..kernels.raw import copy_raw
from ..native.intrinsics import ccall_i32
from ..native.libc import memcpy, now_ns
from ..protocol import *  # noqa: F403 - the protocol's words and fields
from ..transport.mpi_native import B_HANDLE_BYTES, mpi_isend
from .lane_tables import (
    _abandon,
    _dyn,
    _event,
    _heap_len,
    _heap_next,
    _heap_push,
    _op,
    _room,
    _slot_addr,
    _write_frame,
    hash_find,
    hash_put,
    slot_give,
)

# ------------------------------------------------------------------ op progress


@njit(nogil=True, cache=True, inline="always")
def _kernel(mem, kind, dt):
    """The C address of the kernel ``kind`` of element type ``dt`` (0: none, or not made
    yet: the caller fails the op with EV_KERNEL rather than calling it)."""
    if dt <= 0 or dt >= K_TYPES:
        return np.int64(0)
    return mem[mem[C_KTAB] + kind * K_TYPES + dt]


@njit(nogil=True, cache=True)
def _push_stack(mem, arena, slot, q):
    n = mem[mem[C_STK] - 1]
    if n >= mem[C_STKCAP]:
        _event(mem, arena, EV_LOST, slot, -1, q, 0, 0)
        return
    mem[mem[C_STK] + n * 2] = slot
    mem[mem[C_STK] + n * 2 + 1] = q
    mem[mem[C_STK] - 1] = n + 1


@njit(nogil=True, cache=True)
def _release(mem, prog, arena, slot, succ, nsucc):
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
            if mem[w] == 0:
                rs = mem[_dyn(mem, slot, D_RS) + q]
                if rs == RS_STAGED:
                    _push_stack(mem, arena, slot, q)
                elif rs == RS_WAIT and _lands_in_place(mem, prog, slot, q):
                    # its place is free now: its receive is posted (and the clear sent)
                    # in this pass, after the request table's queue ahead of it
                    if not _queue_post(mem, slot, q):
                        _event(mem, arena, EV_LOST, slot, -1, q, 4, 0)


@njit(nogil=True, cache=True)
def _lands_in_place(mem, prog, slot, q):
    return prog[prog[mem[_op(mem, slot) + O_PLAN] + PL_RECVS] + q * G_N + G_SCR] == SCR_DIRECT


@njit(nogil=True, cache=True)
def _queue_post(mem, slot, q):
    """Queue large receive ``q`` of op ``slot`` for posting (``lane_bodies._post_waiting``,
    every pass); False if the queue is full."""
    n = mem[C_NPQ]
    if n >= mem[C_PQCAP]:
        return False
    e = mem[C_PQ] + n * 3
    mem[e] = slot
    mem[e + 1] = mem[_op(mem, slot) + O_SEQ]
    mem[e + 2] = q
    mem[C_NPQ] = n + 1
    return True


@njit(nogil=True, cache=True)
def _locals(mem, prog, slot, first, n):
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
            k = _kernel(mem, K_AVERAGE, dt)
            if k == 0 or ccall_i32(k, (dst, prog[r + L_NBYTES] // isz, prog[r + L_DIV])) < 0:
                return -1
        elif kind == LK_SCALE or kind == LK_ACCUMULATE:
            src = mem[o + O_IN + prog[r + L_SBUF]] + prog[r + L_SOFF]
            w = np.int64(prog[r + L_W]).view(np.float64)
            k = _kernel(mem, K_SCALE if kind == LK_SCALE else K_ACCUMULATE, dt)
            if k == 0 or ccall_i32(k, (dst, src, prog[r + L_NBYTES] // isz, w)) < 0:
                return -1
        else:
            return -1
    return 0


@njit(nogil=True, cache=True)
def _finish(mem, prog, arena, slot):
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
def _end(mem, slot):
    """Op ``slot`` left the table (done or failed): Python hears of it in the done queue."""
    n = mem[C_NDONE]
    mem[mem[C_DONEQ] + n] = slot
    mem[C_NDONE] = n + 1
    mem[C_INFLIGHT] -= 1
    mem[C_PASSIVE] -= mem[_op(mem, slot) + O_PASSIVE]
    mem[C_OPS_DONE] += 1
    fo = mem[C_NFREEOP]
    mem[mem[C_FREEOP] + fo] = slot
    mem[C_NFREEOP] = fo + 1


@njit(nogil=True, cache=True)
def _fail(mem, prog, arena, slot):
    """Op ``slot`` fails here: give back its staged slots, remember its key as failed.
    Its body requests still posted become orphans (Python keeps the buffers alive until
    ``C_ORPHANS`` is 0 again): a receive waits for its sender's body or empty message, and
    is cancelled after ``C_ORPHAN_NS`` (then nothing was sent); a clear held for a body
    not sent is answered with an empty message (``_abandon``)."""
    o = _op(mem, slot)
    if mem[o + O_STATE] != S_ACTIVE:
        return
    mem[o + O_STATE] = S_FAILED
    plan = mem[o + O_PLAN]
    rs = _dyn(mem, slot, D_RS)
    rsl = _dyn(mem, slot, D_RSLOT)
    r0 = prog[plan + PL_RECVS]
    for q in range(prog[plan + PL_NR]):
        if mem[rs + q] == RS_STAGED and prog[r0 + q * G_N + G_SCR] == -1:
            slot_give(mem, mem[rsl + q])
        mem[rs + q] = RS_DONE
    if mem[o + O_NREQ]:
        br = mem[C_BREQ]
        t = now_ns()
        for k in range(mem[C_NBREQ]):
            e = br + k * BR_N
            if mem[e + BR_SLOT] == slot:
                mem[e + BR_SLOT] = -1
                mem[e + BR_T] = t
                mem[C_ORPHANS] += 1
                if mem[e + BR_WHAT] >= 0:
                    mem[mem[C_PEERS] + mem[e + BR_PEER] * P_N + P_BODIES] -= 1
    # Clears held for bodies not sent: their receives wait for an empty message.
    ss = _dyn(mem, slot, D_SS)
    stag = _dyn(mem, slot, D_STAG)
    s0 = prog[plan + PL_SENDS]
    for i in range(prog[plan + PL_NS]):
        st = mem[ss + i]
        if st & SB_CLEARED and (st & 7) != SS_BODY and (st & 7) != SS_SENT:
            dest = prog[mem[o + O_GROUP] + prog[s0 + i * G_N + G_PEER]]
            _abandon(mem, arena, dest, mem[stag + i])
            mem[ss + i] = st & ~SB_CLEARED
    remember_key(mem, mem[o + O_WID], mem[o + O_GEN], H_FAILED)
    _end(mem, slot)


@njit(nogil=True, cache=True)
def remember_key(mem, wid, gen, mark):
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
def remember_failed(mem, wid, gen):
    remember_key(mem, wid, gen, H_FAILED)


@njit(nogil=True, cache=True)
def _applied(mem, prog, arena, slot, q):
    o = _op(mem, slot)
    mem[_dyn(mem, slot, D_RS) + q] = RS_DONE
    mem[o + O_RLEFT] -= 1
    r = prog[mem[o + O_PLAN] + PL_RECVS] + q * G_N
    _release(mem, prog, arena, slot, prog[r + G_SUCC], prog[r + G_NSUCC])


@njit(nogil=True, cache=True)
def _apply(mem, prog, arena, slot, q, body):
    """Apply the body at address ``body`` to receive segment ``q`` of op ``slot``."""
    o = _op(mem, slot)
    r = prog[mem[o + O_PLAN] + PL_RECVS] + q * G_N
    dst = mem[o + O_IN + prog[r + G_BUF]] + prog[r + G_OFF]
    n = prog[r + G_NBYTES]
    if prog[r + G_ACTION] == ACT_COPY:
        copy_raw(dst, body, n)  # (a body received in place: dst is body, nothing moves)
    elif prog[r + G_ACTION] == ACT_ACCUMULATE:
        isz = prog[mem[o + O_PLAN] + PL_ISZ]
        w = np.int64(prog[r + G_W]).view(np.float64)
        k = _kernel(mem, K_ACCUMULATE, mem[o + O_DT])
        if k == 0 or ccall_i32(k, (dst, body, n // isz, w)) < 0:
            _fail(mem, prog, arena, slot)
            _event(mem, arena, EV_KERNEL, slot, -1, 0, 0, 0)
            return
    else:
        isz = prog[mem[o + O_PLAN] + PL_ISZ]
        dt = mem[o + O_DT]
        rop = mem[o + O_ROP]
        k = _kernel(mem, K_REDUCE, dt)
        rc = -1
        if k != 0:
            if prog[r + G_SBUF] >= 0:
                src = mem[o + O_IN + prog[r + G_SBUF]] + prog[r + G_SOFF]
                k3 = _kernel(mem, K_REDUCE3, dt)
                if k3 != 0:  # one pass over memory
                    rc = ccall_i32(k3, (dst, src, body, n // isz, rop))
                else:
                    copy_raw(dst, src, n)
                    rc = ccall_i32(k, (dst, body, n // isz, rop))
            else:
                rc = ccall_i32(k, (dst, body, n // isz, rop))
        if rc < 0:
            _fail(mem, prog, arena, slot)
            _event(mem, arena, EV_KERNEL, slot, -1, 0, 0, 0)
            return
    _applied(mem, prog, arena, slot, q)


@njit(nogil=True, cache=True)
def _drain_stack(mem, prog, arena):
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
            scr = prog[prog[mem[o + O_PLAN] + PL_RECVS] + q * G_N + G_SCR]
            if scr >= 0:  # a large segment's body, in the op's scratch
                _apply(mem, prog, arena, slot, q, mem[o + O_SCR] + scr)
            else:
                s = mem[_dyn(mem, slot, D_RSLOT) + q]
                _apply(mem, prog, arena, slot, q, _slot_addr(mem, abase, s) + FRAME_SIZE)
                slot_give(mem, s)
        _finish(mem, prog, arena, slot)


# ------------------------------------------------------------------ sending


@njit(nogil=True, cache=True)
def _sent(mem, prog, arena, slot, i):
    o = _op(mem, slot)
    ss = _dyn(mem, slot, D_SS) + i
    mem[ss] = (mem[ss] & ~7) | SS_SENT
    mem[o + O_SLEFT] -= 1
    g = prog[mem[o + O_PLAN] + PL_SENDS] + i * G_N
    _release(mem, prog, arena, slot, prog[g + G_SUCC], prog[g + G_NSUCC])
    _push_stack(mem, arena, slot, -1)  # finish check after the release


@njit(nogil=True, cache=True)
def _mark_peer(mem, prog, slot, dest, bit):
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
            if bit == SB_READY and (st & 7) == SS_HELD:
                st = st & ~7
                _heap_push(mem, slot, i)
                released += 1
            mem[ss + i] = st
    return released


@njit(nogil=True, cache=True)
def _find_send(mem, prog, slot, dest, step, seg):
    """The send segment of op ``slot`` to world rank ``dest`` for (step, seg), or -1."""
    o = _op(mem, slot)
    plan = mem[o + O_PLAN]
    g0 = mem[o + O_GROUP]
    s0 = prog[plan + PL_SENDS]
    for i in range(prog[plan + PL_NS]):
        g = s0 + i * G_N
        if prog[g + G_STEP] == step and prog[g + G_SEG] == seg:
            if prog[g0 + prog[g + G_PEER]] == dest:
                return i
    return -1


@njit(nogil=True, cache=True)
def _send_body(mem, prog, arena, b, slot, i, dest, g, n):
    """Post the body of large send segment ``i`` (cleared: its tag is known) straight from
    the op's buffer.  1 posted (or failed into an event), 0 no request free, 2 the peer
    has ``C_BODYCAP`` bodies in flight: later."""
    pw = mem[C_PEERS] + dest * P_N
    if mem[pw + P_BODIES] >= mem[C_BODYCAP]:
        return 2
    k = mem[C_NBREQ]
    if k >= mem[C_BREQCAP]:
        mem[C_BFULL] = 1  # Python grows the table; the body goes after that
        return 0
    o = _op(mem, slot)
    addr = mem[o + O_IN + prog[g + G_BUF]] + prog[g + G_OFF]
    tag = mem[_dyn(mem, slot, D_STAG) + i]
    hb = b[B_HANDLE_BYTES]
    rc = mpi_isend(b, addr, n, dest, tag, mem.ctypes.data + mem[C_BREQH] * 8 + k * hb)
    if rc < 0:
        _event(mem, arena, EV_MPI, slot, dest, rc, 0, 0)
        return 1
    e = mem[C_BREQ] + k * BR_N
    mem[e + BR_SLOT] = slot
    mem[e + BR_WHAT] = i
    mem[e + BR_PEER] = dest
    mem[e + BR_CANCEL] = 0
    mem[C_NBREQ] = k + 1
    mem[o + O_NREQ] += 1
    mem[pw + P_BODIES] += 1
    ss = _dyn(mem, slot, D_SS) + i
    mem[ss] = (mem[ss] & ~7) | SS_BODY
    mem[C_BODIES_SENT] += 1
    return 1


@njit(nogil=True, cache=True)
def _emit(mem, prog, arena, b, slot, i):
    """Send segment ``i`` of op ``slot`` (or announce it, or ask for its clear): 1 done,
    0 no room (try again later), 2 put off (its peer has enough bodies in flight)."""
    o = _op(mem, slot)
    if mem[o + O_STATE] != S_ACTIVE:
        return 1
    g = prog[mem[o + O_PLAN] + PL_SENDS] + i * G_N
    dest = prog[mem[o + O_GROUP] + prog[g + G_PEER]]
    ss = _dyn(mem, slot, D_SS) + i
    st = mem[ss]
    if (st & 7) == SS_SENT or (st & 7) == SS_BODY:
        return 1
    n = prog[g + G_NBYTES]
    if n > mem[C_MICRO]:  # a large segment: its body goes on its own tag once cleared
        if st & SB_CLEARED:
            return _send_body(mem, prog, arena, b, slot, i, dest, g, n)
        if (st & 7) == SS_ASKED:
            return 1
        a = _room(mem, arena, b, dest, FRAME_SIZE)
        if a == 0:
            return 0
        need = FLAG_NEED if mem[o + O_URGENT] else 0  # urgency travels with the frame
        _write_frame(mem, a, ASK, need, slot, prog[g + G_STEP], prog[g + G_SEG], n)
        mem[ss] = (st & ~7) | SS_ASKED
        return 1
    flags = 0
    if not st & SB_READY:
        pw = mem[C_PEERS] + dest * P_N
        if mem[pw + P_CREDIT] <= 0:
            if not st & SB_ANNOUNCED:
                a = _room(mem, arena, b, dest, FRAME_SIZE)
                if a == 0:
                    return 0
                _write_frame(mem, a, RTS, FLAG_NEED if mem[o + O_URGENT] else 0, slot, 0, 0, 0)
                _mark_peer(mem, prog, slot, dest, SB_ANNOUNCED)
            mem[ss] = (mem[ss] & ~7) | SS_HELD
            return 1
        flags = FLAG_CREDIT
    if mem[o + O_URGENT]:  # a thread here waits for the op: the peer raises it too
        flags |= FLAG_NEED
    a = _room(mem, arena, b, dest, FRAME_SIZE + ((n + 7) & ~7))
    if a == 0:
        return 0
    if flags & FLAG_CREDIT:
        mem[mem[C_PEERS] + dest * P_N + P_CREDIT] -= 1
    _write_frame(mem, a, DATA, flags, slot, prog[g + G_STEP], prog[g + G_SEG], n)
    if n:
        memcpy(a + FRAME_SIZE, mem[o + O_IN + prog[g + G_BUF]] + prog[g + G_OFF], n)
    _sent(mem, prog, arena, slot, i)
    return 1


@njit(nogil=True, cache=True)
def _send_ready(mem, prog, arena, b):
    """Send ready segments in priority order while there is room; bodies for a peer with
    ``C_BODYCAP`` in flight are put off (back into the heap after the pass), so a more
    urgent op's bodies overtake them when a body completes."""
    nd = 0
    dfr = mem[C_DEFER]
    while _heap_len(mem) > 0:
        slot, i = _heap_next(mem)
        if slot < 0:
            continue
        r = _emit(mem, prog, arena, b, slot, i)
        if r == 0:
            _heap_push(mem, slot, i)
            break
        if r == 2:
            mem[dfr + nd * 2] = slot
            mem[dfr + nd * 2 + 1] = i
            nd += 1
            continue
        _drain_stack(mem, prog, arena)
    for k in range(nd):
        _heap_push(mem, mem[dfr + k * 2], mem[dfr + k * 2 + 1])

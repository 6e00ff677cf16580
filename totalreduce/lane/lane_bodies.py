# ruff: noqa: F405 - the field constants come from totalreduce.protocol by a star import (Numba
# folds module globals into constants; listing ~100 names would only repeat them)
"""The compiled lane's answers and the rendezvous of its large segments.

Answers owed to a peer (``READY`` for an op it announced, ``CTS`` for a large receive) wait
in a queue until the peer's outbox has room.  A large receive segment (above
``micro_bytes``) is posted when its op starts, on a body tag of its own, and its sender is
told the tag unasked (``CTS``); a sender whose segment is ready without a clear asks
(``ASK``).  Neither frame is kept for an op not submitted at its receiver: the clear is
sent again when the op starts, the ask answered when it arrives.  Bodies go straight
from the op's buffer and land in its scratch (or in place); one ``MPI_Testsome`` a pass
tests them all.  Numba functions over the arrays of :mod:`totalreduce.protocol`; the pass that
drives them is :mod:`.lane_core`.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ..native.intrinsics import ld_i32, ld_i64, ld_u8, ld_u32, st_i32, st_u32
from ..native.libc import memcpy, now_ns
from ..protocol import *  # noqa: F403 - the protocol's words and fields
from ..transport.mpi_native import (
    B_HANDLE_BYTES,
    B_STATUS_BYTES,
    B_UNDEFINED,
    mpi_cancel,
    mpi_get_count,
    mpi_irecv,
    mpi_isend,
    mpi_test,
    mpi_testsome,
)
from .lane_progress import (
    _applied,
    _apply,
    _drain_stack,
    _fail,
    _find_send,
    _push_stack,
    _queue_post,
    _sent,
)
from .lane_tables import (
    _drop_front,
    _dyn,
    _event,
    _find_recv,
    _heap_push,
    _op,
    _raise,
    _room,
    _same_shape,
    _write_frame,
)

# ------------------------------------------------------------------ answers owed


@njit(nogil=True, cache=True)
def _owe(mem, arena, slot, peer, what):
    """Op ``slot`` owes ``peer`` an answer: READY (``what`` RQ_READY: the op is submitted
    here, and the peer announced frames for it), NEED (RQ_NEED: a thread here waits for
    the op, and expects frames from the peer) or the CTS of large receive segment ``what``.
    Queued, so that no answer is lost when the outbox has no room now."""
    n = mem[C_NRQ]
    if n >= mem[C_RQCAP]:
        _event(mem, arena, EV_LOST, slot, peer, n, 2, 0)
        return
    e = mem[C_RQ] + n * 4
    mem[e] = slot
    mem[e + 1] = mem[_op(mem, slot) + O_SEQ]
    mem[e + 2] = peer
    mem[e + 3] = what
    mem[C_NRQ] = n + 1


@njit(nogil=True, cache=True)
def _send_readies(mem, prog, arena, b):
    """Write the answers owed (READY, CTS), in order, while the outboxes have room."""
    n = mem[C_NRQ]
    done = 0
    while done < n:
        e = mem[C_RQ] + done * 4
        slot = mem[e]
        o = _op(mem, slot)
        if mem[o + O_SEQ] == mem[e + 1] and mem[o + O_STATE] == S_ACTIVE:
            a = _room(mem, arena, b, mem[e + 2], FRAME_SIZE)
            if a == 0:
                break
            q = mem[e + 3]
            need = FLAG_NEED if mem[o + O_URGENT] else 0  # urgency travels with the answer
            if q == RQ_NEED:
                _write_frame(mem, a, NEED, FLAG_NEED, slot, 0, 0, 0)
            elif q < 0:
                _write_frame(mem, a, READY, need, slot, 0, 0, 0)
            else:
                r = prog[mem[o + O_PLAN] + PL_RECVS] + q * G_N
                _write_frame(mem, a, CTS, need, slot, prog[r + G_STEP], prog[r + G_SEG],
                             prog[r + G_NBYTES])  # fmt: skip
                st_u32(a + FH_AUX, np.uint32(mem[_dyn(mem, slot, D_RSLOT) + q]))
        done += 1
    if done:
        _drop_front(mem, C_RQ, C_NRQ, done, 4)


@njit(nogil=True, cache=True)
def _ask_peers(mem, prog, arena, slot):
    """A thread has waited ``C_NEED_NS`` for op ``slot``: NEED to each rank it still
    expects frames from (once per op), so that they raise it, or start it raised if they
    have not submitted it yet (the frames it sent them so far may not have said so)."""
    o = _op(mem, slot)
    mem[o + O_WAITED] = -1
    plan = mem[o + O_PLAN]
    r0 = prog[plan + PL_RECVS]
    rs = _dyn(mem, slot, D_RS)
    g0 = mem[o + O_GROUP]
    mark = -mem[o + O_SEQ]  # (lane_submit marks peers with submission numbers, > 0)
    for q in range(prog[plan + PL_NR]):
        if mem[rs + q] != RS_WAIT and mem[rs + q] != RS_POSTED:
            continue
        src = prog[g0 + prog[r0 + q * G_N + G_PEER]]
        pw = mem[C_PEERS] + src * P_N
        if src != mem[C_RANK] and mem[pw + P_MARK] != mark:
            mem[pw + P_MARK] = mark
            _owe(mem, arena, slot, src, RQ_NEED)


# ------------------------------------------------------------------ large segments


@njit(nogil=True, cache=True)
def _post_recv(mem, prog, arena, b, slot, q):
    """Post the receive of large segment ``q`` of op ``slot`` into its scratch on a fresh
    body tag, and owe its peer the CTS that names the tag.  False if no request is free
    (``C_BFULL`` set: Python grows the table, and the receive is posted after that)."""
    k = mem[C_NBREQ]
    if k >= mem[C_BREQCAP]:
        mem[C_BFULL] = 1
        return False
    o = _op(mem, slot)
    r = prog[mem[o + O_PLAN] + PL_RECVS] + q * G_N
    src = prog[mem[o + O_GROUP] + prog[r + G_PEER]]
    pw = mem[C_PEERS] + src * P_N
    tag = mem[C_BTAG] + mem[pw + P_NEXTTAG]
    mem[pw + P_NEXTTAG] = (mem[pw + P_NEXTTAG] + 1) % mem[C_BSPAN]
    scr = prog[r + G_SCR]
    if scr == SCR_DIRECT:
        addr = mem[o + O_IN + prog[r + G_BUF]] + prog[r + G_OFF]
    else:
        addr = mem[o + O_SCR] + scr
    rc = mpi_irecv(b, addr, prog[r + G_NBYTES], src, tag,
                   mem.ctypes.data + mem[C_BREQH] * 8 + k * b[B_HANDLE_BYTES])  # fmt: skip
    if rc < 0:
        _event(mem, arena, EV_MPI, slot, src, rc, 0, 0)
        return True
    e = mem[C_BREQ] + k * BR_N
    mem[e + BR_SLOT] = slot
    mem[e + BR_WHAT] = -q - 1
    mem[e + BR_PEER] = src
    mem[e + BR_CANCEL] = 0
    mem[e + BR_T] = 0
    mem[C_NBREQ] = k + 1
    mem[o + O_NREQ] += 1
    mem[_dyn(mem, slot, D_RS) + q] = RS_POSTED
    mem[_dyn(mem, slot, D_RSLOT) + q] = tag
    _owe(mem, arena, slot, src, q)
    return True


@njit(nogil=True, cache=True)
def want_recv(mem, prog, arena, b, slot, q):
    """Post large receive ``q`` of op ``slot`` now, or queue it behind the ones waiting for
    a free request (posted in order once requests complete or the table grew); False if
    the queue is full."""
    if mem[C_NPQ] == 0 and _post_recv(mem, prog, arena, b, slot, q):
        return True
    return _queue_post(mem, slot, q)


@njit(nogil=True, cache=True)
def _post_waiting(mem, prog, arena, b):
    """Post the queued large receives, in order, while requests are free."""
    n = mem[C_NPQ]
    done = 0
    while done < n:
        e = mem[C_PQ] + done * 3
        slot = mem[e]
        o = _op(mem, slot)
        q = mem[e + 2]
        if (
            mem[o + O_SEQ] == mem[e + 1]
            and mem[o + O_STATE] == S_ACTIVE
            and mem[_dyn(mem, slot, D_RS) + q] == RS_WAIT
            and not _post_recv(mem, prog, arena, b, slot, q)
        ):
            break
        done += 1
    if done:
        _drop_front(mem, C_PQ, C_NPQ, done, 3)


@njit(nogil=True, cache=True)
def _body_done(mem, prog, arena, b, k, r):
    """Body request ``k`` completed (``r`` 1) or failed (``r`` < 0): the last entry takes
    its place; a sent body completes its segment (its successors may go on: the wire no
    longer reads the buffer), a received one is applied now or staged until its waits
    are over (one that came empty is not: its sender gave up), an orphan is forgotten."""
    hb = b[B_HANDLE_BYTES]
    hbase = mem.ctypes.data + mem[C_BREQH] * 8
    br = mem[C_BREQ]
    e = br + k * BR_N
    slot = mem[e + BR_SLOT]
    what = mem[e + BR_WHAT]
    peer = mem[e + BR_PEER]
    empty = mem[e + BR_CANCEL] == 2
    last = mem[C_NBREQ] - 1
    if k != last:
        el = br + last * BR_N
        for w in range(BR_N):
            mem[e + w] = mem[el + w]
        memcpy(hbase + k * hb, hbase + last * hb, hb)
    mem[C_NBREQ] = last
    if slot < 0:
        mem[C_ORPHANS] -= 1
        return
    o = _op(mem, slot)
    mem[o + O_NREQ] -= 1
    if what >= 0:
        mem[mem[C_PEERS] + peer * P_N + P_BODIES] -= 1
    if r < 0:
        _event(mem, arena, EV_MPI, slot, peer, r, 0, 0)
        _fail(mem, prog, arena, slot)
        return
    if mem[o + O_STATE] != S_ACTIVE:
        return
    if what >= 0:
        _sent(mem, prog, arena, slot, what)
        return
    q = -what - 1
    if empty:
        # Its sender's op failed before the body went: nothing to apply.  The op cannot
        # end now; the sender's error (on its way) fails it here.
        mem[_dyn(mem, slot, D_RS) + q] = RS_DONE
        return
    mem[C_BODIES_RECV] += 1
    rr = prog[mem[o + O_PLAN] + PL_RECVS] + q * G_N
    if prog[rr + G_SCR] == SCR_DIRECT:  # it landed where it belongs
        _applied(mem, prog, arena, slot, q)
        _push_stack(mem, arena, slot, -1)
    elif mem[_dyn(mem, slot, D_RW) + q] == 0:
        _apply(mem, prog, arena, slot, q, mem[o + O_SCR] + prog[rr + G_SCR])
        _push_stack(mem, arena, slot, -1)
    else:
        mem[_dyn(mem, slot, D_RS) + q] = RS_STAGED


@njit(nogil=True, cache=True)
def _reap_bodies(mem, prog, arena, b):
    """Test the posted bodies (one ``MPI_Testsome``: one turn of MPI's progress engine
    for all of them) and complete those done; orphans' receives are cancelled first.
    How many completed."""
    abase = arena.ctypes.data
    hb = b[B_HANDLE_BYTES]
    mbase = mem.ctypes.data
    hbase = mbase + mem[C_BREQH] * 8
    n = mem[C_NBREQ]
    if mem[C_ORPHANS]:
        # Orphan receives wait for their sender's body or empty message; after
        # C_ORPHAN_NS nothing will come (the sender never held the clear): cancelled.
        br = mem[C_BREQ]
        t = now_ns()
        for k in range(n):
            e = br + k * BR_N
            if (
                mem[e + BR_SLOT] < 0
                and mem[e + BR_WHAT] < 0
                and mem[e + BR_CANCEL] == 0
                and t - mem[e + BR_T] > mem[C_ORPHAN_NS]
            ):
                mpi_cancel(b, hbase + k * hb)
                mem[e + BR_CANCEL] = 1
    idx = mbase + mem[C_BIDX] * 8
    got = mpi_testsome(b, n, hbase, idx, mbase + mem[C_BST] * 8)
    if got == 0 or got == b[B_UNDEFINED]:
        return 0
    if got < 0:  # one failed: find which, one request at a time
        got = 0
        k = 0
        while k < mem[C_NBREQ]:
            r = mpi_test(b, hbase + k * hb, abase + mem[C_A_STATUS])
            if r == 0:
                k += 1
                continue
            if r > 0:
                _mark_empty(mem, prog, b, k, abase + mem[C_A_STATUS])
            _body_done(mem, prog, arena, b, k, r)
            got += 1
        _drain_stack(mem, prog, arena)
        return got
    sts = mbase + mem[C_BST] * 8
    for j in range(got):  # before the sort below: statuses are in MPI's order
        _mark_empty(mem, prog, b, np.int64(ld_i32(idx + 4 * j)), sts + j * b[B_STATUS_BYTES])
    # Highest position first: the entry that moves into a completed one's place is
    # then never one still to be handled.
    for j in range(1, got):
        v = ld_i32(idx + 4 * j)
        i = j - 1
        while i >= 0 and ld_i32(idx + 4 * i) < v:
            st_i32(idx + 4 * (i + 1), np.int32(ld_i32(idx + 4 * i)))
            i -= 1
        st_i32(idx + 4 * (i + 1), np.int32(v))
    for j in range(got):
        _body_done(mem, prog, arena, b, np.int64(ld_i32(idx + 4 * j)), 1)
    _drain_stack(mem, prog, arena)
    if mem[C_NPQ]:
        _post_waiting(mem, prog, arena, b)
    return got


@njit(nogil=True, cache=True)
def _large_segment(mem, prog, arena, slot, src, f, send):
    """The send (``send``) or receive segment of op ``slot`` that a CTS or ASK from ``src``
    (header at ``f``) names, checked against the frame's shape and byte count; -1 after
    an event (the op failed)."""
    if not _same_shape(mem, slot, f):
        _event(mem, arena, EV_MISMATCH, slot, src, 0, 0, f)
        _fail(mem, prog, arena, slot)
        return -1
    step = ld_u32(f + FH_STEP)
    seg = ld_u32(f + FH_SEGMENT)
    plan = mem[_op(mem, slot) + O_PLAN]
    if send:
        k = _find_send(mem, prog, slot, src, step, seg)
        rows = prog[plan + PL_SENDS]
    else:
        k = _find_recv(mem, prog, slot, src, step, seg)
        rows = prog[plan + PL_RECVS]
    if k < 0:
        _event(mem, arena, EV_UNEXPECTED, slot, src, 0, 0, f)
        _fail(mem, prog, arena, slot)
        return -1
    n = ld_i64(f + FH_NBYTES)
    want = prog[rows + k * G_N + G_NBYTES]
    if n != want or n <= mem[C_MICRO]:
        _event(mem, arena, EV_SIZE, slot, src, n, want, f)
        _fail(mem, prog, arena, slot)
        return -1
    if ld_u8(f + FH_FLAGS) & FLAG_NEED:  # a thread there waits for the op: raise it here
        _raise(mem, slot)
    return k


@njit(nogil=True, cache=True)
def _on_cts(mem, prog, arena, slot, src, f, tag):
    """``src`` posted the receive of our large send segment (step, seg) on ``tag``."""
    i = _large_segment(mem, prog, arena, slot, src, f, True)
    if i < 0:
        return
    ss = _dyn(mem, slot, D_SS) + i
    st = mem[ss]
    if (st & 7) == SS_BODY or (st & 7) == SS_SENT or st & SB_CLEARED:
        return  # a second clear (ours crossed its): the first one counts
    mem[_dyn(mem, slot, D_STAG) + i] = tag
    if (st & 7) == SS_ASKED:
        mem[ss] = (st & ~7) | SB_CLEARED  # ready again
        _heap_push(mem, slot, i)
    else:
        mem[ss] = st | SB_CLEARED


@njit(nogil=True, cache=True)
def _on_ask(mem, prog, arena, slot, src, f):
    """``src`` holds our large receive segment (step, seg) ready and has no clear."""
    q = _large_segment(mem, prog, arena, slot, src, f, False)
    if q >= 0 and mem[_dyn(mem, slot, D_RS) + q] == RS_POSTED:
        _owe(mem, arena, slot, src, q)


@njit(nogil=True, cache=True)
def _send_abandons(mem, arena, b):
    """Post the empty messages owed (``lane_tables._abandon``), in order, while body
    requests are free; each is an orphan request until MPI completes it."""
    n = mem[C_NAQ]
    hb = b[B_HANDLE_BYTES]
    hbase = mem.ctypes.data + mem[C_BREQH] * 8
    done = 0
    while done < n:
        k = mem[C_NBREQ]
        if k >= mem[C_BREQCAP]:
            mem[C_BFULL] = 1  # Python grows the table; the rest go after that
            break
        a = mem[C_AQ] + done * 2
        peer = mem[a]
        done += 1
        rc = mpi_isend(b, arena.ctypes.data, 0, peer, mem[a + 1], hbase + k * hb)
        if rc < 0:
            _event(mem, arena, EV_MPI, -1, peer, rc, 0, 0)
            continue
        e = mem[C_BREQ] + k * BR_N
        mem[e + BR_SLOT] = -1
        mem[e + BR_WHAT] = 0
        mem[e + BR_PEER] = peer
        mem[e + BR_CANCEL] = 1
        mem[e + BR_T] = 0
        mem[C_NBREQ] = k + 1
        mem[C_ORPHANS] += 1
    if done:
        _drop_front(mem, C_AQ, C_NAQ, done, 2)


@njit(nogil=True, cache=True)
def _mark_empty(mem, prog, b, k, status):
    """Body request ``k`` (completed, its status at ``status``): flag a receive of an
    active op that came with fewer bytes than its segment (an empty message: the sender
    gave up) so that ``_body_done`` does not apply it."""
    e = mem[C_BREQ] + k * BR_N
    slot = mem[e + BR_SLOT]
    what = mem[e + BR_WHAT]
    if slot < 0 or what >= 0:
        return
    o = _op(mem, slot)
    rr = prog[mem[o + O_PLAN] + PL_RECVS] + (-what - 1) * G_N
    if mpi_get_count(b, status) != prog[rr + G_NBYTES]:
        mem[e + BR_CANCEL] = 2

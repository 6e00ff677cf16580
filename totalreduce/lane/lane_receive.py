# ruff: noqa: F405 - the field constants come from totalreduce.protocol by a star import (Numba
# folds module globals into constants; listing ~100 names would only repeat them)
"""The compiled lane's receiving side: frames of a landed message placed by op key.

A frame of an op active here is applied (or staged until its turn, :func:`_place`); a
frame of an op not submitted here yet floats in a pool slot within its sender's credit
(:func:`_float`); frames of the rendezvous (announcements, answers, abandons) go to
:mod:`.lane_bodies`; the control frames (ERROR to JOIN) go up to Python as events
(:func:`_on_control`), bounded by a fixed buffer.  :func:`_consume` walks the landing buffer, and
:mod:`.lane_core`'s pass calls it.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ..native.intrinsics import (
    ld_i32,
    ld_i64,
    ld_u8,
    ld_u16,
    ld_u32,
)
from ..native.libc import memcpy
from ..protocol import *  # noqa: F403 - the protocol's words and fields
from .lane_bodies import (
    _on_ask,
    _on_cts,
    _owe,
)
from .lane_progress import (
    _apply,
    _drain_stack,
    _fail,
    _mark_peer,
    _push_stack,
)
from .lane_tables import (
    _abandon,
    _dyn,
    _event,
    _find_recv,
    _float_charge,
    _op,
    _raise,
    _same_shape,
    _slot_addr,
    ann_take,
    float_link,
    hash_value,
    slot_give,
    slot_take,
    unfloat,
)


@njit(nogil=True, cache=True)
def _place(mem, prog, arena, b, slot, src, f, pool_slot):
    """A DATA frame (header at ``f``) of active op ``slot`` from ``src``: apply its body,
    or stage it (in ``pool_slot`` if the frame already lies in one, else in a new slot).
    Returns False only when a new slot was needed and none is free."""
    if not _same_shape(mem, slot, f):
        _event(mem, arena, EV_MISMATCH, slot, src, 0, 0, f)
        _fail(mem, prog, arena, slot)
        if pool_slot >= 0:
            slot_give(mem, pool_slot)
        return True
    q = _find_recv(mem, prog, slot, src, ld_u32(f + FH_STEP), ld_u32(f + FH_SEGMENT))
    if q < 0 or mem[_dyn(mem, slot, D_RS) + q] != RS_WAIT:
        _event(mem, arena, EV_UNEXPECTED, slot, src, 0, 0, f)
        _fail(mem, prog, arena, slot)
        if pool_slot >= 0:
            slot_give(mem, pool_slot)
        return True
    o = _op(mem, slot)
    n = ld_i64(f + FH_NBYTES)
    want = prog[prog[mem[o + O_PLAN] + PL_RECVS] + q * G_N + G_NBYTES]
    if n != want:
        _event(mem, arena, EV_SIZE, slot, src, n, want, f)
        _fail(mem, prog, arena, slot)
        if pool_slot >= 0:
            slot_give(mem, pool_slot)
        return True
    if ld_u8(f + FH_FLAGS) & FLAG_NEED:
        _raise(mem, slot)
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
def _float(mem, arena, src, f, nbytes):
    """Keep a credited DATA frame of an op not submitted here in a pool slot (charged to
    the floating bytes, counted in its peer's credit); False when no slot is free."""
    s = slot_take(mem)
    if s < 0:
        return False
    memcpy(_slot_addr(mem, arena.ctypes.data, s), f, FRAME_SIZE + nbytes)
    m = mem[C_META] + s * M_N
    mem[m + M_SOURCE] = src
    mem[m + M_TYPE] = 1
    mem[m + M_CREDITED] = 1
    mem[mem[C_PEERS] + src * P_N + P_HELD] += 1
    mem[C_FLOATING] += 1
    _float_charge(mem, mem[C_SLOT])
    if not float_link(mem, ld_i64(f + FH_WID), ld_i64(f + FH_GEN), s):
        unfloat(mem, s, True)  # (the hash holds more keys than frames can float)
        _event(mem, arena, EV_LOST, -1, src, 0, 5, f)
    return True


@njit(nogil=True, cache=True)
def _announced(mem, arena, src, f):
    """An announcement (RTS) of an op not submitted here: ``src`` holds that op's frames
    for us and has no credit.  Kept in a small record (charged ``ANN_CHARGE``), so that
    the op's start here answers READY; when the table is full it is not kept, and every
    op started here that receives from ``src`` answers READY at once from then on."""
    x = ann_take(mem, src, RTS, ld_u8(f + FH_FLAGS))
    if x < 0 or not float_link(mem, ld_i64(f + FH_WID), ld_i64(f + FH_GEN), x):
        if x >= 0:
            unfloat(mem, x, False)
        mem[mem[C_PEERS] + src * P_N + P_ANNDROP] = 1
        mem[C_ANNDROPS] += 1


@njit(nogil=True, cache=True)
def _needed(mem, src, f):
    """A NEED of an op not submitted here: a thread on ``src`` waits for it.  Kept as an
    announcement is (a record charged ``ANN_CHARGE`` against the pool), so that the op
    starts raised here; when the table is full it is not kept (the op then rises when a
    frame of the peer's with ``FLAG_NEED`` meets it)."""
    x = ann_take(mem, src, NEED, FLAG_NEED)
    if x < 0:
        return
    if float_link(mem, ld_i64(f + FH_WID), ld_i64(f + FH_GEN), x):
        mem[C_NEEDS_KEPT] += 1
    else:
        unfloat(mem, x, False)


@njit(nogil=True, cache=True)
def _on_control(mem, arena, src, f, avail, ftype, n):
    """A control frame (ERROR to JOIN): handed up to Python as an event, its body (an
    ERROR's text, a PROBE's note) copied beside the others of the pass.  The bytes it
    took; -1 after a malformed-message event (a body it may not carry, a truncated one, more control
    frames in one message than a sender may put there); -2 when the control events are
    full: the rest of the message waits in the landing buffer until Python took them."""
    if n < 0 or n > (MAX_CONTROL_BODY if ftype == ERROR or ftype == PROBE else 0):
        _event(mem, arena, EV_MALFORMED, -1, src, MF_CONTROL, n, f)
        return -1
    size = FRAME_SIZE + ((n + 7) & ~7)
    if size > avail:
        _event(mem, arena, EV_MALFORMED, -1, src, MF_TRUNCATED, avail, f)
        return -1
    if mem[C_LANDCTL] >= CONTROL_PER_MESSAGE:
        _event(mem, arena, EV_MALFORMED, -1, src, MF_FLOOD, mem[C_LANDCTL] + 1, f)
        return -1
    used = mem[C_CTLBLEN]
    if (
        mem[C_NCTL] >= CONTROL_EVENTS
        or used + size - FRAME_SIZE > CONTROL_BODY_BYTES
        or 2 * (mem[C_NEV] + 1) >= mem[C_EVCAP]
    ):
        return -2
    mem[C_LANDCTL] += 1
    if n > 0:
        memcpy(arena.ctypes.data + mem[C_CTLB] + used, f + FRAME_SIZE, n)
    _event(mem, arena, EV_CONTROL, -1, src, used, n, f)
    mem[C_CTLBLEN] = used + size - FRAME_SIZE
    mem[C_NCTL] += 1
    return size


@njit(nogil=True, cache=True)
def _on_frame(mem, prog, arena, b, src, f, avail):
    """One frame at address ``f`` (``avail`` bytes left in the message); the bytes it took,
    0 when it must wait for a free slot, -2 for room among the control events, or -1
    after a malformed-message event."""
    ftype = ld_u8(f + FH_TYPE)
    flags = ld_u8(f + FH_FLAGS)
    n = ld_i64(f + FH_NBYTES)
    size = FRAME_SIZE
    if ftype == DATA:
        if n < 0 or n > mem[C_MICRO]:
            _event(mem, arena, EV_MALFORMED, -1, src, MF_BODY, n, f)
            return -1
        size = FRAME_SIZE + ((n + 7) & ~7)
    elif ftype >= ERROR and ftype <= JOIN:
        return _on_control(mem, arena, src, f, avail, ftype, n)
    elif ftype != RTS and ftype != READY and ftype != CTS and ftype != ASK and ftype != NEED:
        _event(mem, arena, EV_MALFORMED, -1, src, MF_TYPE, ftype, f)
        return -1
    if size > avail:
        _event(mem, arena, EV_MALFORMED, -1, src, MF_TRUNCATED, avail, f)
        return -1
    wid = ld_i64(f + FH_WID)
    gen = ld_i64(f + FH_GEN)
    credited = 1 if ftype == DATA and flags & FLAG_CREDIT else 0
    if credited:
        # Credit enforced on receipt: the frames of this peer floating here and the ones
        # consumed whose credit is not back with it yet never exceed what was granted.
        pw = mem[C_PEERS] + src * P_N
        if mem[pw + P_HELD] + mem[pw + P_OWED] >= mem[C_CREDIT]:
            _event(mem, arena, EV_MALFORMED, -1, src, MF_CREDIT, mem[C_CREDIT], f)
            return -1
    v = hash_value(mem, mem[C_HASH], wid, gen)
    if ftype == READY:
        if v >= 0:
            if flags & FLAG_NEED:
                _raise(mem, v)
            _mark_peer(mem, prog, v, src, SB_READY)
        return size
    if ftype == NEED:
        if v >= 0:
            _raise(mem, v)
        elif v == H_EMPTY:
            _needed(mem, src, f)
        # H_DONE, H_FAILED: the op ended here; what the waiter needs is on its way, or the
        # error is.
        return size
    if ftype == CTS or ftype == ASK:
        # Never kept for an op not submitted here: its sender asks again (ASK) or its
        # receiver clears again (CTS) once the op starts here.
        if v >= 0:
            if ftype == CTS:
                tag = np.int64(ld_u32(f + FH_AUX))
                if tag < mem[C_BTAG] or tag >= mem[C_BTAG] + mem[C_BSPAN]:
                    _event(mem, arena, EV_MALFORMED, -1, src, MF_TAG, tag, f)
                    return -1
                _on_cts(mem, prog, arena, v, src, f, tag)
            else:
                _on_ask(mem, prog, arena, v, src, f)
        elif v == H_FAILED and ftype == CTS:
            # The op failed here: the receive posted for its body is answered empty.
            tag = np.int64(ld_u32(f + FH_AUX))
            if mem[C_BTAG] <= tag < mem[C_BTAG] + mem[C_BSPAN]:
                _abandon(mem, arena, src, tag)
        # H_DONE: a second clear that crossed an ASK, or an ASK that crossed the clear
        # and whose body came first: both answered already.
        return size
    if ftype == RTS:
        if v >= 0:
            if flags & FLAG_NEED:
                _raise(mem, v)
            _owe(mem, arena, v, src, RQ_READY)
        elif v == H_DONE:
            _event(mem, arena, EV_LATE, -1, src, 0, 0, f)
        elif v == H_EMPTY:
            _announced(mem, arena, src, f)
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
        if not _float(mem, arena, src, f, n):
            return 0
        return size
    if v == H_DONE:
        _event(mem, arena, EV_LATE, -1, src, 0, 0, f)
    if credited:
        mem[mem[C_PEERS] + src * P_N + P_OWED] += 1
    return size


@njit(nogil=True, cache=True)
def _consume(mem, prog, arena, b):
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
            mem[mem[C_PEERS] + src * P_N + P_BAD] = 1
            return True
        if ld_u32(land + MH_MAGIC) != LANE_MAGIC or ld_u8(land + MH_VERSION) != LANE_VERSION:
            _event(mem, arena, EV_MALFORMED, -1, src, MF_MAGIC, ld_u32(land + MH_MAGIC), 0)
            mem[mem[C_PEERS] + src * P_N + P_BAD] = 1
            return True
        if ld_i32(land + MH_SENDER) != src:
            _event(mem, arena, EV_MALFORMED, -1, src, MF_SENDER, ld_i32(land + MH_SENDER), 0)
            mem[mem[C_PEERS] + src * P_N + P_BAD] = 1
            return True
        credit = ld_i64(land + MH_CREDIT)
        pw = mem[C_PEERS] + src * P_N
        if credit < 0 or mem[pw + P_CREDIT] + credit > mem[C_CREDIT]:
            _event(mem, arena, EV_MALFORMED, -1, src, MF_OVERCREDIT, credit, 0)
            mem[pw + P_BAD] = 1
            return True
        mem[pw + P_CREDIT] += credit
        mem[C_LANDPOS] = MSG_SIZE
        mem[C_LANDCTL] = 0
        # frames left to read go in the upper bits of the position's twin
        mem[C_LANDLEN] = length | (np.int64(ld_u16(land + MH_NFRAMES)) << 40)
    while True:
        pos = mem[C_LANDPOS]
        packed = mem[C_LANDLEN]
        length = packed & ((np.int64(1) << 40) - 1)
        left = packed >> 40
        if left == 0:
            if pos != length:
                _event(mem, arena, EV_MALFORMED, -1, src, MF_LONG, length - pos, 0)
                mem[mem[C_PEERS] + src * P_N + P_BAD] = 1
            mem[C_LANDLEN] = 0
            mem[C_LANDPOS] = 0
            mem[C_FULL] = 0
            return True
        if pos + FRAME_SIZE > length:
            _event(mem, arena, EV_MALFORMED, -1, src, MF_TRUNCATED, length - pos, 0)
            mem[mem[C_PEERS] + src * P_N + P_BAD] = 1
            mem[C_LANDLEN] = 0
            mem[C_LANDPOS] = 0
            mem[C_FULL] = 0
            return True
        took = _on_frame(mem, prog, arena, b, src, land + pos, length - pos)
        if took == 0 or took == -2:
            mem[C_FULL] = 1 if took == 0 else 2
            return False
        if took < 0:
            mem[mem[C_PEERS] + src * P_N + P_BAD] = 1  # the rest of what it sends is dropped
            mem[C_LANDLEN] = 0
            mem[C_LANDPOS] = 0
            mem[C_FULL] = 0
            return True
        mem[C_LANDPOS] = pos + took
        mem[C_LANDLEN] = length | ((left - 1) << 40)
        _drain_stack(mem, prog, arena)

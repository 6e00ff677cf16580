"""A daemon client's submission ring from compiled code: a repeat submitted and waited for in
one call.

On a service of several nodes an op goes through the node's service: the client writes its
descriptor into its submission ring (:mod:`.arena`), wakes the service if it sleeps, and
waits for the op's completion word.  For a repeat of an op whose descriptor the client kept
(the express path), :func:`ring_now` does all of it in one compiled call, with nothing made
in Python: a ticket taken by compare-and-swap (:func:`.meeting.take_ticket`), the
descriptor written at a ring position taken by an atomic add and published in order (the
control block's tail moves past a position only once every earlier one is written, so
threads of one client may submit at once, without a lock), the service's eventfd written
if its arena thread sleeps, then the wait: the completion word polled (without yielding
the core for the first microseconds where the node's processes do not outnumber the
cores, yielding it between looks after that), then a sleep on the control block's futex
word, which whoever sets one of the client's words bumps and wakes.  No lock is held
while it waits.  An op that ended well is remembered in the client's state (its ticket,
generation and what it was, for a late error that names it) and its ticket given back.

Anything else goes back to Python with the ticket: a completion word that says the op
failed (Python reads the error ring and raises), and a wait that lasted ``check_ns``
(Python looks at the service's socket, then waits again with :func:`ring_wait`, or raises
its timeout).

The ring holds :data:`~.arena.RING` descriptors and a client at most as many tickets, so a
position is never reused before the service read the descriptor there: a descriptor not
yet read belongs to an op whose ticket is still held.
"""

from __future__ import annotations

import numpy as np
from numba import njit, types

from ..native.intrinsics import (
    atomic_add_i64,
    atomic_load_i64,
    atomic_store_i64,
    cpu_relax,
    fence,
    st_i64,
)
from ..native.libc import now_ns, yield_cpu
from . import arena as A
from .meeting import (
    ST_CALLS,
    ST_CTL,
    ST_EFD,
    ST_ENDED,
    ST_HDR,
    ST_LATE,
    ST_ONE,
    ST_PLACED,
    ST_PURE,
    ST_SLEPT,
    ST_WOKE,
    _release,
    futex_seq,
    sleep,
    sleepers,
    take_ticket,
)

_RING, _DW = A.RING, A.D_WORDS
_RING_WORD, _DONE_WORD = A.RING_WORD, A.DONE_WORD
_C_TAIL, _C_LATE = A.C_TAIL, A.C_LATE
_D_TICKET, _D_GEN, _D_PRIO, _D_IN, _D_OUT = A.D_TICKET, A.D_GEN, A.D_PRIO, A.D_IN, A.D_OUT
_H_SERVICE_SLEEPING = A.H_SERVICE_SLEEPING
#: write(fd, buffer address, bytes): the service's eventfd written from compiled code (linked
#: by name, as native/libc's functions are; declared here, where alone it is used, so that
#: the lane's sources stay as they were)
_write = types.ExternalFunction("write", types.int64(types.int32, types.int64, types.int64))

#: What :func:`ring_now` returns in its low four bits (the ticket above them, but for
#: R_DONE and R_BUSY): ended well; nothing taken (a late error waits to be raised, or every
#: completion word is in use: Python goes the whole way); the word says it failed; still on
#: its way after ``check_ns``.
R_DONE, R_BUSY, R_FAILED, R_PENDING = 0, 1, 2, 3
R_SHIFT = 4
R_MASK = (1 << R_SHIFT) - 1
#: What :func:`ring_wait` returns (as :func:`.meeting.meet_wait`).
W_DONE, W_FAILED, W_TIMEOUT, W_CHECK = 1, 2, 3, 4


@njit(nogil=True, cache=True)
def _put(ctl, st, row, ticket, gen, prio, at_in, at_out):  # type: ignore[no-untyped-def]
    """Write descriptor ``row`` with these fields at the next ring position, then move the
    tail past it once every earlier position is written (another thread of this client
    may be writing one)."""
    pos = atomic_add_i64(st.ctypes.data + 8 * ST_PLACED, 1) + 1
    d = ctl + 8 * (_RING_WORD + ((pos - 1) % _RING) * _DW)
    for i in range(_DW):
        st_i64(d + 8 * i, row[i])
    st_i64(d + 8 * _D_TICKET, ticket)
    st_i64(d + 8 * _D_GEN, gen)
    st_i64(d + 8 * _D_PRIO, prio)
    st_i64(d + 8 * _D_IN, at_in)
    st_i64(d + 8 * _D_OUT, at_out)
    tail = ctl + 8 * _C_TAIL
    while atomic_load_i64(tail) != pos - 1:
        yield_cpu()  # an earlier position's writer was preempted between its two steps
    atomic_store_i64(tail, pos)


def bind(st: np.ndarray, ctl: int, hdr: int, efd: int, pure_ns: int) -> None:
    """Keep in a client's state ``st`` what its compiled calls take from there: the
    addresses of its control block and of the arena's header, the service's eventfd,
    and how long a wait polls before it yields the core."""
    st[ST_CTL], st[ST_HDR], st[ST_EFD], st[ST_PURE] = ctl, hdr, efd, pure_ns


@njit(nogil=True, cache=True)
def ring_submit(st, row, gen, prio, at_in, at_out, ticket):  # type: ignore[no-untyped-def]
    """A submission that makes a handle (Python's): descriptor ``row`` with these fields
    under ``ticket`` (0: one taken here) into the client's ring (``st`` is its state,
    :func:`bind`), at the positions :func:`ring_now` takes too, and the service woken if
    it sleeps.  The ticket, or -1 if none was free (nothing written)."""
    t = ticket
    if t <= 0:
        t = take_ticket(st)
        if t < 0:
            return t
    _put(st[ST_CTL], st, row, t, gen, prio, at_in, at_out)
    wake_service(st)
    return t


@njit(nogil=True, cache=True)
def wake_service(st):  # type: ignore[no-untyped-def]
    """After a descriptor: write the service's eventfd if its arena thread sleeps;
    whether it did."""
    fence()
    if atomic_load_i64(st[ST_HDR] + 8 * _H_SERVICE_SLEEPING) != 0:
        _write(np.int32(st[ST_EFD]), st.ctypes.data + 8 * ST_ONE, 8)
        atomic_add_i64(st.ctypes.data + 8 * ST_WOKE, 1)
        return True
    return False


@njit(nogil=True, cache=True)
def ring_wait(st, ticket, deadline_ns, spin_ns, check_ns):  # type: ignore[no-untyped-def]
    """Wait for the completion word of op ``ticket``: W_DONE, W_FAILED, W_TIMEOUT
    (``deadline_ns`` of the monotonic clock passed), W_CHECK (``check_ns`` passed: Python
    looks at the socket).  Polls for ``spin_ns`` (the first ``st[ST_PURE]`` without
    yielding the core), then sleeps on the futex word."""
    ctl = st[ST_CTL]
    pure_ns = st[ST_PURE]
    word = ctl + 8 * (_DONE_WORD + (ticket - 1) % _RING)
    t0 = now_ns()
    while True:
        w = atomic_load_i64(word)
        if w == ticket:
            return W_DONE
        if w == -ticket:
            return W_FAILED
        t = now_ns()
        if t >= deadline_ns:
            return W_TIMEOUT
        if t - t0 >= check_ns:
            return W_CHECK
        if t - t0 < spin_ns:
            if t - t0 < pure_ns:
                cpu_relax()
            else:
                yield_cpu()
            continue
        seq = futex_seq(ctl)
        sleepers(ctl, 1)
        w = atomic_load_i64(word)
        if w != ticket and w != -ticket:
            left = min(deadline_ns - t, check_ns - (t - t0))
            atomic_add_i64(st.ctypes.data + 8 * ST_SLEPT, 1)
            sleep(ctl, np.int64(seq), max(left, 1000))
        sleepers(ctl, -1)


@njit(nogil=True, cache=True)
def ended(st, ticket, gen, what):  # type: ignore[no-untyped-def]
    """Op ``ticket`` (generation ``gen``, ``what``: the client's index of its kind and
    name) ended well here and its word was seen: remembered for a late error, its
    ticket given back."""
    e = ST_ENDED + 3 * (ticket % _RING)
    st[e + 1] = gen
    st[e + 2] = what
    st[e] = ticket
    _release(st, ticket, -1)


@njit(nogil=True, cache=True)
def ring_now(st, row, gen, prio, at_in, at_out, spin_ns, check_ns, what):  # type: ignore[no-untyped-def]
    """A blocking repeat: descriptor ``row`` with generation ``gen``, priority ``prio``
    and buffers at arena offsets ``at_in``, ``at_out``, submitted into the ring of the
    client whose state is ``st`` (:func:`bind`) and waited for in one call.  Returns
    R_DONE (ended well: remembered, its ticket given back), R_BUSY (nothing taken), or
    ``ticket << R_SHIFT | R_FAILED`` or ``| R_PENDING`` (the op is in flight under
    ``ticket``: Python goes on)."""
    ctl = st[ST_CTL]
    if atomic_load_i64(ctl + 8 * _C_LATE) != st[ST_LATE]:
        return R_BUSY
    t = take_ticket(st)
    if t < 0:
        return R_BUSY
    _put(ctl, st, row, t, gen, prio, at_in, at_out)
    atomic_add_i64(st.ctypes.data + 8 * ST_CALLS, 1)
    wake_service(st)
    w = ring_wait(st, t, now_ns() + check_ns, spin_ns, check_ns)
    if w == W_DONE:
        ended(st, t, gen, what)
        return R_DONE
    return t << R_SHIFT | (R_FAILED if w == W_FAILED else R_PENDING)


@njit(nogil=True, cache=True)
def now():  # type: ignore[no-untyped-def]
    """The monotonic clock of the deadlines (ns)."""
    return now_ns()


def prepare() -> None:
    """Compile the ring's functions (or load them from Numba's cache)."""
    from .meeting import state

    ctl = np.zeros(A.CONTROL_BYTES // 8, np.int64)
    hdr = np.zeros(A.HEADER_BYTES // 8, np.int64)
    st = state(0)
    row = np.zeros(_DW, np.int64)
    bind(st, ctl.ctypes.data, hdr.ctypes.data, -1, 0)
    ring_submit(st, row, 0, 0, -1, -1, 0)
    ctl[_DONE_WORD + 1] = 2
    ring_now(st, row, 0, 0, -1, -1, 0, 0, 0)
    ring_wait(st, np.int64(3), now(), 0, 0)
    ended(st, np.int64(3), 0, 0)

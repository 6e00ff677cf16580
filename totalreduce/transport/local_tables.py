"""The local world's tables: the layout of its one ``int64`` array, its lock, its lists and
the matching, as Numba functions (:mod:`.local_calls` compiles MPI's calls from them;
:class:`~.local_native.NativeWorld` makes the array).

The array: a header, a table of ``capacity`` entries (one per pending send or receive, and
the free list through them), per rank two lists (messages not received yet, receives not
matched yet), and per pair of ranks the clock at which the sender's last send to the other
becomes visible (the jitter holds sends back, never out of a sender's order).  A request
handle is the address of its entry.  One spin lock guards the world (it spins briefly,
then yields the core: ranks may outnumber cores).  Also here: the constants of this
"library" (MPICH's values where MPI fixes none), its status layout and its error codes.

Numba checks a cached function against its own file only: :mod:`.local_calls` names this
file in its ``SOURCES``, so a change here drops its cached code too.
"""

from __future__ import annotations

import numpy as np
from numba import carray, njit

from ..native.intrinsics import (
    atomic_cas_i64,
    atomic_store_i64,
    cpu_relax,
    ld_i64,
    ptr_u8,
    st_i32,
    st_i64,
)
from ..native.libc import yield_cpu

# ---------------------------------------------------------------------------- layout

#: The header's words.
H_LOCK = 0
H_SIZE = 1
H_CAP = 2
H_FREE = 3  # first free entry, -1 none
H_USED = 4  # entries in use
H_PEAK = 5  # the most ever in use
H_JITTER = 6  # the chance (in 2**-20) that a send is held back for a few calls
H_RNG = 7  # the jitter's xorshift state
H_CLOCK = 8  # calls into the world so far: the time held sends wait for
H_HELD = 9  # sends held back (not visible yet)
H_HOLDS = 10  # sends ever held back
H_LEN = 12

#: An entry's words.
E_STATE = 0
E_KIND = 1
E_WORLD = 2  # the world's address (a handle leads back to it)
E_SRC = 3  # send: its sender; receive: the source it takes (ANY_SOURCE: any)
E_DST = 4  # send: its destination; receive: its owner
E_TAG = 5
E_ADDR = 6
E_NBYTES = 7  # send: its length; receive: its room
E_NEXT = 8  # the list it is in (free, a box's unexpected or posted), -1 at the end
E_COUNT = 9  # receive: bytes received
E_MSRC = 10  # receive: the sender matched
E_MTAG = 11  # receive: the tag matched
E_ERR = 12
E_FREED = 13  # MPI_Request_free came first: free the entry when it completes
E_CANCELLED = 14
E_VISIBLE = 15  # a send held back: the clock at which it becomes visible (0: it is)
E_WORDS = 16

#: Entry states.
FREE = 0
QUEUED = 1  # a send in its destination's unexpected list, a receive in its owner's posted list
PROBED = 2  # a send matched by MPI_Improbe, waiting for MPI_Mrecv
DONE = 3

SEND = 1
RECV = 2

#: Per rank: the unexpected sends' list and the posted receives' list (head, tail).
X_UHEAD = 0
X_UTAIL = 1
X_PHEAD = 2
X_PTAIL = 3
X_N = 4

#: The comm record a communicator handle points to.
CM_WORLD = 0
CM_RANK = 1
CM_SIZE = 2

#: Constants of this "library" (MPICH's values where MPI fixes none).
ANY_SOURCE = -2
ANY_TAG = -1
UNDEFINED = -32766
NULL = 0  # MPI_REQUEST_NULL and MPI_MESSAGE_NULL

#: The status: 24 bytes.
S_SOURCE = 0
S_TAG = 4
S_ERROR = 8
S_CANCELLED = 12
S_COUNT = 16
S_BYTES = 24

#: Error codes (MPICH's numbers).
ERR_COUNT = 2
ERR_TAG = 4
ERR_RANK = 6
ERR_TRUNCATE = 14
ERR_OTHER = 15
ERR_IN_STATUS = 17
ERR_NO_MEM = 34
_ERRORS = {
    ERR_COUNT: "invalid count",
    ERR_TAG: "invalid tag",
    ERR_RANK: "invalid rank",
    ERR_TRUNCATE: "message truncated",
    ERR_OTHER: "no such message",
    ERR_IN_STATUS: "error code in status",
    ERR_NO_MEM: "the local world's entries are all in use",
}

DEFAULT_CAPACITY = 1 << 16


def error_text(code: int) -> str:
    """What a wrapper's ``-code`` means when the record is this library's."""
    return f"{_ERRORS.get(code, 'unknown error')} (local transport, error {code})"


# ---------------------------------------------------------------------------- helpers


@njit(nogil=True, cache=True, inline="always")
def _ent(w, i, f):  # type: ignore[no-untyped-def]
    """Address of field ``f`` of entry ``i``."""
    return w + 8 * (H_LEN + i * E_WORDS + f)


@njit(nogil=True, cache=True, inline="always")
def _box(w, rank, f):  # type: ignore[no-untyped-def]
    return w + 8 * (H_LEN + ld_i64(w + 8 * H_CAP) * E_WORDS + rank * X_N + f)


@njit(nogil=True, cache=True, inline="always")
def _index(w, h):  # type: ignore[no-untyped-def]
    return (h - w - 8 * H_LEN) // (8 * E_WORDS)


@njit(nogil=True, cache=True)
def _lock(w):  # type: ignore[no-untyped-def]
    spins = 0
    while atomic_cas_i64(w + 8 * H_LOCK, np.int64(0), np.int64(1)) != 0:
        spins += 1
        if spins < 64:
            cpu_relax()
        else:
            yield_cpu()  # the holder may be off its core: ranks can outnumber cores


@njit(nogil=True, cache=True, inline="always")
def _unlock(w):  # type: ignore[no-untyped-def]
    atomic_store_i64(w + 8 * H_LOCK, np.int64(0))


@njit(nogil=True, cache=True)
def _alloc(w):  # type: ignore[no-untyped-def]
    i = ld_i64(w + 8 * H_FREE)
    if i < 0:
        return np.int64(-1)
    st_i64(w + 8 * H_FREE, ld_i64(_ent(w, i, E_NEXT)))
    for f in range(E_WORDS):
        st_i64(_ent(w, i, f), np.int64(0))
    st_i64(_ent(w, i, E_WORLD), w)
    st_i64(_ent(w, i, E_NEXT), np.int64(-1))
    used = ld_i64(w + 8 * H_USED) + 1
    st_i64(w + 8 * H_USED, used)
    if used > ld_i64(w + 8 * H_PEAK):
        st_i64(w + 8 * H_PEAK, used)
    return i


@njit(nogil=True, cache=True)
def _free(w, i):  # type: ignore[no-untyped-def]
    atomic_store_i64(_ent(w, i, E_STATE), np.int64(FREE))
    st_i64(_ent(w, i, E_NEXT), ld_i64(w + 8 * H_FREE))
    st_i64(w + 8 * H_FREE, i)
    st_i64(w + 8 * H_USED, ld_i64(w + 8 * H_USED) - 1)


@njit(nogil=True, cache=True)
def _append(w, rank, head, tail, i):  # type: ignore[no-untyped-def]
    st_i64(_ent(w, i, E_NEXT), np.int64(-1))
    t = ld_i64(_box(w, rank, tail))
    if t < 0:
        st_i64(_box(w, rank, head), i)
    else:
        st_i64(_ent(w, t, E_NEXT), i)
    st_i64(_box(w, rank, tail), i)


@njit(nogil=True, cache=True)
def _unlink(w, rank, head, tail, prev, i):  # type: ignore[no-untyped-def]
    nxt = ld_i64(_ent(w, i, E_NEXT))
    if prev < 0:
        st_i64(_box(w, rank, head), nxt)
    else:
        st_i64(_ent(w, prev, E_NEXT), nxt)
    if ld_i64(_box(w, rank, tail)) == i:
        st_i64(_box(w, rank, tail), prev)
    st_i64(_ent(w, i, E_NEXT), np.int64(-1))


@njit(nogil=True, cache=True)
def _find(w, rank, head, source, tag, field_src):  # type: ignore[no-untyped-def]
    """(previous, entry) of the first visible entry of ``rank``'s list ``head`` whose source
    and tag fit (``field_src``: the entries' field that holds a source), or (-1, -1).  A
    sender's later messages to a rank are never visible before its earlier ones."""
    prev = np.int64(-1)
    i = ld_i64(_box(w, rank, head))
    while i >= 0:
        s = ld_i64(_ent(w, i, field_src))
        t = ld_i64(_ent(w, i, E_TAG))
        if (
            ld_i64(_ent(w, i, E_VISIBLE)) == 0
            and (source == ANY_SOURCE or s == ANY_SOURCE or s == source)
            and (tag == ANY_TAG or t == ANY_TAG or t == tag)
        ):
            return prev, i
        prev = i
        i = ld_i64(_ent(w, i, E_NEXT))
    return np.int64(-1), np.int64(-1)


@njit(nogil=True, cache=True)
def _copy(dst, src, n):  # type: ignore[no-untyped-def]
    if n > 0:
        carray(ptr_u8(dst), n)[:] = carray(ptr_u8(src), n)


@njit(nogil=True, cache=True)
def _settle(w, i):  # type: ignore[no-untyped-def]
    """Entry ``i`` completed: done, or freed if its request was freed first."""
    if ld_i64(_ent(w, i, E_FREED)) != 0:
        _free(w, i)
    else:
        atomic_store_i64(_ent(w, i, E_STATE), np.int64(DONE))


@njit(nogil=True, cache=True)
def _match(w, s, r):  # type: ignore[no-untyped-def]
    """Send ``s`` meets receive ``r``: copy, fill the receive's result, complete both."""
    n = ld_i64(_ent(w, s, E_NBYTES))
    room = ld_i64(_ent(w, r, E_NBYTES))
    if n > room:
        st_i64(_ent(w, r, E_ERR), np.int64(ERR_TRUNCATE))
        n = room
    _copy(ld_i64(_ent(w, r, E_ADDR)), ld_i64(_ent(w, s, E_ADDR)), n)
    st_i64(_ent(w, r, E_COUNT), n)
    st_i64(_ent(w, r, E_MSRC), ld_i64(_ent(w, s, E_SRC)))
    st_i64(_ent(w, r, E_MTAG), ld_i64(_ent(w, s, E_TAG)))
    _settle(w, s)
    _settle(w, r)


@njit(nogil=True, cache=True)
def _status(st, source, tag, err, cancelled, count):  # type: ignore[no-untyped-def]
    if st != 0:
        st_i32(st + S_SOURCE, np.int32(source))
        st_i32(st + S_TAG, np.int32(tag))
        st_i32(st + S_ERROR, np.int32(err))
        st_i32(st + S_CANCELLED, np.int32(cancelled))
        st_i64(st + S_COUNT, np.int64(count))


@njit(nogil=True, cache=True)
def _result(w, i, st):  # type: ignore[no-untyped-def]
    """Write done entry ``i``'s status at ``st``, free it; its error code."""
    err = ld_i64(_ent(w, i, E_ERR))
    if ld_i64(_ent(w, i, E_KIND)) == RECV:
        _status(
            st,
            ld_i64(_ent(w, i, E_MSRC)),
            ld_i64(_ent(w, i, E_MTAG)),
            err,
            ld_i64(_ent(w, i, E_CANCELLED)),
            ld_i64(_ent(w, i, E_COUNT)),
        )
    else:
        _status(st, ANY_SOURCE, ANY_TAG, err, ld_i64(_ent(w, i, E_CANCELLED)), 0)
    _free(w, i)
    return err


@njit(nogil=True, cache=True, inline="always")
def _pair(w, src, dst):  # type: ignore[no-untyped-def]
    """Address of the clock at which ``src``'s last send to ``dst`` becomes visible."""
    size = ld_i64(w + 8 * H_SIZE)
    base = H_LEN + ld_i64(w + 8 * H_CAP) * E_WORDS + size * X_N
    return w + 8 * (base + src * size + dst)


@njit(nogil=True, cache=True)
def _random(w):  # type: ignore[no-untyped-def]
    x = ld_i64(w + 8 * H_RNG)
    x ^= x << 13
    x ^= (x >> 7) & np.int64(0x01FFFFFFFFFFFFFF)
    x ^= x << 17
    st_i64(w + 8 * H_RNG, x)
    return x & np.int64(0x7FFFFFFFFFFFFFFF)


@njit(nogil=True, cache=True)
def _tick(w):  # type: ignore[no-untyped-def]
    """One more call into the world (under the lock): held sends whose time has come arrive
    now (behind what came meanwhile; a sender's own stay in order), meeting the receives
    posted for them."""
    clock = ld_i64(w + 8 * H_CLOCK) + 1
    st_i64(w + 8 * H_CLOCK, clock)
    if ld_i64(w + 8 * H_HELD) == 0:
        return
    for rank in range(ld_i64(w + 8 * H_SIZE)):
        prev = np.int64(-1)
        i = ld_i64(_box(w, rank, X_UHEAD))
        while i >= 0:
            nxt = ld_i64(_ent(w, i, E_NEXT))
            vis = ld_i64(_ent(w, i, E_VISIBLE))
            if vis != 0 and vis <= clock:
                st_i64(_ent(w, i, E_VISIBLE), np.int64(0))
                st_i64(w + 8 * H_HELD, ld_i64(w + 8 * H_HELD) - 1)
                rp, r = _find(
                    w, rank, X_PHEAD, ld_i64(_ent(w, i, E_SRC)), ld_i64(_ent(w, i, E_TAG)), E_SRC
                )
                _unlink(w, rank, X_UHEAD, X_UTAIL, prev, i)
                if r >= 0:
                    _unlink(w, rank, X_PHEAD, X_PTAIL, rp, r)
                    _match(w, i, r)
                else:  # it arrives now: behind what came while it was held
                    _append(w, rank, X_UHEAD, X_UTAIL, i)
                i = nxt
                continue
            prev = i
            i = nxt


@njit(nogil=True, cache=True)
def _hold(w, src, dst):  # type: ignore[no-untyped-def]
    """The clock at which a send from ``src`` to ``dst`` posted now becomes visible (now,
    unless the jitter holds it back), never before that sender's earlier ones to ``dst``."""
    clock = ld_i64(w + 8 * H_CLOCK)
    vis = clock
    jitter = ld_i64(w + 8 * H_JITTER)
    if jitter > 0:
        r = _random(w)
        if (r & np.int64(0xFFFFF)) < jitter:
            vis = clock + 1 + ((r >> 20) & np.int64(3))
    last = ld_i64(_pair(w, src, dst))
    if last > vis:
        vis = last
    st_i64(_pair(w, src, dst), vis)
    return np.int64(0) if vis <= clock else vis

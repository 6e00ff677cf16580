"""The local transport's compiled side: MPI's point-to-point calls for ranks that are threads
of one process, as C functions (Numba ``cfunc``) that compiled code calls through the same
binding record as the MPI library's (:mod:`.mpi_native`).

The compiled lane talks to its peers only through that record: function addresses, handle
values, the status layout.  :func:`binding` fills one with the functions below instead of
``libmpi``'s, so the lane runs unchanged over the local transport, and a new transport is a
new set of such functions, in ``transport/``.

What they keep of MPI:

- matching: a receive takes the earliest message from its source (or any) on its tag (or
  any); messages of one sender on one tag are never overtaken;
- ``MPI_Isend`` is a rendezvous: the receiver copies from the sender's buffer when a
  receive matches it, and only then does the send complete (as the Python local transport
  does), so a buffer reused while its send is in flight shows up as a wrong result;
- ``MPI_Improbe`` / ``MPI_Mrecv``, ``MPI_Test`` / ``Testall`` / ``Testsome`` (completed
  handles become ``MPI_REQUEST_NULL``; all-null gives ``MPI_UNDEFINED``), ``MPI_Cancel``
  of a receive not matched yet (or a send not matched yet), ``MPI_Request_free`` of a
  pending request (freed when it completes), ``MPI_Get_count``, ``MPI_Test_cancelled``;
- truncation: a message longer than its receive fills the receive and fails it with
  ``ERR_TRUNCATE`` (``Testsome``: ``ERR_IN_STATUS``, the status names it).

The world is one ``int64`` array: a header, a table of ``capacity`` entries (one per
pending send or receive, and the free list through them), and per rank two lists (messages
not received yet, receives not matched yet).  A request handle is the address of its entry,
8 bytes, as Open MPI's pointer handles are.  One spin lock guards the world (it spins
briefly, then yields the core: ranks may outnumber cores); tests that find nothing done
and probes of an empty list take no lock.  A world that runs out of entries fails the call
with ``ERR_NO_MEM``, which the lane reports as an MPI error naming the peer.
"""

from __future__ import annotations

import numpy as np
from numba import carray, cfunc, njit, types

from ..native.intrinsics import (
    atomic_cas_i64,
    atomic_load_i64,
    atomic_store_i64,
    cpu_relax,
    ld_i32,
    ld_i64,
    ptr_u8,
    st_i32,
    st_i64,
)
from ..native.libc import yield_cpu
from . import mpi_native as M

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
E_N = 16

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
C_WORLD = 0
C_RANK = 1
C_SIZE = 2

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
    return w + 8 * (H_LEN + i * E_N + f)


@njit(nogil=True, cache=True, inline="always")
def _box(w, rank, f):  # type: ignore[no-untyped-def]
    return w + 8 * (H_LEN + ld_i64(w + 8 * H_CAP) * E_N + rank * X_N + f)


@njit(nogil=True, cache=True, inline="always")
def _index(w, h):  # type: ignore[no-untyped-def]
    return (h - w - 8 * H_LEN) // (8 * E_N)


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
    for f in range(E_N):
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
    base = H_LEN + ld_i64(w + 8 * H_CAP) * E_N + size * X_N
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


@njit(nogil=True, cache=True)
def _post(buf, count, peer, tag, comm, req, kind):  # type: ignore[no-untyped-def]
    w = ld_i64(comm + 8 * C_WORLD)
    rank = ld_i64(comm + 8 * C_RANK)
    size = ld_i64(comm + 8 * C_SIZE)
    if count < 0:
        return np.int32(ERR_COUNT)
    if kind == SEND and (peer < 0 or peer >= size):
        return np.int32(ERR_RANK)
    if kind == RECV and peer != ANY_SOURCE and (peer < 0 or peer >= size):
        return np.int32(ERR_RANK)
    if tag < 0 and not (kind == RECV and tag == ANY_TAG):
        return np.int32(ERR_TAG)
    _lock(w)
    _tick(w)
    i = _alloc(w)
    if i < 0:
        _unlock(w)
        return np.int32(ERR_NO_MEM)
    st_i64(_ent(w, i, E_KIND), np.int64(kind))
    st_i64(_ent(w, i, E_TAG), np.int64(tag))
    st_i64(_ent(w, i, E_ADDR), buf)
    st_i64(_ent(w, i, E_NBYTES), np.int64(count))
    if kind == SEND:
        st_i64(_ent(w, i, E_SRC), rank)
        st_i64(_ent(w, i, E_DST), np.int64(peer))
        vis = _hold(w, rank, np.int64(peer))
        prev, r = (np.int64(-1), np.int64(-1))
        if vis == 0:
            prev, r = _find(w, peer, X_PHEAD, rank, np.int64(tag), E_SRC)
        else:
            st_i64(_ent(w, i, E_VISIBLE), vis)
            st_i64(w + 8 * H_HELD, ld_i64(w + 8 * H_HELD) + 1)
            st_i64(w + 8 * H_HOLDS, ld_i64(w + 8 * H_HOLDS) + 1)
        if r >= 0:
            _unlink(w, peer, X_PHEAD, X_PTAIL, prev, r)
            atomic_store_i64(_ent(w, i, E_STATE), np.int64(QUEUED))
            _match(w, i, r)
        else:
            atomic_store_i64(_ent(w, i, E_STATE), np.int64(QUEUED))
            _append(w, peer, X_UHEAD, X_UTAIL, i)
    else:
        st_i64(_ent(w, i, E_SRC), np.int64(peer))
        st_i64(_ent(w, i, E_DST), rank)
        prev, s = _find(w, rank, X_UHEAD, np.int64(peer), np.int64(tag), E_SRC)
        atomic_store_i64(_ent(w, i, E_STATE), np.int64(QUEUED))
        if s >= 0:
            _unlink(w, rank, X_UHEAD, X_UTAIL, prev, s)
            _match(w, s, i)
        else:
            _append(w, rank, X_PHEAD, X_PTAIL, i)
    _unlock(w)
    st_i64(req, _ent(w, i, 0))
    return np.int32(0)


_POST = types.int32(
    types.int64, types.int32, types.int64, types.int32, types.int32, types.int64, types.int64
)


@cfunc(_POST, cache=True)
def isend(buf, count, _dtype, dest, tag, comm, req):  # type: ignore[no-untyped-def]
    return _post(buf, np.int64(count), np.int64(dest), np.int64(tag), comm, req, SEND)


@cfunc(_POST, cache=True)
def irecv(buf, count, _dtype, source, tag, comm, req):  # type: ignore[no-untyped-def]
    return _post(buf, np.int64(count), np.int64(source), np.int64(tag), comm, req, RECV)


@njit(nogil=True, cache=True)
def _advance(w):  # type: ignore[no-untyped-def]
    """A test that found nothing done: while sends are held back, the call still counts (the
    clock moves and releases them); else nothing to do."""
    if atomic_load_i64(w + 8 * H_HELD) > 0:
        _lock(w)
        _tick(w)
        _unlock(w)


@cfunc(types.int32(types.int64, types.int64, types.int64), cache=True)
def test(req, flag, st):  # type: ignore[no-untyped-def]
    h = ld_i64(req)
    if h == NULL:
        _status(st, ANY_SOURCE, ANY_TAG, 0, 0, 0)
        st_i32(flag, np.int32(1))
        return np.int32(0)
    w = ld_i64(h + 8 * E_WORLD)
    if atomic_load_i64(h + 8 * E_STATE) != DONE:
        _advance(w)
        st_i32(flag, np.int32(0))
        return np.int32(0)
    _lock(w)
    _tick(w)
    err = _result(w, _index(w, h), st)
    _unlock(w)
    st_i64(req, np.int64(NULL))
    st_i32(flag, np.int32(1))
    return np.int32(err)


@cfunc(types.int32(types.int32, types.int64, types.int64, types.int64), cache=True)
def testall(count, reqs, flag, statuses):  # type: ignore[no-untyped-def]
    w = np.int64(0)
    for k in range(count):
        h = ld_i64(reqs + 8 * k)
        if h != NULL:
            w = ld_i64(h + 8 * E_WORLD)
            if atomic_load_i64(h + 8 * E_STATE) != DONE:
                _advance(w)
                st_i32(flag, np.int32(0))
                return np.int32(0)
    failed = False
    if w != 0:
        _lock(w)
        _tick(w)
    for k in range(count):
        st = statuses + S_BYTES * k if statuses != 0 else np.int64(0)
        h = ld_i64(reqs + 8 * k)
        if h == NULL:
            _status(st, ANY_SOURCE, ANY_TAG, 0, 0, 0)
            continue
        if _result(w, _index(w, h), st) != 0:
            failed = True
        st_i64(reqs + 8 * k, np.int64(NULL))
    if w != 0:
        _unlock(w)
    st_i32(flag, np.int32(1))
    return np.int32(ERR_IN_STATUS if failed else 0)


@cfunc(
    types.int32(types.int32, types.int64, types.int64, types.int64, types.int64),
    cache=True,
)
def testsome(count, reqs, outcount, indices, statuses):  # type: ignore[no-untyped-def]
    w = np.int64(0)
    done = False
    for k in range(count):
        h = ld_i64(reqs + 8 * k)
        if h != NULL:
            w = ld_i64(h + 8 * E_WORLD)
            if atomic_load_i64(h + 8 * E_STATE) == DONE:
                done = True
                break
    if w == 0:
        st_i32(outcount, np.int32(UNDEFINED))
        return np.int32(0)
    if not done:
        _advance(w)
        st_i32(outcount, np.int32(0))
        return np.int32(0)
    failed = False
    n = 0
    _lock(w)
    _tick(w)
    for k in range(count):
        h = ld_i64(reqs + 8 * k)
        if h == NULL or atomic_load_i64(h + 8 * E_STATE) != DONE:
            continue
        st = statuses + S_BYTES * n if statuses != 0 else np.int64(0)
        if _result(w, _index(w, h), st) != 0:
            failed = True
        st_i64(reqs + 8 * k, np.int64(NULL))
        st_i32(indices + 4 * n, np.int32(k))
        n += 1
    _unlock(w)
    st_i32(outcount, np.int32(n))
    return np.int32(ERR_IN_STATUS if failed else 0)


@njit(nogil=True, cache=True)
def _probe(source, tag, comm, flag, msg, st):  # type: ignore[no-untyped-def]
    """MPI_Iprobe (``msg`` 0) or MPI_Improbe (the message taken, its handle at ``msg``)."""
    w = ld_i64(comm + 8 * C_WORLD)
    rank = ld_i64(comm + 8 * C_RANK)
    if atomic_load_i64(_box(w, rank, X_UHEAD)) < 0:
        _advance(w)
        st_i32(flag, np.int32(0))
        return np.int32(0)
    _lock(w)
    _tick(w)
    prev, s = _find(w, rank, X_UHEAD, np.int64(source), np.int64(tag), E_SRC)
    if s < 0:
        _unlock(w)
        st_i32(flag, np.int32(0))
        return np.int32(0)
    _status(
        st,
        ld_i64(_ent(w, s, E_SRC)),
        ld_i64(_ent(w, s, E_TAG)),
        0,
        0,
        ld_i64(_ent(w, s, E_NBYTES)),
    )
    if msg != 0:
        _unlink(w, rank, X_UHEAD, X_UTAIL, prev, s)
        atomic_store_i64(_ent(w, s, E_STATE), np.int64(PROBED))
        st_i64(msg, _ent(w, s, 0))
    _unlock(w)
    st_i32(flag, np.int32(1))
    return np.int32(0)


@cfunc(
    types.int32(types.int32, types.int32, types.int64, types.int64, types.int64),
    cache=True,
)
def iprobe(source, tag, comm, flag, st):  # type: ignore[no-untyped-def]
    return _probe(source, tag, comm, flag, np.int64(0), st)


@cfunc(
    types.int32(types.int32, types.int32, types.int64, types.int64, types.int64, types.int64),
    cache=True,
)
def improbe(source, tag, comm, flag, msg, st):  # type: ignore[no-untyped-def]
    return _probe(source, tag, comm, flag, msg, st)


@cfunc(
    types.int32(types.int64, types.int32, types.int64, types.int64, types.int64),
    cache=True,
)
def mrecv(buf, count, _dtype, msg, st):  # type: ignore[no-untyped-def]
    h = ld_i64(msg)
    if h == NULL:
        return np.int32(ERR_OTHER)
    w = ld_i64(h + 8 * E_WORLD)
    s = _index(w, h)
    _lock(w)
    _tick(w)
    n = ld_i64(_ent(w, s, E_NBYTES))
    err = 0
    if n > count:
        err = ERR_TRUNCATE
        n = np.int64(count)
    _copy(buf, ld_i64(_ent(w, s, E_ADDR)), n)
    _status(st, ld_i64(_ent(w, s, E_SRC)), ld_i64(_ent(w, s, E_TAG)), err, 0, n)
    _settle(w, s)
    _unlock(w)
    st_i64(msg, np.int64(NULL))
    return np.int32(err)


@njit(nogil=True, cache=True)
def _take_entry(req):  # type: ignore[no-untyped-def]
    """(world, entry) of the request at ``req`` with the world locked (and the call counted),
    or (0, -1) for ``MPI_REQUEST_NULL``."""
    h = ld_i64(req)
    if h == NULL:
        return np.int64(0), np.int64(-1)
    w = ld_i64(h + 8 * E_WORLD)
    _lock(w)
    _tick(w)
    return w, _index(w, h)


@cfunc(types.int32(types.int64), cache=True)
def cancel(req):  # type: ignore[no-untyped-def]
    w, i = _take_entry(req)
    if w == 0:
        return np.int32(0)
    if ld_i64(_ent(w, i, E_STATE)) == QUEUED:
        owner = ld_i64(_ent(w, i, E_DST))  # a receive's owner, a send's destination
        recv = ld_i64(_ent(w, i, E_KIND)) == RECV
        head, tail = (X_PHEAD, X_PTAIL) if recv else (X_UHEAD, X_UTAIL)
        prev = np.int64(-1)
        j = ld_i64(_box(w, owner, head))
        while j >= 0 and j != i:
            prev = j
            j = ld_i64(_ent(w, j, E_NEXT))
        if j == i:
            _unlink(w, owner, head, tail, prev, i)
            if ld_i64(_ent(w, i, E_VISIBLE)) != 0:  # a send held back: no longer waited for
                st_i64(_ent(w, i, E_VISIBLE), np.int64(0))
                st_i64(w + 8 * H_HELD, ld_i64(w + 8 * H_HELD) - 1)
            st_i64(_ent(w, i, E_CANCELLED), np.int64(1))
            st_i64(_ent(w, i, E_COUNT), np.int64(0))
            st_i64(_ent(w, i, E_MSRC), np.int64(ANY_SOURCE))
            st_i64(_ent(w, i, E_MTAG), np.int64(ANY_TAG))
            _settle(w, i)
    _unlock(w)
    return np.int32(0)


@cfunc(types.int32(types.int64), cache=True)
def request_free(req):  # type: ignore[no-untyped-def]
    w, i = _take_entry(req)
    if w == 0:
        return np.int32(0)
    if ld_i64(_ent(w, i, E_STATE)) == DONE:
        _free(w, i)
    else:
        st_i64(_ent(w, i, E_FREED), np.int64(1))
    _unlock(w)
    st_i64(req, np.int64(NULL))
    return np.int32(0)


@cfunc(types.int32(types.int64, types.int64, types.int64), cache=True)
def get_count(st, _dtype, count):  # type: ignore[no-untyped-def]
    st_i32(count, np.int32(ld_i64(st + S_COUNT)))
    return np.int32(0)


@cfunc(types.int32(types.int64, types.int64), cache=True)
def test_cancelled(st, flag):  # type: ignore[no-untyped-def]
    st_i32(flag, ld_i32(st + S_CANCELLED))
    return np.int32(0)


# ---------------------------------------------------------------------------- the world


class NativeWorld:
    """The compiled message layer of one :class:`~.local.LocalWorld`: ``size`` ranks,
    ``capacity`` entries (pending sends and receives, all ranks together).

    ``jitter`` (0..1): the chance that a send is held back for one to four calls into the
    world before a receive can see it, which reorders messages across senders (never a
    sender's own to one rank), as the Python side's ``jitter`` does."""

    def __init__(
        self, size: int, capacity: int = DEFAULT_CAPACITY, *, jitter: float = 0.0, seed: int = 0
    ) -> None:
        self.size = size
        self.capacity = capacity
        boxes = H_LEN + capacity * E_N
        w = np.zeros(boxes + size * X_N + size * size, dtype=np.int64)
        w[H_SIZE] = size
        w[H_CAP] = capacity
        w[H_JITTER] = int(min(max(jitter, 0.0), 1.0) * (1 << 20))
        w[H_RNG] = (seed * 0x9E3779B1 + 0x2545F4914F6CDD1D) & 0x3FFFFFFFFFFFFFFF or 1
        nxt = np.arange(1, capacity + 1, dtype=np.int64)
        nxt[-1] = -1
        w[H_LEN + E_NEXT : H_LEN + capacity * E_N : E_N] = nxt
        w[H_FREE] = 0
        w[boxes : boxes + size * X_N] = -1  # every list empty
        self.words = w
        self._comms = [np.array([w.ctypes.data, r, size], dtype=np.int64) for r in range(size)]

    @property
    def in_use(self) -> int:
        """Entries in use now (pending sends and receives, requests not tested yet)."""
        return int(self.words[H_USED])

    @property
    def peak(self) -> int:
        return int(self.words[H_PEAK])

    @property
    def holds(self) -> int:
        """Sends the jitter has held back so far."""
        return int(self.words[H_HOLDS])

    def binding(self, rank: int) -> np.ndarray:
        """The record :mod:`.mpi_native`'s wrappers (and the lane) take, for ``rank``."""
        b = np.zeros(M.B_LEN, dtype=np.int64)
        for slot, fn in (
            (M.B_ISEND, isend),
            (M.B_IRECV, irecv),
            (M.B_TEST, test),
            (M.B_TESTALL, testall),
            (M.B_TESTSOME, testsome),
            (M.B_IPROBE, iprobe),
            (M.B_IMPROBE, improbe),
            (M.B_MRECV, mrecv),
            (M.B_CANCEL, cancel),
            (M.B_REQUEST_FREE, request_free),
            (M.B_GET_COUNT, get_count),
            (M.B_TEST_CANCELLED, test_cancelled),
        ):
            b[slot] = int(fn.address or 0)
        b[M.B_HANDLE_BYTES] = 8
        b[M.B_BYTE] = 1
        b[M.B_COMM] = self._comms[rank].ctypes.data
        b[M.B_REQUEST_NULL] = NULL
        b[M.B_MESSAGE_NULL] = NULL
        b[M.B_STATUS_BYTES] = S_BYTES
        b[M.B_STATUS_SOURCE] = S_SOURCE
        b[M.B_STATUS_TAG] = S_TAG
        b[M.B_STATUS_ERROR] = S_ERROR
        b[M.B_ANY_SOURCE] = ANY_SOURCE
        b[M.B_ANY_TAG] = ANY_TAG
        b[M.B_UNDEFINED] = UNDEFINED
        b[M.B_RANK] = rank
        b[M.B_SIZE] = self.size
        b[M.B_KIND] = M.KIND_LOCAL
        return b

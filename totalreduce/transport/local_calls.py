"""The local world's MPI calls: ``MPI_Isend``, ``MPI_Irecv``, the tests, the probes,
``MPI_Mrecv``, ``MPI_Cancel``, ``MPI_Request_free``, ``MPI_Get_count`` and
``MPI_Test_cancelled`` as C functions (Numba ``cfunc``) with MPI's signatures, whose
addresses :meth:`~.local_native.NativeWorld.binding` puts in the binding record.  What
they keep of MPI is in :mod:`.local_native`'s docstring; the world's tables, lock and
matching they are written with are :mod:`.local_tables`.

Numba checks a cached function against its own file only, and these compile in the
tables' functions and constants: a change to any of :data:`SOURCES` drops the cached
code of this module and of :mod:`.local_tables` when this module is next imported.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import numpy as np
from numba import cfunc, njit, types
from numba.core.caching import FunctionCache
from numba.core.registry import CPUDispatcher

from ..native import digest
from ..native.intrinsics import atomic_load_i64, atomic_store_i64, ld_i32, ld_i64, st_i32, st_i64
from . import local_tables
from .local_tables import (
    ANY_SOURCE,
    ANY_TAG,
    CM_RANK,
    CM_SIZE,
    CM_WORLD,
    DONE,
    E_ADDR,
    E_CANCELLED,
    E_COUNT,
    E_DST,
    E_FREED,
    E_KIND,
    E_MSRC,
    E_MTAG,
    E_NBYTES,
    E_NEXT,
    E_SRC,
    E_STATE,
    E_TAG,
    E_VISIBLE,
    E_WORLD,
    ERR_COUNT,
    ERR_IN_STATUS,
    ERR_NO_MEM,
    ERR_OTHER,
    ERR_RANK,
    ERR_TAG,
    ERR_TRUNCATE,
    H_HELD,
    H_HOLDS,
    NULL,
    PROBED,
    QUEUED,
    RECV,
    S_BYTES,
    S_CANCELLED,
    S_COUNT,
    SEND,
    UNDEFINED,
    X_PHEAD,
    X_PTAIL,
    X_UHEAD,
    X_UTAIL,
    _alloc,
    _append,
    _box,
    _copy,
    _ent,
    _find,
    _free,
    _hold,
    _index,
    _lock,
    _match,
    _result,
    _settle,
    _status,
    _tick,
    _unlink,
    _unlock,
)

# ---------------------------------------------------------------------------- the cache

#: What this module's machine code is made of (paths under the package): its own, the
#: tables' functions and constants it compiles in, and the intrinsics and libc calls.
SOURCES = (
    "transport/local_calls.py",
    "transport/local_tables.py",
    "native/intrinsics.py",
    "native/libc.py",
)


def sources_digest() -> str:
    """A digest of :data:`SOURCES` as they are now."""
    return digest.sources_digest(SOURCES)


_F = TypeVar("_F", bound=Callable[..., object])

#: The digest of the sources the cached code was made from, kept beside that cache.
_STAMP = Path(FunctionCache(sources_digest).cache_path) / "local_calls.sources"
_DIGEST = sources_digest()
try:
    _STALE = _STAMP.read_text() != _DIGEST
except OSError:
    _STALE = True


def _forget_tables() -> None:
    """Drop the cached code of :mod:`.local_tables`' functions (none is compiled yet: only
    the functions below call them)."""
    for obj in vars(local_tables).values():
        cached = getattr(obj, "_cache", None) if isinstance(obj, CPUDispatcher) else None
        if cached is not None:
            cached.flush()


if _STALE:
    _forget_tables()


def _fresh(fn: _F) -> _F:
    """``fn``, its cached code dropped first if any of :data:`SOURCES` changed since the
    cache was written (under ``cfunc``/``njit``, which compile or load it)."""
    if _STALE:
        FunctionCache(fn).flush()
    return fn


# ---------------------------------------------------------------------------- MPI's calls


@njit(nogil=True, cache=True)
@_fresh
def _post(buf, count, peer, tag, comm, req, kind):  # type: ignore[no-untyped-def]
    w = ld_i64(comm + 8 * CM_WORLD)
    rank = ld_i64(comm + 8 * CM_RANK)
    size = ld_i64(comm + 8 * CM_SIZE)
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
@_fresh
def isend(buf, count, _dtype, dest, tag, comm, req):  # type: ignore[no-untyped-def]
    return _post(buf, np.int64(count), np.int64(dest), np.int64(tag), comm, req, SEND)


@cfunc(_POST, cache=True)
@_fresh
def irecv(buf, count, _dtype, source, tag, comm, req):  # type: ignore[no-untyped-def]
    return _post(buf, np.int64(count), np.int64(source), np.int64(tag), comm, req, RECV)


@njit(nogil=True, cache=True)
@_fresh
def _advance(w):  # type: ignore[no-untyped-def]
    """A test that found nothing done: while sends are held back, the call still counts (the
    clock moves and releases them); else nothing to do."""
    if atomic_load_i64(w + 8 * H_HELD) > 0:
        _lock(w)
        _tick(w)
        _unlock(w)


@cfunc(types.int32(types.int64, types.int64, types.int64), cache=True)
@_fresh
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
@_fresh
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
@_fresh
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
@_fresh
def _probe(source, tag, comm, flag, msg, st):  # type: ignore[no-untyped-def]
    """MPI_Iprobe (``msg`` 0) or MPI_Improbe (the message taken, its handle at ``msg``)."""
    w = ld_i64(comm + 8 * CM_WORLD)
    rank = ld_i64(comm + 8 * CM_RANK)
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
@_fresh
def iprobe(source, tag, comm, flag, st):  # type: ignore[no-untyped-def]
    return _probe(source, tag, comm, flag, np.int64(0), st)


@cfunc(
    types.int32(types.int32, types.int32, types.int64, types.int64, types.int64, types.int64),
    cache=True,
)
@_fresh
def improbe(source, tag, comm, flag, msg, st):  # type: ignore[no-untyped-def]
    return _probe(source, tag, comm, flag, msg, st)


@cfunc(
    types.int32(types.int64, types.int32, types.int64, types.int64, types.int64),
    cache=True,
)
@_fresh
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
@_fresh
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
@_fresh
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
@_fresh
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
@_fresh
def get_count(st, _dtype, count):  # type: ignore[no-untyped-def]
    st_i32(count, np.int32(ld_i64(st + S_COUNT)))
    return np.int32(0)


@cfunc(types.int32(types.int64, types.int64), cache=True)
@_fresh
def test_cancelled(st, flag):  # type: ignore[no-untyped-def]
    st_i32(flag, ld_i32(st + S_CANCELLED))
    return np.int32(0)


if _STALE:  # every function above is compiled now: the cache is the sources' again
    try:
        _STAMP.parent.mkdir(parents=True, exist_ok=True)
        _STAMP.write_text(_DIGEST)
    except OSError:  # an unwritable cache: Numba compiles in memory each time anyway
        pass

"""The floor of any compiled engine: the bare ring as one Numba function that calls MPI itself.

The same ring as :mod:`.bare` (``2(P-1)`` hops: a reduce-scatter, then an all-gather,
chunked as ``balanced_parts``), but the whole of it is one ``@njit(nogil=True,
cache=True)`` function: per hop it posts ``MPI_Irecv`` and ``MPI_Isend`` through
:mod:`totalreduce.transport.mpi_native`, polls ``MPI_Testall`` and sums the received
chunk inline.  No interpreter runs between the calls, so what is left is what MPI's
point-to-point costs plus one loop: the least an engine built this way can take, which
the latency benchmark sets beside MPI's ``Allreduce`` and the bare mpi4py loop.
float32 sums only: the floor is a yardstick, not a collective.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from numba import carray, njit

from ..errors import TransportError
from ..native.intrinsics import ptr_f32
from ..native.libc import memcpy, yield_cpu
from ..transport.mpi_native import (
    B_HANDLE_BYTES,
    B_RANK,
    B_SIZE,
    STATUS_MAX,
    binding,
    error_text,
    mpi_irecv,
    mpi_isend,
    mpi_testall,
)

#: The workspace: two request handles (at most 8 bytes each), then two statuses.
_WS_STATUSES = 16
_WS_WORDS = (_WS_STATUSES + 2 * STATUS_MAX) // 8
#: MPICH's default (``MPIR_CVAR_POLLS_BEFORE_YIELD``).
_POLLS_BEFORE_YIELD = 1000


@njit(nogil=True, cache=True)
def _exchange(b, ws_addr, send_addr, send_bytes, recv_addr, recv_bytes, right, left, tag):  # type: ignore[no-untyped-def]
    """Receive from ``left`` and send to ``right`` on ``tag``; spin until both complete.

    After ``_POLLS_BEFORE_YIELD`` polls it yields the core between polls, as MPICH's
    blocking calls do: on a machine with more runnable processes than cores, the peer
    being waited for may need this core to make progress."""
    reqs = ws_addr
    rc = mpi_irecv(b, recv_addr, recv_bytes, left, tag, reqs)
    if rc < 0:
        return rc
    rc = mpi_isend(b, send_addr, send_bytes, right, tag, reqs + b[B_HANDLE_BYTES])
    if rc < 0:
        return rc
    polls = 0
    while True:
        rc = mpi_testall(b, 2, reqs, ws_addr + _WS_STATUSES)
        if rc != 0:
            return rc if rc < 0 else 0
        polls += 1
        if polls > _POLLS_BEFORE_YIELD:
            yield_cpu()


@njit(nogil=True, cache=True)
def floor_ring_allreduce(b, ws, x_addr, out_addr, scratch_addr, count):  # type: ignore[no-untyped-def]
    """Ring-allreduce (sum) ``count`` float32 at ``x_addr`` into ``out_addr`` (may equal
    ``x_addr``) over the record ``b``'s communicator; ``scratch_addr`` holds one chunk
    (``ceil(count / P)`` floats); ``ws`` is :func:`floor_workspace`.  0, or -code of the
    MPI call that failed (requests it had posted are then left to the communicator)."""
    rank = b[B_RANK]
    p = b[B_SIZE]
    if out_addr != x_addr:
        memcpy(out_addr, x_addr, count * 4)
    if p == 1:
        return np.int64(0)
    ws_addr = ws.ctypes.data
    right = (rank + 1) % p
    left = (rank - 1 + p) % p
    base = count // p
    extra = count % p
    for k in range(p - 1):
        mine = (rank - k + p) % p
        theirs = (rank - k - 1 + 2 * p) % p
        m_off = mine * base + min(mine, extra)
        m_n = base + (1 if mine < extra else 0)
        t_off = theirs * base + min(theirs, extra)
        t_n = base + (1 if theirs < extra else 0)
        rc = _exchange(
            b, ws_addr, out_addr + 4 * m_off, 4 * m_n, scratch_addr, 4 * t_n, right, left, k
        )
        if rc < 0:
            return rc
        dst = carray(ptr_f32(out_addr + 4 * t_off), t_n)
        src = carray(ptr_f32(scratch_addr), t_n)
        for i in range(t_n):
            dst[i] += src[i]
    for k in range(p - 1):
        got = (rank - k + p) % p
        give = (rank + 1 - k + p) % p
        g_off = got * base + min(got, extra)
        g_n = base + (1 if got < extra else 0)
        s_off = give * base + min(give, extra)
        s_n = base + (1 if give < extra else 0)
        rc = _exchange(
            b,
            ws_addr,
            out_addr + 4 * s_off,
            4 * s_n,
            out_addr + 4 * g_off,
            4 * g_n,
            right,
            left,
            p + k,
        )
        if rc < 0:
            return rc
    return np.int64(0)


def floor_workspace() -> np.ndarray:
    """Room for the floor's two requests and two statuses."""
    return np.zeros(_WS_WORDS, dtype=np.int64)


def floor_ring(
    comm: Any, x: np.ndarray, out: np.ndarray, scratch: np.ndarray
) -> Callable[[], None]:
    """A call that ring-allreduces (sums) ``x`` into ``out`` over ``comm`` with the floor.

    ``x``, ``out`` (may be ``x``) and ``scratch`` (at least ``ceil(x.size / P)``
    elements) are contiguous float32 arrays that must outlive the call; the addresses are
    taken once, here.  ``comm`` should be a communicator of its own (the floor's tags
    start at 0).  The call raises :class:`~totalreduce.TransportError` if MPI fails.
    """
    p = comm.Get_size()
    for name, arr in (("x", x), ("out", out), ("scratch", scratch)):
        if arr.dtype != np.float32 or not arr.flags.c_contiguous:
            raise TransportError(f"floor ring: {name} must be contiguous float32")
    if out.size != x.size or scratch.size < -(-x.size // p):
        raise TransportError(
            f"floor ring: out holds {out.size}, x {x.size}, scratch {scratch.size} "
            f"(at least {-(-x.size // p)}) float32"
        )
    b = binding(comm)
    ws = floor_workspace()
    n = np.int64(x.size)
    xa, oa, sa = (np.int64(a.ctypes.data) for a in (x, out, scratch))

    def run() -> None:
        rc = floor_ring_allreduce(b, ws, xa, oa, sa, n)
        if rc < 0:
            raise TransportError(
                f"floor ring of {int(n)} float32 on rank {comm.Get_rank()}: {error_text(-rc)}"
            )

    run.keep = (x, out, scratch, ws, b)  # type: ignore[attr-defined]
    return run

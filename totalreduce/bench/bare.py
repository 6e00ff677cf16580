"""The floor of any Python engine: a bare ring allreduce written straight on mpi4py.

The same ring as ``algorithms/ring.py`` (``2(P-1)`` hops: a reduce-scatter,
then an all-gather), with nothing around it: per hop one ``Isend`` and one
``Irecv``, ``Test``-polled until both complete, then numpy reduces the
received chunk into place.  No frames, no names, no threads: what is left is
the cost of a Python loop driving MPI requests, which the latency benchmark
sets beside the engine's.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..algorithms.schedule import balanced_parts

_UFUNCS = {"sum": np.add, "avg": np.add, "max": np.maximum, "min": np.minimum}


def _poll(*requests: Any) -> None:
    # Busy-polls on purpose: it is the fastest a Python loop can notice completion.
    for req in requests:
        while not req.Test():
            pass


def bare_ring_allreduce(
    comm: Any, x: np.ndarray, out: np.ndarray, scratch: np.ndarray, op: str = "sum"
) -> np.ndarray:
    """Ring allreduce of ``x`` into ``out`` over ``comm`` (``out`` may be ``x``).

    ``scratch`` holds at least one chunk (``ceil(x.size / P)`` elements).  ``op``
    is ``sum``, ``avg`` (floor division on integers), ``max`` or ``min``.
    """
    p, rank = comm.Get_size(), comm.Get_rank()
    if out is not x:
        out[...] = x
    if p == 1:
        return out
    reduce = _UFUNCS[op]
    chunks = balanced_parts(x.size, p)
    right, left = (rank + 1) % p, (rank - 1) % p

    def chunk(c: int) -> np.ndarray:
        off, n = chunks[c % p]
        return out[off : off + n]

    for k in range(p - 1):
        mine, theirs = chunk(rank - k), chunk(rank - k - 1)
        got = scratch[: theirs.size]
        rreq = comm.Irecv(got, source=left, tag=k)
        sreq = comm.Isend(mine, dest=right, tag=k)
        _poll(rreq, sreq)
        reduce(theirs, got, out=theirs)
    for k in range(p - 1):
        rreq = comm.Irecv(chunk(rank - k), source=left, tag=p + k)
        sreq = comm.Isend(chunk(rank + 1 - k), dest=right, tag=p + k)
        _poll(rreq, sreq)
    if op == "avg":
        if np.issubdtype(out.dtype, np.integer):
            out //= p
        else:
            out /= p
    return out

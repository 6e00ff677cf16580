"""Ring chunked allreduce: the ring with ``2P`` chunks, two in flight per round.

The buffer of ``S`` bytes is cut into ``2P`` balanced chunks (the first
``count % 2P`` one element longer), taken in pairs: pair ``c`` is chunks
``2c`` and ``2c + 1``.  Rank ``r`` sends to ``r + 1`` and receives from
``r - 1``.  Each ring round moves one pair, as two steps, one per chunk:

1. Reduce-scatter, rounds ``k = 0 .. P-2``: step ``2k`` sends chunk
   ``2(r - k)`` and receives chunk ``2(r - k - 1)``, reducing it into the local
   copy; step ``2k + 1`` does the same for the odd chunks ``2(r - k) + 1`` and
   ``2(r - k - 1) + 1``.  Afterwards rank ``r`` holds the reduced pair
   ``r + 1``.
2. All-gather, rounds ``k = 0 .. P-2`` (steps numbered from ``2(P-1)``): step
   ``2(P-1) + 2k (+1)`` sends the even (odd) chunk of pair ``r + 1 - k`` and
   receives the even (odd) chunk of pair ``r - k``, copying it.

Why two steps per round: the waits are derived from regions, so the odd
chunk's step never waits for the even chunk's reduction.  While the even
chunk of a pair is being reduced, the odd chunk is on the wire, and the
reduced even chunk is forwarded while the odd one is reduced: the double
buffering of the chunked ring, expressed without any extra buffer.

Cost (alpha-beta-gamma): ``4(P-1)`` steps, so ``4(P-1)·alpha`` latency if no
two overlap (Gloo counts ``4P``); ``2(P-1)/P · S`` bytes sent per rank
(``beta`` term), the same as the plain ring; ``(P-1)/P · S`` bytes reduced per
rank (``gamma`` term), overlapped with the transfers.

A non-in-place call first copies the input into the output (prologue); an
``avg`` divides by ``P`` at the end (epilogue).
"""

from __future__ import annotations

from .ring import allreduce_epilogue, allreduce_prologue
from .schedule import (
    Action,
    Buffer,
    Recv,
    Region,
    Schedule,
    Send,
    Step,
    balanced_parts,
)


def allreduce_ring_chunked(rank: int, size: int, count: int, *, average: bool = False) -> Schedule:
    """Ring chunked allreduce schedule for ``rank`` of ``size`` over ``count`` elements.

    >>> s = allreduce_ring_chunked(0, 4, 1000)
    >>> len(s.steps), s.bytes_sent(8) == 8 * 2 * 3 * 1000 // 4
    (12, True)
    """
    chunks = balanced_parts(count, 2 * size)
    right, left = (rank + 1) % size, (rank - 1) % size

    def chunk(pair: int, half: int) -> Region:
        off, n = chunks[2 * (pair % size) + half]
        return Region(Buffer.OUTPUT, off, n)

    steps = []
    if size > 1:
        for k in range(size - 1):
            for half in (0, 1):
                steps.append(
                    Step(
                        sends=(Send(right, chunk(rank - k, half)),),
                        recvs=(Recv(left, chunk(rank - k - 1, half), Action.REDUCE),),
                    )
                )
        for k in range(size - 1):
            for half in (0, 1):
                steps.append(
                    Step(
                        sends=(Send(right, chunk(rank + 1 - k, half)),),
                        recvs=(Recv(left, chunk(rank - k, half), Action.COPY),),
                    )
                )
    return Schedule(
        rank=rank,
        size=size,
        count=count,
        out_count=count,
        steps=tuple(steps),
        prologue=allreduce_prologue(count),
        epilogue=allreduce_epilogue(count, size, average),
    )

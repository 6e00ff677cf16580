"""Ring reduce-scatter and its adjoint, the ring all-gather (with per-rank counts).

Reduce-scatter (:func:`reduce_scatter_ring`): every rank gives ``count``
elements; rank ``r`` gets part ``r`` of their sum, where the parts are
``balanced_parts(count, P)`` (the first ``count % P`` ranks one element
more, as DistDL and ``numpy.array_split`` cut).  The prologue copies the input
into ``WORK`` (``count`` elements), the ring reduces there, and the epilogue
copies part ``r`` into ``OUTPUT`` (and divides by ``P`` for an average).
Rank ``r`` sends to ``r + 1`` and receives from ``r - 1``:

1. Steps ``k = 0 .. P-2``: send part ``r - k - 1``, receive part ``r - k - 2``
   and reduce it into ``WORK``.  The part a rank receives is the one it sends
   next, and the last one received, at ``k = P - 2``, is part ``r``, complete.

Cost: ``P - 1`` steps, ``(P-1) · alpha``; ``(P-1)/P · S`` bytes sent per rank
(``beta``) and as many reduced (``gamma``), ``S`` being the input size.

All-gather (:func:`allgather_ring`), all-gather-v: rank ``r`` gives
``counts[r]`` elements; every rank gets their concatenation in rank order.
The prologue copies the rank's own part into place in ``OUTPUT``:

1. Steps ``k = 0 .. P-2``: send part ``r - k``, receive part ``r - k - 1`` and
   copy it.

Cost: ``P - 1`` steps; rank ``r`` sends every part but ``r + 1``'s, i.e.
``T - counts[r + 1]`` elements for a total of ``T``, about ``(P-1)/P · T``
when the parts are balanced.

With ``counts = [n for _, n in balanced_parts(count, P)]`` the two are
adjoint: for stacked inputs ``x`` (``P · count`` values) and ``y`` (``count``
values), ``<RS(x), y> = <x, AG(y)>``, the relation DistDL's layers rely on.
"""

from __future__ import annotations

from collections.abc import Sequence

from .schedule import (
    Action,
    Buffer,
    LocalKind,
    LocalOp,
    Recv,
    Region,
    Schedule,
    Send,
    Step,
    balanced_parts,
)


def reduce_scatter_ring(
    rank: int,
    size: int,
    count: int,
    *,
    average: bool = False,
    counts: Sequence[int] | None = None,
) -> Schedule:
    """Ring reduce-scatter: ``count`` elements in, ``balanced_parts(count, size)[rank]`` out.

    ``counts`` (one per rank, summing to ``count``) cuts the parts explicitly,
    e.g. whole rows of a tensor split along one dimension.

    >>> s = reduce_scatter_ring(1, 3, 10)
    >>> s.out_count, len(s.steps)
    (3, 2)
    """
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} outside 0..{size - 1}")
    if counts is None:
        parts = balanced_parts(count, size)
    else:
        if len(counts) != size or sum(counts) != count or any(n < 0 for n in counts):
            raise ValueError(
                f"reduce-scatter counts {list(counts)} must be {size} values >= 0 "
                f"summing to {count}"
            )
        parts = [(sum(counts[:p]), counts[p]) for p in range(size)]
    right, left = (rank + 1) % size, (rank - 1) % size

    def part(p: int) -> Region:
        off, n = parts[p % size]
        return Region(Buffer.WORK, off, n)

    def source(p: int) -> Region:
        off, n = parts[p % size]
        return Region(Buffer.INPUT, off, n)

    mine = parts[rank][1]
    out = Region(Buffer.OUTPUT, 0, mine)
    steps = []
    # Step 0 sends straight from the input; each part's one reduce takes its local operand
    # from the input, and the last one (this rank's part) lands in the output: no copy of
    # the input first and none of the result after.  Only the parts passed on between
    # (P > 2) go through WORK.
    for k in range(size - 1):
        last = k == size - 2
        steps.append(
            Step(
                sends=(Send(right, source(rank - 1) if k == 0 else part(rank - k - 1)),),
                recvs=(
                    Recv(
                        left,
                        out if last else part(rank - k - 2),
                        Action.REDUCE,
                        src=source(rank - k - 2),
                    ),
                ),
            )
        )
    epilogue: list[LocalOp] = []
    if size == 1:
        epilogue.append(LocalOp(LocalKind.COPY, out, source(rank)))
    elif average:
        epilogue.append(LocalOp(LocalKind.AVERAGE, out, divisor=size))
    return Schedule(
        rank=rank,
        size=size,
        count=count,
        out_count=mine,
        steps=tuple(steps),
        epilogue=tuple(epilogue),
        work_count=count if size > 2 else 0,
    )


def allgather_ring(rank: int, size: int, counts: Sequence[int]) -> Schedule:
    """Ring all-gather-v: ``counts[rank]`` elements in, ``sum(counts)`` out, in rank order.

    >>> s = allgather_ring(0, 3, [2, 0, 5])
    >>> s.count, s.out_count, s.bytes_sent(1)
    (2, 7, 7)
    """
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} outside 0..{size - 1}")
    if len(counts) != size:
        raise ValueError(f"allgather needs one count per rank: {size} ranks, {len(counts)} counts")
    if any(n < 0 for n in counts):
        raise ValueError(f"allgather counts must be >= 0, got {list(counts)}")
    offsets = [sum(counts[:p]) for p in range(size)]
    right, left = (rank + 1) % size, (rank - 1) % size

    def part(p: int) -> Region:
        return Region(Buffer.OUTPUT, offsets[p % size], counts[p % size])

    steps = []
    if size > 1:
        for k in range(size - 1):
            steps.append(
                Step(
                    sends=(Send(right, part(rank - k)),),
                    recvs=(Recv(left, part(rank - k - 1), Action.COPY),),
                )
            )
    own = counts[rank]
    return Schedule(
        rank=rank,
        size=size,
        count=own,
        out_count=sum(counts),
        steps=tuple(steps),
        prologue=(LocalOp(LocalKind.COPY, part(rank), Region(Buffer.INPUT, 0, own)),),
    )

"""Ring allreduce: a ring reduce-scatter followed by a ring all-gather.

The buffer of ``S`` bytes is cut into ``P`` balanced chunks (the first
``count % P`` chunks one element longer).  Rank ``r`` sends to ``r + 1`` and
receives from ``r - 1``:

1. Reduce-scatter, steps ``k = 0 .. P-2``: send chunk ``r - k``, receive chunk
   ``r - k - 1`` and reduce it into the local copy.  Afterwards rank ``r``
   holds the fully reduced chunk ``r + 1``.
2. All-gather, steps ``k = 0 .. P-2`` (numbered ``P-1 ..``): send chunk
   ``r + 1 - k``, receive chunk ``r - k`` and copy it.

Cost (alpha-beta-gamma): ``2(P-1)`` steps, so ``2(P-1)·alpha`` latency;
``2(P-1)/P · S`` bytes sent per rank (``beta`` term); ``(P-1)/P · S`` bytes
reduced per rank (``gamma`` term).  Segments of consecutive steps pipeline:
segment *k* of a chunk is forwarded as soon as it is reduced.

Nothing is copied up front: the first step sends from the input, and each
reduce-scatter receive writes ``input chunk (op) received`` into the output,
so the first frame leaves at once even for a large buffer.  Every chunk of
the output is written exactly once by the reduce-scatter or the all-gather.
An ``avg`` divides by ``P`` at the end (epilogue).
"""

from __future__ import annotations

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


def allreduce_prologue(count: int) -> tuple[LocalOp, ...]:
    """Copy the input into the output, where the reduction happens."""
    whole_in = Region(Buffer.INPUT, 0, count)
    return (LocalOp(LocalKind.COPY, Region(Buffer.OUTPUT, 0, count), whole_in),)


def allreduce_epilogue(count: int, size: int, average: bool) -> tuple[LocalOp, ...]:
    """Divide by the number of contributions for an average."""
    if not average or size == 1:
        return ()
    return (LocalOp(LocalKind.AVERAGE, Region(Buffer.OUTPUT, 0, count), divisor=size),)


def allreduce_ring(rank: int, size: int, count: int, *, average: bool = False) -> Schedule:
    """Ring allreduce schedule for ``rank`` of ``size`` over ``count`` elements."""
    chunks = balanced_parts(count, size)
    right, left = (rank + 1) % size, (rank - 1) % size

    def chunk(c: int) -> Region:
        off, n = chunks[c % size]
        return Region(Buffer.OUTPUT, off, n)

    def source(c: int) -> Region:
        off, n = chunks[c % size]
        return Region(Buffer.INPUT, off, n)

    steps = []
    if size > 1:
        for k in range(size - 1):
            # Step 0 sends straight from the input, and each chunk's one reduce
            # takes its local operand from the input: no prologue copy.
            steps.append(
                Step(
                    sends=(Send(right, source(rank) if k == 0 else chunk(rank - k)),),
                    recvs=(
                        Recv(left, chunk(rank - k - 1), Action.REDUCE, src=source(rank - k - 1)),
                    ),
                )
            )
        for k in range(size - 1):
            steps.append(
                Step(
                    sends=(Send(right, chunk(rank + 1 - k)),),
                    recvs=(Recv(left, chunk(rank - k), Action.COPY),),
                )
            )
    return Schedule(
        rank=rank,
        size=size,
        count=count,
        out_count=count,
        steps=tuple(steps),
        prologue=allreduce_prologue(count) if size == 1 else (),
        epilogue=allreduce_epilogue(count, size, average),
    )

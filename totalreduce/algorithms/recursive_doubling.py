"""Recursive doubling allreduce: lg P exchanges of the whole vector.

Power-of-two ``P = 2^L``.  Steps ``k = 0 .. L-1``: rank ``r`` sends its whole
partial sum to ``r XOR 2^k``, receives the partner's and reduces it in.  After
step ``k`` every rank holds the sum over its aligned group of ``2^(k+1)``
ranks; after step ``L - 1``, the sum over all of them.  Step 0 sends straight
from the input and its receive writes ``input (op) received`` into the output,
so nothing is copied up front.

Other ``P`` (Thakur, Rabenseifner and Gropp, 2005): let ``P' = 2^floor(lg P)``
and ``rem = P - P'``.

1. Fold in, step 0: among the first ``2 rem`` ranks, each even rank sends its
   input to the odd rank above it, which reduces it in; the even ranks then sit
   out.  The other ``P - 2 rem`` ranks do nothing in this step.
2. Recursive doubling, steps ``1 .. lg P'``, among the ``P'`` ranks left, renumbered
   ``r // 2`` (odd ranks below ``2 rem``) and ``r - rem`` (the rest).
3. Fold out, the last step: each odd rank below ``2 rem`` sends the result to
   the even rank below it.

Each step both sends and reduces into the whole output, so a receive is
applied only once the same step's send of that region has left (the
write-after-read wait :func:`~totalreduce.algorithms.schedule.plan_segments`
derives); until then the received frame waits in a scratch buffer of the
engine, and the two directions of an exchange still overlap on the wire.

Cost (alpha-beta-gamma), ``S`` bytes.  Power of two: ``lg P`` steps, so
``lg P · alpha``; ``lg P · S`` bytes sent per rank (``beta``); ``lg P · S``
bytes reduced per rank (``gamma``).  Other ``P``: ``lg P' + 2`` steps, so
``(lg P' + 2) · alpha``; at most ``(lg P' + 1) · S`` bytes sent and
``(lg P' + 1) · S`` reduced by a rank.  Against the ring's ``2(P-1)`` steps
and ``2(P-1)/P · S`` bytes, it wins while latency dominates (small buffers)
and loses once bandwidth does.

An ``avg`` divides by ``P`` at the end (epilogue).
"""

from __future__ import annotations

from .ring import allreduce_epilogue, allreduce_prologue
from .schedule import Action, Buffer, Recv, Region, Schedule, Send, Step


def allreduce_recursive_doubling(
    rank: int, size: int, count: int, *, average: bool = False
) -> Schedule:
    """Recursive doubling allreduce schedule for ``rank`` of ``size`` over ``count`` elements.

    >>> len(allreduce_recursive_doubling(0, 8, 100).steps)
    3
    >>> len(allreduce_recursive_doubling(0, 6, 100).steps)  # fold in, 2 exchanges, fold out
    4
    """
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} outside 0..{size - 1}")
    pof2 = 1 << (size.bit_length() - 1)
    rem = size - pof2
    levels = pof2.bit_length() - 1
    whole_in = Region(Buffer.INPUT, 0, count)
    whole_out = Region(Buffer.OUTPUT, 0, count)

    def real(new: int) -> int:
        return 2 * new + 1 if new < rem else new + rem

    steps: list[Step] = []
    folded = rem > 0
    if folded:
        if rank < 2 * rem and rank % 2 == 0:
            fold_in = Step(sends=(Send(rank + 1, whole_in),))
        elif rank < 2 * rem:
            fold_in = Step(recvs=(Recv(rank - 1, whole_out, Action.REDUCE, src=whole_in),))
        else:
            fold_in = Step()
        steps.append(fold_in)

    if rank < 2 * rem and rank % 2 == 0:
        steps.extend(Step() for _ in range(levels))
    else:
        new = rank // 2 if rank < 2 * rem else rank - rem
        # The output holds a partial sum already if this rank reduced at fold-in.
        started = rank < 2 * rem
        for k in range(levels):
            peer = real(new ^ (1 << k))
            if started:
                steps.append(
                    Step(
                        sends=(Send(peer, whole_out),),
                        recvs=(Recv(peer, whole_out, Action.REDUCE),),
                    )
                )
            else:
                steps.append(
                    Step(
                        sends=(Send(peer, whole_in),),
                        recvs=(Recv(peer, whole_out, Action.REDUCE, src=whole_in),),
                    )
                )
                started = True

    if folded:
        if rank < 2 * rem and rank % 2 == 0:
            steps.append(Step(recvs=(Recv(rank + 1, whole_out, Action.COPY),)))
        elif rank < 2 * rem:
            steps.append(Step(sends=(Send(rank - 1, whole_out),)))
        else:
            steps.append(Step())

    return Schedule(
        rank=rank,
        size=size,
        count=count,
        out_count=count,
        steps=tuple(steps),
        prologue=allreduce_prologue(count) if size == 1 else (),
        epilogue=allreduce_epilogue(count, size, average),
    )

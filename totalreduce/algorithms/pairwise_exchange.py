"""Pairwise exchange: Gloo's benchmark pattern, the pairs of halving-doubling, equal loads.

For ``P`` a power of two and ``C`` steps, ``1 <= C <= lg P``, the buffer of
``S`` bytes is cut into ``C`` balanced parts:

1. Step ``k = 0 .. C-1``: rank ``r`` pairs with ``r XOR 2^k`` (the pairs of
   halving-doubling's reduce-scatter step ``k``), sends part ``k`` of its input
   and copies the partner's part ``k`` into part ``k`` of ``WORK``.

Unlike the reduce-scatter the load does not halve: every step moves ``S / C``
and nothing is combined, so received data never mixes with the input.  The
epilogue copies ``WORK`` to ``OUTPUT``, so part ``k`` of the result is part
``k`` of the input of rank ``r XOR 2^k``: that makes a run checkable.

Cost: ``C`` steps, ``C · alpha``; ``S`` bytes sent per rank (``beta``); no
reduction.  It measures how the network takes pairs at distances ``1, 2, 4,
...``, which is what halving-doubling's steps see.
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


def pairwise_exchange(rank: int, size: int, count: int, *, steps: int) -> Schedule:
    """Pairwise exchange for ``rank`` of ``size``: ``steps`` swaps of ``count / steps`` each.

    >>> s = pairwise_exchange(0, 8, 900, steps=3)
    >>> [st.sends[0].peer for st in s.steps], s.bytes_sent(1)
    ([1, 2, 4], 900)
    """
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} outside 0..{size - 1}")
    if size < 2 or size & (size - 1):
        raise ValueError(f"pairwise exchange needs a power-of-two number of ranks >= 2, got {size}")
    lg = size.bit_length() - 1
    if not 1 <= steps <= lg:
        raise ValueError(f"pairwise exchange on {size} ranks takes 1..{lg} steps, got {steps}")
    plan = []
    for k, (off, n) in enumerate(balanced_parts(count, steps)):
        peer = rank ^ (1 << k)
        plan.append(
            Step(
                sends=(Send(peer, Region(Buffer.INPUT, off, n)),),
                recvs=(Recv(peer, Region(Buffer.WORK, off, n), Action.COPY),),
            )
        )
    # OUTPUT is written only after every send is done, so an in-place call
    # needs no private copy of the input.
    result = LocalOp(LocalKind.COPY, Region(Buffer.OUTPUT, 0, count), Region(Buffer.WORK, 0, count))
    return Schedule(
        rank=rank,
        size=size,
        count=count,
        out_count=count,
        steps=tuple(plan),
        epilogue=(result,),
        work_count=count,
    )

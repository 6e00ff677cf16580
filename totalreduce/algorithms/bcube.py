"""BCube allreduce: group reduce-scatters along one rank digit per step.

Ranks are written as digits in a mixed radix ``P = n_0 · n_1 · ... ·
n_{D-1}``, digit 0 varying fastest, so ``rank = d_0 + n_0 (d_1 + n_1 (d_2 +
...))``.  With ``P`` a power of ``base`` every ``n_k`` is ``base``: the ranks
form groups of ``base`` consecutive ranks at step 0, groups of ranks
``base`` apart at step 1, and so on.  The buffer of ``S`` bytes is cut into
``P`` balanced fine blocks; every region below is a run of whole fine blocks.

1. Reduce-scatter, steps ``k = 0 .. D-1``: rank ``r`` forms a group with the
   ``n_k - 1`` ranks that differ from it only in digit ``k``.  It cuts the range
   it still owns into ``n_k`` equal parts, sends part ``e`` to the group member
   whose digit ``k`` is ``e``, and reduces what every member sends for part
   ``d_k`` (its own digit) into its copy.  Afterwards every rank owns one fully
   reduced fine block.
2. All-gather, steps ``D .. 2D-1``: the mirror image.  Step ``D + m`` uses
   digit ``k = D-1-m``: each rank sends everything it owns to the other
   members of that group and copies in what each of them owns.

Radix rule for any ``P`` (``base`` itself needs no power relation to ``P``):
digits are taken greedily, each the largest divisor of what is left of ``P``
that lies in ``2 .. base``; when what is left has no such divisor (all its
prime factors exceed ``base``), the next digit is its smallest prime factor, a
group larger than ``base``.  So 12 with base 2 runs as 2 · 2 · 3, 12 with base 4
as 4 · 3, and a prime ``P`` larger than ``base`` is one group of ``P`` (a direct
reduce-scatter and all-gather).  :func:`bcube_radices` gives the digits.

Cost (alpha-beta-gamma): ``2D`` steps (``2 log_base P`` for a power of
``base``), each with ``n_k - 1`` concurrent messages per rank, so ``2D · alpha``
if the transport overlaps a step's messages, up to ``2 Σ(n_k - 1) · alpha``
if it serialises them; ``2(P-1)/P · S`` bytes sent per rank (``beta``), for any
radices; ``(P-1)/P · S`` bytes reduced per rank (``gamma``).  ``base = 2`` is
halving-doubling.

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


def bcube_radices(size: int, base: int) -> list[int]:
    """The group size of each digit for ``size`` ranks and ``base``, fastest digit first.

    >>> bcube_radices(16, 4), bcube_radices(12, 2), bcube_radices(12, 4), bcube_radices(7, 2)
    ([4, 4], [2, 2, 3], [4, 3], [7])
    """
    if base < 2:
        raise ValueError(f"bcube base must be >= 2, got {base}")
    if size < 1:
        raise ValueError(f"bcube needs at least one rank, got {size}")
    radices = []
    left = size
    while left > 1:
        digit = next((d for d in range(min(base, left), 1, -1) if left % d == 0), 0)
        if not digit:
            digit = next(d for d in range(base + 1, left + 1) if left % d == 0)
        radices.append(digit)
        left //= digit
    return radices


def allreduce_bcube(
    rank: int, size: int, count: int, *, average: bool = False, base: int = 2
) -> Schedule:
    """BCube allreduce schedule for ``rank`` of ``size`` over ``count`` elements.

    Works for any ``size``; see :func:`bcube_radices` for the groups used when
    ``size`` is not a power of ``base``.
    """
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} outside 0..{size - 1}")
    radices = bcube_radices(size, base)
    parts = balanced_parts(count, size)
    bounds = [off for off, _ in parts] + [count]

    def region(lo: int, hi: int) -> Region:
        return Region(Buffer.OUTPUT, bounds[lo], bounds[hi] - bounds[lo])

    # Per digit: (weight, own digit, owned range before the step).
    rounds = []
    lo, hi = 0, size
    weight = 1
    for n in radices:
        digit = rank // weight % n
        rounds.append((weight, n, digit, lo, hi))
        part = (hi - lo) // n
        lo, hi = lo + digit * part, lo + (digit + 1) * part
        weight *= n

    steps = []
    for weight, n, digit, lo, hi in rounds:
        part = (hi - lo) // n
        peers = [(rank + (e - digit) * weight, e) for e in range(n) if e != digit]
        keep = region(lo + digit * part, lo + (digit + 1) * part)
        steps.append(
            Step(
                sends=tuple(Send(p, region(lo + e * part, lo + (e + 1) * part)) for p, e in peers),
                recvs=tuple(Recv(p, keep, Action.REDUCE) for p, _ in peers),
            )
        )
    for weight, n, digit, lo, hi in reversed(rounds):
        part = (hi - lo) // n
        peers = [(rank + (e - digit) * weight, e) for e in range(n) if e != digit]
        keep = region(lo + digit * part, lo + (digit + 1) * part)
        steps.append(
            Step(
                sends=tuple(Send(p, keep) for p, _ in peers),
                recvs=tuple(
                    Recv(p, region(lo + e * part, lo + (e + 1) * part), Action.COPY)
                    for p, e in peers
                ),
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

"""Halving-doubling allreduce, with binary blocks for any number of ranks.

Power-of-two ``P = 2^L``.  The buffer of ``S`` bytes is cut into ``P``
balanced fine blocks; every region below is a run of whole fine blocks.

1. Reduce-scatter, steps ``i = 0 .. L-1`` (vector halving, distance
   doubling): rank ``r`` pairs with ``r XOR 2^i``, splits the range it still
   owns in two, sends the half its partner keeps and reduces the partner's
   copy of the half it keeps (the rank whose bit ``i`` is 0 keeps the lower
   half).  Step 0 pairs 0 with 1, 2 with 3, ...; each step doubles the
   distance and halves the data.  Afterwards rank ``r`` owns the fully reduced
   fine block ``bitreverse_L(r)``.
2. All-gather, steps ``L .. 2L-1``: the mirror image.  Step ``L + m`` pairs
   ``r`` with ``r XOR 2^(L-1-m)``; each rank sends everything it owns and
   copies in the half it sent at the mirrored reduce-scatter step, so the data
   doubles at each step.

The mirrored steps write the regions the reduce-scatter read; the waits that
:func:`~totalreduce.algorithms.schedule.plan_segments` derives from the
regions replace Gloo's explicit notifications.

Other ``P``: Gloo's binary blocks (not the fold of the extra ranks).  ``P`` is
written as a sum of powers of two, ``P = B_0 + B_1 + ...`` with
``B_0 > B_1 > ...``; block ``b`` is a run of consecutive ranks, the largest
first.  The fine blocks are cut for ``B_0`` (``S / B_0`` each), so the piece a
rank of a smaller block owns is a whole number of pieces of any larger block:
rank ``j`` of a block of size ``s`` owns exactly what ranks ``j, j + s, j + 2s,
...`` of a block of size ``t > s`` own together.

1. Intra-block reduce-scatter, steps ``0 .. lg B_0 - 1`` (a smaller block
   uses the first ``lg B_b`` of them).
2. Upward, one step per block boundary, smallest block first: each rank of
   block ``b`` sends its block's partial sum of each sub-piece to the rank of
   block ``b - 1`` that owns it, which reduces it in, and so on up to block 0,
   whose ranks then hold complete sums.
3. Downward, one step per boundary, block 0 first: each rank of block
   ``b - 1`` sends its complete piece to the rank of block ``b`` that owns it.
4. Intra-block all-gather, the mirror of 1 (a smaller block uses the last
   ``lg B_b`` steps).

Cost (alpha-beta-gamma), power-of-two ``P``: ``2 lg P`` steps, so
``2 lg P · alpha``; ``2(P-1)/P · S`` bytes sent per rank (``beta``);
``(P-1)/P · S`` bytes reduced per rank (``gamma``).  Binary blocks: ``2 lg
B_0 + 2(k - 1)`` steps for ``k`` blocks (``k`` = ones in the binary form of
``P``); a rank of block ``b`` of size ``s`` sends at most ``2(s-1)/s · S`` within
its block plus ``S / s`` across each of its (at most two) boundaries, so at most
``2 S``, and the crossing steps are sequential: the smaller blocks add latency
and load imbalance (Gloo notes that few large blocks, such as 16 + 8, still do
well).

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


def binary_blocks(size: int) -> list[tuple[int, int]]:
    """``(first rank, block size)`` of the power-of-two blocks of ``size``, largest first.

    >>> binary_blocks(13)
    [(0, 8), (8, 4), (12, 1)]
    """
    blocks = []
    first = 0
    for bit in range(size.bit_length() - 1, -1, -1):
        if size >> bit & 1:
            blocks.append((first, 1 << bit))
            first += 1 << bit
    return blocks


def halving_ranges(local: int, levels: int, fine: int) -> list[tuple[int, int, int, int]]:
    """The halving of ``[0, fine)`` for local rank ``local`` over ``levels`` steps.

    Entry ``i`` is ``(keep_lo, keep_hi, give_lo, give_hi)`` in fine blocks: at
    reduce-scatter step ``i`` the rank keeps the first range and sends the
    second (the rank whose bit ``i`` is set keeps the upper half).
    """
    lo, hi = 0, fine
    out = []
    for i in range(levels):
        mid = (lo + hi) // 2
        if local >> i & 1:
            out.append((mid, hi, lo, mid))
            lo = mid
        else:
            out.append((lo, mid, mid, hi))
            hi = mid
    return out


def owned_range(local: int, levels: int, fine: int) -> tuple[int, int]:
    """Fine blocks ``[lo, hi)`` local rank ``local`` owns after ``levels`` halvings."""
    ranges = halving_ranges(local, levels, fine)
    if not ranges:
        return 0, fine
    return ranges[-1][0], ranges[-1][1]


def allreduce_halving_doubling(
    rank: int, size: int, count: int, *, average: bool = False
) -> Schedule:
    """Halving-doubling allreduce schedule for ``rank`` of ``size`` over ``count`` elements.

    Any ``size`` works; a power of two takes ``2 lg size`` steps.

    >>> len(allreduce_halving_doubling(0, 8, 100).steps)
    6
    >>> len(allreduce_halving_doubling(0, 24, 100).steps)  # blocks 16 + 8
    10
    """
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} outside 0..{size - 1}")
    blocks = binary_blocks(size)
    fine = blocks[0][1]
    top = fine.bit_length() - 1  # lg B_0: steps of each intra-block phase
    nblocks = len(blocks)
    parts = balanced_parts(count, fine)
    bounds = [off for off, _ in parts] + [count]

    def region(lo: int, hi: int) -> Region:
        return Region(Buffer.OUTPUT, bounds[lo], bounds[hi] - bounds[lo])

    b = next(i for i, (first, n) in enumerate(blocks) if first <= rank < first + n)
    first, bsize = blocks[b]
    local = rank - first
    levels = bsize.bit_length() - 1

    total = 2 * top + 2 * (nblocks - 1)
    sends: list[list[Send]] = [[] for _ in range(total)]
    recvs: list[list[Recv]] = [[] for _ in range(total)]
    ranges = halving_ranges(local, levels, fine)
    mine = owned_range(local, levels, fine)

    # 1. Intra-block reduce-scatter.
    for i, (klo, khi, glo, ghi) in enumerate(ranges):
        peer = first + (local ^ (1 << i))
        sends[i].append(Send(peer, region(glo, ghi)))
        recvs[i].append(Recv(peer, region(klo, khi), Action.REDUCE))

    # 2. Upward: block c sends to block c - 1 at step top + (nblocks - 1 - c).
    if b > 0:
        up_first, up_size = blocks[b - 1]
        up_levels = up_size.bit_length() - 1
        step = top + (nblocks - 1 - b)
        for j in range(local, up_size, bsize):
            sends[step].append(Send(up_first + j, region(*owned_range(j, up_levels, fine))))
    if b < nblocks - 1:
        low_first, low_size = blocks[b + 1]
        step = top + (nblocks - 2 - b)
        recvs[step].append(Recv(low_first + local % low_size, region(*mine), Action.REDUCE))

    # 3. Downward: block c sends to block c + 1 at step top + (nblocks - 1) + c.
    if b < nblocks - 1:
        low_first, low_size = blocks[b + 1]
        step = top + (nblocks - 1) + b
        sends[step].append(Send(low_first + local % low_size, region(*mine)))
    if b > 0:
        up_first, up_size = blocks[b - 1]
        up_levels = up_size.bit_length() - 1
        step = top + (nblocks - 1) + (b - 1)
        for j in range(local, up_size, bsize):
            recvs[step].append(
                Recv(up_first + j, region(*owned_range(j, up_levels, fine)), Action.COPY)
            )

    # 4. Intra-block all-gather, mirroring 1 and ending at the last step.
    base = top + 2 * (nblocks - 1)
    for i in range(levels - 1, -1, -1):
        klo, khi, glo, ghi = ranges[i]
        peer = first + (local ^ (1 << i))
        step = base + top - 1 - i
        sends[step].append(Send(peer, region(klo, khi)))
        recvs[step].append(Recv(peer, region(glo, ghi), Action.COPY))

    steps = tuple(Step(tuple(s), tuple(r)) for s, r in zip(sends, recvs, strict=True))
    return Schedule(
        rank=rank,
        size=size,
        count=count,
        out_count=count,
        steps=steps,
        prologue=allreduce_prologue(count),
        epilogue=allreduce_epilogue(count, size, average),
    )

"""Rooted and personalised collectives: reduce, gather, scatter, all-to-all, send/recv.

All are direct (one step of data, every transfer straight to its destination),
as Gloo's and MPI's linear algorithms for these are; ``n`` is the per-rank
element count, ``P`` the group size.

Reduce (:func:`reduce_direct`): every non-root sends its input to ``root``,
which reduces the ``P - 1`` arrivals into its copy of its own input (same-step
reductions into one region need no order between them).  Cost: 1 step; the
root receives ``(P-1) · n`` elements and reduces as many.

Gather (:func:`gather_direct`): every non-root sends its input to ``root``,
which places rank ``r``'s at ``r · n`` of its ``P · n`` output.  Cost: 1 step;
the root receives ``(P-1) · n``.

Scatter (:func:`scatter_direct`): the root sends part ``j`` (``n`` elements at
``j · n`` of its ``P · n`` input) to rank ``j``.  Cost: 1 step; the root sends
``(P-1) · n``.

All-to-all (:func:`alltoall_direct`): rank ``r`` sends its part ``j`` to rank
``j`` and receives rank ``j``'s part ``r`` into its part ``j``; parts may differ
in size (``split`` / ``recv_split``, as ``all_to_all_single`` allows), and
every pair must agree on what it exchanges.  Cost: 1 step, ``P - 1`` sends and
receives per rank.

Send/recv (:func:`send_recv`): the two-rank op of a point-to-point message,
``src`` sends its whole input, ``dst`` receives it into its output and answers
with a token (a synchronous send: both ends check each other's shape).

Confirmation.  The rooted ones carry the confirmation of :mod:`.broadcast`:
each non-root sends the root a one-element ``WORK`` token (its frame carries
the op's shape; at step 1 for reduce and gather, whose step 0 already
receives the data from each rank) and the root releases every non-root once
all tokens have come, so ranks that disagree on the root or the count fail the op on
every rank before any finishes.  Reduce and gather answer at ``P = 2`` too,
because their non-root only sends and would otherwise never hear the root; with one
non-root the answer needs no token first (it goes when the op starts: ``confirm``), so
a two-rank reduce or gather costs ``alpha``, not a round trip.
All-to-all needs none: every rank receives from every rank it sends to.
"""

from __future__ import annotations

from collections.abc import Sequence

from .broadcast import confirm, confirm_work
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
)


def _check(what: str, rank: int, size: int, count: int, root: int) -> None:
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} outside 0..{size - 1}")
    if not 0 <= root < size:
        raise ValueError(f"{what} root {root} outside 0..{size - 1}")
    if count < 0:
        raise ValueError(f"{what} count must be >= 0, got {count}")


def reduce_direct(
    rank: int, size: int, count: int, *, root: int = 0, average: bool = False
) -> Schedule:
    """Reduce schedule: ``count`` elements of every rank reduced into ``root``'s output.

    A non-root's output is empty (``out_count`` 0).
    """
    _check("reduce", rank, size, count, root)
    mine = Region(Buffer.INPUT, 0, count)
    out = Region(Buffer.OUTPUT, 0, count)
    steps: list[Step] = []
    if rank == root:
        recvs = tuple(Recv(p, out, Action.REDUCE) for p in range(size) if p != root)
        if size > 1:
            steps = [Step(recvs=recvs)]
        confirm(rank, size, root, 2, steps, always_release=True, token_step=1)
        epilogue: tuple[LocalOp, ...] = ()
        if average and size > 1:
            epilogue = (LocalOp(LocalKind.AVERAGE, out, divisor=size),)
        return Schedule(
            rank=rank,
            size=size,
            count=count,
            out_count=count,
            steps=tuple(steps),
            prologue=(LocalOp(LocalKind.COPY, out, mine),),
            epilogue=epilogue,
            work_count=confirm_work(size, always_release=True),
        )
    steps = [Step(sends=(Send(root, mine),))]
    confirm(rank, size, root, 2, steps, always_release=True, token_step=1)
    work = confirm_work(size, always_release=True)
    return Schedule(
        rank=rank, size=size, count=count, out_count=0, steps=tuple(steps), work_count=work
    )


def gather_direct(rank: int, size: int, count: int, *, root: int = 0) -> Schedule:
    """Gather schedule: ``root``'s output holds every rank's ``count`` elements in rank order."""
    _check("gather", rank, size, count, root)
    mine = Region(Buffer.INPUT, 0, count)
    if rank == root:
        recvs = tuple(
            Recv(p, Region(Buffer.OUTPUT, p * count, count)) for p in range(size) if p != root
        )
        steps: list[Step] = [Step(recvs=recvs)] if size > 1 else []
        confirm(rank, size, root, 2, steps, always_release=True, token_step=1)
        own = LocalOp(LocalKind.COPY, Region(Buffer.OUTPUT, root * count, count), mine)
        return Schedule(
            rank=rank,
            size=size,
            count=count,
            out_count=size * count,
            steps=tuple(steps),
            prologue=(own,),
            work_count=confirm_work(size, always_release=True),
        )
    steps = [Step(sends=(Send(root, mine),))]
    confirm(rank, size, root, 2, steps, always_release=True, token_step=1)
    work = confirm_work(size, always_release=True)
    return Schedule(
        rank=rank, size=size, count=count, out_count=0, steps=tuple(steps), work_count=work
    )


def scatter_direct(rank: int, size: int, count: int, *, root: int = 0) -> Schedule:
    """Scatter schedule: rank ``j`` gets part ``j`` (``count`` elements) of ``root``'s input.

    The root's input has ``size * count`` elements; a non-root has none (``count`` 0).
    """
    _check("scatter", rank, size, count, root)
    out = Region(Buffer.OUTPUT, 0, count)
    if rank == root:
        sends = tuple(
            Send(p, Region(Buffer.INPUT, p * count, count)) for p in range(size) if p != root
        )
        steps: list[Step] = [Step(sends=sends)] if size > 1 else []
        confirm(rank, size, root, 1, steps)
        own = LocalOp(LocalKind.COPY, out, Region(Buffer.INPUT, root * count, count))
        return Schedule(
            rank=rank,
            size=size,
            count=size * count,
            out_count=count,
            steps=tuple(steps),
            prologue=(own,),
            work_count=1 if size > 1 else 0,
        )
    steps = [Step(recvs=(Recv(root, out),))]
    confirm(rank, size, root, 1, steps)
    return Schedule(
        rank=rank, size=size, count=0, out_count=count, steps=tuple(steps), work_count=1
    )


def offsets(sizes: Sequence[int]) -> list[int]:
    """Where each of consecutive parts of ``sizes`` starts."""
    out, at = [], 0
    for n in sizes:
        out.append(at)
        at += n
    return out


def alltoall_direct(
    rank: int, size: int, split: Sequence[int], recv_split: Sequence[int] | None = None
) -> Schedule:
    """All-to-all schedule: part ``j`` of this rank's input to rank ``j``, and back.

    ``split[j]`` elements go to rank ``j`` (the input is their sum);
    ``recv_split[j]`` come from rank ``j`` (default ``split``, the equal case).

    >>> s = alltoall_direct(1, 3, [2, 2, 2])
    >>> [(x.peer, x.region.offset) for x in s.steps[0].sends]
    [(0, 0), (2, 4)]
    """
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} outside 0..{size - 1}")
    got = list(split if recv_split is None else recv_split)
    split = list(split)
    for what, sizes in (("split", split), ("recv_split", got)):
        if len(sizes) != size or any(n < 0 for n in sizes):
            raise ValueError(f"alltoall {what} must be {size} counts >= 0, got {sizes}")
    if split[rank] != got[rank]:
        raise ValueError(
            f"alltoall: rank {rank} sends itself {split[rank]} elements but expects {got[rank]}"
        )
    src, dst = offsets(split), offsets(got)
    peers = [p for p in range(size) if p != rank]
    steps: tuple[Step, ...] = ()
    if peers:
        steps = (
            Step(
                sends=tuple(Send(p, Region(Buffer.INPUT, src[p], split[p])) for p in peers),
                recvs=tuple(Recv(p, Region(Buffer.OUTPUT, dst[p], got[p])) for p in peers),
            ),
        )
    own = LocalOp(
        LocalKind.COPY,
        Region(Buffer.OUTPUT, dst[rank], got[rank]),
        Region(Buffer.INPUT, src[rank], split[rank]),
    )
    return Schedule(
        rank=rank,
        size=size,
        count=sum(split),
        out_count=sum(got),
        steps=steps,
        prologue=(own,),
        reads_input=True,  # in place, part j would be overwritten before it left
    )


def send_recv(rank: int, count: int, *, sender: int) -> Schedule:
    """The two-rank schedule of one message: group rank ``sender`` sends ``count`` elements.

    The receiver answers with a one-element token, so the sender hears the
    receiver's shape too: a size or dtype disagreement fails both ends, and a
    send completes once its receive is posted (MPI's synchronous send).
    """
    if rank not in (0, 1) or sender not in (0, 1):
        raise ValueError(f"send_recv is a two-rank op: rank {rank}, sender {sender}")
    if count < 0:
        raise ValueError(f"send_recv count must be >= 0, got {count}")
    token = Region(Buffer.WORK, 0, 1)
    if rank == sender:
        step = Step(
            sends=(Send(1 - rank, Region(Buffer.INPUT, 0, count)),), recvs=(Recv(1 - rank, token),)
        )
        return Schedule(rank=rank, size=2, count=count, out_count=0, steps=(step,), work_count=1)
    step = Step(
        sends=(Send(1 - rank, token),), recvs=(Recv(1 - rank, Region(Buffer.OUTPUT, 0, count)),)
    )
    return Schedule(rank=rank, size=2, count=0, out_count=count, steps=(step,), work_count=1)

"""Neighbor averaging on a virtual topology: BlueFog's neighbor ops and Decent-DP's edges.

:func:`neighbor_allreduce`: ``x_i <- self_weight * x_i + sum_j src_weights[j] * x_j``,
where each sender ``j`` may scale what it sends to ``i`` by ``dst_weights[i]``
(BlueFog's meaning).  Steps:

0. Announce: send an empty frame to every rank this rank receives from, and
   receive one from every rank it sends to.  A pattern that does not match
   between two ranks therefore shows up as an unexpected frame on one of them,
   which the engine reports naming both ranks, instead of a rank waiting
   forever for data nobody sends.  The announce step waits for nothing, so it
   overlaps the data step.
1. Data: send the input (or a scaled copy, one per distinct destination
   weight) to every destination; receive from every source and accumulate
   ``weight * x_j`` into the output, which the prologue set to
   ``self_weight * x_i``.

Cost: 2 steps; ``|dst| * S`` bytes sent, ``|src| * S`` accumulated.

:func:`neighbor_allgather`: the same announce step, then every rank receives
the input of each of its sources; the output is their concatenation in
ascending rank order.

:func:`edge_average`: Decent-DP's edge rule over one edge's group of ``n``
ranks, ``x_i <- w x_i + (1-w)/(n-1) sum_{j != i} x_j``, as a ring allreduce
sum over the group followed by ``out = b * sum + (w - b) * x_i`` with
``b = (1-w)/(n-1)``.  Cost: the ring's, ``2(n-1)`` steps and
``2(n-1)/n · S`` bytes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .ring import allreduce_ring
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


def _check_peers(rank: int, size: int, peers: Sequence[int], what: str) -> None:
    for p in peers:
        if not 0 <= p < size:
            raise ValueError(f"rank {rank}: {what} rank {p} outside 0..{size - 1}")
        if p == rank:
            raise ValueError(f"rank {rank}: {what} ranks must not include the rank itself")
    if len(set(peers)) != len(peers):
        raise ValueError(f"rank {rank}: {what} ranks repeat: {list(peers)}")


def _announce(rank: int, src: Sequence[int], dst: Sequence[int]) -> Step:
    nothing = Region(Buffer.OUTPUT, 0, 0)
    return Step(
        sends=tuple(Send(j, nothing) for j in src),
        recvs=tuple(Recv(d, nothing, Action.COPY) for d in dst),
    )


#: What an unmatched frame means at each step of a neighbor schedule (see ``Schedule.unexpected``).
NEIGHBOR_UNEXPECTED = (
    "rank {sender} receives from rank {me}, but rank {me} does not send to rank {sender} "
    "(check the topology or src_weights / dst_weights)",
    "rank {sender} sends to rank {me}, but rank {me} does not receive from rank {sender} "
    "(check the topology or src_weights / dst_weights)",
)


def neighbor_allreduce(
    rank: int,
    size: int,
    count: int,
    *,
    self_weight: float,
    src_weights: Mapping[int, float],
    dst_weights: Mapping[int, float],
) -> Schedule:
    """Weighted neighbor averaging for ``rank`` (see the module docstring).

    >>> s = neighbor_allreduce(0, 3, 4, self_weight=0.5, src_weights={1: 0.5}, dst_weights={2: 1})
    >>> [r.peer for r in s.steps[1].recvs], [x.peer for x in s.steps[1].sends]
    ([1], [2])
    """
    src = sorted(src_weights)
    dst = sorted(dst_weights)
    _check_peers(rank, size, src, "source")
    _check_peers(rank, size, dst, "destination")
    whole_in = Region(Buffer.INPUT, 0, count)
    out = Region(Buffer.OUTPUT, 0, count)
    prologue = [LocalOp(LocalKind.SCALE, out, whole_in, weight=float(self_weight))]
    scaled: dict[float, Region] = {}
    sends = []
    for d in dst:
        w = float(dst_weights[d])
        if w == 1.0:
            sends.append(Send(d, whole_in))
            continue
        if w not in scaled:
            slot = Region(Buffer.WORK, len(scaled) * count, count)
            scaled[w] = slot
            prologue.append(LocalOp(LocalKind.SCALE, slot, whole_in, weight=w))
        sends.append(Send(d, scaled[w]))
    recvs = tuple(Recv(j, out, Action.ACCUMULATE, float(src_weights[j])) for j in src)
    return Schedule(
        rank=rank,
        size=size,
        count=count,
        out_count=count,
        steps=(_announce(rank, src, dst), Step(sends=tuple(sends), recvs=recvs)),
        prologue=tuple(prologue),
        work_count=len(scaled) * count,
        reads_input=True,
        unexpected=NEIGHBOR_UNEXPECTED,
    )


def neighbor_allgather(
    rank: int, size: int, count: int, *, src_ranks: Sequence[int], dst_ranks: Sequence[int]
) -> Schedule:
    """Gather the inputs of ``src_ranks`` (ascending) into one output of ``len(src) * count``.

    >>> neighbor_allgather(1, 4, 3, src_ranks=[3, 0], dst_ranks=[2]).out_count
    6
    """
    src = sorted(src_ranks)
    dst = sorted(dst_ranks)
    _check_peers(rank, size, src, "source")
    _check_peers(rank, size, dst, "destination")
    whole_in = Region(Buffer.INPUT, 0, count)
    data = Step(
        sends=tuple(Send(d, whole_in) for d in dst),
        recvs=tuple(
            Recv(j, Region(Buffer.OUTPUT, k * count, count), Action.COPY) for k, j in enumerate(src)
        ),
    )
    return Schedule(
        rank=rank,
        size=size,
        count=count,
        out_count=len(src) * count,
        steps=(_announce(rank, src, dst), data),
        unexpected=NEIGHBOR_UNEXPECTED,
    )


def edge_average(rank: int, size: int, count: int, *, weight: float) -> Schedule:
    """Decent-DP's edge rule over a group of ``size`` ranks (``rank`` is the group rank).

    >>> s = edge_average(0, 2, 10, weight=0.5)
    >>> len(s.steps), [op.kind.name for op in s.epilogue]
    (2, ['SCALE', 'ACCUMULATE'])
    """
    if not 0.0 <= weight <= 1.0:
        raise ValueError(f"edge weight must be in [0, 1], got {weight}")
    ring = allreduce_ring(rank, size, count)
    out = Region(Buffer.OUTPUT, 0, count)
    if size == 1:
        return ring
    b = (1.0 - weight) / (size - 1)
    epilogue = (
        LocalOp(LocalKind.SCALE, out, out, weight=b),
        LocalOp(LocalKind.ACCUMULATE, out, Region(Buffer.INPUT, 0, count), weight=weight - b),
    )
    return Schedule(
        rank=rank,
        size=size,
        count=count,
        out_count=count,
        steps=ring.steps,
        prologue=ring.prologue,
        epilogue=epilogue,
        reads_input=True,
    )

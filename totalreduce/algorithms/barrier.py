"""Barriers: schedules that move no data and finish only when every rank has arrived.

All-to-all (:func:`barrier_all_to_all`), one step: every rank sends a
zero-byte notification to every other rank and receives one from each.  No
rank finishes before all have started.  Cost: 1 step, ``alpha`` latency (the
``P - 1`` notifications of a rank overlap); ``P - 1`` zero-byte frames sent
per rank.

All-to-one (:func:`barrier_all_to_one`), two steps:

1. Every non-root sends a notification to ``root``; the root receives
   ``P - 1`` of them.
2. The root sends a notification to every non-root, each of which receives
   it.

Cost: 2 steps, ``2 alpha`` latency; one frame per non-root and ``P - 1`` for
the root.

Why the all-to-one notifications carry one element: the schedule contract
derives every wait from overlapping regions and an empty region overlaps
nothing, so with zero-byte regions the root's step-2 sends would not wait for
its step-1 receives and a non-root could leave before the others arrived.
Each notification is therefore one element of a one-element ``WORK`` array:
the root receives the step-1 tokens into it and sends it at step 2, which
makes step 2 wait for every arrival.  The token's value is never used
(``count`` and ``out_count`` stay 0).  The all-to-all barrier needs no such
order, so its frames are empty.
"""

from __future__ import annotations

from .schedule import Action, Buffer, Recv, Region, Schedule, Send, Step

NOTHING = Region(Buffer.OUTPUT, 0, 0)
TOKEN = Region(Buffer.WORK, 0, 1)


def barrier_all_to_all(rank: int, size: int) -> Schedule:
    """All-to-all barrier schedule for ``rank`` of ``size``: one step of empty frames."""
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} outside 0..{size - 1}")
    peers = [p for p in range(size) if p != rank]
    steps: tuple[Step, ...] = ()
    if peers:
        steps = (
            Step(
                sends=tuple(Send(p, NOTHING) for p in peers),
                recvs=tuple(Recv(p, NOTHING, Action.COPY) for p in peers),
            ),
        )
    return Schedule(rank=rank, size=size, count=0, out_count=0, steps=steps)


def barrier_all_to_one(rank: int, size: int, root: int = 0) -> Schedule:
    """All-to-one barrier schedule for ``rank`` of ``size``: gather to ``root``, then release."""
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} outside 0..{size - 1}")
    if not 0 <= root < size:
        raise ValueError(f"barrier root {root} outside 0..{size - 1}")
    if size == 1:
        return Schedule(rank=rank, size=size, count=0, out_count=0)
    if rank == root:
        others = [p for p in range(size) if p != root]
        steps = (
            # COPY, not REDUCE: a token has no reduce op; each arrival waits for
            # the previous one to land, which costs nothing for one element.
            Step(recvs=tuple(Recv(p, TOKEN, Action.COPY) for p in others)),
            Step(sends=tuple(Send(p, TOKEN) for p in others)),
        )
    else:
        steps = (
            Step(sends=(Send(root, TOKEN),)),
            Step(recvs=(Recv(root, TOKEN, Action.COPY),)),
        )
    return Schedule(rank=rank, size=size, count=0, out_count=0, steps=steps, work_count=1)

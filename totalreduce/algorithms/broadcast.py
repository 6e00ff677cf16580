"""Broadcast: the root's buffer to every rank, direct or pipelined down a chain.

Both put the result in ``OUTPUT`` on every rank; the root copies its input
there in the prologue and sends from it, so ``out=x`` works on the root too.

One-to-all (:func:`broadcast_one_to_all`), Gloo's: one step in which the
root sends the whole buffer to each of the ``P - 1`` others and they receive
it.  Cost: 1 step, ``alpha`` latency; the root sends ``(P-1) · S`` bytes, so
``(P-1) · S · beta`` on its link; the others send nothing.  Best for small
buffers.

Pipelined chain (:func:`broadcast_pipelined`), for large buffers.  The ranks
form the chain ``root, root + 1, ..., root - 1`` (modulo ``P``); the rank at
position ``v`` receives from position ``v - 1`` and forwards to ``v + 1``.
The buffer is cut into ``C`` balanced pieces (``chunks``):

1. Step ``t``, for ``t = 0 .. C + P - 3``: position ``v`` sends piece
   ``t - v`` to ``v + 1`` and receives piece ``t - v + 1`` from ``v - 1`` (the
   piece ``v - 1`` sends at that step), when those pieces exist.

So piece ``c`` enters the chain at step ``c`` and reaches the end at step
``c + P - 2``, and up to ``P - 1`` pieces are on the wire at once, one per
link.  Each piece is forwarded as soon as it has landed (the waits come from
the regions), and within a piece the engine's segments pipeline further.
Cost: ``C + P - 2`` steps; each rank but the last sends ``S`` bytes, the last
none; the time is about ``(P - 2 + C) · (alpha + beta · S / C)``, smallest
near ``C = sqrt((P - 2) · beta · S / alpha)``.  The default
``C = min(count, 2P)`` (at least 1) keeps the start-up share of ``P - 2``
piece times to about a third of the total without making pieces tiny.

Confirmation (both algorithms).  A broadcast's data flows one way, so
without more a rank could finish before a rank that disagrees on the root
or the count has said so: the root would return its buffer and raise the
error only at its next call, and the ranks would disagree from then on on
which generation of the name comes next.  So every non-root also sends the
root a one-element token at step 0 (its frame carries the op's shape, which
the root checks), and for ``P > 2`` the root, once every token has arrived,
sends each non-root a release token in a last step of its own.  The root
finishes only after hearing every rank, a non-root only after the root has:
a disagreement anywhere fails the op on every rank before any finishes.
With ``P = 2`` the one exchange checks both ways and no release is needed.
The tokens are one element of ``WORK`` (their value is never read): an empty
region overlaps nothing, so it could not order the release after the
tokens (as in :mod:`.barrier`).  Cost: the root receives ``P - 1`` tokens and
sends ``P - 1`` more; a non-root finishes about ``2 alpha`` after it sent
its token, so a small one-to-all broadcast takes ``2 alpha`` instead of
``alpha``; a pipelined one hides the confirmation behind its pieces.
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


def _check(rank: int, size: int, count: int, root: int) -> None:
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} outside 0..{size - 1}")
    if not 0 <= root < size:
        raise ValueError(f"broadcast root {root} outside 0..{size - 1}")
    if count < 0:
        raise ValueError(f"broadcast count must be >= 0, got {count}")


#: The confirmation token (see the module docstring).
TOKEN = Region(Buffer.WORK, 0, 1)
#: The root's token of a two-rank reduce or gather (:func:`confirm`), apart from the one
#: it receives so that neither waits for the other.
ANSWER = Region(Buffer.WORK, 1, 1)


def confirm_work(size: int, *, always_release: bool = False) -> int:
    """The ``WORK`` elements :func:`confirm` uses on every rank of ``size``."""
    if size == 1:
        return 0
    return 2 if size == 2 and always_release else 1


def confirm(
    rank: int,
    size: int,
    root: int,
    release_step: int,
    steps: list[Step],
    *,
    always_release: bool = False,
    token_step: int = 0,
) -> None:
    """Add the confirmation tokens to ``steps``: to the root at ``token_step``, back at
    ``release_step`` (later steps are added as needed).

    With ``always_release``, the root answers at ``P = 2`` too: for ops whose non-roots
    only send (reduce, gather) and so never hear the root otherwise.  Its answer
    (``ANSWER``, :func:`confirm_work` elements of ``WORK``) then goes at ``token_step``
    when the op starts, not after the other's token: with one non-root, the two tokens
    (and the data the non-root sends) check each other's shape both ways, as a two-rank
    broadcast's exchange does, and the non-root finishes one message after it started
    instead of a round trip through the root.
    """
    if size == 1:
        return
    if size == 2 and always_release:
        while len(steps) <= token_step:
            steps.append(Step())
        at, other = steps[token_step], 1 - root
        if rank == root:
            steps[token_step] = Step(
                at.sends + (Send(other, ANSWER),), at.recvs + (Recv(other, TOKEN),)
            )
        else:
            steps[token_step] = Step(
                at.sends + (Send(root, TOKEN),), at.recvs + (Recv(root, ANSWER),)
            )
        return
    release = size > 2 or always_release
    while len(steps) <= (release_step if release else token_step):
        steps.append(Step())
    others = [p for p in range(size) if p != root]
    at = steps[token_step]
    if rank == root:
        steps[token_step] = Step(at.sends, at.recvs + tuple(Recv(p, TOKEN) for p in others))
    else:
        steps[token_step] = Step(at.sends + (Send(root, TOKEN),), at.recvs)
    if not release:
        return  # two ranks: the one exchange checked both ways
    last = steps[release_step]
    if rank == root:
        steps[release_step] = Step(last.sends + tuple(Send(p, TOKEN) for p in others), last.recvs)
    else:
        steps[release_step] = Step(last.sends, last.recvs + (Recv(root, TOKEN),))


def _root_prologue(rank: int, root: int, count: int) -> tuple[LocalOp, ...]:
    if rank != root:
        return ()
    src = Region(Buffer.INPUT, 0, count)
    return (LocalOp(LocalKind.COPY, Region(Buffer.OUTPUT, 0, count), src),)


def broadcast_one_to_all(rank: int, size: int, count: int, *, root: int = 0) -> Schedule:
    """Broadcast schedule in one step: ``root`` sends ``count`` elements to every rank."""
    _check(rank, size, count, root)
    whole = Region(Buffer.OUTPUT, 0, count)
    steps: list[Step] = []
    if size > 1:
        if rank == root:
            steps = [Step(sends=tuple(Send(p, whole) for p in range(size) if p != root))]
        else:
            steps = [Step(recvs=(Recv(root, whole, Action.COPY),))]
    confirm(rank, size, root, 1, steps)
    return Schedule(
        rank=rank,
        size=size,
        count=count,
        out_count=count,
        steps=tuple(steps),
        prologue=_root_prologue(rank, root, count),
        work_count=1 if size > 1 else 0,
    )


def default_chunks(size: int, count: int) -> int:
    """Pieces :func:`broadcast_pipelined` uses when ``chunks`` is not given."""
    return max(1, min(count, 2 * size))


def broadcast_pipelined(
    rank: int, size: int, count: int, *, root: int = 0, chunks: int | None = None
) -> Schedule:
    """Broadcast schedule pipelined down the chain ``root -> root + 1 -> ...`` in ``chunks`` pieces.

    >>> len(broadcast_pipelined(0, 4, 1000, chunks=8).steps)  # C + P - 2
    10
    """
    _check(rank, size, count, root)
    pieces = default_chunks(size, count) if chunks is None else chunks
    if pieces < 1:
        raise ValueError(f"broadcast chunks must be >= 1, got {chunks}")
    parts = balanced_parts(count, pieces)
    position = (rank - root) % size
    succ, pred = (rank + 1) % size, (rank - 1) % size

    steps: list[Step] = []
    if size > 1:
        total = pieces + size - 2
        sends: list[list[Send]] = [[] for _ in range(total)]
        recvs: list[list[Recv]] = [[] for _ in range(total)]
        for c, (off, n) in enumerate(parts):
            piece = Region(Buffer.OUTPUT, off, n)
            if position > 0:
                recvs[c + position - 1].append(Recv(pred, piece, Action.COPY))
            if position < size - 1:
                sends[c + position].append(Send(succ, piece))
        steps = [Step(tuple(s), tuple(r)) for s, r in zip(sends, recvs, strict=True)]
        # The release gets a step of its own: at step 1 it would meet a piece from the root.
        confirm(rank, size, root, total, steps)
    return Schedule(
        rank=rank,
        size=size,
        count=count,
        out_count=count,
        steps=tuple(steps),
        prologue=_root_prologue(rank, root, count),
        work_count=1 if size > 1 else 0,
    )

"""The allreduce algorithms by the names users pass as ``algorithm=``.

Every entry takes ``(rank, size, count, *, average=False)`` and returns a
:class:`~totalreduce.algorithms.schedule.Schedule`; algorithm options (the
BCube ``base``) pass through :func:`allreduce_schedule` as keywords.  The
choice of ``"auto"`` is a pure lookup, :func:`auto_allreduce`, in a crossover
table the caller supplies (``totalreduce tune`` measures them;
``service/tuning.py`` loads them).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .bcube import allreduce_bcube
from .halving_doubling import allreduce_halving_doubling
from .recursive_doubling import allreduce_recursive_doubling
from .ring import allreduce_ring
from .ring_chunked import allreduce_ring_chunked
from .schedule import Schedule

AllreduceAlgorithm = Callable[..., Schedule]

ALLREDUCE: dict[str, AllreduceAlgorithm] = {
    "ring": allreduce_ring,
    "ring_chunked": allreduce_ring_chunked,
    "halving_doubling": allreduce_halving_doubling,
    "recursive_doubling": allreduce_recursive_doubling,
    "bcube": allreduce_bcube,
}


def allreduce_schedule(
    name: str, rank: int, size: int, count: int, *, average: bool = False, **options: Any
) -> Schedule:
    """The schedule of allreduce algorithm ``name``; ``options`` go to the algorithm.

    >>> allreduce_schedule("bcube", 0, 9, 90, base=3).steps[0].sends[0].peer
    1
    """
    try:
        algorithm = ALLREDUCE[name]
    except KeyError:
        known = ", ".join(sorted(ALLREDUCE))
        raise ValueError(f"unknown allreduce algorithm {name!r}; known: {known}") from None
    return algorithm(rank, size, count, average=average, **options)


Crossovers = Mapping[int, Sequence[tuple[float, str]]]


BROADCAST = ("one_to_all", "pipelined")


def auto_allreduce(size: int, nbytes: int, crossovers: Crossovers) -> str:
    """The algorithm a crossover table picks for ``size`` ranks and ``nbytes`` of data.

    ``crossovers`` maps a rank count to rows ``(limit, name)`` in increasing
    ``limit``: ``name`` is chosen for ``nbytes < limit``, and the last row's
    name above every limit.  The row set used is that of the largest tabulated
    rank count not above ``size`` (the smallest one if all are above).

    >>> table = {2: [(1 << 20, "ring")], 8: [(65536, "halving_doubling"), (1e18, "ring")]}
    >>> auto_allreduce(16, 1000, table), auto_allreduce(16, 1 << 24, table)
    ('halving_doubling', 'ring')
    >>> auto_allreduce(4, 1 << 30, table)
    'ring'
    """
    return auto_choice(size, nbytes, crossovers, ALLREDUCE)


def auto_choice(
    size: int, nbytes: int, crossovers: Crossovers, known: Sequence[str] | Mapping[str, Any]
) -> str:
    """:func:`auto_allreduce` for any collective whose algorithms are ``known``.

    >>> auto_choice(4, 1 << 24, {2: [(1 << 20, "one_to_all"), (None, "pipelined")]}, BROADCAST)
    'pipelined'
    """
    if not crossovers:
        raise ValueError("auto needs a non-empty crossover table")
    sizes = sorted(crossovers)
    at_or_below = [s for s in sizes if s <= size]
    rows = crossovers[at_or_below[-1] if at_or_below else sizes[0]]
    if not rows:
        raise ValueError(f"crossover table has no rows for {size} ranks")
    for limit, name in rows:
        if limit is not None and nbytes < limit:
            choice = name
            break
    else:
        choice = rows[-1][1]
    if choice not in known:
        names = ", ".join(sorted(known))
        raise ValueError(f"crossover table names unknown algorithm {choice!r}; known: {names}")
    return choice

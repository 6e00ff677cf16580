"""From a call's arguments to a compiled op: algorithm choice, schedule, segment plan.

Plans are cached: a training loop submits the same shapes every step, so the
schedule and its segment plan are built once per (kind, algorithm, rank,
size, count, options, segment size).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from ..algorithms.codes import AlgorithmCode, OpKind
from ..algorithms.schedule import Schedule, SegmentPlan, alias_input, plan_segments
from ..errors import InvalidArgumentError


def _allreduce_algorithms() -> dict[str, tuple[AlgorithmCode, Callable[..., Schedule]]]:
    from ..algorithms import registry

    return {name: (AlgorithmCode[name.upper()], fn) for name, fn in registry.ALLREDUCE.items()}


def choose_allreduce(
    algorithm: str,
    size: int,
    nbytes: int,
    tuning_file: str | None = None,
    dtype: str | None = None,
) -> str:
    """The allreduce algorithm to run; ``auto`` follows the tuning table in force.

    ``tuning_file`` None means the configured one (``TOTALREDUCE_TUNING_FILE``);
    for rank counts that file does not cover, the table shipped with the package
    (:mod:`totalreduce.service.tuning`).
    """
    from ..algorithms import registry

    return _choose("allreduce", registry.ALLREDUCE, algorithm, size, nbytes, tuning_file, dtype)


def choose_broadcast(
    algorithm: str,
    size: int,
    nbytes: int,
    tuning_file: str | None = None,
    dtype: str | None = None,
) -> str:
    """The broadcast algorithm to run; ``auto`` follows the tuning table in force."""
    from ..algorithms import registry

    return _choose("broadcast", registry.BROADCAST, algorithm, size, nbytes, tuning_file, dtype)


def _choose(
    collective: str,
    known: Any,
    algorithm: str,
    size: int,
    nbytes: int,
    tuning_file: str | None,
    dtype: str | None,
) -> str:
    if algorithm != "auto":
        if algorithm not in known:
            names = ", ".join(sorted(known))
            raise InvalidArgumentError(
                f"unknown {collective} algorithm {algorithm!r}; known: auto, {names}"
            )
        return algorithm
    from ..algorithms import registry
    from . import tuning

    # Remembered per shape: a training loop asks again every step, and walking the
    # tables costs more than a frame.
    key = (collective, size, nbytes, dtype, tuning_file or tuning.configured_file())
    choice = tuning.CHOICES.get(key)
    if choice is None:
        crossovers, _ = tuning.table_for(collective, size, dtype, tuning_file)
        choice = registry.auto_choice(size, nbytes, crossovers, known)
        if len(tuning.CHOICES) > 65536:
            tuning.CHOICES.clear()
        tuning.CHOICES[key] = choice
    return choice


_ROOTED = frozenset(
    {OpKind.REDUCE, OpKind.GATHER, OpKind.SCATTER, OpKind.ALLTOALL, OpKind.SEND_RECV}
)


@functools.lru_cache(maxsize=1024)
def compile_op(
    kind: OpKind,
    algorithm: str,
    rank: int,
    size: int,
    count: int,
    average: bool,
    options: tuple[tuple[str, Any], ...] = (),
) -> tuple[AlgorithmCode, Schedule]:
    """Build (and cache) the schedule of an op for group rank ``rank`` of ``size``."""
    opts = dict(options)
    if kind is OpKind.ALLREDUCE:
        code, fn = _allreduce_algorithms()[algorithm]
        sched = fn(rank, size, count, average=average, **opts)
    elif kind is OpKind.BROADCAST:
        from ..algorithms import broadcast

        if algorithm == "pipelined":
            code = AlgorithmCode.PIPELINED
            sched = broadcast.broadcast_pipelined(rank, size, count, **opts)
        else:
            code = AlgorithmCode.ONE_TO_ALL
            sched = broadcast.broadcast_one_to_all(rank, size, count, **opts)
    elif kind is OpKind.BARRIER:
        from ..algorithms import barrier

        if algorithm == "all_to_one":
            code = AlgorithmCode.ALL_TO_ONE
            sched = barrier.barrier_all_to_one(rank, size, **opts)
        else:
            code = AlgorithmCode.ALL_TO_ALL
            sched = barrier.barrier_all_to_all(rank, size)
    elif kind is OpKind.REDUCE_SCATTER:
        from ..algorithms.reduce_scatter import reduce_scatter_ring

        code = AlgorithmCode.RING
        sched = reduce_scatter_ring(rank, size, count, average=average, **opts)
    elif kind is OpKind.ALLGATHER:
        from ..algorithms.reduce_scatter import allgather_ring

        code = AlgorithmCode.RING
        sched = allgather_ring(rank, size, opts["counts"])
    elif kind is OpKind.PAIRWISE_EXCHANGE:
        from ..algorithms.pairwise_exchange import pairwise_exchange

        code = AlgorithmCode.PAIRWISE
        sched = pairwise_exchange(rank, size, count, **opts)
    elif kind in _ROOTED:
        from ..algorithms import rooted

        code = AlgorithmCode.DIRECT
        if kind is OpKind.REDUCE:
            sched = rooted.reduce_direct(rank, size, count, average=average, **opts)
        elif kind is OpKind.GATHER:
            sched = rooted.gather_direct(rank, size, count, **opts)
        elif kind is OpKind.SCATTER:
            sched = rooted.scatter_direct(rank, size, count, **opts)
        elif kind is OpKind.ALLTOALL:
            sched = rooted.alltoall_direct(rank, size, **opts)
        else:
            sched = rooted.send_recv(rank, count, **opts)
    else:
        raise InvalidArgumentError(f"no schedule for op kind {kind.name.lower()}")
    sched.validate()
    return code, sched


@functools.lru_cache(maxsize=256)
def cached_edge(rank: int, size: int, count: int, weight: float) -> Schedule:
    """Decent-DP edge averaging schedules, cached (a training loop repeats them)."""
    from ..algorithms.neighbor import edge_average

    return edge_average(rank, size, count, weight=weight)


@functools.lru_cache(maxsize=1024)
def cached_neighbor_allreduce(
    rank: int,
    size: int,
    count: int,
    self_weight: float,
    src: tuple[tuple[int, float], ...],
    dst: tuple[tuple[int, float], ...],
) -> Schedule:
    """BlueFog's weighted neighbour averaging schedules, cached by what they are made of
    (a training loop repeats the same few each step, and the same schedule object lets
    the engine reuse its compiled plan)."""
    from ..algorithms.neighbor import neighbor_allreduce

    return neighbor_allreduce(
        rank, size, count, self_weight=self_weight, src_weights=dict(src), dst_weights=dict(dst)
    )


@functools.lru_cache(maxsize=1024)
def cached_neighbor_allgather(
    rank: int, size: int, count: int, src: tuple[int, ...], dst: tuple[int, ...]
) -> Schedule:
    """Neighbor all-gather schedules, cached as :func:`cached_neighbor_allreduce`."""
    from ..algorithms.neighbor import neighbor_allgather

    return neighbor_allgather(rank, size, count, src_ranks=list(src), dst_ranks=list(dst))


# Keyed by the schedule object itself: the schedules come from the caches above, so
# a training loop hands in the same objects every step, and hashing a schedule's
# whole tree of steps on every submission would cost more than the op's own frames.
_ALIASES: dict[int, tuple[Schedule, Schedule | None]] = {}
_PLANS: dict[tuple[int, int], tuple[Schedule, SegmentPlan]] = {}


def alias_for(schedule: Schedule) -> Schedule | None:
    """The in-place form of a schedule (cached); None if it needs a private input copy."""
    hit = _ALIASES.get(id(schedule))
    if hit is not None and hit[0] is schedule:
        return hit[1]
    if len(_ALIASES) > 2048:
        _ALIASES.clear()
    aliased = alias_input(schedule)
    _ALIASES[id(schedule)] = (schedule, aliased)
    return aliased


def plan_for(schedule: Schedule, segment_elems: int) -> SegmentPlan:
    """The segment plan of a schedule, cached."""
    key = (id(schedule), segment_elems)
    hit = _PLANS.get(key)
    if hit is not None and hit[0] is schedule:
        return hit[1]
    if len(_PLANS) > 2048:
        _PLANS.clear()
    plan = plan_segments(schedule, segment_elems)
    _PLANS[key] = (schedule, plan)
    return plan

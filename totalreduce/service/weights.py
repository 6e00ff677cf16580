"""Topology weights: who a rank averages with at a step, and with what weights.

A topology is a name or an object of :mod:`totalreduce.topology`: a Decent-DP
edge topology (:class:`~totalreduce.topology.Topology`: one edge per rank and
step, averaged with the edge's weight) or a BlueFog graph (a mixing matrix per
step).  Per-call (dynamic) weights follow BlueFog's meaning.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import InvalidArgumentError

#: The topology used when a call names none.
DEFAULT_TOPOLOGY = "exponential-2"


def resolve_topology(topology: Any, size: int) -> Any:
    """The topology object for a name or object over ``size`` ranks."""
    from ..topology import get_topology

    try:
        return get_topology(topology, size)
    except ValueError as exc:
        raise InvalidArgumentError(str(exc)) from None


def edge_topology(topology: Any) -> bool:
    """Is this (resolved) topology a Decent-DP edge topology?"""
    from ..topology import Topology

    return isinstance(topology, Topology)


def graph_weights(
    topology: Any, rank: int, step: int
) -> tuple[float, dict[int, float], dict[int, float]]:
    """``(self_weight, src_weights, dst_weights)`` of ``rank`` on a graph topology at ``step``."""
    from ..topology import plan

    p = plan(topology, rank, step)
    return p.self_weight, dict(p.src_weights), {d: 1.0 for d in p.dst_ranks}


def weight_map(weights: Any) -> dict[int, float]:
    """Rank -> weight from BlueFog's two spellings: a mapping, or ranks (weight 1 each)."""
    if isinstance(weights, Mapping):
        return {int(k): float(v) for k, v in weights.items()}
    return {int(r): 1.0 for r in weights}


def neighbor_weights(
    rank: int,
    size: int,
    topology: Any,
    step: int,
    self_weight: float | None,
    src_weights: Any,
    dst_weights: Any,
) -> tuple[float, dict[int, float], dict[int, float]]:
    """BlueFog's weights: from the topology at ``step``, or as given (dynamic)."""
    given = (self_weight, src_weights, dst_weights)
    if any(v is not None for v in given):
        if src_weights is None or self_weight is None:
            raise InvalidArgumentError(
                "dynamic neighbor_allreduce needs self_weight and src_weights "
                "(and dst_weights, or a topology to take the destinations from)"
            )
        src = weight_map(dict(src_weights))
        if dst_weights is None:
            if topology is None:
                raise InvalidArgumentError(
                    "neighbor_allreduce with src_weights needs dst_weights or a topology"
                )
            _, _, dst = graph_weights(resolve_topology(topology, size), rank, step)
        else:
            dst = weight_map(dst_weights)
        return float(self_weight), src, dst
    return graph_weights(resolve_topology(topology or DEFAULT_TOPOLOGY, size), rank, step)


def neighbor_ranks(
    rank: int, size: int, topology: Any, step: int, src_ranks: Any, dst_ranks: Any
) -> tuple[list[int], list[int]]:
    """Sources and destinations (ascending) of a neighbor all-gather: given, or the topology's."""
    if src_ranks is not None or dst_ranks is not None:
        if src_ranks is None or dst_ranks is None:
            raise ValueError("give both src_ranks and dst_ranks")
        return sorted(int(r) for r in src_ranks), sorted(int(r) for r in dst_ranks)
    _, src, dst = graph_weights(resolve_topology(topology or DEFAULT_TOPOLOGY, size), rank, step)
    return sorted(src), sorted(dst)

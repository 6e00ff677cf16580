"""Topology weights: who a rank averages with at a step, and with what weights.

A topology is a name or an object of :mod:`totalreduce.topology`: a Decent-DP
edge topology (:class:`~totalreduce.topology.Topology`: one edge per rank and
step, averaged with the edge's weight) or a BlueFog graph (a mixing matrix per
step).  Per-call (dynamic) weights follow BlueFog's meaning.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from ..errors import InvalidArgumentError

#: The topology used when a call names none.
DEFAULT_TOPOLOGY = "exponential-2"


def resolve_topology(topology: Any, size: int) -> Any:
    """The topology object for a name or object over ``size`` ranks (one object per name
    and size: a training loop names its topology every step)."""
    try:
        if isinstance(topology, str):
            return _named_topology(topology, size)
        from ..topology import get_topology

        return get_topology(topology, size)
    except ValueError as exc:
        raise InvalidArgumentError(str(exc)) from None


@functools.lru_cache(maxsize=64)
def _named_topology(name: str, size: int) -> Any:
    from ..topology import get_topology

    return get_topology(name, size)


def edge_topology(topology: Any) -> bool:
    """Is this (resolved) topology a Decent-DP edge topology?"""
    from ..topology import Topology

    return isinstance(topology, Topology)


def static_graph(topology: Any, size: int) -> bool:
    """Is this topology (a name or an object) a static graph, the same weights at every
    step (so an op's schedule on it does not depend on the step)?"""
    from ..topology.graph_model import Graph

    try:
        topo = resolve_topology(topology, size)
    except Exception:  # noqa: BLE001 - not one: the op goes the whole way every time
        return False
    return isinstance(topo, Graph) and topo.period == 1


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
    """BlueFog's weights: from the topology at ``step``, or as given (dynamic).

    ``self_weight`` and ``src_weights`` without ``dst_weights`` (BlueFog's static form)
    send to every out-neighbor of ``topology`` (default ``exponential-2``) and weigh
    the in-neighbors as given, those left out by 0; a source that is no in-neighbor is
    refused.  A rank named among its own destinations and sources (a schedule pairing a
    rank with itself, as BlueFog's inner-outer ring does on one machine) keeps that share
    of its own value: its weight is added to ``self_weight``.
    """
    given = (self_weight, src_weights, dst_weights)
    if not any(v is not None for v in given):
        return graph_weights(resolve_topology(topology or DEFAULT_TOPOLOGY, size), rank, step)
    if src_weights is None or self_weight is None:
        raise InvalidArgumentError(
            "dynamic neighbor_allreduce needs self_weight and src_weights "
            "(and dst_weights, or a topology to take the destinations from)"
        )
    if not isinstance(src_weights, Mapping):
        raise InvalidArgumentError(
            f"src_weights must map source ranks to weights, got {src_weights!r}"
        )
    src = weight_map(src_weights)
    sw = float(self_weight)
    if dst_weights is None:
        topo = resolve_topology(topology or DEFAULT_TOPOLOGY, size)
        _, in_weights, dst = graph_weights(topo, rank, step)
        strangers = sorted(set(src) - set(in_weights))
        if strangers:
            raise InvalidArgumentError(
                f"src_weights name ranks {strangers} that are not in-neighbors of rank {rank} "
                f"in {topo.describe()} at step {step} (those are {sorted(in_weights)}); "
                "without dst_weights the topology says who sends"
            )
        return sw, {r: src.get(r, 0.0) for r in sorted(in_weights)}, dst
    dst = weight_map(dst_weights)
    if (rank in src) != (rank in dst):
        where = "src_weights" if rank in src else "dst_weights"
        other = "dst_weights" if rank in src else "src_weights"
        raise InvalidArgumentError(
            f"rank {rank} is in its own {where} but not in its {other}; a rank may name "
            "itself only in both (it then keeps that share of its own value)"
        )
    if rank in src:
        sw += src.pop(rank)
        dst.pop(rank)
    return sw, src, dst


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

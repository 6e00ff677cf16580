"""The edge model of a topology: per iteration, a partition of the ranks into averaging groups.

This module owns :class:`Edge` and :class:`Topology`, the base class of the topologies
described as groups of ranks that average together (``complete``, ``ring``, ``exp``,
``alternating-exp-ring``).  An iteration is a list of edges in which every rank appears
exactly once; the topology repeats its list of iterations with period ``len(list)``.

Edge rule.  In an edge with ranks ``R`` and weight ``w``, each member ``i`` computes::

    x_i <- w * x_i + (1 - w) / (|R| - 1) * sum(x_j for j in R if j != i)

and a rank alone in its edge (``|R| == 1``) keeps its value whatever ``w`` is.  Each edge
is a symmetric, doubly stochastic block, so every iteration's mixing matrix is symmetric
and doubly stochastic by construction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .mixing import MixingTopology, NeighborPlan


@dataclass(frozen=True)
class Edge:
    """A group of ranks that average together in one iteration.

    ``weight`` is the share each member keeps of its own value; the rest is split equally
    among the other members.  ``Edge((0, 1), 0.5)`` is a pairwise average,
    ``Edge(tuple(range(n)), 1 / n)`` a full average, ``Edge((r,), 1.0)`` a rank that sits
    the iteration out.  Ranks are normalised to a tuple of ints; their range, uniqueness
    and the weight are checked by the :class:`Topology` that holds the edge, so that
    errors can name the iteration.
    """

    ranks: tuple[int, ...]
    weight: float

    def __post_init__(self) -> None:
        try:
            ranks = tuple(int(r) for r in self.ranks)
        except (TypeError, ValueError):
            raise TypeError(f"edge ranks must be ints, got {self.ranks!r}") from None
        object.__setattr__(self, "ranks", ranks)
        object.__setattr__(self, "weight", float(self.weight))

    @property
    def self_weight(self) -> float:
        """The weight a member gives its own value (1 for a rank alone)."""
        return self.weight if len(self.ranks) > 1 else 1.0

    @property
    def peer_weight(self) -> float:
        """The weight a member gives each other member's value (0 for a rank alone)."""
        k = len(self.ranks)
        return (1.0 - self.weight) / (k - 1) if k > 1 else 0.0


class Topology(MixingTopology):
    """A topology given as, per iteration, edges that partition the ranks.

    Subclasses implement :meth:`_edges`, returning one list of :class:`Edge` per
    iteration of the period; they set any attribute :meth:`_edges` reads before calling
    ``super().__init__(world_size)``, which builds and validates the edges.

    Example::

        @register("pairs")
        class Pairs(Topology):
            def _edges(self) -> list[list[Edge]]:
                n = self.world_size
                return [[Edge((i, i + 1), 0.5) for i in range(0, n, 2)]]
    """

    def __init__(self, world_size: int) -> None:
        super().__init__(world_size)
        self._schedule = self._validated(self._edges())
        # _owner[t][r] is the index, within iteration t, of the edge holding rank r.
        self._owner = [self._owners(iteration) for iteration in self._schedule]

    def _edges(self) -> list[list[Edge]]:
        """One list of edges per iteration of the period.

        Subclasses implement this, or Decent-DP's name for it, ``_get_topo_edges`` (which
        may read ``self._world_size``): a Decent-DP topology registers unchanged."""
        getter = getattr(self, "_get_topo_edges", None)
        if getter is None:
            raise TypeError(
                f"{type(self).__qualname__} must implement _edges() (or Decent-DP's "
                "_get_topo_edges()), returning one list of Edge per iteration"
            )
        return [list(iteration) for iteration in getter()]

    @property
    def period(self) -> int:
        """The number of iterations before the edges repeat."""
        return len(self._schedule)

    def edges(self, step: int) -> list[Edge]:
        """The edges of ``step`` (taken modulo the period)."""
        return list(self._schedule[self._phase(step)])

    def edge_of(self, rank: int, step: int) -> Edge:
        """The edge holding ``rank`` at ``step``."""
        self._check_rank(rank)
        phase = self._phase(step)
        return self._schedule[phase][self._owner[phase][rank]]

    def matrix(self, step: int) -> np.ndarray:
        """``W(step)`` built from the edges by the edge rule."""
        n = self.world_size
        w = np.zeros((n, n))
        for edge in self._schedule[self._phase(step)]:
            idx = np.array(edge.ranks)
            w[np.ix_(idx, idx)] = edge.peer_weight
            w[idx, idx] = edge.self_weight
        return w

    def plan(self, rank: int, step: int) -> NeighborPlan:
        """The plan of ``rank`` at ``step``: the other members of its edge, both ways."""
        edge = self.edge_of(rank, step)
        peer = edge.peer_weight
        if peer == 0.0:
            return NeighborPlan(self_weight=edge.self_weight)
        others = tuple(sorted(r for r in edge.ranks if r != rank))
        return NeighborPlan(
            self_weight=edge.self_weight,
            src_weights={r: peer for r in others},
            dst_ranks=others,
        )

    def _validated(self, schedule: list[list[Edge]]) -> tuple[tuple[Edge, ...], ...]:
        n = self.world_size
        if not schedule:
            raise ValueError(
                f"{self.describe()}: _edges() returned no iterations; "
                "it must return at least one list of edges"
            )
        for t, iteration in enumerate(schedule):
            seen: dict[int, Edge] = {}
            for edge in iteration:
                if not isinstance(edge, Edge):
                    raise TypeError(f"{self.describe()}, iteration {t}: {edge!r} is not an Edge")
                problem = _edge_problem(edge, n, seen)
                if problem:
                    raise ValueError(f"{self.describe()}, iteration {t}{problem}")
                seen.update((r, edge) for r in edge.ranks)
            if len(seen) < n:
                missing = [r for r in range(n) if r not in seen]
                raise ValueError(
                    f"{self.describe()}, iteration {t}: ranks {missing} are in no edge; each "
                    "rank must be in exactly one (a rank that sits out is an edge of its own, "
                    f"Edge(({missing[0]},), 1.0))"
                )
        return tuple(tuple(iteration) for iteration in schedule)

    def _owners(self, iteration: tuple[Edge, ...]) -> list[int]:
        owner = [0] * self.world_size
        for k, edge in enumerate(iteration):
            for r in edge.ranks:
                owner[r] = k
        return owner


def _edge_problem(edge: Edge, n: int, seen: dict[int, Edge]) -> str:
    """What is wrong with ``edge`` among the edges ``seen`` so far, or "" if nothing."""
    where = f", edge {edge.ranks}"
    if not edge.ranks:
        return f"{where}: an edge needs at least one rank"
    if not (math.isfinite(edge.weight) and 0.0 <= edge.weight <= 1.0):
        return f"{where}: weight {edge.weight} is outside [0, 1]"
    for r in edge.ranks:
        if not 0 <= r < n:
            return f"{where}: rank {r} is out of range for world size {n}"
        if edge.ranks.count(r) > 1:
            return f"{where}: rank {r} appears twice in the edge"
        if r in seen:
            return (
                f": rank {r} is in two edges, {seen[r].ranks} and {edge.ranks}; "
                "each rank must be in exactly one"
            )
    return ""

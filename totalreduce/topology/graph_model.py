"""The static-graph model of a topology: one fixed mixing matrix, with neighbor queries.

This module owns :class:`Graph`, the base class of the static weighted directed graphs
(the BlueFog family in ``graph_topologies.py``), and :class:`MatrixGraph`, a graph given
directly by its matrix.  A graph is a topology of period 1: every step uses the same
``W``.  Rank ``j`` is an in-neighbor of ``i`` (``i`` receives from ``j``) when
``W[i, j] > 0`` and ``j != i``; ``i`` is then an out-neighbor of ``j``.

Graphs must be row stochastic (every rank's weights sum to 1); they need not be column
stochastic, but every built-in graph is.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator

import numpy as np

from .mixing import MixingTopology, NeighborPlan, plan_from_matrix

#: How far a row sum may stray from 1 before a graph is refused.
ROW_SUM_TOLERANCE = 1e-9


class Graph(MixingTopology):
    """A static graph: the same mixing matrix at every step.

    Subclasses implement :meth:`_matrix`; they set any attribute it reads before calling
    ``super().__init__(world_size)``, which builds and validates the matrix.
    """

    def __init__(self, world_size: int) -> None:
        super().__init__(world_size)
        w = np.array(self._matrix(), dtype=float)
        self._check(w)
        w.setflags(write=False)
        self._w = w
        n = self.world_size
        self._in = tuple(tuple(int(j) for j in np.flatnonzero(w[i]) if j != i) for i in range(n))
        self._out = tuple(
            tuple(int(i) for i in np.flatnonzero(w[:, j]) if i != j) for j in range(n)
        )
        self._plans: dict[int, NeighborPlan] = {}

    @abc.abstractmethod
    def _matrix(self) -> np.ndarray:
        """The ``world_size`` x ``world_size`` mixing matrix (row i = what i receives)."""

    @property
    def period(self) -> int:
        """Always 1: a static graph."""
        return 1

    @property
    def weights(self) -> np.ndarray:
        """The mixing matrix (read-only)."""
        return self._w

    def matrix(self, step: int = 0) -> np.ndarray:
        """The mixing matrix; ``step`` is accepted for the common interface and ignored."""
        self._phase(step)
        return self._w.copy()

    def plan(self, rank: int, step: int = 0) -> NeighborPlan:
        """The plan of ``rank`` (the same at every step)."""
        self._check_rank(rank)
        self._phase(step)
        p = self._plans.get(rank)
        if p is None:
            p = self._plans[rank] = plan_from_matrix(self._w, rank)
        return NeighborPlan(p.self_weight, dict(p.src_weights), p.dst_ranks)

    def in_neighbors(self, rank: int) -> tuple[int, ...]:
        """The ranks ``rank`` receives from (``W[rank, j] > 0``, ``j != rank``), sorted."""
        self._check_rank(rank)
        return self._in[rank]

    def out_neighbors(self, rank: int) -> tuple[int, ...]:
        """The ranks ``rank`` sends to (``W[i, rank] > 0``, ``i != rank``), sorted."""
        self._check_rank(rank)
        return self._out[rank]

    # ------------------------------------------------------------------ networkx's queries
    # BlueFog's graphs are networkx DiGraphs: an edge j -> i carries W[i, j], and a rank
    # with a non-zero self weight has a self-loop.  These answer what BlueFog's helpers and
    # scripts ask such a graph, with networkx's meanings (a self-loop counts once in the
    # in-degree and once in the out-degree).

    def number_of_nodes(self) -> int:
        """networkx's ``number_of_nodes()``: the world size."""
        return self.world_size

    def number_of_edges(self) -> int:
        """networkx's ``number_of_edges()``: the non-zero weights, self-loops included."""
        return int(np.count_nonzero(self._w))

    def predecessors(self, rank: int) -> Iterator[int]:
        """networkx's ``predecessors(rank)``: the ranks whose value ``rank`` weighs (itself
        too when its own weight is non-zero), ascending."""
        self._check_rank(rank)
        return iter([int(j) for j in np.flatnonzero(self._w[rank])])

    def successors(self, rank: int) -> Iterator[int]:
        """networkx's ``successors(rank)``: the ranks that weigh ``rank``'s value (itself too
        when its own weight is non-zero), ascending."""
        self._check_rank(rank)
        return iter([int(i) for i in np.flatnonzero(self._w[:, rank])])

    def in_degree(self, rank: int) -> int:
        """networkx's ``in_degree(rank)``: the number of :meth:`predecessors`."""
        self._check_rank(rank)
        return int(np.count_nonzero(self._w[rank]))

    def out_degree(self, rank: int) -> int:
        """networkx's ``out_degree(rank)``: the number of :meth:`successors`."""
        self._check_rank(rank)
        return int(np.count_nonzero(self._w[:, rank]))

    def degree(self, rank: int) -> int:
        """networkx's ``degree(rank)`` of a directed graph: in-degree plus out-degree."""
        return self.in_degree(rank) + self.out_degree(rank)

    def _check(self, w: np.ndarray) -> None:
        n = self.world_size
        if w.shape != (n, n):
            raise ValueError(f"{self.describe()}: matrix has shape {w.shape}, expected ({n}, {n})")
        bad = np.argwhere(~np.isfinite(w) | (w < 0.0) | (w > 1.0))
        if len(bad):
            i, j = (int(v) for v in bad[0])
            raise ValueError(f"{self.describe()}: W[{i}, {j}] = {w[i, j]} is outside [0, 1]")
        sums = w.sum(axis=1)
        off = np.flatnonzero(np.abs(sums - 1.0) > ROW_SUM_TOLERANCE)
        if len(off):
            i = int(off[0])
            raise ValueError(
                f"{self.describe()}: row {i} sums to {float(sums[i])!r}, not 1; rank {i}'s weights "
                "(its own and its in-neighbors') must add up to 1"
            )


class MatrixGraph(Graph):
    """A static graph given by its mixing matrix (row i = the weights of what i receives).

    Example::

        g = MatrixGraph([[0.5, 0.5], [0.5, 0.5]])
    """

    def __init__(self, matrix: object) -> None:
        w = np.array(matrix, dtype=float)
        if w.ndim != 2 or w.shape[0] != w.shape[1] or w.shape[0] < 1:
            raise ValueError(f"a mixing matrix must be square and non-empty, got shape {w.shape}")
        self._given = w
        super().__init__(w.shape[0])

    def _matrix(self) -> np.ndarray:
        return self._given

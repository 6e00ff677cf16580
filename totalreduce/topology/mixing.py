"""The common interface of every topology: mixing matrices and per-rank neighbor plans.

This module owns :class:`MixingTopology`, the base both topology families derive from
(the edge model of ``edge_model.py`` and the static graphs of ``graph_model.py``), and
:class:`NeighborPlan`, the one thing the engine needs from a topology to run one step of
neighbor averaging on one rank.  The free functions :func:`plan` and
:func:`mixing_matrix` are the entry points the engine and the analysis use, whatever the
family.
"""

from __future__ import annotations

import abc
import inspect
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np


@dataclass(frozen=True)
class NeighborPlan:
    """One rank's part of one step of neighbor averaging.

    The rank replaces its value by ``self_weight * x_self + sum(w * x_j for j, w in
    src_weights.items())``, which is row ``rank`` of the step's mixing matrix applied to
    the vector of all ranks' values.  It sends its own (pre-step) value to every rank in
    ``dst_ranks``; these are exactly the ranks whose plan lists this rank in
    ``src_weights``, so the sends and receives of all ranks match one to one.  Ranks with a
    zero weight are left out of both, so nothing is sent only to be multiplied by zero.

    Example::

        p = plan(get_topology("ring", 4), rank=1, step=0)
        # NeighborPlan(self_weight=0.5, src_weights={0: 0.5}, dst_ranks=(0,))
    """

    self_weight: float
    src_weights: dict[int, float] = field(default_factory=dict)
    dst_ranks: tuple[int, ...] = ()

    @property
    def src_ranks(self) -> tuple[int, ...]:
        """The ranks this rank receives from, in increasing order."""
        return tuple(sorted(self.src_weights))


class MixingTopology(abc.ABC):
    """A periodic sequence of mixing matrices over ``world_size`` ranks.

    Step ``t`` uses matrix ``W(t mod period)``; row ``i`` of it holds the weights rank
    ``i`` applies to the values it receives (see the package docstring).  Subclasses give
    :attr:`period` and :meth:`matrix`; they may override :meth:`plan` with something
    cheaper than building the whole matrix.
    """

    #: The name the class is registered under (set by ``register``); empty if none.
    name: ClassVar[str] = ""

    def __init__(self, world_size: int) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, (int, np.integer)):
            raise TypeError(f"world_size must be an int, got {world_size!r}")
        if world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {world_size}")
        self._world_size = int(world_size)

    @property
    def world_size(self) -> int:
        """The number of ranks."""
        return self._world_size

    @property
    @abc.abstractmethod
    def period(self) -> int:
        """The number of steps after which the matrices repeat (at least 1)."""

    @abc.abstractmethod
    def matrix(self, step: int) -> np.ndarray:
        """The ``world_size`` x ``world_size`` mixing matrix of ``step`` (a new array)."""

    def plan(self, rank: int, step: int) -> NeighborPlan:
        """What ``rank`` receives, with which weights, and whom it sends to at ``step``."""
        self._check_rank(rank)
        return plan_from_matrix(self.matrix(step), rank)

    def _check_rank(self, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)):
            raise TypeError(f"rank must be an int, got {rank!r}")
        if not 0 <= rank < self._world_size:
            raise ValueError(
                f"rank {rank} is out of range for {self.describe()} "
                f"(ranks 0..{self._world_size - 1})"
            )

    def _phase(self, step: int) -> int:
        """The index within the period of ``step``; refuses negative steps."""
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
            raise TypeError(f"step must be an int, got {step!r}")
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step} for {self.describe()}")
        return int(step) % self.period

    def describe(self) -> str:
        """A short human description: name (or class), options and world size."""
        label = self.name or type(self).__name__
        options = ", ".join(f"{k}={v!r}" for k, v in self.options().items())
        with_options = f" ({options})" if options else ""
        return f"topology {label!r}{with_options} with world size {self._world_size}"

    def options(self) -> dict[str, object]:
        """The options of this topology's class (its parameters after the world size that
        it keeps as attributes of the same name), with the values it was built with."""
        params = list(inspect.signature(type(self)).parameters.values())[1:]
        mine = vars(self)
        return {
            p.name: mine[p.name]
            for p in params
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name in mine
        }

    def __repr__(self) -> str:
        return f"<{type(self).__name__}: {self.describe()}, period {self.period}>"


def plan_from_matrix(matrix: np.ndarray, rank: int) -> NeighborPlan:
    """The :class:`NeighborPlan` of ``rank`` read off a mixing matrix.

    Sources are the non-zero off-diagonal entries of row ``rank``; destinations are the
    non-zero off-diagonal entries of column ``rank`` (the ranks that will weigh this
    rank's value).
    """
    row = matrix[rank]
    col = matrix[:, rank]
    src = {int(j): float(row[j]) for j in np.flatnonzero(row) if j != rank}
    dst = tuple(int(j) for j in np.flatnonzero(col) if j != rank)
    return NeighborPlan(self_weight=float(row[rank]), src_weights=src, dst_ranks=dst)


def plan(topology: MixingTopology, rank: int, step: int) -> NeighborPlan:
    """The :class:`NeighborPlan` of ``rank`` at ``step`` for any topology.

    Example::

        topo = get_topology("exponential-2", 8)
        p = plan(topo, rank=0, step=0)
        # p.src_weights == {4: 0.25, 6: 0.25, 7: 0.25}, p.dst_ranks == (1, 2, 4)
    """
    _require_topology(topology)
    return topology.plan(rank, step)


def mixing_matrix(topology: MixingTopology, step: int) -> np.ndarray:
    """The mixing matrix ``W(step)`` of any topology (a static graph ignores ``step``)."""
    _require_topology(topology)
    return topology.matrix(step)


def _require_topology(topology: object) -> None:
    if not isinstance(topology, MixingTopology):
        raise TypeError(
            f"expected a topology (use get_topology(name, world_size)), got {topology!r}"
        )

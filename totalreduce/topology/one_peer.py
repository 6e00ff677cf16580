"""One-peer dynamic topologies derived from a static graph.

This module owns :class:`OnePeerGraph`, :func:`one_peer_dynamic` and
:func:`one_peer_matrix`.  At step ``t`` each rank sends to only one of its out-neighbors,
taking them in turn: the out-neighbors of rank ``i`` are ordered clockwise from ``i``
(by ``(j - i) mod n``) and step ``t`` uses the one at index ``t mod outdegree(i)``.  A rank
receives from every rank that sends to it at that step, and averages itself and what it
received with equal weights, ``1 / (received + 1)``: 1/2 and 1/2 when it receives from one
rank.

On a circulant graph (exponential, ring, fully connected...) every rank uses the same
offset at each step, so every rank receives from exactly one rank and each step's matrix
is doubly stochastic; from ``exponential-2`` this gives the one-peer exponential-2 graph,
which averages exactly in ``log2 n`` steps when ``n`` is a power of two.  On other graphs
(star, mesh) a rank may receive from several ranks or from none, and the matrices are
row stochastic only.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np

from .graph_model import Graph
from .mixing import MixingTopology, NeighborPlan

#: How many phases' receive lists a OnePeerGraph keeps.
_CACHED_PHASES = 256


class OnePeerGraph(MixingTopology):
    """The one-peer dynamic topology of a static ``graph`` (see the module docstring).

    The period is the least common multiple of the out-degrees (1 if no rank sends).
    A rank without out-neighbors never sends.

    Example::

        topo = OnePeerGraph(get_topology("exponential-2", 8))
        topo.sends(0, 2), topo.receives(0, 2)   # ([4], [4])
    """

    def __init__(self, graph: Graph) -> None:
        if not isinstance(graph, Graph):
            raise TypeError(
                "one-peer rotation needs a static graph (a Graph, e.g. "
                f"get_topology('exponential-2', n)), got {graph!r}"
            )
        super().__init__(graph.world_size)
        self.graph = graph
        n = graph.world_size
        self._targets = tuple(_clockwise(graph.out_neighbors(i), i, n) for i in range(n))
        self._period = math.lcm(*(max(len(t), 1) for t in self._targets))
        self._receivers: dict[int, tuple[tuple[int, ...], ...]] = {}

    @property
    def period(self) -> int:
        """The least common multiple of the out-degrees."""
        return self._period

    def describe(self) -> str:
        """A short human description naming the underlying graph."""
        return f"one-peer dynamic {self.graph.describe()}"

    def sends(self, rank: int, step: int) -> list[int]:
        """The rank ``rank`` sends to at ``step`` (empty if it has no out-neighbor)."""
        self._check_rank(rank)
        return self._send(rank, self._phase(step))

    def receives(self, rank: int, step: int) -> list[int]:
        """The ranks that send to ``rank`` at ``step``, sorted."""
        self._check_rank(rank)
        return list(self._received(self._phase(step))[rank])

    def matrix(self, step: int) -> np.ndarray:
        """``W(step)``: each rank averages itself and the ranks it receives from."""
        received = self._received(self._phase(step))
        n = self.world_size
        w = np.zeros((n, n))
        for i in range(n):
            weight = 1.0 / (len(received[i]) + 1)
            w[i, i] = weight
            w[i, list(received[i])] = weight
        return w

    def plan(self, rank: int, step: int) -> NeighborPlan:
        """The plan of ``rank`` at ``step``: receive from the senders, send to one peer."""
        src = self.receives(rank, step)
        weight = 1.0 / (len(src) + 1)
        return NeighborPlan(
            self_weight=weight,
            src_weights={j: weight for j in src},
            dst_ranks=tuple(self.sends(rank, step)),
        )

    def _received(self, phase: int) -> tuple[tuple[int, ...], ...]:
        """For each rank, the ranks sending to it at ``phase`` (computed once per phase)."""
        cached = self._receivers.get(phase)
        if cached is None:
            lists: list[list[int]] = [[] for _ in range(self.world_size)]
            for j in range(self.world_size):
                for i in self._send(j, phase):
                    lists[i].append(j)
            cached = tuple(tuple(r) for r in lists)
            if len(self._receivers) >= _CACHED_PHASES:
                # The period is an lcm of degrees and can be huge: keep the cache bounded.
                self._receivers.clear()
            self._receivers[phase] = cached
        return cached

    def _send(self, rank: int, phase: int) -> list[int]:
        targets = self._targets[rank]
        return [targets[phase % len(targets)]] if targets else []


def _clockwise(ranks: tuple[int, ...], origin: int, n: int) -> tuple[int, ...]:
    """``ranks`` ordered by their distance clockwise from ``origin``, ``(r - origin) mod n``."""
    return tuple(sorted(ranks, key=lambda r: (r - origin) % n))


def one_peer_dynamic(graph: Graph, rank: int) -> Iterator[tuple[list[int], list[int]]]:
    """Yield ``(send_to, recv_from)`` of ``rank`` for steps 0, 1, 2, ... forever.

    ``send_to`` holds the one out-neighbor used at that step (none if ``rank`` has no
    out-neighbor); ``recv_from`` the ranks that send to ``rank`` at that step.  The
    matching weights are ``1 / (len(recv_from) + 1)`` for the rank itself and for each
    received value (see :func:`one_peer_matrix`).

    Example::

        gen = one_peer_dynamic(get_topology("exponential-2", 8), rank=0)
        next(gen)   # ([1], [7])
        next(gen)   # ([2], [6])
        next(gen)   # ([4], [4])
    """
    topo = OnePeerGraph(graph)
    topo._check_rank(rank)
    return _rotate(topo, rank)


def _rotate(topo: OnePeerGraph, rank: int) -> Iterator[tuple[list[int], list[int]]]:
    step = 0
    while True:
        yield topo.sends(rank, step), topo.receives(rank, step)
        step += 1


def one_peer_matrix(graph: Graph, step: int) -> np.ndarray:
    """The whole world's one-peer mixing matrix of ``graph`` at ``step``.

    Row ``i`` gives ``1 / (r + 1)`` to rank ``i`` and to each of the ``r`` ranks that send
    to it at ``step``: 1/2 self and 1/2 the received neighbor when ``r == 1``, as on every
    circulant graph.
    """
    return OnePeerGraph(graph).matrix(step)

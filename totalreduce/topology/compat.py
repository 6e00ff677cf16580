"""BlueFog's ``topology_util`` names and Decent-DP's registration, on this package's classes.

Pure code.  With ``from totalreduce import topology as topology_util`` a BlueFog script's
``topology_util.RingGraph(n)``, ``GetDynamicSendRecvRanks(topo, rank)``,
``GetRecvWeights(topo, rank)`` ... run unchanged; with ``from totalreduce.topology import
TopologyReg, Topology`` a Decent-DP topology registers as its documentation writes it::

    @TopologyReg.register("my-ring")
    class MyRing(Topology):
        def _get_topo_edges(self):
            n = self._world_size
            ...
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TypeVar

import numpy as np

from .graph_model import Graph
from .mixing import MixingTopology, mixing_matrix, plan
from .one_peer import one_peer_dynamic
from .registry import register

T = TypeVar("T", bound=type[MixingTopology])


def GetDynamicSendRecvRanks(topo: Graph, self_rank: int) -> Iterator[tuple[list[int], list[int]]]:  # noqa: N802
    """BlueFog's one-peer dynamic schedule: yields ``(send_ranks, recv_ranks)`` per step."""
    return one_peer_dynamic(topo, self_rank)


def GetRecvWeights(topo: MixingTopology, rank: int) -> tuple[float, dict[int, float]]:  # noqa: N802
    """``(self_weight, {source: weight})`` of what ``rank`` receives (step 0)."""
    p = plan(topo, rank, 0)
    return p.self_weight, dict(p.src_weights)


def GetSendWeights(topo: MixingTopology, rank: int) -> tuple[float, dict[int, float]]:  # noqa: N802
    """``(self_weight, {destination: weight})``: the weight each out-neighbor gives what
    ``rank`` sends (step 0), as BlueFog's ``GetSendWeights``."""
    w = mixing_matrix(topo, 0)
    dst = {int(i): float(w[i, rank]) for i in np.nonzero(w[:, rank])[0] if i != rank}
    return float(w[rank, rank]), dst


def IsRegularGraph(topo: MixingTopology) -> bool:  # noqa: N802
    """Whether every rank has the same number of in-neighbors (step 0)."""
    w = mixing_matrix(topo, 0) != 0
    np.fill_diagonal(w, False)
    degrees = w.sum(axis=1)
    return bool((degrees == degrees[0]).all())


def IsTopologyEquivalent(topo1: MixingTopology, topo2: MixingTopology) -> bool:  # noqa: N802
    """Whether two topologies have the same mixing matrix (step 0)."""
    if topo1 is None or topo2 is None:
        return False
    a, b = mixing_matrix(topo1, 0), mixing_matrix(topo2, 0)
    return a.shape == b.shape and bool(np.allclose(a, b))


class TopologyReg:
    """Decent-DP's registry: ``@TopologyReg.register(name)`` on a :class:`Topology`."""

    @staticmethod
    def register(name: str) -> Callable[[T], T]:
        """The class decorator (the same registry as :func:`register`)."""
        return register(name)

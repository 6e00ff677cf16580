"""Topologies for neighbor averaging: graphs, mixing matrices and consensus rates.

Pure code (numpy only; matplotlib only to draw): no MPI, no threads, no torch.

Convention.  One step of neighbor averaging over ``n`` ranks is ``x <- W x`` with the
``n`` x ``n`` mixing matrix ``W``: row ``i`` holds the weights rank ``i`` gives to the
values it receives, ``x_i <- sum_j W[i, j] x_j``.  ``W[i, j] > 0`` with ``j != i`` means
``j`` sends to ``i``.  (BlueFog's networkx graphs store the transpose: their edge
``j -> i`` carries ``W[i, j]``.)  Step ``t`` of a topology uses ``W(t mod period)``.

Two families share one interface, :class:`MixingTopology`:

- the edge model (``edge_model.py``, from Decent-DP): per iteration, a partition of the
  ranks into :class:`Edge` groups that average together -- ``complete``, ``ring``,
  ``exp``, ``alternating-exp-ring``;
- static graphs (``graph_model.py``, from BlueFog), period 1 -- ``exponential-2``,
  ``exponential``, ``symmetric-exponential``, ``mesh-grid-2d``, ``star``,
  ``ring-graph``, ``fully-connected`` -- and the one-peer dynamic topology built from any
  of them (``one_peer.py``).

BlueFog's ``topology_util`` is this package too (``from totalreduce import topology as
topology_util``): the graph classes take BlueFog's arguments, and ``bluefog.py`` has its
predicates, weights and dynamic send/receive schedules.

The engine needs only :func:`plan` (what one rank receives, with which weights, and
whom it sends to, at one step) and :func:`get_topology`; :func:`mixing_matrix` and the
functions of ``analysis.py`` serve tests, tuning and the ``totalreduce topology``
command.

Example::

    from totalreduce.topology import get_topology, plan, rho_period

    topo = get_topology("exp", 8)
    plan(topo, rank=3, step=0)   # NeighborPlan(0.5, {2: 0.5}, (2,))
    rho_period(topo)             # 0.0: exact average after log2(8) steps
"""

from __future__ import annotations

from .analysis import (
    is_column_stochastic,
    is_doubly_stochastic,
    is_row_stochastic,
    period_matrix,
    rho,
    rho_period,
    spectral_gap,
)
from .bluefog import (
    GetDynamicOnePeerSendRecvRanks,
    GetDynamicSendRecvRanks,
    GetExp2DynamicSendRecvMachineRanks,
    GetInnerOuterExpo2DynamicSendRecvRanks,
    GetInnerOuterRingDynamicSendRecvRanks,
    GetRecvWeights,
    GetSendWeights,
    IsRegularGraph,
    IsTopologyEquivalent,
    from_networkx,
    isPowerOf,
)
from .compat import TopologyReg
from .edge_model import Edge, Topology
from .edge_topologies import (
    AlternatingExpRingTopology,
    CompleteTopology,
    OnePeerExpTopology,
    OnePeerRingTopology,
)
from .graph_model import Graph, MatrixGraph
from .graph_topologies import (
    ExponentialGraph,
    ExponentialTwoGraph,
    FullyConnectedGraph,
    MeshGrid2DGraph,
    RingGraph,
    StarGraph,
    SymmetricExponentialGraph,
)
from .mixing import MixingTopology, NeighborPlan, mixing_matrix, plan
from .one_peer import OnePeerGraph, one_peer_dynamic, one_peer_matrix
from .registry import get_topology, known_topologies, register, topology_options

__all__ = [
    "GetDynamicOnePeerSendRecvRanks",
    "GetDynamicSendRecvRanks",
    "GetExp2DynamicSendRecvMachineRanks",
    "GetInnerOuterExpo2DynamicSendRecvRanks",
    "GetInnerOuterRingDynamicSendRecvRanks",
    "GetRecvWeights",
    "GetSendWeights",
    "IsRegularGraph",
    "IsTopologyEquivalent",
    "TopologyReg",
    "AlternatingExpRingTopology",
    "CompleteTopology",
    "Edge",
    "ExponentialGraph",
    "ExponentialTwoGraph",
    "FullyConnectedGraph",
    "Graph",
    "MatrixGraph",
    "MeshGrid2DGraph",
    "MixingTopology",
    "NeighborPlan",
    "OnePeerExpTopology",
    "OnePeerGraph",
    "OnePeerRingTopology",
    "RingGraph",
    "StarGraph",
    "SymmetricExponentialGraph",
    "Topology",
    "from_networkx",
    "get_topology",
    "isPowerOf",
    "is_column_stochastic",
    "is_doubly_stochastic",
    "is_row_stochastic",
    "known_topologies",
    "mixing_matrix",
    "one_peer_dynamic",
    "one_peer_matrix",
    "period_matrix",
    "plan",
    "register",
    "rho",
    "rho_period",
    "spectral_gap",
    "topology_options",
]

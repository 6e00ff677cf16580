"""BlueFog's module-level topology: ``set_topology``, ``load_topology``, neighbor ranks.

``import totalreduce.torch as bf`` then runs BlueFog's own snippets::

    bf.init()
    bf.set_topology(topology_util.RingGraph(bf.size()))   # topology_util: totalreduce.topology
    x = bf.neighbor_allreduce(x)                          # averages over the ring

The topology set here is what ``neighbor_allreduce`` uses when a call names no topology
and no dynamic weights; without one, the engine's default (``exponential-2``) holds.
"""

from __future__ import annotations

import threading
from typing import Any

from ..api import rank as _rank
from ..api import size as _size
from ..errors import InvalidArgumentError
from ..topology import ExponentialTwoGraph, MixingTopology, get_topology, plan

_lock = threading.Lock()
_state: dict[str, Any] = {"topology": None, "weighted": False}


def set_topology(topology: Any = None, is_weighted: bool = False) -> bool:
    """Make ``topology`` (a :mod:`totalreduce.topology` object or name; default BlueFog's,
    the exponential-2 graph over every rank) the default of ``neighbor_allreduce``.
    Returns True, as BlueFog's does when the topology changed."""
    n = _size()
    if topology is None:
        topology = ExponentialTwoGraph(n)
    elif isinstance(topology, str):
        topology = get_topology(topology, n)
    if not isinstance(topology, MixingTopology):
        raise InvalidArgumentError(
            f"set_topology: {topology!r} is not a topology (use totalreduce.topology's "
            "RingGraph(n), ExponentialTwoGraph(n), ... or a name)"
        )
    if topology.world_size != n:
        raise InvalidArgumentError(
            f"set_topology: the topology has {topology.world_size} ranks but the world has {n}"
        )
    with _lock:
        _state["topology"], _state["weighted"] = topology, bool(is_weighted)
    return True


def load_topology() -> MixingTopology:
    """The topology ``set_topology`` set (BlueFog's default if none was set)."""
    with _lock:
        topo = _state["topology"]
    return topo if topo is not None else ExponentialTwoGraph(_size())


def current_topology() -> MixingTopology | None:
    """The topology ``set_topology`` set, or None."""
    with _lock:
        return _state["topology"]  # type: ignore[no-any-return]


def is_topo_weighted() -> bool:
    """Whether ``set_topology`` was told the topology's weights are to be used."""
    with _lock:
        return bool(_state["weighted"])


def in_neighbor_ranks() -> list[int]:
    """The ranks this rank receives from (first step of the topology)."""
    return sorted(plan(load_topology(), _rank(), 0).src_weights)


def out_neighbor_ranks() -> list[int]:
    """The ranks this rank sends to (first step of the topology)."""
    return sorted(plan(load_topology(), _rank(), 0).dst_ranks)


# ---------------------------------------------------------------- BlueFog's other spellings


def machine_rank() -> int:
    """BlueFog's machine (node) index of this rank: ``cross_rank()`` (its nodes run as many
    ranks each, as BlueFog requires)."""
    from ..api import cross_rank

    return cross_rank()


def machine_size() -> int:
    """BlueFog's number of machines (nodes): ``cross_size()``."""
    from ..api import cross_size

    return cross_size()

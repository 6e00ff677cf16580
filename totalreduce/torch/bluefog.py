"""BlueFog's module-level topologies: ``set_topology``, ``set_machine_topology``, neighbor ranks.

``import totalreduce.torch as bf`` then runs BlueFog's own snippets::

    bf.init()
    bf.set_topology(topology_util.RingGraph(bf.size()))   # topology_util: totalreduce.topology
    x = bf.neighbor_allreduce(x)                          # averages over the ring

The topology set here is what ``neighbor_allreduce`` uses when a call names no topology
and no destinations; without one, BlueFog's default (the exponential-2 graph over every
rank) holds.  With BlueFog's meanings:

- no weights: every out-neighbor is sent to, and the rank averages itself and its
  in-neighbors with equal weights, ``1 / (indegree + 1)``, unless ``set_topology(...,
  is_weighted=True)`` asked for the graph's own weights;
- ``self_weight`` and ``src_weights`` alone: sent to every out-neighbor, the in-neighbors
  weighed as given (those left out by 0);
- ``dst_weights`` too: a dynamic step, exactly as given.

A networkx DiGraph, BlueFog's own kind of topology (edge ``j -> i`` weighted by what ``i``
gives ``j``'s value), is taken too: with its weights under ``is_weighted=True`` (each rank's
must add up to 1), else only its edges count.

The machine topology (``set_machine_topology``) is the default of
``hierarchical_neighbor_allreduce``: a topology over the ``machine_size()`` machines, each
of ``local_size()`` consecutive ranks, as BlueFog lays them out.
"""

from __future__ import annotations

import threading
from typing import Any

from ..api import default_service
from ..errors import InvalidArgumentError, TotalReduceError
from ..topology import ExponentialTwoGraph, Graph, MixingTopology, get_topology, plan
from ..topology.bluefog import from_networkx, is_networkx_graph

_lock = threading.Lock()
#: What set_topology and set_machine_topology set, for the service they set it on: a new
#: ``init()`` after ``shutdown()`` starts without them, as BlueFog's shutdown forgets them.
_state: dict[str, Any] = {
    "service": None,
    "topology": None,
    "weighted": False,
    "machine_topology": None,
    "machine_weighted": False,
}


def _mine(key: str) -> Any:
    """``_state[key]`` when it was set on the running service (caller holds ``_lock``)."""
    if _state["service"] is not default_service():
        return None
    return _state[key]


def _keep(**values: Any) -> None:
    """Set ``values`` for the running service (caller holds ``_lock``)."""
    svc = default_service()
    if _state["service"] is not svc:
        _state.update(
            service=svc, topology=None, weighted=False, machine_topology=None,
            machine_weighted=False,
        )  # fmt: skip
    _state.update(values)


def _checked(
    topology: Any, n: int, what: str, default: bool, weighted: bool = True
) -> MixingTopology:
    if is_networkx_graph(topology):  # BlueFog's own kind of topology
        try:
            topology = from_networkx(topology, weighted=weighted)
        except (TypeError, ValueError) as exc:
            raise InvalidArgumentError(f"{what}: {exc}") from None
    if topology is None and default:
        topology = ExponentialTwoGraph(n)
    elif isinstance(topology, str):
        try:
            topology = get_topology(topology, n)
        except ValueError as exc:
            raise InvalidArgumentError(f"{what}: {exc}") from None
    if not isinstance(topology, MixingTopology):
        raise InvalidArgumentError(
            f"{what}: {topology!r} is not a topology (use totalreduce.topology's "
            "RingGraph(n), ExponentialTwoGraph(n), ... or a name)"
        )
    if topology.world_size != n:
        unit = "machines" if "machine" in what else "ranks"
        raise InvalidArgumentError(
            f"{what}: the topology has {topology.world_size} nodes but there are {n} {unit}"
        )
    return topology


def set_topology(topology: Any = None, is_weighted: bool = False) -> bool:
    """Make ``topology`` (a :mod:`totalreduce.topology` object or name; default BlueFog's,
    the exponential-2 graph over every rank) the default of ``neighbor_allreduce`` and of
    the windows created after it.  ``is_weighted``: average with the graph's own weights
    (default: equal weights over each rank and its in-neighbors, as BlueFog).  Returns
    True, as BlueFog's does when the topology is set."""
    topology = _checked(
        topology, default_service().size, "set_topology", default=True, weighted=is_weighted
    )
    with _lock:
        _keep(topology=topology, weighted=bool(is_weighted))
    return True


def load_topology() -> MixingTopology:
    """The topology ``set_topology`` set (BlueFog's default if none was set)."""
    with _lock:
        topo = _mine("topology")
    return topo if topo is not None else ExponentialTwoGraph(default_service().size)


def current_topology() -> MixingTopology | None:
    """The topology ``set_topology`` set, or None."""
    with _lock:
        return _mine("topology")  # type: ignore[no-any-return]


def is_topo_weighted() -> bool:
    """Whether ``set_topology`` was told the topology's weights are to be used."""
    with _lock:
        return bool(_mine("weighted"))


def in_neighbor_ranks() -> list[int]:
    """The ranks this rank receives from (first step of the topology), ascending; never
    itself."""
    return sorted(plan(load_topology(), default_service().rank, 0).src_weights)


def out_neighbor_ranks() -> list[int]:
    """The ranks this rank sends to (first step of the topology), ascending; never itself."""
    return sorted(plan(load_topology(), default_service().rank, 0).dst_ranks)


def neighbor_defaults(call: dict[str, Any], service: Any) -> None:
    """Fill a ``neighbor_allreduce`` call that names no topology with BlueFog's defaults
    (see the module docstring): the topology ``set_topology`` set, and, with no weights on
    an unweighted static graph, equal weights over the rank and its in-neighbors."""
    given = (call["self_weight"], call["src_weights"], call["dst_weights"])
    if given[2] is not None:
        return  # dynamic: exactly as given
    topo = current_topology()
    if given[0] is not None or given[1] is not None:
        call["topology"] = topo if topo is not None else ExponentialTwoGraph(service.size)
        return
    if topo is None:
        return  # the engine's default: exponential-2, equal weights already
    call["topology"] = topo
    if isinstance(topo, Graph) and not is_topo_weighted():
        sources = plan(topo, service.rank, 0).src_weights
        weight = 1.0 / (len(sources) + 1)
        call["self_weight"] = weight
        call["src_weights"] = dict.fromkeys(sources, weight)


# ---------------------------------------------------------------- machines


def _layout() -> tuple[int, int, int]:
    """(rank, local_size, machine count) of this rank; TotalReduceError on uneven nodes."""
    svc = default_service()
    local_size = svc.node_layout()[1]
    if svc.size % local_size or svc.node_layout()[3] * local_size != svc.size:
        raise TotalReduceError(
            f"machine_rank(), machine_size() and the machine topology need every node to run "
            f"as many ranks (BlueFog's homogeneous layout); this node runs {local_size} of "
            f"{svc.size}"
        )
    return svc.rank, local_size, svc.size // local_size


def machine_rank() -> int:
    """BlueFog's machine index of this rank: ``rank() // local_size()`` (machines hold
    consecutive ranks, as many each)."""
    rank, local_size, _ = _layout()
    return rank // local_size


def machine_size() -> int:
    """BlueFog's number of machines: ``size() // local_size()``."""
    return _layout()[2]


def set_machine_topology(topology: Any, is_weighted: bool = False) -> bool:
    """Make ``topology``, over the ``machine_size()`` machines, the default of
    ``hierarchical_neighbor_allreduce``; ``is_weighted``: use its weights (default: equal
    weights over the machine and its in-neighbor machines).  Returns True."""
    if topology is None:
        raise InvalidArgumentError("set_machine_topology: the machine topology must not be None")
    topology = _checked(
        topology, machine_size(), "set_machine_topology", default=False, weighted=is_weighted
    )
    with _lock:
        _keep(machine_topology=topology, machine_weighted=bool(is_weighted))
    return True


def load_machine_topology() -> MixingTopology | None:
    """The machine topology ``set_machine_topology`` set, or None (as BlueFog's)."""
    with _lock:
        return _mine("machine_topology")  # type: ignore[no-any-return]


def is_machine_topo_weighted() -> bool:
    """Whether ``set_machine_topology`` was told the topology's weights are to be used."""
    with _lock:
        return bool(_mine("machine_weighted"))


def in_neighbor_machine_ranks() -> list[int]:
    """The machines this rank's machine receives from, ascending (none without a machine
    topology); never its own."""
    topo = load_machine_topology()
    if topo is None:
        return []
    return sorted(plan(topo, machine_rank(), 0).src_weights)


def out_neighbor_machine_ranks() -> list[int]:
    """The machines this rank's machine sends to, ascending (none without a machine
    topology); never its own."""
    topo = load_machine_topology()
    if topo is None:
        return []
    return sorted(plan(topo, machine_rank(), 0).dst_ranks)

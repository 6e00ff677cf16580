"""BlueFog's ``topology_util``: its predicates, weights and dynamic send/receive schedules.

Pure code.  ``from totalreduce import topology as topology_util`` stands in for
``from bluefog.common import topology_util``: every name of BlueFog's module is in this
package (the graph classes in ``graph_topologies.py``, the rest here), with BlueFog's
arguments and meanings.  BlueFog's graphs are networkx DiGraphs whose edge ``j -> i``
carries what this package writes ``W[i, j]``; the answers below are BlueFog's, and each
function here also takes such a networkx graph (:func:`from_networkx`).

The generators yield ``(send_ranks, recv_ranks)``, two lists, per step, forever: at step
``t`` this rank sends to ``send_ranks`` and receives from ``recv_ranks``, and every rank's
lists agree with the others' (rank ``a`` sends to ``b`` exactly when ``b`` receives from
``a``).  BlueFog's examples weigh them ``1 / (len(recv_ranks) + 1)`` each:

    gen = topology_util.GetDynamicOnePeerSendRecvRanks(bf.load_topology(), bf.rank())
    send, recv = next(gen)
    x = bf.neighbor_allreduce(x, self_weight=1 / (len(recv) + 1),
                              src_weights={r: 1 / (len(recv) + 1) for r in recv},
                              dst_weights=send)

The three machine-aware generators place ranks as BlueFog does: machine ``m`` holds ranks
``m * local_size .. m * local_size + local_size - 1`` (every machine as many).  Arguments
they cannot serve raise ValueError at the call (BlueFog's assertions fire at the first
``next``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from .graph_model import Graph, MatrixGraph
from .mixing import MixingTopology, mixing_matrix, plan
from .one_peer import OnePeerGraph

#: The longest period :func:`IsTopologyEquivalent` compares step by step (dynamic topologies).
EQUIVALENCE_STEPS = 4096

SendRecv = tuple[list[int], list[int]]


def _topology(topo: object, what: str) -> MixingTopology:
    if is_networkx_graph(topo):
        return from_networkx(topo)
    if not isinstance(topo, MixingTopology):
        raise TypeError(
            f"{what} takes a topology of totalreduce.topology (RingGraph(n), "
            f"ExponentialTwoGraph(n), get_topology(name, n), ...), got {topo!r}"
        )
    return topo


def is_networkx_graph(obj: object) -> bool:
    """Whether ``obj`` looks like a networkx directed graph (what BlueFog's topologies are)."""
    return (
        not isinstance(obj, MixingTopology)
        and callable(getattr(obj, "number_of_nodes", None))
        and callable(getattr(obj, "edges", None))
        and callable(getattr(obj, "is_directed", None))
    )


def from_networkx(graph: object, weighted: bool = True) -> MatrixGraph:
    """A topology built with networkx, as BlueFog's are, as a :class:`MatrixGraph`.

    ``graph`` is a directed graph on the nodes ``0 .. n-1`` whose edge ``j -> i`` carries
    the weight rank ``i`` gives ``j``'s value (its ``"weight"``, 1 without one): ``W[i, j]``.
    With ``weighted`` each rank's weights, its self-loop's included, must add up to 1 (as
    ``nx.from_numpy_array`` of BlueFog's matrices gives them); without, only the edges count
    and each rank weighs itself and its in-neighbors equally, as BlueFog does when a
    topology is set without ``is_weighted``.  networkx itself is not imported here.
    """
    if not is_networkx_graph(graph):
        raise TypeError(f"from_networkx takes a networkx directed graph, got {graph!r}")
    g: Any = graph
    if not g.is_directed():
        raise TypeError(
            "from_networkx takes a directed graph (networkx.DiGraph, as BlueFog's topologies "
            "are); an undirected one has no direction for who sends to whom"
        )
    n = int(g.number_of_nodes())
    nodes = sorted(g.nodes())
    if nodes != list(range(n)):
        raise ValueError(
            f"from_networkx: the graph's nodes must be the ranks 0..{n - 1}, got {nodes[:8]}..."
        )
    w = np.zeros((n, n))
    for src, dst, weight in g.edges(data="weight", default=1.0):
        w[int(dst), int(src)] = float(weight)
    if not weighted:
        links = w != 0
        np.fill_diagonal(links, True)
        w = links / links.sum(axis=1, keepdims=True)
    return MatrixGraph(w)


def _int(value: object, what: str, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{what} must be an int, got {value!r}")
    if value < least:
        raise ValueError(f"{what} must be at least {least}, got {value}")
    return int(value)


def _floor_log2(k: int) -> int:
    """``floor(log2(k))`` for ``k >= 1``, exactly."""
    return k.bit_length() - 1


# ---------------------------------------------------------------- predicates and weights


def isPowerOf(x: int, base: int) -> bool:  # noqa: N802 (BlueFog's name)
    """Whether ``x`` is ``base**k`` for some ``k >= 0`` (so 1 is a power of every base).

    BlueFog's helper of the exponential graphs; this one decides in integer arithmetic
    (BlueFog's, through ``math.log``, answers False for 243 with base 3, for example).
    """
    b = _int(base, "isPowerOf: base", 2)
    v = _int(x, "isPowerOf: x", 1)
    while v % b == 0:
        v //= b
    return v == 1


def GetRecvWeights(topo: MixingTopology, rank: int) -> tuple[float, dict[int, float]]:  # noqa: N802
    """``(self_weight, {source: weight})``: the weights ``rank`` gives itself and each rank it
    receives from (ascending), as BlueFog's ``GetRecvWeights``; 0.0 for itself when it has no
    weight of its own.  A dynamic topology answers for its first step."""
    p = plan(_topology(topo, "GetRecvWeights"), rank, 0)
    return p.self_weight, dict(sorted(p.src_weights.items()))


def GetSendWeights(topo: MixingTopology, rank: int) -> tuple[float, dict[int, float]]:  # noqa: N802
    """``(self_weight, {destination: weight})``: the weight ``rank`` gives itself and the
    weight each rank it sends to gives its value (ascending), as BlueFog's
    ``GetSendWeights``.  A dynamic topology answers for its first step."""
    t = _topology(topo, "GetSendWeights")
    t._check_rank(rank)
    w = mixing_matrix(t, 0)
    dst = {int(i): float(w[i, rank]) for i in np.flatnonzero(w[:, rank]) if i != rank}
    return float(w[rank, rank]), dst


def IsRegularGraph(topo: MixingTopology) -> bool:  # noqa: N802
    """Whether every rank has the same degree, as BlueFog's ``IsRegularGraph``: networkx's
    degree of a directed graph, in-neighbors plus out-neighbors, a rank's own non-zero
    weight counting once in each.  A dynamic topology answers for its first step."""
    w = mixing_matrix(_topology(topo, "IsRegularGraph"), 0) != 0
    degrees = w.sum(axis=0) + w.sum(axis=1)
    return bool((degrees == degrees[0]).all())


def IsTopologyEquivalent(topo1: object, topo2: object) -> bool:  # noqa: N802
    """Whether two topologies have the same weights, as BlueFog's ``IsTopologyEquivalent``:
    the same world size, the same number of edges and exactly the same mixing matrix (not
    an isomorphism).  None on either side is never equivalent.

    Dynamic topologies are equivalent when their periods and every step's matrix agree;
    one with a period above :data:`EQUIVALENCE_STEPS` raises ValueError.
    """
    if topo1 is None or topo2 is None:
        return False
    a = _topology(topo1, "IsTopologyEquivalent")
    b = _topology(topo2, "IsTopologyEquivalent")
    if a.world_size != b.world_size or a.period != b.period:
        return False
    if a.period > EQUIVALENCE_STEPS:
        raise ValueError(
            f"IsTopologyEquivalent: {a.describe()} repeats only after {a.period} steps; "
            f"comparing more than {EQUIVALENCE_STEPS} steps is refused"
        )
    for t in range(a.period):
        wa, wb = a.matrix(t), b.matrix(t)
        if np.count_nonzero(wa) != np.count_nonzero(wb) or not np.array_equal(wa, wb):
            return False
    return True


# ---------------------------------------------------------------- one-peer rotation


def GetDynamicOnePeerSendRecvRanks(topo: Graph, self_rank: int) -> Iterator[SendRecv]:  # noqa: N802
    """BlueFog's one-peer schedule of a static graph: yields ``([send_rank], recv_ranks)``.

    Every rank orders its out-neighbors clockwise, by ``(r - rank) mod n``, and at step
    ``t`` sends to the one at index ``t mod outdegree``; it receives from every rank that
    sends to it at ``t``, in ascending order.  Where BlueFog divides by zero (a rank with
    no out-neighbor: a single rank), this yields ``([], [])`` for that rank.  BlueFog's
    own rotation assumes every rank has a non-zero weight of its own (all its graphs do);
    on a graph where one has none this rotates through all its out-neighbors.
    """
    if is_networkx_graph(topo):
        topo = from_networkx(topo)
    if not isinstance(topo, Graph):
        raise TypeError(
            "GetDynamicOnePeerSendRecvRanks takes a static graph (RingGraph(n), "
            f"ExponentialTwoGraph(n), MeshGrid2DGraph(n), ...), got {topo!r}"
        )
    rotation = OnePeerGraph(topo)
    rotation._check_rank(self_rank)
    return _one_peer(rotation, int(self_rank))


def _one_peer(rotation: OnePeerGraph, rank: int) -> Iterator[SendRecv]:
    step = 0
    while True:
        yield rotation.sends(rank, step), rotation.receives(rank, step)
        step += 1


def GetDynamicSendRecvRanks(topo: Graph, self_rank: int) -> Iterator[SendRecv]:  # noqa: N802
    """BlueFog's older name of :func:`GetDynamicOnePeerSendRecvRanks` (the same schedule)."""
    return GetDynamicOnePeerSendRecvRanks(topo, self_rank)


# ---------------------------------------------------------------- machine-aware schedules


def _machines(world_size: object, local_size: object, what: str, least_local: int) -> int:
    """The number of machines; ValueError naming ``what`` when the layout is not BlueFog's."""
    n = _int(world_size, f"{what}: world_size", 1)
    k = _int(local_size, f"{what}: local_size", least_local)
    if n % k:
        raise ValueError(
            f"{what}: world_size {n} is not a multiple of local_size {k}; every machine must "
            "run as many ranks (a homogeneous layout)"
        )
    return n // k


def _rank_in(self_rank: object, world_size: int, what: str) -> int:
    r = _int(self_rank, f"{what}: self_rank", 0)
    if r >= world_size:
        raise ValueError(f"{what}: self_rank {r} is out of range for world size {world_size}")
    return r


def GetExp2DynamicSendRecvMachineRanks(  # noqa: N802
    world_size: int, local_size: int, self_rank: int, local_rank: int
) -> Iterator[SendRecv]:
    """BlueFog's one-peer exponential-2 schedule among machines: yields
    ``([send_machine], [recv_machine])``, machine ids (for ``hierarchical_neighbor_allreduce``'s
    ``dst_machine_weights`` and ``src_machine_weights``).

    With ``M = world_size // local_size`` machines and ``K = floor(log2(M - 1))``, machine
    ``m`` sends at step ``t`` to ``(m + 2**(t mod (K + 1))) mod M`` and receives from
    ``(m - 2**(t mod (K + 1))) mod M``.  Needs at least two machines, and ``local_rank``
    must be ``self_rank mod local_size``.
    """
    what = "GetExp2DynamicSendRecvMachineRanks"
    machines = _machines(world_size, local_size, what, 1)
    rank = _rank_in(self_rank, int(world_size), what)
    local = _int(local_rank, f"{what}: local_rank", 0)
    if rank % int(local_size) != local:
        raise ValueError(
            f"{what}: local_rank {local} is not self_rank {rank} mod local_size {local_size}; "
            "machines must hold consecutive ranks, as many each"
        )
    if machines < 2:
        raise ValueError(
            f"{what}: world_size {world_size} with local_size {local_size} is one machine; "
            "the schedule among machines needs at least two"
        )
    return _exp2_machines(rank // int(local_size), machines)


def _exp2_machines(machine: int, machines: int) -> Iterator[SendRecv]:
    hops = _floor_log2(machines - 1) + 1
    step = 0
    while True:
        dist = 2 ** (step % hops)
        yield [(machine + dist) % machines], [(machine - dist) % machines]
        step += 1


def GetInnerOuterRingDynamicSendRecvRanks(  # noqa: N802
    world_size: int, local_size: int, self_rank: int
) -> Iterator[SendRecv]:
    """BlueFog's inner-ring/outer-ring schedule: yields ``([send_rank], [recv_rank])``.

    At step ``t`` local rank ``o = t mod local_size`` of every machine talks outside: it
    sends to the same local rank of the next machine and receives from the previous one.
    The other local ranks of the machine form a ring without ``o``: each sends to the next
    local rank after itself that is not ``o`` and receives from the one before.  Needs
    ``local_size > 2``.  With a single machine, the rank talking outside is its own next
    machine: it yields ``([self_rank], [self_rank])`` then, as BlueFog's does (sending to
    oneself with weight 1/2 keeps the value).
    """
    what = "GetInnerOuterRingDynamicSendRecvRanks"
    machines = _machines(world_size, local_size, what, 3)
    rank = _rank_in(self_rank, int(world_size), what)
    return _inner_outer_ring(rank, int(local_size), machines)


def _inner_outer_ring(rank: int, k: int, machines: int) -> Iterator[SendRecv]:
    machine, local = divmod(rank, k)
    step = 0
    while True:
        outside = step % k
        if outside == local:
            send = ((machine + 1) % machines) * k + local
            recv = ((machine - 1) % machines) * k + local
        else:
            nxt = (local + 1) % k
            if nxt == outside:
                nxt = (nxt + 1) % k
            prev = (local - 1) % k
            if prev == outside:
                prev = (prev - 1) % k
            send, recv = machine * k + nxt, machine * k + prev
        yield [send], [recv]
        step += 1


def GetInnerOuterExpo2DynamicSendRecvRanks(  # noqa: N802
    world_size: int, local_size: int, self_rank: int
) -> Iterator[SendRecv]:
    """BlueFog's inner-exponential-2/outer-exponential-2 schedule: yields
    ``([send_rank], [recv_rank])``.

    At step ``t`` local rank ``o = t mod local_size`` of every machine talks outside, to
    the same local rank of the machines ``d = 2**(t mod (floor(log2(M - 1)) + 1))`` after
    (sends) and before (receives) its own, ``M`` machines.  Each other local rank ``l``
    hops ``h = 2**(t mod (floor(log2(local_size - 2)) + 1))`` local ranks forward to send
    and backward to receive, one further when ``o`` lies within that hop (``h`` at least
    the distance to ``o`` that way).  Needs ``local_size > 2`` and at least two machines
    (BlueFog's fails on one).
    """
    what = "GetInnerOuterExpo2DynamicSendRecvRanks"
    machines = _machines(world_size, local_size, what, 3)
    rank = _rank_in(self_rank, int(world_size), what)
    if machines < 2:
        raise ValueError(
            f"{what}: world_size {world_size} with local_size {local_size} is one machine; "
            "it needs at least two (GetDynamicOnePeerSendRecvRanks serves one machine)"
        )
    return _inner_outer_expo2(rank, int(local_size), machines)


def _inner_outer_expo2(rank: int, k: int, machines: int) -> Iterator[SendRecv]:
    machine, local = divmod(rank, k)
    outer_hops = _floor_log2(machines - 1) + 1
    inner_hops = _floor_log2(k - 2) + 1
    step = 0
    while True:
        outside = step % k
        if outside == local:
            dist = 2 ** (step % outer_hops)
            send = ((machine + dist) % machines) * k + local
            recv = ((machine - dist) % machines) * k + local
        else:
            hop = 2 ** (step % inner_hops)
            ahead = hop + 1 if hop >= (outside - local) % k else hop
            behind = hop + 1 if hop >= (local - outside) % k else hop
            send = machine * k + (local + ahead) % k
            recv = machine * k + (local - behind) % k
        yield [send], [recv]
        step += 1

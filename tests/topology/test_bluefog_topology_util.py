"""BlueFog's ``topology_util`` in totalreduce.topology: every name, its arguments, its answers.

The expectations are written from BlueFog's definitions, in BlueFog's orientation (its
networkx graphs keep ``A[src, dst]``, the weight ``dst`` gives ``src``'s value; this
package's mixing matrix is ``W = A.T``), and checked for every world size 1..16, every
rank and enough steps to cover each schedule's period; a few small cases are spelled out by
hand.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from totalreduce import topology as topology_util
from totalreduce.topology import Graph, MatrixGraph

SIZES = range(1, 17)

#: Every name of BlueFog's ``bluefog/common/topology_util.py``.
BLUEFOG_NAMES = (
    "IsTopologyEquivalent",
    "GetRecvWeights",
    "GetSendWeights",
    "ExponentialTwoGraph",
    "isPowerOf",
    "ExponentialGraph",
    "SymmetricExponentialGraph",
    "MeshGrid2DGraph",
    "StarGraph",
    "RingGraph",
    "FullyConnectedGraph",
    "IsRegularGraph",
    "GetDynamicOnePeerSendRecvRanks",
    "GetExp2DynamicSendRecvMachineRanks",
    "GetInnerOuterRingDynamicSendRecvRanks",
    "GetInnerOuterExpo2DynamicSendRecvRanks",
)


def test_every_name_of_bluefogs_module_is_here() -> None:
    missing = [n for n in BLUEFOG_NAMES if not hasattr(topology_util, n)]
    assert not missing
    assert set(BLUEFOG_NAMES) <= set(topology_util.__all__)


# ---------------------------------------------------------------- BlueFog's adjacency, by hand


def circulant_a(n: int, offsets: list[int]) -> np.ndarray:
    """A[i, (i + d) % n] = 1 / (len(offsets) + 1) for d in offsets, and A[i, i] the same."""
    a = np.zeros((n, n))
    w = 1.0 / (len(offsets) + 1)
    for i in range(n):
        a[i, i] = w
        for d in offsets:
            a[i, (i + d) % n] = w
    return a


POWERS = {2: [1, 2, 4, 8, 16], 3: [1, 3, 9], 4: [1, 4, 16]}


def exponential_a(n: int, base: int) -> np.ndarray:
    return circulant_a(n, [d for d in range(1, n) if d in POWERS[base]])


def sym_a(n: int, base: int) -> np.ndarray:
    # BlueFog: offset d is a neighbor when its index (d, or n - d past the half) is a power
    return circulant_a(n, [d for d in range(1, n) if (d if d <= n // 2 else n - d) in POWERS[base]])


def ring_a(n: int, style: int) -> np.ndarray:
    if n == 1:
        return np.ones((1, 1))
    if n == 2:
        return np.full((2, 2), 0.5)
    a = np.zeros((n, n))
    for i in range(n):
        if style == 0:  # both ways
            a[i, i] = a[i, (i + 1) % n] = a[i, (i - 1) % n] = 1 / 3
        elif style == 1:  # i sends to its left, i - 1
            a[i, i] = a[i, (i - 1) % n] = 0.5
        else:  # i sends to its right, i + 1
            a[i, i] = a[i, (i + 1) % n] = 0.5
    return a


#: BlueFog's default mesh shape: rows = the largest divisor of n not above sqrt(n).
MESH_SHAPES = {
    1: (1, 1), 2: (1, 2), 3: (1, 3), 4: (2, 2), 5: (1, 5), 6: (2, 3), 7: (1, 7), 8: (2, 4),
    9: (3, 3), 10: (2, 5), 11: (1, 11), 12: (3, 4), 13: (1, 13), 14: (2, 7), 15: (3, 5),
    16: (4, 4),
}  # fmt: skip


def mesh_a(n: int, shape: tuple[int, int]) -> np.ndarray:
    rows, cols = shape
    near: list[set[int]] = []
    for i in range(n):
        r, c = divmod(i, cols)
        cells = [(r - 1, c), (r + 1, c), (r, c - 1), (r, c + 1)]
        near.append({y * cols + x for y, x in cells if 0 <= y < rows and 0 <= x < cols} | {i})
    a = np.zeros((n, n))
    for i in range(n):
        for j in near[i] - {i}:
            a[i, j] = 1.0 / max(len(near[i]), len(near[j]))  # Hastings, self counted
        a[i, i] = 1.0 - a[i].sum()
    return a


def star_a(n: int, center: int) -> np.ndarray:
    a = np.zeros((n, n))
    for i in range(n):
        a[i, i] = 1 - 1 / n
        a[i, center] = 1 / n
    a[center, :] = 1 / n
    return a


def bluefog_graphs(n: int) -> list[tuple[str, Graph, np.ndarray]]:
    """(label, this package's graph built with BlueFog's arguments, BlueFog's adjacency)."""
    tu = topology_util
    out = [
        ("ExponentialTwoGraph", tu.ExponentialTwoGraph(n), exponential_a(n, 2)),
        ("ExponentialGraph", tu.ExponentialGraph(n), exponential_a(n, 2)),
        ("ExponentialGraph base 3", tu.ExponentialGraph(n, base=3), exponential_a(n, 3)),
        ("ExponentialGraph 4", tu.ExponentialGraph(n, 4), exponential_a(n, 4)),
        ("SymmetricExponential", tu.SymmetricExponentialGraph(n), sym_a(n, 4)),
        ("SymmetricExponential 2", tu.SymmetricExponentialGraph(n, 2), sym_a(n, 2)),
        ("MeshGrid2DGraph", tu.MeshGrid2DGraph(n), mesh_a(n, MESH_SHAPES[n])),
        ("MeshGrid2DGraph line", tu.MeshGrid2DGraph(n, shape=(1, n)), mesh_a(n, (1, n))),
        ("StarGraph", tu.StarGraph(n), star_a(n, 0)),
        ("StarGraph last", tu.StarGraph(n, center_rank=n - 1), star_a(n, n - 1)),
        ("FullyConnectedGraph", tu.FullyConnectedGraph(n), np.full((n, n), 1 / n)),
    ]  # fmt: skip
    for style in (0, 1, 2):
        out.append((f"RingGraph {style}", tu.RingGraph(n, connect_style=style), ring_a(n, style)))
    if n % 2 == 0:
        half = (2, n // 2)
        out.append(("MeshGrid2DGraph 2 rows", tu.MeshGrid2DGraph(n, half), mesh_a(n, half)))
    return out


@pytest.mark.parametrize("n", SIZES)
def test_graphs_have_bluefogs_weights(n: int) -> None:
    for label, g, a in bluefog_graphs(n):
        np.testing.assert_allclose(g.matrix(0), a.T, atol=1e-15, err_msg=f"{label} n={n}")


def test_small_graphs_spelled_out() -> None:
    # a 1x3 mesh: the ends have one neighbor (2 with themselves), the middle two (3)
    np.testing.assert_allclose(
        topology_util.MeshGrid2DGraph(3).matrix(0),
        [[2 / 3, 1 / 3, 0], [1 / 3, 1 / 3, 1 / 3], [0, 1 / 3, 2 / 3]],
    )
    # the left ring of 4: rank i sends to i - 1, so receives from i + 1
    np.testing.assert_allclose(
        topology_util.RingGraph(4, 1).matrix(0),
        [[0.5, 0.5, 0, 0], [0, 0.5, 0.5, 0], [0, 0, 0.5, 0.5], [0.5, 0, 0, 0.5]],
    )
    # the star of 4 around rank 2
    np.testing.assert_allclose(
        topology_util.StarGraph(4, 2).matrix(0),
        [[0.75, 0, 0.25, 0], [0, 0.75, 0.25, 0], [0.25] * 4, [0, 0, 0.25, 0.75]],
    )


def test_bluefogs_positional_and_keyword_arguments() -> None:
    tu = topology_util
    assert tu.IsTopologyEquivalent(tu.RingGraph(6, 1), tu.RingGraph(size=6, connect_style=1))
    assert tu.IsTopologyEquivalent(tu.RingGraph(6, 2), tu.RingGraph(6, style="right"))
    assert tu.RingGraph(6, 1).connect_style == 1 and tu.RingGraph(6).connect_style == 0
    assert tu.IsTopologyEquivalent(tu.ExponentialGraph(size=9, base=3), tu.ExponentialGraph(9, 3))
    assert tu.IsTopologyEquivalent(tu.StarGraph(5, 3), tu.StarGraph(5, center=3))
    assert tu.MeshGrid2DGraph(size=8, shape=(2, 4)).shape == (2, 4)
    for cls in (tu.ExponentialTwoGraph, tu.FullyConnectedGraph, tu.SymmetricExponentialGraph):
        assert cls(size=5).world_size == 5


def test_bad_arguments_name_what_is_wrong() -> None:
    tu = topology_util
    for bad in (3, -1, True, "1", 1.0):
        with pytest.raises(ValueError, match="connect_style must be 0 .bidirectional., 1"):
            tu.RingGraph(5, connect_style=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="connect_style=1 is the 'left' ring but style='right'"):
        tu.RingGraph(5, 1, style="right")
    with pytest.raises(ValueError, match="center=1 and center_rank=2 disagree"):
        tu.StarGraph(5, 2, center=1)
    with pytest.raises(ValueError, match="center 5 is out of range for world size 5"):
        tu.StarGraph(5, center_rank=5)
    with pytest.raises(ValueError, match=r"mesh shape \(2, 3\) does not hold world size 8"):
        tu.MeshGrid2DGraph(8, (2, 3))
    with pytest.raises(ValueError, match="base >= 2"):
        tu.ExponentialGraph(8, base=1)
    with pytest.raises(ValueError, match="world_size must be at least 1"):
        tu.RingGraph(0)


# ---------------------------------------------------------------- predicates and weights


def test_is_power_of() -> None:
    tu = topology_util
    for base in (2, 3, 4):
        want = {x for x in POWERS[base] if x <= 16}
        assert {x for x in range(1, 17) if tu.isPowerOf(x, base)} == want
    assert tu.isPowerOf(243, 3) and tu.isPowerOf(1000, 10) and not tu.isPowerOf(242, 3)
    with pytest.raises(ValueError, match="base must be at least 2"):
        tu.isPowerOf(4, 1)
    with pytest.raises(ValueError, match="x must be at least 1"):
        tu.isPowerOf(0, 2)


@pytest.mark.parametrize("n", SIZES)
def test_recv_and_send_weights(n: int) -> None:
    for label, g, a in bluefog_graphs(n):
        for r in range(n):
            sw, src = topology_util.GetRecvWeights(g, r)
            assert sw == pytest.approx(a[r, r]), label
            want = {s: a[s, r] for s in range(n) if s != r and a[s, r] != 0}
            assert list(src) == sorted(want), label  # ascending, as networkx keeps them
            assert src == pytest.approx(want), label
            sw, dst = topology_util.GetSendWeights(g, r)
            assert sw == pytest.approx(a[r, r]), label
            want = {d: a[r, d] for d in range(n) if d != r and a[r, d] != 0}
            assert list(dst) == sorted(want) and dst == pytest.approx(want), label


def test_recv_weights_without_a_weight_of_its_own() -> None:
    g = MatrixGraph([[0.0, 1.0], [1.0, 0.0]])
    assert topology_util.GetRecvWeights(g, 0) == (0.0, {1: 1.0})


@pytest.mark.parametrize("n", SIZES)
def test_is_regular_graph_counts_in_and_out_degrees(n: int) -> None:
    for label, g, a in bluefog_graphs(n):
        nz = a != 0
        degree = nz.sum(axis=0) + nz.sum(axis=1)  # networkx: in + out, a self-loop in both
        assert topology_util.IsRegularGraph(g) == bool((degree == degree[0]).all()), label
    tu = topology_util
    assert tu.IsRegularGraph(tu.RingGraph(n)) and tu.IsRegularGraph(tu.ExponentialGraph(n))
    assert tu.IsRegularGraph(tu.StarGraph(n)) == (n <= 2)
    assert tu.IsRegularGraph(tu.MeshGrid2DGraph(n)) == (n in (1, 2, 4))


def test_is_regular_graph_is_not_about_in_degrees_alone() -> None:
    # every rank receives from one rank, but rank 0 sends to two and rank 2 to none
    g = MatrixGraph([[0.5, 0.5, 0], [0.5, 0.5, 0], [0.5, 0, 0.5]])
    assert not topology_util.IsRegularGraph(g)


@pytest.mark.parametrize("n", SIZES)
def test_is_topology_equivalent(n: int) -> None:
    tu = topology_util
    assert tu.IsTopologyEquivalent(tu.ExponentialGraph(n), tu.ExponentialTwoGraph(n))
    assert tu.IsTopologyEquivalent(tu.RingGraph(n, 1), tu.RingGraph(n, 2)) == (n <= 2)
    assert not tu.IsTopologyEquivalent(tu.RingGraph(n), None)
    assert not tu.IsTopologyEquivalent(None, tu.RingGraph(n))
    assert not tu.IsTopologyEquivalent(tu.RingGraph(n), tu.RingGraph(n + 1))
    w = tu.FullyConnectedGraph(n).matrix(0)
    assert tu.IsTopologyEquivalent(MatrixGraph(w), tu.FullyConnectedGraph(n))
    if n > 1:  # exact, as BlueFog compares: a rounding apart is another topology
        w[0, 0] += 1e-12
        w[0, 1] -= 1e-12
        assert not tu.IsTopologyEquivalent(MatrixGraph(w), tu.FullyConnectedGraph(n))


def test_networkx_queries_of_a_graph() -> None:
    g = topology_util.StarGraph(4)
    assert g.number_of_nodes() == 4
    assert g.number_of_edges() == 4 + 3 + 3  # self-loops, and both ways to each leaf
    assert list(g.successors(0)) == [0, 1, 2, 3] and list(g.predecessors(2)) == [0, 2]
    assert (g.in_degree(0), g.out_degree(0), g.degree(1)) == (4, 4, 4)
    with pytest.raises(ValueError, match="rank 4 is out of range"):
        g.successors(4)


# ---------------------------------------------------------------- the one-peer rotation


def one_peer_expected(a: np.ndarray, rank: int, step: int) -> tuple[list[int], list[int]]:
    """BlueFog's rotation: out-neighbors clockwise from each rank, index step mod degree."""
    n = len(a)

    def targets(r: int) -> list[int]:
        outs = [d for d in range(n) if d != r and a[r, d] != 0]
        return sorted(outs, key=lambda d: d - r if d >= r else d - r + n)

    mine = targets(rank)
    send = [mine[step % len(mine)]] if mine else []
    recv = [o for o in range(n) if o != rank and targets(o)[step % len(targets(o))] == rank]
    return send, recv


@pytest.mark.parametrize("n", SIZES)
def test_one_peer_schedule(n: int) -> None:
    for label, g, a in bluefog_graphs(n):
        steps = 2 * max(1, n - 1) + 3  # past every out-degree's period
        for r in range(n):
            gen = topology_util.GetDynamicOnePeerSendRecvRanks(g, r)
            got = list(itertools.islice(gen, steps))
            if n == 1:
                assert got == [([], [])] * steps  # BlueFog divides by zero here
                continue
            want = [one_peer_expected(a, r, t) for t in range(steps)]
            assert got == want, f"{label} n={n} rank {r}"


def test_one_peer_spelled_out() -> None:
    tu = topology_util
    gen = tu.GetDynamicOnePeerSendRecvRanks(tu.ExponentialTwoGraph(8), 0)
    assert [next(gen) for _ in range(4)] == [([1], [7]), ([2], [6]), ([4], [4]), ([1], [7])]
    # star of 4: the leaves always send to the center, the center to one leaf in turn
    center = tu.GetDynamicOnePeerSendRecvRanks(tu.StarGraph(4), 0)
    leaf = tu.GetDynamicOnePeerSendRecvRanks(tu.StarGraph(4), 2)
    leaves = [1, 2, 3]
    assert [next(center) for _ in range(3)] == [([1], leaves), ([2], leaves), ([3], leaves)]
    assert [next(leaf) for _ in range(3)] == [([0], []), ([0], [0]), ([0], [])]
    # the older name is the same schedule
    old = tu.GetDynamicSendRecvRanks(tu.RingGraph(5), 3)
    new = tu.GetDynamicOnePeerSendRecvRanks(tu.RingGraph(5), 3)
    assert list(itertools.islice(old, 6)) == list(itertools.islice(new, 6))


def test_one_peer_refuses_what_it_cannot_rotate() -> None:
    with pytest.raises(TypeError, match="takes a static graph"):
        topology_util.GetDynamicOnePeerSendRecvRanks(topology_util.get_topology("exp", 4), 0)
    with pytest.raises(ValueError, match="rank 4 is out of range"):
        topology_util.GetDynamicOnePeerSendRecvRanks(topology_util.RingGraph(4), 4)


# ---------------------------------------------------------------- machine-aware schedules


def floor_log2(k: int) -> int:
    e = 0
    while 2 ** (e + 1) <= k:
        e += 1
    return e


def layouts(least_local: int, least_machines: int) -> list[tuple[int, int]]:
    """Every (world_size, local_size) with world_size 1..16 it divides, within the bounds."""
    return [
        (n, k)
        for n in SIZES
        for k in range(least_local, n + 1)
        if n % k == 0 and n // k >= least_machines
    ]


def matched(sched: dict[int, list[tuple[list[int], list[int]]]], steps: int) -> None:
    """Every send is someone's receive at the same step, and the other way round."""
    for t in range(steps):
        for r, rows in sched.items():
            (s,), (v,) = rows[t]
            assert sched[s][t][1] == [r], (t, r, s)
            assert sched[v][t][0] == [r], (t, r, v)


@pytest.mark.parametrize(("n", "k"), layouts(1, 2))
def test_exp2_machine_schedule(n: int, k: int) -> None:
    machines = n // k
    hops = floor_log2(machines - 1) + 1
    steps = 3 * hops + 1
    for r in range(n):
        gen = topology_util.GetExp2DynamicSendRecvMachineRanks(n, k, r, r % k)
        got = list(itertools.islice(gen, steps))
        m = r // k
        want = [
            ([(m + 2 ** (t % hops)) % machines], [(m - 2 ** (t % hops)) % machines])
            for t in range(steps)
        ]
        assert got == want, (n, k, r)


def test_exp2_machine_schedule_spelled_out() -> None:
    gen = topology_util.GetExp2DynamicSendRecvMachineRanks(10, 2, 7, 1)  # machine 3 of 5
    assert [next(gen) for _ in range(4)] == [([4], [2]), ([0], [1]), ([2], [4]), ([4], [2])]
    gen = topology_util.GetExp2DynamicSendRecvMachineRanks(4, 2, 1, 1)  # two machines
    assert [next(gen) for _ in range(3)] == [([1], [1])] * 3


def test_exp2_machine_schedule_refuses_bad_layouts() -> None:
    f = topology_util.GetExp2DynamicSendRecvMachineRanks
    with pytest.raises(ValueError, match="world_size 10 is not a multiple of local_size 4"):
        f(10, 4, 0, 0)
    with pytest.raises(ValueError, match="local_rank 0 is not self_rank 3 mod local_size 2"):
        f(8, 2, 3, 0)
    with pytest.raises(ValueError, match="is one machine; the schedule among machines needs"):
        f(4, 4, 0, 0)
    with pytest.raises(ValueError, match="self_rank 8 is out of range for world size 8"):
        f(8, 2, 8, 0)


@pytest.mark.parametrize(("n", "k"), layouts(3, 1))
def test_inner_outer_ring_schedule(n: int, k: int) -> None:
    machines = n // k
    steps = 2 * k + 1
    sched = {
        r: list(
            itertools.islice(topology_util.GetInnerOuterRingDynamicSendRecvRanks(n, k, r), steps)
        )
        for r in range(n)
    }
    for r in range(n):
        m, local = divmod(r, k)
        for t in range(steps):
            outside = t % k
            if local == outside:  # to the same local rank of the next machine
                want = ([((m + 1) % machines) * k + local], [((m - 1) % machines) * k + local])
            else:  # the machine's ring without the rank talking outside
                ring = [(outside + 1 + j) % k for j in range(k - 1)]
                at = ring.index(local)
                want = ([m * k + ring[(at + 1) % (k - 1)]], [m * k + ring[at - 1]])
            assert sched[r][t] == want, (n, k, r, t)
    if machines > 1:
        matched(sched, steps)


def test_inner_outer_ring_spelled_out() -> None:
    got = {
        r: list(itertools.islice(topology_util.GetInnerOuterRingDynamicSendRecvRanks(8, 4, r), 2))
        for r in range(8)
    }
    assert [got[r][0] for r in range(4)] == [([4], [4]), ([2], [3]), ([3], [1]), ([1], [2])]
    assert [got[r][1] for r in range(4)] == [([2], [3]), ([5], [5]), ([3], [0]), ([0], [2])]
    assert got[5][1] == ([1], [1]) and got[6][0] == ([7], [5])
    # one machine: the rank talking outside is its own next machine, as in BlueFog
    one = topology_util.GetInnerOuterRingDynamicSendRecvRanks(4, 4, 0)
    assert next(one) == ([0], [0])


@pytest.mark.parametrize(("n", "k"), layouts(3, 2))
def test_inner_outer_expo2_schedule(n: int, k: int) -> None:
    machines = n // k
    outer_hops = floor_log2(machines - 1) + 1
    inner_hops = floor_log2(k - 2) + 1
    steps = 2 * k * outer_hops * inner_hops + 1
    sched = {
        r: list(
            itertools.islice(topology_util.GetInnerOuterExpo2DynamicSendRecvRanks(n, k, r), steps)
        )
        for r in range(n)
    }
    for r in range(n):
        m, local = divmod(r, k)
        for t in range(steps):
            outside = t % k
            if local == outside:
                d = 2 ** (t % outer_hops)
                want = ([((m + d) % machines) * k + local], [((m - d) % machines) * k + local])
            else:  # h local ranks on, not counting the one talking outside
                h = 2 ** (t % inner_hops)
                ahead = [(local + j) % k for j in range(1, k) if (local + j) % k != outside]
                behind = [(local - j) % k for j in range(1, k) if (local - j) % k != outside]
                want = ([m * k + ahead[h - 1]], [m * k + behind[h - 1]])
            assert sched[r][t] == want, (n, k, r, t)
    matched(sched, steps)


def test_inner_outer_expo2_spelled_out() -> None:
    got = {
        r: list(itertools.islice(topology_util.GetInnerOuterExpo2DynamicSendRecvRanks(8, 4, r), 4))
        for r in range(8)
    }
    by_step = [[got[r][t] for r in range(8)] for t in range(4)]
    assert by_step[0] == [([4], [4]), ([2], [3]), ([3], [1]), ([1], [2]),
                          ([0], [0]), ([6], [7]), ([7], [5]), ([5], [6])]  # fmt: skip
    assert by_step[1][:4] == [([3], [2]), ([5], [5]), ([0], [3]), ([2], [0])]
    assert by_step[2][:4] == [([1], [3]), ([3], [0]), ([6], [6]), ([0], [1])]
    assert by_step[3][:4] == [([2], [1]), ([0], [2]), ([1], [0]), ([7], [7])]


def test_inner_outer_schedules_refuse_bad_layouts() -> None:
    tu = topology_util
    for f in (tu.GetInnerOuterRingDynamicSendRecvRanks, tu.GetInnerOuterExpo2DynamicSendRecvRanks):
        with pytest.raises(ValueError, match="local_size must be at least 3, got 2"):
            f(8, 2, 0)
        with pytest.raises(ValueError, match="world_size 9 is not a multiple of local_size 4"):
            f(9, 4, 0)
        with pytest.raises(TypeError, match="self_rank must be an int"):
            f(8, 4, 1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="is one machine; it needs at least two"):
        tu.GetInnerOuterExpo2DynamicSendRecvRanks(4, 4, 0)


# ---------------------------------------------------------------- networkx graphs, as BlueFog's


class FakeDiGraph:
    """The networkx calls from_networkx makes, on an edge list (networkx is optional)."""

    def __init__(self, n: int, edges: list[tuple[int, int, float | None]], directed=True) -> None:
        self.n, self._edges, self.directed = n, edges, directed

    def number_of_nodes(self) -> int:
        return self.n

    def nodes(self) -> list[int]:
        return list(range(self.n))

    def is_directed(self) -> bool:
        return self.directed

    def edges(self, data: str, default: float) -> list[tuple[int, int, float]]:
        assert data == "weight"
        return [(s, d, default if w is None else w) for s, d, w in self._edges]


def test_from_networkx_reads_bluefogs_orientation() -> None:
    # BlueFog's left ring of 3: edge i -> i - 1 and the self-loops, weight 1/2
    edges = [(i, i, 0.5) for i in range(3)] + [(i, (i - 1) % 3, 0.5) for i in range(3)]
    g = topology_util.from_networkx(FakeDiGraph(3, edges))
    np.testing.assert_allclose(g.matrix(0), topology_util.RingGraph(3, 1).matrix(0))
    assert topology_util.GetRecvWeights(FakeDiGraph(3, edges), 0) == (0.5, {1: 0.5})
    gen = topology_util.GetDynamicOnePeerSendRecvRanks(FakeDiGraph(3, edges), 0)
    assert next(gen) == ([2], [1])
    # without weights only the edges count: equal weights over a rank and its in-neighbors
    plain = [(0, 1, None), (0, 2, None), (1, 2, None)]
    w = topology_util.from_networkx(FakeDiGraph(3, plain), weighted=False).matrix(0)
    np.testing.assert_allclose(w, [[1, 0, 0], [0.5, 0.5, 0], [1 / 3, 1 / 3, 1 / 3]])


def test_from_networkx_refuses_what_it_cannot_read() -> None:
    with pytest.raises(TypeError, match="takes a directed graph"):
        topology_util.from_networkx(FakeDiGraph(2, [], directed=False))
    with pytest.raises(ValueError, match="row 1 sums to 2.0, not 1"):
        topology_util.from_networkx(FakeDiGraph(2, [(0, 0, 1.0), (1, 1, 1.0), (0, 1, 1.0)]))
    with pytest.raises(TypeError, match="takes a networkx directed graph"):
        topology_util.from_networkx([[1.0]])


def test_real_networkx_graphs_of_bluefogs_matrices() -> None:
    nx = pytest.importorskip("networkx")
    for n in (1, 4, 6, 9):
        for label, g, a in bluefog_graphs(n):
            made = nx.from_numpy_array(a, create_using=nx.DiGraph)  # as BlueFog builds them
            np.testing.assert_allclose(topology_util.from_networkx(made).matrix(0), a.T)
            same = bool(np.array_equal(a.T, g.matrix(0)))  # exact, as BlueFog compares
            assert topology_util.IsTopologyEquivalent(made, g) == same, label
            assert topology_util.IsRegularGraph(made) == topology_util.IsRegularGraph(g), label

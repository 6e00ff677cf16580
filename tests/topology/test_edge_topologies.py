"""complete, ring, exp and alternating-exp-ring for every world size 1..33."""

from __future__ import annotations

import numpy as np
import pytest
from topology_cases import SIZES, divisors, edge_cases

from totalreduce.topology import (
    AlternatingExpRingTopology,
    Edge,
    Topology,
    get_topology,
    is_doubly_stochastic,
    period_matrix,
    rho_period,
)


def rounds(n: int) -> int:
    """ceil(log2 n)."""
    return (n - 1).bit_length()


@pytest.mark.parametrize("n", SIZES)
def test_every_iteration_is_symmetric_and_doubly_stochastic(n: int) -> None:
    for name, options in edge_cases(n):
        topo = get_topology(name, n, **options)
        assert isinstance(topo, Topology)
        for t in range(topo.period):
            w = topo.matrix(t)
            where = f"{name} {options} n={n} t={t}"
            assert w.shape == (n, n), where
            assert np.all((w >= 0) & (w <= 1)), where
            np.testing.assert_allclose(w.sum(axis=1), 1.0, atol=1e-12, err_msg=where)
            np.testing.assert_allclose(w.sum(axis=0), 1.0, atol=1e-12, err_msg=where)
            np.testing.assert_array_equal(w, w.T, err_msg=where)
        if n > 1:
            # Over a period every topology is connected: the product mixes.
            assert rho_period(topo) < 1 - 1e-9, f"{name} {options} n={n}"


@pytest.mark.parametrize("n", SIZES)
def test_complete_is_the_average(n: int) -> None:
    topo = get_topology("complete", n)
    assert topo.period == 1
    np.testing.assert_allclose(topo.matrix(0), np.full((n, n), 1 / n))


@pytest.mark.parametrize("n", [n for n in SIZES if n % 2 == 0])
def test_ring_even_alternates_right_and_left(n: int) -> None:
    topo = get_topology("ring", n)
    assert isinstance(topo, Topology) and topo.period == 2
    for i in range(0, n, 2):
        assert topo.edge_of(i, 0) == Edge((i, i + 1), 0.5)
        assert topo.edge_of(i + 1, 0) == Edge((i, i + 1), 0.5)
    for i in range(1, n, 2):
        assert set(topo.edge_of(i, 1).ranks) == {i, (i + 1) % n}
        assert topo.edge_of(i, 1).weight == 0.5
    if n > 2:
        # Each rank meets its right neighbour at one step and its left one at the other.
        for i in range(n):
            met = {r for t in (0, 1) for r in topo.edge_of(i, t).ranks} - {i}
            assert met == {(i - 1) % n, (i + 1) % n}


@pytest.mark.parametrize("n", [n for n in SIZES if n % 2 == 1 and n >= 3])
def test_ring_odd_closes_with_a_triple(n: int) -> None:
    topo = get_topology("ring", n)
    assert isinstance(topo, Topology) and topo.period == 2
    first = {e.ranks: e.weight for e in topo.edges(0)}
    second = {e.ranks: e.weight for e in topo.edges(1)}
    want_first: dict[tuple[int, ...], float] = {(i, i + 1): 0.5 for i in range(0, n - 3, 2)}
    want_first[(n - 3, n - 2, n - 1)] = 1 / 3
    want_second: dict[tuple[int, ...], float] = {(i, i + 1): 0.5 for i in range(1, n - 3, 2)}
    want_second[(0, n - 2, n - 1)] = 1 / 3
    assert first == want_first
    assert second == want_second
    w = topo.matrix(0)
    np.testing.assert_allclose(w[n - 1, n - 3 :], [1 / 3, 1 / 3, 1 / 3])
    # Every link of the ring is used in the period.
    links = {
        frozenset((a, b)) for t in (0, 1) for e in topo.edges(t) for a in e.ranks for b in e.ranks
    }
    for i in range(n):
        assert frozenset((i, (i + 1) % n)) in links


def test_ring_small_sizes() -> None:
    np.testing.assert_array_equal(get_topology("ring", 1).matrix(0), [[1.0]])
    for t in (0, 1):
        np.testing.assert_array_equal(get_topology("ring", 2).matrix(t), np.full((2, 2), 0.5))
        np.testing.assert_allclose(get_topology("ring", 3).matrix(t), np.full((3, 3), 1 / 3))


@pytest.mark.parametrize("n", [2, 4, 8, 16, 32])
def test_exp_pairs_i_with_i_plus_2_to_the_t(n: int) -> None:
    topo = get_topology("exp", n)
    log = n.bit_length() - 1
    assert topo.period == log
    for t in range(3 * log):
        d = 2 ** (t % log)
        w = topo.matrix(t)
        for i in range(n):
            if i & d == 0:
                partner = (i + d) % n
                assert isinstance(topo, Topology)
                assert topo.edge_of(i, t) == Edge((i, partner), 0.5)
                assert w[i, partner] == 0.5 and w[partner, i] == 0.5 and w[i, i] == 0.5
        assert np.count_nonzero(w) == 2 * n


@pytest.mark.parametrize("n", [1, 2, 4, 8, 16, 32])
def test_exp_averages_exactly_after_log2_n_steps(n: int) -> None:
    topo = get_topology("exp", n)
    # Powers of two: every product entry is a dyadic rational, so equality is exact.
    np.testing.assert_array_equal(period_matrix(topo), np.full((n, n), 1 / n))


@pytest.mark.parametrize("n", [n for n in SIZES if n & (n - 1)])
def test_exp_other_sizes_use_the_hypercube_and_sit_out(n: int) -> None:
    topo = get_topology("exp", n)
    assert isinstance(topo, Topology)
    assert topo.period == rounds(n)
    for t in range(topo.period):
        d = 2**t
        for i in range(n):
            edge = topo.edge_of(i, t)
            if i ^ d < n:
                assert edge == Edge(tuple(sorted((i, i ^ d))), 0.5)
            else:
                assert edge.ranks == (i,)
                assert topo.matrix(t)[i, i] == 1.0
    # Measured property of this schedule: the period contracts by (2^K - n) / 2^K.
    k = 2 ** rounds(n)
    assert rho_period(topo) == pytest.approx((k - n) / k, abs=1e-9)


def test_exp_single_rank() -> None:
    topo = get_topology("exp", 1)
    assert topo.period == 1
    np.testing.assert_array_equal(topo.matrix(0), [[1.0]])


@pytest.mark.parametrize("n", SIZES)
def test_alternating_exp_ring_structure(n: int) -> None:
    for local in divisors(n):
        topo = get_topology("alternating-exp-ring", n, local_size=local)
        assert isinstance(topo, AlternatingExpRingTopology)
        nodes = n // local
        where = f"n={n} local_size={local}"

        def node(m: int, local: int = local) -> tuple[int, ...]:
            return tuple(range(m * local, (m + 1) * local))

        if nodes == 1:
            assert topo.period == 1, where
            np.testing.assert_allclose(topo.matrix(0), np.full((n, n), 1 / n), err_msg=where)
            continue
        assert topo.period == 2 * rounds(nodes), where
        merged_in = []  # per pair, in order: which iteration of its round merged it
        for r in range(rounds(nodes)):
            for m in range(nodes):
                partner = m ^ (1 << r)
                apart = Edge(node(m), 1 / local)
                got = [topo.edge_of(m * local, 2 * r + k) for k in (0, 1)]
                if partner >= nodes:  # no partner: the node averages inside itself twice
                    assert got == [apart, apart], where
                    continue
                merged = Edge(tuple(sorted(node(m) + node(partner))), 1 / (2 * local))
                assert sorted(got, key=lambda e: len(e.ranks)) == [apart, merged], where
                for lr in range(local):  # every rank of the node has the node's edges
                    assert [topo.edge_of(m * local + lr, 2 * r + k) for k in (0, 1)] == got
                if m < partner:
                    merged_in.append(got.index(merged))
        # The pairs take turns: the first merges in its round's second iteration, the
        # next in the first, and so on.
        assert merged_in == [1 - c % 2 for c in range(len(merged_in))], where


def test_alternating_exp_ring_one_rank_per_node_leaves_ranks_alone() -> None:
    topo = get_topology("alternating-exp-ring", 4, local_size=1)
    assert [sorted(e.ranks for e in topo.edges(t)) for t in range(topo.period)] == [
        [(0,), (1,), (2, 3)],
        [(0, 1), (2,), (3,)],
        [(0,), (1, 3), (2,)],
        [(0, 2), (1,), (3,)],
    ]
    np.testing.assert_array_equal(period_matrix(topo), np.full((4, 4), 1 / 4))


@pytest.mark.parametrize("n, local", [(4, 2), (8, 2), (8, 4), (16, 2), (16, 4), (32, 4), (24, 3)])
def test_alternating_exp_ring_averages_in_one_period_for_power_of_two_nodes(
    n: int, local: int
) -> None:
    topo = get_topology("alternating-exp-ring", n, local_size=local)
    np.testing.assert_allclose(period_matrix(topo), np.full((n, n), 1 / n), atol=1e-15)
    assert is_doubly_stochastic(period_matrix(topo))


def test_alternating_exp_ring_refusals() -> None:
    with pytest.raises(ValueError, match="needs local_size .* for world size 8"):
        get_topology("alternating-exp-ring", 8)
    with pytest.raises(ValueError, match="world size 10 is not a multiple of local_size 4"):
        get_topology("alternating-exp-ring", 10, local_size=4)
    with pytest.raises(ValueError, match="local_size must be at least 1, got 0"):
        get_topology("alternating-exp-ring", 8, local_size=0)
    with pytest.raises(TypeError, match="local_size must be an int"):
        get_topology("alternating-exp-ring", 8, local_size=2.0)


def test_alternating_exp_ring_single_rank() -> None:
    topo = get_topology("alternating-exp-ring", 1, local_size=1)
    np.testing.assert_array_equal(topo.matrix(0), [[1.0]])

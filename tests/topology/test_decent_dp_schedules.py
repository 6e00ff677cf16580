"""Decent-DP's topology names: every iteration's edges are the ones Decent-DP builds.

``decent_dp_iterations`` restates, from Decent-DP's description of its topologies
(``decent_dp/topo.py``), which ranks average together in each iteration, for the sizes
Decent-DP accepts; the registry's topologies must give each rank exactly that edge at
every step.  Sizes it refuses are covered by test_edge_topologies.py.
"""

from __future__ import annotations

import io

import numpy as np
import pytest

from totalreduce.topology import Edge, Topology, get_topology, period_matrix
from totalreduce.topology.cli import main

Iteration = list[tuple[tuple[int, ...], float]]


def decent_dp_iterations(name: str, n: int, local: int = 1) -> list[Iteration]:
    """Decent-DP's iterations of ``name`` over ``n`` ranks (nodes of ``local`` ranks)."""
    if name == "complete":
        return [[(tuple(range(n)), 1 / n)]]
    if name == "ring":  # even n: each even rank with its right, then with its left neighbour
        right = [((i, i + 1), 0.5) for i in range(0, n, 2)]
        left = [(tuple(sorted((i, (i - 1) % n))), 0.5) for i in range(0, n, 2)]
        return [right, left]

    def one_peer_pairs(members: int, distance: int) -> list[tuple[int, int]]:
        # scan the members in order; an unmatched one takes the member `distance` ahead
        matched: set[int] = set()
        pairs = []
        for j in range(members):
            if j not in matched:
                partner = (j + distance) % members
                matched.update((j, partner))
                pairs.append((j, partner))
        return pairs

    if name == "one-peer-exp":  # n a power of two
        rounds = n.bit_length() - 1
        return [[(tuple(sorted(p)), 0.5) for p in one_peer_pairs(n, 2**k)] for k in range(rounds)]
    assert name == "alternating-exp-ring"  # n // local a power of two, at least 2

    def block(m: int) -> tuple[int, ...]:
        return tuple(range(m * local, (m + 1) * local))

    nodes = n // local
    out: list[Iteration] = []
    counted = 0
    for k in range(nodes.bit_length() - 1):
        first: Iteration = []
        second: Iteration = []
        for a, b in one_peer_pairs(nodes, 2**k):
            apart = [(block(a), 1 / local), (block(b), 1 / local)]
            merged = [(tuple(sorted(block(a) + block(b))), 1 / (2 * local))]
            # even-counted pairs average inside their nodes first, odd-counted ones together
            first += apart if counted % 2 == 0 else merged
            second += merged if counted % 2 == 0 else apart
            counted += 1
        out += [first, second]
    return out


def cases() -> list[tuple[str, int, int]]:
    out = []
    for n in range(1, 65):
        out.append(("complete", n, 1))
        if n % 2 == 0:
            out.append(("ring", n, 1))
        if n > 1 and n & (n - 1) == 0:
            out.append(("one-peer-exp", n, 1))
        for local in range(1, n + 1):
            nodes = n // local
            if n % local == 0 and nodes >= 2 and nodes & (nodes - 1) == 0:
                out.append(("alternating-exp-ring", n, local))
    return out


CASES = cases()


def build(name: str, n: int, local: int) -> Topology:
    options = {"local_size": local} if name == "alternating-exp-ring" else {}
    topo = get_topology(name, n, **options)
    assert isinstance(topo, Topology)
    return topo


@pytest.mark.parametrize("name", ["complete", "ring", "one-peer-exp", "alternating-exp-ring"])
def test_every_decent_dp_edge_is_the_registrys(name: str) -> None:
    mine = [c for c in CASES if c[0] == name]
    assert len(mine) >= 6
    for _, n, local in mine:
        want = decent_dp_iterations(name, n, local)
        topo = build(name, n, local)
        where = f"{name} n={n} local={local}"
        assert topo.period == len(want), where
        for t in range(3 * topo.period + 1):
            # Decent-DP's get_edge(t): the edge of iteration t mod period holding the rank
            expected = want[t % len(want)]
            for rank in range(n):
                (ranks, weight), *more = [e for e in expected if rank in e[0]]
                assert not more, where
                assert topo.edge_of(rank, t) == Edge(ranks, weight), (where, t, rank)


def test_the_restatement_builds_valid_iterations() -> None:
    """The reference itself: every iteration a partition of the ranks (so the test above
    compares like with like)."""
    for name, n, local in CASES:
        for iteration in decent_dp_iterations(name, n, local):
            ranks = sorted(r for group, _ in iteration for r in group)
            assert ranks == list(range(n)), (name, n, local, iteration)


@pytest.mark.parametrize(
    ("n", "local"), [(4, 2), (8, 2), (8, 4), (16, 2), (16, 4), (32, 8), (64, 2)]
)
def test_alternating_exp_ring_on_decent_dp_sizes_averages_in_one_period(n: int, local: int):
    np.testing.assert_allclose(
        period_matrix(build("alternating-exp-ring", n, local)), np.full((n, n), 1 / n), atol=1e-15
    )


def test_one_peer_exp_is_exp_under_decent_dp_s_name() -> None:
    for n in range(1, 34):
        ours, exp = get_topology("one-peer-exp", n), get_topology("exp", n)
        assert ours.name == "one-peer-exp" and exp.name == "exp"
        assert ours.period == exp.period
        for t in range(ours.period):
            np.testing.assert_array_equal(ours.matrix(t), exp.matrix(t))


@pytest.mark.parametrize(
    ("argv", "wants"),
    [
        (["one-peer-exp", "-n", "8", "--step", "1"], ["topology 'one-peer-exp'", "period 3"]),
        (["alternating-exp-ring", "-n", "8", "--local-size", "2"], ["period 4", "0.250"]),
        (["complete", "-n", "4"], ["period 1", "rho(W(0)) = 0.000000"]),
        (["ring", "-n", "6", "--step", "1"], ["period 2"]),
    ],
)
def test_the_cli_knows_decent_dp_s_names(argv: list[str], wants: list[str]) -> None:
    out = io.StringIO()
    assert main(argv, out=out) == 0
    for want in wants:
        assert want in out.getvalue(), out.getvalue()

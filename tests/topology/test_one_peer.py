"""One-peer dynamic topologies: the rotation, its matrices, exact averaging."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from topology_cases import SIZES, graph_cases

from totalreduce.topology import (
    Graph,
    OnePeerGraph,
    get_topology,
    is_doubly_stochastic,
    is_row_stochastic,
    one_peer_dynamic,
    one_peer_matrix,
    period_matrix,
)

CIRCULANT = {"exponential-2", "exponential", "symmetric-exponential", "ring-graph"}
CIRCULANT |= {"fully-connected"}


def graph(name: str, n: int, **options: object) -> Graph:
    g = get_topology(name, n, **options)
    assert isinstance(g, Graph)
    return g


def reference_rotation(g: Graph) -> list[list[int]]:
    """Each rank's out-neighbors in turn order: clockwise, starting next to the rank."""
    n = g.world_size
    turns = []
    for r in range(n):
        turns.append(sorted(g.out_neighbors(r), key=lambda j: (j - r) % n))  # noqa: B023
    return turns


def expected(turns: list[list[int]], rank: int, step: int) -> tuple[list[int], list[int]]:
    """The rotation rule written out plainly: rank r sends to turns[r][step mod degree]."""
    target = [t[step % len(t)] if t else -1 for t in turns]
    recv = [j for j in range(len(turns)) if j != rank and target[j] == rank]
    return ([] if target[rank] < 0 else [target[rank]]), recv


@pytest.mark.parametrize("n", [2, 4, 8, 16, 32])
def test_exponential_2_gives_the_one_peer_exponential_graph(n: int) -> None:
    g = graph("exponential-2", n)
    log = n.bit_length() - 1
    for rank in range(n):
        gen = one_peer_dynamic(g, rank)
        for t, (send, recv) in enumerate(itertools.islice(gen, 3 * log)):
            d = 2 ** (t % log)
            assert send == [(rank + d) % n]
            assert recv == [(rank - d) % n]
    for t in range(log):
        w = one_peer_matrix(g, t)
        d = 2**t
        want = 0.5 * (np.eye(n) + np.roll(np.eye(n), d, axis=1).T)
        np.testing.assert_array_equal(w, want)
        assert all(w[i, (i - d) % n] == 0.5 and w[i, i] == 0.5 for i in range(n))


@pytest.mark.parametrize("n", [1, 2, 4, 8, 16, 32])
def test_one_peer_exponential_2_averages_exactly_after_log2_n_steps(n: int) -> None:
    g = graph("exponential-2", n)
    product = np.eye(n)
    for t in range(max(n.bit_length() - 1, 1)):
        product = one_peer_matrix(g, t) @ product
    np.testing.assert_array_equal(product, np.full((n, n), 1 / n))
    np.testing.assert_array_equal(period_matrix(OnePeerGraph(g)), np.full((n, n), 1 / n))


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 12, 17, 33])
def test_rotation_matches_the_rule_for_every_graph(n: int) -> None:
    for name, options in graph_cases(n):
        g = graph(name, n, **options)
        topo = OnePeerGraph(g)
        turns = reference_rotation(g)
        assert topo.period == math.lcm(*(max(len(t), 1) for t in turns))
        for rank in range(n):
            steps = min(topo.period + 3, 40)
            for t, got in enumerate(itertools.islice(one_peer_dynamic(g, rank), steps)):
                assert got == expected(turns, rank, t), f"{name} {options} n={n} t={t}"


@pytest.mark.parametrize("n", SIZES)
def test_sends_and_receives_match_across_ranks(n: int) -> None:
    for name, options in graph_cases(n):
        topo = OnePeerGraph(graph(name, n, **options))
        for t in range(min(topo.period, 6)):
            sent = {(i, j) for i in range(n) for j in topo.sends(i, t)}
            received = {(j, i) for i in range(n) for j in topo.receives(i, t)}
            where = f"{name} {options} n={n} t={t}"
            assert sent == received, where
            w = topo.matrix(t)
            assert is_row_stochastic(w), where
            if name in CIRCULANT:
                # Every rank uses the same offset: one receive each, 1/2 and 1/2.
                assert is_doubly_stochastic(w), where
                assert all(len(topo.receives(i, t)) == (1 if n > 1 else 0) for i in range(n))


def test_star_one_peer_is_row_stochastic_only() -> None:
    topo = OnePeerGraph(graph("star", 5))
    # Every leaf sends to the center at every step; the center sends to one leaf in turn.
    assert topo.receives(0, 0) == [1, 2, 3, 4]
    assert [topo.sends(0, t) for t in range(5)] == [[1], [2], [3], [4], [1]]
    w = topo.matrix(0)
    np.testing.assert_allclose(w[0], 0.2)
    np.testing.assert_allclose(w[1, :2], 0.5)
    assert w[2, 2] == 1.0
    assert is_row_stochastic(w) and not is_doubly_stochastic(w)


def test_single_rank_and_refusals() -> None:
    g = graph("exponential-2", 1)
    assert list(itertools.islice(one_peer_dynamic(g, 0), 2)) == [([], []), ([], [])]
    np.testing.assert_array_equal(one_peer_matrix(g, 3), [[1.0]])
    with pytest.raises(TypeError, match="needs a static graph"):
        OnePeerGraph(get_topology("ring", 4))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rank 8 is out of range"):
        one_peer_dynamic(graph("exponential-2", 8), 8)

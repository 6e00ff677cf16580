"""The static graphs for every world size 1..33: weights, neighbors, rho."""

from __future__ import annotations

import math

import numpy as np
import pytest
from topology_cases import SIZES, graph_cases

from totalreduce.topology import (
    Graph,
    MatrixGraph,
    get_topology,
    is_doubly_stochastic,
    rho,
)


def graph(name: str, n: int, **options: object) -> Graph:
    g = get_topology(name, n, **options)
    assert isinstance(g, Graph)
    return g


def powers_below(base: int, n: int) -> list[int]:
    return [base**k for k in range(n) if base**k < n]


@pytest.mark.parametrize("n", SIZES)
def test_every_graph_is_doubly_stochastic_with_consistent_neighbors(n: int) -> None:
    for name, options in graph_cases(n):
        g = graph(name, n, **options)
        where = f"{name} {options} n={n}"
        w = g.matrix(0)
        assert g.period == 1
        assert np.all((w >= 0) & (w <= 1)), where
        np.testing.assert_allclose(w.sum(axis=1), 1.0, atol=1e-12, err_msg=where)
        np.testing.assert_allclose(w.sum(axis=0), 1.0, atol=1e-12, err_msg=where)
        np.testing.assert_array_equal(g.matrix(5), w, err_msg=where)  # static
        for i in range(n):
            assert g.in_neighbors(i) == tuple(j for j in range(n) if j != i and w[i, j] > 0)
            assert g.out_neighbors(i) == tuple(j for j in range(n) if j != i and w[j, i] > 0)
        if n > 1:
            assert rho(w) < 1 - 1e-9, where  # connected and aperiodic


@pytest.mark.parametrize("n", SIZES)
def test_exponential_2_receives_from_i_minus_2_to_the_k(n: int) -> None:
    g = graph("exponential-2", n)
    offsets = powers_below(2, n)
    w = g.matrix(0)
    weight = 1 / (len(offsets) + 1)
    want = np.zeros((n, n))
    for i in range(n):
        want[i, i] = weight
        for d in offsets:
            want[i, (i - d) % n] = weight
    np.testing.assert_allclose(w, want)
    for i in range(n):
        assert set(g.in_neighbors(i)) == {(i - d) % n for d in offsets}
        assert set(g.out_neighbors(i)) == {(i + d) % n for d in offsets}
    np.testing.assert_array_equal(w, graph("exponential", n).matrix(0))


@pytest.mark.parametrize("n", [2, 4, 8, 16, 32])
def test_exponential_2_rho_for_powers_of_two(n: int) -> None:
    g = graph("exponential-2", n)
    log = math.log2(n)
    # Uniform weights 1/(log2 n + 1) on self and the log2 n in-neighbors...
    assert np.all(np.isin(g.matrix(0), [0.0, 1 / (log + 1)]))
    # ...give rho = 1 - 2/(1 + log2 n), reached at the eigenvalue of frequency n/2.
    assert rho(g.matrix(0)) == pytest.approx(1 - 2 / (1 + log), abs=1e-12)


@pytest.mark.parametrize("base", [3, 4, 5])
@pytest.mark.parametrize("n", [1, 2, 3, 5, 9, 10, 17, 26, 33])
def test_exponential_other_bases(n: int, base: int) -> None:
    g = graph("exponential", n, base=base)
    offsets = powers_below(base, n)
    for i in range(n):
        assert set(g.in_neighbors(i)) == {(i - d) % n for d in offsets}
        assert g.matrix(0)[i, i] == pytest.approx(1 / (len(offsets) + 1))


@pytest.mark.parametrize("n", SIZES)
def test_symmetric_exponential_mirrors_the_offsets(n: int) -> None:
    for base in (2, 4):
        g = graph("symmetric-exponential", n, base=base)
        w = g.matrix(0)
        np.testing.assert_array_equal(w, w.T)
        near = set(powers_below(base, n // 2 + 1))
        offsets = {d for d in range(1, n) if (d if d <= n // 2 else n - d) in near}
        for i in range(n):
            assert set(g.in_neighbors(i)) == {(i - d) % n for d in offsets}
            assert w[i, i] == pytest.approx(1 / (len(offsets) + 1))


@pytest.mark.parametrize("n", SIZES)
def test_mesh_grid_has_metropolis_weights(n: int) -> None:
    g = graph("mesh-grid-2d", n)
    rows, cols = g.shape  # type: ignore[attr-defined]
    assert rows * cols == n and rows <= cols
    assert all(n % r for r in range(rows + 1, math.isqrt(n) + 1))  # most square
    w = g.matrix(0)
    np.testing.assert_array_equal(w, w.T)

    def links(i: int) -> set[int]:
        r, c = divmod(i, cols)
        out = {(r + dr) * cols + (c + dc) for dr, dc in ((-1, 0), (1, 0), (0, -1), (0, 1))}
        return {j for j in out if 0 <= j < n and abs(j // cols - r) + abs(j % cols - c) == 1}

    for i in range(n):
        assert set(g.in_neighbors(i)) == links(i)
        for j in links(i):
            assert w[i, j] == pytest.approx(1 / (max(len(links(i)), len(links(j))) + 1))
        assert w[i, i] == pytest.approx(1 - sum(w[i, j] for j in links(i)))


def test_mesh_grid_shape_option() -> None:
    assert graph("mesh-grid-2d", 24).shape == (4, 6)  # type: ignore[attr-defined]
    g = graph("mesh-grid-2d", 12, shape=(2, 6))
    assert g.in_neighbors(0) == (1, 6) and g.in_neighbors(7) == (1, 6, 8)
    with pytest.raises(ValueError, match=r"mesh shape \(3, 5\) does not hold world size 12"):
        graph("mesh-grid-2d", 12, shape=(3, 5))


@pytest.mark.parametrize("n", SIZES)
def test_star_weights(n: int) -> None:
    for center in {0, n // 2, n - 1}:
        w = graph("star", n, center=center).matrix(0)
        want = np.eye(n) * (1 - 1 / n)
        want[:, center] = 1 / n
        want[center, :] = 1 / n
        np.testing.assert_allclose(w, want)
    with pytest.raises(ValueError, match=f"center {n} is out of range for world size {n}"):
        graph("star", n, center=n)


@pytest.mark.parametrize("n", [n for n in SIZES if n >= 3])
def test_bidirectional_ring_graph_rho(n: int) -> None:
    w = graph("ring-graph", n).matrix(0)
    for i in range(n):
        assert w[i, i] == w[i, (i - 1) % n] == w[i, (i + 1) % n] == pytest.approx(1 / 3)
    assert rho(w) == pytest.approx(1 / 3 + 2 / 3 * math.cos(2 * math.pi / n), abs=1e-12)


@pytest.mark.parametrize("n", [n for n in SIZES if n >= 2])
def test_one_way_ring_graphs(n: int) -> None:
    left = graph("ring-graph", n, style="left")
    right = graph("ring-graph", n, style="right")
    for i in range(n):
        assert left.out_neighbors(i) == ((i - 1) % n,)
        assert left.in_neighbors(i) == ((i + 1) % n,)
        assert right.out_neighbors(i) == ((i + 1) % n,)
        assert right.in_neighbors(i) == ((i - 1) % n,)
        assert left.matrix(0)[i, (i + 1) % n] == 0.5 == right.matrix(0)[i, (i - 1) % n]
    # A one-way ring's eigenvalues (1 + e^{2 pi i j/n})/2 have modulus |cos(pi j/n)|.
    assert rho(right.matrix(0)) == pytest.approx(math.cos(math.pi / n), abs=1e-9)


def test_small_ring_graphs() -> None:
    for style in ("bidirectional", "left", "right"):
        np.testing.assert_array_equal(graph("ring-graph", 1, style=style).matrix(0), [[1.0]])
        np.testing.assert_array_equal(
            graph("ring-graph", 2, style=style).matrix(0), np.full((2, 2), 0.5)
        )
    with pytest.raises(ValueError, match="unknown ring-graph style 'up'; known: bidirectional"):
        graph("ring-graph", 4, style="up")


@pytest.mark.parametrize("n", SIZES)
def test_fully_connected(n: int) -> None:
    np.testing.assert_allclose(graph("fully-connected", n).matrix(0), np.full((n, n), 1 / n))


@pytest.mark.parametrize("base", [1, 0, 2.5, True])
def test_refuses_bad_base(base: object) -> None:
    with pytest.raises(ValueError, match="integer base >= 2"):
        get_topology("exponential", 8, base=base)
    with pytest.raises(ValueError, match="integer base >= 2"):
        get_topology("symmetric-exponential", 8, base=base)


def test_matrix_graph_validation() -> None:
    g = MatrixGraph([[0.25, 0.75], [1.0, 0.0]])
    assert g.in_neighbors(1) == (0,) and g.out_neighbors(1) == (0,)
    assert not is_doubly_stochastic(g.matrix(0))
    with pytest.raises(ValueError, match=r"row 1 sums to 0.9.*not 1"):
        MatrixGraph([[0.5, 0.5], [0.4, 0.5]])
    with pytest.raises(ValueError, match=r"W\[0, 0\] = 1.5 is outside \[0, 1\]"):
        MatrixGraph([[1.5, -0.5], [0.5, 0.5]])
    with pytest.raises(ValueError, match=r"square and non-empty, got shape \(2, 3\)"):
        MatrixGraph(np.zeros((2, 3)))


def test_weights_are_read_only() -> None:
    g = graph("exponential-2", 4)
    with pytest.raises(ValueError):
        g.weights[0, 0] = 1.0
    w = g.matrix(0)
    w[0, 0] = 7.0  # a copy: the graph is unchanged
    assert g.matrix(0)[0, 0] == pytest.approx(1 / 3)

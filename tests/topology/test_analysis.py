"""Stochasticity checks, rho, period products and consensus by repeated averaging."""

from __future__ import annotations

import math

import numpy as np
import pytest

from totalreduce.topology import (
    Graph,
    get_topology,
    is_column_stochastic,
    is_doubly_stochastic,
    is_row_stochastic,
    period_matrix,
    rho,
    rho_period,
    spectral_gap,
)


def test_stochastic_checks() -> None:
    rows_only = np.array([[0.5, 0.5], [1.0, 0.0]])
    assert is_row_stochastic(rows_only) and not is_column_stochastic(rows_only)
    assert is_column_stochastic(rows_only.T) and not is_row_stochastic(rows_only.T)
    assert is_doubly_stochastic(np.full((3, 3), 1 / 3))
    nearly = np.array([[0.5, 0.5 + 1e-6], [0.5, 0.5]])
    assert not is_row_stochastic(nearly)
    assert is_row_stochastic(nearly, tol=1e-5)
    negative = np.array([[1.5, -0.5], [0.5, 0.5]])
    assert not is_row_stochastic(negative)
    with pytest.raises(ValueError, match=r"square matrix, got shape \(2, 3\)"):
        is_row_stochastic(np.zeros((2, 3)))


def test_rho_of_simple_matrices() -> None:
    assert rho([[1.0]]) == 0.0
    assert spectral_gap([[1.0]]) == 1.0
    assert spectral_gap(np.eye(3)) == pytest.approx(0.0)
    assert rho(np.full((5, 5), 0.2)) == pytest.approx(0.0, abs=1e-12)
    # Two components: eigenvalue 1 twice, so no consensus.
    assert rho(np.eye(4)) == pytest.approx(1.0)
    # Swapping two ranks: eigenvalue -1, periodic, no consensus.
    assert rho([[0.0, 1.0], [1.0, 0.0]]) == pytest.approx(1.0)
    # A non-symmetric matrix: complex eigenvalues compared by modulus.
    n = 7
    right = 0.5 * (np.eye(n) + np.roll(np.eye(n), 1, axis=1))
    assert rho(right) == pytest.approx(math.cos(math.pi / n), abs=1e-12)


def test_period_matrix_multiplies_in_step_order() -> None:
    topo = get_topology("ring", 6)
    w0, w1 = topo.matrix(0), topo.matrix(1)
    assert not np.allclose(w1 @ w0, w0 @ w1)
    np.testing.assert_allclose(period_matrix(topo), w1 @ w0)
    assert rho_period(topo) == pytest.approx(rho(w1 @ w0))
    graph = get_topology("exponential-2", 6)
    np.testing.assert_allclose(period_matrix(graph), graph.matrix(0))


SYMMETRIC_OR_NORMAL = [
    ("ring-graph", {}),
    ("symmetric-exponential", {}),
    ("mesh-grid-2d", {}),
    ("star", {}),
    ("fully-connected", {}),
    # Circulant, hence normal: the same bound holds.
    ("exponential-2", {}),
    ("exponential", {"base": 3}),
]


@pytest.mark.parametrize("n", [2, 3, 5, 8, 12, 16, 25, 33])
@pytest.mark.parametrize("name, options", SYMMETRIC_OR_NORMAL)
def test_consensus_error_is_bounded_by_rho_to_the_k(
    n: int, name: str, options: dict[str, object]
) -> None:
    g = get_topology(name, n, **options)
    assert isinstance(g, Graph)
    w = g.matrix(0)
    r = rho(w)
    rng = np.random.default_rng(n)
    x = rng.standard_normal((n, 4))
    mean = x.mean(axis=0)
    initial = np.linalg.norm(x - mean)
    for k in range(1, 61):
        x = w @ x
        np.testing.assert_allclose(x.mean(axis=0), mean, atol=1e-12)  # the mean is kept
        assert np.linalg.norm(x - mean) <= r**k * initial * (1 + 1e-9) + 1e-12
    if r < 0.9:
        np.testing.assert_allclose(x, np.broadcast_to(mean, x.shape), atol=1e-3)


@pytest.mark.parametrize("n", [3, 6, 9, 16, 20])
def test_edge_topologies_converge_period_by_period(n: int) -> None:
    for name in ("ring", "exp"):
        topo = get_topology(name, n)
        rng = np.random.default_rng(n)
        x = rng.standard_normal(n)
        mean = x.mean()
        p = period_matrix(topo)
        for _ in range(200):
            x = p @ x
        np.testing.assert_allclose(x, mean, atol=1e-8)

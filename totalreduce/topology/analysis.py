"""Analysis of mixing matrices: stochasticity checks and the consensus rate rho.

This module owns the numbers that say whether and how fast repeated neighbor averaging
reaches the average: :func:`is_row_stochastic`, :func:`is_column_stochastic`,
:func:`is_doubly_stochastic`, :func:`rho` (and :func:`spectral_gap`, ``1 - rho``), and,
for periodic topologies, :func:`period_matrix` and :func:`rho_period`.

For a doubly stochastic ``W`` whose eigenvalues other than 1 lie strictly inside the
unit circle, ``x(k) = W x(k-1)`` converges to the average ``x*``; for a symmetric ``W``,
``||x(k) - x*|| <= rho**k ||x(0) - x*||``.
"""

from __future__ import annotations

import numpy as np

from .mixing import MixingTopology

#: Default tolerance of the stochasticity checks.
TOLERANCE = 1e-9


def _square(w: object) -> np.ndarray:
    a = np.asarray(w, dtype=float)
    if a.ndim != 2 or a.shape[0] != a.shape[1] or a.shape[0] < 1:
        raise ValueError(f"expected a non-empty square matrix, got shape {a.shape}")
    return a


def is_row_stochastic(w: object, tol: float = TOLERANCE) -> bool:
    """True if ``w`` has no entry below ``-tol`` and every row sums to 1 within ``tol``."""
    a = _square(w)
    return bool(np.all(a >= -tol) and np.all(np.abs(a.sum(axis=1) - 1.0) <= tol))


def is_column_stochastic(w: object, tol: float = TOLERANCE) -> bool:
    """True if ``w`` has no entry below ``-tol`` and every column sums to 1 within ``tol``."""
    return is_row_stochastic(_square(w).T, tol)


def is_doubly_stochastic(w: object, tol: float = TOLERANCE) -> bool:
    """True if ``w`` is both row and column stochastic within ``tol``."""
    return is_row_stochastic(w, tol) and is_column_stochastic(w, tol)


def rho(w: object) -> float:
    """``max(|lambda_2|, |lambda_n|)``: the largest modulus among the eigenvalues but one 1.

    Exactly one eigenvalue is set aside: the one closest to 1 (a row or column stochastic
    matrix always has 1 as an eigenvalue).  The result is the largest modulus of the others,
    so a second eigenvalue 1 (a disconnected graph) or -1 (a periodic one) gives
    ``rho = 1``: no consensus.  Symmetric matrices use the real symmetric eigensolver;
    others the general one, whose complex eigenvalues are compared by modulus.  For a
    non-symmetric ``W``, rho is the asymptotic rate per step, not a bound on every single
    step.  A 1 x 1 matrix has rho 0.
    """
    a = _square(w)
    if a.shape[0] == 1:
        return 0.0
    if np.allclose(a, a.T, rtol=0.0, atol=1e-12):
        values: np.ndarray = np.linalg.eigvalsh((a + a.T) / 2.0).astype(complex)
    else:
        values = np.linalg.eigvals(a)
    rest = np.delete(values, int(np.argmin(np.abs(values - 1.0))))
    return float(np.max(np.abs(rest)))


def spectral_gap(w: object) -> float:
    """``1 - rho(w)``: 0 means no consensus, 1 means exact averaging in one step."""
    return 1.0 - rho(w)


def period_matrix(topology: MixingTopology) -> np.ndarray:
    """The product ``W(p-1) @ ... @ W(1) @ W(0)`` over one period ``p`` of ``topology``.

    Applied to the ranks' values, it gives their values after one whole period.
    """
    product = np.eye(topology.world_size)
    for step in range(topology.period):
        product = topology.matrix(step) @ product
    return product


def rho_period(topology: MixingTopology) -> float:
    """:func:`rho` of :func:`period_matrix`: the consensus rate per period."""
    return rho(period_matrix(topology))

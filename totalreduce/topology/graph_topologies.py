"""The built-in static graphs (the BlueFog family) and their weights.

``exponential-2``, ``exponential``, ``symmetric-exponential``, ``mesh-grid-2d``, ``star``,
``ring-graph`` and ``fully-connected``.  Unless a graph says otherwise, rank ``i`` averages
itself and its in-neighbors with equal weights, ``1 / (indegree + 1)``.

Each class takes BlueFog's arguments, positionally or by BlueFog's keyword, and builds
the graph ``bluefog.common.topology_util`` builds (the same weights, transposed: see the
package docstring): ``RingGraph(size, connect_style=1)``, ``ExponentialGraph(size, 3)``,
``MeshGrid2DGraph(size, shape=(2, 4))``, ``StarGraph(size, center_rank=2)``,
``SymmetricExponentialGraph(size, base=4)``.  ``RingGraph``'s ``style=`` and
``StarGraph``'s ``center=`` are this package's spellings of the same options.

Most of these graphs are circulant: rank ``i`` sends to ``i + d`` for every offset ``d`` of
a fixed set (mod ``n``), so it receives from ``i - d``; then ``W[i, (i - d) % n]`` is the
uniform weight and every row and column holds the same weights, so ``W`` is doubly
stochastic.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np

from .graph_model import Graph
from .registry import register


def circulant(n: int, offsets: Iterable[int]) -> np.ndarray:
    """``W`` for "rank ``i`` sends to ``i + d`` for each ``d`` in ``offsets``", uniform weights.

    Offsets are taken mod ``n``; zero (the rank itself) is ignored.
    """
    ds = sorted({d % n for d in offsets} - {0})
    weight = 1.0 / (len(ds) + 1)
    w = np.zeros((n, n))
    rows = np.arange(n)
    w[rows, rows] = weight
    for d in ds:
        w[rows, (rows - d) % n] = weight
    return w


def powers(base: int, below: int) -> list[int]:
    """The powers ``1, base, base**2, ...`` that are smaller than ``below``."""
    out = []
    p = 1
    while p < below:
        out.append(p)
        p *= base
    return out


def _check_base(base: object, name: str) -> int:
    if isinstance(base, bool) or not isinstance(base, int) or base < 2:
        raise ValueError(f"{name} needs an integer base >= 2, got base={base!r}")
    return base


@register("exponential")
class ExponentialGraph(Graph):
    """Rank ``i`` sends to ``i + b**k`` for every power ``b**k < n`` (``b = base``, default 2).

    So rank ``i`` receives from ``i - b**k`` (mod ``n``), with uniform weights
    ``1 / (number of powers + 1)``.  With base 2 this is ``exponential-2``.  BlueFog's
    ``ExponentialGraph(size, base)``; the powers are found in integer arithmetic, so
    ``base**k`` is never missed (BlueFog's floating-point test misses 243 for base 3 and
    1000 for base 10: the graphs differ from BlueFog's from those sizes on).
    """

    def __init__(self, size: int, base: int = 2) -> None:
        self.base = _check_base(base, "the exponential graph")
        super().__init__(size)

    def _matrix(self) -> np.ndarray:
        n = self.world_size
        return circulant(n, powers(self.base, n))


@register("exponential-2")
class ExponentialTwoGraph(ExponentialGraph):
    """Rank ``i`` receives from ``i - 2**k`` for every ``2**k < n`` (BlueFog's default graph).

    Uniform weights ``1 / (floor(log2(n - 1)) + 2)`` for ``n >= 2`` (the powers of two below
    ``n``, plus the rank itself); for ``n`` a power of two that is
    ``1 / (log2 n + 1)`` and ``rho(W) = 1 - 2 / (log2 n + 1)``: the eigenvalues of this
    circulant are ``(1 + sum_k omega**(j * 2**k)) / (log2 n + 1)`` and the one at
    ``j = n/2`` has ``omega**(n/2) = -1`` and every other term 1.
    """

    def __init__(self, size: int) -> None:
        super().__init__(size, base=2)


@register("symmetric-exponential")
class SymmetricExponentialGraph(Graph):
    """Rank ``i`` sends to ``i + d`` where ``min(d, n - d)`` is a power of ``base`` (default 4).

    The offsets up to ``n // 2`` are the powers of ``base``, the others mirror them, so the
    graph is undirected and ``W`` symmetric; uniform weights ``1 / (degree + 1)``.
    BlueFog's ``SymmetricExponentialGraph(size, base)``.
    """

    def __init__(self, size: int, base: int = 4) -> None:
        self.base = _check_base(base, "the symmetric exponential graph")
        super().__init__(size)

    def _matrix(self) -> np.ndarray:
        n = self.world_size
        near = set(powers(self.base, n // 2 + 1))
        return circulant(n, [d for d in range(1, n) if min(d, n - d) in near])


def grid_shape(n: int) -> tuple[int, int]:
    """The most square ``(rows, cols)`` with ``rows * cols == n`` and ``rows <= cols``."""
    rows = math.isqrt(n)
    while n % rows:
        rows -= 1
    return rows, n // rows


@register("mesh-grid-2d")
class MeshGrid2DGraph(Graph):
    """A 2-D grid (no wrap-around) with Metropolis-Hastings weights.

    Ranks fill ``shape = (rows, cols)`` row by row (default: the most square factorisation,
    ``rows <= cols``; a prime ``n`` gives a line).  Rank ``i`` is linked to its left,
    right, upper and lower neighbors.  The weights are not uniform: with ``d_i`` the number
    of neighbors of ``i``, ``W[i, j] = 1 / (max(d_i, d_j) + 1)`` for each neighbor ``j`` and
    ``W[i, i]`` takes the rest, which keeps ``W`` symmetric and doubly stochastic although
    the degrees differ between corners, borders and the inside.  BlueFog's
    ``MeshGrid2DGraph(size, shape)``.
    """

    def __init__(self, size: int, shape: tuple[int, int] | None = None) -> None:
        if shape is None:
            if isinstance(size, int) and size >= 1:
                shape = grid_shape(size)
        else:
            try:
                rows, cols = (int(v) for v in shape)
            except (TypeError, ValueError):
                raise ValueError(f"mesh shape must be (rows, cols), got {shape!r}") from None
            if rows < 1 or cols < 1 or rows * cols != size:
                raise ValueError(
                    f"mesh shape {tuple(shape)} does not hold world size {size}; "
                    "rows * cols must equal it"
                )
            shape = (rows, cols)
        self.shape = shape
        super().__init__(size)

    def neighbors(self, rank: int) -> list[int]:
        """The grid neighbors of ``rank``, sorted."""
        assert self.shape is not None
        cols = self.shape[1]
        n = self.world_size
        out = []
        if rank - cols >= 0:
            out.append(rank - cols)
        if rank % cols:
            out.append(rank - 1)
        if (rank + 1) % cols and rank + 1 < n:
            out.append(rank + 1)
        if rank + cols < n:
            out.append(rank + cols)
        return out

    def _matrix(self) -> np.ndarray:
        n = self.world_size
        links = [self.neighbors(i) for i in range(n)]
        w = np.zeros((n, n))
        for i in range(n):
            for j in links[i]:
                w[i, j] = 1.0 / (max(len(links[i]), len(links[j])) + 1)
            w[i, i] = 1.0 - w[i].sum()
        return w


@register("star")
class StarGraph(Graph):
    """Every rank is linked both ways to ``center`` (default 0).

    The weights are not uniform (uniform ones would not be column stochastic): the
    center takes the plain average of all ranks, ``W[c, j] = 1/n``; every other rank keeps
    ``1 - 1/n`` of its value and takes ``1/n`` from the center.  ``W`` is symmetric and
    doubly stochastic.  BlueFog's ``StarGraph(size, center_rank)``; ``center=`` is the
    same option.
    """

    def __init__(self, size: int, center_rank: int = 0, *, center: int | None = None) -> None:
        if center is not None and center != center_rank and center_rank != 0:
            raise ValueError(
                f"center={center!r} and center_rank={center_rank!r} disagree; pass one of them"
            )
        if center is None:
            center = center_rank
        if isinstance(center, bool) or not isinstance(center, int):
            raise TypeError(f"center must be an int, got {center!r}")
        if isinstance(size, int) and not 0 <= center < max(size, 1):
            raise ValueError(f"center {center} is out of range for world size {size}")
        self.center = center
        super().__init__(size)

    def _matrix(self) -> np.ndarray:
        n, c = self.world_size, self.center
        w = np.eye(n) * (1.0 - 1.0 / n)
        w[:, c] = 1.0 / n
        w[c, :] = 1.0 / n
        return w


#: The ring's styles; the index of each is BlueFog's ``connect_style``.
RING_STYLES = ("bidirectional", "left", "right")


@register("ring-graph")
class RingGraph(Graph):
    """A static ring in one of three styles, uniform weights.

    - ``bidirectional`` (default; BlueFog's ``connect_style=0``): rank ``i`` receives from
      ``i - 1`` and ``i + 1``, weight 1/3 each (1/2 for ``n = 2``, where both are the same
      rank);
    - ``left`` (``connect_style=1``): every rank sends to its left neighbor ``i - 1``, so
      receives from ``i + 1``; weight 1/2;
    - ``right`` (``connect_style=2``): every rank sends to its right neighbor ``i + 1``, so
      receives from ``i - 1``; weight 1/2.

    For ``n = 1`` the rank keeps its value.  BlueFog's ``RingGraph(size, connect_style)``;
    ``style=`` names the same choice.
    """

    def __init__(
        self, size: int, connect_style: int | None = None, *, style: str | None = None
    ) -> None:
        if connect_style is not None:
            if (
                isinstance(connect_style, bool)
                or not isinstance(connect_style, int)
                or not 0 <= connect_style < len(RING_STYLES)
            ):
                raise ValueError(
                    "connect_style must be 0 (bidirectional), 1 (left) or 2 (right), got "
                    f"{connect_style!r}"
                )
            named = RING_STYLES[connect_style]
            if style is not None and style != named:
                raise ValueError(
                    f"connect_style={connect_style} is the {named!r} ring but style={style!r} "
                    "was given too; pass one of them"
                )
            style = named
        if style is None:
            style = "bidirectional"
        if style not in RING_STYLES:
            raise ValueError(f"unknown ring-graph style {style!r}; known: {', '.join(RING_STYLES)}")
        self.style = style
        super().__init__(size)

    @property
    def connect_style(self) -> int:
        """BlueFog's number for the style: 0 bidirectional, 1 left, 2 right."""
        return RING_STYLES.index(self.style)

    def _matrix(self) -> np.ndarray:
        offsets = {"bidirectional": (1, -1), "left": (-1,), "right": (1,)}[self.style]
        return circulant(self.world_size, offsets)


@register("fully-connected")
class FullyConnectedGraph(Graph):
    """Every rank receives from every other: ``W = J/n``.  BlueFog's
    ``FullyConnectedGraph(size)``."""

    def __init__(self, size: int) -> None:
        super().__init__(size)

    def _matrix(self) -> np.ndarray:
        n = self.world_size
        return np.full((n, n), 1.0 / n)

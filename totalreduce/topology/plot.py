"""Drawing a topology: ranks on a circle, an arrow from each sender to each receiver.

This module owns :func:`plot_topology`, the only code of the package that needs
matplotlib (an optional dependency: ``pip install totalreduce[plot]``).  It draws with
the Agg canvas directly, so it neither needs a display nor changes pyplot's global
backend.
"""

from __future__ import annotations

import math
import os

from .analysis import rho
from .mixing import MixingTopology

INSTALL_HINT = "drawing a topology needs matplotlib; install it with: pip install totalreduce[plot]"


def plot_topology(
    topology: MixingTopology, path: str | os.PathLike[str], step: int = 0, dpi: int = 120
) -> None:
    """Draw ``W(step)`` of ``topology`` to the image file ``path`` (PNG by its suffix).

    Rank ``i`` sits at angle ``2*pi*i/n`` on a circle; an arrow ``j -> i`` means ``i``
    receives from ``j`` (``W[i, j] > 0``).  Raises ImportError with the install hint if
    matplotlib is missing.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError(INSTALL_HINT) from exc

    w = topology.matrix(step)
    n = topology.world_size
    pos = [
        (math.cos(math.pi / 2 - 2 * math.pi * i / n), math.sin(math.pi / 2 - 2 * math.pi * i / n))
        for i in range(n)
    ]
    fig = Figure(figsize=(6, 6))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    node_points = 14.0 if n <= 16 else max(6.0, 220.0 / n)
    for i in range(n):
        for j in range(n):
            if i != j and w[i, j] > 0.0:
                ax.annotate(
                    "",
                    xy=pos[i],
                    xytext=pos[j],
                    arrowprops={
                        "arrowstyle": "-|>",
                        "color": "tab:blue",
                        "alpha": 0.6,
                        "lw": 1.0,
                        "shrinkA": node_points,
                        "shrinkB": node_points,
                        # A slight bend keeps the two arrows of a two-way link apart.
                        "connectionstyle": "arc3,rad=0.12",
                    },
                )
    for i, (x, y) in enumerate(pos):
        ax.plot(
            [x], [y], "o", ms=2 * node_points, mfc="white", mec="black", zorder=3, clip_on=False
        )
        ax.text(x, y, str(i), ha="center", va="center", fontsize=9, zorder=4)
    label = topology.name or type(topology).__name__
    ax.set_title(
        f"{label}, n={n}, step {step % topology.period} of {topology.period}, rho={rho(w):.4f}"
    )
    ax.set_xlim(-1.25, 1.25)
    ax.set_ylim(-1.25, 1.25)
    ax.set_aspect("equal")
    ax.axis("off")
    fig.savefig(os.fspath(path), dpi=dpi)

"""The examples' shared task: a synthetic spiral classification set, its model, its plot.

Every rank generates the same data set from the same seed (nothing to download)
and trains on its own shard of it.  The model is a small MLP; ``SlowBackward``
lets a run make some ranks slower than others in the backward pass, to show
what a straggler costs.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence

import torch

CLASSES = 3


def spiral(
    points_per_class: int, seed: int, noise: float = 0.5
) -> tuple[torch.Tensor, torch.Tensor]:
    """``CLASSES`` interleaved 2-D spiral arms: inputs ``(N, 2)`` and labels ``(N,)``.

    >>> x, y = spiral(100, seed=0)
    >>> x.shape, y.shape
    (torch.Size([300, 2]), torch.Size([300]))
    """
    g = torch.Generator().manual_seed(seed)
    xs, ys = [], []
    for c in range(CLASSES):
        r = torch.linspace(0.1, 1.0, points_per_class)
        angle = r * 4.0 + c * 2.0 * math.pi / CLASSES
        angle = angle + noise * torch.randn(points_per_class, generator=g)
        xs.append(torch.stack([r * torch.sin(angle), r * torch.cos(angle)], dim=1))
        ys.append(torch.full((points_per_class,), c, dtype=torch.long))
    x, y = torch.cat(xs), torch.cat(ys)
    order = torch.randperm(len(y), generator=g)
    return x[order], y[order]


def shard(
    x: torch.Tensor, y: torch.Tensor, rank: int, size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's equal share of the data set (the remainder is dropped)."""
    n = len(y) // size
    return x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]


def batches(
    x: torch.Tensor, y: torch.Tensor, batch_size: int, epoch: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Shuffled mini-batches of one epoch (the same number on every rank)."""
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(epoch))
    for i in range(0, len(y) - batch_size + 1, batch_size):
        idx = order[i : i + batch_size]
        yield x[idx], y[idx]


class SlowBackward(torch.autograd.Function):
    """Identity forward; the backward pass sleeps ``seconds`` before passing the gradient on."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, seconds: float) -> torch.Tensor:  # type: ignore[override]
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        if ctx.seconds > 0:
            time.sleep(ctx.seconds)
        return grad, None


class SpiralNet(torch.nn.Module):
    """MLP ``2 -> hidden -> hidden -> hidden -> CLASSES``; backward sleeps ``delay_s`` midway."""

    def __init__(self, hidden: int = 128, delay_s: float = 0.0) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(2, hidden)
        self.mid1 = torch.nn.Linear(hidden, hidden)
        self.mid2 = torch.nn.Linear(hidden, hidden)
        self.out = torch.nn.Linear(hidden, CLASSES)
        self.delay_s = delay_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        h = torch.relu(self.mid1(h))
        h = SlowBackward.apply(h, self.delay_s)  # the layers after this one finish first
        h = torch.relu(self.mid2(h))
        return self.out(h)


def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """The fraction of ``x`` that ``model`` classifies as ``y``."""
    with torch.no_grad():
        return float((model(x).argmax(dim=1) == y).float().mean())


def plot_losses(
    path: str, curves: dict[str, Sequence[float]], title: str, ylabel: str = "training loss"
) -> None:
    """Draw one line per curve against the epoch into ``path`` (a PNG).

    An empty ``path`` (``--plot ''``) draws nothing; so does a missing matplotlib, with a notice.
    """
    if not path:
        return
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install matplotlib): no plot drawn")
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, values in curves.items():
        ax.plot(range(1, len(values) + 1), values, marker="o", markersize=3, label=label)
    ax.set_xlabel("epoch")
    ax.set_ylabel(ylabel)
    ax.set_yscale("log")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"loss curves written to {path}")

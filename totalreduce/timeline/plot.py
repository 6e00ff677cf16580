"""Drawing a trace as a PNG: one row per rank, each op a bar colored by its priority.

Ops that overlap in time on one rank share its row in thin lanes, so every bar stays visible.
Under each rank's ops a dark strip shows when its threads were blocked in ``wait()``. Needs
matplotlib (``pip install totalreduce[plot]``); it draws with the Agg canvas directly, so it
neither needs a display nor changes pyplot's global backend.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from .trace import TraceError


def _lanes(bars: list[tuple[float, float]]) -> list[int]:
    """A lane per bar (in the given order) such that bars of one lane do not overlap."""
    ends: list[float] = []
    lanes = []
    for t0, t1 in bars:
        for k, end in enumerate(ends):
            if end <= t0:
                ends[k] = t1
                lanes.append(k)
                break
        else:
            ends.append(t1)
            lanes.append(len(ends) - 1)
    return lanes


def plot(
    events: Sequence[dict[str, Any]],
    path: str | os.PathLike[str],
    title: str = "",
    last_ms: float = 0.0,
) -> None:
    """Draw the ops (``cat`` "op") and waits (``cat`` "wait") of ``events`` into ``path``.

    ``last_ms`` > 0 draws only the last that many milliseconds of the trace (a training
    job's last steps, not its start-up).  Raises
    :class:`~totalreduce.timeline.trace.TraceError` if there is no op to draw.
    """
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    ops = [e for e in events if e.get("ph") == "X" and e.get("cat") == "op"]
    if not ops:
        raise TraceError("the trace has no op to draw")
    waits = [e for e in events if e.get("ph") == "X" and e.get("cat") == "wait"]
    if last_ms > 0:
        end = max(e["ts"] + e["dur"] for e in ops + waits)
        start = end - last_ms * 1000.0
        ops = [e for e in ops if e["ts"] + e["dur"] >= start]
        waits = [e for e in waits if e["ts"] + e["dur"] >= start]
    ranks = sorted({int(e["pid"]) for e in ops})
    row = {r: i for i, r in enumerate(ranks)}
    t_origin = min(e["ts"] for e in ops + waits)
    priorities = sorted({int(e["args"].get("priority", 0)) for e in ops})
    cmap = matplotlib.colormaps["viridis"].resampled(max(len(priorities), 2))
    color = {p: cmap(k) for k, p in enumerate(priorities)}

    fig = Figure(figsize=(10, 1.0 + 0.9 * len(ranks)))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    for r in ranks:
        mine = sorted((e for e in ops if e["pid"] == r), key=lambda e: e["ts"])
        spans = [(e["ts"], e["ts"] + e["dur"]) for e in mine]
        lanes = _lanes(spans)
        height = 0.7 / max(max(lanes) + 1, 1)
        for e, lane in zip(mine, lanes, strict=True):
            y = row[r] - 0.35 + lane * height
            x0 = (e["ts"] - t_origin) / 1000.0
            width = e["dur"] / 1000.0
            failed = e["args"].get("status") not in (None, "done")
            ax.broken_barh(
                [(x0, width)],
                (y, height * 0.9),
                facecolors=color[int(e["args"].get("priority", 0))],
                edgecolors="red" if failed else "white",
                linewidth=0.5,
            )
        for e in waits:
            if e["pid"] == r:
                x0 = (e["ts"] - t_origin) / 1000.0
                ax.broken_barh([(x0, e["dur"] / 1000.0)], (row[r] - 0.45, 0.08), facecolors="k")
    ax.set_yticks(range(len(ranks)))
    ax.set_yticklabels([f"rank {r}" for r in ranks])
    ax.set_ylim(len(ranks) - 0.5, -0.5)
    ax.set_xlabel("time (ms)")
    if len(priorities) <= 8:
        legend = [Patch(color=color[p], label=f"priority {p}") for p in priorities]
    else:  # many priorities (one per layer): a color bar reads better than a long legend
        from matplotlib.cm import ScalarMappable
        from matplotlib.colors import Normalize

        bar = ScalarMappable(
            Normalize(priorities[0], priorities[-1]), matplotlib.colormaps["viridis"]
        )
        fig.colorbar(bar, ax=ax, label="priority", pad=0.01)
        legend = []
    if waits:
        legend.append(Patch(color="k", label="wait()"))
    if legend and len(priorities) <= 8:
        ax.legend(handles=legend, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    elif legend:  # the color bar is on the right: the wait strip's key goes under the axes
        ax.legend(handles=legend, loc="upper right", bbox_to_anchor=(1.0, -0.12), fontsize="small")
    ax.set_title(title or f"{len(ops)} ops on {len(ranks)} rank(s)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)

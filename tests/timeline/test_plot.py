"""Drawing a trace: a PNG, one row per rank."""

from __future__ import annotations

from pathlib import Path

import pytest

from totalreduce.timeline import Timeline, TraceError, load
from totalreduce.timeline.plot import _lanes, plot

pytest.importorskip("matplotlib", reason="plotting needs matplotlib")

MS = 1_000_000


def test_lanes_never_overlap() -> None:
    assert _lanes([(0, 5), (1, 2), (2, 3), (5, 6), (3, 9)]) == [0, 1, 1, 0, 1]


def test_plot_writes_a_png(tmp_path: Path) -> None:
    tl = Timeline(str(tmp_path / "t"), rank=0)
    t = tl.start_perf_ns
    for k in range(6):
        tl.op(f"g{k}", 0, "submitted", k % 3, t + k * MS)
        tl.op(f"g{k}", 0, "done", k % 3, t + k * MS + 4 * MS)
    tl.wait("g5", 0, t + 6 * MS, t + 9 * MS)
    tl.close()
    png = tmp_path / "step.png"
    plot(load(tmp_path / "t.0.json"), png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_size > 2000


def test_plot_refuses_a_trace_without_ops(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="no op"):
        plot([{"name": "x", "ph": "M", "pid": 0, "args": {}}], tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


def test_plot_many_priorities_and_a_window(tmp_path: Path) -> None:
    """One priority per layer draws a color bar; --last-ms keeps only the last ops."""
    tl = Timeline(str(tmp_path / "t"), rank=0)
    t = tl.start_perf_ns
    for k in range(40):
        tl.op(f"layer{k}", 0, "submitted", k, t + k * 10 * MS)
        tl.op(f"layer{k}", 0, "done", k, t + k * 10 * MS + 2 * MS)
    tl.close()
    events = load(tmp_path / "t.0.json")
    plot(events, tmp_path / "all.png")
    plot(events, tmp_path / "last.png", last_ms=25.0)
    for name in ("all.png", "last.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(TraceError, match="no op"):  # a window with nothing in it
        plot([e for e in events if e.get("cat") != "op"], tmp_path / "none.png", last_ms=25.0)

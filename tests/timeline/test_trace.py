"""Merging the ranks' traces: clocks aligned, one process per rank."""

from __future__ import annotations

from pathlib import Path

import pytest

from totalreduce.timeline import Timeline, TraceError, load, merge, write

MS = 1_000_000


def rank_file(tmp_path: Path, rank: int, wall_start_ns: int, sync_ns: int = 0) -> Path:
    """A rank's trace whose recorder started at ``wall_start_ns`` on its wall clock, with one
    op submitted 1 ms after that start and done 2 ms later."""
    tl = Timeline(str(tmp_path / "t"), rank=rank)
    # as if this rank's process had started its clock at another moment
    tl.wall_minus_perf_ns = wall_start_ns - tl.start_perf_ns
    t = tl.start_perf_ns
    tl.op("g", 0, "submitted", 0, t + MS)
    tl.op("g", 0, "done", 0, t + 3 * MS)
    if sync_ns:
        tl.sync(sync_ns)
    tl.close()
    return tmp_path / f"t.{rank}.json"


def op_of(events: list[dict], rank: int) -> dict:
    (e,) = [e for e in events if e.get("cat") == "op" and e["pid"] == rank]
    return e


def test_merge_aligns_two_ranks(tmp_path: Path) -> None:
    base = 1_700_000_000 * 10**9
    f0 = rank_file(tmp_path, 0, base + 5 * MS)  # rank 0's recorder started 5 ms later
    f1 = rank_file(tmp_path, 1, base)
    merged = merge([f0, f1])
    assert op_of(merged, 1)["ts"] == 1000.0  # rank 1 started first: its times stay
    assert op_of(merged, 0)["ts"] == 6000.0  # rank 0's move by 5 ms
    names = {e["pid"]: e["args"]["name"] for e in merged if e.get("name") == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1"}

    out = tmp_path / "merged.json"
    write(out, merged)
    assert load(out) == merged


def test_merge_applies_the_sync_offset(tmp_path: Path) -> None:
    base = 1_700_000_000 * 10**9
    # rank 1's wall clock runs 2 ms behind: it says it started 2 ms before rank 0, but its
    # sync offset moves it back onto rank 0's clock
    f0 = rank_file(tmp_path, 0, base)
    f1 = rank_file(tmp_path, 1, base - 2 * MS, sync_ns=2 * MS)
    merged = merge([f1, f0])
    assert op_of(merged, 0)["ts"] == op_of(merged, 1)["ts"] == 1000.0


def test_merge_refuses_two_files_of_one_rank(tmp_path: Path) -> None:
    f0 = rank_file(tmp_path, 0, 0)
    with pytest.raises(TraceError, match="both traces of rank 0"):
        merge([f0, f0])


def test_merge_refuses_a_file_without_a_clock(tmp_path: Path) -> None:
    bad = tmp_path / "other.json"
    bad.write_text('[{"name": "x", "ph": "X", "ts": 0, "dur": 1, "pid": 0, "tid": 0}]')
    with pytest.raises(TraceError, match="no totalreduce_clock"):
        merge([bad])
    (tmp_path / "junk.json").write_text("not json")
    with pytest.raises(TraceError, match="not a JSON trace"):
        load(tmp_path / "junk.json")


def test_load_leaves_out_an_event_cut_in_the_middle(tmp_path: Path) -> None:
    path = rank_file(tmp_path, 0, 0)
    text = path.read_text().rstrip().removesuffix("]").rstrip()
    path.write_text(text + ',\n{"name":"cut","ph":"X","ts":1')  # the writer died here
    events = load(path)
    assert [e["name"] for e in events if e.get("cat") == "op"] == ["g"]
    assert all(e["name"] != "cut" for e in events)

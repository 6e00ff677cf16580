"""The timeline recorder: events written, the JSON parses, every op has a beginning and an end."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from totalreduce.timeline import Timeline, load, timeline_path
from totalreduce.timeline.recorder import CLOCK_EVENT, MAX_LANES, SYNC_EVENT

MS = 1_000_000


def record_step(tl: Timeline, t: int) -> None:
    """Two overlapping ops with segments, reductions and a wait, from ``t`` (ns) on."""
    for name, prio, off in (("fc1.grad", 10, 0), ("fc2.grad", 0, MS)):
        tl.op(name, 0, "submitted", prio, t + off)
        tl.segment(name, 0, "send", 1, 4096, t + off + MS, t + off + 2 * MS)
        tl.segment(name, 0, "recv", 1, 4096, t + off + MS, t + off + 3 * MS)
        tl.op(name, 0, "first_send", prio, t + off + MS)
        tl.op(name, 0, "last_recv", prio, t + off + 3 * MS)
        tl.compute(name, 0, "reduce", 4096, t + off + 3 * MS, t + off + 4 * MS)
        tl.op(name, 0, "done", prio, t + off + 4 * MS)
    tl.wait("fc1.grad", 0, t + 2 * MS, t + 4 * MS)


def slices(events: list[dict], cat: str) -> list[dict]:
    return [e for e in events if e.get("ph") == "X" and e.get("cat") == cat]


def track_names(events: list[dict]) -> dict[int, str]:
    return {
        e["tid"]: e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e["name"] == "thread_name"
    }


def test_path_per_rank() -> None:
    assert timeline_path("run/t-{rank}.json", 2) == "run/t-2.json"
    assert timeline_path("run/t", 2) == "run/t.2.json"


def test_events_written_and_parsed(tmp_path: Path) -> None:
    tl = Timeline(str(tmp_path / "t"), rank=3)
    t = tl.start_perf_ns
    record_step(tl, t)
    tl.sync(1234)
    tl.close()
    text = (tmp_path / "t.3.json").read_text()
    events = json.loads(text)  # a complete JSON array: the closing bracket is there
    assert all(e["pid"] == 3 for e in events)
    names = track_names(events)
    meta = {e["name"]: e["args"] for e in events if e["ph"] == "M" and "tid" not in e}
    assert meta["process_name"] == {"name": "rank 3"}
    assert meta[CLOCK_EVENT]["rank"] == 3
    assert meta[SYNC_EVENT] == {"offset_ns": 1234}

    ops = {e["name"]: e for e in slices(events, "op")}
    assert set(ops) == {"fc1.grad", "fc2.grad"}
    fc1 = ops["fc1.grad"]
    assert fc1["ts"] == 0.0 and fc1["dur"] == 4000.0  # microseconds since the recorder started
    assert fc1["args"]["status"] == "done"
    assert fc1["args"]["priority"] == 10
    assert fc1["args"]["waited_on_by"] == [threading.current_thread().name]
    assert names[fc1["tid"]] == "ops, priority 10"
    # the two ops overlap, but each priority has its own track
    assert names[ops["fc2.grad"]["tid"]] == "ops, priority 0"
    phases = [e for e in slices(events, "op.phase") if e["tid"] == fc1["tid"]]
    assert [p["name"] for p in phases] == ["queued", "on the wire", "reducing"]
    assert [p["dur"] for p in phases] == [1000.0, 2000.0, 1000.0]

    segs = slices(events, "segment")
    assert sorted(names[s["tid"]] for s in segs) == [
        "recv from rank 1",
        "recv from rank 1 (2)",  # the two ops' receives overlap: a second lane
        "send to rank 1",
        "send to rank 1",  # these do not
    ]
    assert all(s["args"]["bytes"] == 4096 and s["args"]["peer"] == 1 for s in segs)
    comp = slices(events, "compute")
    assert {names[c["tid"]] for c in comp} == {threading.current_thread().name}
    assert [c["args"]["op"] for c in comp] == ["fc1.grad", "fc2.grad"]
    (wait,) = slices(events, "wait")
    assert wait["args"] == {"op": "fc1.grad", "generation": 0}
    assert wait["dur"] == 2000.0


def test_no_two_slices_of_a_track_overlap(tmp_path: Path) -> None:
    tl = Timeline(str(tmp_path / "t"), rank=0, flush_every=7)
    t = tl.start_perf_ns
    for k in range(40):  # each op lasts 5 ms, a new one every ms
        tl.op(f"g{k}", 0, "submitted", k % 3, t + k * MS)
        tl.segment(f"g{k}", 0, "send", 1, 8, t + k * MS, t + k * MS + 3 * MS)
        tl.op(f"g{k}", 0, "done", k % 3, t + k * MS + 5 * MS)
    tl.close()
    events = load(tmp_path / "t.0.json")
    tops = slices(events, "op") + slices(events, "segment")
    assert len(tops) == 80
    by_track: dict[int, list[tuple[float, float]]] = {}
    for e in tops:
        by_track.setdefault(e["tid"], []).append((e["ts"], e["ts"] + e["dur"]))
    assert len(by_track) > 3  # overlaps forced extra lanes
    for spans in by_track.values():
        spans.sort()
        for (_, end), (start, _) in zip(spans, spans[1:], strict=False):
            assert end <= start


def test_every_op_has_a_beginning_and_an_end(tmp_path: Path) -> None:
    tl = Timeline(str(tmp_path / "t.json"), rank=0, flush_every=5)
    t = tl.start_perf_ns
    tl.op("a", 0, "submitted", 0, t)
    tl.op("a", 0, "done", 0, t + MS)
    tl.op("b", 4, "submitted", 1, t + MS)
    tl.op("b", 4, "failed", 1, t + 2 * MS)
    tl.op(7, 0, "submitted", 0, t + 2 * MS)  # still in flight at close
    tl.op(7, 0, "first_send", 0, t + 3 * MS)
    tl.close()
    ops = {e["name"]: e for e in slices(load(tmp_path / "t.json.0.json"), "op")}
    assert {k: v["args"]["status"] for k, v in ops.items()} == {
        "a": "done",
        "b": "failed",
        "7": "unfinished",
    }
    assert ops["b"]["args"]["generation"] == 4
    assert ops["7"]["dur"] == 1000.0  # up to the last moment recorded


def test_a_crashed_job_leaves_a_readable_trace(tmp_path: Path) -> None:
    tl = Timeline(str(tmp_path / "t"), rank=1, flush_interval_s=0.02)
    t = tl.start_perf_ns
    for k in range(30):
        tl.segment("x", 0, "recv", 0, 64, t + k * MS, t + k * MS + 10)
    # no close(): the writer thread puts the records on disk by itself, without the closing
    # bracket, and the trace reads back
    path = tmp_path / "t.1.json"
    deadline = time.monotonic() + 30
    while not (path.exists() and path.read_text().count('"cat":"segment"') == 30):
        assert time.monotonic() < deadline, "the writer thread wrote nothing within 30 s"
        time.sleep(0.01)
    text = path.read_text()
    assert not text.rstrip().endswith("]")
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)
    assert len(slices(load(path), "segment")) == 30
    tl.close()
    assert len(slices(json.loads(path.read_text()), "segment")) == 30


def test_many_records_wake_the_writer_early(tmp_path: Path) -> None:
    tl = Timeline(str(tmp_path / "t"), rank=0, flush_every=100, flush_interval_s=3600)
    t = tl.start_perf_ns
    for k in range(250):
        tl.compute("x", k, "reduce", 8, t, t + 1)
    path = tmp_path / "t.0.json"
    deadline = time.monotonic() + 30
    while not (path.exists() and path.read_text().count('"cat":"compute"') >= 200):
        assert time.monotonic() < deadline, "flush_every records did not wake the writer"
        time.sleep(0.01)
    tl.close()
    assert len(slices(load(path), "compute")) == 250


def test_appends_from_several_threads_are_all_written(tmp_path: Path) -> None:
    tl = Timeline(str(tmp_path / "t"), rank=0, flush_every=50)

    def body(k: int) -> None:
        for i in range(500):
            t = tl.start_perf_ns + i * 1000
            tl.compute(f"op{k}", i, "reduce", 8, t, t + 10)

    threads = [threading.Thread(target=body, args=(k,), name=f"reducer-{k}") for k in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    tl.close()
    events = load(tmp_path / "t.0.json")
    comp = slices(events, "compute")
    assert len(comp) == 2000
    names = track_names(events)
    assert {names[c["tid"]] for c in comp} == {f"reducer-{k}" for k in range(4)}


def test_close_twice_and_records_after_close(tmp_path: Path) -> None:
    tl = Timeline(str(tmp_path / "t"), rank=0)
    tl.op("a", 0, "submitted", 0)
    tl.op("a", 0, "done", 0)
    tl.close()
    tl.close()
    tl.op("b", 0, "submitted", 0)
    tl.flush()
    assert [e["name"] for e in slices(load(tmp_path / "t.0.json"), "op")] == ["a"]


def test_lanes_of_a_track_are_bounded(tmp_path: Path) -> None:
    tl = Timeline(str(tmp_path / "t"), rank=0)
    t = tl.start_perf_ns
    for k in range(3 * MAX_LANES):  # all at once: every one overlaps every other
        tl.segment("x", k, "send", 1, 8, t, t + MS)
    tl.close()
    events = load(tmp_path / "t.0.json")
    segs = slices(events, "segment")
    assert len(segs) == 3 * MAX_LANES
    assert len({s["tid"] for s in segs}) == MAX_LANES


def test_unknown_events_and_directions_raise_at_the_call(tmp_path: Path) -> None:
    with Timeline(str(tmp_path / "t"), rank=0) as tl:
        with pytest.raises(ValueError, match="unknown event 'sent'"):
            tl.op("a", 0, "sent", 0)
        with pytest.raises(ValueError, match="'send' or 'recv'"):
            tl.segment("a", 0, "out", 1, 8, 0, 1)

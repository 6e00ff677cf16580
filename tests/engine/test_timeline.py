"""The engine records into the timeline: every op's life on every rank, merged by clock."""

from __future__ import annotations

import numpy as np

from conftest import local_services, run_ranks
from totalreduce.timeline import load, merge


def test_two_rank_run_records_every_op_and_merges(tmp_path) -> None:
    """The main loop's ops: their stages and segments (``lane=False``: the compiled lane
    records op events only, see the next test)."""
    names = ["small", "large"]
    with local_services(2, timeline=str(tmp_path / "tl"), lane=False) as svcs:
        run_ranks(
            svcs,
            lambda s: [
                s.allreduce(np.ones(n), name=nm) for nm, n in zip(names, (10, 300_000), strict=True)
            ],
        )
    files = sorted(tmp_path.glob("tl.*.json"))
    assert [f.name for f in files] == ["tl.0.json", "tl.1.json"]
    for f in files:
        events = load(f)
        for nm in names:
            life = [e for e in events if e.get("name") == nm and e.get("cat") == "op"]
            assert len(life) == 1, f"{f.name}: op {nm}: {life}"
            args = life[0]["args"]
            assert args["status"] == "done" and life[0]["dur"] > 0
            for stage in ("submitted_us", "first_send_us", "last_recv_us", "reduced_us"):
                assert stage in args, (nm, args)
            # A peer's frame may be reduced before this rank's own first frame leaves
            # (the op ends only when both are done), so only submission comes first.
            assert args["submitted_us"] <= min(args["first_send_us"], args["reduced_us"]), args
            assert args["waited_on_by"], args
            segments = [e for e in events if e.get("name") == nm and e.get("cat") == "segment"]
            assert {e["args"]["peer"] for e in segments} == {1 - int(f.name[3])}
        assert any(e.get("name", "").startswith("wait ") for e in events)  # the waits
        assert any(e.get("name") in ("reduce", "copy") for e in events)  # the reductions
    merged = merge(files)
    pids = {e["pid"] for e in merged if e.get("name") in names}
    assert pids == {0, 1}
    starts = [e["ts"] for e in merged if e.get("ph") in ("X", "b") and e.get("name") in names]
    assert min(starts) >= 0


def test_the_lanes_ops_are_recorded_as_ops(tmp_path) -> None:
    """Ops the compiled lane runs appear with their life (submitted, done, waited on), not
    their segments: the lane records no per-segment events."""
    with local_services(2, timeline=str(tmp_path / "tl")) as svcs:
        run_ranks(svcs, lambda s: [s.allreduce(np.ones(n), name=f"l{n}") for n in (10, 300_000)])
        assert all(s.loop.lane.stats()["ops_done"] >= 2 for s in svcs)
    for f in sorted(tmp_path.glob("tl.*.json")):
        events = load(f)
        for n in (10, 300_000):
            life = [e for e in events if e.get("name") == f"l{n}" and e.get("cat") == "op"]
            assert len(life) == 1 and life[0]["args"]["status"] == "done", life
            assert life[0]["args"]["submitted_us"] >= 0 and life[0]["dur"] > 0


def test_a_traced_repeat_takes_the_untraced_route_and_shows_in_the_timeline(tmp_path) -> None:
    """The timeline is a sink on the express route: a traced 4 KiB repeat enters the lane
    from the calling thread exactly as an untraced one does (``lane_express`` counts both),
    and every repeat still appears as an op with its life."""
    n_ops = 50

    def rank_main(s):
        x = np.ones(1024, np.float32)
        before = s.loop.stats.lane_express
        for _ in range(n_ops):
            s.allreduce(x, name="rep")
        return s.loop.stats.lane_express - before

    counts = {}
    for traced in (False, True):
        opts = {"timeline": str(tmp_path / "tl")} if traced else {}
        with local_services(2, **opts) as svcs:
            counts[traced] = run_ranks(svcs, rank_main)
    # the first op of the name goes the whole way; the repeats, traced or not, the express way
    assert counts[True] == counts[False] and min(counts[True]) >= n_ops - 2, counts
    for f in sorted(tmp_path.glob("tl.*.json")):
        life = [e for e in load(f) if e.get("name") == "rep" and e.get("cat") == "op"]
        assert len(life) == n_ops and all(e["args"]["status"] == "done" for e in life), life[:2]

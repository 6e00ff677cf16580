"""The engine records into the timeline: every op's life on every rank, merged by clock."""

from __future__ import annotations

import numpy as np

from conftest import local_services, run_ranks
from totalreduce.timeline import load, merge


def test_two_rank_run_records_every_op_and_merges(tmp_path) -> None:
    """Every op's life on both ranks, in a file per rank, merged by clock (the lane records
    op events, not segments: the next test)."""
    names = ["small", "large"]
    with local_services(2, timeline=str(tmp_path / "tl")) as svcs:
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
            assert args["submitted_us"] >= 0, args
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


def run_repeats(svc, mode: str) -> tuple[int, list[np.ndarray]]:
    """Repeats of a 4 KiB allreduce (after the first call, which leaves the express record,
    and the second, which leaves its lane part): how many took the express route, and
    their results (blocking ones, then ``_async(...).wait()`` ones)."""
    x = np.arange(512, dtype=np.float64) + svc.rank
    svc.allreduce(x, name=mode)
    svc.allreduce(x, name=mode)
    e0 = svc.loop.stats.lane_express
    got = [svc.allreduce(x, name=mode) for _ in range(5)]
    got += [svc.allreduce_async(x, name=mode).wait() for _ in range(5)]
    return svc.loop.stats.lane_express - e0, got


def test_a_traced_repeat_takes_the_untraced_route_and_shows_in_the_timeline(tmp_path) -> None:
    """The timeline is a sink on the express route: a repeated 4 KiB allreduce enters the
    lane from the calling thread (``LaneOps.now``, ``LaneOps.express``) exactly as often traced as
    untraced, gives the same results, and every generation shows as an op that was
    submitted and done."""
    want = 2 * np.arange(512, dtype=np.float64) + 1
    with local_services(2) as svcs:
        plain = run_ranks(svcs, lambda s: run_repeats(s, "plain"))
    with local_services(2, timeline=str(tmp_path / "tl")) as svcs:
        traced = run_ranks(svcs, lambda s: run_repeats(s, "traced"))
    for (n_plain, got_plain), (n_traced, got_traced) in zip(plain, traced, strict=True):
        assert n_traced == n_plain == 10
        for a, b in zip(got_plain, got_traced, strict=True):
            np.testing.assert_array_equal(a, want)
            np.testing.assert_array_equal(b, want)
    for f in sorted(tmp_path.glob("tl.*.json")):
        life = [e for e in load(f) if e.get("name") == "traced" and e.get("cat") == "op"]
        assert len(life) == 12, life  # two whole-way calls and ten repeats
        for e in life:
            assert e["args"]["status"] == "done" and e["args"]["submitted_us"] >= 0, e
        # the blocking repeats that ended in their call recorded it as their wait (an op
        # that ended before its wait began records none, on either route)
        assert any(e["args"].get("waited_on_by") for e in life), life

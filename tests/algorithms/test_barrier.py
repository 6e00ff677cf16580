"""Barrier schedules: they finish in the simulator and order what a barrier must order."""

from __future__ import annotations

import numpy as np
import pytest

from totalreduce.algorithms.barrier import barrier_all_to_all, barrier_all_to_one
from totalreduce.algorithms.schedule import Schedule, SegmentPlan, plan_segments
from totalreduce.algorithms.simulator import simulate


def run(schedules: list[Schedule], seed: int) -> None:
    outs = simulate(schedules, [np.zeros(0, dtype=np.uint8)] * len(schedules), seed=seed)
    assert all(out.size == 0 for out in outs)


def sends_after(plan: SegmentPlan, recv: int) -> set[int]:
    """Send segments that cannot start before receive segment ``recv`` is applied."""
    seen_recvs, found = {recv}, set()
    todo = [recv]
    while todo:
        for is_send, idx in plan.after_recv[todo.pop()]:
            if is_send:
                found.add(idx)
            elif idx not in seen_recvs:
                seen_recvs.add(idx)
                todo.append(idx)
    return found


@pytest.mark.parametrize("p", range(1, 17))
def test_barrier_all_to_all_finishes(p: int) -> None:
    schedules = [barrier_all_to_all(r, p) for r in range(p)]
    for seed in range(3):
        run(schedules, seed)
    for r, s in enumerate(schedules):
        assert (s.count, s.out_count, s.work_count) == (0, 0, 0)
        assert len(s.steps) == (1 if p > 1 else 0)
        assert s.bytes_sent(8) == 0
        if p > 1:
            others = set(range(p)) - {r}
            assert {x.peer for x in s.steps[0].sends} == others
            assert {x.peer for x in s.steps[0].recvs} == others


@pytest.mark.parametrize("p", range(1, 17))
def test_barrier_all_to_one_finishes_for_every_root(p: int) -> None:
    for root in range(p):
        schedules = [barrier_all_to_one(r, p, root=root) for r in range(p)]
        run(schedules, seed=root)
        for r, s in enumerate(schedules):
            assert (s.count, s.out_count) == (0, 0)
            assert len(s.steps) == (2 if p > 1 else 0)
            frames = sum(len(st.sends) for st in s.steps)
            assert frames == (p - 1 if r == root else 1)


@pytest.mark.parametrize("p", [2, 3, 5, 8])
def test_barrier_all_to_one_root_releases_only_after_every_arrival(p: int) -> None:
    root = p - 1
    s = barrier_all_to_one(root, p, root=root)
    plan = plan_segments(s, segment_elems=1)
    releases = {i for i, seg in enumerate(plan.sends) if seg.step == 1}
    assert len(releases) == p - 1
    for q, seg in enumerate(plan.recvs):
        assert seg.step == 0
        assert sends_after(plan, q) == releases, f"release does not wait for rank {seg.peer}"
    # And nothing on the root's side goes out before the arrivals.
    assert all(plan.send_waits[i] > 0 for i in releases)


def test_barrier_rejects_bad_root() -> None:
    with pytest.raises(ValueError, match="root"):
        barrier_all_to_one(0, 4, root=4)

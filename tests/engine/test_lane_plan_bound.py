"""What the compiled lane keeps of its plans stays within ``Config.lane_plan_bytes`` when
shapes keep changing (new counts, new weights every step): the least recently used plans
are dropped and ``prog`` compacted, ops in flight keep theirs (moved), and a shape met
again is compiled again.  In-process ranks (threads); each test takes a few seconds."""

from __future__ import annotations

import threading
import time

import numpy as np

from conftest import local_services, run_ranks
from totalreduce.lane.lane_plans import PLAN_CHARGE

SMALL = 1 << 16  # the least bound: a dozen small plans, so compactions come every few ops


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def _within(lane, bound: int) -> None:
    """The kept plans' charges and ``prog``'s words stay within the bound (past it by one
    plan at most: the one compiled after the last compaction) and the in-use pages too."""
    biggest = max((e.charge for e in lane._plans.values()), default=0)
    assert lane._charged <= bound + biggest + PLAN_CHARGE, (lane._charged, bound)
    assert lane._prog_len * 8 <= bound, (lane._prog_len, bound)
    assert len(lane._plans) <= bound // PLAN_CHARGE + 1, len(lane._plans)
    assert lane.prog.nbytes <= max(1 << 19, 2 * bound), lane.prog.nbytes


def _grow(bound: int, warm: int, measured: int) -> tuple[float, list]:
    """RSS grown over ``measured`` allreduces of new counts after ``warm`` of them (a fixed
    algorithm: no choice of one remembered per count)."""

    def body(s):
        rss = 0.0
        for n in range(1, warm + measured + 1):
            if n == warm + 1:
                rss = _rss_mib()
            out = s.allreduce(np.full(n, s.rank + 1, np.int32), name="grad", algorithm="ring")
            assert out.shape == (n,) and out[0] == 3 and out[-1] == 3, (n, out[:3])
        return _rss_mib() - rss

    with local_services(2, lane_plan_bytes=bound) as svcs:
        grown = run_ranks(svcs, body, timeout=120)[0]
        lanes = [s.loop.lane for s in svcs]
    return grown, lanes


def test_rss_and_prog_stay_within_the_bound_over_thousands_of_shapes() -> None:
    """3,000 allreduces of new counts after 4,200 (the service's caches bounded by count
    have reached their high water by then: 4,096 ended ops remembered, 1,024 schedules,
    2,048 segment plans): unbounded (every plan kept, and its schedule), RSS grew 16 MiB
    here; bounded, 2 MiB."""
    bound = 512 << 10
    grown, lanes = _grow(bound, 4200, 3000)
    for lane in lanes:
        _within(lane, bound)
        assert lane.plans_epoch > 10, lane.plans_epoch
    assert grown < 8.0, f"RSS grew {grown:.1f} MiB over 3,000 new shapes"


def test_exact_results_across_compactions_with_ops_in_flight() -> None:
    """Async ops of new shapes interleaved with repeats (small, large with scratch, in
    place, reduce-scatters, broadcasts), held back at random (jitter), many in flight
    while compactions move their plans: every result exact, on both ranks, which compact
    at moments of their own."""
    in_flight_at: list[int] = []

    def body(s):
        lane = s.loop.lane
        lane.on_compact.append(lambda: in_flight_at.append(int(lane._in_table().size)))
        p, r = s.size, s.rank
        pending = []
        for step in range(40):
            hs = []
            for k in range(6):  # new shapes
                n = 1 + step * 6 + k
                x = (np.arange(n, dtype=np.int64) * 3 + r) % 17
                hs.append((s.allreduce_async(x, name=f"new.{step}.{k}"), ("sum", n)))
            for k, n in enumerate((5, 257, 40_000)):  # repeats (the last: bodies, scratch)
                x = (np.arange(n, dtype=np.int64) * 3 + r) % 17
                hs.append((s.allreduce_async(x, name=f"rep.{k}", out=x), ("sum", n)))
            x = np.arange(4 * p + step, dtype=np.float64) * (r + 1)
            hs.append((s.reduce_scatter_async(x[: 4 * p], name="rs"), ("rs", r)))
            b = np.full(3 + step, float(r + step), np.float64)
            hs.append((s.broadcast_async(b, root=step % p, name=f"bc.{step}"), ("bc", step)))
            pending.append(hs)
            if len(pending) > 3:  # some 40 ops in flight
                _check(pending.pop(0), p)
        for hs in pending:
            _check(hs, p)
        return lane.plans_epoch

    def after(s):  # new shapes with nothing in flight: what was pinned goes
        for n in range(20):
            assert s.allreduce(np.ones(n, np.int64), name=f"after.{n}").sum() == 2 * n
        _within(s.loop.lane, SMALL)

    with local_services(2, jitter=0.3, seed=7, lane_plan_bytes=SMALL) as svcs:
        epochs = run_ranks(svcs, body, timeout=120)
        run_ranks(svcs, after, timeout=60)
    assert min(epochs) > 10, epochs
    assert max(in_flight_at) > 4, in_flight_at  # compactions came with ops in the table


def _check(hs, p: int) -> None:
    for h, (what, n) in hs:
        got = h.wait(timeout=60)
        if what == "sum":
            want = sum((np.arange(n, dtype=np.int64) * 3 + r) % 17 for r in range(p))
            np.testing.assert_array_equal(got, want)
        elif what == "rs":  # (n: the rank, whose part of the sum it gets)
            whole = sum(np.arange(4 * p, dtype=np.float64) * (r + 1) for r in range(p))
            np.testing.assert_array_equal(got, whole[4 * n : 4 * n + 4])
        else:
            np.testing.assert_array_equal(got, np.full(3 + n, float(n % p + n), np.float64))


def test_the_express_route_after_a_compaction() -> None:
    """A blocking repeat takes the express route (entered and driven from the calling
    thread); after compactions moved its plan, its kept lane shape is stale: it is made
    anew, the repeats are exact and take the express route again."""

    def body(s):
        lane, stats = s.loop.lane, s.loop.stats
        x = np.arange(100, dtype=np.int64) + s.rank
        want = 2 * np.arange(100, dtype=np.int64) + 1
        for _ in range(5):
            np.testing.assert_array_equal(s.allreduce(x, name="e"), want)
        ex = next(v for k, v in s._express.items() if k[0] == "e")
        shape = ex.lane_shape
        assert shape.epoch == lane.plans_epoch
        epoch = lane.plans_epoch
        for i in range(60):  # new shapes: compactions, the repeat's plan dropped
            s.allreduce(np.ones(1000 + i, np.float32), name=f"other.{i}")
        assert lane.plans_epoch > epoch + 2
        assert lane.enter(None, shape) is None  # a stale shape is never entered
        assert lane.now(shape, x, x, 0, 0, 0) == -1
        before = stats.lane_express
        for _ in range(20):
            np.testing.assert_array_equal(s.allreduce(x, name="e"), want)
        assert ex.lane_shape is not shape and ex.lane_shape.epoch == lane.plans_epoch
        return stats.lane_express - before

    with local_services(2, lane_plan_bytes=SMALL) as svcs:
        express = run_ranks(svcs, body, timeout=120)
    assert min(express) >= 18, express  # one repeat renews the shape, the rest go express


def test_neighbor_allreduce_with_changing_weights_each_step() -> None:
    """BlueFog's dynamic weights: a new schedule every step (600 steps), each compiled
    into the lane; the kept plans stay within the bound and every average is exact."""

    def body(s):
        peer = 1 - s.rank
        x = np.full(33, float(s.rank), np.float64)
        for step in range(600):
            w = 0.125 + step / 4096
            got = s.neighbor_allreduce(x, name="nar", self_weight=1 - w,
                                       src_weights={peer: w}, dst_weights=[peer])  # fmt: skip
            want = (1 - w) * s.rank + w * peer
            np.testing.assert_array_equal(got, np.full(33, want))
        return s.loop.lane

    with local_services(2, lane_plan_bytes=SMALL) as svcs:
        lanes = run_ranks(svcs, body, timeout=120)
    for lane in lanes:
        _within(lane, SMALL)
        assert lane.plans_epoch > 20, lane.plans_epoch


def test_compiled_repeats_outside_the_engine_wait_for_fields_of_the_new_epoch() -> None:
    """A node service's compiled loop keeps copies of lane fields: once a compaction moved
    the plans, ``ServiceRepeats.begin`` refuses until its caller says its copies are of
    the new epoch (``renew``)."""
    from totalreduce.lane.lane_service import ServiceRepeats
    from totalreduce.service import express

    both = threading.Barrier(2)  # (no op of the other rank's floating here meanwhile)

    def body(s):
        rep = ServiceRepeats(s, express._make)
        lane = s.loop.lane
        s.allreduce(np.ones(3), name="warm")
        both.wait()
        assert _begin(rep)
        both.wait()
        for n in range(40):
            s.allreduce(np.ones(100 + n), name=f"new.{n}")
        both.wait()
        assert lane.plans_epoch > 0
        assert not _begin(rep, tries=20)
        rep.renew(lane.plans_epoch)
        assert _begin(rep)
        both.wait()

    with local_services(2, lane_plan_bytes=SMALL) as svcs:
        run_ranks(svcs, body, timeout=60)


def _begin(rep, tries: int = 200) -> bool:
    """Whether ``begin`` takes the lock (a few tries: the comm thread may hold it)."""
    for _ in range(tries):
        if rep.begin():
            rep.end()
            return True
        time.sleep(0.005)
    return False


def test_groups_that_change_with_one_schedule_across_compactions() -> None:
    """Pairs of ranks that change every step (a dynamic topology's groups) run one schedule
    each (the same count), so the plan is met again while its group is new: a compaction
    then keeps the plan it just found.  New counts over the whole world between them keep
    the charges at the bound and push the pairs' groups out before their next turn.  Every
    result exact."""
    pairings = [((0, 1), (2, 3)), ((0, 2), (1, 3)), ((0, 3), (1, 2))]

    kept: list[int] = []  # the plans compactions were asked to keep (-1: none)

    def body(s):
        r = s.rank
        lane = s.loop.lane
        compact = lane._compact
        lane._compact = lambda keep: (kept.append(keep), compact(keep))
        for step in range(120):
            for k in range(3):
                n = 50 + 3 * step + k
                got = s.allreduce(np.full(n, r, np.int64), name=f"world.{k}")
                np.testing.assert_array_equal(got, np.full(n, 6))
            pair = next(p for p in pairings[step // 4 % 3] if r in p)  # (4 steps each)
            x = np.arange(10, dtype=np.int64) * (r + 1)
            got = s.allreduce(x, name=f"pair.{pair}", group=list(pair))
            np.testing.assert_array_equal(got, np.arange(10) * (pair[0] + pair[1] + 2))
        return s.loop.lane

    with local_services(4, lane_plan_bytes=SMALL) as svcs:
        lanes = run_ranks(svcs, body, timeout=120)
    for lane in lanes:
        _within(lane, SMALL)
        assert lane.plans_epoch > 10, lane.plans_epoch
    assert any(k >= 0 for k in kept), kept  # a new group's compaction kept a plan found

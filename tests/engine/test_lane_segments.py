"""How the compiled lane cuts its ops: every rank of every kind and algorithm the lane
runs gets at most ``segment_cap(P)`` send and receive segments (``SEGCAP`` up to 24 ranks),
whatever the size and the group's, and the schedules cut so run exactly at the group
sizes past 32 (pure: the schedules, their segment plans and the simulator, no MPI)."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import full_run
from totalreduce.algorithms.codes import AlgorithmCode, OpKind
from totalreduce.algorithms.registry import allreduce_schedule
from totalreduce.algorithms.schedule import plan_segments
from totalreduce.lane.lane_plans import (
    LANE_ALGORITHMS,
    LANE_KINDS,
    LANE_MAX_SEGMENTS,
    LANE_SEGMENT_BYTES,
    fits_eager,
    large_segment_bytes,
    segment_cap,
)
from totalreduce.service.ops import compile_op

NAMES = sorted(a.name.lower() for a in LANE_ALGORITHMS)
SIZES = [1, 2, 3, 4, 5, 7, 8, 9, 13, 16, 17, 31, 32, 33]  # (24, 25: the sweep below)
#: Every group size up to 70 (the largest checked, whatever their ranks' schedules) with
#: ``--full``; by default the sizes around the powers of two, the cap's bend (24) and 70.
ALL_SIZES = range(1, 71)
SOME_SIZES = (23, 24, 25, 26, 34, 47, 63, 64, 65, 70)  # (to 33: every rank, above)
FULL = pytest.mark.full
MICRO = 64 << 10  # micro_bytes' default: an eager allreduce moves at most 8 of these


def test_the_cap_is_segcap_up_to_24_ranks_then_grows_with_the_group() -> None:
    assert [segment_cap(p) for p in (1, 24, 25, 32, 33, 64)] == [128, 128, 132, 160, 164, 288]
    assert all(segment_cap(p + 1) >= segment_cap(p) for p in range(1, 4096))


def _allreduce_fits(name: str, p: int, ranks, nbytes_list) -> None:  # type: ignore[no-untyped-def]
    cap = segment_cap(p)
    for isz in (2, 8):  # the narrowest and widest types bound the others
        for nbytes in nbytes_list:
            count = nbytes // isz
            if count * isz <= LANE_MAX_SEGMENTS * MICRO:  # eager, as plan_of cuts it
                seg = MICRO
            else:
                seg = large_segment_bytes(count * isz, p, LANE_SEGMENT_BYTES, isz)
                assert seg % isz == 0 and seg >= min(LANE_SEGMENT_BYTES, count * isz) // 2
            for rank in ranks(p):
                plan = plan_segments(allreduce_schedule(name, rank, p, count), seg // isz)
                assert len(plan.sends) <= cap and len(plan.recvs) <= cap, (
                    name, p, rank, nbytes, isz, len(plan.sends), len(plan.recvs),
                )  # fmt: skip


@pytest.mark.parametrize("p", SIZES)
@pytest.mark.parametrize("name", NAMES)
def test_every_rank_fits_the_segment_table(name: str, p: int) -> None:
    sizes = (8, 8 * MICRO, 8 * MICRO + 8, 1 << 20, 5_000_008, 64 << 20, 1 << 30)
    _allreduce_fits(name, p, range, sizes)


def _three_ranks(p: int) -> list[int]:
    return sorted({0, p // 2, p - 1})


@pytest.mark.parametrize("name", NAMES)
def test_every_group_size_to_70_fits_the_segment_table(name: str) -> None:
    """Group sizes 1..70, at the most an eager op moves and at large sizes: the first, a
    middle and the last ranks (every rank, to 33 ranks, above)."""
    for p in ALL_SIZES if full_run() else SOME_SIZES:
        _allreduce_fits(name, p, _three_ranks, (8 * MICRO, 64 << 20, 1 << 30))


@pytest.mark.parametrize("p", [33, pytest.param(64, marks=FULL)])
@pytest.mark.parametrize("name", NAMES)
def test_allreduces_cut_as_the_lane_cuts_them_are_exact_past_32_ranks(name: str, p: int) -> None:
    """The simulator runs every rank's schedule in the lane's segments (eager: at most 8
    of ``micro_bytes``; large: ``large_segment_bytes``, here at a small segment size so that
    the cut is the group's cap's), exact integer sums."""
    from totalreduce.algorithms.simulator import simulate

    isz = 8
    for count, seg in ((0, MICRO), (p + 1, MICRO), (3 * p + 7, 64),
                       (4099, large_segment_bytes(4099 * isz, p, 64, isz))):  # fmt: skip
        xs = [np.arange(count, dtype=np.int64) * p + r for r in range(p)]
        want = np.arange(count, dtype=np.int64) * p * p + p * (p - 1) // 2
        schedules = [allreduce_schedule(name, r, p, count) for r in range(p)]
        for r, s in enumerate(schedules):
            plan = plan_segments(s, max(1, seg // isz))
            assert max(len(plan.sends), len(plan.recvs)) <= segment_cap(p), (name, p, count, r)
        for r, out in enumerate(simulate(schedules, xs, segment_elems=max(1, seg // isz), seed=p)):
            np.testing.assert_array_equal(out, want, err_msg=f"{name} P={p} n={count} rank={r}")


def test_segments_stay_at_the_configured_size_while_they_fit() -> None:
    assert large_segment_bytes(4 << 20, 2, 256 << 10, 4) == 256 << 10
    assert large_segment_bytes(4 << 20, 8, 64 << 10, 4) > 64 << 10  # would need > SEGCAP
    big = large_segment_bytes(64 << 20, 2, 256 << 10, 4)
    assert big > 256 << 10 and big % 4 == 0


_KIND_NAMES = {
    AlgorithmCode.RING: "ring",
    AlgorithmCode.ONE_TO_ALL: "one_to_all",
    AlgorithmCode.PIPELINED: "pipelined",
    AlgorithmCode.ALL_TO_ALL: "all_to_all",
    AlgorithmCode.ALL_TO_ONE: "all_to_one",
}


def _kind_plans(kind: OpKind, code: AlgorithmCode, p: int, count: int, isz: int,
                micro: int):  # fmt: skip
    """Every rank's segment plan of an op the lane takes, cut the way ``plan_of`` cuts it,
    with even and uneven parts (reduce-scatter, all-gather) or every root (broadcast)."""
    nbytes = count * isz
    if nbytes <= LANE_MAX_SEGMENTS * micro and fits_eager(nbytes, p, micro, kind, code):
        seg = micro
    else:
        seg = large_segment_bytes(nbytes, p, LANE_SEGMENT_BYTES, isz, kind, code)
        assert seg % isz == 0 and seg >= min(LANE_SEGMENT_BYTES, nbytes) // 2
    if kind is OpKind.BROADCAST:
        variants = [(("root", root),) for root in sorted({0, p - 1})]
    elif kind is OpKind.BARRIER:
        variants = [()]
    else:
        even = tuple(count // p + (r < count % p) for r in range(p))
        uneven = (0,) * (p - 1) + (count,)
        variants = [(("counts", even),), (("counts", uneven),)]
    for opts in variants:
        for rank in range(p):
            got, sched = compile_op(kind, _KIND_NAMES[code], rank, p, count, False, opts)
            assert got is code
            yield rank, opts, plan_segments(sched, max(1, seg // isz))


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 8, 9, 17, 31, 32, 33, pytest.param(64, marks=FULL)])
@pytest.mark.parametrize(
    "kind,code",
    [(k, c) for k, codes in sorted(LANE_KINDS.items()) for c in sorted(codes)],
    ids=lambda v: v.name.lower(),
)
def test_every_rank_of_the_other_kinds_fits_the_segment_table(
    kind: OpKind, code: AlgorithmCode, p: int
) -> None:
    """Reduce-scatters, all-gathers and broadcasts of any size, and barriers: every rank's
    plan fits, eager (one-to-all broadcasts to many ranks go large sooner) or large."""
    micro = 16 << 10
    for isz in (2, 8):
        top = LANE_MAX_SEGMENTS * micro // isz  # the most elements of an eager op
        counts = (
            (0,) if kind is OpKind.BARRIER else (0, 3 * p + 1, top, top + 1, (64 << 20) // isz + 3)
        )
        for count in counts:
            for rank, opts, plan in _kind_plans(kind, code, p, count, isz, micro):
                cap = segment_cap(p)
                assert len(plan.sends) <= cap and len(plan.recvs) <= cap, (
                    kind, code, p, rank, opts, count, isz, len(plan.sends), len(plan.recvs),
                )  # fmt: skip


def test_one_to_all_to_many_ranks_goes_large_before_the_eager_limit() -> None:
    micro = 16 << 10
    assert fits_eager(8 * micro, 2, micro, OpKind.BROADCAST, AlgorithmCode.ONE_TO_ALL)
    assert not fits_eager(8 * micro, 32, micro, OpKind.BROADCAST, AlgorithmCode.ONE_TO_ALL)
    assert fits_eager(8 * micro, 32, micro, OpKind.REDUCE_SCATTER, AlgorithmCode.RING)


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_an_in_place_ring_lands_its_gathered_parts_in_place(p: int) -> None:
    """A large in-place allreduce's all-gather receives (copies, whose places the op's own
    earlier sends read) land straight in the output, posted once those sends are over:
    no scratch and no copy for them; only the reduce-scatter's receives take scratch.
    At P = 2 the sends they wait for are of the step just before theirs: they take
    scratch too, so that their clears leave when the op starts."""
    from totalreduce import protocol as L
    from totalreduce.algorithms.schedule import Action, alias_input
    from totalreduce.lane.lane_plans import LanePlans

    isz, count = 4, 1 << 20
    seg = large_segment_bytes(count * isz, p, LANE_SEGMENT_BYTES, isz)
    for rank in range(p):
        sched = alias_input(allreduce_schedule("ring", rank, p, count))
        assert sched is not None
        plans = LanePlans(64 << 10, 1 << 20, 1 << 16)
        at = plans._compile(sched, isz, seg)
        prog = plans.prog
        segplan = plan_segments(sched, seg // isz)
        r0 = int(prog[at + L.PL_RECVS])
        reducing = 0
        for q, r in enumerate(segplan.recvs):
            scr = int(prog[r0 + q * L.G_N + L.G_SCR])
            if r.action is Action.COPY and p > 2:
                assert scr == L.SCR_DIRECT, (rank, q)
            else:
                assert scr >= 0
                reducing += (r.region.count * isz + 63) & ~63
        assert int(prog[at + L.PL_SCR]) == reducing
        assert any(
            segplan.recv_waits[q] for q, r in enumerate(segplan.recvs) if r.action is Action.COPY
        )  # fmt: skip (posted after their waits)

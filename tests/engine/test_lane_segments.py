"""How the compiled lane cuts its ops: every rank of every kind and algorithm the lane
runs gets at most ``SEGCAP`` send and receive segments, whatever the size (pure: the
schedules and their segment plans, no MPI)."""

from __future__ import annotations

import pytest

from totalreduce.algorithms.codes import AlgorithmCode, OpKind
from totalreduce.algorithms.registry import allreduce_schedule
from totalreduce.algorithms.schedule import plan_segments
from totalreduce.engine.lane_plans import (
    LANE_ALGORITHMS,
    LANE_KINDS,
    LANE_MAX_GROUP,
    LANE_MAX_SEGMENTS,
    LANE_SEGMENT_BYTES,
    SEGCAP,
    fits_eager,
    large_segment_bytes,
)
from totalreduce.service.ops import compile_op

NAMES = sorted(a.name.lower() for a in LANE_ALGORITHMS)
SIZES = [1, 2, 3, 4, 5, 7, 8, 9, 13, 16, 17, 31, 32]


@pytest.mark.parametrize("p", SIZES)
@pytest.mark.parametrize("name", NAMES)
def test_every_rank_fits_the_segment_table(name: str, p: int) -> None:
    assert max(SIZES) <= LANE_MAX_GROUP
    for isz in (2, 8):  # the narrowest and widest types bound the others
        for nbytes in (129 << 10, 1 << 20, 5_000_008, 64 << 20, 1 << 30):
            count = nbytes // isz
            seg = large_segment_bytes(count * isz, p, LANE_SEGMENT_BYTES, isz)
            assert seg % isz == 0 and seg >= min(LANE_SEGMENT_BYTES, count * isz) // 2
            for rank in range(p):
                plan = plan_segments(allreduce_schedule(name, rank, p, count), seg // isz)
                assert len(plan.sends) <= SEGCAP and len(plan.recvs) <= SEGCAP, (
                    name, p, rank, nbytes, isz, len(plan.sends), len(plan.recvs),
                )  # fmt: skip


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


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 8, 9, 17, 31, 32])
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
                assert len(plan.sends) <= SEGCAP and len(plan.recvs) <= SEGCAP, (
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
    no scratch and no copy for them; only the reduce-scatter's receives take scratch."""
    from totalreduce import protocol as L
    from totalreduce.algorithms.schedule import Action, alias_input
    from totalreduce.engine.lane_plans import LanePlans

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
            if r.action is Action.COPY:
                assert scr == L.SCR_DIRECT, (rank, q)
            else:
                assert scr >= 0
                reducing += (r.region.count * isz + 63) & ~63
        assert int(prog[at + L.PL_SCR]) == reducing
        assert any(
            segplan.recv_waits[q] for q, r in enumerate(segplan.recvs) if r.action is Action.COPY
        )  # fmt: skip (posted after their waits)

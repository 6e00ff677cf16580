"""How the compiled lane cuts a large allreduce: every rank of every algorithm the lane
runs gets at most ``SEGCAP`` send and receive segments, whatever the size (pure: the
schedules and their segment plans, no MPI)."""

from __future__ import annotations

import pytest

from totalreduce.algorithms.registry import allreduce_schedule
from totalreduce.algorithms.schedule import plan_segments
from totalreduce.engine.lane_plans import (
    LANE_ALGORITHMS,
    LANE_MAX_GROUP,
    LANE_SEGMENT_BYTES,
    SEGCAP,
    large_segment_bytes,
)

NAMES = sorted(a.name.lower() for a in LANE_ALGORITHMS)
SIZES = [1, 2, 3, 4, 5, 7, 8, 9, 13, 16, 17, 31, 32]


@pytest.mark.parametrize("p", SIZES)
@pytest.mark.parametrize("name", NAMES)
def test_every_rank_fits_the_segment_table(name: str, p: int) -> None:
    assert max(SIZES) <= LANE_MAX_GROUP
    for isz in (2, 4, 8):
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


@pytest.mark.parametrize("p", SIZES)
def test_small_reduce_scatters_and_allgathers_fit_the_segment_table(p: int) -> None:
    """The other kinds run in the lane only small (the whole op within the eager
    segments): every rank's plan fits, with balanced and uneven parts."""
    from totalreduce.algorithms.codes import OpKind
    from totalreduce.engine.lane_plans import LANE_KINDS, LANE_MAX_SEGMENTS
    from totalreduce.service.ops import compile_op

    assert set(LANE_KINDS) == {OpKind.REDUCE_SCATTER, OpKind.ALLGATHER}
    micro = 16 << 10
    for isz in (2, 4, 8):
        top = LANE_MAX_SEGMENTS * micro // isz  # the most elements the lane takes
        for total in (0, 1, p, 3 * p + 1, top // 3, top - 1, top):
            even = [total // p + (r < total % p) for r in range(p)]
            uneven = [0] * (p - 1) + [total] if p > 1 else [total]
            for counts in (even, uneven):
                for rank in range(p):
                    for kind in LANE_KINDS:
                        code, sched = compile_op(
                            kind, "ring", rank, p, total, False, (("counts", tuple(counts)),)
                        )
                        assert code is LANE_KINDS[kind]
                        plan = plan_segments(sched, micro // isz)
                        assert len(plan.sends) <= SEGCAP and len(plan.recvs) <= SEGCAP, (
                            kind, p, rank, total, isz, len(plan.sends), len(plan.recvs),
                        )  # fmt: skip

"""Groups of more than 32 ranks in the compiled lane, over the in-process transport.

A lane's per-op segment table holds what any op of its world's groups needs
(``lane_plans.segment_cap``), so no group size sends an op to the main loop: every
allreduce algorithm the lane runs, both broadcasts, reduce-scatter, all-gather, all-to-all
and the barrier at 33, 48 and 64 ranks, eager and large (bodies on tags of their own: a
small ``micro_bytes`` keeps them a few KiB), exact, and the main loop runs none of them.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import local_services, run_ranks
from totalreduce import protocol as L
from totalreduce.lane.lane_plans import SEGCAP, segment_cap

ALGORITHMS = ["ring", "ring_chunked", "halving_doubling", "bcube", "recursive_doubling"]
#: micro_bytes 256: an op of more than 2 KiB is large (its segments' bodies on tags of
#: their own); segment_bytes 1 KiB cuts it into many.
OPTIONS = {"micro_bytes": 256, "segment_bytes": 1024}


def values(k: int, n: int, rank: int) -> np.ndarray:
    return (np.arange(n, dtype=np.int64) * 7 + 3 * rank + k) % 1013


@pytest.mark.parametrize(
    "p", [33, pytest.param(48, marks=pytest.mark.full), pytest.param(64, marks=pytest.mark.full)]
)
def test_every_kind_runs_in_the_lane_past_32_ranks(p: int) -> None:
    small, large = p + 3, 40 * p  # large: a ring's chunks of 320 bytes are bodies too
    sizes = (small, large)

    def rank_main(s):
        lane = s.loop.lane
        assert lane is not None, "the lane is off"
        assert int(lane.mem[L.C_SEGCAP]) == segment_cap(p) > SEGCAP
        lane0 = lane.stats()["ops_done"]
        all0 = s.loop.stats.ops_completed
        hs = {}
        for a in ALGORITHMS:
            for n in sizes:
                hs[(a, n)] = s.allreduce_async(values(1, n, s.rank), algorithm=a, name=f"{a}.{n}")
        for a in ("pipelined", "one_to_all"):
            for n in sizes:
                x = values(2, n, s.rank)
                hs[(a, n)] = s.broadcast_async(x, root=p - 1, algorithm=a, name=f"bc.{a}.{n}")
        hs["rs"] = s.reduce_scatter_async(values(3, 6 * p, s.rank), name="rs")
        hs["ag"] = s.allgather_async(values(4, 5, s.rank), name="ag")
        hs["a2a"] = s.alltoall_async(values(5, 2 * p, s.rank), name="a2a")
        hs["bar"] = s.barrier_async(name="bar")
        out = {k: h.wait(timeout=120) for k, h in hs.items()}
        ran = lane.stats()["ops_done"] - lane0
        done = s.loop.stats.ops_completed - all0
        return out, done - ran, ran, done  # (ops completed that the lane did not run: 0)

    with local_services(p, **OPTIONS) as svcs:
        results = run_ranks(svcs, rank_main, timeout=240)
    total = sum(values(1, large, r) for r in range(p))
    full = sum(values(3, 6 * p, r) for r in range(p))
    for r, (out, main, ran, done) in enumerate(results):
        assert main == 0, f"rank {r}: {main} ops completed outside the lane"
        assert ran == done > 0, f"rank {r}: the lane ran {ran} of {done} ops"
        for a in ALGORITHMS:
            np.testing.assert_array_equal(out[(a, large)], total, err_msg=a)
            want = sum(values(1, small, q) for q in range(p))
            np.testing.assert_array_equal(out[(a, small)], want, err_msg=a)
        for a in ("pipelined", "one_to_all"):
            for n in sizes:
                np.testing.assert_array_equal(out[(a, n)], values(2, n, p - 1), err_msg=a)
        np.testing.assert_array_equal(out["rs"], full[6 * r : 6 * r + 6])
        np.testing.assert_array_equal(
            out["ag"].reshape(-1), np.concatenate([values(4, 5, q) for q in range(p)])
        )
        want = np.concatenate([values(5, 2 * p, q)[2 * r : 2 * r + 2] for q in range(p)])
        np.testing.assert_array_equal(out["a2a"].reshape(-1), want)

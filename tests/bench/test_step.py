"""The training-step scenario (``totalreduce bench --step``): its schedules, its buckets, its
timeline, and a run under ``mpiexec`` whose sums are checked."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
from bench_run import bench

from conftest import optional_module
from totalreduce.bench.resnet18 import RESNET18_GRADIENTS, resnet18_gradient_counts
from totalreduce.bench.step import (
    MpiBuckets,
    Scenario,
    TotalreduceBuckets,
    _Compute,
    expected,
    plan_buckets,
    value,
    wrong,
)
from totalreduce.bench.table import read_csv
from totalreduce.launch import find_mpiexec

MPIEXEC = find_mpiexec()  # this Python's (the mpich wheel's, beside it), else PATH's

needs_mpiexec = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec beside python or on PATH")


def test_resnet18_counts() -> None:
    assert len(RESNET18_GRADIENTS) == 62
    assert sum(RESNET18_GRADIENTS) == 11_689_512
    assert RESNET18_GRADIENTS[:3] == (9408, 64, 64)  # conv1 7x7x3x64, bn1
    assert RESNET18_GRADIENTS[-2:] == (512_000, 1000)  # fc
    assert max(RESNET18_GRADIENTS) == 512 * 512 * 9
    assert sum(resnet18_gradient_counts(classes=10)) == 11_689_512 - 512 * 990 - 990


def test_resnet18_matches_torchvision_when_installed() -> None:
    models = optional_module("torchvision.models")
    assert tuple(p.numel() for p in models.resnet18().parameters()) == RESNET18_GRADIENTS


def test_schedules_are_per_rank_and_step_and_repeatable() -> None:
    sc = Scenario(RESNET18_GRADIENTS, 0.005, 0.010, jitter=0.1, swap=0.3)
    n = len(RESNET18_GRADIENTS)
    orders = {}
    for step in range(4):
        for rank in range(4):
            order, scale = sc.schedule(step, rank)
            assert sorted(order) == list(range(n))  # every gradient once
            # The reverse of the model's order, each layer moved by one place at most.
            assert all(abs(order[k] - (n - 1 - k)) <= 1 for k in range(n)), order
            assert 0.9 <= scale <= 1.1
            assert sc.schedule(step, rank) == (order, scale)  # the same on every call
            orders[step, rank] = tuple(order)
    assert len(set(orders.values())) == len(orders)  # each rank and step its own
    plain = Scenario((5, 6, 7), 0.0, 0.0, jitter=0.0, swap=0.0)
    assert plain.schedule(3, 1) == ([2, 1, 0], 1.0)
    assert sum(sc.shares) == pytest.approx(1.0)
    assert sc.shares[-5] > sc.shares[-4] > 0  # a 3x3 convolution costs more than a norm


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"counts": ()}, "every tensor"),
        ({"counts": (4, 0)}, "(4, 0)"),
        ({"forward_s": -1.0}, "forward -1.0"),
        ({"jitter": 1.0}, "jitter 1.0"),
        ({"swap": 1.5}, "swap 1.5"),
        ({"compute": "gpu"}, "'gpu'"),
    ],
)
def test_bad_scenarios_name_what_is_wrong(kwargs: dict, named: str) -> None:
    args = {"counts": (4, 4), "forward_s": 0.001, "backward_s": 0.002, **kwargs}
    with pytest.raises(ValueError, match="step scenario") as info:
        Scenario(**args)
    assert named in str(info.value)


def test_buckets_are_runs_in_reverse_model_order() -> None:
    counts = (10, 300, 20, 20, 500, 5, 5)
    flat = np.zeros(sum(counts), np.float32)
    offsets = np.cumsum((0,) + counts)
    grads = [flat[offsets[i] : offsets[i + 1]] for i in range(len(counts))]
    per_tensor = MpiBuckets(grads, flat, None, 0)
    assert per_tensor.buckets == [(i, i + 1) for i in reversed(range(len(counts)))]
    assert per_tensor.name == "mpi.Iallreduce x7"
    bucketed = MpiBuckets(grads, flat, None, 300 * 4)
    # 5+5+500 >= 300 elements closes the first bucket, 20+20+300 the next, 10 is the last.
    assert bucketed.buckets == [(4, 7), (1, 4), (0, 1)]
    assert bucketed.bucket_of == [2, 1, 1, 1, 0, 0, 0]
    assert bucketed.name == "mpi.Iallreduce(buckets)"
    two = MpiBuckets(grads, flat, None, 400 * 4)  # 20+20+300+10 < 400: the first layer closes
    assert two.buckets == [(4, 7), (0, 4)]
    mine = TotalreduceBuckets(grads, flat, 300 * 4)  # totalreduce's rows use the same runs
    assert (mine.buckets, mine.bucket_of) == plan_buckets(grads, 300 * 4)
    assert mine.buckets == bucketed.buckets
    np.testing.assert_array_equal(mine.part(1), flat[10:350])


def test_the_compute_timeline_moves_on_by_the_hooks_time_not_by_late_wake_ups() -> None:
    c = _Compute(spin=False)
    c.start()
    t0 = c.end
    c.run(0.002)
    assert c.end == t0 + 0.002  # however late the sleep woke
    h0 = time.perf_counter()
    c.host(time.sleep, 0.003)  # a hook (a wait) of 3 ms delays what follows, by its time
    took = time.perf_counter() - h0
    assert 0.003 <= c.end - (t0 + 0.002) <= took
    before = c.end
    c.run(0.002)
    assert c.end == before + 0.002
    assert time.perf_counter() >= c.end
    spun = _Compute(spin=True)
    spun.start()
    start = spun.end
    writes = []
    spun.run(0.001, then=lambda: writes.append(1))
    assert writes == [1] and time.perf_counter() >= start + 0.001


def test_wrong_counts_elements_that_miss_the_sum() -> None:
    p, step = 3, 7
    grads = [np.full(4, expected(p, step, i), np.float32) for i in range(3)]
    assert wrong(grads, p, step) == 0
    grads[1][2] += value(0, step, 1)
    grads[2][:] = 0
    assert wrong(grads, p, step) == 1 + 4


@needs_mpiexec
@pytest.mark.parametrize(("n", "compute"), [(2, "sleep"), (3, "spin")])
def test_step_mode_under_mpiexec(n: int, compute: str, tmp_path: Path) -> None:
    out = bench(
        n,
        "--step",
        "--step-scale", "0.002",
        "--step-forward-ms", "0.5",
        "--step-backward-ms", "1",
        "--step-speeds", "1,2",
        "--step-rounds", "1",
        "--step-steps", "2",
        "--step-compute", compute,
        "--step-bucket", "4K",
        "--csv", "s.csv",
        "--json", "s.json",
        cwd=tmp_path,
    )  # fmt: skip
    assert out.splitlines()[0] == f"# totalreduce bench (step): P={n}, float32, op sum"
    rows = read_csv((tmp_path / "s.csv").read_text())
    impls = [
        "compute.only",
        "mpi.Allreduce(fused)",
        "mpi.Iallreduce x62",
        "mpi.Iallreduce(buckets)",
        "tr.allreduce_async x62",
        "tr.allreduce_async(buckets)",
    ]
    assert [r["impl"] for r in rows] == impls * 2, out
    assert [float(r["compute_ms"]) for r in rows] == [1.5] * 6 + [3.0] * 6
    for r in rows:
        assert r["mode"] == "step" and r["ops"] == "62"
        assert r["wrong"] == ("" if r["impl"] == "compute.only" else "0"), r
        assert float(r["time_us"]) > 0 and float(r["vs_mpi"]) > 0
    for speed in (rows[:6], rows[6:]):
        mpi = [r for r in speed if r["impl"].startswith("mpi")]
        assert max(float(r["vs_mpi"]) for r in mpi) == pytest.approx(1.0)
        assert float(speed[0]["time_us"]) >= 0.9 * float(speed[0]["compute_ms"]) * 1e3
    text = [ln.split() for ln in out.splitlines() if ln.strip() and not ln.startswith("#")]
    assert len(text) == 12 and all(ln[0] == rows[0]["size"] for ln in text)

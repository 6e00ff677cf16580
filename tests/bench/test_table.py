"""The nccl-tests-style table, the CSV round trip, and the exact checks behind ``#wrong``."""

from __future__ import annotations

import io

import numpy as np
import pytest

from totalreduce.bench.cases import expected, pattern, wrong
from totalreduce.bench.table import Result, bandwidths, header, read_csv, row, write_csv


def test_bandwidth_factors_follow_nccl_tests() -> None:
    assert bandwidths("allreduce", 4, 1_000_000, 1e-3) == pytest.approx((1.0, 1.5))
    assert bandwidths("reduce_scatter", 4, 1_000_000, 1e-3) == pytest.approx((1.0, 0.75))
    assert bandwidths("allgather", 8, 1_000_000, 1e-3) == pytest.approx((1.0, 0.875))
    assert bandwidths("broadcast", 8, 1_000_000, 1e-3) == pytest.approx((1.0, 1.0))
    assert bandwidths("neighbor_allreduce", 8, 1_000_000, 1e-3) == (None, None)


def test_rows_and_headers() -> None:
    r = Result("size", "allreduce", "tr.ring", 4096, 1024, "float32", "sum", -1)
    r.time_us, r.algbw, r.busbw, r.wrong = 120.0, 0.034, 0.034, 0
    r.vs_mpi = 0.05
    for latency in (False, True):
        assert all(h.startswith("#") for h in header(latency))
        cols = row(r, latency).split()
        assert cols[:6] == ["4096", "1024", "float32", "sum", "-1", "tr.ring"]
        assert cols[6:10] == ["120.0", "0.034", "0.034", "0"]
        assert cols[10:14] == ["-", "-", "-", "N/A"]  # no in-place call
        assert len(cols) == (17 if latency else 15)


def test_csv_round_trip() -> None:
    r = Result("burst", "allreduce", "tr.allreduce_async x161", 100, 25, "float32", "sum", -1, 161)
    r.time_us, r.wrong = 5000.0, 0
    buf = io.StringIO()
    write_csv([r], buf)
    (back,) = read_csv(buf.getvalue())
    assert back["impl"] == "tr.allreduce_async x161" and back["ops"] == "161"
    assert back["time_us"] == "5000.0" and back["ip_time_us"] == "" and back["wrong"] == "0"


@pytest.mark.parametrize("dtype", ["float32", "int32", "int64", "float64"])
@pytest.mark.parametrize("op", ["sum", "avg", "max", "min"])
def test_expected_results_are_exact(dtype: str, op: str) -> None:
    p, n = 5, 1000
    stack = np.stack([pattern(n, r, dtype).astype(np.float64) for r in range(p)])
    ref = {"sum": stack.sum(0), "max": stack.max(0), "min": stack.min(0)}.get(op)
    if ref is None:
        ref = stack.sum(0) // p if dtype.startswith("int") else stack.sum(0) / p
    want = expected(n, p, dtype, op)
    assert wrong(want, ref.astype(dtype)) == 0
    # ... and ``wrong`` does count what differs.
    bad = want.copy()
    bad[[3, 500]] += 1
    assert wrong(bad, want) == 2
    assert wrong(want[:-1], want) == n

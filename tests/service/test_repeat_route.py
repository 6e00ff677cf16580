"""A repeat is one compiled call (``lane_core.lane_once``): the blocking form enters and
drives its op there, the async form enters it there and waits apart; the same results and
the same errors as the whole way's."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

import totalreduce as tr
from conftest import local_services, run_ranks
from totalreduce.lane import lane_core

DTYPES = ["float32", "float64", "int32", "int64", "uint8", "int8", "int16", "bool", "float16"]


def entries(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many ops entered the lane by the repeat's compiled call: [blocking, async]
    (patched once the lanes are made: ``compile_all`` compiles the real one)."""
    seen = [0, 0]
    real = lane_core.lane_once
    lock = threading.Lock()

    def counted(*a: Any) -> int:
        with lock:
            seen[0 if a[9] >= 0 else 1] += 1  # max_ns: the blocking form drives
        return int(real(*a))

    monkeypatch.setattr(lane_core, "lane_once", counted)
    return seen


def _x(dtype: str, n: int, rank: int, k: int) -> np.ndarray:
    if dtype == "bool":
        return (np.arange(n) + rank + k) % 3 == 0
    return ((np.arange(n) * 7 + rank * 3 + k) % 11).astype(dtype)


def _want(dtype: str, n: int, k: int) -> np.ndarray:
    a, b = _x(dtype, n, 0, k), _x(dtype, n, 1, k)
    return (a | b) if dtype == "bool" else (a + b)


@pytest.mark.parametrize("dtype", ["float32", pytest.param("all", marks=pytest.mark.full)])
def test_blocking_and_async_repeats_take_the_one_call_with_exact_results(
    dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each dtype's 4 KiB-ish allreduce, repeated blocking (into ``out`` and into a new
    array) and async: after the calls that make the record and its lane part, every
    repeat enters through ``lane_once`` (blocking ones driving, async ones not) and the
    loop's route counter moves once per repeat; every result exact."""
    dtypes = DTYPES if dtype == "all" else [dtype]
    reps = 6

    def body(s: Any) -> tuple[int, list[tuple[str, int, np.ndarray]]]:
        got = []
        express = 0
        for dt in dtypes:
            n = 4096 // np.dtype(dt).itemsize
            out = np.empty(n, dt)
            for k in range(2):  # the whole way, then the lane's part made
                s.allreduce(_x(dt, n, s.rank, k), name=f"b.{dt}", out=out)
                s.allreduce(_x(dt, n, s.rank, k), name=f"n.{dt}")
                s.allreduce_async(_x(dt, n, s.rank, k), name=f"a.{dt}").wait()
            e0 = s.loop.stats.lane_express
            for k in range(reps):
                s.allreduce(_x(dt, n, s.rank, k), name=f"b.{dt}", out=out)
                got.append((dt, k, out.copy()))
                got.append((dt, k, s.allreduce(_x(dt, n, s.rank, k), name=f"n.{dt}")))
                h = s.allreduce_async(_x(dt, n, s.rank, k), name=f"a.{dt}")
                got.append((dt, k, h.wait()))
            express += s.loop.stats.lane_express - e0
        return express, got

    with local_services(2) as svcs:
        seen = entries(monkeypatch)  # (after the lanes compiled: compile_all names it)
        results = run_ranks(svcs, body, timeout=300)
    for express, got in results:
        assert express == 3 * reps * len(dtypes), express
        for dt, k, a in got:
            want = _want(dt, 4096 // np.dtype(dt).itemsize, k)
            assert a.dtype == want.dtype
            np.testing.assert_array_equal(a, want, err_msg=dt)
    # both ranks: the blocking repeats (two of three) drove, the async ones entered
    assert seen[0] >= 2 * 2 * reps * len(dtypes), seen
    assert seen[1] >= 2 * reps * len(dtypes), seen


def test_a_name_that_changes_shape_and_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """A name repeated at one count, then another (its own record, made by the whole way),
    then the first again: every result exact, and the repeats of either count take the
    one call."""

    def body(s: Any) -> list[bool]:
        ok = []
        for n in (100, 300, 100, 300):
            for k in range(4):
                got = s.allreduce(_x("int64", n, s.rank, k), name="g")
                ok.append(bool(np.array_equal(got, _want("int64", n, k))))
                got = s.allreduce_async(_x("int64", n, s.rank, k), name="g").wait()
                ok.append(bool(np.array_equal(got, _want("int64", n, k))))
        return ok

    with local_services(2) as svcs:
        seen = entries(monkeypatch)
        for ok in run_ranks(svcs, body, timeout=120):
            assert all(ok), ok
    # per rank, each count: its first two calls of each form make the record and the
    # lane part; the rest (4 rounds x 4 x 2 forms less those) took the one call
    assert sum(seen) >= 2 * (32 - 8), seen


def test_a_mismatch_on_a_repeat_raises_todays_text_on_both_ranks() -> None:
    """Ranks that repeat a name with different counts (blocking) or dtypes (async) raise
    ``OpMismatchError`` naming the op, its generation and both ranks' values, and the name
    works after."""
    with local_services(2) as svcs:
        barrier = threading.Barrier(2)

        def body(s: Any) -> tuple[str, str, np.ndarray]:
            x = np.ones(512, np.float32)
            for _ in range(3):
                s.allreduce(x, name="m")
                s.allreduce_async(x, name="a").wait()
            barrier.wait(30)
            with pytest.raises(tr.OpMismatchError) as counts:
                s.allreduce(x if s.rank == 0 else np.ones(513, np.float32), name="m")
            barrier.wait(30)
            with pytest.raises(tr.OpMismatchError) as dtypes:
                s.allreduce_async(x if s.rank == 0 else x.astype(np.float64), name="a").wait()
            barrier.wait(30)
            return str(counts.value), str(dtypes.value), s.allreduce(x, name="m")

        for counts, dtypes, after in run_ranks(svcs, body, timeout=60):
            # the rank that found it names itself first; a rank told by its peer's error
            # before it looked itself raises the peer's text: either order, both values
            both = ("rank 0 has count 512", "rank 1 has count 513")
            assert counts in (
                f"op 'm' generation 3: {both[0]}, {both[1]}",
                f"op 'm' generation 3: {both[1]}, {both[0]}",
            ), counts
            assert dtypes.startswith("op 'a' generation 3: rank "), dtypes
            assert "has dtype float32" in dtypes and "has dtype float64" in dtypes, dtypes
            np.testing.assert_array_equal(after, np.full(512, 2.0))


def test_a_traced_repeat_takes_the_one_call_as_an_untraced_one(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a timeline, 4 KiB repeats (blocking and async) enter by ``lane_once`` as often
    as without: the timeline is a sink on the route, not a reason to leave it."""

    def body(s: Any) -> int:
        x = np.arange(1024, dtype=np.float32) + s.rank
        for _ in range(2):
            s.allreduce(x, name="t")
            s.allreduce_async(x, name="ta").wait()
        e0 = s.loop.stats.lane_express
        for _ in range(10):
            s.allreduce(x, name="t")
            s.allreduce_async(x, name="ta").wait()
        return int(s.loop.stats.lane_express - e0)

    counts = []
    for options in ({}, {"timeline": str(tmp_path / "tl")}):
        with local_services(2, **options) as svcs, monkeypatch.context() as m:
            seen = entries(m)
            express = run_ranks(svcs, body, timeout=120)
        counts.append((express, seen[0] >= 20, seen[1] >= 20))
    assert counts[0] == counts[1] == ([20, 20], True, True), counts
    assert sorted(tmp_path.glob("tl.*.json")), "no timeline written"

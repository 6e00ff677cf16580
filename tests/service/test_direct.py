"""The blocking allreduce's own path (``express.run``, ``LaneOps.now``): a repeat the
compiled lane runs is entered and driven to its end in one call, with no handle; one that
does not end there is waited for as a handle.  Either way the same results and errors as
``allreduce_async(...).wait()``."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest

import totalreduce as tr
from conftest import local_services, run_ranks
from totalreduce.engine.lane_loop import LaneOps
from totalreduce.service import express


def outcomes(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """How each ``LaneOps.now`` call went: ended in its try, entered and waited, not entered."""
    seen = {"ended": 0, "waited": 0, "declined": 0}
    real = LaneOps.now
    lock = threading.Lock()

    def counted(self, *a, **kw):  # type: ignore[no-untyped-def]
        r = real(self, *a, **kw)
        with lock:
            seen["ended" if r is True else "declined" if r is None else "waited"] += 1
        return r

    monkeypatch.setattr(LaneOps, "now", counted)
    return seen


def test_blocking_repeats_end_in_one_call_without_a_handle(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen = outcomes(monkeypatch)
    made = [0]

    class Counted(express.ExpressOp):  # type: ignore[misc, name-defined]
        def __init__(self, *a: Any, **kw: Any) -> None:
            made[0] += 1
            super().__init__(*a, **kw)

    monkeypatch.setattr(express, "ExpressOp", Counted)
    n = 200
    with local_services(2) as svcs:

        def rank_main(svc: Any) -> list[np.ndarray]:
            x = np.arange(1024, dtype=np.float32) + svc.rank
            y = np.empty_like(x)
            got = []
            for k in range(n):
                x[0] = k
                svc.allreduce(x, name="d", out=y)
                got.append(y.copy())
            got.append(svc.allreduce(x.reshape(32, 32), name="d2"))  # out=None, 2-d
            got.append(svc.allreduce(x.reshape(32, 32), name="d2"))
            return got

        results = run_ranks(svcs, rank_main, timeout=120)
    want = 2 * np.arange(1024, dtype=np.float32) + 1
    for got in results:
        for k in range(n):
            want[0] = 2 * k
            np.testing.assert_array_equal(got[k], want)
        for g in got[n:]:
            assert g.shape == (32, 32)
            np.testing.assert_array_equal(g.ravel()[1:], want[1:])
    # the first call of each name goes the whole way, the first repeat the async way (it
    # makes the record's lane shape); every later repeat takes this path
    assert sum(seen.values()) == 2 * (n - 2)
    assert seen["ended"] > 0  # some end in their first try (most do on an idle machine)
    # a handle for each rank's first repeat of each name (the async way) and for the
    # repeats that did not end in their first try, none for those that did
    assert made[0] == 2 * 2 + seen["waited"] + seen["declined"]


def test_a_blocking_repeat_whose_peer_is_late_is_waited_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rank 1 comes 30 ms late to each repeat: rank 0's first try (200 µs) ends without it,
    and the op is then waited for as a handle, to the right result."""
    seen = outcomes(monkeypatch)
    with local_services(2) as svcs:

        def rank_main(svc: Any) -> list[np.ndarray]:
            x = np.full(256, svc.rank + 1.0)
            got = [svc.allreduce(x, name="late")]
            for k in range(4):
                if svc.rank == 1:
                    time.sleep(0.03)
                x[:] = svc.rank + k
                got.append(svc.allreduce(x, name="late"))
            return got

        results = run_ranks(svcs, rank_main, timeout=60)
    for got in results:
        np.testing.assert_array_equal(got[0], np.full(256, 3.0))
        for k in range(4):
            np.testing.assert_array_equal(got[1 + k], np.full(256, 2.0 * k + 1))
    assert seen["waited"] >= 3, seen  # rank 0's last three repeats (the first one makes the shape)


def test_a_mismatch_met_on_the_blocking_path_fails_the_op_on_every_rank() -> None:
    """Rank 1 repeats the name with another reduce op (a new record, its frames of another
    shape); rank 0's repeat meets them in its first try: both raise, naming the op, and the
    next op of the name works on both."""
    with local_services(2) as svcs:
        barrier = threading.Barrier(2)

        def rank_main(svc: Any) -> Any:
            x = np.ones(512, np.float32)
            for _ in range(3):
                svc.allreduce(x, name="m")
                svc.allreduce(x, name="m", op="max")
            barrier.wait(30)
            with pytest.raises(tr.OpMismatchError) as info:
                svc.allreduce(x, name="m", op="sum" if svc.rank == 0 else "max")
            barrier.wait(30)
            return str(info.value), svc.allreduce(x, name="m")

        for text, after in run_ranks(svcs, rank_main, timeout=60):
            assert "'m'" in text and "generation 6" in text
            np.testing.assert_array_equal(after, np.full(512, 2.0))


def test_blocking_repeats_from_two_threads_of_one_rank() -> None:
    """Two threads of each rank repeat their own names: the loop's lock is taken by one
    blocking repeat at a time, and every result is exact."""
    with local_services(2) as svcs:

        def rank_main(svc: Any) -> list[list[np.ndarray]]:
            out: list[list[np.ndarray]] = [[], []]

            def thread(t: int) -> None:
                x = np.full(300, float(svc.rank + 10 * t))
                for k in range(100):
                    x[0] = k
                    out[t].append(svc.allreduce(x, name=f"t{t}"))

            threads = [threading.Thread(target=thread, args=(t,)) for t in range(2)]
            for th in threads:
                th.start()
            for th in threads:
                th.join(60)
            return out

        for out in run_ranks(svcs, rank_main, timeout=120):
            for t in range(2):
                assert len(out[t]) == 100
                for k, got in enumerate(out[t]):
                    assert got[0] == 2 * k
                    np.testing.assert_array_equal(got[1:], np.full(299, 1.0 + 20 * t))

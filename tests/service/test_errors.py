"""Errors a user gets: mismatches on every rank, timeouts, bad arguments, malformed frames."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest

import totalreduce as tr
from conftest import local_services, run_ranks
from totalreduce.service.config import Config
from totalreduce.service.service import Service
from totalreduce.transport.local import LocalWorld


@pytest.mark.parametrize("p", [2, 3, 5])
def test_count_mismatch_reported_on_every_rank(p: int) -> None:
    def rank_main(svc):
        n = 13 if svc.rank == 1 else 12
        t0 = time.monotonic()
        with pytest.raises(tr.OpMismatchError) as info:
            svc.allreduce(np.ones(n, dtype=np.float32), name="conv2.grad")
        after = svc.allreduce(np.full(3, svc.rank), name="next")
        return str(info.value), time.monotonic() - t0, after

    with local_services(p) as svcs:
        results = run_ranks(svcs, rank_main, timeout=30)
    for msg, secs, after in results:
        assert secs < 5
        assert "'conv2.grad' generation 0" in msg
        assert "count 12" in msg and "count 13" in msg
        assert "rank 1" in msg
        np.testing.assert_array_equal(after, np.full(3, p * (p - 1) // 2))


def test_dtype_and_op_mismatch_named() -> None:
    def rank_main(svc):
        dtype = np.float64 if svc.rank == 0 else np.float32
        with pytest.raises(tr.OpMismatchError) as a:
            svc.allreduce(np.ones(4, dtype=dtype), name="d")
        with pytest.raises(tr.OpMismatchError) as b:
            svc.allreduce(np.ones(4), name="o", op="max" if svc.rank == 0 else "min")
        return str(a.value), str(b.value)

    with local_services(2) as svcs:
        results = run_ranks(svcs, rank_main, timeout=30)
    for a, b in results:
        assert "float64" in a and "float32" in a
        assert "max" in b and "min" in b


def test_wait_timeout_raises_and_op_stays_in_flight() -> None:
    with local_services(2) as svcs:
        h = svcs[0].allreduce_async(np.ones(3), name="late")
        with pytest.raises(tr.OpTimeoutError, match="'late' generation 0"):
            h.wait(timeout=0.2)
        assert not h.done()
        other = svcs[1].allreduce_async(np.ones(3), name="late")
        np.testing.assert_array_equal(h.wait(timeout=10), np.full(3, 2.0))
        np.testing.assert_array_equal(other.wait(timeout=10), np.full(3, 2.0))


def test_invalid_arguments_raise_before_sending() -> None:
    with local_services(1) as (svc,):
        x = np.ones((4, 4))
        with pytest.raises(tr.InvalidArgumentError, match="C-contiguous"):
            svc.allreduce_async(x[:, 1])
        with pytest.raises(tr.InvalidArgumentError, match="unsupported dtype"):
            svc.allreduce_async(np.ones(3, dtype=np.complex64))
        with pytest.raises(tr.InvalidArgumentError, match="out has"):
            svc.allreduce_async(np.ones(3), out=np.ones(4))
        with pytest.raises(tr.InvalidArgumentError, match="read-only"):
            ro = np.ones(3)
            ro.flags.writeable = False
            svc.allreduce_async(np.ones(3), out=ro)
        with pytest.raises(tr.InvalidArgumentError, match="reduce op"):
            svc.allreduce_async(np.ones(3), op="median")
        with pytest.raises(tr.InvalidArgumentError, match="algorithm"):
            svc.allreduce_async(np.ones(3), algorithm="magic")
        with pytest.raises(tr.InvalidArgumentError, match="root"):
            svc.broadcast_async(np.ones(3), root=3)
        with pytest.raises(tr.InvalidArgumentError, match="overlaps"):
            y = np.ones(10)
            svc.allreduce_async(y[:5], out=y[2:7])
        assert svc.loop.stats.frames_sent == 0


def test_name_reused_in_flight_with_other_shape_refused() -> None:
    with local_services(2) as svcs:
        svcs[0].allreduce_async(np.ones(3), name="w")
        with pytest.raises(tr.InvalidArgumentError, match="'w': generation 0 is still in flight"):
            svcs[0].allreduce_async(np.ones(5), name="w")
        svcs[1].allreduce(np.ones(3), name="w")


def test_submit_after_shutdown() -> None:
    with local_services(1) as (svc,):
        svc.shutdown()
        with pytest.raises(tr.NotInitializedError):
            svc.allreduce_async(np.ones(2))


def test_p1_works() -> None:
    with local_services(1) as (svc,):
        x = np.arange(10.0)
        np.testing.assert_array_equal(svc.allreduce(x, op="avg"), x)
        np.testing.assert_array_equal(svc.broadcast(x), x)
        svc.barrier()
        y = x.copy()
        assert svc.allreduce(y, out=y) is not None
        np.testing.assert_array_equal(y, x)


def test_malformed_frame_is_an_error_not_a_crash() -> None:
    world = LocalWorld(2)
    svc = Service(world.transport(0), Config.load(env={}))
    from totalreduce.protocol import LANE_TAG
    from totalreduce.transport import mpi_native

    b = world.native().binding(1)  # rank 1's raw sends on the lane's tag
    req = mpi_native.request_array(b, 1)
    try:
        garbage = np.frombuffer(b"\x00garbage" * 12, dtype=np.uint8).copy()
        rc = mpi_native.mpi_isend(b, garbage.ctypes.data, garbage.nbytes, 0, LANE_TAG,
                                  req.ctypes.data)  # fmt: skip
        assert rc == 0
        deadline = time.monotonic() + 5
        while 1 not in svc.loop.peers.bad and time.monotonic() < deadline:
            time.sleep(0.01)
        h = svc.allreduce_async(np.ones(4), name="x")
        with pytest.raises(tr.FrameError, match="message from rank 1 refused.*bad magic"):
            h.wait(timeout=5)
        assert svc.loop.fatal is None  # the comm thread lives on
    finally:
        svc.shutdown(timeout=1)


def test_done_callback_runs_exactly_once() -> None:
    import threading

    with local_services(2) as svcs:
        for _ in range(50):
            calls = []
            h0 = svcs[0].allreduce_async(np.ones(3), name="cb")
            h1 = svcs[1].allreduce_async(np.ones(3), name="cb")
            t = threading.Thread(target=h0.add_done_callback, args=(calls.append,))
            t.start()
            h0.add_done_callback(calls.append)
            t.join()
            h0.wait(timeout=10)
            h1.wait(timeout=10)
            deadline = time.monotonic() + 5
            while len(calls) < 2 and time.monotonic() < deadline:
                time.sleep(0.001)  # callbacks run just after the event is set
            time.sleep(0.002)
            assert calls == [h0, h0]


def test_a_callback_added_while_the_handle_ends_runs_exactly_once() -> None:
    """``Handle._finish`` takes the callback lock only when it sees callbacks: one added
    just as it ends runs once (by the ender or by the adder), never twice, never not.
    The adder's look at the completion word is slowed, so the ender sets it and looks
    for callbacks in between."""
    from totalreduce.engine.completion import Completion
    from totalreduce.service.handle import Handle

    class SlowWord(Completion):
        __slots__ = ()

        def is_set(self) -> bool:
            flag = self._flag
            if not flag:
                time.sleep(0.002)  # what the ender may do meanwhile
            return flag

    for i in range(40):
        h = Handle("cb", 0, None)
        h._event = SlowWord()
        calls: list[str] = []
        start = threading.Barrier(3)

        def add(tag: str, h: Handle = h, calls: list[str] = calls, start: Any = start) -> None:
            start.wait()
            h.add_done_callback(lambda _h: calls.append(tag))

        def end(h: Handle = h, start: Any = start, late: float = 0.001 * (i % 3)) -> None:
            start.wait()
            time.sleep(late)  # before, while and after the adders look
            h._finish(None)

        threads = [threading.Thread(target=add, args=(t,)) for t in "ab"]
        threads.append(threading.Thread(target=end))
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert sorted(calls) == ["a", "b"], i


def test_abort_then_submit_fails_on_every_rank() -> None:
    def rank_main(svc):
        if svc.rank == 0:
            svc.abort("doomed", 0, "client 7 of node 0 died during op 'doomed'")
        with pytest.raises(tr.OpFailedError, match="client 7 of node 0 died"):
            svc.allreduce(np.ones(3), name="doomed")
        return svc.allreduce(np.ones(3), name="doomed")  # generation 1 is unaffected

    with local_services(3) as svcs:
        results = run_ranks(svcs, rank_main, timeout=30)
    for out in results:
        np.testing.assert_array_equal(out, np.full(3, 3.0))


def test_remembered_routes_and_checks_still_refuse_and_tell_names_apart() -> None:
    """What submission remembers per shape (route, reduce op, wire id) never hides a bad
    argument, a view of the input as ``out`` is in place, and names 1 and "1" are two ops."""
    with local_services(2) as svcs:

        def rank_main(svc):
            x = np.arange(6.0)
            for _ in range(2):  # the second time, from what was remembered
                np.testing.assert_array_equal(svc.allreduce(x, name="r"), 2 * x)
                with pytest.raises(tr.InvalidArgumentError, match="bitwise"):
                    svc.allreduce_async(x, name="r", op="band")
                with pytest.raises(tr.InvalidArgumentError, match="bool"):
                    svc.allreduce_async(np.ones(3, dtype=bool), op="avg")
            y = np.arange(6.0)
            svc.allreduce(y, name="view", out=y.reshape(2, 3))  # the same memory: in place
            np.testing.assert_array_equal(y, 2 * np.arange(6.0))
            a = svc.allreduce_async(np.ones(2), name=1)
            b = svc.allreduce_async(np.ones(3), name="1")  # another op, not a mismatch
            return a.wait(30), b.wait(30), (a.generation, b.generation)

        for a, b, gens in run_ranks(svcs, rank_main, timeout=60):
            np.testing.assert_array_equal(a, np.full(2, 2.0))
            np.testing.assert_array_equal(b, np.full(3, 2.0))
            assert gens == (0, 0)

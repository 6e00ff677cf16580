"""totalreduce.torch.futures: engine handles as torch futures and Work, on local ranks.

The failure cases matter most: a failed op must fail the torch future as C++ sees
it (DDP's reducer, ``Work``), not only in Python; ``set_exception`` does not
(``test_the_failure_reaches_cpp``).  Dead peers under MPI: test_torch_dead_peer.py.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest

from conftest import import_torch

torch = import_torch()
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch built without torch.distributed", allow_module_level=True)

import totalreduce.torch as trt  # noqa: E402
from conftest import local_services, run_ranks  # noqa: E402
from totalreduce.errors import OpFailedError, OpTimeoutError, TotalReduceError  # noqa: E402
from totalreduce.torch.futures import torch_future, torch_work  # noqa: E402

_create_work_from_future = pytest.importorskip(
    "torch._C._distributed_c10d"
)._create_work_from_future

torch.set_num_threads(1)


def _cpp_sees_success(fut: torch.futures.Future) -> bool:
    """What C++ makes of a completed future (``set_exception`` says success here)."""
    return bool(_create_work_from_future(fut).is_success())


def test_success_value_callbacks_and_their_thread() -> None:
    def rank(s):
        t = torch.full((5,), float(s.rank + 1))
        h = trt.allreduce_async_(t, name="fut.ok", op="sum", service=s)
        seen: list[str] = []
        fut = torch_future([h], lambda: h.wait() * 10)
        fut.add_done_callback(lambda f: seen.append(threading.current_thread().name))
        chained = fut.then(lambda f: f.value() + 1)
        got = fut.wait()
        assert torch.equal(got, torch.full((5,), 30.0)) and t.data_ptr() == h.wait().data_ptr()
        assert torch.equal(chained.wait(), torch.full((5,), 31.0))
        deadline = time.monotonic() + 5
        while not seen and time.monotonic() < deadline:
            time.sleep(0.001)
        assert _cpp_sees_success(fut)
        return seen

    with local_services(2) as svcs:
        seen = run_ranks(svcs, rank, timeout=60)
    for names in seen:
        # Once each, never on the comm thread (its callbacks would stall every op).
        assert len(names) == 1 and not names[0].startswith("totalreduce-comm"), names


def test_work_over_several_handles_and_no_handles() -> None:
    def rank(s):
        ts = [torch.full((3,), float(s.rank + k)) for k in range(3)]
        hs = [
            trt.allreduce_async_(t, name=f"fut.many{k}", op="sum", service=s)
            for k, t in enumerate(ts)
        ]
        finished = []
        work = torch_work(hs, lambda: finished.append(1) or ts)
        assert work.wait() is True and finished == [1]
        assert work.is_completed() and work.is_success() and work.exception() is None
        assert work.get_future().wait() is ts
        assert [t[0].item() for t in ts] == [1.0, 3.0, 5.0]
        empty = torch_work([], lambda: "nothing to wait for")
        assert empty.get_future().done() and empty.get_future().wait() == "nothing to wait for"
        assert empty.wait()

    with local_services(2) as svcs:
        run_ranks(svcs, rank, timeout=60)


def _failing_op(svcs, name: str):
    """An op on rank 0 whose peer (rank 1) shuts down before submitting it."""
    t = torch.ones(4)
    h = trt.allreduce_async_(t, name=name, service=svcs[0])
    return h


def _stop_peer_later(svc, delay: float) -> threading.Thread:
    th = threading.Thread(target=lambda: (time.sleep(delay), svc.shutdown(timeout=1)))
    th.start()
    return th


def test_a_failed_op_fails_the_future_in_python_and_cpp() -> None:
    with local_services(2) as svcs:
        h = _failing_op(svcs, "fut.dead")
        fut = torch_future([h], lambda: h.wait())
        work = torch_work([h], lambda: None)
        _stop_peer_later(svcs[1], 0.0).join()
        with pytest.raises(TotalReduceError, match=r"fut\.dead.*rank 1") as caught:
            work.wait()  # the op's own error, its own type
        assert isinstance(caught.value, RuntimeError)
        # torch's wrapper: a RuntimeError that still names the op and the rank.
        with pytest.raises(RuntimeError, match=r"fut\.dead.*rank 1"):
            fut.wait()
        assert not _cpp_sees_success(fut) and not _cpp_sees_success(work.get_future())
        assert work.is_completed() and not work.is_success()
        assert isinstance(work.exception(), OpFailedError)
        with pytest.raises(RuntimeError, match=r"fut\.dead"):
            fut.then(lambda f: f.value()).wait()


def test_a_waiter_blocked_before_the_failure_raises() -> None:
    with local_services(2) as svcs:
        h = _failing_op(svcs, "fut.later")
        work = torch_work([h], lambda: None)
        stopper = _stop_peer_later(svcs[1], 0.3)
        t0 = time.monotonic()
        with pytest.raises(TotalReduceError, match=r"fut\.later.*rank 1"):
            work.wait()
        stopper.join()
        assert time.monotonic() - t0 < 30
        assert work.get_future().done() and not _cpp_sees_success(work.get_future())


def test_a_failing_finish_fails_the_future() -> None:
    def rank(s):
        t = torch.ones(2)
        h = trt.allreduce_async_(t, name="fut.finish", op="sum", service=s)

        def finish():
            raise ValueError(f"copy-out failed on rank {s.rank}")

        work = torch_work([h], finish)
        with pytest.raises(ValueError, match="copy-out failed"):
            work.wait()
        fut = torch_future([h], finish)
        with pytest.raises(RuntimeError, match="copy-out failed"):
            fut.wait()
        assert not _cpp_sees_success(fut)

    with local_services(2) as svcs:
        run_ranks(svcs, rank, timeout=60)


def test_wait_with_a_timeout_leaves_the_op_in_flight() -> None:
    with local_services(2) as svcs:
        t0 = torch.ones(3)
        h0 = trt.allreduce_async_(t0, name="fut.slow", op="sum", service=svcs[0])
        work = torch_work([h0], lambda: t0)
        with pytest.raises(OpTimeoutError):
            work.wait(timedelta(milliseconds=200))
        assert not work.get_future().done()
        h1 = trt.allreduce_async_(torch.ones(3), name="fut.slow", op="sum", service=svcs[1])
        assert work.wait(timedelta(seconds=30))
        h1.wait()
        assert torch.equal(work.get_future().wait(), torch.full((3,), 2.0))


def test_a_callback_may_wait_on_another_future() -> None:
    """As on gloo, a callback chained on one future may block on another one's completion."""

    def rank(s):
        t1, t2 = torch.ones(2), torch.full((2,), 2.0)
        h1 = trt.allreduce_async_(t1, name="fut.first", op="sum", service=s)
        h2 = trt.allreduce_async_(t2, name="fut.second", op="sum", service=s)

        def then(f):
            inner = torch_future([h2], lambda: h2.wait())  # completed by the completion threads
            return f.value() + inner.wait()

        chained = torch_future([h1], lambda: h1.wait()).then(then)
        return chained.wait()

    with local_services(2) as svcs:
        got = run_ranks(svcs, rank, timeout=60)
    assert all(torch.equal(g, torch.full((2,), 6.0)) for g in got)

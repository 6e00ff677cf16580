"""The CUDA path: staging order with stand-in streams and events here, the real thing on a GPU."""

from __future__ import annotations

import contextlib
import copy

import pytest

from conftest import import_torch

torch = import_torch()

import totalreduce.torch as trt  # noqa: E402
from conftest import local_services, run_ranks  # noqa: E402
from totalreduce.torch.buckets import Bucket, plan_buckets  # noqa: E402
from totalreduce.torch.compression import Compression  # noqa: E402
from totalreduce.torch.cuda_staging import CudaLauncher, PinnedPool  # noqa: E402

torch.set_num_threads(1)
needs_gpu = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device: torch.cuda.is_available() is false"
)


class Event:
    """A stand-in CUDA event: done only when the test says so."""

    def __init__(self, log: list[str]) -> None:
        self.log, self.done = log, False

    def record(self, stream) -> None:
        self.log.append(f"record on {stream.name}")

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.log.append("event wait")
        self.done = True


class Stream:
    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def wait_stream(self, other) -> None:
        self.log.append(f"{self.name} waits for {other.name}")


def launcher(log: list[str], events: list[Event]) -> CudaLauncher:
    current = Stream("current", log)

    def event() -> Event:
        events.append(Event(log))
        return events[-1]

    return CudaLauncher(
        PinnedPool(pin=False),
        stream=Stream("side", log),
        current=lambda: current,
        event=event,
        stream_context=lambda _s: contextlib.nullcontext(),
    )


def test_ops_leave_only_once_their_copy_is_done() -> None:
    P = 2

    def rank(s):
        # Each rank (a thread here) has its own parameters: two threads setting .grad on
        # the same tensors at once is a race in torch itself.
        params = [
            ("a", torch.zeros(3, dtype=torch.float64)),
            ("b", torch.zeros(4, dtype=torch.float64)),
        ]
        log: list[str] = []
        events: list[Event] = []
        lau = launcher(log, events)
        (plan,) = plan_buckets(params, [1, 2], 1 << 20, Compression.none, "cuda.")
        b = Bucket(plan, "avg", s, launcher=lau)
        got = []
        for step in range(2):
            assert [n for n, _ in plan.members] == ["b", "a"]  # reverse registration order
            b.fill(1, torch.full((3,), float(s.rank + step), dtype=torch.float64))
            b.fill(0, torch.full((4,), 10.0 * s.rank, dtype=torch.float64))
            b.submit()
            assert b.submitted and b.handle is None and lau.staged == 1
            assert log[-2:] == ["side waits for current", "record on side"]
            assert lau.poll() == 0 and b.handle is None  # the copy is not done: nothing leaves
            if step == 0:
                events[-1].done = True
                assert lau.poll() == 1 and b.handle is not None
            else:
                lau.flush()  # synchronize(): may wait for the copy
                assert log[-1] == "event wait" and b.handle is not None
            assert lau.staged == 0
            for _, p in plan.members:
                p.grad = None
            b.finish()
            assert log[-1] == "current waits for side"  # the optimizer reads after the copy back
            got.append([p.grad.tolist() for _, p in plan.members])
        host = b.host
        lau.release([b])
        assert b.host is None and lau.pool.acquire(7, torch.float64) is host
        assert lau.pool.allocated == 1  # one host buffer for both steps
        return got

    with local_services(P) as svcs:
        results = run_ranks(svcs, lambda s: rank(s), timeout=60)
    for got in results:
        assert got[0] == [[5.0] * 4, [0.5] * 3]
        assert got[1] == [[5.0] * 4, [1.5] * 3]


def test_pinned_pool_reuses_by_size_and_dtype() -> None:
    pool = PinnedPool(pin=False)
    a = pool.acquire(16, torch.float32)
    pool.release(a)
    assert pool.acquire(16, torch.float64) is not a
    assert pool.acquire(16, torch.float32) is a
    assert pool.allocated == 2


@needs_gpu
@pytest.mark.parametrize("fusion_bytes", [0, 1 << 20])
def test_distributed_optimizer_on_cuda_matches_cpu(fusion_bytes: int) -> None:
    P = 2
    torch.manual_seed(3)
    template = torch.nn.Sequential(
        torch.nn.Linear(5, 9), torch.nn.Tanh(), torch.nn.Linear(9, 3)
    ).double()

    def rank(s, device):
        model = copy.deepcopy(template).to(device)
        opt = trt.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
            named_parameters=model.named_parameters(),
            fusion_bytes=fusion_bytes,
            prefix=f"{device}.",
            service=s,
        )
        g = torch.Generator().manual_seed(s.rank)
        x = torch.randn(6, 5, generator=g, dtype=torch.float64).to(device)
        y = torch.randn(6, 3, generator=g, dtype=torch.float64).to(device)
        for _ in range(4):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        return [p.detach().cpu() for p in model.parameters()]

    with local_services(P) as svcs:
        cpu = run_ranks(svcs, lambda s: rank(s, "cpu"))
        gpu = run_ranks(svcs, lambda s: rank(s, "cuda"))
    for a, b in zip(cpu[0], gpu[0], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


@needs_gpu
def test_cuda_tensor_collectives() -> None:
    P = 2

    def rank(s):
        t = torch.full((1000,), float(s.rank + 1), device="cuda")
        avg = trt.allreduce(t, "cuda.t", op="avg", service=s)
        trt.allreduce_(t, "cuda.t_", op="sum", service=s)
        return avg.device.type, avg.cpu(), t.cpu()

    with local_services(P) as svcs:
        for dev, avg, t in run_ranks(svcs, rank):
            assert dev == "cuda" and torch.all(avg == 1.5) and torch.all(t == 3.0)

"""totalreduce.torch's tensor collectives over the local transport (ranks as threads)."""

from __future__ import annotations

import subprocess
import sys
import threading

import numpy as np
import pytest

from conftest import import_torch

torch = import_torch()

import totalreduce.torch as trt  # noqa: E402
from conftest import local_services, run_ranks  # noqa: E402
from totalreduce.errors import InvalidArgumentError, TotalReduceError  # noqa: E402
from totalreduce.torch.tensors import host_buffer  # noqa: E402

torch.set_num_threads(1)
P = 3


@pytest.fixture(scope="module")
def services():
    with local_services(P) as svcs:
        yield svcs


def values(rank: int, dtype: torch.dtype, shape: tuple[int, ...] = (5, 4)) -> torch.Tensor:
    n = int(np.prod(shape))
    return (torch.arange(n, dtype=torch.float64).reshape(shape) * (rank + 1) - 3).to(dtype)


def test_import_totalreduce_does_not_import_torch() -> None:
    code = "import sys, totalreduce; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_missing_torch_gives_install_hint() -> None:
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "try:\n    import totalreduce.torch\nexcept ImportError as e:\n    print(e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    assert "pip install torch" in out


@pytest.mark.parametrize("dtype", trt.SUPPORTED_DTYPES, ids=str)
def test_allreduce_every_dtype(services, dtype: torch.dtype) -> None:
    def rank(s):
        x = values(s.rank, dtype)
        total = trt.allreduce(x, name=f"sum.{dtype}", op="sum", service=s)
        y = values(s.rank, dtype)
        same = trt.allreduce_(y, name=f"max.{dtype}", op="max", service=s)
        assert same is y
        return total, y

    results = run_ranks(services, rank)
    # Integer and bool types reduce in their own arithmetic (uint8 wraps, bool sums as "or").
    exact = dtype if not dtype.is_floating_point else torch.float64
    want_sum = values(0, exact)
    want_max = values(0, exact)
    for r in range(1, P):
        want_sum = want_sum + values(r, exact)
        want_max = torch.maximum(want_max, values(r, exact))
    for total, mx in results:
        assert total.dtype == dtype and total.shape == (5, 4)
        tol = {torch.float16: 1e-2, torch.bfloat16: 2e-2}.get(dtype, 0.0)
        torch.testing.assert_close(total.double(), want_sum.double(), rtol=tol, atol=tol)
        torch.testing.assert_close(mx.double(), want_max.double(), rtol=tol, atol=tol)


def test_contiguous_tensor_is_used_without_copy() -> None:
    t = torch.ones(4, 3)
    buf = host_buffer(t)
    assert not buf.staged
    assert buf.array.ctypes.data == t.data_ptr()
    bf = torch.ones(7, dtype=torch.bfloat16)
    bbuf = host_buffer(bf)
    assert not bbuf.staged and bbuf.engine_dtype == "bfloat16"
    assert bbuf.array.dtype == np.uint16 and bbuf.array.ctypes.data == bf.data_ptr()
    assert host_buffer(t.t()).staged


def test_in_place_on_non_contiguous_tensor_copies_back(services) -> None:
    def rank(s):
        base = torch.zeros(4, 6, dtype=torch.float64)
        view = base[:, ::2]
        view.fill_(s.rank + 1)
        trt.allreduce_(view, name="strided", op="sum", service=s)
        return base

    for base in run_ranks(services, rank):
        assert torch.all(base[:, ::2] == sum(range(1, P + 1)))
        assert torch.all(base[:, 1::2] == 0)


def test_average_and_handles(services) -> None:
    def rank(s):
        x = torch.full((3,), float(s.rank), dtype=torch.float32)
        h = trt.allreduce_async(x, "avg.handle", service=s)
        seen = threading.Event()
        h.add_done_callback(lambda th: seen.set())
        out = trt.synchronize(h)
        assert trt.poll(h) and h.exception() is None and seen.wait(5)
        assert h.name == "avg.handle" and h.generation >= 0
        return out

    for out in run_ranks(services, rank):
        torch.testing.assert_close(out, torch.full((3,), (P - 1) / 2))


def test_requires_grad_tensor_and_zero_dim(services) -> None:
    def rank(s):
        w = torch.full((2,), 1.0 + s.rank, requires_grad=True)
        a = trt.allreduce(w, "rg", op="sum", service=s)
        z = trt.allreduce(torch.tensor(2.0 * s.rank), "scalar", op="sum", service=s)
        return a, z

    for a, z in run_ranks(services, rank):
        assert not a.requires_grad
        torch.testing.assert_close(a, torch.full((2,), 6.0))
        assert z.shape == () and float(z) == 2.0 * sum(range(P))


def test_broadcast_widens_small_integer_types(services) -> None:
    def rank(s):
        flags = torch.tensor([s.rank == 1, s.rank != 1, True])
        trt.broadcast_(flags, root=1, name="flags", service=s)
        small = torch.arange(4, dtype=torch.uint8) + s.rank
        copy = trt.broadcast(small, root=2, name="small", service=s)
        bf = torch.full((3,), 0.5 * (s.rank + 1), dtype=torch.bfloat16)
        trt.broadcast_(bf, root=0, service=s)
        return flags, copy, bf

    for flags, copy, bf in run_ranks(services, rank):
        assert flags.tolist() == [True, False, True]
        assert copy.dtype == torch.uint8 and copy.tolist() == [2, 3, 4, 5]
        assert bf.tolist() == [0.5, 0.5, 0.5]


def test_reduce_scatter_and_allgather_flat(services) -> None:
    def rank(s):
        x = torch.arange(10, dtype=torch.float64) * (s.rank + 1)
        part = trt.reduce_scatter(x, "rs.flat", service=s)
        whole = trt.allgather(part, "ag.flat", service=s)
        return part, whole

    total = torch.arange(10, dtype=torch.float64) * sum(range(1, P + 1))
    results = run_ranks(services, rank)
    assert [len(p) for p, _ in results] == [4, 3, 3]
    torch.testing.assert_close(torch.cat([p for p, _ in results]), total)
    for _, whole in results:
        torch.testing.assert_close(whole, total)


def test_neighbor_allreduce_complete_topology_averages(services) -> None:
    def rank(s):
        x = torch.full((4,), float(s.rank), dtype=torch.float64)
        new = trt.neighbor_allreduce(x, "nb", topology="complete", service=s)
        trt.neighbor_allreduce_(x, "nb.inplace", topology="complete", service=s)
        return new, x

    for new, x in run_ranks(services, rank):
        torch.testing.assert_close(new, torch.full((4,), (P - 1) / 2, dtype=torch.float64))
        torch.testing.assert_close(x, new)


@pytest.mark.parametrize(
    ("bad", "words"),
    [
        (lambda: torch.zeros(3, dtype=torch.complex64), "view_as_real"),
        (lambda: torch.zeros(3, dtype=torch.uint32), "uint32"),
        (lambda: torch.zeros(3).to_sparse(), "dense"),
        (lambda: np.zeros(3), "torch.Tensor"),
        (lambda: torch.zeros(3, device="meta"), "meta"),
    ],
)
def test_bad_tensors_are_refused_at_the_call(services, bad, words: str) -> None:
    with pytest.raises(InvalidArgumentError, match=words) as info:
        trt.allreduce_async(bad(), "never", service=services[0])
    assert isinstance(info.value, TotalReduceError)


def test_cuda_tensor_round_trip(services) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")

    def rank(s):
        x = torch.full((1000,), float(s.rank), device="cuda")
        y = trt.allreduce(x, "cuda.new", op="sum", service=s)
        trt.allreduce_(x, "cuda.inplace", op="sum", service=s)
        return y, x

    for y, x in run_ranks(services, rank):
        assert y.is_cuda and x.is_cuda
        assert torch.all(y == sum(range(P))) and torch.all(x == sum(range(P)))

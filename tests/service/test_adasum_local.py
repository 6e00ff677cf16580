"""Adasum (``allreduce(op="adasum")``) on the local transport, against a numpy reference."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import local_services, run_ranks
from totalreduce.errors import InvalidArgumentError

OPTIONS = {"segment_bytes": 64, "micro_bytes": 32}


def ada(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a64, b64 = a.reshape(-1).astype(np.float64), b.reshape(-1).astype(np.float64)
    dot, aa, bb = float(a64 @ b64), float(a64 @ a64), float(b64 @ b64)
    ca = 1 - dot / aa * 0.5 if aa >= 1e-8 else 1.0
    cb = 1 - dot / bb * 0.5 if bb >= 1e-8 else 1.0
    return (ca * a64 + cb * b64).astype(a.dtype).reshape(a.shape)


def reference(vs: list[np.ndarray]) -> np.ndarray:
    p = len(vs)
    m = 1
    while m * 2 <= p:
        m *= 2
    v = [x.copy() for x in vs[:m]]
    for r in range(p - m):
        v[r] = ada(v[r], vs[r + m])
    d = 1
    while d < m:
        v = [ada(v[min(r, r ^ d)], v[max(r, r ^ d)]) for r in range(m)]
        d *= 2
    return v[0]


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_adasum_matches_the_reference_and_is_the_same_on_every_rank(p: int, dtype: type) -> None:
    rng = np.random.default_rng(p)
    xs = [rng.normal(size=(3, 11)).astype(dtype) for _ in range(p)]

    def rank_main(svc):
        a = svc.allreduce(xs[svc.rank], op="adasum", name="g")
        b = svc.allreduce_async(xs[svc.rank].copy(), op="adasum", name="g").wait(30)
        x = xs[svc.rank].copy()
        svc.allreduce(x, op="adasum", out=x)  # in place, unnamed
        return a, b, x

    with local_services(p, **OPTIONS) as svcs:
        results = run_ranks(svcs, rank_main, timeout=120)
    want = reference(xs)
    for a, b, x in results:
        assert a.shape == (3, 11) and a.dtype == dtype
        np.testing.assert_array_equal(a, results[0][0])  # the same bits everywhere
        np.testing.assert_array_equal(b, a)
        np.testing.assert_array_equal(x, a)
        np.testing.assert_allclose(a, want, rtol=1e-5 if dtype == np.float32 else 1e-12)


def test_adasum_adds_orthogonal_gradients_and_averages_equal_ones() -> None:
    def rank_main(svc):
        e = np.zeros(4)
        e[svc.rank] = 1.0 + svc.rank
        same = np.full(4, 3.0)
        return svc.allreduce(e, op="adasum"), svc.allreduce(same, op="adasum")

    with local_services(4, **OPTIONS) as svcs:
        results = run_ranks(svcs, rank_main, timeout=60)
    for orth, same in results:
        np.testing.assert_allclose(orth, [1.0, 2.0, 3.0, 4.0])
        np.testing.assert_allclose(same, np.full(4, 3.0))


def test_adasum_refuses_integers() -> None:
    with local_services(1, **OPTIONS) as svcs:
        with pytest.raises(InvalidArgumentError, match="floating gradients .* got int64"):
            svcs[0].allreduce(np.arange(3), op="adasum")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_adasum_of_16_bit_floats_combines_in_float32(dtype: str) -> None:
    import totalreduce.kernels as k
    from totalreduce.dtypes import DType

    dt = DType.FLOAT16 if dtype == "float16" else DType.BFLOAT16
    p, n = 3, 9
    rng = np.random.default_rng(5)
    xs32 = [rng.normal(size=n).astype(np.float32) for _ in range(p)]
    xs16 = []
    for x in xs32:
        bits = np.empty(n, np.uint16)
        k.narrow_into(bits, x, dt)
        back = np.empty(n, np.float32)
        k.widen_into(back, bits, dt)
        xs16.append((bits, back))
    want32 = reference([b for _, b in xs16])
    want = np.empty(n, np.uint16)
    k.narrow_into(want, want32, dt)

    def rank_main(svc):
        bits = xs16[svc.rank][0]
        x = bits if dtype == "bfloat16" else bits.view(np.float16)
        kw = {"dtype": "bfloat16"} if dtype == "bfloat16" else {}
        return svc.allreduce(x, op="adasum", name="h", **kw).view(np.uint16)

    with local_services(p, **OPTIONS) as svcs:
        results = run_ranks(svcs, rank_main, timeout=60)
    for got in results:
        np.testing.assert_array_equal(got, results[0])
        np.testing.assert_array_equal(got, want)

"""The element kernels against numpy references, bit for bit.

float32/float64/int32/int64 are checked against numpy's own arithmetic;
float16 against numpy computing in float32 and casting back; bfloat16 (which
numpy lacks) against a float64 round-to-nearest-even reference written here.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numba
import numpy as np
import pytest

from totalreduce import kernels
from totalreduce.dtypes import DType, ReduceOp
from totalreduce.kernels import (
    axpy_into,
    copy_into,
    finish_average,
    reduce_into,
    scale_into,
    warm_up,
)
from totalreduce.kernels import numba_kernels as nk

FLOATS = [DType.FLOAT16, DType.FLOAT32, DType.FLOAT64, DType.BFLOAT16]
INTS = [DType.INT32, DType.INT64]
ALL = FLOATS + INTS
N = 1013  # odd, so vector loops also run their remainder


@pytest.fixture(autouse=True)
def _quiet_numpy() -> Iterator[None]:
    """The references overflow to infinity and make NaNs on purpose."""
    with np.errstate(all="ignore"):
        yield


# ---------------------------------------------------------------------------
# References and data.
# ---------------------------------------------------------------------------


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _bf16_magnitude(bits: np.ndarray) -> np.ndarray:
    """|value| of bfloat16 bits in float64, with 0x7f80 read as 2**128, not inf."""
    bits = bits.astype(np.int64) & 0x7FFF
    exp = bits >> 7
    man = (bits & 0x7F).astype(np.float64)
    normal = np.ldexp(1.0 + man / 128.0, (exp - 127).astype(np.int32))
    subnormal = np.ldexp(man / 128.0, -126)
    return np.where(exp == 0, subnormal, normal)


def f32_to_bf16(values: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 bits, nearest even, without bit tricks."""
    f = np.asarray(values, dtype=np.float32)
    u = f.view(np.uint32)
    low = (u >> 16).astype(np.uint16)  # truncated toward zero
    high = low + np.uint16(1)  # next magnitude up (may be infinity)
    x = np.abs(f.astype(np.float64))
    d_low = x - _bf16_magnitude(low)
    d_high = _bf16_magnitude(high) - x
    up = (d_high < d_low) | ((d_high == d_low) & (low & 1 == 1))
    out = np.where(up, high, low)
    out = np.where(np.isinf(f), low, out)  # infinities are exact
    return np.where(np.isnan(f), np.uint16(0x7FC0), out).astype(np.uint16)


def is_nan(a: np.ndarray, dtype: DType) -> np.ndarray:
    if dtype is DType.BFLOAT16:
        return (a & 0x7FFF) > 0x7F80
    if dtype in INTS:
        return np.zeros(a.shape, bool)
    return np.isnan(a)


def bits(a: np.ndarray) -> np.ndarray:
    return a.view(f"u{a.dtype.itemsize}")


def assert_same(got: np.ndarray, want: np.ndarray, dtype: DType, any_zero: bool = False) -> None:
    """Bit-identical, except that any NaN matches any NaN (and, with
    ``any_zero``, -0 matches +0: which zero MAX/MIN return is unspecified)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    nan_got, nan_want = is_nan(got, dtype), is_nan(want, dtype)
    np.testing.assert_array_equal(nan_got, nan_want)
    ok = nan_got | (bits(got) == bits(want))
    if any_zero and dtype not in INTS:
        magnitude = np.iinfo(bits(got).dtype).max >> 1
        ok |= ((bits(got) & magnitude) == 0) & ((bits(want) & magnitude) == 0)
    bad = np.flatnonzero(~ok)
    assert bad.size == 0, (
        f"{bad.size} mismatches, first at {bad[0]}: {got[bad[0]]} != {want[bad[0]]}"
    )


def sample(dtype: DType, n: int, rng: np.random.Generator, nan: bool = False) -> np.ndarray:
    """Test data spanning the type: wide ranges, nearby values, specials."""
    if dtype in INTS:
        info = np.iinfo(dtype.numpy)
        return rng.integers(info.min, info.max, n, dtype=dtype.numpy, endpoint=True)
    if dtype in (DType.FLOAT16, DType.BFLOAT16):
        # Half random bit patterns (subnormals to infinities), half values of
        # similar size so that sums round rather than just pick the larger.
        raw = rng.integers(0, 1 << 16, n, dtype=np.uint16)
        near = rng.standard_normal(n).astype(np.float32) * 3
        near16 = near.astype(np.float16).view(np.uint16)
        if dtype is DType.BFLOAT16:
            near16 = f32_to_bf16(near)
        out = np.where(rng.random(n) < 0.5, raw, near16)
        if not nan:
            limit = 0x7C00 if dtype is DType.FLOAT16 else 0x7F80
            out = np.where((out & 0x7FFF) > limit, out & 0x83FF, out)  # NaN -> finite
        return out.view(dtype.numpy).copy() if dtype is DType.FLOAT16 else out
    x = (rng.standard_normal(n) * 10.0 ** rng.integers(-5, 6, n)).astype(dtype.numpy)
    specials = [0.0, -0.0, np.inf, -np.inf, 1e-45, np.finfo(dtype.numpy).max]
    if nan:
        specials.append(np.nan)
    x[rng.integers(0, n, 20)] = rng.choice(specials, 20)
    return x


def to32(a: np.ndarray, dtype: DType) -> np.ndarray:
    """float16/bfloat16 data widened to float32 (the reference's working type)."""
    return bf16_to_f32(a) if dtype is DType.BFLOAT16 else a.astype(np.float32)


def from32(x: np.ndarray, dtype: DType) -> np.ndarray:
    """float32 rounded back to float16/bfloat16, to nearest even."""
    return f32_to_bf16(x) if dtype is DType.BFLOAT16 else x.astype(np.float16)


def reference_reduce(a: np.ndarray, b: np.ndarray, op: ReduceOp, dtype: DType) -> np.ndarray:
    half = dtype in (DType.FLOAT16, DType.BFLOAT16)
    if op in (ReduceOp.SUM, ReduceOp.AVG):
        if half:
            return from32(to32(a, dtype) + to32(b, dtype), dtype)
        return np.add(a, b)
    if op is ReduceOp.PRODUCT:
        if half:
            return from32(to32(a, dtype) * to32(b, dtype), dtype)
        return np.multiply(a, b)
    if op.bitwise:
        bitwise = {ReduceOp.BAND: np.bitwise_and, ReduceOp.BOR: np.bitwise_or}
        return bitwise.get(op, np.bitwise_xor)(a, b)
    # MAX/MIN pick an operand (NaN propagates), so they are exact in any type.
    func = np.maximum if op is ReduceOp.MAX else np.minimum
    if dtype is DType.BFLOAT16:
        return from32(func(to32(a, dtype), to32(b, dtype)), dtype)
    return func(a, b)


# ---------------------------------------------------------------------------
# reduce_into
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "op"),
    [(d, o) for d in ALL for o in ReduceOp if o.refuses(d) is None],
    ids=lambda v: v.name,
)
def test_reduce_matches_numpy(dtype: DType, op: ReduceOp) -> None:
    rng = np.random.default_rng(int(dtype) * 10 + int(op))
    nan = op in (ReduceOp.MAX, ReduceOp.MIN)  # NaN payloads survive only in MAX/MIN
    for n in (1, 2, 7, 16, 17, 33, N, 20000):
        a, b = sample(dtype, n, rng, nan), sample(dtype, n, rng, nan)
        want = reference_reduce(a, b, op, dtype)
        reduce_into(a, b, op, dtype)
        assert_same(a, want, dtype, any_zero=nan)


@pytest.mark.parametrize("dtype", INTS, ids=lambda d: d.name)
def test_integer_sum_wraps(dtype: DType) -> None:
    info = np.iinfo(dtype.numpy)
    a = np.array([info.max, info.min, info.max, -1], dtype.numpy)
    b = np.array([1, -1, info.max, info.min], dtype.numpy)
    want = a + b
    reduce_into(a, b, ReduceOp.SUM, dtype)
    np.testing.assert_array_equal(a, want)
    assert a[0] == info.min and a[1] == info.max


def test_float16_sum_rounds_like_numpy_on_dense_grid() -> None:
    # Every half value plus a few addends of various magnitudes: ties, carries
    # into the exponent, overflow to infinity and results in the subnormals.
    every = np.arange(1 << 16, dtype=np.uint16)
    every = every[(every & 0x7FFF) <= 0x7C00].view(np.float16)
    for addend in (0.0, -0.0, 2.0**-24, -(2.0**-25), 2.0**-14, 0.5, 1.0, 3.0, 1e4, 65504.0):
        a = every.copy()
        b = np.full(a.shape, addend, np.float16)
        want = (a.astype(np.float32) + b.astype(np.float32)).astype(np.float16)
        reduce_into(a, b, ReduceOp.SUM, DType.FLOAT16)
        assert_same(a, want, DType.FLOAT16)


@pytest.mark.parametrize("dtype", ALL, ids=lambda d: d.name)
def test_reduce_into_views_with_offsets(dtype: DType) -> None:
    rng = np.random.default_rng(7)
    a, b = sample(dtype, 20, rng), sample(dtype, 20, rng)
    orig = a.copy()
    want = reference_reduce(a[3:10], b[5:12], ReduceOp.SUM, dtype)
    reduce_into(a[3:10], b[5:12], ReduceOp.SUM, dtype)
    assert_same(a[3:10], want, dtype)
    assert_same(a[:3], orig[:3], dtype)
    assert_same(a[10:], orig[10:], dtype)


@pytest.mark.parametrize("shift", [-5, -2, 2, 5])
def test_reduce_and_copy_overlapping_views_match_numpy(shift: int) -> None:
    base = np.arange(40, dtype=np.float32) * 1.5
    d0, s0 = (shift, 0) if shift > 0 else (0, -shift)
    for op in (ReduceOp.SUM, ReduceOp.MAX):
        got, want = base.copy(), base.copy()
        func = np.add if op is ReduceOp.SUM else np.maximum
        func(want[d0 : d0 + 30], want[s0 : s0 + 30], out=want[d0 : d0 + 30])
        reduce_into(got[d0 : d0 + 30], got[s0 : s0 + 30], op, DType.FLOAT32)
        np.testing.assert_array_equal(got, want)
    got, want = base.copy(), base.copy()
    want[d0 : d0 + 30] = want[s0 : s0 + 30]
    copy_into(got[d0 : d0 + 30], got[s0 : s0 + 30], DType.FLOAT32)
    np.testing.assert_array_equal(got, want)
    # Identical ranges are fine too.
    got = base.copy()
    reduce_into(got, got, ReduceOp.SUM, DType.FLOAT32)
    np.testing.assert_array_equal(got, base * 2)


def test_read_only_and_unaligned_arrays_are_accepted() -> None:
    src = np.frombuffer(np.arange(8, dtype=np.float64).tobytes(), np.float64)
    assert not src.flags.writeable
    raw = bytearray(8 * 8 + 1)
    dst = np.frombuffer(raw, np.float64, count=8, offset=1)
    assert not dst.flags.aligned
    dst[:] = 1.0
    reduce_into(dst, src, ReduceOp.SUM, DType.FLOAT64)
    np.testing.assert_array_equal(dst, np.arange(8) + 1.0)
    copy_into(dst, src, DType.FLOAT64)
    np.testing.assert_array_equal(dst, np.arange(8.0))
    axpy_into(dst, src, 0.5, DType.FLOAT64)
    np.testing.assert_array_equal(dst, np.arange(8.0) * 1.5)
    h = np.frombuffer(np.ones(4, np.float16).tobytes(), np.float16)
    out = np.zeros(4, np.float16)
    reduce_into(out, h, ReduceOp.MAX, DType.FLOAT16)
    np.testing.assert_array_equal(out, np.ones(4))


# ---------------------------------------------------------------------------
# copy_into, finish_average, scale_into, axpy_into
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ALL, ids=lambda d: d.name)
def test_copy_into(dtype: DType) -> None:
    rng = np.random.default_rng(3)
    for n in (1, 5, N):
        src = sample(dtype, n, rng, nan=True)
        dst = np.zeros(n + 4, dtype.numpy)
        copy_into(dst[2 : n + 2], src, dtype)
        np.testing.assert_array_equal(bits(dst[2 : n + 2]), bits(src))
        assert not bits(dst[:2]).any() and not bits(dst[n + 2 :]).any()


@pytest.mark.parametrize("dtype", INTS, ids=lambda d: d.name)
@pytest.mark.parametrize("divisor", [1, 2, 3, 4, 7, 8, 1 << 20, 1000003])
def test_finish_average_integers_floor(dtype: DType, divisor: int) -> None:
    rng = np.random.default_rng(divisor)
    info = np.iinfo(dtype.numpy)
    a = np.concatenate(
        [
            np.array([info.min, info.max, -1, -2, -3, -7, -8, -9, 0, 1, 7, 9], dtype.numpy),
            sample(dtype, N, rng),
            rng.integers(-50, 50, 200, dtype=dtype.numpy),
        ]
    )
    want = a // divisor
    finish_average(a, divisor, dtype)
    np.testing.assert_array_equal(a, want)
    assert np.all(a[2:8] < 0)  # -1 // 2 == -1, not 0: floor, not truncation


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name)
@pytest.mark.parametrize("divisor", [2, 3, 7, 8, 100])
def test_finish_average_floats(dtype: DType, divisor: int) -> None:
    a = sample(dtype, N, np.random.default_rng(divisor), nan=True)
    if dtype in (DType.FLOAT16, DType.BFLOAT16):
        want = from32(to32(a, dtype) / np.float32(divisor), dtype)
    else:
        want = a / dtype.numpy.type(divisor)
    finish_average(a, divisor, dtype)
    assert_same(a, want, dtype)


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name)
@pytest.mark.parametrize("weight", [0.5, 0.1, -3.0, 1 / 3])
def test_scale_and_axpy(dtype: DType, weight: float) -> None:
    rng = np.random.default_rng(11)
    a, b = sample(dtype, N, rng), sample(dtype, N, rng)
    if dtype in (DType.FLOAT16, DType.BFLOAT16):
        w = np.float32(weight)
        want_scale = from32(to32(a, dtype) * w, dtype)
        want_axpy = from32(to32(a, dtype) + w * to32(b, dtype), dtype)
    else:
        w = dtype.numpy.type(weight)
        want_scale, want_axpy = a * w, a + w * b
    got = a.copy()
    scale_into(got, weight, dtype)
    assert_same(got, want_scale, dtype)
    got = a.copy()
    axpy_into(got, b, weight, dtype)
    assert_same(got, want_axpy, dtype)


# ---------------------------------------------------------------------------
# Edge cases and errors.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ALL, ids=lambda d: d.name)
def test_empty_arrays_are_no_ops(dtype: DType) -> None:
    a, b = np.zeros(0, dtype.numpy), np.zeros(0, dtype.numpy)
    for op in ReduceOp:
        reduce_into(a, b, op, dtype)
    copy_into(a, b, dtype)
    finish_average(a, 3, dtype)
    if dtype in FLOATS:
        scale_into(a, 2.0, dtype)
        axpy_into(a, b, 2.0, dtype)


@pytest.mark.parametrize("func", ["reduce_into", "copy_into", "axpy_into"])
def test_length_mismatch_names_both_lengths(func: str) -> None:
    a, b = np.zeros(3, np.float32), np.zeros(4, np.float32)
    with pytest.raises(ValueError, match=r"dst has 3 elements but src has 4"):
        if func == "reduce_into":
            reduce_into(a, b, ReduceOp.SUM, DType.FLOAT32)
        elif func == "copy_into":
            copy_into(a, b, DType.FLOAT32)
        else:
            axpy_into(a, b, 1.0, DType.FLOAT32)
    with pytest.raises(ValueError, match=r"dst has 0 elements but src has 4"):
        reduce_into(a[:0], b, ReduceOp.SUM, DType.FLOAT32)


@pytest.mark.parametrize("dtype", INTS, ids=lambda d: d.name)
def test_integer_scale_and_axpy_raise(dtype: DType) -> None:
    a = np.ones(4, dtype.numpy)
    with pytest.raises(TypeError, match=f"scale_into.*{dtype.name}"):
        scale_into(a, 0.5, dtype)
    with pytest.raises(TypeError, match=f"axpy_into.*{dtype.name}"):
        axpy_into(a, a.copy(), 0.5, dtype)
    np.testing.assert_array_equal(a, 1)


def test_bad_arguments_raise_clear_errors() -> None:
    f32 = np.ones(4, np.float32)
    with pytest.raises(ValueError, match="unsupported op"):
        reduce_into(f32, f32.copy(), 99, DType.FLOAT32)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unsupported dtype"):
        reduce_into(f32, f32.copy(), ReduceOp.SUM, np.float32)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="divisor must be >= 1"):
        finish_average(f32, 0, DType.FLOAT32)
    with pytest.raises(TypeError):
        finish_average(f32, 2.0, DType.FLOAT32)  # type: ignore[arg-type]
    wrong_kind: list[tuple[Any, Any, DType, str]] = [
        (np.ones(4, np.float64), np.ones(4, np.float64), DType.FLOAT32, "float64"),
        (np.ones(4, np.float32), np.ones(4, np.float32), DType.FLOAT16, "float32"),
        (np.ones(4, np.float16), np.ones(4, np.float16), DType.BFLOAT16, "float16"),
        (np.ones(8, np.float32)[::2], np.ones(4, np.float32), DType.FLOAT32, "non-contiguous"),
        (np.ones((2, 2), np.float32), np.ones((2, 2), np.float32), DType.FLOAT32, "2-D"),
        (np.frombuffer(bytes(16), np.float32), np.ones(4, np.float32), DType.FLOAT32, "read-only"),
    ]
    for dst, src, dtype, what in wrong_kind:
        with pytest.raises(TypeError, match=f"reduce_into\\({dtype.name}\\).*{what}"):
            reduce_into(dst, src, ReduceOp.SUM, dtype)
        with pytest.raises(TypeError, match=f"copy_into\\({dtype.name}\\).*{what}"):
            copy_into(dst, src, dtype)
    with pytest.raises(TypeError, match="float32"):
        scale_into(np.ones(4, np.float32), 2.0, DType.FLOAT16)


# ---------------------------------------------------------------------------
# Conversions: exhaustive over 16-bit patterns.
# ---------------------------------------------------------------------------

ALL16 = np.arange(1 << 16, dtype=np.uint16)


def test_float16_to_float32_all_patterns() -> None:
    got = np.empty(ALL16.size, np.float32)
    nk.half_bits_to_float32(ALL16, got)
    want = ALL16.view(np.float16).astype(np.float32)
    assert_same(got, want, DType.FLOAT32)


def test_float16_round_trip_all_patterns() -> None:
    wide = np.empty(ALL16.size, np.float32)
    back = np.empty(ALL16.size, np.uint16)
    nk.half_bits_to_float32(ALL16, wide)
    nk.float32_to_half_bits(wide, back)
    nan = np.isnan(ALL16.view(np.float16))
    assert nan.sum() == 2 * 1023
    np.testing.assert_array_equal(back[~nan], ALL16[~nan])
    assert np.isnan(back[nan].view(np.float16)).all()


def test_float32_to_float16_matches_numpy() -> None:
    rng = np.random.default_rng(5)
    # Random patterns, plus every midpoint between adjacent halves and the
    # float32 values either side of it (ties and near-ties, incl. overflow).
    halves = ALL16[(ALL16 & 0x7FFF) < 0x7C00].view(np.float16).astype(np.float64)
    halves = np.sort(halves)
    mids = ((halves[:-1] + halves[1:]) / 2).astype(np.float32)
    top = np.float32(65504.0 + 16.0)  # halfway from the largest half to 2**16
    mids = np.concatenate([mids, [top, -top]]).astype(np.float32)
    near = np.concatenate(
        [mids, np.nextafter(mids, np.float32(np.inf)), np.nextafter(mids, np.float32(-np.inf))]
    )
    patterns = rng.integers(0, 1 << 32, 300000, dtype=np.uint64).astype(np.uint32)
    x = np.concatenate([near, patterns.view(np.float32), [np.inf, -np.inf, 0.0, -0.0]])
    x = x.astype(np.float32)
    got = np.empty(x.size, np.uint16)
    nk.float32_to_half_bits(x, got)
    assert_same(got.view(np.float16), from32(x, DType.FLOAT16), DType.FLOAT16)


def test_bfloat16_conversions() -> None:
    wide = np.empty(ALL16.size, np.float32)
    nk.bf16_bits_to_float32(ALL16, wide)
    np.testing.assert_array_equal(bits(wide), ALL16.astype(np.uint32) << 16)
    back = np.empty(ALL16.size, np.uint16)
    nk.float32_to_bf16_bits(wide, back)
    nan = (ALL16 & 0x7FFF) > 0x7F80
    np.testing.assert_array_equal(back[~nan], ALL16[~nan])
    assert ((back[nan] & 0x7FFF) > 0x7F80).all()
    rng = np.random.default_rng(9)
    x = rng.integers(0, 1 << 32, 300000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    ties = (rng.integers(0, 1 << 16, 1000, dtype=np.uint32) << 16 | 0x8000).view(np.float32)
    x = np.concatenate([x, ties, np.array([3.3961514e38, np.inf, -np.inf, 0.0, -0.0], np.float32)])
    got = np.empty(x.size, np.uint16)
    nk.float32_to_bf16_bits(x, got)
    assert_same(got, f32_to_bf16(x), DType.BFLOAT16)


# ---------------------------------------------------------------------------
# Compilation: one signature per storage type, nogil and cached.
# ---------------------------------------------------------------------------


def test_warm_up_builds_one_signature_per_storage_type() -> None:
    warm_up([DType.FLOAT32])
    assert DType.FLOAT32 in kernels._READY
    warm_up()
    assert set(kernels._READY) == set(DType)
    # Read-only, unaligned and writable arrays all share the one signature.
    f32 = np.ones(4, np.float32)
    reduce_into(f32, np.frombuffer(f32.tobytes(), np.float32), ReduceOp.SUM, DType.FLOAT32)
    storage_types: dict[Any, int] = {
        nk.reduce_native: 2,  # float32, float64
        nk.reduce_integer: 5,  # uint8, int8, int16, int32, int64
        nk.reduce_bool: 1,
        nk.reduce_f16: 1,
        nk.reduce_bf16: 1,
        nk.copy_array: 9,  # float16 and bfloat16 share the uint16 copy
        nk.average_float: 2,
        nk.average_int: 5,
        nk.scale_float: 2,
        nk.axpy_float: 2,
    }
    for kernel, count in storage_types.items():
        assert len(kernel.signatures) == count, (kernel.__name__, kernel.signatures)


def test_every_kernel_is_nogil_and_cached() -> None:
    dispatchers: list[Any] = [
        obj for obj in vars(nk).values() if isinstance(obj, numba.core.dispatcher.Dispatcher)
    ]
    assert len(dispatchers) > 20
    for d in dispatchers:
        assert d.targetoptions.get("nogil") is True, d.__name__
        assert d._cache.__class__.__name__ == "FunctionCache", d.__name__


_CONCURRENT_FIRST_USE = """
import threading
import numpy as np
from totalreduce.dtypes import DType, ReduceOp
from totalreduce.kernels import copy_into, reduce_into, warm_up
from totalreduce.kernels import numba_kernels as nk

warm_up([DType.FLOAT32])
a, b = np.ones(64, np.float32), np.ones(64, np.float32)
errors, stop = [], threading.Event()

def hammer():
    try:
        while not stop.is_set():
            reduce_into(a, b, ReduceOp.MAX, DType.FLOAT32)
            copy_into(a, b, DType.FLOAT32)
    except Exception as exc:
        errors.append(exc)

threads = [threading.Thread(target=hammer) for _ in range(2)]
for t in threads:
    t.start()
warm_up([d for d in DType if d is not DType.FLOAT32])
stop.set()
for t in threads:
    t.join()
assert not errors, errors
assert len(nk.reduce_native.signatures) == 2, nk.reduce_native.signatures
assert len(nk.copy_array.signatures) == 9, nk.copy_array.signatures
print("OK")
"""


def test_first_use_of_a_dtype_while_others_run_is_safe() -> None:
    # A fresh interpreter, so that the other dtypes are built while two
    # threads keep calling kernels they share with the dtype already in use.
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-c", _CONCURRENT_FIRST_USE],
        cwd=root,
        env=dict(os.environ, PYTHONPATH=str(root)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr

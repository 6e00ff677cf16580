"""Every element type against every reduce op, bit for bit against numpy.

Covers the types and ops added for gloo's CPU surface (uint8, int8, int16,
bool; PRODUCT, BAND, BOR, BXOR) beside the older ones, and the combinations
that are refused with a message naming the op and the type.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from test_kernels import bf16_to_f32, f32_to_bf16

from totalreduce.dtypes import DType, ReduceOp
from totalreduce.kernels import finish_average, reduce_into

N = 1013
INTEGERS = [DType.UINT8, DType.INT8, DType.INT16, DType.INT32, DType.INT64]
NUMPY_OPS = {
    ReduceOp.SUM: np.add,
    ReduceOp.AVG: np.add,  # the division comes after, in finish_average
    ReduceOp.MAX: np.maximum,
    ReduceOp.MIN: np.minimum,
    ReduceOp.PRODUCT: np.multiply,
    ReduceOp.BAND: np.bitwise_and,
    ReduceOp.BOR: np.bitwise_or,
    ReduceOp.BXOR: np.bitwise_xor,
}


@pytest.fixture(autouse=True)
def _quiet_numpy() -> Iterator[None]:
    with np.errstate(all="ignore"):
        yield


def operands(dtype: DType, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Two arrays spanning the type's whole range (so sums and products wrap)."""
    rng = np.random.default_rng(seed)
    if dtype is DType.BOOL:
        return rng.random(N) < 0.5, rng.random(N) < 0.5
    if dtype.integral:
        info = np.iinfo(dtype.numpy)
        draw = lambda: rng.integers(info.min, info.max, N, endpoint=True, dtype=dtype.numpy)  # noqa: E731
        return draw(), draw()
    if dtype is DType.BFLOAT16:
        return (
            f32_to_bf16(rng.normal(0, 100, N).astype(np.float32)),
            f32_to_bf16(rng.normal(0, 100, N).astype(np.float32)),
        )
    return rng.normal(0, 100, N).astype(dtype.numpy), rng.normal(0, 100, N).astype(dtype.numpy)


def reference(dtype: DType, op: ReduceOp, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    fn = NUMPY_OPS[op]
    if dtype is DType.FLOAT16:  # half arithmetic: in float32, rounded once
        return fn(a.astype(np.float32), b.astype(np.float32)).astype(np.float16)
    if dtype is DType.BFLOAT16:
        if op in (ReduceOp.MAX, ReduceOp.MIN):  # picks an operand's bits
            pick = fn(bf16_to_f32(a), bf16_to_f32(b)) == bf16_to_f32(a)
            return np.where(pick, a, b)
        return f32_to_bf16(fn(bf16_to_f32(a), bf16_to_f32(b)))
    return fn(a, b)


def _pairs() -> list[tuple[DType, ReduceOp]]:
    return [(d, o) for d in DType for o in ReduceOp if o.refuses(d) is None]


@pytest.mark.parametrize(("dtype", "op"), _pairs(), ids=lambda v: v.name.lower())
def test_reduce_matches_numpy_exactly(dtype: DType, op: ReduceOp) -> None:
    a, b = operands(dtype, int(dtype) * 31 + int(op))
    dst = a.copy()
    reduce_into(dst, b, op, dtype)
    want = reference(dtype, op, a, b)
    assert dst.dtype == want.dtype
    np.testing.assert_array_equal(dst.view(np.uint8), want.view(np.uint8))


@pytest.mark.parametrize("dtype", INTEGERS, ids=lambda d: d.name.lower())
def test_small_integer_average_floors_like_numpy(dtype: DType) -> None:
    a, _ = operands(dtype, 7)
    for divisor in (2, 3, 4, 7):
        dst = a.copy()
        finish_average(dst, divisor, dtype)
        np.testing.assert_array_equal(dst, a // dtype.numpy.type(divisor))


def test_bool_is_logical_as_in_gloo() -> None:
    # gloo (torch 2.13, 2 ranks) gives these for [T, T, F, F] with [T, F, T, F].
    a = np.array([True, True, False, False])
    b = np.array([True, False, True, False])
    want = {
        ReduceOp.SUM: [True, True, True, False],
        ReduceOp.MAX: [True, True, True, False],
        ReduceOp.BOR: [True, True, True, False],
        ReduceOp.PRODUCT: [True, False, False, False],
        ReduceOp.MIN: [True, False, False, False],
        ReduceOp.BAND: [True, False, False, False],
        ReduceOp.BXOR: [False, True, True, False],
    }
    for op, expect in want.items():
        dst = a.copy()
        reduce_into(dst, b, op, DType.BOOL)
        assert dst.tolist() == expect, op


@pytest.mark.parametrize("op", [ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR])
@pytest.mark.parametrize(
    "dtype", [DType.FLOAT16, DType.FLOAT32, DType.FLOAT64, DType.BFLOAT16], ids=lambda d: d.name
)
def test_bitwise_ops_refuse_floating_types(dtype: DType, op: ReduceOp) -> None:
    a = np.zeros(4, dtype.numpy)
    with pytest.raises(ValueError, match=f"'{op.name.lower()}' is bitwise.*{dtype.name.lower()}"):
        reduce_into(a, a.copy(), op, dtype)


def test_bool_has_no_average() -> None:
    a = np.zeros(4, np.bool_)
    with pytest.raises(ValueError, match="'avg'.*bool"):
        reduce_into(a, a.copy(), ReduceOp.AVG, DType.BOOL)
    with pytest.raises(TypeError, match="bool"):
        finish_average(a, 2, DType.BOOL)


def test_codes_are_appended_never_renumbered() -> None:
    # They travel on the wire: the old ones keep their numbers.
    assert [(d.name, int(d)) for d in DType] == [
        ("FLOAT16", 1), ("FLOAT32", 2), ("FLOAT64", 3), ("INT32", 4), ("INT64", 5),
        ("BFLOAT16", 6), ("UINT8", 7), ("INT8", 8), ("INT16", 9), ("BOOL", 10),
    ]  # fmt: skip
    assert [(o.name, int(o)) for o in ReduceOp] == [
        ("SUM", 1), ("AVG", 2), ("MAX", 3), ("MIN", 4),
        ("PRODUCT", 5), ("BAND", 6), ("BOR", 7), ("BXOR", 8),
    ]  # fmt: skip
    assert ReduceOp.of("prod") is ReduceOp.PRODUCT

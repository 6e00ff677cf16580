"""The raw kernels as C functions, one per element type, compiled when a type is first used.

A compiled loop that inlines every kernel of every element type (:mod:`.raw`) pays for all
of them in its own compile, again at every level that inlines it: the lane's first compile
took 82-85 s of one core with the ten element types inlined, 25 s without them, while the
kernels alone compile in about 11 s.  Here each kernel of each type is a Numba ``cfunc``
with a C signature; the lane calls it through its address (``native.intrinsics.ccall_i32``,
as it calls MPI) from a table Python fills the first time an op of that type needs it
(:func:`addresses`), so a job compiles (or loads from the cache) only the kernels of the
types it reduces, once per installation.

Every function returns 0, or -1 for what it does not take (an op code the kernel refuses);
they run the same kernels as the rest of the library (:mod:`.numba_kernels`, through
:mod:`.raw`), so a reduction gives the same bits whichever path ran it.

The kinds (``K_*``) and the table's layout are the protocol's (``protocol.K_*``): entry
``kind * K_TYPES + dtype code`` of the lane's kernel table.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from numba import carray, cfunc, njit, types

from ..dtypes import DType
from ..native.intrinsics import (
    ptr_bool,
    ptr_f32,
    ptr_f64,
    ptr_i8,
    ptr_i16,
    ptr_i32,
    ptr_i64,
    ptr_u8,
    ptr_u16,
)
from ..protocol import K_ACCUMULATE, K_AVERAGE, K_REDUCE, K_REDUCE3, K_SCALE, K_TYPES
from . import raw

_i64 = types.int64
#: (dst, src, n, op), (dst, a, b, n, op), (dst, n, divisor), (dst, src, n, weight)
SIG_REDUCE = types.int32(_i64, _i64, _i64, _i64)
SIG_REDUCE3 = types.int32(_i64, _i64, _i64, _i64, _i64)
SIG_AVERAGE = types.int32(_i64, _i64, _i64)
SIG_WEIGHTED = types.int32(_i64, _i64, _i64, types.float64)

# ---------------------------------------------------------------- reduce: dst (op)= src


def reduce_f32(dst, src, n, op):  # type: ignore[no-untyped-def]
    raw.reduce_native(carray(ptr_f32(dst), n), carray(ptr_f32(src), n), op)
    return 0


def reduce_f64(dst, src, n, op):  # type: ignore[no-untyped-def]
    raw.reduce_native(carray(ptr_f64(dst), n), carray(ptr_f64(src), n), op)
    return 0


def reduce_i32(dst, src, n, op):  # type: ignore[no-untyped-def]
    raw.reduce_integer(carray(ptr_i32(dst), n), carray(ptr_i32(src), n), op)
    return 0


def reduce_i64(dst, src, n, op):  # type: ignore[no-untyped-def]
    raw.reduce_integer(carray(ptr_i64(dst), n), carray(ptr_i64(src), n), op)
    return 0


def reduce_f16(dst, src, n, op):  # type: ignore[no-untyped-def]
    raw.reduce_f16(carray(ptr_u16(dst), n), carray(ptr_u16(src), n), op)
    return 0


def reduce_bf16(dst, src, n, op):  # type: ignore[no-untyped-def]
    raw.reduce_bf16(carray(ptr_u16(dst), n), carray(ptr_u16(src), n), op)
    return 0


def reduce_u8(dst, src, n, op):  # type: ignore[no-untyped-def]
    raw.reduce_integer(carray(ptr_u8(dst), n), carray(ptr_u8(src), n), op)
    return 0


def reduce_i8(dst, src, n, op):  # type: ignore[no-untyped-def]
    raw.reduce_integer(carray(ptr_i8(dst), n), carray(ptr_i8(src), n), op)
    return 0


def reduce_i16(dst, src, n, op):  # type: ignore[no-untyped-def]
    raw.reduce_integer(carray(ptr_i16(dst), n), carray(ptr_i16(src), n), op)
    return 0


def reduce_bool(dst, src, n, op):  # type: ignore[no-untyped-def]
    raw.reduce_bool(carray(ptr_bool(dst), n), carray(ptr_bool(src), n), op)
    return 0


# ---------------------------------------------------------------- reduce3: dst = a (op) b
# One pass over memory for sums (dst written once), else a copy and the reduction: what
# raw.reduce3_raw does, for one type each (its other types are not compiled here).


@njit(nogil=True, cache=True)
def _apart(dst, a, b, span):  # type: ignore[no-untyped-def]
    return (dst + span <= a or a + span <= dst) and (dst + span <= b or b + span <= dst)


def reduce3_f32(dst, a, b, n, op):  # type: ignore[no-untyped-def]
    if n > 0 and (op == raw.OP_SUM or op == raw.OP_AVG) and _apart(dst, a, b, n * 4):
        raw.sum3(carray(ptr_f32(dst), n), carray(ptr_f32(a), n), carray(ptr_f32(b), n))
        return 0
    raw.copy_raw(dst, a, n * 4)
    raw.reduce_native(carray(ptr_f32(dst), n), carray(ptr_f32(b), n), op)
    return 0


def reduce3_f64(dst, a, b, n, op):  # type: ignore[no-untyped-def]
    if n > 0 and (op == raw.OP_SUM or op == raw.OP_AVG) and _apart(dst, a, b, n * 8):
        raw.sum3(carray(ptr_f64(dst), n), carray(ptr_f64(a), n), carray(ptr_f64(b), n))
        return 0
    raw.copy_raw(dst, a, n * 8)
    raw.reduce_native(carray(ptr_f64(dst), n), carray(ptr_f64(b), n), op)
    return 0


def reduce3_i32(dst, a, b, n, op):  # type: ignore[no-untyped-def]
    if n > 0 and (op == raw.OP_SUM or op == raw.OP_AVG) and _apart(dst, a, b, n * 4):
        raw.sum3(carray(ptr_i32(dst), n), carray(ptr_i32(a), n), carray(ptr_i32(b), n))
        return 0
    raw.copy_raw(dst, a, n * 4)
    raw.reduce_integer(carray(ptr_i32(dst), n), carray(ptr_i32(b), n), op)
    return 0


def reduce3_i64(dst, a, b, n, op):  # type: ignore[no-untyped-def]
    if n > 0 and (op == raw.OP_SUM or op == raw.OP_AVG) and _apart(dst, a, b, n * 8):
        raw.sum3(carray(ptr_i64(dst), n), carray(ptr_i64(a), n), carray(ptr_i64(b), n))
        return 0
    raw.copy_raw(dst, a, n * 8)
    raw.reduce_integer(carray(ptr_i64(dst), n), carray(ptr_i64(b), n), op)
    return 0


# ---------------------------------------------------------------- average: dst /= divisor


def average_f32(dst, n, divisor):  # type: ignore[no-untyped-def]
    raw.average_float(carray(ptr_f32(dst), n), divisor)
    return 0


def average_f64(dst, n, divisor):  # type: ignore[no-untyped-def]
    raw.average_float(carray(ptr_f64(dst), n), divisor)
    return 0


def average_i32(dst, n, divisor):  # type: ignore[no-untyped-def]
    raw.average_int(carray(ptr_i32(dst), n), divisor)
    return 0


def average_i64(dst, n, divisor):  # type: ignore[no-untyped-def]
    raw.average_int(carray(ptr_i64(dst), n), divisor)
    return 0


def average_f16(dst, n, divisor):  # type: ignore[no-untyped-def]
    raw.average_f16(carray(ptr_u16(dst), n), divisor)
    return 0


def average_bf16(dst, n, divisor):  # type: ignore[no-untyped-def]
    raw.average_bf16(carray(ptr_u16(dst), n), divisor)
    return 0


def average_u8(dst, n, divisor):  # type: ignore[no-untyped-def]
    raw.average_int(carray(ptr_u8(dst), n), divisor)
    return 0


def average_i8(dst, n, divisor):  # type: ignore[no-untyped-def]
    raw.average_int(carray(ptr_i8(dst), n), divisor)
    return 0


def average_i16(dst, n, divisor):  # type: ignore[no-untyped-def]
    raw.average_int(carray(ptr_i16(dst), n), divisor)
    return 0


# ---------------------------------------------------------------- weighted: floating types
# scale: dst = weight * src (src may be dst: the copy, then the kernel in place)


def scale_f32(dst, src, n, weight):  # type: ignore[no-untyped-def]
    raw.copy_raw(dst, src, n * 4)
    raw.scale_float(carray(ptr_f32(dst), n), weight)
    return 0


def scale_f64(dst, src, n, weight):  # type: ignore[no-untyped-def]
    raw.copy_raw(dst, src, n * 8)
    raw.scale_float(carray(ptr_f64(dst), n), weight)
    return 0


def scale_f16(dst, src, n, weight):  # type: ignore[no-untyped-def]
    raw.copy_raw(dst, src, n * 2)
    raw.scale_f16(carray(ptr_u16(dst), n), weight)
    return 0


def scale_bf16(dst, src, n, weight):  # type: ignore[no-untyped-def]
    raw.copy_raw(dst, src, n * 2)
    raw.scale_bf16(carray(ptr_u16(dst), n), weight)
    return 0


def accumulate_f32(dst, src, n, weight):  # type: ignore[no-untyped-def]
    raw.axpy_float(carray(ptr_f32(dst), n), carray(ptr_f32(src), n), weight)
    return 0


def accumulate_f64(dst, src, n, weight):  # type: ignore[no-untyped-def]
    raw.axpy_float(carray(ptr_f64(dst), n), carray(ptr_f64(src), n), weight)
    return 0


def accumulate_f16(dst, src, n, weight):  # type: ignore[no-untyped-def]
    raw.axpy_f16(carray(ptr_u16(dst), n), carray(ptr_u16(src), n), weight)
    return 0


def accumulate_bf16(dst, src, n, weight):  # type: ignore[no-untyped-def]
    raw.axpy_bf16(carray(ptr_u16(dst), n), carray(ptr_u16(src), n), weight)
    return 0


_F16, _F32, _F64 = int(DType.FLOAT16), int(DType.FLOAT32), int(DType.FLOAT64)
_I32, _I64, _BF16 = int(DType.INT32), int(DType.INT64), int(DType.BFLOAT16)
_U8, _I8, _I16, _BOOL = int(DType.UINT8), int(DType.INT8), int(DType.INT16), int(DType.BOOL)

#: Per element type: its kernels, by kind (a type a kind does not take has none).
KERNELS: dict[int, dict[int, tuple[Any, Callable[..., int]]]] = {
    _F32: {K_REDUCE: (SIG_REDUCE, reduce_f32), K_REDUCE3: (SIG_REDUCE3, reduce3_f32),
           K_AVERAGE: (SIG_AVERAGE, average_f32), K_SCALE: (SIG_WEIGHTED, scale_f32),
           K_ACCUMULATE: (SIG_WEIGHTED, accumulate_f32)},
    _F64: {K_REDUCE: (SIG_REDUCE, reduce_f64), K_REDUCE3: (SIG_REDUCE3, reduce3_f64),
           K_AVERAGE: (SIG_AVERAGE, average_f64), K_SCALE: (SIG_WEIGHTED, scale_f64),
           K_ACCUMULATE: (SIG_WEIGHTED, accumulate_f64)},
    _F16: {K_REDUCE: (SIG_REDUCE, reduce_f16), K_AVERAGE: (SIG_AVERAGE, average_f16),
           K_SCALE: (SIG_WEIGHTED, scale_f16), K_ACCUMULATE: (SIG_WEIGHTED, accumulate_f16)},
    _BF16: {K_REDUCE: (SIG_REDUCE, reduce_bf16), K_AVERAGE: (SIG_AVERAGE, average_bf16),
            K_SCALE: (SIG_WEIGHTED, scale_bf16), K_ACCUMULATE: (SIG_WEIGHTED, accumulate_bf16)},
    _I32: {K_REDUCE: (SIG_REDUCE, reduce_i32), K_REDUCE3: (SIG_REDUCE3, reduce3_i32),
           K_AVERAGE: (SIG_AVERAGE, average_i32)},
    _I64: {K_REDUCE: (SIG_REDUCE, reduce_i64), K_REDUCE3: (SIG_REDUCE3, reduce3_i64),
           K_AVERAGE: (SIG_AVERAGE, average_i64)},
    _U8: {K_REDUCE: (SIG_REDUCE, reduce_u8), K_AVERAGE: (SIG_AVERAGE, average_u8)},
    _I8: {K_REDUCE: (SIG_REDUCE, reduce_i8), K_AVERAGE: (SIG_AVERAGE, average_i8)},
    _I16: {K_REDUCE: (SIG_REDUCE, reduce_i16), K_AVERAGE: (SIG_AVERAGE, average_i16)},
    _BOOL: {K_REDUCE: (SIG_REDUCE, reduce_bool)},
}  # fmt: skip
assert all(0 < dt < K_TYPES for dt in KERNELS)

_compiled: dict[int, dict[int, Any]] = {}
_lock = threading.Lock()


def addresses(dtype: int) -> dict[int, int]:
    """The C addresses of the kernels of element type ``dtype`` (a DType code), by kind:
    compiled (or loaded from Numba's cache) the first time a process asks.  The compiled
    objects are kept for the process's life, so the addresses stay valid."""
    with _lock:
        done = _compiled.get(dtype)
        if done is None:
            done = {kind: cfunc(sig, cache=True, nogil=True)(fn)
                    for kind, (sig, fn) in KERNELS.get(dtype, {}).items()}  # fmt: skip
            _compiled[dtype] = done
    return {kind: int(c.address) for kind, c in done.items()}

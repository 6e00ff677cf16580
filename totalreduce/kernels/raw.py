"""The kernels on raw memory: what a compiled loop calls on the bytes of a frame.

A compiled data plane (``lane/lane_core.py``) holds an op's buffers as addresses
and its element type as the :class:`~totalreduce.dtypes.DType` code, so it cannot
pick a kernel by array type as :mod:`totalreduce.kernels` does.  These functions do
the picking in compiled code: each views the two ranges as arrays of the storage type
(``carray`` over a typed pointer) and calls the same kernel of :mod:`.numba_kernels`
the rest of the library uses, so a reduction gives the same bits whichever path ran it.

Every function returns 0, or -1 for a dtype code it does not take (the caller checked
before, so -1 is a bug report, never silently wrong data).  They take the element types
of gradients (float16, bfloat16, float32, float64, int32, int64) and the narrow integer
and bool types (uint8, int8, int16, bool), so every element type runs in the lane.
"""

from __future__ import annotations

from numba import carray, njit

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
from ..native.libc import memmove
from . import numba_kernels as _nk

# The same kernel functions as the rest of the library (one source, the same bits),
# compiled for the raw, C-contiguous views made here: their own dispatchers, so the
# library's kernels keep exactly one signature per storage type.
_jit = njit(nogil=True, cache=True)
reduce_native = _jit(_nk.reduce_native.py_func)
reduce_integer = _jit(_nk.reduce_integer.py_func)
reduce_bool = _jit(_nk.reduce_bool.py_func)
reduce_f16 = _jit(_nk.reduce_f16.py_func)
reduce_bf16 = _jit(_nk.reduce_bf16.py_func)
average_float = _jit(_nk.average_float.py_func)
average_int = _jit(_nk.average_int.py_func)
average_f16 = _jit(_nk.average_f16.py_func)
average_bf16 = _jit(_nk.average_bf16.py_func)
scale_float = _jit(_nk.scale_float.py_func)
scale_f16 = _jit(_nk.scale_f16.py_func)
scale_bf16 = _jit(_nk.scale_bf16.py_func)
axpy_float = _jit(_nk.axpy_float.py_func)
axpy_f16 = _jit(_nk.axpy_f16.py_func)
axpy_bf16 = _jit(_nk.axpy_bf16.py_func)

# DType codes (totalreduce.dtypes.DType), repeated here as compile-time constants.
DT_F16, DT_F32, DT_F64, DT_I32, DT_I64, DT_BF16, DT_U8, DT_I8, DT_I16, DT_BOOL = range(1, 11)

#: Bytes per element, indexed by DType code (0 unused).
ITEMSIZE = (0, 2, 4, 8, 4, 8, 2, 1, 1, 2, 1)


OP_SUM = _nk.OP_SUM
OP_AVG = _nk.OP_AVG


@njit(nogil=True, cache=True)
def sum3(dst, a, b):
    for i in range(dst.shape[0]):
        dst[i] = a[i] + b[i]


@njit(nogil=True, cache=True)
def reduce3_raw(dt, op, dst, a, b, n):
    """``dst[i] = a[i] (op) b[i]``: what ``copy_raw(dst, a)`` then ``reduce_raw(dst, b)``
    give, bit for bit, in one pass over memory for sums of the native types (an op
    whose input and output differ: the output's region is written once, not twice)."""
    if n <= 0:
        return 0
    isz = ITEMSIZE[dt] if 0 < dt < len(ITEMSIZE) else 0
    span = n * isz
    apart = (dst + span <= a or a + span <= dst) and (dst + span <= b or b + span <= dst)
    if apart and (op == OP_SUM or op == OP_AVG):
        if dt == DT_F32:
            sum3(carray(ptr_f32(dst), n), carray(ptr_f32(a), n), carray(ptr_f32(b), n))
            return 0
        if dt == DT_F64:
            sum3(carray(ptr_f64(dst), n), carray(ptr_f64(a), n), carray(ptr_f64(b), n))
            return 0
        if dt == DT_I32:
            sum3(carray(ptr_i32(dst), n), carray(ptr_i32(a), n), carray(ptr_i32(b), n))
            return 0
        if dt == DT_I64:
            sum3(carray(ptr_i64(dst), n), carray(ptr_i64(a), n), carray(ptr_i64(b), n))
            return 0
    if isz == 0:
        return -1
    copy_raw(dst, a, span)
    return reduce_raw(dt, op, dst, b, n)


@njit(nogil=True, cache=True)
def reduce_raw(dt, op, dst, src, n):
    """``dst[i] = dst[i] (op) src[i]`` for ``n`` elements of type ``dt`` at two addresses."""
    if n <= 0:
        return 0
    if dt == DT_F32:
        reduce_native(carray(ptr_f32(dst), n), carray(ptr_f32(src), n), op)
    elif dt == DT_F64:
        reduce_native(carray(ptr_f64(dst), n), carray(ptr_f64(src), n), op)
    elif dt == DT_I32:
        reduce_integer(carray(ptr_i32(dst), n), carray(ptr_i32(src), n), op)
    elif dt == DT_I64:
        reduce_integer(carray(ptr_i64(dst), n), carray(ptr_i64(src), n), op)
    elif dt == DT_F16:
        reduce_f16(carray(ptr_u16(dst), n), carray(ptr_u16(src), n), op)
    elif dt == DT_BF16:
        reduce_bf16(carray(ptr_u16(dst), n), carray(ptr_u16(src), n), op)
    elif dt == DT_U8:
        reduce_integer(carray(ptr_u8(dst), n), carray(ptr_u8(src), n), op)
    elif dt == DT_I8:
        reduce_integer(carray(ptr_i8(dst), n), carray(ptr_i8(src), n), op)
    elif dt == DT_I16:
        reduce_integer(carray(ptr_i16(dst), n), carray(ptr_i16(src), n), op)
    elif dt == DT_BOOL:
        reduce_bool(carray(ptr_bool(dst), n), carray(ptr_bool(src), n), op)
    else:
        return -1
    return 0


@njit(nogil=True, cache=True)
def average_raw(dt, dst, n, divisor):
    """``dst /= divisor`` (floor division on integers) for ``n`` elements of type ``dt``."""
    if n <= 0:
        return 0
    if dt == DT_F32:
        average_float(carray(ptr_f32(dst), n), divisor)
    elif dt == DT_F64:
        average_float(carray(ptr_f64(dst), n), divisor)
    elif dt == DT_I32:
        average_int(carray(ptr_i32(dst), n), divisor)
    elif dt == DT_I64:
        average_int(carray(ptr_i64(dst), n), divisor)
    elif dt == DT_F16:
        average_f16(carray(ptr_u16(dst), n), divisor)
    elif dt == DT_BF16:
        average_bf16(carray(ptr_u16(dst), n), divisor)
    elif dt == DT_U8:
        average_int(carray(ptr_u8(dst), n), divisor)
    elif dt == DT_I8:
        average_int(carray(ptr_i8(dst), n), divisor)
    elif dt == DT_I16:
        average_int(carray(ptr_i16(dst), n), divisor)
    else:
        return -1
    return 0


@njit(nogil=True, cache=True)
def scale_raw(dt, dst, src, n, weight):
    """``dst = weight * src`` (``src`` may be ``dst``) for ``n`` elements of a floating
    type ``dt``: the copy, then the main loop's kernel in place (the same bits)."""
    if n <= 0:
        return 0
    if dt == DT_F32:
        copy_raw(dst, src, n * 4)
        scale_float(carray(ptr_f32(dst), n), weight)
    elif dt == DT_F64:
        copy_raw(dst, src, n * 8)
        scale_float(carray(ptr_f64(dst), n), weight)
    elif dt == DT_F16:
        copy_raw(dst, src, n * 2)
        scale_f16(carray(ptr_u16(dst), n), weight)
    elif dt == DT_BF16:
        copy_raw(dst, src, n * 2)
        scale_bf16(carray(ptr_u16(dst), n), weight)
    else:
        return -1
    return 0


@njit(nogil=True, cache=True)
def accumulate_raw(dt, dst, src, n, weight):
    """``dst += weight * src`` for ``n`` elements of a floating type ``dt`` (weighted
    neighbour averaging), with the main loop's kernels."""
    if n <= 0:
        return 0
    if dt == DT_F32:
        axpy_float(carray(ptr_f32(dst), n), carray(ptr_f32(src), n), weight)
    elif dt == DT_F64:
        axpy_float(carray(ptr_f64(dst), n), carray(ptr_f64(src), n), weight)
    elif dt == DT_F16:
        axpy_f16(carray(ptr_u16(dst), n), carray(ptr_u16(src), n), weight)
    elif dt == DT_BF16:
        axpy_bf16(carray(ptr_u16(dst), n), carray(ptr_u16(src), n), weight)
    else:
        return -1
    return 0


@njit(nogil=True, cache=True)
def copy_raw(dst, src, nbytes):
    """``nbytes`` from ``src`` to ``dst`` (the ranges may overlap)."""
    if nbytes > 0 and dst != src:
        memmove(dst, src, nbytes)
    return 0

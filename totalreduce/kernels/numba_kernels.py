"""Numba kernels: every loop that reads or writes payload elements.

This module owns the element arithmetic of the whole library: reducing one
buffer into another, copying, the final division of an average, scaling and
``dst += w * src``.  The Python wrappers in :mod:`totalreduce.kernels` choose a
kernel by :class:`~totalreduce.dtypes.DType` and hand it arrays already viewed
as the storage type the kernel expects:

* ``float32``, ``float64``, ``int32``, ``int64``, ``int16``, ``int8``,
  ``uint8``: one generic kernel per operation, compiled once per storage type
  (integer types have their own reduce kernel, with the bitwise ops);
* ``bool``: its own reduce kernel (``SUM``/``MAX``/``BOR`` are a logical or,
  ``PRODUCT``/``MIN``/``BAND`` a logical and, ``BXOR`` an exclusive or, as
  numpy and gloo compute them);
* ``float16``: ``uint16`` arrays of IEEE half bit patterns (Numba has no half
  arithmetic), widened to float32, computed there and rounded back to nearest
  even;
* ``bfloat16``: ``uint16`` arrays of bfloat16 bit patterns, handled the same
  way with their own conversions.

Reduce kernels take the operation as an integer (the :class:`ReduceOp` value)
and branch on it once, outside the element loop.  ``MAX``/``MIN`` follow
``np.maximum``/``np.minimum``: a NaN operand wins.  Integer ``SUM`` and
``PRODUCT`` wrap.

Every two-array kernel tolerates ``dst`` and ``src`` sharing memory: if the two
ranges partially overlap, ``src`` is copied first, so the result is the one
numpy gives for the same call.
"""

from __future__ import annotations

import numba
import numpy as np

from ..dtypes import ReduceOp

OP_SUM = int(ReduceOp.SUM)
OP_AVG = int(ReduceOp.AVG)
OP_MAX = int(ReduceOp.MAX)
OP_MIN = int(ReduceOp.MIN)
OP_PRODUCT = int(ReduceOp.PRODUCT)
OP_BAND = int(ReduceOp.BAND)
OP_BOR = int(ReduceOp.BOR)
OP_BXOR = int(ReduceOp.BXOR)

# ---------------------------------------------------------------------------
# Scalar helpers (inlined by LLVM into the kernels below).
# ---------------------------------------------------------------------------


@numba.njit(nogil=True, cache=True)
def _float_bits(x: float) -> int:
    """The bit pattern of a float32, as a non-negative int64."""
    return np.int64(np.float32(x).view(np.uint32))


@numba.njit(nogil=True, cache=True)
def _bits_float(bits: int) -> float:
    """The float32 whose bit pattern is the low 32 bits of ``bits``."""
    return np.uint32(bits).view(np.float32)


@numba.njit(nogil=True, cache=True)
def _half_to_float(h: int) -> float:
    """Widen IEEE half bits to float32 (exact; NaN payloads are kept)."""
    h = np.int64(h)
    sign = (h & 0x8000) << 16
    mag = h & 0x7FFF
    # All three candidates are computed so LLVM can select instead of branch.
    subnormal = _float_bits(np.float32(mag) * np.float32(2.0**-24))
    normal = (mag << 13) + ((127 - 15) << 23)
    special = (mag << 13) + ((255 - 31) << 23)
    if mag < 0x0400:
        bits = subnormal
    elif mag < 0x7C00:
        bits = normal
    else:
        bits = special
    return _bits_float(bits | sign)


@numba.njit(nogil=True, cache=True)
def _float_to_half(x: float) -> int:
    """Round a float32 to IEEE half bits, to nearest even.

    Values past the largest half round to infinity; NaN stays NaN (quieted,
    with the top payload bits kept).
    """
    u = _float_bits(x)
    sign = (u >> 16) & 0x8000
    mag = u & 0x7FFFFFFF
    # Normal half: rebias the exponent and round off 13 mantissa bits; a carry
    # out of the mantissa correctly bumps the exponent (up to infinity).
    normal = (mag - ((127 - 15) << 23) + 0x0FFF + ((mag >> 13) & 1)) >> 13
    # Subnormal half: adding 0.5 leaves a float32 whose last mantissa bit is
    # worth 2**-24, the half subnormal step, so the FPU does the rounding.
    subnormal = _float_bits(_bits_float(mag) + np.float32(0.5)) - 0x3F000000
    nan = 0x7E00 | ((mag >> 13) & 0x03FF)
    if mag < 0x38800000:  # below 2**-14
        out = subnormal
    elif mag < 0x47800000:  # below 2**16
        out = normal
    elif mag > 0x7F800000:
        out = nan
    else:
        out = 0x7C00
    return np.uint16(out | sign)


@numba.njit(nogil=True, cache=True)
def _bf16_to_float(b: int) -> float:
    """Widen bfloat16 bits to float32 (exact)."""
    return _bits_float(np.int64(b) << 16)


@numba.njit(nogil=True, cache=True)
def _float_to_bf16(x: float) -> int:
    """Round a float32 to bfloat16 bits, to nearest even; NaN stays NaN."""
    u = _float_bits(x)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    nan = (u >> 16) | 0x0040
    if (u & 0x7FFFFFFF) > 0x7F800000:
        return np.uint16(nan)
    return np.uint16(rounded)


@numba.njit(nogil=True, cache=True)
def _partial_overlap(dst: np.ndarray, src: np.ndarray) -> bool:
    """True when the two ranges share memory but do not start together."""
    d = dst.ctypes.data
    s = src.ctypes.data
    return d != s and d < s + np.uint64(src.nbytes) and s < d + np.uint64(dst.nbytes)


# ---------------------------------------------------------------------------
# float32 / float64 / int32 / int64: one generic kernel per operation.
# ---------------------------------------------------------------------------


@numba.njit(nogil=True, cache=True)
def reduce_native(dst: np.ndarray, src: np.ndarray, op: int) -> None:
    """``dst[i] = dst[i] (op) src[i]`` on float32/float64 (no bitwise ops)."""
    if _partial_overlap(dst, src):
        src = src.copy()
    n = dst.shape[0]
    if op == OP_PRODUCT:
        for i in range(n):
            dst[i] = dst[i] * src[i]
    elif op == OP_MAX:
        for i in range(n):
            a = dst[i]
            b = src[i]
            dst[i] = a if (a >= b or a != a) else b
    elif op == OP_MIN:
        for i in range(n):
            a = dst[i]
            b = src[i]
            dst[i] = a if (a <= b or a != a) else b
    else:
        for i in range(n):
            dst[i] = dst[i] + src[i]


@numba.njit(nogil=True, cache=True)
def reduce_integer(dst: np.ndarray, src: np.ndarray, op: int) -> None:
    """``dst[i] = dst[i] (op) src[i]`` on an integer type; sums and products wrap."""
    if _partial_overlap(dst, src):
        src = src.copy()
    n = dst.shape[0]
    if op == OP_PRODUCT:
        for i in range(n):
            dst[i] = dst[i] * src[i]
    elif op == OP_MAX:
        for i in range(n):
            dst[i] = max(dst[i], src[i])
    elif op == OP_MIN:
        for i in range(n):
            dst[i] = min(dst[i], src[i])
    elif op == OP_BAND:
        for i in range(n):
            dst[i] = dst[i] & src[i]
    elif op == OP_BOR:
        for i in range(n):
            dst[i] = dst[i] | src[i]
    elif op == OP_BXOR:
        for i in range(n):
            dst[i] = dst[i] ^ src[i]
    else:
        for i in range(n):
            dst[i] = dst[i] + src[i]


@numba.njit(nogil=True, cache=True)
def reduce_bool(dst: np.ndarray, src: np.ndarray, op: int) -> None:
    """``dst[i] = dst[i] (op) src[i]`` on bool: or, and, or exclusive or."""
    if _partial_overlap(dst, src):
        src = src.copy()
    n = dst.shape[0]
    if op == OP_PRODUCT or op == OP_MIN or op == OP_BAND:
        for i in range(n):
            dst[i] = dst[i] and src[i]
    elif op == OP_BXOR:
        for i in range(n):
            dst[i] = dst[i] != src[i]
    else:  # SUM, MAX, BOR
        for i in range(n):
            dst[i] = dst[i] or src[i]


@numba.njit(nogil=True, cache=True)
def copy_array(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[:] = src`` for any storage type (16-bit types share one copy)."""
    if _partial_overlap(dst, src):
        src = src.copy()
    for i in range(dst.shape[0]):
        dst[i] = src[i]


@numba.njit(nogil=True, cache=True)
def average_float(dst: np.ndarray, divisor: int) -> None:
    """``dst /= divisor`` on float32/float64, the divisor in the array's type."""
    d = dst.dtype.type(divisor)
    for i in range(dst.shape[0]):
        dst[i] = dst[i] / d


@numba.njit(nogil=True, cache=True)
def average_int(dst: np.ndarray, divisor: int) -> None:
    """``dst //= divisor`` on int32/int64 (floor division, ``divisor >= 1``)."""
    n = dst.shape[0]
    if (divisor & (divisor - 1)) == 0:
        # A power of two: an arithmetic shift floors just like ``//``.
        shift = 0
        while (np.int64(1) << shift) < divisor:
            shift += 1
        for i in range(n):
            dst[i] = dst[i] >> shift
    else:
        for i in range(n):
            dst[i] = dst[i] // divisor


@numba.njit(nogil=True, cache=True)
def scale_float(dst: np.ndarray, weight: float) -> None:
    """``dst *= weight`` on float32/float64, the weight in the array's type."""
    w = dst.dtype.type(weight)
    for i in range(dst.shape[0]):
        dst[i] = dst[i] * w


@numba.njit(nogil=True, cache=True)
def axpy_float(dst: np.ndarray, src: np.ndarray, weight: float) -> None:
    """``dst += weight * src`` on float32/float64 (two roundings, no FMA)."""
    if _partial_overlap(dst, src):
        src = src.copy()
    w = dst.dtype.type(weight)
    for i in range(dst.shape[0]):
        dst[i] = dst[i] + w * src[i]


@numba.njit(nogil=True, cache=True)
def adasum_float(dst: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
    """Adasum's combine of two gradients on float32/float64:
    ``dst = (1 - a.b / 2|a|^2) a + (1 - a.b / 2|b|^2) b`` (a coefficient stays 1 when its
    norm is below 1e-8, as Horovod's).  The sums run in float64, in index order, so the
    two ranks of a pair that call it with the same ``a`` and ``b`` get the same bits;
    ``dst`` may be ``a`` or ``b``."""
    dot = 0.0
    aa = 0.0
    bb = 0.0
    for i in range(a.shape[0]):
        x = np.float64(a[i])
        y = np.float64(b[i])
        dot += x * y
        aa += x * x
        bb += y * y
    ca = 1.0 - dot / aa * 0.5 if aa >= 1e-8 else 1.0
    cb = 1.0 - dot / bb * 0.5 if bb >= 1e-8 else 1.0
    for i in range(dst.shape[0]):
        dst[i] = ca * np.float64(a[i]) + cb * np.float64(b[i])


# ---------------------------------------------------------------------------
# float16 as uint16 bits, computed in float32.
# ---------------------------------------------------------------------------


@numba.njit(nogil=True, cache=True)
def reduce_f16(dst: np.ndarray, src: np.ndarray, op: int) -> None:
    """Reduce IEEE half bits: sums and products in float32, MAX/MIN pick an operand's bits."""
    if _partial_overlap(dst, src):
        src = src.copy()
    n = dst.shape[0]
    if op == OP_PRODUCT:
        for i in range(n):
            dst[i] = _float_to_half(_half_to_float(dst[i]) * _half_to_float(src[i]))
    elif op == OP_MAX:
        for i in range(n):
            a = dst[i]
            b = src[i]
            fa = _half_to_float(a)
            fb = _half_to_float(b)
            dst[i] = a if (fa >= fb or fa != fa) else b
    elif op == OP_MIN:
        for i in range(n):
            a = dst[i]
            b = src[i]
            fa = _half_to_float(a)
            fb = _half_to_float(b)
            dst[i] = a if (fa <= fb or fa != fa) else b
    else:
        for i in range(n):
            dst[i] = _float_to_half(_half_to_float(dst[i]) + _half_to_float(src[i]))


@numba.njit(nogil=True, cache=True)
def average_f16(dst: np.ndarray, divisor: int) -> None:
    """``dst /= divisor`` on half bits, divided in float32."""
    d = np.float32(divisor)
    for i in range(dst.shape[0]):
        dst[i] = _float_to_half(_half_to_float(dst[i]) / d)


@numba.njit(nogil=True, cache=True)
def scale_f16(dst: np.ndarray, weight: float) -> None:
    """``dst *= weight`` on half bits, multiplied in float32."""
    w = np.float32(weight)
    for i in range(dst.shape[0]):
        dst[i] = _float_to_half(_half_to_float(dst[i]) * w)


@numba.njit(nogil=True, cache=True)
def axpy_f16(dst: np.ndarray, src: np.ndarray, weight: float) -> None:
    """``dst += weight * src`` on half bits, computed in float32."""
    if _partial_overlap(dst, src):
        src = src.copy()
    w = np.float32(weight)
    for i in range(dst.shape[0]):
        dst[i] = _float_to_half(_half_to_float(dst[i]) + w * _half_to_float(src[i]))


# ---------------------------------------------------------------------------
# bfloat16 as uint16 bits, computed in float32.
# ---------------------------------------------------------------------------


@numba.njit(nogil=True, cache=True)
def reduce_bf16(dst: np.ndarray, src: np.ndarray, op: int) -> None:
    """Reduce bfloat16 bits: sums and products in float32, MAX/MIN pick an operand's bits."""
    if _partial_overlap(dst, src):
        src = src.copy()
    n = dst.shape[0]
    if op == OP_PRODUCT:
        for i in range(n):
            dst[i] = _float_to_bf16(_bf16_to_float(dst[i]) * _bf16_to_float(src[i]))
    elif op == OP_MAX:
        for i in range(n):
            a = dst[i]
            b = src[i]
            fa = _bf16_to_float(a)
            fb = _bf16_to_float(b)
            dst[i] = a if (fa >= fb or fa != fa) else b
    elif op == OP_MIN:
        for i in range(n):
            a = dst[i]
            b = src[i]
            fa = _bf16_to_float(a)
            fb = _bf16_to_float(b)
            dst[i] = a if (fa <= fb or fa != fa) else b
    else:
        for i in range(n):
            dst[i] = _float_to_bf16(_bf16_to_float(dst[i]) + _bf16_to_float(src[i]))


@numba.njit(nogil=True, cache=True)
def average_bf16(dst: np.ndarray, divisor: int) -> None:
    """``dst /= divisor`` on bfloat16 bits, divided in float32."""
    d = np.float32(divisor)
    for i in range(dst.shape[0]):
        dst[i] = _float_to_bf16(_bf16_to_float(dst[i]) / d)


@numba.njit(nogil=True, cache=True)
def scale_bf16(dst: np.ndarray, weight: float) -> None:
    """``dst *= weight`` on bfloat16 bits, multiplied in float32."""
    w = np.float32(weight)
    for i in range(dst.shape[0]):
        dst[i] = _float_to_bf16(_bf16_to_float(dst[i]) * w)


@numba.njit(nogil=True, cache=True)
def axpy_bf16(dst: np.ndarray, src: np.ndarray, weight: float) -> None:
    """``dst += weight * src`` on bfloat16 bits, computed in float32."""
    if _partial_overlap(dst, src):
        src = src.copy()
    w = np.float32(weight)
    for i in range(dst.shape[0]):
        dst[i] = _float_to_bf16(_bf16_to_float(dst[i]) + w * _bf16_to_float(src[i]))


# ---------------------------------------------------------------------------
# Array conversions (tests, diagnostics): the same scalar code as the kernels.
# ---------------------------------------------------------------------------


@numba.njit(nogil=True, cache=True)
def half_bits_to_float32(src: np.ndarray, dst: np.ndarray) -> None:
    """``dst[i] = float32(half(src[i]))`` for uint16 ``src``, float32 ``dst``."""
    for i in range(src.shape[0]):
        dst[i] = _half_to_float(src[i])


@numba.njit(nogil=True, cache=True)
def float32_to_half_bits(src: np.ndarray, dst: np.ndarray) -> None:
    """``dst[i] = bits(half(src[i]))``, rounded to nearest even."""
    for i in range(src.shape[0]):
        dst[i] = _float_to_half(src[i])


@numba.njit(nogil=True, cache=True)
def bf16_bits_to_float32(src: np.ndarray, dst: np.ndarray) -> None:
    """``dst[i] = float32(bfloat16(src[i]))`` for uint16 ``src``."""
    for i in range(src.shape[0]):
        dst[i] = _bf16_to_float(src[i])


@numba.njit(nogil=True, cache=True)
def float32_to_bf16_bits(src: np.ndarray, dst: np.ndarray) -> None:
    """``dst[i] = bits(bfloat16(src[i]))``, rounded to nearest even."""
    for i in range(src.shape[0]):
        dst[i] = _float_to_bf16(src[i])

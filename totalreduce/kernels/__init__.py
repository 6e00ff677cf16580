"""Element kernels: the only code in totalreduce that does arithmetic on payload.

The functions here validate their arguments, pick the Numba kernel of
:mod:`.numba_kernels` for a :class:`~totalreduce.dtypes.DType` (a dict lookup)
and call it; the kernels release the GIL.  Arrays are 1-D and C-contiguous,
float16 data arrives as ``float16`` arrays and bfloat16 data as ``uint16``
arrays of bit patterns.  ``dst`` must be writable and ``src`` may be read-only;
either may be unaligned or a view into a bigger array (even the same one).

Each kernel has exactly one compiled signature per storage type.  It is built
(or loaded from Numba's on-disk cache) the first time a dtype is used, or
ahead of time by :func:`warm_up`; after that the kernels never compile again,
so an array of the wrong kind is rejected with a ``TypeError`` instead of
triggering a surprise compilation.
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import numpy as np
from numba import from_dtype, types

from ..dtypes import DType, ReduceOp
from . import numba_kernels as nk

__all__ = [
    "adasum_into",
    "axpy_into",
    "copy_into",
    "finish_average",
    "narrow_into",
    "reduce_into",
    "scale_into",
    "widen_into",
    "warm_up",
]

Kernel = Callable[..., None]

_U16 = np.dtype(np.uint16)
_INTEGER = frozenset(d for d in DType if d.integral)  # bool included: nothing to scale

# ReduceOp -> the integer the reduce kernels branch on.  SUM and AVG both add.
_OP_CODES: dict[ReduceOp, int] = {
    ReduceOp.SUM: nk.OP_SUM,
    ReduceOp.AVG: nk.OP_AVG,
    ReduceOp.MAX: nk.OP_MAX,
    ReduceOp.MIN: nk.OP_MIN,
    ReduceOp.PRODUCT: nk.OP_PRODUCT,
    ReduceOp.BAND: nk.OP_BAND,
    ReduceOp.BOR: nk.OP_BOR,
    ReduceOp.BXOR: nk.OP_BXOR,
}


class _Table(NamedTuple):
    """The kernels of one DType and the single signature each is built for."""

    dtype: DType
    public: np.dtype  # what callers pass
    view16: bool  # float16: pass ``a.view(uint16)`` to the kernel
    reduce: Kernel
    copy: Kernel
    average: Kernel | None  # None: bool (no average)
    scale: Kernel | None  # None: integer type
    axpy: Kernel | None
    signatures: tuple[tuple[Any, tuple[Any, ...]], ...]


def _table(dtype: DType, reduce: Any, average: Any, scale: Any, axpy: Any) -> _Table:
    storage = _U16 if dtype is DType.FLOAT16 else dtype.numpy
    item = from_dtype(storage)
    dst = types.Array(item, 1, "C", aligned=False)
    src = types.Array(item, 1, "C", readonly=True, aligned=False)
    sigs: list[tuple[Any, tuple[Any, ...]]] = [
        (reduce, (dst, src, types.int64)),
        (nk.copy_array, (dst, src)),
    ]
    if average is not None:
        sigs.append((average, (dst, types.int64)))
    if scale is not None:
        sigs += [(scale, (dst, types.float64)), (axpy, (dst, src, types.float64))]
    return _Table(
        dtype=dtype,
        public=dtype.numpy,
        view16=dtype is DType.FLOAT16,
        reduce=reduce,
        copy=nk.copy_array,
        average=average,
        scale=scale,
        axpy=axpy,
        signatures=tuple(sigs),
    )


_TABLES: dict[DType, _Table] = {
    DType.FLOAT16: _table(DType.FLOAT16, nk.reduce_f16, nk.average_f16, nk.scale_f16, nk.axpy_f16),
    DType.FLOAT32: _table(
        DType.FLOAT32, nk.reduce_native, nk.average_float, nk.scale_float, nk.axpy_float
    ),
    DType.FLOAT64: _table(
        DType.FLOAT64, nk.reduce_native, nk.average_float, nk.scale_float, nk.axpy_float
    ),
    DType.INT32: _table(DType.INT32, nk.reduce_integer, nk.average_int, None, None),
    DType.INT64: _table(DType.INT64, nk.reduce_integer, nk.average_int, None, None),
    DType.UINT8: _table(DType.UINT8, nk.reduce_integer, nk.average_int, None, None),
    DType.INT8: _table(DType.INT8, nk.reduce_integer, nk.average_int, None, None),
    DType.INT16: _table(DType.INT16, nk.reduce_integer, nk.average_int, None, None),
    DType.BOOL: _table(DType.BOOL, nk.reduce_bool, None, None, None),
    DType.BFLOAT16: _table(
        DType.BFLOAT16, nk.reduce_bf16, nk.average_bf16, nk.scale_bf16, nk.axpy_bf16
    ),
}

# DTypes whose kernels are built; the wrappers' fast path.
_READY: dict[DType, _Table] = {}
_LOCK = threading.Lock()

# Every signature of each kernel, over all the DTypes that share it (the copy
# kernel serves them all; the generic kernels serve several).
_KERNEL_SIGNATURES: dict[Any, list[tuple[Any, ...]]] = {}
for _t in _TABLES.values():
    for _kernel, _sig in _t.signatures:
        _KERNEL_SIGNATURES.setdefault(_kernel, [])
        if _sig not in _KERNEL_SIGNATURES[_kernel]:
            _KERNEL_SIGNATURES[_kernel].append(_sig)
del _t, _kernel, _sig
_BUILT: set[Any] = set()  # kernels whose signatures are all compiled; under _LOCK


def _prepare(dtype: object) -> _Table:
    """Build (or load from cache) the kernels of ``dtype``, once."""
    try:
        table = _TABLES[dtype]  # type: ignore[index]
    except (KeyError, TypeError):
        names = ", ".join(d.name for d in DType)
        raise ValueError(f"unsupported dtype {dtype!r}; expected a DType ({names})") from None
    with _LOCK:
        if table.dtype in _READY:
            return table
        for kernel, _ in table.signatures:
            if kernel in _BUILT:
                continue
            # Compile all signatures of the kernel, then forbid compiling for
            # good: calls with writable or aligned arrays convert to these
            # instead of specialising.  A kernel is switched exactly once, and
            # before any DType using it is ready, so no thread ever calls a
            # kernel that is still being built.
            for sig in _KERNEL_SIGNATURES[kernel]:
                kernel.compile(sig)
            kernel.disable_compile(True)
            _BUILT.add(kernel)
        _prime(table)
        _READY[table.dtype] = table
    return table


def _prime(table: _Table) -> None:
    """Call every kernel once on one element, so Numba resolves the common
    argument types (writable, aligned) before the first real call."""
    a = np.zeros(1, table.public)
    b = np.zeros(1, table.public)
    if table.view16:
        a, b = a.view(_U16), b.view(_U16)
    table.reduce(a, b, nk.OP_SUM)
    table.copy(a, b)
    if table.average is not None:
        table.average(a, 1)
    if table.scale is not None and table.axpy is not None:
        table.scale(a, 1.0)
        table.axpy(a, b, 1.0)


def _name(dtype: object) -> str:
    return dtype.name if isinstance(dtype, DType) else repr(dtype)


def _describe(a: object) -> str:
    if not isinstance(a, np.ndarray):
        return f"a {type(a).__name__}"
    parts = [f"{a.ndim}-D {a.dtype}"]
    if not a.flags.c_contiguous:
        parts.append("non-contiguous")
    if not a.flags.writeable:
        parts.append("read-only")
    return " ".join(parts) + " array"


def _bad_arrays(func: str, table: _Table, dst: object, src: object = None) -> TypeError:
    want = f"1-D C-contiguous {table.public} array"
    msg = f"{func}({table.dtype.name}): dst must be a writable {want}"
    got = f"got dst {_describe(dst)}"
    if src is not None:
        msg += f" and src a {want}"
        got += f" and src {_describe(src)}"
    return TypeError(f"{msg}; {got}")


def _check_dtypes(func: str, table: _Table, dst: Any, src: Any = None) -> None:
    """Raise unless the arrays hold ``table.public`` (the slow path of the
    identity test the wrappers do first)."""
    for a in (dst, src):
        if a is not None and not (isinstance(a, np.ndarray) and a.dtype == table.public):
            raise _bad_arrays(func, table, dst, src)


def _length_error(func: str, dst: Any, src: Any, dtype: object) -> ValueError:
    return ValueError(
        f"{func}({_name(dtype)}): dst has {len(dst)} elements but src has {len(src)}; "
        "they must be the same length"
    )


def _integer_error(func: str, dtype: object) -> TypeError:
    return TypeError(
        f"{func} needs a floating dtype, got {_name(dtype)}: integer buffers "
        "cannot be scaled by a fractional weight"
    )


def reduce_into(dst: np.ndarray, src: np.ndarray, op: ReduceOp, dtype: DType) -> None:
    """Combine ``src`` into ``dst`` element-wise: ``dst[i] = dst[i] (op) src[i]``.

    ``SUM`` and ``AVG`` both add (the division of ``AVG`` is
    :func:`finish_average`); ``MAX``/``MIN`` follow ``np.maximum``/``np.minimum``
    (NaN wins); ``PRODUCT`` multiplies; ``BAND``/``BOR``/``BXOR`` are bitwise
    (integer and bool types only).  Integer sums and products wrap; float16
    and bfloat16 compute in float32 and round back to nearest even.  On bool,
    ``SUM``/``MAX`` are a logical or and ``PRODUCT``/``MIN`` a logical and
    (numpy's ``add``/``multiply`` on bool, and gloo's).  Raises ``ValueError``
    for arrays of different lengths, an unknown op/dtype or an op the dtype
    has not (a bitwise op on floats, ``AVG`` on bool), ``TypeError`` for
    arrays that are not 1-D, C-contiguous and of ``dtype`` (``dst`` also
    writable).
    """
    n = len(dst)
    if len(src) != n:
        raise _length_error("reduce_into", dst, src, dtype)
    if n == 0:
        return
    code = _OP_CODES.get(op)
    if code is None:
        names = ", ".join(o.name for o in ReduceOp)
        raise ValueError(f"reduce_into: unsupported op {op!r}; expected a ReduceOp ({names})")
    if (code >= nk.OP_BAND or code == nk.OP_AVG) and isinstance(dtype, DType):
        why = ReduceOp(code).refuses(dtype)
        if why is not None:
            raise ValueError(f"reduce_into: {why}")
    table = _READY.get(dtype)
    if table is None:
        table = _prepare(dtype)
    pub = table.public
    if getattr(dst, "dtype", None) is not pub or getattr(src, "dtype", None) is not pub:
        _check_dtypes("reduce_into", table, dst, src)
    a, b = dst, src
    if table.view16:
        a, b = dst.view(_U16), src.view(_U16)
    try:
        table.reduce(a, b, code)
    except TypeError:
        raise _bad_arrays("reduce_into", table, dst, src) from None


def copy_into(dst: np.ndarray, src: np.ndarray, dtype: DType) -> None:
    """Copy ``src`` into ``dst`` (``dst[:] = src``) without holding the GIL.

    Overlapping views of one buffer are handled like numpy does.  Raises like
    :func:`reduce_into`.
    """
    n = len(dst)
    if len(src) != n:
        raise _length_error("copy_into", dst, src, dtype)
    if n == 0:
        return
    table = _READY.get(dtype)
    if table is None:
        table = _prepare(dtype)
    pub = table.public
    if getattr(dst, "dtype", None) is not pub or getattr(src, "dtype", None) is not pub:
        _check_dtypes("copy_into", table, dst, src)
    a, b = dst, src
    if table.view16:
        a, b = dst.view(_U16), src.view(_U16)
    try:
        table.copy(a, b)
    except TypeError:
        raise _bad_arrays("copy_into", table, dst, src) from None


def finish_average(dst: np.ndarray, divisor: int, dtype: DType) -> None:
    """Finish an ``AVG`` reduction: divide ``dst`` by the number of contributions.

    Floating types divide (float16/bfloat16 in float32, rounded back);
    integer types floor-divide like numpy's ``//``.  ``divisor`` must be an
    integer >= 1 (``ValueError`` otherwise; ``TypeError`` if not an integer).
    """
    d = operator.index(divisor)
    if d < 1:
        raise ValueError(f"finish_average({_name(dtype)}): divisor must be >= 1, got {d}")
    if d == 1 or len(dst) == 0:
        return
    table = _READY.get(dtype)
    if table is None:
        table = _prepare(dtype)
    if table.average is None:
        raise TypeError(f"finish_average({_name(dtype)}): bool arrays have no average")
    if getattr(dst, "dtype", None) is not table.public:
        _check_dtypes("finish_average", table, dst)
    a = dst.view(_U16) if table.view16 else dst
    try:
        table.average(a, d)
    except TypeError:
        raise _bad_arrays("finish_average", table, dst) from None


def scale_into(dst: np.ndarray, weight: float, dtype: DType) -> None:
    """Multiply ``dst`` by ``weight`` in place (floating dtypes only).

    The weight is rounded to the element type first (to float32 for
    float16/bfloat16, which multiply in float32).  Raises ``TypeError`` for an
    integer dtype.
    """
    if dtype in _INTEGER:
        raise _integer_error("scale_into", dtype)
    if len(dst) == 0:
        return
    table = _READY.get(dtype)
    if table is None:
        table = _prepare(dtype)
    assert table.scale is not None
    if getattr(dst, "dtype", None) is not table.public:
        _check_dtypes("scale_into", table, dst)
    a = dst.view(_U16) if table.view16 else dst
    try:
        table.scale(a, float(weight))
    except TypeError:
        raise _bad_arrays("scale_into", table, dst) from None


def axpy_into(dst: np.ndarray, src: np.ndarray, weight: float, dtype: DType) -> None:
    """Add a weighted buffer: ``dst += weight * src`` (floating dtypes only).

    For float32/float64 this is numpy's ``dst += w * src`` with ``w`` first
    converted to the element type: a rounded multiply, then a rounded add, no
    fused multiply-add.  float16/bfloat16 compute both steps in float32 and
    round once at the end.  Used for weighted neighbour averaging.  Raises
    ``TypeError`` for an integer dtype and otherwise like :func:`reduce_into`.
    """
    if dtype in _INTEGER:
        raise _integer_error("axpy_into", dtype)
    n = len(dst)
    if len(src) != n:
        raise _length_error("axpy_into", dst, src, dtype)
    if n == 0:
        return
    table = _READY.get(dtype)
    if table is None:
        table = _prepare(dtype)
    assert table.axpy is not None
    pub = table.public
    if getattr(dst, "dtype", None) is not pub or getattr(src, "dtype", None) is not pub:
        _check_dtypes("axpy_into", table, dst, src)
    a, b = dst, src
    if table.view16:
        a, b = dst.view(_U16), src.view(_U16)
    try:
        table.axpy(a, b, float(weight))
    except TypeError:
        raise _bad_arrays("axpy_into", table, dst, src) from None


def adasum_into(dst: np.ndarray, a: np.ndarray, b: np.ndarray, dtype: DType) -> None:
    """Adasum's combine of ``a`` and ``b`` into ``dst`` (float32/float64; ``dst`` may be
    either): ``(1 - a.b/2|a|^2) a + (1 - a.b/2|b|^2) b``, dot products in float64.  The
    result depends on which operand is ``a``: a pair of ranks passes the lower rank's
    gradient as ``a`` on both sides, and both get the same bits."""
    if dtype not in (DType.FLOAT32, DType.FLOAT64):
        raise TypeError(f"adasum_into({_name(dtype)}): Adasum combines float32 or float64")
    n = len(dst)
    if len(a) != n or len(b) != n:
        raise _length_error("adasum_into", dst, a if len(a) != n else b, dtype)
    pub = dtype.numpy
    for arr in (dst, a, b):
        if getattr(arr, "dtype", None) != pub or arr.ndim != 1:
            raise _bad_arrays("adasum_into", _prepare(dtype), dst, a)
    nk.adasum_float(dst, a, b)


def widen_into(dst: np.ndarray, src: np.ndarray, dtype: DType) -> None:
    """``dst`` (float32) = the float16 or bfloat16 values of ``src`` (their 16-bit patterns)."""
    if dtype not in (DType.FLOAT16, DType.BFLOAT16):
        raise TypeError(f"widen_into({_name(dtype)}): float16 or bfloat16 only")
    if len(dst) != len(src):
        raise _length_error("widen_into", dst, src, dtype)
    bits = src.view(_U16)
    if dtype is DType.FLOAT16:
        nk.half_bits_to_float32(bits, dst)
    else:
        nk.bf16_bits_to_float32(bits, dst)


def narrow_into(dst: np.ndarray, src: np.ndarray, dtype: DType) -> None:
    """``dst`` (float16 or bfloat16 patterns) = ``src`` (float32) rounded to nearest even."""
    if dtype not in (DType.FLOAT16, DType.BFLOAT16):
        raise TypeError(f"narrow_into({_name(dtype)}): float16 or bfloat16 only")
    if len(dst) != len(src):
        raise _length_error("narrow_into", dst, src, dtype)
    bits = dst.view(_U16)
    if dtype is DType.FLOAT16:
        nk.float32_to_half_bits(src, bits)
    else:
        nk.float32_to_bf16_bits(src, bits)


def warm_up(dtypes: Iterable[DType] | None = None) -> None:
    """Compile, or load from Numba's cache, the kernels of ``dtypes`` (default:
    every DType), so that their first real use does not pause."""
    for dtype in DType if dtypes is None else dtypes:
        _prepare(DType.of(dtype))

"""Element types and reduce operations: the codes every layer agrees on.

The codes travel on the wire (engine/wire.py) and select kernels (kernels/),
so they must never be renumbered: new ones are appended.  bfloat16 has no numpy dtype: it is carried
as its 16-bit pattern in a ``uint16`` array and reduced by its own kernel.
"""

from __future__ import annotations

import enum

import numpy as np


class DType(enum.IntEnum):
    """Element types the engine moves and reduces."""

    FLOAT16 = 1
    FLOAT32 = 2
    FLOAT64 = 3
    INT32 = 4
    INT64 = 5
    BFLOAT16 = 6
    UINT8 = 7
    INT8 = 8
    INT16 = 9
    BOOL = 10

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self]

    @property
    def numpy(self) -> np.dtype:
        """The numpy dtype of a buffer holding this type (uint16 for bfloat16)."""
        return _NUMPY[self]

    @property
    def integral(self) -> bool:
        """An integer or bool type: the bitwise reduce ops apply, scaling does not."""
        return self in _INTEGRAL

    @classmethod
    def of(cls, dtype: object) -> DType:
        """The code for a numpy dtype (or anything ``np.dtype`` accepts)."""
        if isinstance(dtype, DType):
            return dtype
        if isinstance(dtype, str) and dtype.lower() == "bfloat16":
            return cls.BFLOAT16
        try:
            key = np.dtype(dtype)  # type: ignore[call-overload]
        except TypeError as exc:
            raise ValueError(f"unsupported dtype {dtype!r}") from exc
        try:
            return _FROM_NUMPY[key]
        except KeyError:
            names = ", ".join(d.name.lower() for d in cls)
            raise ValueError(f"unsupported dtype {key.name!r}; supported: {names}") from None


_ITEMSIZE: dict[DType, int] = {
    DType.FLOAT16: 2,
    DType.FLOAT32: 4,
    DType.FLOAT64: 8,
    DType.INT32: 4,
    DType.INT64: 8,
    DType.BFLOAT16: 2,
    DType.UINT8: 1,
    DType.INT8: 1,
    DType.INT16: 2,
    DType.BOOL: 1,
}
_NUMPY: dict[DType, np.dtype] = {
    DType.FLOAT16: np.dtype(np.float16),
    DType.FLOAT32: np.dtype(np.float32),
    DType.FLOAT64: np.dtype(np.float64),
    DType.INT32: np.dtype(np.int32),
    DType.INT64: np.dtype(np.int64),
    DType.BFLOAT16: np.dtype(np.uint16),
    DType.UINT8: np.dtype(np.uint8),
    DType.INT8: np.dtype(np.int8),
    DType.INT16: np.dtype(np.int16),
    DType.BOOL: np.dtype(np.bool_),
}
_FROM_NUMPY = {v: k for k, v in _NUMPY.items() if k is not DType.BFLOAT16}
_INTEGRAL = frozenset({DType.INT32, DType.INT64, DType.UINT8, DType.INT8, DType.INT16, DType.BOOL})


class ReduceOp(enum.IntEnum):
    """How received data combines with local data.

    ``AVG`` reduces as ``SUM`` and divides by the number of contributions at
    the end; on integer types that division rounds toward negative infinity
    (numpy's ``//``); bool has no average.  ``PRODUCT`` multiplies.  The
    bitwise ``BAND``, ``BOR`` and ``BXOR`` apply to integer and bool types
    only.  On bool, as in gloo and numpy, ``SUM`` and ``MAX`` are a logical
    or, ``PRODUCT`` and ``MIN`` a logical and.  Integer ``SUM`` and
    ``PRODUCT`` wrap around.
    """

    SUM = 1
    AVG = 2
    MAX = 3
    MIN = 4
    PRODUCT = 5
    BAND = 6
    BOR = 7
    BXOR = 8

    @property
    def bitwise(self) -> bool:
        """``BAND``, ``BOR`` or ``BXOR``: integer and bool types only."""
        return self in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)

    def refuses(self, dtype: DType) -> str | None:
        """Why this op cannot reduce ``dtype``, or None when it can."""
        if self.bitwise and not dtype.integral:
            return (
                f"reduce op {self.name.lower()!r} is bitwise: it needs an integer or bool "
                f"array, got {dtype.name.lower()}"
            )
        if self is ReduceOp.AVG and dtype is DType.BOOL:
            return "reduce op 'avg' has no meaning on bool arrays (use 'sum', 'max' or 'min')"
        return None

    @classmethod
    def of(cls, op: object) -> ReduceOp:
        if isinstance(op, ReduceOp):
            return op
        if isinstance(op, str):
            try:
                return cls[op.upper()]
            except KeyError:
                pass
        if isinstance(op, str) and op.lower() in _ALIASES:
            return _ALIASES[op.lower()]
        names = ", ".join(repr(o.name.lower()) for o in cls)
        raise ValueError(f"unsupported reduce op {op!r}; supported: {names}")


#: Other names of the reduce ops (torch's and MPI's spellings).
_ALIASES = {"prod": ReduceOp.PRODUCT}

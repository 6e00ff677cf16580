"""Element types and reduce operations: the codes every layer agrees on.

The codes travel on the wire (engine/wire.py) and select kernels (kernels/),
so they must never be renumbered.  bfloat16 has no numpy dtype: it is carried
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

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self]

    @property
    def numpy(self) -> np.dtype:
        """The numpy dtype of a buffer holding this type (uint16 for bfloat16)."""
        return _NUMPY[self]

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
}
_NUMPY: dict[DType, np.dtype] = {
    DType.FLOAT16: np.dtype(np.float16),
    DType.FLOAT32: np.dtype(np.float32),
    DType.FLOAT64: np.dtype(np.float64),
    DType.INT32: np.dtype(np.int32),
    DType.INT64: np.dtype(np.int64),
    DType.BFLOAT16: np.dtype(np.uint16),
}
_FROM_NUMPY = {v: k for k, v in _NUMPY.items() if k is not DType.BFLOAT16}


class ReduceOp(enum.IntEnum):
    """How received data combines with local data.

    ``AVG`` reduces as ``SUM`` and divides by the number of contributions at
    the end; on integer types that division rounds toward negative infinity
    (numpy's ``//``).
    """

    SUM = 1
    AVG = 2
    MAX = 3
    MIN = 4

    @classmethod
    def of(cls, op: object) -> ReduceOp:
        if isinstance(op, ReduceOp):
            return op
        if isinstance(op, str):
            try:
                return cls[op.upper()]
            except KeyError:
                pass
        names = ", ".join(repr(o.name.lower()) for o in cls)
        raise ValueError(f"unsupported reduce op {op!r}; supported: {names}")

"""Argument checks: arrays, output buffers, priorities, groups and reduce ops of a call.

Each function runs in the caller's thread and raises
:class:`~totalreduce.InvalidArgumentError` before anything is named or sent.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..dtypes import DType, ReduceOp
from ..errors import InvalidArgumentError
from ..group import Group

#: The element types neighbor averaging accepts.
FLOATING = (DType.FLOAT16, DType.FLOAT32, DType.FLOAT64, DType.BFLOAT16)


def as_array(x: Any, what: str, dtype: str | None = None) -> tuple[np.ndarray, DType]:
    """A numpy view of ``x`` (array or buffer) and its element type, after the usual checks.

    ``dtype="bfloat16"`` declares a 16-bit integer array to hold bfloat16 bit
    patterns (numpy has no bfloat16).
    """
    if isinstance(x, np.ndarray):
        arr = x
    elif hasattr(x, "__array__"):
        arr = np.asarray(x)
    else:
        try:
            arr = np.asarray(memoryview(x))
        except TypeError:
            raise InvalidArgumentError(
                f"{what} must be a numpy array or a buffer, got {type(x).__name__}"
            ) from None
    if not arr.flags.c_contiguous:
        raise InvalidArgumentError(
            f"{what} is not C-contiguous (shape {arr.shape}, strides {arr.strides}); "
            "pass np.ascontiguousarray(...)"
        )
    if dtype is not None:
        try:
            dt = DType.of(dtype)
        except ValueError as exc:
            raise InvalidArgumentError(f"{what}: {exc}") from None
        if dt is DType.BFLOAT16:
            if arr.dtype.itemsize != 2 or arr.dtype.kind not in "iu":
                raise InvalidArgumentError(
                    f"{what}: dtype='bfloat16' needs a 16-bit integer array of bit patterns, "
                    f"got {arr.dtype}"
                )
            return arr.view(np.uint16), dt
        if np.dtype(dt.numpy) != arr.dtype:
            raise InvalidArgumentError(f"{what} has dtype {arr.dtype}, dtype= says {dtype}")
        return arr, dt
    try:
        return arr, DType.of(arr.dtype)
    except ValueError as exc:
        raise InvalidArgumentError(f"{what}: {exc}") from None


def output(x: np.ndarray, out: Any, what: str = "out") -> tuple[np.ndarray, bool]:
    """The array the result of ``x`` goes to (new if ``out`` is None), and whether it is ``x``."""
    want = x.size
    if out is None:
        return np.empty(want, dtype=x.dtype), False
    if out.__class__ is np.ndarray and out.dtype is x.dtype and out.size == want:
        # The common case, answered without building anything: a training step's repeats.
        # Two arrays that each own their memory are two allocations: disjoint.
        f = out.flags
        if (
            f.c_contiguous
            and f.writeable
            and (out is x or (f.owndata and x.flags.owndata) or not np.may_share_memory(out, x))
        ):
            return out, out is x
    o, _ = as_array(out, what, "bfloat16" if x.dtype == np.uint16 else None)
    if o.dtype != x.dtype or o.size != want:
        raise InvalidArgumentError(
            f"{what} has dtype {o.dtype} and {o.size} elements; expected {x.dtype} and {want}"
        )
    if not o.flags.writeable:
        raise InvalidArgumentError(f"{what} is read-only")
    if o is x:
        return o, True
    if not np.may_share_memory(o, x):  # disjoint bounds: the cheap answer
        return o, False
    same = o.ctypes.data == x.ctypes.data and o.nbytes == x.nbytes
    if not same and np.shares_memory(o, x):
        raise InvalidArgumentError(f"{what} overlaps the input without being the same array")
    return o, same


def priority(value: Any) -> int:
    """An op's priority as an int (bools and floats refused)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InvalidArgumentError(f"priority must be an int, got {value!r}")
    if not -(1 << 31) <= value < 1 << 31:
        raise InvalidArgumentError(f"priority must fit in 32 bits (frames carry it), got {value!r}")
    return int(value)


def group_of(group: Any, world: Group, rank: int) -> tuple[Group, int]:
    """The group an op runs over (``world`` for None) and world rank ``rank``'s rank in it."""
    if group is None:
        return world, rank
    if not isinstance(group, Group):
        group = Group(group)
    bad = [r for r in group.ranks if r >= world.size]
    if bad:
        raise InvalidArgumentError(f"group {group} names ranks {bad} outside 0..{world.size - 1}")
    me = group.rank_of(rank)
    if me is None:
        raise InvalidArgumentError(f"rank {rank} is not a member of {group}")
    return group, me


def floating(dt: DType) -> None:
    """Neighbor averaging needs a floating-point element type."""
    if dt not in FLOATING:
        raise InvalidArgumentError(
            f"neighbor averaging needs a floating-point array, got {dt.name.lower()}"
        )


def reduce_op(op: Any, dt: DType | None = None, what: str = "") -> ReduceOp:
    """The ReduceOp a call names, or InvalidArgumentError listing the known ones.

    With ``dt``, also refuse an op the element type has not (a bitwise op on a
    floating type, ``avg`` on bool), naming the call ``what``, the op and the type.
    """
    key = (op, dt)
    hit = _REDUCE_OPS.get(key) if op.__class__ in (str, ReduceOp) else None
    if hit is not None:
        return hit
    try:
        rop = ReduceOp.of(op)
    except ValueError as exc:
        raise InvalidArgumentError(str(exc)) from None
    why = None if dt is None else rop.refuses(dt)
    if why is not None:
        raise InvalidArgumentError(f"{what}: {why}" if what else why)
    if op.__class__ in (str, ReduceOp) and len(_REDUCE_OPS) < 1024:
        _REDUCE_OPS[key] = rop
    return rop


#: (op as given, dtype) -> the ReduceOp, for ops that passed the checks: every call of a
#: training step names its op again.
_REDUCE_OPS: dict[tuple[Any, DType | None], ReduceOp] = {}

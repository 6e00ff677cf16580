"""Tensors as engine buffers: dtypes, zero-copy host views, staging, and :class:`TensorHandle`.

This module owns the one place where a torch tensor becomes the numpy array the
engine reads and writes, and where a result array becomes a tensor again:

- which torch dtypes the engine takes (:data:`SUPPORTED_DTYPES`); bfloat16 travels
  as its 16-bit pattern in a ``uint16`` array and is reduced by the engine's
  bfloat16 kernel (which accumulates in float32);
- a contiguous CPU tensor is used in place, without a copy;
- a non-contiguous CPU tensor, or a CUDA tensor, is staged through a contiguous
  host buffer (pinned when CUDA is available; from a :class:`PinnedPool` when
  the caller keeps one) and the result is copied back;
- :class:`TensorHandle`, whose ``wait()`` returns a tensor.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import InvalidArgumentError
from ..service.handle import HandleLike

#: The tensor dtypes every collective accepts.
SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.bool,
)


def _dtype_names() -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)


class PinnedPool:
    """Host buffers by (dtype, element count), pinned when CUDA is present, reused.

    >>> pool = PinnedPool()
    >>> t = pool.acquire(1024, torch.float32)
    >>> pool.release(t); pool.acquire(1024, torch.float32) is t
    True
    """

    def __init__(self, pin: bool | None = None) -> None:
        self.pin = torch.cuda.is_available() if pin is None else pin
        self._free: dict[tuple[torch.dtype, int], list[torch.Tensor]] = {}
        self._lock = threading.Lock()
        self.allocated = 0

    def acquire(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A 1-D host tensor of ``numel`` elements of ``dtype`` (contents undefined)."""
        with self._lock:
            free = self._free.get((dtype, numel))
            if free:
                return free.pop()
            self.allocated += 1
        return torch.empty(numel, dtype=dtype, pin_memory=self.pin)

    def release(self, tensor: torch.Tensor) -> None:
        """Give ``tensor`` back for a later :meth:`acquire` of the same size and dtype."""
        with self._lock:
            self._free.setdefault((tensor.dtype, tensor.numel()), []).append(tensor)


@dataclass
class HostBuffer:
    """The host-side buffer the engine works on for one tensor.

    ``host`` is a contiguous CPU tensor: the caller's own tensor when no copy
    was needed (``staged`` false), else a copy.  ``array`` is the numpy view of
    ``host`` the engine gets (``uint16`` for bfloat16, with ``engine_dtype``
    ``"bfloat16"``).
    """

    tensor: torch.Tensor
    host: torch.Tensor
    array: np.ndarray
    engine_dtype: str | None
    staged: bool
    pool: PinnedPool | None = None
    flat: torch.Tensor | None = None

    @property
    def engine_kwargs(self) -> dict[str, Any]:
        """The ``dtype=`` keyword the engine needs for this buffer (empty unless bfloat16)."""
        return {} if self.engine_dtype is None else {"dtype": self.engine_dtype}

    def copy_back(self) -> torch.Tensor:
        """After an in-place op: put the result into the caller's tensor; return it."""
        if self.staged:
            with torch.no_grad():
                self.tensor.copy_(self.host.view(self.tensor.shape))
        return self.tensor

    def release(self) -> None:
        """Give a staging buffer taken from a pool back (once the op no longer reads it)."""
        if self.pool is not None and self.flat is not None:
            self.pool.release(self.flat)
            self.flat = None

    def as_tensor(self, result: np.ndarray) -> torch.Tensor:
        """A result array of the engine as a tensor of the caller's dtype and device."""
        return array_to_tensor(result, self.engine_dtype, self.tensor.dtype, self.tensor.device)


def array_to_tensor(
    arr: np.ndarray, engine_dtype: str | None, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Wrap an engine array as a tensor (no copy on CPU) of ``dtype`` on ``device``."""
    if engine_dtype == "bfloat16":
        out = torch.from_numpy(np.ascontiguousarray(arr).view(np.int16)).view(torch.bfloat16)
    else:
        out = torch.from_numpy(arr)
    if out.dtype != dtype:
        out = out.to(dtype)
    if device.type != "cpu":
        out = out.to(device)
    return out


def check_tensor(tensor: Any, what: str) -> torch.Tensor:
    """``tensor`` if it is a dense tensor on a device the engine can reach; else raise."""
    if not isinstance(tensor, torch.Tensor):
        raise InvalidArgumentError(f"{what} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise InvalidArgumentError(
            f"{what} has layout {tensor.layout}; only dense (strided) tensors are supported, "
            "call .to_dense() first"
        )
    if tensor.device.type not in ("cpu", "cuda"):
        raise InvalidArgumentError(
            f"{what} is on device {tensor.device}; totalreduce takes CPU and CUDA tensors, "
            "move it with .cpu() first"
        )
    return tensor


def host_buffer(
    tensor: Any, what: str = "tensor", *, widen: bool = False, pool: PinnedPool | None = None
) -> HostBuffer:
    """The :class:`HostBuffer` for ``tensor``, holding its current values.

    ``widen`` is kept for its callers: every supported dtype now travels as
    itself (bool, uint8, int8 and int16 were once widened to int64).
    ``pool``: where a staging copy takes its buffer from (and
    :meth:`HostBuffer.release` gives it back); without one each staged call
    allocates (pinned when CUDA is available).

    >>> b = host_buffer(torch.ones(3))
    >>> b.staged, b.array.dtype
    (False, dtype('float32'))
    """
    t = check_tensor(tensor, what).detach()
    if t.is_complex():
        raise InvalidArgumentError(
            f"{what} has dtype {t.dtype}; pass torch.view_as_real({what}) (its real pairs) instead"
        )
    carried = t.dtype
    if t.dtype not in SUPPORTED_DTYPES:
        raise InvalidArgumentError(f"{what} has dtype {t.dtype}; supported: {_dtype_names()}")
    flat = None
    if t.device.type == "cpu" and t.is_contiguous() and carried == t.dtype:
        host, staged = t, False
    else:
        if pool is not None:
            flat = pool.acquire(t.numel(), carried)
            host = flat.view(t.shape)
        else:
            host = torch.empty(
                t.shape,
                dtype=carried,
                pin_memory=t.device.type == "cuda" and torch.cuda.is_available(),
            )
        host.copy_(t)
        staged = True
    if carried == torch.bfloat16:
        array = host.view(torch.int16).numpy().view(np.uint16)
        engine_dtype: str | None = "bfloat16"
    else:
        array = host.numpy()
        engine_dtype = None
    return HostBuffer(tensor, host, array, engine_dtype, staged, pool, flat)


class TensorHandle:
    """One submitted op on tensors; ``wait()`` returns the result tensor.

    The engine's :class:`~totalreduce.Handle` is ``handle``.  ``done()`` never
    blocks; ``wait(timeout=None)`` blocks, copies a staged result back (in-place
    ops on non-contiguous or CUDA tensors) and returns the tensor: the caller's
    own tensor for in-place ops (names ending in ``_``), a new one otherwise.
    Until then the input tensor must not be modified: the engine reads it
    without a copy.

    >>> h = trt.allreduce_async_(grad, name="fc1.weight")   # doctest: +SKIP
    >>> ...                                                 # doctest: +SKIP
    >>> h.wait() is grad                                    # doctest: +SKIP
    True
    """

    __slots__ = ("handle", "_finish", "_result", "_lock")

    def __init__(self, handle: HandleLike, finish: Callable[[Any], torch.Tensor]) -> None:
        self.handle = handle
        self._finish: Callable[[Any], torch.Tensor] | None = finish
        self._result: torch.Tensor | None = None
        self._lock = threading.Lock()

    @property
    def name(self) -> str | int:
        """The op's name."""
        return self.handle.name

    @property
    def generation(self) -> int:
        """The op's generation (how many earlier ops of this name this rank submitted)."""
        return self.handle.generation

    def done(self) -> bool:
        """True once the op completed or failed."""
        return self.handle.done()

    def exception(self) -> BaseException | None:
        """The op's error once done, else None."""
        return self.handle.exception()

    def wait(self, timeout: float | None = None) -> torch.Tensor:
        """Block until the op completes; return the result tensor."""
        raw = self.handle.wait(timeout)
        with self._lock:
            if self._finish is not None:
                self._result = self._finish(raw)
                self._finish = None
            assert self._result is not None
            return self._result

    def add_done_callback(self, fn: Callable[[TensorHandle], None]) -> None:
        """Call ``fn(self)`` when the op ends; runs on the comm thread, so keep it short."""
        self.handle.add_done_callback(lambda _h: fn(self))

    def __repr__(self) -> str:
        state = "done" if self.done() else "in flight"
        return f"<TensorHandle op={self.name!r} generation={self.generation} {state}>"


def empty(*size: Any, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A new, uninitialized CPU tensor for collectives (``torch.empty``'s shape forms).

    In daemon mode it lives in the node's arena (:func:`totalreduce.empty`), so an
    allreduce, broadcast or barrier of it makes no copy and the result lands in it in
    place; otherwise it is ``torch.empty``.
    """
    from ..api import empty as array_empty

    if dtype not in SUPPORTED_DTYPES:
        raise InvalidArgumentError(f"empty: dtype {dtype} is not one of {_dtype_names()}")
    shape = tuple(size[0]) if len(size) == 1 and isinstance(size[0], (tuple, list)) else size
    storage = np.uint16 if dtype is torch.bfloat16 else torch.empty(0, dtype=dtype).numpy().dtype
    t = torch.from_numpy(array_empty(tuple(int(n) for n in shape), storage))
    return t.view(torch.bfloat16) if dtype is torch.bfloat16 else t

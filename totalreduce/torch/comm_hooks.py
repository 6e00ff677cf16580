"""Comm hooks for ``torch.nn.parallel.DistributedDataParallel``: DDP's buckets on totalreduce.

This module owns :func:`allreduce_hook` and its compressed variants
:func:`fp16_compress_hook` and :func:`bfloat16_compress_hook`.  Each submits a
bucket's flat gradient buffer as an averaging allreduce and returns a
``torch.futures.Future`` (:mod:`.futures`) that completes when the average is
in the buffer (or fails with the op's error), so DDP keeps its own bucketing
and overlap and a DDP user switches with one line::

    ddp = DistributedDataParallel(model)
    ddp.register_comm_hook(None, totalreduce.torch.allreduce_hook)

A bucket's op is named ``prefix + "bucket{index}"``: DDP calls every bucket
once per iteration on every rank, so the generation of that name is the
iteration and the ranks' ops meet whatever order the buckets finish in.  Two
DDP models in one process need two states with different prefixes
(:class:`CommHookState`), or their bucket names would meet each other.

In daemon mode :func:`allreduce_hook` copies each bucket into a buffer of its own
in the node's arena (kept for the bucket's next iterations, while the client's part
of the arena stays at most half used), reduces that in place, and hands DDP the
buffer as the result: DDP reads its gradients from it (by default it copies them into
the parameters' ``.grad`` anyway), so the result is not copied back into the bucket
first.  DDP fills buckets of its own memory, so the copy in stays.  The compress
hooks write the 16-bit bucket straight into such a buffer too.
"""

# No ``from __future__ import annotations`` here: DDP's register_comm_hook compares
# the hook's annotations with dist.GradBucket and Future[Tensor] as objects.
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..errors import InvalidArgumentError
from ..service.handle import ServiceLike
from ..service.service import Service
from .collectives import allreduce_async_, resolve_service
from .futures import torch_future


@dataclass
class CommHookState:
    """The ``state`` a totalreduce comm hook takes (``None`` means ``CommHookState()``).

    ``service``: the service to run on (default: ``totalreduce.init()``'s);
    ``prefix``: start of the bucket op names, distinct per DDP model;
    ``calls``: how many buckets the hook has submitted (counted by the hook).

    >>> ddp.register_comm_hook(trt.CommHookState(prefix="encoder."), trt.allreduce_hook)
    ... # doctest: +SKIP
    """

    service: ServiceLike | None = None
    prefix: str = "ddp."
    calls: int = 0


#: Daemon mode: each bucket's buffer in the node's arena, by service (they live in its
#: arena), then by (prefix, bucket index).
_ARENA_BUFFERS: weakref.WeakKeyDictionary[Any, dict[tuple[str, int], torch.Tensor]] = (
    weakref.WeakKeyDictionary()
)


_DEFAULT_PREFIX = CommHookState.prefix

#: What DDP passes a hook (``Any`` in a torch built without torch.distributed).
GradBucket: Any = dist.GradBucket if dist.is_available() else Any


def _state(state: Any) -> tuple[ServiceLike, str, CommHookState | None]:
    if state is None:
        return resolve_service(None), _DEFAULT_PREFIX, None
    if isinstance(state, CommHookState):
        return resolve_service(state.service), state.prefix, state
    if isinstance(state, Service):
        return state, _DEFAULT_PREFIX, None
    raise InvalidArgumentError(
        f"a totalreduce comm hook takes state None, a CommHookState or a Service, got "
        f"{type(state).__name__}"
    )


def _bucket_op(
    resolved: tuple[ServiceLike, str, CommHookState | None],
    bucket: Any,
    tensor: torch.Tensor,
    op: str,
    finish: Any,
) -> torch.futures.Future[torch.Tensor]:
    svc, prefix, counted = resolved
    index = int(bucket.index())
    if counted is not None:
        counted.calls += 1
    # Buckets with higher indices hold the layers nearer the input, which the
    # next forward pass needs first.
    handle = allreduce_async_(tensor, f"{prefix}bucket{index}", op, index, service=svc)
    return torch_future([handle], lambda: finish(handle.wait()))


def allreduce_hook(state: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average a DDP bucket across ranks with totalreduce (DDP's ``allreduce_hook``).

    >>> ddp.register_comm_hook(None, trt.allreduce_hook)   # doctest: +SKIP
    """
    resolved = _state(state)
    buffer = bucket.buffer()
    own = _arena_buffer(resolved, bucket, buffer.dtype)
    if own is not None:  # daemon mode: reduced in the arena, where DDP reads it
        own.copy_(buffer)
        buffer = own
    return _bucket_op(resolved, bucket, buffer, "avg", lambda reduced: reduced)


def _arena_buffer(
    resolved: tuple[ServiceLike, str, CommHookState | None], bucket: Any, dtype: torch.dtype
) -> torch.Tensor | None:
    """The bucket's buffer of ``dtype`` in the node's arena (made the first time, and
    again when DDP rebuilds its buckets); None in embedded mode, or when the client's part
    of the arena has no room to spare (the tensor is then staged, one copy in and one out,
    as any other)."""
    svc, prefix, _ = resolved
    thin = getattr(svc, "_thin", None)
    buffer = bucket.buffer()
    if thin is None or buffer.dim() != 1 or not buffer.is_contiguous() or buffer.is_cuda:
        return None
    cache = _ARENA_BUFFERS.setdefault(svc, {})
    key = (prefix, int(bucket.index()))
    own = cache.get(key)
    if own is not None and own.dtype == dtype and own.numel() == buffer.numel():
        return own
    cache.pop(key, None)  # (its arena block is freed with its last array)
    storage = np.uint16 if dtype is torch.bfloat16 else torch.empty(0, dtype=dtype).numpy().dtype
    arr = thin.empty_if_room(buffer.numel(), storage)
    if arr is None:
        return None
    own = torch.from_numpy(arr)
    if dtype is torch.bfloat16:
        own = own.view(torch.bfloat16)
    cache[key] = own
    return own


def _compressed(state: Any, bucket: Any, dtype: torch.dtype) -> torch.futures.Future[torch.Tensor]:
    buffer = bucket.buffer()
    resolved = _state(state)
    svc = resolved[0]
    # Divide before the sum, as DDP's own compress hooks do, so the 16-bit sum
    # cannot overflow where the mean would not.
    compressed = _arena_buffer(resolved, bucket, dtype)  # daemon mode: no staging copies
    if compressed is None:
        compressed = buffer.div(svc.size).to(dtype)
    else:
        compressed.copy_(buffer.div(svc.size))

    def decompress(reduced: torch.Tensor) -> torch.Tensor:
        buffer.copy_(reduced)
        return buffer

    return _bucket_op(resolved, bucket, compressed, "sum", decompress)


def fp16_compress_hook(state: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """:func:`allreduce_hook` with the bucket sent as float16 (half the bytes).

    >>> ddp.register_comm_hook(None, trt.fp16_compress_hook)   # doctest: +SKIP
    """
    return _compressed(state, bucket, torch.float16)


def bfloat16_compress_hook(state: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """:func:`allreduce_hook` with the bucket sent as bfloat16 (float32's range, half the bytes).

    Not called ``bf16_compress_hook``: DDP refuses a hook of that name unless
    NCCL is present, taking it for its own.
    """
    return _compressed(state, bucket, torch.bfloat16)

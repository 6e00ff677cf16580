"""Start every rank from the same state: parameters, optimizer state, any picklable object.

This module owns the broadcasts a training script makes once, before its first
step (or after loading a checkpoint on one rank): :func:`broadcast_parameters`
for a model's tensors, :func:`broadcast_optimizer_state` for an optimizer's
state and hyper-parameters, :func:`broadcast_object` underneath the latter, and
:func:`allgather_object` for one object from every rank.

>>> trt.broadcast_parameters(model.state_dict(), root=0)    # doctest: +SKIP
>>> trt.broadcast_optimizer_state(optimizer, root=0)        # doctest: +SKIP
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch

from ..errors import InvalidArgumentError
from ..service.handle import ServiceLike
from .collectives import broadcast_async_, resolve_root, resolve_service


def broadcast_parameters(
    params: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]] | torch.nn.Module,
    root: int = 0,
    prefix: str = "broadcast.",
    *,
    root_rank: int | None = None,
    service: ServiceLike | None = None,
) -> None:
    """Overwrite every rank's tensors with rank ``root``'s, in place.

    ``params`` is a ``state_dict()`` (parameters and buffers), an iterable of
    ``(name, tensor)`` such as ``model.named_parameters()``, bare tensors such as
    ``model.parameters()`` (named by position), or a module (its state dict).  All
    broadcasts start at once and are waited for together; each is named ``prefix +
    name``, so every rank must pass the same names.

    >>> trt.broadcast_parameters(model.state_dict(), root=0)   # doctest: +SKIP
    """
    root = resolve_root(root, root_rank)
    if isinstance(params, torch.nn.Module):
        params = params.state_dict()
    items = list(params.items()) if isinstance(params, Mapping) else list(params)
    handles = []
    for k, item in enumerate(items):
        if isinstance(item, torch.Tensor):  # model.parameters(): named by position
            item = (f"param.{k}", item)
        if not (isinstance(item, tuple) and len(item) == 2):
            raise InvalidArgumentError(
                "broadcast_parameters takes a state dict or (name, tensor) pairs, got an item "
                f"{item!r}"
            )
        name, tensor = item
        if not isinstance(tensor, torch.Tensor):
            raise InvalidArgumentError(
                f"broadcast_parameters: {name!r} is a {type(tensor).__name__}, not a tensor"
            )
        handles.append(broadcast_async_(tensor, root, name=f"{prefix}{name}", service=service))
    for h in handles:
        h.wait()


def broadcast_object(
    obj: Any,
    root: int = 0,
    name: str = "broadcast_object",
    *,
    root_rank: int | None = None,
    service: ServiceLike | None = None,
) -> Any:
    """Return rank ``root``'s ``obj`` on every rank (pickled; other ranks' ``obj`` is ignored).

    ``root_rank=`` is Horovod's name for ``root``.  Two broadcasts: the
    pickle's length, then its bytes.  Meant for small, trusted state (it
    unpickles what rank ``root`` sent).

    >>> cfg = trt.broadcast_object(cfg if trt.rank() == 0 else None)   # doctest: +SKIP
    """
    svc = resolve_service(service)
    root = resolve_root(root, root_rank)
    if svc.rank == root:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        length = np.array([len(data)], dtype=np.int64)
    else:
        data = b""
        length = np.zeros(1, dtype=np.int64)
    svc.broadcast(length, root, name=f"{name}.length", out=length)
    # The pickle travels as its own bytes (uint8), not padded to words.
    body = np.frombuffer(data, dtype=np.uint8).copy() if svc.rank == root else None
    if body is None:
        body = np.zeros(int(length[0]), dtype=np.uint8)
    svc.broadcast(body, root, name=f"{name}.bytes", out=body)
    if svc.rank == root:
        return obj
    return pickle.loads(body.tobytes())


def allgather_object(
    obj: Any, name: str = "allgather_object", *, service: ServiceLike | None = None
) -> list[Any]:
    """Every rank's ``obj``, in rank order (Horovod's ``allgather_object``).

    Each rank's pickle travels as an all-gather of unequal parts (the engine
    exchanges the lengths itself); meant for small, trusted objects.

    >>> trt.allgather_object({"rank": trt.rank()})   # on 2 ranks   # doctest: +SKIP
    [{'rank': 0}, {'rank': 1}]
    """
    svc = resolve_service(service)
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    length = np.array([len(data)], dtype=np.int64)
    lengths = svc.allgather(length, f"{name}.length")
    body = np.frombuffer(data, dtype=np.uint8).copy()
    joined = svc.allgather(body, f"{name}.bytes")
    out, start = [], 0
    for n in (int(v) for v in lengths):
        out.append(pickle.loads(joined[start : start + n].tobytes()))
        start += n
    return out


def broadcast_optimizer_state(
    optimizer: torch.optim.Optimizer,
    root: int = 0,
    name: str = "broadcast_optimizer_state",
    *,
    root_rank: int | None = None,
    service: ServiceLike | None = None,
) -> None:
    """Load rank ``root``'s optimizer state and hyper-parameters on every rank.

    Works whether or not the other ranks' optimizers have state yet (for
    example after rank ``root`` alone loaded a checkpoint): the root's
    ``state_dict()`` is serialised with ``torch.save`` and loaded with
    ``load_state_dict`` everywhere else, which moves its tensors to the
    parameters' devices.

    >>> trt.broadcast_optimizer_state(optimizer, root=0)   # doctest: +SKIP
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise InvalidArgumentError(
            f"broadcast_optimizer_state takes a torch.optim.Optimizer, got "
            f"{type(optimizer).__name__}"
        )
    svc = resolve_service(service)
    root = resolve_root(root, root_rank)
    blob: bytes | None = None
    if svc.rank == root:
        buf = io.BytesIO()
        torch.save(optimizer.state_dict(), buf)
        blob = buf.getvalue()
    blob = broadcast_object(blob, root, name=name, service=svc)
    if svc.rank != root:
        assert blob is not None
        state = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
        optimizer.load_state_dict(state)

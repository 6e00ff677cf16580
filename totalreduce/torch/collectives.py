"""Collectives on torch tensors: the engine's ops, taking and returning tensors.

Each op has an ``_async`` form returning a :class:`~totalreduce.torch.TensorHandle`
and a blocking form; a trailing ``_`` means in place (Horovod's convention): the
result is written into the tensor passed, which ``wait()`` returns.  Without it
the result is a new tensor.  Every function takes ``service=`` (default: the
service ``totalreduce.init()`` started) and ``priority=`` (higher goes first;
None means 0); the ones the torch.distributed backend uses take ``staging=``, a
:class:`~totalreduce.torch.tensors.PinnedPool` to reuse staging buffers from.

Contiguous CPU tensors go to the engine without a copy, so a tensor must not be
modified until its op is done.  Other tensors are staged (see ``tensors.py``).

>>> h = trt.allreduce_async(grad, name="fc1.weight", op="avg")   # doctest: +SKIP
>>> avg = h.wait()                                                # doctest: +SKIP
>>> trt.allreduce_(grad, name="fc1.weight")      # in place, blocking   # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

import torch

from ..api import default_service
from ..errors import InvalidArgumentError
from ..service.handle import ServiceLike
from .tensors import HostBuffer, PinnedPool, TensorHandle, host_buffer

#: Horovod's op constants (``hvd.Average`` ...): the engine's op names.
Average = "avg"
Sum = "sum"
#: Horovod's Adasum (float32/float64): see :mod:`totalreduce.service.adasum`.
Adasum = "adasum"
Min = "min"
Max = "max"


def resolve_root(root: int, root_rank: int | None) -> int:
    """``root_rank`` (Horovod's name) when given, else ``root``; both given must agree."""
    if root_rank is None:
        return root
    if root not in (0, root_rank):
        raise InvalidArgumentError(f"root={root} and root_rank={root_rank} disagree; pass one")
    return root_rank


def resolve_service(service: ServiceLike | None) -> ServiceLike:
    """``service``, or the default one (``totalreduce.init()`` must have run)."""
    return default_service() if service is None else service


def priority_value(priority: Any) -> int:
    """The engine priority for ``priority`` (None means 0)."""
    if priority is None:
        return 0
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise InvalidArgumentError(f"priority must be an int or None, got {priority!r}")
    return priority


def _op_of(op: str, average: bool | None) -> str:
    """Horovod's and BlueFog's ``average=`` (True: "avg", False: "sum") over ``op``."""
    if average is None:
        return op
    return "avg" if average else "sum"


def _bluefog_positional(
    name: Any, topology: Any, step: Any, self_weight: Any, src_weights: Any, dst_weights: Any
) -> tuple[Any, Any, Any, Any, Any, Any]:
    """BlueFog's positional order ``(tensor, self_weight, src_weights, dst_weights,
    enable_topo_check, name)`` read from this module's ``(tensor, name, topology, step,
    self_weight, src_weights, ...)``: a float where the name goes is BlueFog's
    ``self_weight`` (a name is a str or an int)."""
    if not isinstance(name, float):
        return name, topology, step, self_weight, src_weights, dst_weights
    bf_name = src_weights if isinstance(src_weights, (str, int)) else None
    return bf_name, None, None, name, topology, step


def _in_place(buf: HostBuffer) -> Any:
    def finish(_raw: Any) -> torch.Tensor:
        out = buf.copy_back()
        buf.release()
        return out

    return finish


def _new_tensor(buf: HostBuffer) -> Any:
    def finish(raw: Any) -> torch.Tensor:
        out = buf.as_tensor(raw)
        buf.release()  # the input's staging copy; the result is the engine's own array
        return out

    return finish


# ---------------------------------------------------------------- allreduce


def allreduce_async(
    tensor: torch.Tensor,
    name: str | int | None = None,
    op: str = "avg",
    priority: int | None = None,
    *,
    average: bool | None = None,
    group: Any = None,
    service: ServiceLike | None = None,
) -> TensorHandle:
    """Start reducing ``tensor`` across ranks into a new tensor (``op``: avg, sum, max, min).

    >>> h = trt.allreduce_async(torch.ones(4), name="ones", op="sum")   # doctest: +SKIP
    >>> h.wait()                                                         # doctest: +SKIP
    tensor([4., 4., 4., 4.])
    """
    op = _op_of(op, average)
    svc = resolve_service(service)
    buf = host_buffer(tensor)
    h = svc.allreduce_async(
        buf.array,
        name=name,
        op=op,
        priority=priority_value(priority),
        group=group,
        **buf.engine_kwargs,
    )
    return TensorHandle(h, _new_tensor(buf))


def allreduce_async_(
    tensor: torch.Tensor,
    name: str | int | None = None,
    op: str = "avg",
    priority: int | None = None,
    *,
    average: bool | None = None,
    group: Any = None,
    staging: PinnedPool | None = None,
    service: ServiceLike | None = None,
) -> TensorHandle:
    """Start reducing ``tensor`` across ranks in place; ``wait()`` returns ``tensor``."""
    op = _op_of(op, average)
    svc = resolve_service(service)
    buf = host_buffer(tensor, pool=staging)
    h = svc.allreduce_async(
        buf.array,
        name=name,
        op=op,
        out=buf.array,
        priority=priority_value(priority),
        group=group,
        **buf.engine_kwargs,
    )
    return TensorHandle(h, _in_place(buf))


def allreduce(
    tensor: torch.Tensor,
    name: str | int | None = None,
    op: str = "avg",
    priority: int | None = None,
    *,
    average: bool | None = None,
    service: ServiceLike | None = None,
) -> torch.Tensor:
    """Blocking :func:`allreduce_async`: the reduced values in a new tensor."""
    op = _op_of(op, average)
    return allreduce_async(tensor, name, op, priority, service=service).wait()


def allreduce_(
    tensor: torch.Tensor,
    name: str | int | None = None,
    op: str = "avg",
    priority: int | None = None,
    *,
    average: bool | None = None,
    service: ServiceLike | None = None,
) -> torch.Tensor:
    """Blocking :func:`allreduce_async_`: reduces ``tensor`` in place and returns it."""
    op = _op_of(op, average)
    return allreduce_async_(tensor, name, op, priority, service=service).wait()


# ---------------------------------------------------------------- broadcast


def broadcast_async(
    tensor: torch.Tensor,
    root: int = 0,
    name: str | int | None = None,
    priority: int | None = None,
    *,
    root_rank: int | None = None,
    group: Any = None,
    service: ServiceLike | None = None,
) -> TensorHandle:
    """Start copying rank ``root``'s ``tensor`` to every rank, into a new tensor.

    ``root_rank=`` is Horovod's name for ``root``.
    """
    svc = resolve_service(service)
    root = resolve_root(root, root_rank)
    buf = host_buffer(tensor, widen=True)
    h = svc.broadcast_async(
        buf.array,
        root,
        name=name,
        priority=priority_value(priority),
        group=group,
        **buf.engine_kwargs,
    )
    return TensorHandle(h, _new_tensor(buf))


def broadcast_async_(
    tensor: torch.Tensor,
    root: int = 0,
    name: str | int | None = None,
    priority: int | None = None,
    *,
    root_rank: int | None = None,
    group: Any = None,
    staging: PinnedPool | None = None,
    service: ServiceLike | None = None,
) -> TensorHandle:
    """Start overwriting ``tensor`` with rank ``root``'s, in place; ``wait()`` returns it."""
    svc = resolve_service(service)
    root = resolve_root(root, root_rank)
    buf = host_buffer(tensor, widen=True, pool=staging)
    h = svc.broadcast_async(
        buf.array,
        root,
        name=name,
        out=buf.array,
        priority=priority_value(priority),
        group=group,
        **buf.engine_kwargs,
    )
    return TensorHandle(h, _in_place(buf))


def broadcast(
    tensor: torch.Tensor,
    root: int = 0,
    name: str | int | None = None,
    priority: int | None = None,
    *,
    root_rank: int | None = None,
    service: ServiceLike | None = None,
) -> torch.Tensor:
    """Blocking :func:`broadcast_async`: rank ``root``'s values in a new tensor."""
    return broadcast_async(
        tensor, root, name, priority, root_rank=root_rank, service=service
    ).wait()


def broadcast_(
    tensor: torch.Tensor,
    root: int = 0,
    name: str | int | None = None,
    priority: int | None = None,
    *,
    root_rank: int | None = None,
    service: ServiceLike | None = None,
) -> torch.Tensor:
    """Blocking :func:`broadcast_async_`: overwrites ``tensor`` with rank ``root``'s."""
    return broadcast_async_(
        tensor, root, name, priority, root_rank=root_rank, service=service
    ).wait()


# ---------------------------------------------------------------- reduce-scatter / all-gather


def reduce_scatter_async(
    tensor: torch.Tensor,
    name: str | int | None = None,
    op: str = "sum",
    partition: Any = None,
    axes: Any = None,
    group: Any = None,
    priority: int | None = None,
    *,
    staging: PinnedPool | None = None,
    service: ServiceLike | None = None,
) -> TensorHandle:
    """Start a reduce-scatter; ``wait()`` returns this rank's part as a new tensor.

    Without ``partition`` the tensor is flattened and each rank gets its
    balanced 1-D part of the sum.  With ``partition=totalreduce.Partition(shape)``
    and ``axes=(k,)`` the sum runs over the ranks along partition dimension
    ``k`` and tensor dimension ``k`` is split among them (a 3x7x12 tensor on a
    2x2x3 partition along axis 2 gives 3x7x4).  A rank outside the partition
    gets a copy of its zero-volume input.
    """
    svc = resolve_service(service)
    buf = host_buffer(tensor, pool=staging)
    h = svc.reduce_scatter_async(
        buf.array,
        name,
        op,
        partition=partition,
        axes=axes,
        group=group,
        priority=priority_value(priority),
        **buf.engine_kwargs,
    )
    return TensorHandle(h, _new_tensor(buf))


def reduce_scatter(
    tensor: torch.Tensor,
    name: str | int | None = None,
    op: str = "sum",
    partition: Any = None,
    axes: Any = None,
    group: Any = None,
    priority: int | None = None,
    *,
    service: ServiceLike | None = None,
) -> torch.Tensor:
    """Blocking :func:`reduce_scatter_async`."""
    return reduce_scatter_async(
        tensor, name, op, partition, axes, group, priority, service=service
    ).wait()


def allgather_async(
    tensor: torch.Tensor,
    name: str | int | None = None,
    partition: Any = None,
    axes: Any = None,
    group: Any = None,
    priority: int | None = None,
    *,
    flat: bool = False,
    staging: PinnedPool | None = None,
    service: ServiceLike | None = None,
) -> TensorHandle:
    """Start an all-gather: every rank's tensor joined in rank order, as a new tensor.

    Without ``partition`` the tensors are concatenated along dimension 0, as
    Horovod's and torch's ``allgather`` do: ranks may differ in dimension 0
    only (a ``(2, 5)`` and a ``(3, 5)`` give ``(5, 5)``; a 0-d tensor counts as
    ``(1,)``).  ``flat=True`` joins the flattened tensors into one 1-D tensor
    instead, whatever their shapes.  With ``partition`` and ``axes=(k,)`` the
    parts of the ranks along partition dimension ``k`` are joined along tensor
    dimension ``k`` (the adjoint of :func:`reduce_scatter_async`).

    >>> trt.allgather(torch.ones(2, 5)).shape     # on 3 ranks   # doctest: +SKIP
    torch.Size([6, 5])
    """
    svc = resolve_service(service)
    buf = host_buffer(tensor, pool=staging)
    h = svc.allgather_async(
        buf.array,
        name,
        partition=partition,
        axes=axes,
        group=group,
        priority=priority_value(priority),
        **buf.engine_kwargs,
    )
    if partition is not None or flat or tensor.dim() <= 1:
        return TensorHandle(h, _new_tensor(buf))
    rows = tuple(tensor.shape[1:])
    per_row = max(1, int(torch.Size(rows).numel()))

    def joined(raw: Any) -> torch.Tensor:
        out = buf.as_tensor(raw)
        buf.release()
        if out.numel() % per_row:
            raise InvalidArgumentError(
                f"allgather {h.name!r}: the ranks' tensors differ beyond dimension 0 "
                f"({out.numel()} elements gathered, not a multiple of this rank's row shape "
                f"{rows}); pass flat=True to join them flattened"
            )
        return out.reshape(-1, *rows)

    return TensorHandle(h, joined)


def allgather(
    tensor: torch.Tensor,
    name: str | int | None = None,
    partition: Any = None,
    axes: Any = None,
    group: Any = None,
    priority: int | None = None,
    *,
    flat: bool = False,
    service: ServiceLike | None = None,
) -> torch.Tensor:
    """Blocking :func:`allgather_async`."""
    return allgather_async(
        tensor, name, partition, axes, group, priority, flat=flat, service=service
    ).wait()


# ---------------------------------------------------------------- barrier


def barrier(name: str | int | None = None, *, service: ServiceLike | None = None) -> None:
    """Return once every rank has entered the barrier (Horovod's ``hvd.barrier()``)."""
    resolve_service(service).barrier(name)


# ---------------------------------------------------------------- neighbor averaging


def _neighbor(
    tensor: torch.Tensor,
    name: str | int | None,
    in_place: bool,
    kwargs: dict[str, Any],
    priority: int | None,
    service: ServiceLike | None,
) -> TensorHandle:
    svc = resolve_service(service)
    buf = host_buffer(tensor)
    if in_place:
        kwargs = dict(kwargs, out=buf.array)
    if (
        kwargs.get("topology") is None
        and kwargs.get("self_weight") is None
        and kwargs.get("src_weights") is None
    ):
        from .bluefog import current_topology

        kwargs = dict(kwargs, topology=current_topology())  # set_topology's, if any
    h = svc.neighbor_allreduce_async(
        buf.array, name, priority=priority_value(priority), **kwargs, **buf.engine_kwargs
    )
    return TensorHandle(h, _in_place(buf) if in_place else _new_tensor(buf))


def neighbor_allreduce_async(
    tensor: torch.Tensor,
    name: str | int | None = None,
    topology: Any = None,
    step: int | None = None,
    self_weight: float | None = None,
    src_weights: Any = None,
    dst_weights: Any = None,
    priority: int | None = None,
    *,
    neighbor_weights: Any = None,
    send_neighbors: Any = None,
    enable_topo_check: bool = True,
    service: ServiceLike | None = None,
) -> TensorHandle:
    """Start averaging ``tensor`` with this rank's neighbors, into a new tensor.

    ``x_i <- sum_j W(step)[i, j] x_j`` with ``W`` the mixing matrix of
    ``topology`` (a name or a :mod:`totalreduce.topology` object) at ``step``
    (default: the op's generation), or BlueFog's dynamic ``self_weight`` /
    ``src_weights`` / ``dst_weights``.  Floating-point tensors only.
    """
    name, topology, step, self_weight, src_weights, dst_weights = _bluefog_positional(
        name, topology, step, self_weight, src_weights, dst_weights
    )
    src_weights = neighbor_weights if src_weights is None else src_weights  # BlueFog's older names
    dst_weights = send_neighbors if dst_weights is None else dst_weights
    del enable_topo_check  # the engine always checks that senders and receivers agree
    kwargs = dict(
        topology=topology,
        step=step,
        self_weight=self_weight,
        src_weights=src_weights,
        dst_weights=dst_weights,
    )
    return _neighbor(tensor, name, False, kwargs, priority, service)


def neighbor_allreduce_async_(
    tensor: torch.Tensor,
    name: str | int | None = None,
    topology: Any = None,
    step: int | None = None,
    self_weight: float | None = None,
    src_weights: Any = None,
    dst_weights: Any = None,
    priority: int | None = None,
    *,
    neighbor_weights: Any = None,
    send_neighbors: Any = None,
    enable_topo_check: bool = True,
    service: ServiceLike | None = None,
) -> TensorHandle:
    """In-place :func:`neighbor_allreduce_async`; ``wait()`` returns ``tensor``."""
    name, topology, step, self_weight, src_weights, dst_weights = _bluefog_positional(
        name, topology, step, self_weight, src_weights, dst_weights
    )
    src_weights = neighbor_weights if src_weights is None else src_weights  # BlueFog's older names
    dst_weights = send_neighbors if dst_weights is None else dst_weights
    del enable_topo_check  # the engine always checks that senders and receivers agree
    kwargs = dict(
        topology=topology,
        step=step,
        self_weight=self_weight,
        src_weights=src_weights,
        dst_weights=dst_weights,
    )
    return _neighbor(tensor, name, True, kwargs, priority, service)


def neighbor_allreduce(
    tensor: torch.Tensor,
    name: str | int | None = None,
    topology: Any = None,
    step: int | None = None,
    self_weight: float | None = None,
    src_weights: Any = None,
    dst_weights: Any = None,
    priority: int | None = None,
    *,
    neighbor_weights: Any = None,
    send_neighbors: Any = None,
    enable_topo_check: bool = True,
    service: ServiceLike | None = None,
) -> torch.Tensor:
    """Blocking :func:`neighbor_allreduce_async`."""
    name, topology, step, self_weight, src_weights, dst_weights = _bluefog_positional(
        name, topology, step, self_weight, src_weights, dst_weights
    )
    src_weights = neighbor_weights if src_weights is None else src_weights  # BlueFog's older names
    dst_weights = send_neighbors if dst_weights is None else dst_weights
    del enable_topo_check  # the engine always checks that senders and receivers agree
    return neighbor_allreduce_async(
        tensor,
        name,
        topology,
        step,
        self_weight,
        src_weights,
        dst_weights,
        priority,
        service=service,
    ).wait()


def neighbor_allreduce_(
    tensor: torch.Tensor,
    name: str | int | None = None,
    topology: Any = None,
    step: int | None = None,
    self_weight: float | None = None,
    src_weights: Any = None,
    dst_weights: Any = None,
    priority: int | None = None,
    *,
    neighbor_weights: Any = None,
    send_neighbors: Any = None,
    enable_topo_check: bool = True,
    service: ServiceLike | None = None,
) -> torch.Tensor:
    """Blocking :func:`neighbor_allreduce_async_`."""
    name, topology, step, self_weight, src_weights, dst_weights = _bluefog_positional(
        name, topology, step, self_weight, src_weights, dst_weights
    )
    src_weights = neighbor_weights if src_weights is None else src_weights  # BlueFog's older names
    dst_weights = send_neighbors if dst_weights is None else dst_weights
    del enable_topo_check  # the engine always checks that senders and receivers agree
    return neighbor_allreduce_async_(
        tensor,
        name,
        topology,
        step,
        self_weight,
        src_weights,
        dst_weights,
        priority,
        service=service,
    ).wait()


# ---------------------------------------------------------------- handles


def poll(handle: TensorHandle) -> bool:
    """True once ``handle``'s op has completed (never blocks)."""
    return handle.done()


def synchronize(handle: TensorHandle, timeout: float | None = None) -> torch.Tensor:
    """Wait for ``handle``'s op and return its tensor (Horovod's name for ``wait``)."""
    return handle.wait(timeout)

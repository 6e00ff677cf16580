"""Distributed data-movement layers: :class:`ReduceScatter` and :class:`AllGather` (seed 003).

This module owns the two ``nn.Module``\\ s and their autograd functions.  Each
layer's backward is the other layer's forward, because each is the other's
adjoint: for every ``x`` and ``y`` (summing over ranks)
``<ReduceScatter(x), y> = <x, AllGather(y)>``.

- ``ReduceScatter(partition, axes=(k,))``: on a Cartesian
  :class:`totalreduce.Partition`, sums the tensors of the ranks along partition
  dimension ``k`` and leaves each of them its balanced part of tensor dimension
  ``k`` (a 3x7x12 tensor on a 2x2x3 partition along axis 2 gives 3x7x4).
  Without a partition: the balanced 1-D part of the flattened sum over all ranks.
- ``AllGather(partition, axes=(k,))``: joins the parts of the ranks along
  partition dimension ``k`` along tensor dimension ``k`` (1-D without a
  partition).  For its backward to be a reduce-scatter, the parts must be the
  balanced split a ``ReduceScatter`` produces.

A rank outside the partition passes a zero-volume tensor and gets a copy of it
back; it takes no part in the communication.  Neither layer works in place.

Example (12 ranks)::

    layer = trt.ReduceScatter(totalreduce.Partition((2, 2, 3)), axes=(2,))
    y = layer(torch.rand(3, 7, 12, requires_grad=True))    # y: 3 x 7 x 4
    y.sum().backward()                                      # an all-gather
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import InvalidArgumentError
from ..service.handle import ServiceLike
from .collectives import allgather, reduce_scatter, resolve_service


class _Collective(torch.nn.Module):
    """What both layers share: the partition, the axis, the op names, the service."""

    def __init__(
        self,
        partition: Any = None,
        axes: Any = None,
        name: str | None = None,
        *,
        service: ServiceLike | None = None,
    ) -> None:
        super().__init__()
        if partition is None and axes not in (None, (), (0,), 0):
            raise InvalidArgumentError(
                f"{type(self).__name__}: axes={axes!r} needs a partition; without one the "
                "tensor is flattened"
            )
        self.partition = partition
        self.axes = (axes,) if isinstance(axes, int) else (tuple(axes) if axes else None)
        self.name = name
        self._service = service

    def _op_name(self, phase: str) -> str | None:
        # Unnamed layers match their ops by call order on each rank, as MPI does.
        return None if self.name is None else f"{self.name}.{phase}"

    def reduce_scatter(self, x: torch.Tensor, phase: str) -> torch.Tensor:
        return reduce_scatter(
            x.contiguous(),
            self._op_name(phase),
            "sum",
            partition=self.partition,
            axes=self.axes,
            service=resolve_service(self._service),
        )

    def allgather(self, x: torch.Tensor, phase: str) -> torch.Tensor:
        return allgather(
            x.contiguous(),
            self._op_name(phase),
            partition=self.partition,
            axes=self.axes,
            flat=True,
            service=resolve_service(self._service),
        )

    def extra_repr(self) -> str:
        return f"partition={self.partition!r}, axes={self.axes}, name={self.name!r}"


class _ReduceScatterFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, layer: _Collective) -> torch.Tensor:
        ctx.layer = layer
        ctx.in_shape = x.shape
        return layer.reduce_scatter(x, "forward")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        full = ctx.layer.allgather(grad, "backward")
        return full.reshape(ctx.in_shape), None


class _AllGatherFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, layer: _Collective) -> torch.Tensor:
        ctx.layer = layer
        ctx.in_shape = x.shape
        return layer.allgather(x, "forward")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        part = ctx.layer.reduce_scatter(grad, "backward")
        if part.numel() != torch.Size(ctx.in_shape).numel():
            raise InvalidArgumentError(
                f"AllGather backward: this rank's part had shape {tuple(ctx.in_shape)} but the "
                f"balanced split of the gathered gradient gives {tuple(part.shape)}; the "
                "parts must be split as ReduceScatter splits them"
            )
        return part.reshape(ctx.in_shape), None


class ReduceScatter(_Collective):
    """Sum over the partition's ranks along ``axes``, keeping this rank's part.

    ``ReduceScatter(partition=None, axes=None, name=None, service=None)``; see
    the module docstring.  ``name`` names the ops (``name.forward``,
    ``name.backward``); unnamed layers match by call order.  Backward: an
    all-gather of the gradient.

    >>> rs = trt.ReduceScatter(totalreduce.Partition((2, 3)), axes=(1,))  # doctest: +SKIP
    >>> rs(torch.ones(4, 6)).shape      # on each of the 6 ranks           # doctest: +SKIP
    torch.Size([4, 2])
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ReduceScatterFunction.apply(x, self)


class AllGather(_Collective):
    """Join the parts of the partition's ranks along ``axes`` (the adjoint of ReduceScatter).

    Backward: a reduce-scatter (sum) of the gradient.

    >>> ag = trt.AllGather(totalreduce.Partition((2, 3)), axes=(1,))   # doctest: +SKIP
    >>> ag(torch.ones(4, 2)).shape      # on each of the 6 ranks        # doctest: +SKIP
    torch.Size([4, 6])
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _AllGatherFunction.apply(x, self)

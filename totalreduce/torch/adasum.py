"""``DistributedOptimizer(..., op=hvd.Adasum)``: Horovod's Adasum optimizer.

As in Horovod, Adasum combines *model updates*, not gradients: each ``step()``
lets the wrapped optimizer take its step with this rank's own gradients, takes
the change of every parameter, combines the changes of all ranks with
``allreduce(op="adasum")`` (one op per parameter, all in flight at once; each
is per tensor, as Adasum's dot products are) and applies the combined change
to the parameters as they were before the step.  Every rank ends the step with
the same parameters.  The optimizer's own state (momentum, Adam's moments)
stays local, as in Horovod.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from ..errors import InvalidArgumentError
from ..service.handle import ServiceLike


def adasum_optimizer(
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, torch.Tensor]] | None,
    prefix: str,
    backward_passes_per_step: int,
    service: ServiceLike,
) -> torch.optim.Optimizer:
    """The Adasum wrapper of ``optimizer`` (see the module docstring)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if named_parameters is not None:
        named = list(named_parameters)
        names = {p: n for n, p in named}
        missing = [i for i, p in enumerate(params) if p not in names]
        if missing:
            raise InvalidArgumentError(
                f"DistributedOptimizer(op=Adasum): parameters {missing} of the optimizer are "
                "not in named_parameters"
            )
    else:
        names = {p: f"{gi}.{i}" for gi, g in enumerate(optimizer.param_groups)
                 for i, p in enumerate(g["params"])}  # fmt: skip
    if backward_passes_per_step < 1:
        raise InvalidArgumentError(
            f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}"
        )
    base = type(optimizer)
    cls = type(base.__name__, (_AdasumOptimizer, base), {"__module__": base.__module__})
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update(optimizer.__dict__)  # shared: one state, one set of groups
    wrapped._tra_names = [(f"{prefix}adasum.{names[p]}", p) for p in params]
    wrapped._tra_service = service
    wrapped._tra_passes = backward_passes_per_step
    wrapped._tra_calls = 0
    return wrapped  # type: ignore[no-any-return]


class _AdasumOptimizer(torch.optim.Optimizer):
    _tra_names: list[tuple[str, torch.Tensor]]
    _tra_service: ServiceLike
    _tra_passes: int
    _tra_calls: int

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Step locally, combine every parameter's change by Adasum, apply it to the
        parameters as they were (see the module docstring)."""
        self._tra_calls += 1
        if self._tra_calls % self._tra_passes:
            return None if closure is None else closure()  # gradients keep accumulating
        with torch.no_grad():
            start = [p.detach().clone() for _, p in self._tra_names]
        loss = super().step(closure)
        handles = []
        with torch.no_grad():
            for (name, p), s in zip(self._tra_names, start, strict=True):
                delta = (p.detach() - s).contiguous()
                if delta.device.type != "cpu":
                    delta = delta.cpu()
                arr = delta.numpy()
                handles.append((p, s, delta, self._tra_service.allreduce_async(
                    arr, name=name, op="adasum", out=arr)))  # fmt: skip
            for p, s, delta, h in handles:
                h.wait()
                p.copy_(s + delta.to(p.device))
        return loss

    def synchronize(self) -> None:
        """Nothing to wait for between steps: the combine happens inside ``step()``."""

    def skip_synchronize(self) -> Any:
        import contextlib

        return contextlib.nullcontext()

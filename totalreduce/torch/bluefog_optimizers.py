"""BlueFog's distributed optimizers: ``bf.DistributedAdaptWithCombineOptimizer`` and the rest.

Each factory takes BlueFog's arguments and returns an instance of a subclass of the
wrapped optimizer's class, sharing its parameter groups and state (the wrapped optimizer
keeps working on the same tensors), whose ``step()`` communicates as BlueFog's does:

- :func:`DistributedAdaptWithCombineOptimizer` (and :func:`DistributedNeighborAllreduceOptimizer`,
  :func:`DistributedHierarchicalNeighborAllreduceOptimizer`, :func:`DistributedAllreduceOptimizer`,
  the same with a fixed :class:`CommunicationType`): every forward pass of the model in
  training mode starts averaging its parameters, overlapped with the backward pass;
  ``step()`` waits, puts the averages in place and takes the wrapped step with the gradient
  of the pre-averaging values: ``w <- avg(w) - lr * grad(w)``;
- :func:`DistributedAdaptThenCombineOptimizer`: ``step()`` takes the wrapped step, then
  averages: ``w <- avg(w - lr * grad(w))`` (any optimizer: BlueFog's reimplements SGD,
  Adam, RMSprop, Adagrad and Adadelta per parameter; ``register_step_function`` still
  replaces the step by one of one's own);
- :func:`DistributedGradientAllreduceOptimizer`: each gradient is averaged over all ranks as
  soon as the backward pass has produced it; ``step()`` waits and steps.

The averaging follows :class:`CommunicationType` (``neighbor_allreduce`` over the topology
``set_topology`` set, ``hierarchical_neighbor_allreduce`` over the machine topology,
``allreduce``, or ``empty``: none) and the optimizer's knobs, which a script may change
between steps as BlueFog's: ``self_weight``, ``src_weights``, ``dst_weights``,
``src_machine_weights``, ``dst_machine_weights``, ``enable_topo_check``.  With
``num_steps_per_communication=k`` (BlueFog's ``backward_passes_per_step`` for the gradient
one) the averaging happens every ``k``-th forward pass, step or backward pass.

Example (BlueFog's, with ``import totalreduce.torch as bf``)::

    optimizer = bf.DistributedAdaptWithCombineOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01), model=model,
        communication_type=bf.CommunicationType.neighbor_allreduce)
    for x, y in batches:
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()
"""

from __future__ import annotations

import contextlib
import enum
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..errors import InvalidArgumentError
from .bluefog_ops import (
    hierarchical_neighbor_allreduce_nonblocking,
    timeline_end_activity,
    timeline_start_activity,
)
from .collectives import allreduce_nonblocking, neighbor_allreduce_nonblocking, synchronize


class CommunicationType(enum.Enum):
    """How BlueFog's optimizers average: over the topology, the machines, all ranks, or not."""

    neighbor_allreduce = "neighbor.allreduce"
    hierarchical_neighbor_allreduce = "hierarchical.neighbor.allreduce"
    allreduce = "allreduce"
    empty = "empty"


def _models(model: Any, who: str) -> list[torch.nn.Module]:
    models = list(model) if isinstance(model, (list, tuple)) else [model]
    if not models or not all(isinstance(m, torch.nn.Module) for m in models):
        raise InvalidArgumentError(
            f"{who} needs the model (a torch.nn.Module, or a list of them), got {model!r}"
        )
    return models


def _named(
    models: list[torch.nn.Module], groups: list[dict[str, Any]], who: str
) -> dict[torch.Tensor, str]:
    """Parameter -> name over ``models``; every parameter of the optimizer must be one."""
    names: dict[torch.Tensor, str] = {}
    for i, m in enumerate(models):
        for n, p in m.named_parameters():
            names.setdefault(p, n if len(models) == 1 else f"{i}.{n}")
    missing = [p for g in groups for p in g["params"] if p not in names]
    if missing:
        raise InvalidArgumentError(
            f"{who}: {len(missing)} parameter(s) of the optimizer are not parameters of the "
            "model given; pass the model whose parameters the optimizer steps"
        )
    return names


def _wrap(optimizer: Any, mixin: type, who: str) -> Any:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise InvalidArgumentError(f"{who} wraps a torch.optim.Optimizer, got {optimizer!r}")
    if isinstance(optimizer, _Averaging):
        raise InvalidArgumentError(
            f"{who}: the optimizer is already one of BlueFog's distributed optimizers; wrap "
            "the plain torch optimizer instead"
        )
    base = type(optimizer)
    cls: Any = type(base.__name__, (mixin, base), {"__module__": base.__module__})
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update(optimizer.__dict__)  # one state, one set of parameter groups
    return wrapped


def _every(k: Any, what: str) -> int:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise InvalidArgumentError(f"{what} must be an int >= 1, got {k!r}")
    return k


class _Averaging(torch.optim.Optimizer):
    """The knobs, the averaging of one tensor and the timeline, shared by the optimizers."""

    _bf_names: dict[torch.Tensor, str]
    _bf_models: list[torch.nn.Module]
    _bf_type: CommunicationType
    _bf_handles: dict[torch.Tensor, Any]
    _bf_should_sync: bool
    _bf_timeline: list[Any]

    def _bf_setup(self, model: Any, communication_type: Any, who: str) -> None:
        if not isinstance(communication_type, CommunicationType):
            raise InvalidArgumentError(
                f"{who}: communication_type must be a bf.CommunicationType, got "
                f"{communication_type!r}"
            )
        self._bf_models = _models(model, who)
        self._bf_names = _named(self._bf_models, self.param_groups, who)
        self._bf_type = communication_type
        self._bf_handles = {}
        self._bf_should_sync = True
        self._bf_timeline = []
        # BlueFog's knobs: None means the topology's (or machine topology's) defaults
        self.self_weight: float | None = None
        self.src_weights: Any = None
        self.dst_weights: Any = None
        self.src_machine_weights: Any = None
        self.dst_machine_weights: Any = None
        self.enable_topo_check = False

    @property
    def communication_type(self) -> CommunicationType:
        """How the parameters are averaged (settable between steps)."""
        return self._bf_type

    @communication_type.setter
    def communication_type(self, value: CommunicationType) -> None:
        if not isinstance(value, CommunicationType):
            raise InvalidArgumentError(f"communication_type must be a CommunicationType: {value!r}")
        self._bf_type = value

    def _bf_average_async(self, p: torch.Tensor) -> Any:
        """Start averaging ``p``'s values as the communication type says (None: empty)."""
        name = f"{self._bf_type.value}.{self._bf_names[p]}"
        kind = self._bf_type
        if kind is CommunicationType.neighbor_allreduce:
            return neighbor_allreduce_nonblocking(
                p.data, name=name, self_weight=self.self_weight, src_weights=self.src_weights,
                dst_weights=self.dst_weights, enable_topo_check=self.enable_topo_check,
            )  # fmt: skip
        if kind is CommunicationType.hierarchical_neighbor_allreduce:
            return hierarchical_neighbor_allreduce_nonblocking(
                p.data, name=name, self_weight=self.self_weight,
                src_machine_weights=self.src_machine_weights,
                dst_machine_weights=self.dst_machine_weights,
                enable_topo_check=self.enable_topo_check,
            )  # fmt: skip
        if kind is CommunicationType.allreduce:
            return allreduce_nonblocking(p.data, name=name, average=True)
        return None

    def _bf_params(self) -> Iterator[torch.Tensor]:
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    yield p

    def synchronize(self) -> None:
        """Wait for the averaging in flight and put the averages into the parameters."""
        handles, self._bf_handles = self._bf_handles, {}
        with torch.no_grad():
            for p, h in handles.items():
                if h is not None:
                    p.copy_(synchronize(h))

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """``step()`` inside this block does not :meth:`synchronize` (after one's own call)."""
        self._bf_should_sync = False
        try:
            yield
        finally:
            self._bf_should_sync = True

    def turn_on_timeline(self) -> None:
        """Record each model's forward passes as activities on this rank's timeline
        (``TOTALREDUCE_TIMELINE`` or ``start_timeline``), named by the communication type."""
        if self._bf_timeline:
            return
        activity = self._bf_type.value
        for i, m in enumerate(self._bf_models):
            name = f"model{i}.forward"
            self._bf_timeline.append(
                m.register_forward_pre_hook(
                    lambda *_, n=name: timeline_start_activity(n, f"forward, {activity}")
                )
            )
            self._bf_timeline.append(
                m.register_forward_hook(lambda *_, n=name: timeline_end_activity(n))
            )

    def turn_off_timeline(self) -> None:
        """Stop recording the forward passes (see :meth:`turn_on_timeline`)."""
        for h in self._bf_timeline:
            h.remove()
        self._bf_timeline = []

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The wrapped ``zero_grad``; refused while gradients are being averaged (as BlueFog)."""
        if self._bf_handles and isinstance(self, _GradientAllreduce):
            raise AssertionError(
                "optimizer.zero_grad() was called after loss.backward() but before "
                "optimizer.step() or optimizer.synchronize(); the gradients are being averaged"
            )
        super().zero_grad(set_to_none=set_to_none)


class _AdaptWithCombine(_Averaging):
    """BlueFog's consensus-style optimizers (see the module docstring)."""

    _bf_every: int
    _bf_forwards: int
    _bf_hooks: list[Any]
    _bf_warned: bool

    def _bf_start(self, every: int) -> None:
        self._bf_every = every
        self._bf_forwards = 0
        self._bf_warned = False
        self._bf_hooks = [m.register_forward_hook(self._bf_forward) for m in self._bf_models]

    def _bf_forward(self, module: torch.nn.Module, *_: Any) -> None:
        if not module.training:
            return
        if self._bf_handles:
            if not self._bf_warned:
                warnings.warn(
                    "the model ran forward again before optimizer.step(): its parameters "
                    "are already being averaged, so this pass starts nothing",
                    stacklevel=2,
                )
                self._bf_warned = True
            return
        self._bf_forwards += 1
        if self._bf_forwards % self._bf_every:
            return
        for p in self._bf_params():
            self._bf_handles[p] = self._bf_average_async(p)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Put the averages of the last forward's parameters in place, then step."""
        if self._bf_should_sync:
            self.synchronize()
        return super().step(closure)


class _AdaptThenCombine(_Averaging):
    """BlueFog's adapt-then-combine optimizer (see the module docstring)."""

    _bf_every: int
    _bf_steps: int
    _bf_step_function: Callable[..., None] | None

    def _bf_start(self, every: int) -> None:
        self._bf_every = every
        self._bf_steps = 0
        self._bf_step_function = None

    def register_step_function(self, step_func: Callable[..., None]) -> None:
        """Step with ``step_func(optimizer, parameter, gradient, parameter_group)`` per
        parameter instead of the wrapped optimizer's ``step`` (BlueFog's hook for
        optimizers it does not know; every optimizer works here without one)."""
        if not callable(step_func):
            raise InvalidArgumentError(f"register_step_function takes a callable: {step_func!r}")
        self._bf_step_function = step_func

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Step (adapt), then average the new parameters (combine) every k-th step."""
        if self._bf_step_function is None:
            loss = super().step(closure)
        else:
            loss = closure() if closure is not None else None
            with torch.no_grad():
                for group in self.param_groups:
                    for p in group["params"]:
                        if p.grad is not None:
                            self._bf_step_function(self, p, p.grad.data, group)
        self._bf_steps += 1
        if self._bf_steps % self._bf_every == 0:
            for p in self._bf_params():
                self._bf_handles[p] = self._bf_average_async(p)
            if self._bf_should_sync:
                self.synchronize()
        return loss


class _GradientAllreduce(_Averaging):
    """BlueFog's gradient-averaging optimizer (see the module docstring)."""

    _bf_every: int
    _bf_passes: dict[torch.Tensor, int]
    _bf_hooks: list[Any]

    def _bf_start(self, every: int) -> None:
        self._bf_every = every
        self._bf_passes = {}
        self._bf_hooks = []
        for p in self._bf_params():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            self._bf_passes[p] = 0
            self._bf_hooks.append(p.register_post_accumulate_grad_hook(self._bf_grad_ready))

    def _bf_average_grad_async(self, p: torch.Tensor) -> Any:
        assert p.grad is not None
        return allreduce_nonblocking(p.grad, name=f"gradient.{self._bf_names[p]}", average=True)

    def _bf_grad_ready(self, p: torch.Tensor) -> None:
        self._bf_passes[p] += 1
        if self._bf_passes[p] == self._bf_every and p not in self._bf_handles:
            self._bf_handles[p] = self._bf_average_grad_async(p)

    def synchronize(self) -> None:
        """Average every gradient (those not started yet now) and put the averages in place."""
        for p in self._bf_params():
            if p not in self._bf_handles:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                self._bf_handles[p] = self._bf_average_grad_async(p)
        handles, self._bf_handles = self._bf_handles, {}
        with torch.no_grad():
            for p, h in handles.items():
                assert p.grad is not None
                p.grad.copy_(synchronize(h))
                self._bf_passes[p] = 0

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Wait for the averaged gradients, then take the wrapped step."""
        if self._bf_should_sync:
            self.synchronize()
        return super().step(closure)


# ---------------------------------------------------------------- BlueFog's factories


def _awc(optimizer: Any, model: Any, kind: Any, every: Any, who: str) -> Any:
    wrapped = _wrap(optimizer, _AdaptWithCombine, who)
    wrapped._bf_setup(model, kind, who)
    wrapped._bf_start(_every(every, "num_steps_per_communication"))
    return wrapped


def DistributedAdaptWithCombineOptimizer(  # noqa: N802 (BlueFog's name)
    optimizer: torch.optim.Optimizer,
    model: Any,
    communication_type: CommunicationType = CommunicationType.neighbor_allreduce,
    num_steps_per_communication: int = 1,
) -> torch.optim.Optimizer:
    """``w <- avg(w) - lr * grad(w)``: each forward pass starts averaging the parameters,
    ``step()`` puts the averages in place and steps (see the module docstring)."""
    return _awc(optimizer, model, communication_type, num_steps_per_communication,
                "DistributedAdaptWithCombineOptimizer")  # fmt: skip


def DistributedNeighborAllreduceOptimizer(  # noqa: N802
    optimizer: torch.optim.Optimizer, model: Any, num_steps_per_communication: int = 1
) -> torch.optim.Optimizer:
    """:func:`DistributedAdaptWithCombineOptimizer` averaging over the topology."""
    return _awc(optimizer, model, CommunicationType.neighbor_allreduce,
                num_steps_per_communication, "DistributedNeighborAllreduceOptimizer")  # fmt: skip


def DistributedHierarchicalNeighborAllreduceOptimizer(  # noqa: N802
    optimizer: torch.optim.Optimizer, model: Any, num_steps_per_communication: int = 1
) -> torch.optim.Optimizer:
    """:func:`DistributedAdaptWithCombineOptimizer` averaging inside each machine, then over
    the machine topology (``set_machine_topology``)."""
    return _awc(optimizer, model, CommunicationType.hierarchical_neighbor_allreduce,
                num_steps_per_communication,
                "DistributedHierarchicalNeighborAllreduceOptimizer")  # fmt: skip


def DistributedAllreduceOptimizer(  # noqa: N802
    optimizer: torch.optim.Optimizer, model: Any, num_steps_per_communication: int = 1
) -> torch.optim.Optimizer:
    """:func:`DistributedAdaptWithCombineOptimizer` averaging over all ranks."""
    return _awc(optimizer, model, CommunicationType.allreduce, num_steps_per_communication,
                "DistributedAllreduceOptimizer")  # fmt: skip


def DistributedAdaptThenCombineOptimizer(  # noqa: N802
    optimizer: torch.optim.Optimizer,
    model: Any,
    communication_type: CommunicationType = CommunicationType.neighbor_allreduce,
    num_steps_per_communication: int = 1,
) -> torch.optim.Optimizer:
    """``w <- avg(w - lr * grad(w))``: ``step()`` steps, then averages the new parameters
    (every ``num_steps_per_communication``-th step; see the module docstring)."""
    who = "DistributedAdaptThenCombineOptimizer"
    wrapped = _wrap(optimizer, _AdaptThenCombine, who)
    wrapped._bf_setup(model, communication_type, who)
    wrapped._bf_start(_every(num_steps_per_communication, "num_steps_per_communication"))
    return wrapped  # type: ignore[no-any-return]


def DistributedGradientAllreduceOptimizer(  # noqa: N802
    optimizer: torch.optim.Optimizer, model: Any, num_steps_per_communication: int = 1
) -> torch.optim.Optimizer:
    """Average each gradient over all ranks as the backward pass produces it (every
    ``num_steps_per_communication``-th backward pass: the gradients accumulate between);
    ``step()`` waits for them and steps."""
    who = "DistributedGradientAllreduceOptimizer"
    wrapped = _wrap(optimizer, _GradientAllreduce, who)
    wrapped._bf_setup(model, CommunicationType.allreduce, who)
    wrapped._bf_start(_every(num_steps_per_communication, "num_steps_per_communication"))
    return wrapped  # type: ignore[no-any-return]

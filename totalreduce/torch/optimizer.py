"""DistributedOptimizer: Horovod's optimizer wrapper, fed by post-accumulate-grad hooks.

This module owns the life of one step's gradients: a hook on every parameter
that requires a gradient submits it, in place and named by the parameter, the
moment autograd has accumulated it; ``step()`` waits for those averages (and
submits what never came), then runs the wrapped optimizer.

Rules a user can rely on:

- **Names.** A gradient is named ``prefix + parameter name`` (from
  ``named_parameters``, else ``prefix + "group{g}.{i}"``); the k-th step of a
  name on one rank meets the k-th on every other rank, whatever the order in
  which backward produced the gradients.
- **Unused parameters.** A parameter whose gradient this rank did not produce
  by ``step()`` is submitted then, with its current gradient or zeros if it has
  none, so the ranks that did use it never wait forever.  Its gradient after
  ``step()`` is then the average over all ranks in which unused ranks count
  zeros (Horovod's behaviour); a parameter unused everywhere gets a zero
  gradient, not None.
- **Priority.** By default parameters listed earlier (nearer the input in a
  module's registration order) get a higher priority: the next forward pass
  needs them first.  ``priority=`` takes an int, a mapping from name to int, or
  a callable ``(name, parameter) -> int``.
- **Accumulation.** With ``backward_passes_per_step=k`` gradients are summed
  locally over ``k`` backward passes and submitted on the k-th; ``step()`` after
  fewer passes submits what it has.  Scale the loss by ``1/k`` for a mean.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from ..errors import InvalidArgumentError, TotalReduceError
from ..service.service import Service
from .collectives import allreduce_async_, resolve_service
from .tensors import TensorHandle

PriorityRule = int | Mapping[str, int] | Callable[[str, torch.Tensor], int] | None


class GradientSyncError(TotalReduceError):
    """A :func:`DistributedOptimizer` was driven out of order.

    For example ``zero_grad()`` while gradients were still being averaged, or
    more backward passes than ``backward_passes_per_step`` before ``step()``.
    """


def DistributedOptimizer(  # noqa: N802 - Horovod's name, a factory that returns an optimizer
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
    op: str = "avg",
    priority: PriorityRule = None,
    backward_passes_per_step: int = 1,
    prefix: str = "grad.",
    *,
    service: Service | None = None,
) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so its gradients are averaged across ranks as backward makes them.

    Returns an instance of a subclass of ``type(optimizer)`` sharing the
    optimizer's state and parameter groups (so learning-rate schedulers,
    ``state_dict()`` and ``isinstance`` keep working); use it instead of
    ``optimizer``.  See the module docstring for names, unused parameters,
    priorities and accumulation.  Extra methods: ``synchronize()`` (wait for
    the averaged gradients without stepping, e.g. to clip them),
    ``skip_synchronize()``, ``remove_hooks()``.

    >>> opt = trt.DistributedOptimizer(                     # doctest: +SKIP
    ...     torch.optim.SGD(model.parameters(), lr=0.1),
    ...     named_parameters=model.named_parameters())
    >>> loss.backward()       # each gradient leaves when ready    # doctest: +SKIP
    >>> opt.step()            # waits for the averages, then steps  # doctest: +SKIP
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise InvalidArgumentError(
            f"DistributedOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    if isinstance(optimizer, _DistributedOptimizer):
        raise InvalidArgumentError("this optimizer is already a DistributedOptimizer")
    if (
        isinstance(backward_passes_per_step, bool)
        or not isinstance(backward_passes_per_step, int)
        or backward_passes_per_step < 1
    ):
        raise InvalidArgumentError(
            f"backward_passes_per_step must be an int >= 1, got {backward_passes_per_step!r}"
        )
    base = type(optimizer)
    cls = type(base.__name__, (_DistributedOptimizer, base), {"__module__": base.__module__})
    wrapped = cls.__new__(cls)
    # Share, not copy: the wrapper and the original see one state and one set of groups.
    wrapped.__dict__.update(optimizer.__dict__)
    wrapped._tr_setup(
        named_parameters, op, priority, backward_passes_per_step, prefix, resolve_service(service)
    )
    return wrapped


class _DistributedOptimizer(torch.optim.Optimizer):
    """The behaviour :func:`DistributedOptimizer` mixes into the wrapped optimizer's class."""

    # Everything lives under _tr_ names so it cannot collide with an optimizer's own.
    _tr_service: Service
    _tr_op: str
    _tr_passes: int
    _tr_prefix: str
    _tr_rule: PriorityRule
    _tr_names: dict[torch.Tensor, str]
    _tr_priority: dict[torch.Tensor, int]
    _tr_order: list[torch.Tensor]
    _tr_required: list[torch.Tensor]
    _tr_pending: dict[torch.Tensor, TensorHandle]
    _tr_delay: dict[torch.Tensor, int]
    _tr_hooks: list[Any]
    _tr_lock: threading.Lock
    _tr_synchronized: bool
    _tr_should_sync: bool

    def _tr_setup(
        self,
        named_parameters: Iterable[tuple[str, torch.Tensor]] | None,
        op: str,
        priority: PriorityRule,
        passes: int,
        prefix: str,
        service: Service,
    ) -> None:
        self._tr_service = service
        self._tr_op = op
        self._tr_passes = passes
        self._tr_prefix = prefix
        self._tr_rule = priority
        self._tr_names = {}
        self._tr_priority = {}
        self._tr_order = []
        self._tr_required = []
        self._tr_pending = {}
        self._tr_delay = {}
        self._tr_hooks = []
        self._tr_lock = threading.Lock()
        self._tr_synchronized = False
        self._tr_should_sync = True

        in_groups = [p for g in self.param_groups for p in g["params"]]
        if named_parameters is None:
            named = [
                (f"group{gi}.{pi}", p)
                for gi, g in enumerate(self.param_groups)
                for pi, p in enumerate(g["params"])
            ]
        else:
            named = _check_names(named_parameters, in_groups)
        known = set(in_groups)
        ordered = [(n, p) for n, p in named if p in known]
        self._tr_register(ordered)

    def _tr_register(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Name, rank by priority and hook the parameters of ``named`` (in their order)."""
        start = len(self._tr_order)
        total = start + len(named)
        for i, (name, p) in enumerate(named):
            if p in self._tr_names:
                continue
            full = self._tr_prefix + name
            self._tr_names[p] = full
            self._tr_order.append(p)
            self._tr_priority[p] = priority_of(self._tr_rule, name, p, total - (start + i))
            if p.requires_grad:
                self._tr_required.append(p)
                self._tr_delay[p] = self._tr_passes
                self._tr_hooks.append(p.register_post_accumulate_grad_hook(self._tr_hook))
        # Waiting (and submitting stragglers) goes from the most to the least urgent.
        self._tr_required.sort(key=lambda q: -self._tr_priority[q])

    def _tr_hook(self, p: torch.Tensor) -> None:
        with self._tr_lock:
            if p in self._tr_pending:
                raise GradientSyncError(
                    f"the gradient of {self._tr_names[p]!r} was produced more than "
                    f"backward_passes_per_step={self._tr_passes} times before step(); call "
                    "step() or synchronize() after each backward pass, or raise "
                    "backward_passes_per_step"
                )
            self._tr_synchronized = False
            self._tr_delay[p] -= 1
            if self._tr_delay[p] > 0:
                return
            self._tr_pending[p] = self._tr_submit(p)

    def _tr_submit(self, p: torch.Tensor) -> TensorHandle:
        grad = p.grad
        if grad is None:
            # Unused here: contribute zeros so the ranks that used it do not wait.
            grad = p.grad = torch.zeros_like(p)
        return allreduce_async_(
            grad,
            self._tr_names[p],
            self._tr_op,
            self._tr_priority[p],
            service=self._tr_service,
        )

    def synchronize(self) -> None:
        """Wait until every gradient is averaged (submitting those backward did not make).

        Call it before ``step()`` to look at or clip the averaged gradients;
        ``step()`` then does not average them again.
        """
        with self._tr_lock:
            for p in self._tr_required:
                if p not in self._tr_pending:
                    self._tr_pending[p] = self._tr_submit(p)
            pending = [(p, self._tr_pending[p]) for p in self._tr_required]
        try:
            for _p, h in pending:
                h.wait()
        finally:
            with self._tr_lock:
                self._tr_pending.clear()
                for p in self._tr_required:
                    self._tr_delay[p] = self._tr_passes
                self._tr_synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Within this block ``step()`` does not synchronize (Horovod's name).

        >>> opt.synchronize()                                      # doctest: +SKIP
        >>> torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # doctest: +SKIP
        >>> with opt.skip_synchronize():                           # doctest: +SKIP
        ...     opt.step()
        """
        self._tr_should_sync = False
        try:
            yield
        finally:
            self._tr_should_sync = True

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Wait for the averaged gradients (unless already synchronized), then step."""
        if self._tr_should_sync and not self._tr_synchronized:
            self.synchronize()
        self._tr_synchronized = False
        return super().step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients; refused while some are still being averaged."""
        with self._tr_lock:
            if self._tr_pending:
                names = sorted(self._tr_names[p] for p in self._tr_pending)
                shown = ", ".join(names[:4]) + (" ..." if len(names) > 4 else "")
                raise GradientSyncError(
                    f"zero_grad() was called while {len(names)} gradients ({shown}) are being "
                    "averaged: call step() or synchronize() after backward, before zero_grad()"
                )
            for p in self._tr_required:
                self._tr_delay[p] = self._tr_passes
        super().zero_grad(set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group; its parameters are named ``group{g}.{i}`` and hooked."""
        super().add_param_group(param_group)
        if not hasattr(self, "_tr_names"):
            return
        gi = len(self.param_groups) - 1
        self._tr_register(
            [(f"group{gi}.{i}", p) for i, p in enumerate(self.param_groups[-1]["params"])]
        )

    def remove_hooks(self) -> None:
        """Remove the gradient hooks: later backward passes no longer submit anything."""
        for h in self._tr_hooks:
            h.remove()
        self._tr_hooks.clear()

    def gradient_names(self) -> dict[str, int]:
        """Every averaged gradient's op name and its priority, most urgent first."""
        return {self._tr_names[p]: self._tr_priority[p] for p in self._tr_required}


def _check_names(
    named_parameters: Iterable[tuple[str, torch.Tensor]], in_groups: list[torch.Tensor]
) -> list[tuple[str, torch.Tensor]]:
    try:
        named = [(n, p) for n, p in named_parameters]
    except (TypeError, ValueError):
        raise InvalidArgumentError(
            "named_parameters must be pairs (name, parameter), e.g. model.named_parameters()"
        ) from None
    seen: set[str] = set()
    for n, p in named:
        if not isinstance(n, str) or not isinstance(p, torch.Tensor):
            raise InvalidArgumentError(
                f"named_parameters must be pairs (str, tensor), got ({n!r}, {type(p).__name__})"
            )
        if n in seen:
            raise InvalidArgumentError(f"parameter name {n!r} appears twice in named_parameters")
        seen.add(n)
    named_set = {p for _, p in named}
    missing = [i for i, p in enumerate(in_groups) if p not in named_set]
    if missing:
        raise InvalidArgumentError(
            f"{len(missing)} parameters of the optimizer (positions {missing[:8]} in its "
            "param_groups) are not in named_parameters; pass model.named_parameters() of the "
            "model the optimizer trains"
        )
    return named


def priority_of(rule: PriorityRule, name: str, p: torch.Tensor, default: int) -> int:
    """The priority ``rule`` gives parameter ``name`` (``default`` when the rule is None)."""
    if rule is None:
        value: Any = default
    elif callable(rule):
        value = rule(name, p)
    elif isinstance(rule, Mapping):
        value = rule.get(name, 0)
    else:
        value = rule
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentError(
            f"the priority of parameter {name!r} must be an int, got {value!r}"
        )
    return value

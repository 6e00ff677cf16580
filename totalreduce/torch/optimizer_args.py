"""DistributedOptimizer's arguments: Horovod's order, the options' checks, parameter names.

:func:`read_arguments` is what :func:`~.optimizer.DistributedOptimizer` does with its
arguments before it wraps anything: Horovod's positional order (a compression third),
Horovod's names for the ops, and the check of every option, in that order.
:func:`_check_names` checks ``named_parameters`` against the optimizer's parameters, and
:func:`priority_of` reads a ``priority=`` rule (:mod:`.decentralized` takes the same rules).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

import torch

from ..errors import InvalidArgumentError
from .compression import Compressor

PriorityRule = int | Mapping[str, int] | Callable[[str, torch.Tensor], int] | None


class Arguments(NamedTuple):
    """The arguments :func:`read_arguments` read, in the keyword order."""

    op: Any
    priority: Any
    backward_passes_per_step: Any
    prefix: Any
    compression: type[Compressor]
    sparse_as_dense: Any


def read_arguments(
    optimizer: Any,
    wrapper: type,
    op: Any,
    priority: Any,
    backward_passes_per_step: Any,
    prefix: Any,
    args: tuple[Any, ...],
    *,
    fusion_bytes: Any,
    compression: Any,
    gradient_predivide_factor: Any,
    num_groups: Any,
    groups: Any,
    sparse_as_dense: Any,
) -> Arguments:
    """The arguments of ``DistributedOptimizer(optimizer, op, priority,
    backward_passes_per_step, prefix, *args, ...)`` in the keyword order, checked
    (Horovod's positional order when a compression comes third); ``wrapper``: the
    class of an optimizer that is already wrapped (refused)."""
    if isinstance(op, type) and issubclass(op, Compressor):
        # Horovod's positional order: (optimizer, named_parameters, compression,
        # backward_passes_per_step, op, gradient_predivide_factor, num_groups, groups,
        # sparse_as_dense).
        given = [op, priority, backward_passes_per_step, prefix, *args]
        names = ["compression", "backward_passes_per_step", "op", "gradient_predivide_factor",
                 "num_groups", "groups", "sparse_as_dense"]  # fmt: skip
        if len(given) > len(names):
            raise InvalidArgumentError(f"DistributedOptimizer takes at most {len(names) + 2} "
                                       "positional arguments in Horovod's order")  # fmt: skip
        values = dict(zip(names, given, strict=False))
        compression = values.get("compression", compression)
        backward_passes_per_step = values.get("backward_passes_per_step", 1)
        op = values.get("op", "avg")
        gradient_predivide_factor = values.get(
            "gradient_predivide_factor", gradient_predivide_factor
        )
        num_groups = values.get("num_groups", num_groups)
        groups = values.get("groups", groups)
        sparse_as_dense = values.get("sparse_as_dense", sparse_as_dense)
        priority, prefix = None, "grad."
    elif args:
        raise InvalidArgumentError(
            "DistributedOptimizer takes (optimizer, named_parameters, op, priority, "
            "backward_passes_per_step, prefix) positionally, or Horovod's order with a "
            "compression third"
        )
    op = {"Average": "avg", "Sum": "sum", "Adasum": "adasum"}.get(getattr(op, "__name__", op), op)
    if not isinstance(gradient_predivide_factor, (int, float)) or gradient_predivide_factor <= 0:
        raise InvalidArgumentError(
            f"gradient_predivide_factor must be a number > 0, got {gradient_predivide_factor!r}"
        )
    if gradient_predivide_factor != 1.0 and op != "avg":
        raise InvalidArgumentError(
            f"gradient_predivide_factor only applies to op=Average (as in Horovod); got op={op!r}"
        )
    if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups < 0:
        raise InvalidArgumentError(f"num_groups must be an int >= 0, got {num_groups!r}")
    if groups is not None and not (isinstance(groups, int) or isinstance(groups, (list, tuple))):
        raise InvalidArgumentError(
            f"groups must be an int or a list of lists of parameters, got {groups!r}"
        )
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise InvalidArgumentError(
            f"DistributedOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    if isinstance(optimizer, wrapper):
        raise InvalidArgumentError("this optimizer is already a DistributedOptimizer")
    if (
        isinstance(backward_passes_per_step, bool)
        or not isinstance(backward_passes_per_step, int)
        or backward_passes_per_step < 1
    ):
        raise InvalidArgumentError(
            f"backward_passes_per_step must be an int >= 1, got {backward_passes_per_step!r}"
        )
    if isinstance(fusion_bytes, bool) or not isinstance(fusion_bytes, int) or fusion_bytes < 0:
        raise InvalidArgumentError(
            f"fusion_bytes must be an int >= 0 (0 turns fusion off), got {fusion_bytes!r}"
        )
    if not (isinstance(compression, type) and issubclass(compression, Compressor)):
        raise InvalidArgumentError(
            f"compression must be Compression.none or Compression.fp16, got {compression!r}"
        )
    return Arguments(op, priority, backward_passes_per_step, prefix, compression, sparse_as_dense)


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

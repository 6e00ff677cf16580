"""DecentralizedDataParallel: after every local step, average parameters with the step's neighbors.

This module owns decentralized data parallelism in the manner of Decent-DP:
no gradient is reduced; each rank steps on its own gradient, then replaces its
parameters by the weighted mean over its neighbors of the step's topology,
``x_i <- sum_j W(t)[i, j] x_j`` (see :mod:`totalreduce.topology`).

How the averaging overlaps computation: ``optimizer.step()`` (through a step
post-hook) starts one ``neighbor_allreduce`` per parameter and returns; each
submodule waits only for its own parameters, in a forward pre-hook, right
before it runs in the next forward pass.  Parameters nearer the input get the
higher priority by default, since the forward pass needs them first.  The
averaged values are written back when they are waited for, so between two
steps a parameter holds either its pre-averaging or its averaged value, never a
mix.  :meth:`DecentralizedDataParallel.global_average` makes every rank hold
the exact mean of all ranks (for evaluation or a checkpoint).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..errors import InvalidArgumentError
from ..service.handle import ServiceLike
from ..topology import MixingTopology, get_topology, topology_options
from .broadcast_state import broadcast_parameters
from .collectives import allreduce_async_, resolve_service
from .optimizer_args import priority_of
from .tensors import array_to_tensor, host_buffer


def detect_local_size(service: ServiceLike) -> int:
    """The number of ranks on this rank's node: the transport's node layout.

    Over MPI that is the shared-memory split the transport made once at its
    start; ranks that share one process (the local transport) are one node.
    """
    return service.node_layout()[1]


def resolve_topology(
    topology: str | MixingTopology, service: ServiceLike, local_size: int | None
) -> MixingTopology:
    """The topology object for a name (filling in ``local_size`` where it takes one)."""
    try:
        if isinstance(topology, MixingTopology):
            return get_topology(topology, service.size)
        options: dict[str, Any] = {}
        if "local_size" in topology_options(topology):
            options["local_size"] = (
                local_size if local_size is not None else (detect_local_size(service))
            )
        return get_topology(topology, service.size, **options)
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"DecentralizedDataParallel: {exc}") from None


class DecentralizedDataParallel(torch.nn.Module):
    """Wrap ``module`` so that every ``optimizer.step()`` is followed by neighbor averaging.

    ``topology`` is a name (``alternating-exp-ring``, ``ring``, ``exp``,
    ``complete`` or a BlueFog graph) or a :mod:`totalreduce.topology` object;
    ``alternating-exp-ring`` needs ``local_size`` (ranks per node), detected from
    the launcher when not given.  With ``sync_initial`` (default) rank 0's
    parameters and buffers are broadcast first, as DDP does.  ``priority`` works as
    in :func:`~totalreduce.torch.DistributedOptimizer` (default: input side first).

    Use the wrapper like the module, and the optimizer as usual::

        model = trt.DecentralizedDataParallel(net, opt, topology="ring")
        for x, y in batches:
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()               # steps locally, then starts the averaging
        model.global_average()       # every rank: the mean of all ranks' parameters

    Only floating-point parameters that require a gradient are averaged.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        topology: str | MixingTopology = "alternating-exp-ring",
        local_size: int | None = None,
        *,
        service: ServiceLike | None = None,
        prefix: str = "decentralized.",
        priority: Any = None,
        sync_initial: bool = True,
    ) -> None:
        super().__init__()
        if not isinstance(module, torch.nn.Module):
            raise InvalidArgumentError(f"module must be a torch.nn.Module, got {module!r}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise InvalidArgumentError(
                f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        self.module = module
        svc = resolve_service(service)
        # Plain attributes (not submodules or buffers), kept out of state_dict().
        self.__dict__["optimizer"] = optimizer
        self.__dict__["service"] = svc
        self.__dict__["topology"] = resolve_topology(topology, svc, local_size)
        self._prefix = prefix
        self._step = 0
        named = [
            (n, p)
            for n, p in module.named_parameters()
            if p.requires_grad and p.is_floating_point()
        ]
        self._names: dict[torch.Tensor, str] = {p: n for n, p in named}
        self._priority = {
            p: priority_of(priority, n, p, len(named) - i) for i, (n, p) in enumerate(named)
        }
        self._order = sorted(self._names, key=lambda q: -self._priority[q])
        self._received: dict[torch.Tensor, np.ndarray] = {}
        self._pending: dict[torch.Tensor, Any] = {}
        if sync_initial:
            broadcast_parameters(
                module.state_dict(), root=0, prefix=f"{prefix}initial.", service=svc
            )
        self._hooks: list[Any] = [
            optimizer.register_step_pre_hook(lambda *_: self.synchronize()),
            optimizer.register_step_post_hook(lambda *_: self._start()),
        ]
        for m in module.modules():
            own = [p for p in m.parameters(recurse=False) if p in self._names]
            if own:
                self._hooks.append(m.register_forward_pre_hook(self._waiter(own)))

    # ------------------------------------------------------------------ averaging

    def _start(self) -> None:
        """Start this step's neighbor averaging of every parameter (most urgent first)."""
        svc: ServiceLike = self.service
        step = self._step
        self._step += 1
        for p in self._order:
            buf = host_buffer(p.detach())
            out = self._received.get(p)
            if out is None or out.shape != buf.array.shape or out.dtype != buf.array.dtype:
                out = self._received[p] = np.empty_like(buf.array)
            handle = svc.neighbor_allreduce_async(
                buf.array,
                self._prefix + self._names[p],
                topology=self.topology,
                step=step,
                out=out,
                priority=self._priority[p],
                **buf.engine_kwargs,
            )
            self._pending[p] = (handle, buf.engine_dtype)

    def _finish(self, p: torch.Tensor) -> None:
        entry = self._pending.pop(p, None)
        if entry is None:
            return
        handle, engine_dtype = entry
        mixed = handle.wait()
        with torch.no_grad():
            p.copy_(array_to_tensor(mixed, engine_dtype, p.dtype, p.device).view(p.shape))

    def _waiter(self, params: list[torch.Tensor]) -> Callable[..., None]:
        def wait_for_own(_module: torch.nn.Module, _inputs: Any) -> None:
            if self._pending:
                for p in params:
                    self._finish(p)

        return wait_for_own

    def synchronize(self) -> None:
        """Wait for every parameter's averaging in flight and write the results back."""
        for p in self._order:
            self._finish(p)

    @property
    def step_count(self) -> int:
        """How many averaging steps have started (the next one uses ``W(step_count)``)."""
        return self._step

    def global_average(self, buffers: bool = True) -> None:
        """Make every rank hold the mean over all ranks of each parameter (blocking).

        With ``buffers`` (default) floating-point buffers such as BatchNorm's
        running statistics are averaged too.  Call it on every rank, e.g. before
        evaluating or saving.
        """
        self.synchronize()
        tensors = [(n, p) for p, n in self._names.items()]
        if buffers:
            tensors += [(n, b) for n, b in self.module.named_buffers() if b.is_floating_point()]
        handles = [
            allreduce_async_(t.data, f"{self._prefix}global.{n}", "avg", service=self.service)
            for n, t in tensors
        ]
        for h in handles:
            h.wait()

    def remove_hooks(self) -> None:
        """Detach from the optimizer and the module (after a final :meth:`synchronize`)."""
        self.synchronize()
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    # ------------------------------------------------------------------ module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped module (each submodule first waits for its own parameters)."""
        return self.module(*args, **kwargs)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """``optimizer.step(closure)``: a local step followed by the start of the averaging."""
        return self.optimizer.step(closure)

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

Decent-DP's own form, which builds its optimizers and steps inside the backward
pass, is :mod:`totalreduce.torch.decent_dp`; both forms run their averages
through :class:`NeighborAverager` and :func:`average_globally` of this module.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import InvalidArgumentError
from ..service.handle import ServiceLike
from ..topology import Edge, MixingTopology, Topology, get_topology, topology_options
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


@dataclass
class _InFlight:
    """One tensor's neighbor average: its handle, the step it mixes with, its result."""

    handle: Any
    engine_dtype: str | None
    step: int
    mixed: torch.Tensor | None = None


class NeighborAverager:
    """Neighbor averages of tensors over one topology, in flight until their owner applies them.

    The engine side that both forms of DecentralizedDataParallel share.  :meth:`start`
    submits ``sum_j W(step)[i, j] x_j`` of a tensor's current values (without a copy for
    a contiguous CPU tensor, so the caller leaves the tensor alone until the average is
    collected); :meth:`finish` waits and writes the result into a tensor, optionally only
    a share of it; :meth:`collect` waits without applying, so the result can be applied
    later.  Each average is filed under a key of the caller's choosing and named
    ``prefix + name`` on the engine.
    """

    def __init__(self, service: ServiceLike, topology: MixingTopology, prefix: str) -> None:
        self.service = service
        self.topology = topology
        self.prefix = prefix
        self._received: dict[Hashable, np.ndarray] = {}
        self._pending: dict[Hashable, _InFlight] = {}

    def start(
        self, key: Hashable, tensor: torch.Tensor, name: str, step: int, priority: int = 0
    ) -> None:
        """Submit the average of ``tensor`` at ``step`` under ``key`` (one per key at a time)."""
        if key in self._pending:
            raise InvalidArgumentError(
                f"{self.prefix}{name}: an average of step {self._pending[key].step} is still "
                f"pending; it must be finished before step {step} starts"
            )
        buf = host_buffer(tensor.detach())
        out = self._received.get(key)
        if out is None or out.shape != buf.array.shape or out.dtype != buf.array.dtype:
            out = self._received[key] = np.empty_like(buf.array)
        handle = self.service.neighbor_allreduce_async(
            buf.array,
            self.prefix + name,
            topology=self.topology,
            step=step,
            out=out,
            priority=priority,
            **buf.engine_kwargs,
        )
        self._pending[key] = _InFlight(handle, buf.engine_dtype, step)

    def __len__(self) -> int:
        """How many averages are pending."""
        return len(self._pending)

    def pending(self, key: Hashable) -> bool:
        """Whether ``key`` has an average that was not finished (collected or not)."""
        return key in self._pending

    def step_of(self, key: Hashable) -> int:
        """The step ``key``'s pending average mixes with."""
        return self._pending[key].step

    def edge_of(self, key: Hashable) -> Edge | None:
        """This rank's edge in ``key``'s pending average (None for a graph topology)."""
        if not isinstance(self.topology, Topology):
            return None
        return self.topology.edge_of(self.service.rank, self._pending[key].step)

    def collect(self, key: Hashable, like: torch.Tensor) -> torch.Tensor:
        """Wait for ``key``'s average; its values as a tensor of ``like``'s dtype and device
        (kept pending: :meth:`finish` applies it later)."""
        entry = self._pending[key]
        if entry.mixed is None:
            mixed = entry.handle.wait()
            entry.mixed = array_to_tensor(mixed, entry.engine_dtype, like.dtype, like.device)
        return entry.mixed.view(like.shape)

    def finish(self, key: Hashable, tensor: torch.Tensor, share: float = 1.0) -> bool:
        """Wait for ``key``'s average and write it into ``tensor``: ``tensor <- (1 - share)
        tensor + share mixed``.  False when nothing is pending under ``key``."""
        if key not in self._pending:
            return False
        mixed = self.collect(key, tensor)
        del self._pending[key]
        with torch.no_grad():
            if share == 1.0:
                tensor.copy_(mixed)
            else:
                tensor.mul_(1.0 - share).add_(mixed, alpha=share)
        return True

    def collect_all(self, likes: Iterable[tuple[Hashable, torch.Tensor]]) -> None:
        """:meth:`collect` every pending key among ``likes``' (key, tensor) pairs."""
        for key, like in likes:
            if key in self._pending:
                self.collect(key, like)

    def drop(self, key: Hashable) -> None:
        """Wait for ``key``'s average (the engine still reads the tensor) and forget it."""
        entry = self._pending.pop(key, None)
        if entry is not None and entry.mixed is None:
            entry.handle.wait()


def average_globally(
    tensors: Iterable[tuple[str, torch.Tensor]], prefix: str, service: ServiceLike
) -> None:
    """Replace each named tensor by its mean over all ranks, in place (all in flight at once)."""
    handles = [
        allreduce_async_(t.data, f"{prefix}global.{n}", "avg", service=service) for n, t in tensors
    ]
    for h in handles:
        h.wait()


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
            hint = (
                "; this form takes an optimizer: Decent-DP's form, which builds its "
                "optimizers from a function (optim_fn), is "
                "totalreduce.torch.decent_dp.DecentralizedDataParallel"
                if callable(optimizer)
                else ""
            )
            raise InvalidArgumentError(
                f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}" + hint
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
        self._averager = NeighborAverager(svc, self.topology, prefix)
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
        step = self._step
        self._step += 1
        for p in self._order:
            self._averager.start(p, p, self._names[p], step, self._priority[p])

    def _waiter(self, params: list[torch.Tensor]) -> Callable[..., None]:
        def wait_for_own(_module: torch.nn.Module, _inputs: Any) -> None:
            if len(self._averager):
                for p in params:
                    self._averager.finish(p, p)

        return wait_for_own

    def synchronize(self) -> None:
        """Wait for every parameter's averaging in flight and write the results back."""
        for p in self._order:
            self._averager.finish(p, p)

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
        average_globally(tensors, self._prefix, self.service)

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

"""Decent-DP's API, as Decent-DP spells it: a port changes its import lines and nothing else.

One module stands for Decent-DP's three that training scripts import::

    from decent_dp.ddp import DecentralizedDataParallel as DecentDP   # before
    from decent_dp.optim import optim_fn_adamw
    from decent_dp.utils import initialize_dist

    from totalreduce.torch.decent_dp import DecentralizedDataParallel as DecentDP   # after
    from totalreduce.torch.decent_dp import optim_fn_adamw
    from totalreduce.torch.decent_dp import initialize_dist

and the script runs under ``mpiexec -n N python train.py`` instead of ``torchrun``.

- :class:`DecentralizedDataParallel` builds one optimizer (and LR scheduler) per bucket of
  parameters from ``optim_fn`` (and ``lr_scheduler_fn``) and steps them itself, inside the
  backward pass, as Decent-DP does; the neighbor averages run on the totalreduce engine
  (:class:`~totalreduce.torch.decentralized.NeighborAverager`, shared with
  :class:`totalreduce.torch.DecentralizedDataParallel`, the form that takes an optimizer).
- ``optim_fn_adam``, ``optim_fn_adamw``, ``optim_fn_accum_adam``, ``optim_fn_accum_adamw``,
  :class:`AccumAdam`, :class:`AccumAdamW` and ``lr_scheduler_fn_cosine_with_warmup``:
  Decent-DP's optimizer and scheduler helpers, with its defaults.
- :func:`initialize_dist`: torch.distributed on the ``"totalreduce"`` backend.
- Topology names: Decent-DP's ``complete``, ``ring``, ``one-peer-exp`` and
  ``alternating-exp-ring`` (its schedules, see :mod:`totalreduce.topology`), and every
  other name of the registry.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..api import init, is_initialized
from ..errors import InvalidArgumentError
from ..service.handle import ServiceLike
from ..topology import MixingTopology, Topology
from .broadcast_state import allgather_object, broadcast_parameters
from .collectives import resolve_service
from .decentralized import NeighborAverager, average_globally, resolve_topology

OPTIM_FN_TYPE = Callable[[list[tuple[str, torch.Tensor]]], torch.optim.Optimizer]
"""What ``optim_fn`` is: ``(name, parameter)`` pairs of one bucket -> its optimizer."""

LR_SCHEDULER_FN_TYPE = Callable[[torch.optim.Optimizer], Any]
"""What ``lr_scheduler_fn`` is: a bucket's optimizer -> its LR scheduler."""


def _aligned(numel: int) -> int:
    """Decent-DP sizes each parameter rounded up to a multiple of 32 elements."""
    return math.ceil(numel / 32) * 32


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill ``numel`` consecutive places (any dimension order)."""
    expected = 1
    for stride, size in sorted((s, n) for s, n in zip(t.stride(), t.shape, strict=True) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


@dataclass
class _Slab:
    """The parameters of one bucket that share a dtype and a device, as one flat tensor.

    With ``param_as_bucket_view`` the parameters are views of ``flat`` (so the flat tensor
    is what travels, without a copy); without it ``flat`` is a separate buffer that
    :meth:`gather` fills and :meth:`scatter` empties.
    """

    params: list[torch.Tensor]
    flat: torch.Tensor
    as_view: bool
    comm: torch.Tensor | None = None  # Decent-DP's "comm_buffer", for pre_average_hook

    @classmethod
    def build(cls, params: list[torch.Tensor], as_view: bool) -> _Slab:
        first = params[0]
        flat = torch.zeros(sum(p.numel() for p in params), dtype=first.dtype, device=first.device)
        slab = cls(params, flat, as_view)
        if as_view:
            start = 0
            for p in params:
                view = flat.as_strided(p.shape, p.stride(), start)
                view.copy_(p.detach())
                p.data = view
                start += p.numel()
        return slab

    def pieces(self, flat: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Each parameter with its part of ``flat`` (in the parameter's layout)."""
        start = 0
        for p in self.params:
            yield p, flat.as_strided(p.shape, p.stride(), flat.storage_offset() + start)
            start += p.numel()

    def gather(self) -> None:
        if not self.as_view:
            for p, part in self.pieces(self.flat):
                part.copy_(p.detach())

    def scatter(self) -> None:
        if not self.as_view:
            for p, part in self.pieces(self.flat):
                p.detach().copy_(part)

    def attach_comm(self) -> None:
        """Give every parameter a ``comm_buffer`` view, as Decent-DP does for optimizers
        with a ``pre_average_hook``."""
        self.comm = torch.zeros_like(self.flat)
        for p, part in self.pieces(self.comm):
            p.comm_buffer = part  # type: ignore[attr-defined]


@dataclass
class _Bucket:
    names: list[str]
    params: list[torch.Tensor]
    optimizer: Any
    scheduler: Any
    slabs: list[_Slab] = field(default_factory=list)


def _check_optimizer(opt: Any, names: list[str]) -> Any:
    if not (callable(getattr(opt, "step", None)) and callable(getattr(opt, "zero_grad", None))):
        raise InvalidArgumentError(
            f"optim_fn must return an optimizer (with step() and zero_grad()); for the "
            f"bucket of {names[0]!r}..{names[-1]!r} it returned {type(opt).__name__}"
        )
    return opt


class DecentralizedDataParallel(torch.nn.Module):
    """Decent-DP's ``DecentralizedDataParallel``: decentralized training that steps by itself.

    Arguments, in Decent-DP's order: ``model``; ``optim_fn(list of (name, parameter))``
    returning an optimizer; ``lr_scheduler_fn(optimizer)`` returning an LR scheduler, or
    None; ``topology`` (default ``"complete"``; also ``"ring"``, ``"one-peer-exp"``,
    ``"alternating-exp-ring"``, any name of :mod:`totalreduce.topology` or a topology
    object); ``scaler``, a ``torch.amp.GradScaler`` or None; ``grad_clip_norm`` (0: no
    clipping); ``param_as_bucket_view`` (parameters become views of one flat tensor per
    bucket, so a bucket travels without a copy); ``sync_buffer_in_global_avg`` (whether
    :meth:`global_avg` also averages float16/32/64 buffers); ``bucket_size_in_mb``
    (default 25); ``local_world_size`` (Decent-DP's ``_local_world_size`` is accepted
    too): the ranks per node for ``alternating-exp-ring``, by default ``LOCAL_WORLD_SIZE``
    (which ``import totalreduce.torch`` sets under ``mpiexec``), else the launcher's node
    layout.

    What happens when, as in Decent-DP:

    - construction broadcasts rank 0's trainable parameters to every rank;
    - the first training iteration only records the order in which the backward pass
      produces the gradients;
    - the second forward pass in training mode splits the parameters, in that order, into
      buckets of about ``bucket_size_in_mb`` (each parameter counted rounded up to 32
      elements), builds each bucket's optimizer with ``optim_fn`` (and scheduler), takes
      the first step with the first iteration's gradients, and starts each bucket's
      neighbor average;
    - from then on, when a bucket's last gradient is ready in the backward pass, the
      bucket applies the average it started one iteration before (``x <- (1 - a) x + a
      W x``, ``a`` the adaptive factor, 1 by default), takes its optimizer step (unscale,
      clip, ``scaler.step`` and ``scaler.update`` after the last bucket, or a plain step),
      zeroes its gradients, steps its scheduler and starts its next average;
    - a forward pass in training mode counts an iteration (not in eval mode, nor while
      gradients accumulate); averages started at iteration ``t`` use the topology's step
      ``t + 1`` (the very first uses step 1), so the schedule walks the topology as
      Decent-DP's does;
    - ``train()`` and ``eval()`` only switch the model's mode; nothing is averaged globally
      until :meth:`global_avg` is called.

    The model's parameters are never averaged in place of a step: there is no
    ``optimizer.step()`` to call.  Differences from Decent-DP: torch.distributed need not
    be initialized (``totalreduce.init()`` runs if needed); a topology name Decent-DP
    refuses for a size (``ring`` on an odd number of ranks, ...) works as
    docs/topology.md describes; ranks whose parameter layouts differ all raise, naming
    the ranks.
    """

    #: The buffer dtypes :meth:`global_avg` averages (with ``sync_buffer_in_global_avg``).
    FLOAT_DTYPES = (torch.float16, torch.float32, torch.float64)

    def __init__(
        self,
        model: torch.nn.Module,
        optim_fn: OPTIM_FN_TYPE,
        lr_scheduler_fn: LR_SCHEDULER_FN_TYPE | None = None,
        topology: str | MixingTopology = "complete",
        scaler: Any = None,
        grad_clip_norm: float = 0.0,
        param_as_bucket_view: bool = True,
        sync_buffer_in_global_avg: bool = False,
        bucket_size_in_mb: float = 25,
        _local_world_size: int | None = None,
        *,
        local_world_size: int | None = None,
        service: ServiceLike | None = None,
        prefix: str = "decent_dp.",
    ) -> None:
        super().__init__()
        if not isinstance(model, torch.nn.Module):
            raise InvalidArgumentError(f"model must be a torch.nn.Module, got {model!r}")
        if isinstance(optim_fn, torch.optim.Optimizer) or not callable(optim_fn):
            raise InvalidArgumentError(
                "optim_fn must be a function from a list of (name, parameter) pairs to an "
                f"optimizer, e.g. optim_fn_adamw, got {type(optim_fn).__name__}; the form "
                "that takes an optimizer is totalreduce.torch.DecentralizedDataParallel"
            )
        if lr_scheduler_fn is not None and not callable(lr_scheduler_fn):
            raise InvalidArgumentError(
                f"lr_scheduler_fn must be a function of the optimizer or None, got "
                f"{type(lr_scheduler_fn).__name__}"
            )
        if scaler is not None and not all(
            callable(getattr(scaler, m, None)) for m in ("step", "update", "unscale_")
        ):
            raise InvalidArgumentError(
                f"scaler must be a torch.amp.GradScaler or None, got {type(scaler).__name__}"
            )
        if isinstance(grad_clip_norm, bool) or not (
            isinstance(grad_clip_norm, (int, float)) and grad_clip_norm >= 0
        ):
            raise InvalidArgumentError(
                f"grad_clip_norm must be a number >= 0 (0: no clipping), got {grad_clip_norm!r}"
            )
        if isinstance(bucket_size_in_mb, bool) or not (
            isinstance(bucket_size_in_mb, (int, float)) and bucket_size_in_mb > 0
        ):
            raise InvalidArgumentError(
                f"bucket_size_in_mb must be a number > 0, got {bucket_size_in_mb!r}"
            )
        local = _local_size(local_world_size, _local_world_size)
        if service is None and not is_initialized():
            init()
        svc = resolve_service(service)
        if torch.cuda.is_available():  # as Decent-DP: the model goes to the current GPU
            model = model.cuda()
        self._model = model
        # Plain attributes (not submodules), kept out of state_dict().
        self.__dict__["service"] = svc
        self.__dict__["topology"] = resolve_topology(topology, svc, local)
        self._optim_fn = optim_fn
        self._lr_scheduler_fn = lr_scheduler_fn
        self._scaler = scaler
        self._grad_clip_norm = float(grad_clip_norm)
        self._param_as_bucket_view = bool(param_as_bucket_view)
        self._sync_buffer_in_global_avg = bool(sync_buffer_in_global_avg)
        self._bucket_size = bucket_size_in_mb * 1024 * 1024
        self._prefix = prefix
        self._averager = NeighborAverager(svc, self.topology, self._prefix)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self._param_names = [n for n, _ in named]
        self._params = [p for _, p in named]
        self._step = 0
        self._initialized = False
        self._is_grad_accum_enable = False
        self._adaptive_factor = 1.0
        self._traced: list[int] = []
        self._buckets: list[_Bucket] = []
        self._backups: list[torch.Tensor] = []
        self._trace_hooks = [
            p.register_post_accumulate_grad_hook(self._tracer(i))
            for i, p in enumerate(self._params)
        ]
        self._hooks: list[Any] = []
        with torch.no_grad():
            broadcast_parameters(named, root=0, prefix=f"{self._prefix}initial.", service=svc)

    # ------------------------------------------------------------------ first iteration

    def _tracer(self, index: int) -> Callable[[torch.Tensor], None]:
        def trace(_param: torch.Tensor) -> None:
            if self._is_grad_accum_enable:
                return
            if index in self._traced:
                raise RuntimeError(
                    f"DecentralizedDataParallel: parameter {self._param_names[index]!r} "
                    "received its gradient twice in the first iteration; each parameter "
                    "must get one gradient per backward pass (for several backward passes "
                    "per step, call set_accumulate_grad(True) around the extra ones)"
                )
            self._traced.append(index)

        return trace

    def _build_buckets(self) -> None:
        """Decent-DP's buckets: the traced parameters, in gradient order, cut each time the
        running size reaches ``bucket_size_in_mb``; one optimizer (and scheduler) each."""
        layout = [(i, self._params[i].numel()) for i in self._traced]
        every = allgather_object(layout, name=f"{self._prefix}layout", service=self.service)
        differ = [r for r, theirs in enumerate(every) if theirs != every[0]]
        if differ:
            raise RuntimeError(
                "DecentralizedDataParallel: the parameters that received gradients in the "
                f"first iteration, or their order or sizes, differ between rank 0 and ranks "
                f"{differ}; every rank must build the same model and run the same backward pass"
            )
        if not self._traced:
            raise RuntimeError(
                "DecentralizedDataParallel: no parameter received a gradient in the first "
                "training iteration; call loss.backward() after the first forward pass"
            )
        for h in self._trace_hooks:
            h.remove()
        self._trace_hooks = []
        unused = [self._param_names[i] for i in range(len(self._params)) if i not in self._traced]
        if unused:
            warnings.warn(
                f"DecentralizedDataParallel: parameters {unused} received no gradient in the "
                "first iteration; as in Decent-DP they are neither stepped nor averaged",
                stacklevel=3,
            )
        start, size = 0, 0
        order = self._traced
        for k, i in enumerate(order):
            size += _aligned(self._params[i].numel()) * self._params[i].element_size()
            if size >= self._bucket_size or k == len(order) - 1:
                members = order[start : k + 1]
                self._add_bucket(members)
                start, size = k + 1, 0

    def _add_bucket(self, members: list[int]) -> None:
        names = [self._param_names[i] for i in members]
        params = [self._params[i] for i in members]
        opt = _check_optimizer(self._optim_fn(list(zip(names, params, strict=True))), names)
        sched = None if self._lr_scheduler_fn is None else self._lr_scheduler_fn(opt)
        bucket = _Bucket(names, params, opt, sched)
        groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for name, p in zip(names, params, strict=True):
            if not p.is_floating_point():
                raise InvalidArgumentError(
                    f"DecentralizedDataParallel: parameter {name!r} has dtype {p.dtype}; "
                    "only floating-point parameters can be averaged"
                )
            if self._param_as_bucket_view and not _dense(p):
                raise InvalidArgumentError(
                    f"DecentralizedDataParallel: parameter {name!r} (shape {tuple(p.shape)}, "
                    f"strides {p.stride()}) has gaps or overlaps, so it cannot become a view "
                    "of its bucket; pass param_as_bucket_view=False"
                )
            groups.setdefault((p.dtype, p.device), []).append(p)
        with torch.no_grad():
            bucket.slabs = [_Slab.build(ps, self._param_as_bucket_view) for ps in groups.values()]
            if hasattr(opt, "pre_average_hook"):
                for slab in bucket.slabs:
                    slab.attach_comm()
                    slab.gather()
                    assert slab.comm is not None
                    slab.comm.copy_(slab.flat)
        index = len(self._buckets)
        self._buckets.append(bucket)
        self._hooks.append(params[-1].register_post_accumulate_grad_hook(self._ready(index)))

    def _first_step(self) -> None:
        """Step every bucket with the first iteration's gradients and start its average
        (Decent-DP does this in the second forward pass, with the topology's step 1)."""
        for index, bucket in enumerate(self._buckets):
            if hasattr(bucket.optimizer, "pre_average_hook"):
                edge = self._edge_at(1)
                bucket.optimizer.pre_average_hook(edge, edge.weight)
            self._local_step(index)
            self._launch(index, 1)
        for index, bucket in enumerate(self._buckets):  # every rank through its first step
            for k, slab in enumerate(bucket.slabs):
                self._averager.collect((index, k), slab.flat)

    # ------------------------------------------------------------------ every iteration

    def _ready(self, index: int) -> Callable[[torch.Tensor], None]:
        def bucket_ready(_param: torch.Tensor) -> None:
            if not self._is_grad_accum_enable:
                with torch.no_grad():
                    self._mix(index)
                    self._local_step(index)
                    self._launch(index, self._step + 1)

        return bucket_ready

    def _mix(self, index: int) -> None:
        """Apply the bucket's average started one iteration before (if any)."""
        bucket = self._buckets[index]
        keys = [((index, k), slab) for k, slab in enumerate(bucket.slabs)]
        keys = [(key, slab) for key, slab in keys if self._averager.pending(key)]
        if not keys:
            return
        for key, slab in keys:  # the engine is done with the flat tensors after this
            self._averager.collect(key, slab.flat)
            slab.gather()
        if hasattr(bucket.optimizer, "pre_average_hook"):
            edge = self._edge_at(self._averager.step_of(keys[0][0]))
            for key, slab in keys:
                self._fill_comm(key, slab, edge.self_weight, len(edge.ranks))
            bucket.optimizer.pre_average_hook(edge, edge.weight)
        for key, slab in keys:
            self._averager.finish(key, slab.flat, self._adaptive_factor)
            slab.scatter()

    def _edge_at(self, step: int) -> Any:
        """This rank's edge at ``step``, for an optimizer's ``pre_average_hook``."""
        if not isinstance(self.topology, Topology):
            raise InvalidArgumentError(
                "DecentralizedDataParallel: the optimizer has a pre_average_hook, which takes "
                f"an edge, and {self.topology.describe()} is a graph without edges; use an "
                "edge topology (complete, ring, one-peer-exp, alternating-exp-ring)"
            )
        return self.topology.edge_of(self.service.rank, step)

    def _fill_comm(self, key: tuple[int, int], slab: _Slab, w: float, k: int) -> None:
        """Decent-DP's comm buffer: the edge's sum of ``(1 - w) / (k - 1) x_j``, self
        included, which is the average less ``(w - (1 - w) / (k - 1)) x_i``."""
        assert slab.comm is not None
        mixed = self._averager.collect(key, slab.flat)
        own = w - (1.0 - w) / (k - 1) if k > 1 else 1.0
        torch.add(mixed, slab.flat, alpha=-own, out=slab.comm)

    def _local_step(self, index: int) -> None:
        bucket = self._buckets[index]
        opt, scaler, clip = bucket.optimizer, self._scaler, self._grad_clip_norm
        if scaler is not None:
            if clip > 0:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(bucket.params, clip)
            scaler.step(opt)
            if index == len(self._buckets) - 1:
                scaler.update()
        else:
            if clip > 0:
                torch.nn.utils.clip_grad_norm_(bucket.params, clip)
            opt.step()
        opt.zero_grad()
        if bucket.scheduler is not None:
            bucket.scheduler.step()

    def _launch(self, index: int, step: int) -> None:
        priority = len(self._buckets) - index  # the first bucket is waited for first
        for k, slab in enumerate(self._buckets[index].slabs):
            slab.gather()
            self._averager.start((index, k), slab.flat, f"bucket{index}.{k}", step, priority)

    # ------------------------------------------------------------------ module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the model; in training mode this counts an iteration (see the class)."""
        if self._step == 1 and not self._initialized:
            self._initialized = True
            with torch.no_grad():
                self._build_buckets()
                self._first_step()
        if self._model.training and not self._is_grad_accum_enable:
            self._step += 1
        return self._model(*args, **kwargs)

    def train(self, mode: bool = True) -> DecentralizedDataParallel:
        """Set the model's training mode (nothing is averaged)."""
        super().train(mode)
        return self

    def eval(self) -> DecentralizedDataParallel:
        """Set the model's evaluation mode (nothing is averaged: see :meth:`global_avg`)."""
        return self.train(False)

    def parameters(self, recurse: bool = True) -> Iterator[torch.nn.Parameter]:
        """The model's parameters."""
        yield from self._model.parameters(recurse)

    # ------------------------------------------------------------------ Decent-DP's methods

    def set_accumulate_grad(self, enable: bool = True) -> None:
        """While enabled, backward passes only accumulate gradients: no step, no average,
        and forward passes do not count iterations."""
        self._is_grad_accum_enable = bool(enable)

    def set_adaptive_factor(self, factor: float) -> None:
        """Apply only ``factor`` of each average: ``x <- (1 - factor) x + factor W x``."""
        if isinstance(factor, bool) or not (
            isinstance(factor, (int, float)) and math.isfinite(factor)
        ):
            raise InvalidArgumentError(f"the adaptive factor must be a number, got {factor!r}")
        self._adaptive_factor = float(factor)

    def get_lr(self) -> float:
        """The first bucket's learning rate from its scheduler (0.0 before the buckets are
        built, in the second training iteration)."""
        if not self._initialized:
            return 0.0
        scheduler = self._buckets[0].scheduler
        if scheduler is None:
            raise RuntimeError(
                "DecentralizedDataParallel.get_lr() reads the LR scheduler, and none was "
                "given: pass lr_scheduler_fn"
            )
        return float(scheduler.get_last_lr()[0])

    @torch.no_grad()
    def global_avg(self, will_revert: bool = True, return_d2c: bool = False) -> float | None:
        """Make every rank hold the mean over all ranks of each parameter (call it on every
        rank); with ``sync_buffer_in_global_avg`` also of the float buffers.

        ``will_revert``: keep a copy of the parameters for :meth:`revert_global_avg`, and
        keep the averages in flight, which the next iteration applies as usual (without it
        they are dropped).  ``return_d2c``: return the distance of this rank's parameters to
        the mean (the norm over all parameters of their difference).
        """
        slabs = [
            ((b, k), slab)
            for b, bucket in enumerate(self._buckets)
            for k, slab in enumerate(bucket.slabs)
        ]
        if will_revert:
            self._averager.collect_all((key, slab.flat) for key, slab in slabs)
        else:
            for key, _slab in slabs:
                self._averager.drop(key)
        if will_revert or return_d2c:
            if len(self._backups) == len(self._params):
                torch._foreach_copy_(self._backups, [p.detach() for p in self._params])
            else:
                self._backups = [p.detach().clone() for p in self._params]
        if self._initialized and self._param_as_bucket_view:
            tensors = [(f"bucket{b}.{k}", slab.flat) for (b, k), slab in slabs]
        else:
            tensors = list(zip(self._param_names, self._params, strict=True))
        if self._sync_buffer_in_global_avg:
            tensors += [
                (f"buffer.{n}", b)
                for n, b in self._model.named_buffers()
                if b.dtype in self.FLOAT_DTYPES
            ]
        average_globally(tensors, self._prefix, self.service)
        if not return_d2c:
            return None
        diffs = torch._foreach_sub([p.detach() for p in self._params], self._backups)
        return float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(diffs))))

    @torch.no_grad()
    def revert_global_avg(self) -> None:
        """Put back the parameters :meth:`global_avg` saved."""
        if not self._backups:
            raise RuntimeError(
                "DecentralizedDataParallel.revert_global_avg(): nothing to revert; call "
                "global_avg() (with will_revert=True, the default) first"
            )
        torch._foreach_copy_([p.detach() for p in self._params], self._backups)


def _local_size(keyword: int | None, decent_dp_keyword: int | None) -> int | None:
    """``local_world_size``, or Decent-DP's ``_local_world_size``, or ``LOCAL_WORLD_SIZE``."""
    if keyword is not None and decent_dp_keyword is not None and keyword != decent_dp_keyword:
        raise InvalidArgumentError(
            f"local_world_size={keyword} and _local_world_size={decent_dp_keyword} disagree; "
            "pass one"
        )
    value: Any = keyword if keyword is not None else decent_dp_keyword
    where = "local_world_size"
    if value is None:
        env = os.environ.get("LOCAL_WORLD_SIZE")
        if env is None:
            return None
        value, where = env, "LOCAL_WORLD_SIZE"
        try:
            value = int(env)
        except ValueError:
            raise InvalidArgumentError(f"LOCAL_WORLD_SIZE={env!r} is not an int") from None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgumentError(f"{where} must be an int >= 1, got {value!r}")
    return value


# ---------------------------------------------------------------------- decent_dp.utils


def initialize_dist() -> tuple[int, int]:
    """Start totalreduce and torch.distributed (backend ``"totalreduce"``); return
    ``(rank, world_size)``.

    As Decent-DP's: it reads ``LOCAL_WORLD_SIZE`` and ``LOCAL_RANK`` (under ``mpiexec``
    ``import totalreduce.torch`` has set them from the launcher), and where
    ``CUDA_VISIBLE_DEVICES`` lists one GPU per local rank it leaves each rank its own.
    Calling it again returns the same answer.
    """
    import torch.distributed as dist

    missing = [v for v in ("LOCAL_WORLD_SIZE", "LOCAL_RANK") if v not in os.environ]
    if missing:
        raise RuntimeError(
            f"initialize_dist() needs {' and '.join(missing)}: launch with mpiexec -n N "
            "(import totalreduce.torch sets them from the MPI launcher), or set them"
        )
    local_world_size = int(os.environ["LOCAL_WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    gpus = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    if gpus and not dist.is_initialized():
        listed = gpus.split(",")
        if len(listed) != local_world_size:
            raise ValueError(
                f"CUDA_VISIBLE_DEVICES={gpus!r} lists {len(listed)} devices for "
                f"LOCAL_WORLD_SIZE={local_world_size} ranks per node; list one per rank"
            )
        os.environ["CUDA_VISIBLE_DEVICES"] = listed[local_rank]
    init()
    if not dist.is_initialized():
        dist.init_process_group(backend="totalreduce", init_method="totalreduce://")
    return dist.get_rank(), dist.get_world_size()


# ---------------------------------------------------------------------- decent_dp.optim


def _param_groups(params: list[tuple[str, torch.Tensor]], weight_decay: float) -> list[dict]:
    """Decent-DP's two groups: weight decay on the parameters whose name contains ``bn`` or
    ``bias``, none on the others (the reverse of the usual convention, kept so that the
    numbers match Decent-DP's; write your own ``optim_fn`` for the other split)."""
    decayed = [p for n, p in params if "bn" in n or "bias" in n]
    others = [p for n, p in params if not ("bn" in n or "bias" in n)]
    return [
        {"params": others, "weight_decay": 0.0},
        {"params": decayed, "weight_decay": weight_decay},
    ]


def optim_fn_adam(
    params: list[tuple[str, torch.Tensor]],
    lr: float = 1e-3,
    beta1: float = 0.9,
    beta2: float = 0.999,
    weight_decay: float = 1.0 / 32768,
    eps: float = 1e-8,
) -> torch.optim.Optimizer:
    """``torch.optim.Adam`` over Decent-DP's two parameter groups (see
    :func:`optim_fn_adamw`); change a default with ``functools.partial``."""
    return torch.optim.Adam(
        _param_groups(params, weight_decay), lr=lr, betas=(beta1, beta2), eps=eps
    )


def optim_fn_adamw(
    params: list[tuple[str, torch.Tensor]],
    lr: float = 1e-3,
    beta1: float = 0.9,
    beta2: float = 0.999,
    weight_decay: float = 0.1,
    eps: float = 1e-8,
) -> torch.optim.Optimizer:
    """``torch.optim.AdamW`` with Decent-DP's defaults; change one with
    ``functools.partial(optim_fn_adamw, lr=...)``.

    As in Decent-DP, ``weight_decay`` applies to the parameters whose name contains
    ``bn`` or ``bias`` only (the other group has none).
    """
    return torch.optim.AdamW(
        _param_groups(params, weight_decay), lr=lr, betas=(beta1, beta2), eps=eps
    )


def optim_fn_accum_adam(
    params: list[tuple[str, torch.Tensor]],
    lr: float = 1e-3,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 1.0 / 32768,
    accum_iter: int = 4,
) -> torch.optim.Optimizer:
    """:class:`AccumAdam` over Decent-DP's two parameter groups, with its defaults."""
    return AccumAdam(
        _param_groups(params, weight_decay),
        lr=lr,
        betas=(beta1, beta2),
        eps=eps,
        accum_iter=accum_iter,
    )


def optim_fn_accum_adamw(
    params: list[tuple[str, torch.Tensor]],
    lr: float = 1e-3,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.1,
    accum_iter: int = 4,
) -> torch.optim.Optimizer:
    """:class:`AccumAdamW` over Decent-DP's two parameter groups, with its defaults."""
    return AccumAdamW(
        _param_groups(params, weight_decay),
        lr=lr,
        betas=(beta1, beta2),
        eps=eps,
        accum_iter=accum_iter,
    )


def lr_scheduler_fn_cosine_with_warmup(
    optimizer: torch.optim.Optimizer,
    t_max: int,
    t_warmup: int,
    cosine_eta_min: float = 1e-6,
    warmup_decay: float = 0.01,
) -> torch.optim.lr_scheduler.LRScheduler:
    """A linear warmup over ``t_warmup`` steps from ``warmup_decay`` times the LR, then a
    cosine decay to ``cosine_eta_min`` over ``t_max`` steps (Decent-DP's helper)."""
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(
        optimizer, T_max=t_max, eta_min=cosine_eta_min
    )
    warmup = torch.optim.lr_scheduler.LinearLR(
        optimizer, start_factor=warmup_decay, total_iters=t_warmup
    )
    return torch.optim.lr_scheduler.SequentialLR(
        optimizer, schedulers=[warmup, cosine], milestones=[t_warmup]
    )


class _AccumAdamBase(torch.optim.Optimizer):
    """Adam whose moments advance once every ``accum_iter`` steps, with the mean gradient.

    Every step still moves the parameters: it uses the moments as they would be if the
    current gradient were the next one in them (``m + (1 - beta1) g`` and ``v + (1 -
    beta2) g^2``, where ``m`` and ``v`` are kept already multiplied by the betas), with the
    bias corrections of ``ceil(step / accum_iter)`` rounds.  After every ``accum_iter``-th
    step the moments take in the mean of those steps' gradients.  With ``accum_iter=1``
    this is Adam (or AdamW).  These are Decent-DP's ``AccumAdam`` and ``AccumAdamW``.
    """

    _decoupled = False

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        accum_iter: int = 4,
    ) -> None:
        name = type(self).__name__
        if not 0.0 <= lr:
            raise InvalidArgumentError(f"{name}: lr must be >= 0, got {lr}")
        if not all(0.0 <= b < 1.0 for b in betas) or len(betas) != 2:
            raise InvalidArgumentError(f"{name}: betas must be two numbers in [0, 1), got {betas}")
        if not 0.0 <= eps:
            raise InvalidArgumentError(f"{name}: eps must be >= 0, got {eps}")
        if not 0.0 <= weight_decay:
            raise InvalidArgumentError(f"{name}: weight_decay must be >= 0, got {weight_decay}")
        if isinstance(accum_iter, bool) or not isinstance(accum_iter, int) or accum_iter < 1:
            raise InvalidArgumentError(
                f"{name}: accum_iter must be an int >= 1, got {accum_iter!r}"
            )
        defaults = dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, accum_iter=accum_iter
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """One step (``closure``, if given, reevaluates the loss first)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, decay, every = (
                group["lr"],
                group["eps"],
                group["weight_decay"],
                group["accum_iter"],
            )
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["accum_grad"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                step = state["step"]
                grad = p.grad
                if decay != 0:
                    if self._decoupled:
                        p.mul_(1 - lr * decay)
                    else:
                        grad = grad.add(p, alpha=decay)
                m, v, acc = state["exp_avg"], state["exp_avg_sq"], state["accum_grad"]
                acc.add_(grad, alpha=1.0 / every)
                rounds = -(-step // every)
                m_now = m.add(grad, alpha=1 - beta1)
                v_now = v.addcmul(grad, grad, value=1 - beta2)
                denom = v_now.sqrt_().div_(math.sqrt(1 - beta2**rounds)).add_(eps)
                p.addcdiv_(m_now, denom, value=-lr / (1 - beta1**rounds))
                if step % every == 0:
                    m.add_(acc, alpha=1 - beta1).mul_(beta1)
                    v.addcmul_(acc, acc, value=1 - beta2).mul_(beta2)
                    acc.zero_()
        return loss


class AccumAdam(_AccumAdamBase):
    """Decent-DP's ``AccumAdam``: L2 weight decay (added to the gradient), moments advanced
    every ``accum_iter`` steps (see :class:`AccumAdamW`'s base for the rule)."""


class AccumAdamW(_AccumAdamBase):
    """Decent-DP's ``AccumAdamW``: decoupled weight decay (``p <- (1 - lr wd) p`` each step),
    moments advanced every ``accum_iter`` steps with the mean gradient."""

    _decoupled = True


__all__ = [
    "LR_SCHEDULER_FN_TYPE",
    "OPTIM_FN_TYPE",
    "AccumAdam",
    "AccumAdamW",
    "DecentralizedDataParallel",
    "initialize_dist",
    "lr_scheduler_fn_cosine_with_warmup",
    "optim_fn_accum_adam",
    "optim_fn_accum_adamw",
    "optim_fn_adam",
    "optim_fn_adamw",
]

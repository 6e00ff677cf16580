"""DistributedOptimizer: Horovod's optimizer wrapper, fed by post-accumulate-grad hooks.

This module owns the life of one step's gradients: a hook on every parameter
that requires a gradient copies it into its fusion bucket the moment autograd
has accumulated it, and the bucket's average starts as soon as its last member
is in; ``step()`` waits for those averages (and submits what never came), then
runs the wrapped optimizer.  While it waits, the comm thread drives the
engine and each bucket is copied out as soon as its op ends, in whatever order
they end.

Rules a user can rely on:

- **Buckets.** Gradients travel in buckets of at most ``fusion_bytes``, the
  one nearest the input at most 1 MiB (see ``buckets.py``: a pure function of
  the parameter list, so no rank asks another; ``fusion_bytes=0`` sends each
  gradient alone, named ``prefix + parameter name``).  The k-th step of a
  bucket on one rank meets the k-th on every other rank, whatever order
  backward filled them in.
- **Unused parameters.** A parameter whose gradient this rank did not produce
  by ``step()`` is submitted then, with its current gradient or zeros if it has
  none, so the ranks that did use it never wait forever.  Its gradient after
  ``step()`` is then the average over all ranks in which unused ranks count
  zeros (Horovod's behaviour); a parameter unused everywhere gets a zero
  gradient, not None.
- **Priority.** By default parameters listed earlier (nearer the input in a
  module's registration order) get a higher priority: the next forward pass
  needs them first.  ``priority=`` takes an int, a mapping from name to int, or
  a callable ``(name, parameter) -> int``.  A bucket takes its most urgent
  member's priority.
- **Accumulation.** With ``backward_passes_per_step=k`` gradients are summed
  locally over ``k`` backward passes and submitted on the k-th; ``step()`` after
  fewer passes submits what it has.  Scale the loss by ``1/k`` for a mean.
- **Rounds and join.** Each synchronization also reduces a flag, 1 from a rank
  still training and 0 from one that joined, so a rank that ran out of data
  can :meth:`join` and keep the others' steps going.  The flag rides as one
  extra element in the last bucket of the plan where it can (free); without
  such a bucket (no fusion, integer averages, min) it is an 8-byte op of its
  own, ``prefix + "#round"``, started with the first gradient of the step.

The factory's arguments (Horovod's positional order, the check of every option,
``named_parameters`` and ``priority`` rules) are read in :mod:`.optimizer_args`.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from ..errors import InvalidArgumentError, TotalReduceError
from ..service.handle import ServiceLike
from ..service.service import Service
from .buckets import Bucket, describe, member_index, plan_buckets
from .collectives import allreduce_async_, resolve_service
from .compression import Compression, Compressor
from .cuda_staging import CudaLauncher
from .optimizer_args import PriorityRule, _check_names, priority_of, read_arguments
from .tensors import TensorHandle

#: Default ``fusion_bytes``: the most bytes of gradients one bucket op carries.  Measured
#: with ``bench --torch`` (ResNet-18, 2 ranks on 2 CPU cores): no fusion was 5-15 % slower than
#: any cap from 4 to 64 MiB, and those were within the noise of each other; 25 MiB (DDP's
#: default) keeps a few buckets per step on ResNet-sized models, so the first can overlap
#: the rest of backward where cores are free.
DEFAULT_FUSION_BYTES = 25 << 20


class GradientSyncError(TotalReduceError):
    """A :func:`DistributedOptimizer` was driven out of order.

    For example ``zero_grad()`` while gradients were still being averaged, or
    more backward passes than ``backward_passes_per_step`` before ``step()``.
    """


def DistributedOptimizer(  # noqa: N802 - Horovod's name, a factory that returns an optimizer
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
    op: Any = "avg",
    priority: Any = None,
    backward_passes_per_step: Any = 1,
    prefix: Any = "grad.",
    *args: Any,
    fusion_bytes: int = DEFAULT_FUSION_BYTES,
    compression: type[Compressor] = Compression.none,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Any = None,
    sparse_as_dense: bool = False,
    service: ServiceLike | None = None,
) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so its gradients are averaged across ranks as backward makes them.

    Returns an instance of a subclass of ``type(optimizer)`` sharing the
    optimizer's state and parameter groups (so learning-rate schedulers,
    ``state_dict()`` and ``isinstance`` keep working); use it instead of
    ``optimizer``.  See the module docstring for buckets, unused parameters,
    priorities and accumulation.  ``fusion_bytes`` caps a bucket (0: no
    fusion); ``compression=Compression.fp16`` sends floating-point gradients
    as float16.  Extra methods: ``synchronize()`` (wait for the averaged
    gradients without stepping, e.g. to clip them), ``skip_synchronize()``,
    ``join()``, ``buckets()``, ``gradient_names()``, ``remove_hooks()``.

    Horovod's positional order ``(optimizer, named_parameters, compression,
    backward_passes_per_step, op, ...)`` is accepted (a compression third says
    which order), and so are Horovod's ``gradient_predivide_factor`` (with
    ``op=Average`` the result is the same average; checked, not needed by the
    engine's exact sum), ``num_groups``/``groups`` (fusion here is planned from
    the parameter list, so these are checked and otherwise have no effect) and
    ``sparse_as_dense``.

    >>> opt = trt.DistributedOptimizer(                     # doctest: +SKIP
    ...     torch.optim.SGD(model.parameters(), lr=0.1),
    ...     named_parameters=model.named_parameters())
    >>> loss.backward()       # each gradient leaves when ready    # doctest: +SKIP
    >>> opt.step()            # waits for the averages, then steps  # doctest: +SKIP
    """
    # Horovod's order and names, every option checked (optimizer_args.py).
    op, priority, backward_passes_per_step, prefix, compression, sparse_as_dense = read_arguments(
        optimizer, _DistributedOptimizer, op, priority, backward_passes_per_step, prefix, args,
        fusion_bytes=fusion_bytes, compression=compression,
        gradient_predivide_factor=gradient_predivide_factor, num_groups=num_groups, groups=groups,
        sparse_as_dense=sparse_as_dense,
    )  # fmt: skip
    if op == "adasum":  # Horovod's Adasum combines the model's updates: its own wrapper
        from .adasum import adasum_optimizer

        return adasum_optimizer(
            optimizer, named_parameters, str(prefix), backward_passes_per_step,
            resolve_service(service),
        )  # fmt: skip
    base = type(optimizer)
    cls = type(base.__name__, (_DistributedOptimizer, base), {"__module__": base.__module__})
    wrapped = cls.__new__(cls)
    # Share, not copy: the wrapper and the original see one state and one set of groups.
    wrapped.__dict__.update(optimizer.__dict__)
    wrapped._tr_setup(
        named_parameters,
        op,
        priority,
        backward_passes_per_step,
        prefix,
        resolve_service(service),
        fusion_bytes,
        compression,
    )
    wrapped._tr_sparse_as_dense = bool(sparse_as_dense)
    _LIVE.append(weakref.ref(wrapped))
    return wrapped


#: Every DistributedOptimizer made in this process (Horovod's module-level ``join()`` finds
#: the live one).
_LIVE: list[weakref.ref[Any]] = []


def _live_optimizers() -> list[Any]:
    """The DistributedOptimizers still alive, oldest first."""
    alive = [o for o in (r() for r in _LIVE) if o is not None]
    _LIVE[:] = [weakref.ref(o) for o in alive]
    return alive


class _DistributedOptimizer(torch.optim.Optimizer):
    """The behaviour :func:`DistributedOptimizer` mixes into the wrapped optimizer's class."""

    # Everything lives under _tr_ names so it cannot collide with an optimizer's own.
    _tr_service: Service
    _tr_op: str
    _tr_passes: int
    _tr_prefix: str
    _tr_rule: PriorityRule
    _tr_fusion: int
    _tr_compressor: type[Compressor]
    _tr_named: list[tuple[str, torch.Tensor]]
    _tr_names: dict[torch.Tensor, str]
    _tr_priority: dict[torch.Tensor, int]
    _tr_buckets: list[Bucket]
    _tr_member: dict[torch.Tensor, tuple[Bucket, int]]
    _tr_delay: dict[torch.Tensor, int]
    _tr_hooks: list[Any]
    _tr_lock: threading.Lock
    _tr_synchronized: bool
    _tr_should_sync: bool
    _tr_round: TensorHandle | None
    _tr_rounds: int
    _tr_launcher: CudaLauncher | None
    _tr_carrier: Bucket | None
    _tr_polling: bool

    def _tr_setup(
        self,
        named_parameters: Iterable[tuple[str, torch.Tensor]] | None,
        op: str,
        priority: PriorityRule,
        passes: int,
        prefix: str,
        service: Service,
        fusion_bytes: int,
        compression: type[Compressor],
    ) -> None:
        self._tr_service = service
        self._tr_op = op
        self._tr_passes = passes
        self._tr_prefix = prefix
        self._tr_rule = priority
        self._tr_fusion = fusion_bytes
        self._tr_compressor = compression
        self._tr_named = []
        self._tr_names = {}
        self._tr_priority = {}
        self._tr_buckets = []
        self._tr_member = {}
        self._tr_delay = {}
        self._tr_hooks = []
        self._tr_lock = threading.Lock()
        self._tr_synchronized = False
        self._tr_should_sync = True
        self._tr_round = None
        self._tr_rounds = 0
        self._tr_launcher = None
        self._tr_polling = False

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
        """Name, rank by priority, bucket and hook the parameters of ``named`` (in order)."""
        start = len(self._tr_named)
        total = start + len(named)
        for i, (name, p) in enumerate(named):
            if p in self._tr_names:
                continue
            self._tr_names[p] = self._tr_prefix + name
            self._tr_priority[p] = priority_of(self._tr_rule, name, p, total - (start + i))
            if p.requires_grad:
                self._tr_named.append((name, p))
                self._tr_delay[p] = self._tr_passes
                self._tr_hooks.append(p.register_post_accumulate_grad_hook(self._tr_hook))
        # The whole plan again: it is a function of the full parameter list only.
        if self._tr_launcher is not None:
            self._tr_launcher.release(self._tr_buckets)
        plans = plan_buckets(
            self._tr_named,
            [self._tr_priority[p] for _, p in self._tr_named],
            self._tr_fusion,
            self._tr_compressor,
            self._tr_prefix,
        )
        self._tr_buckets = [Bucket(plan, self._tr_op, self._tr_service) for plan in plans]
        # The flag rides in the last bucket of the plan that can carry it: the same on every rank.
        carriers = [b for b in self._tr_buckets if b.can_carry_flag]
        self._tr_carrier = carriers[-1] if carriers else None
        if self._tr_carrier is not None:
            self._tr_carrier.flag = True
        # Waiting (and submitting stragglers) goes from the most to the least urgent.
        self._tr_buckets.sort(key=lambda b: -b.plan.priority)
        self._tr_member = member_index(self._tr_buckets)
        if any(b.plan.device.type == "cuda" for b in self._tr_buckets):
            if self._tr_launcher is None:
                self._tr_launcher = CudaLauncher()
            for b in self._tr_buckets:
                if b.plan.device.type == "cuda":
                    b.launcher = self._tr_launcher

    def _tr_end_of_backward(self) -> None:
        """Autograd callback: submit what finished copying while backward ran its last ops."""
        self._tr_polling = False
        if self._tr_launcher is not None:
            self._tr_launcher.poll()

    def _tr_open_round(self) -> None:
        """Start this round's flag op, unless a bucket carries the flag: 1 = still training."""
        if self._tr_carrier is None and self._tr_round is None:
            flag = torch.ones(1, dtype=torch.int64)
            top = max((b.plan.priority for b in self._tr_buckets), default=0) + 1
            self._tr_round = allreduce_async_(
                flag, self._tr_prefix + "#round", "sum", top, service=self._tr_service
            )

    def _tr_hook(self, p: torch.Tensor) -> None:
        with self._tr_lock:
            bucket, i = self._tr_member[p]
            if bucket.submitted or i in bucket.ready:
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
            self._tr_open_round()
            bucket.fill(i, self._tr_dense(p))
            if bucket.complete:
                bucket.submit()
            if self._tr_launcher is not None:
                self._tr_launcher.poll()
                if not self._tr_polling:
                    # Once more when backward ends, for the buckets completed last.
                    self._tr_polling = True
                    torch.autograd.Variable._execution_engine.queue_callback(
                        self._tr_end_of_backward
                    )

    def _tr_dense(self, p: torch.Tensor) -> Any:
        """``p.grad``, dense: a sparse gradient is made dense with ``sparse_as_dense=True``
        (Horovod's option), else refused naming the parameter."""
        g = p.grad
        if g is not None and g.is_sparse:
            if not getattr(self, "_tr_sparse_as_dense", False):
                raise InvalidArgumentError(
                    f"gradient {self._tr_names.get(p, '?')!r} is sparse: pass "
                    "sparse_as_dense=True to DistributedOptimizer to average it densely"
                )
            g = g.to_dense()
        return g

    def synchronize(self) -> None:
        """Wait until every gradient is averaged (submitting those backward did not make).

        Call it before ``step()`` to look at or clip the averaged gradients;
        ``step()`` then does not average them again.
        """
        with self._tr_lock:
            self._tr_open_round()
            for b in self._tr_buckets:
                if not b.submitted:
                    for i, (_, p) in enumerate(b.plan.members):
                        if i not in b.ready:
                            b.fill(i, self._tr_dense(p))
                    b.submit()
            flag, self._tr_round = self._tr_round, None
            self._tr_polling = False  # in case a failed backward never ran its callback
        try:
            if self._tr_launcher is not None:
                self._tr_launcher.flush()
            for b in _in_completion_order(self._tr_buckets):
                b.finish()
            if flag is not None:
                flag.wait()
            self._tr_rounds += 1
        finally:
            with self._tr_lock:
                for b in self._tr_buckets:
                    b.handle = None
                    b.staging = False
                    b.ready.clear()
                for _, p in self._tr_named:
                    self._tr_delay[p] = self._tr_passes
                self._tr_synchronized = True

    def join(self) -> int:
        """Keep the other ranks' steps going with zeros until every rank has joined.

        Horovod's ``hvd.join()`` for this optimizer: call it on a rank that ran
        out of data.  Each step another rank takes, this rank contributes zeros
        to every bucket (they count in the average, as unused parameters do);
        once every rank has called ``join()`` it returns, on every rank, the
        rank that joined last (the highest such rank on a tie).  The model and
        gradients of a joined rank are left as they are.
        """
        with self._tr_lock:
            busy = self._tr_round is not None or any(b.submitted for b in self._tr_buckets)
        if busy:
            raise GradientSyncError(
                "join() was called with gradients in flight: call step() or synchronize() first"
            )
        mine = self._tr_rounds
        svc = self._tr_service
        top = max((b.plan.priority for b in self._tr_buckets), default=0) + 1
        carrier = self._tr_carrier
        while True:
            handle = None
            if carrier is None:
                flag = torch.zeros(1, dtype=torch.int64)
                handle = allreduce_async_(flag, self._tr_prefix + "#round", "sum", top, service=svc)
            for b in self._tr_buckets:
                b.submit_zeros()  # the carrier's flag element is zero too
            for b in self._tr_buckets:
                b.finish(write=False)
            self._tr_rounds += 1
            active = carrier.active if carrier is not None else float(handle.wait()[0])
            if active < 0.5:
                break
        last = torch.tensor([mine * svc.size + svc.rank], dtype=torch.int64)
        allreduce_async_(last, self._tr_prefix + "#last_joined", "max", service=svc).wait()
        return int(last[0]) % svc.size

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
            pending = [b.name for b in self._tr_buckets if b.submitted or b.ready]
            if pending:
                names = sorted(pending)
                shown = ", ".join(names[:4]) + (" ..." if len(names) > 4 else "")
                raise GradientSyncError(
                    f"zero_grad() was called while {len(names)} gradients ({shown}) are being "
                    "averaged: call step() or synchronize() after backward, before zero_grad()"
                )
            for _, p in self._tr_named:
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
        if self._tr_launcher is not None:
            self._tr_launcher.release(self._tr_buckets)

    def gradient_names(self) -> dict[str, int]:
        """Every op's name (a bucket's, or a parameter's without fusion) and its priority.

        Most urgent first.  With ``fusion_bytes=0`` the names are
        ``prefix + parameter name``.
        """
        return {b.name: b.plan.priority for b in self._tr_buckets}

    def buckets(self) -> dict[str, list[str]]:
        """``{op name: [parameter names]}``: which gradients travel together."""
        return describe(self._tr_buckets)


def _in_completion_order(buckets: list[Bucket]) -> Iterator[Bucket]:
    """``buckets``, each yielded once its op has ended (those without an op first).

    The comm thread drives the ops meanwhile and this thread blocks, as a DDP
    step blocks on its buckets' futures: a waiter that drove the engine itself
    would spin between passes on a core the other ranks' backward passes need.
    Copying a finished bucket out overlaps the ops still in flight.  Once a
    second without news, every op still in flight gets one pass of the engine
    from here (``done()``, as ``MPI_Test``), so nothing depends on the comm
    thread alone.
    """
    ended: queue.SimpleQueue[Bucket] = queue.SimpleQueue()

    def report(b: Bucket) -> Callable[[TensorHandle], None]:
        return lambda _h: ended.put(b)

    pending = 0
    for b in buckets:
        if b.handle is None:
            yield b
            continue
        pending += 1
        b.handle.add_done_callback(report(b))
    while pending:
        try:
            b = ended.get(timeout=_POLL_S)
        except queue.Empty:
            for other in buckets:
                if other.handle is not None:
                    other.handle.done()
            continue
        pending -= 1
        yield b


#: How long :func:`_in_completion_order` blocks before it progresses the engine itself.
_POLL_S = 1.0

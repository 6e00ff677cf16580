"""Fusion buckets: which gradients travel together, and the buffers they travel in.

This module owns the plan (:func:`plan_buckets`) and the per-bucket life of one
step's gradients (:class:`Bucket`): copy in when a member is ready, submit when
the last member is, copy out once the result is back.

Rules the optimizer and its users rely on:

- **No negotiation.** The plan is a pure function of the parameter list, the
  dtypes, ``fusion_bytes`` and the compressor, so every rank computes the same
  buckets without exchanging anything.  Ranks may complete their buckets in
  different orders: the engine pairs ops by name and generation.
- **Order.** Parameters are taken in reverse registration order (the order
  backward produces them, roughly), so the first bucket fills first; a bucket
  holds one device and one dtype and at most ``fusion_bytes`` of wire bytes, or
  one parameter larger than that.  Buckets are numbered in the order they are
  opened and named ``prefix + "bucket.<i>"``.  With ``fusion_bytes=0`` every
  parameter is its own bucket named ``prefix + parameter name``.
- **Priority.** A bucket's priority is that of its most urgent member, so the
  buckets nearest the input still go first.
- **Buffers.** A bucket's flat buffer is allocated once and reused every step;
  a gradient is copied in once and the result copied out once.  A bucket of one
  parameter on the CPU without compression skips both copies: the gradient
  itself is reduced in place.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..service.handle import ServiceLike
from .collectives import allreduce_async_
from .compression import Compressor
from .tensors import TensorHandle


@dataclass
class BucketPlan:
    """One bucket of the plan: its op name, members (in order), dtype and wire dtype."""

    index: int
    name: str
    members: list[tuple[str, torch.Tensor]]
    dtype: torch.dtype
    wire_dtype: torch.dtype
    device: torch.device
    priority: int

    @property
    def numel(self) -> int:
        return sum(p.numel() for _, p in self.members)


def plan_buckets(
    named: Sequence[tuple[str, torch.Tensor]],
    priorities: Sequence[int],
    fusion_bytes: int,
    compressor: type[Compressor],
    prefix: str,
) -> list[BucketPlan]:
    """The buckets of ``named`` (parameters in registration order, with their priorities).

    >>> [b.name for b in plan_buckets(model.named_parameters(), [2, 1], 0, NoneCompressor, "g.")]
    ... # doctest: +SKIP
    ['g.fc.weight', 'g.fc.bias']
    """
    plans: list[BucketPlan] = []
    if fusion_bytes <= 0:
        for (n, p), prio in zip(named, priorities, strict=True):
            wire = compressor.wire(p.dtype)
            plans.append(
                BucketPlan(len(plans), prefix + n, [(n, p)], p.dtype, wire, p.device, prio)
            )
        return plans
    open_: dict[tuple[torch.device, torch.dtype], tuple[BucketPlan, int]] = {}
    for (n, p), prio in reversed(list(zip(named, priorities, strict=True))):
        wire = compressor.wire(p.dtype)
        nbytes = p.numel() * wire.itemsize
        key = (p.device, p.dtype)
        current = open_.get(key)
        if current is not None and current[1] + nbytes <= fusion_bytes:
            plan, used = current
            plan.members.append((n, p))
            plan.priority = max(plan.priority, prio)
            open_[key] = (plan, used + nbytes)
            continue
        plan = BucketPlan(
            len(plans), f"{prefix}bucket.{len(plans)}", [(n, p)], p.dtype, wire, p.device, prio
        )
        plans.append(plan)
        open_[key] = (plan, nbytes)
    return plans


@dataclass(eq=False)
class Bucket:
    """One bucket's buffers and this step's state (see the module docstring).

    ``op`` is the engine op (``avg``, ``sum``, ``min``, ``max``); with a wire
    dtype narrower than the gradients' an average travels as a sum of
    gradients divided by the number of ranks on the way in.
    """

    plan: BucketPlan
    op: str
    service: ServiceLike
    offsets: list[int] = field(default_factory=list)
    ready: set[int] = field(default_factory=set)
    handle: TensorHandle | None = None
    buffer: torch.Tensor | None = None
    #: CUDA buckets: the pinned host copy the engine works on, and the launcher staging it.
    host: torch.Tensor | None = None
    staging: bool = False
    launcher: Any = None
    #: The result is on the host and must land on the device (set by the launcher).
    landing: bool = False
    #: This bucket also carries the step's round flag in one extra element (see
    #: ``can_carry_flag``); ``active`` is the flag's value after the last ``finish``.
    flag: bool = False
    active: float = 0.0

    def __post_init__(self) -> None:
        start = 0
        for _, p in self.plan.members:
            self.offsets.append(start)
            start += p.numel()
        self.direct = (
            len(self.plan.members) == 1
            and self.plan.device.type == "cpu"
            and self.plan.wire_dtype == self.plan.dtype
        )
        self.prescale = self.plan.wire_dtype != self.plan.dtype and self.op == "avg"
        self.wire_op = "sum" if self.prescale else self.op

    @property
    def name(self) -> str:
        return self.plan.name

    @property
    def can_carry_flag(self) -> bool:
        """Whether one extra element can count the ranks still training, exactly.

        It holds 1 on a rank still training and 0 on one that joined.  It needs
        a buffer of our own (not a gradient reduced in place), a reduction that
        keeps "some rank sent 1" visible (not min), and a dtype that holds the
        count or the mean exactly (float32, float64; 16-bit and integer types
        only for sums and maxima, where the value is an integer).
        """
        if self.direct or self.wire_op == "min":
            return False
        wire = self.plan.wire_dtype
        if wire in (torch.float32, torch.float64):
            return True
        return self.wire_op in ("sum", "max") and wire in (torch.float16, torch.int32, torch.int64)

    @property
    def submitted(self) -> bool:
        return self.handle is not None or self.staging

    def device_buffer(self) -> torch.Tensor:
        """The flat buffer on the parameters' device (allocated once)."""
        return self._flat()

    def _flat(self) -> torch.Tensor:
        if self.buffer is None:
            self.buffer = torch.empty(
                self.plan.numel + (1 if self.flag else 0),
                dtype=self.plan.wire_dtype,
                device=self.plan.device,
            )
        return self.buffer

    def _slice(self, i: int) -> torch.Tensor:
        p = self.plan.members[i][1]
        return self._flat()[self.offsets[i] : self.offsets[i] + p.numel()]

    def fill(self, i: int, grad: torch.Tensor | None) -> None:
        """Member ``i`` is ready with ``grad`` (None: zeros, it was not used here)."""
        self.ready.add(i)
        if self.direct:
            return
        dst = self._slice(i)
        with torch.no_grad():
            if grad is None:
                dst.zero_()
            elif self.prescale:
                torch.div(grad.reshape(-1), self.service.size, out=dst)
            else:
                dst.copy_(grad.reshape(-1))

    @property
    def complete(self) -> bool:
        return len(self.ready) == len(self.plan.members)

    def submit(self) -> None:
        """Start the bucket's allreduce (all members must be filled).

        A CUDA bucket hands itself to its launcher, which starts the op once
        the copy to the host is done.
        """
        if self.flag:
            self._flat()[-1] = 1  # this rank is still training
        if self.launcher is not None:
            self.launcher.submit(self)
            return
        if self.direct:
            p = self.plan.members[0][1]
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            tensor = p.grad
        else:
            tensor = self._flat()
        self.handle = allreduce_async_(
            tensor, self.name, self.wire_op, self.plan.priority, service=self.service
        )

    def finish(self, write: bool = True) -> None:
        """Wait for the result and copy it out into the members' gradients (when ``write``)."""
        handle, self.handle = self.handle, None
        self.ready.clear()
        if handle is None:
            return
        handle.wait()
        if self.landing:
            self.landing = False
            self.launcher.land(self)
        if self.flag:
            value = float(self._flat()[-1])
            self.active = value * self.service.size if self.wire_op == "avg" else value
        if self.direct or not write:
            return
        with torch.no_grad():
            for i, (_, p) in enumerate(self.plan.members):
                part = self._slice(i).view(p.shape)
                if p.grad is None:
                    p.grad = torch.empty_like(p)
                p.grad.copy_(part)

    def submit_zeros(self) -> None:
        """Contribute zeros for every member (a rank that has joined); no launcher, no hooks."""
        if self.direct:
            tensor = torch.zeros_like(self.plan.members[0][1])
        else:
            tensor = self._flat().zero_()
        self.ready.update(range(len(self.plan.members)))
        self.handle = allreduce_async_(
            tensor, self.name, self.wire_op, self.plan.priority, service=self.service
        )


def member_index(buckets: Sequence[Bucket]) -> dict[torch.Tensor, tuple[Bucket, int]]:
    """Each parameter's bucket and its position in it."""
    out: dict[torch.Tensor, tuple[Bucket, int]] = {}
    for b in buckets:
        for i, (_, p) in enumerate(b.plan.members):
            out[p] = (b, i)
    return out


def describe(buckets: Sequence[Bucket]) -> dict[str, Any]:
    """``{op name: [parameter names]}`` of ``buckets``, in plan order."""
    return {b.name: [n for n, _ in b.plan.members] for b in buckets}

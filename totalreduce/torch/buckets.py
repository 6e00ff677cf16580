"""Fusion buckets: which gradients travel together, and the buffers they travel in.

This module owns the plan (:func:`plan_buckets`) and the per-bucket life of one
step's gradients (:class:`Bucket`): copy in when a member is ready, submit when
the last member is, copy out once the result is back.

Rules the optimizer and its users rely on:

- **No negotiation.** The plan is a pure function of the parameter list, the
  dtypes, ``fusion_bytes`` and the compressor, so every rank computes the same
  buckets without exchanging anything.  Ranks may complete their buckets in
  different orders: the engine pairs ops by name and generation.
- **Order.** A bucket holds consecutive parameters of one device and one
  dtype and at most ``fusion_bytes`` of wire bytes, or one parameter larger
  than that.  Boundaries are drawn from the input side, where the bucket
  nearest the input holds at most :data:`LAST_BUCKET_BYTES` (1 MiB): backward
  completes it last, so no gradient computation can hide its op, and a small
  one keeps the step's tail short (with one large bucket there, as the plan
  drawn from the output side gave ResNet-18, the whole 24 MiB went after
  backward).  Buckets and their members are then listed in reverse
  registration order (the order backward produces them, roughly), numbered
  in that order and named ``prefix + "bucket.<i>"``.  With ``fusion_bytes=0``
  every parameter is its own bucket named ``prefix + parameter name``.
- **Priority.** A bucket's priority is that of its most urgent member, so the
  buckets nearest the input still go first.
- **Buffers.** A bucket's flat buffer is allocated once and reused every step,
  with a view of it per member made once; a gradient is copied in once and the
  result copied out once.  A bucket of one parameter on the CPU without
  compression skips both copies: the gradient itself is reduced in place.
- **Averages.** A floating-point bucket averages by multiplying each gradient
  by ``1/P`` as it is copied in (the copy that happens anyway; DDP does the
  same) and summing: the engine's ``avg`` would divide the whole result again
  after the last segment arrived, one more pass over the bucket at the end of
  the op.  Integer buckets (a floor division) and buckets reduced in place
  keep the engine's ``avg``.
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

#: Cap of the bucket nearest the input (of each device and dtype): backward completes it
#: last, so no gradient computation hides its op; a small one keeps that tail short.
LAST_BUCKET_BYTES = 1 << 20


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
    last_bytes: int | None = None,
) -> list[BucketPlan]:
    """The buckets of ``named`` (parameters in registration order, with their priorities).

    Bucket boundaries are drawn from the input side: the bucket nearest the
    input (the last one backward completes) holds at most ``last_bytes``
    (default :data:`LAST_BUCKET_BYTES`), the others at most ``fusion_bytes``
    (or one larger parameter).  The buckets and their members are then listed
    in backward order, from the output side.

    >>> [b.name for b in plan_buckets(model.named_parameters(), [2, 1], 0, NoneCompressor, "g.")]
    ... # doctest: +SKIP
    ['g.fc.weight', 'g.fc.bias']
    """
    items = list(zip(named, priorities, strict=True))
    plans: list[BucketPlan] = []
    if fusion_bytes <= 0:
        for (n, p), prio in items:
            wire = compressor.wire(p.dtype)
            plans.append(
                BucketPlan(len(plans), prefix + n, [(n, p)], p.dtype, wire, p.device, prio)
            )
        return plans
    if last_bytes is None:
        last_bytes = LAST_BUCKET_BYTES
    groups: list[list[int]] = []  # positions in ``items``, from the input side
    open_: dict[tuple[torch.device, torch.dtype], tuple[list[int], int, int]] = {}
    for k, ((_, p), _) in enumerate(items):
        nbytes = p.numel() * compressor.wire(p.dtype).itemsize
        key = (p.device, p.dtype)
        current = open_.get(key)
        if current is not None and current[1] + nbytes <= current[2]:
            current[0].append(k)
            open_[key] = (current[0], current[1] + nbytes, current[2])
            continue
        # The first group of a device and dtype is the one nearest the input.
        cap = min(last_bytes, fusion_bytes) if current is None else fusion_bytes
        group = [k]
        groups.append(group)
        open_[key] = (group, nbytes, cap)
    # Backward order: the bucket holding the last parameter first, members last first.
    for group in sorted(groups, key=lambda g: -g[-1]):
        members = [items[k][0] for k in reversed(group)]
        _, p = members[0]
        plans.append(
            BucketPlan(
                len(plans),
                f"{prefix}bucket.{len(plans)}",
                members,
                p.dtype,
                compressor.wire(p.dtype),
                p.device,
                max(items[k][1] for k in group),
            )
        )
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
        # Averages of a copied floating-point bucket are scaled on the way in (see the
        # module docstring); a narrower wire dtype needs it anyway, so the 16-bit sum
        # cannot overflow where the mean would not.
        self.prescale = (
            self.op == "avg"
            and not self.direct
            and self.plan.wire_dtype.is_floating_point
            and self.plan.dtype.is_floating_point
        )
        self.wire_op = "sum" if self.prescale else self.op
        self._views: list[torch.Tensor] | None = None

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
            n = self.plan.numel + (1 if self.flag else 0)
            from ..api import is_initialized

            if self.plan.device.type == "cpu" and is_initialized():
                # In daemon mode in the node's arena: the bucket's allreduce makes no copy.
                from .tensors import empty

                self.buffer = empty(n, dtype=self.plan.wire_dtype)
            else:
                self.buffer = torch.empty(n, dtype=self.plan.wire_dtype, device=self.plan.device)
        return self.buffer

    def views(self) -> list[torch.Tensor]:
        """Each member's part of the flat buffer, in the member's shape (made once)."""
        if self._views is None:
            flat = self._flat()
            self._views = [
                flat[o : o + p.numel()].view(p.shape)
                for o, (_, p) in zip(self.offsets, self.plan.members, strict=True)
            ]
        return self._views

    def fill(self, i: int, grad: torch.Tensor | None) -> None:
        """Member ``i`` is ready with ``grad`` (None: zeros, it was not used here)."""
        self.ready.add(i)
        if self.direct:
            return
        dst = self.views()[i]
        if grad is None:
            dst.zero_()
            return
        # Detached: the buffer must never join a graph (backward(create_graph=True)).
        grad = grad.detach()
        if self.prescale:
            if self.plan.wire_dtype == self.plan.dtype:
                torch.mul(grad, 1.0 / self.service.size, out=dst)
            else:
                torch.div(grad, self.service.size, out=dst)
        else:
            dst.copy_(grad)

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
            for part, (_, p) in zip(self.views(), self.plan.members, strict=True):
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

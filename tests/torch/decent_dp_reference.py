"""Decent-DP's training algorithm for P ranks in one process: the numbers a port must reproduce.

A restatement of what Decent-DP's ``DecentralizedDataParallel`` does to each rank's
parameters (its ``decent_dp/ddp.py``), written with whole mixing matrices instead of
process groups, so that tests can compare totalreduce.torch.decent_dp against it:

- rank 0's parameters are everyone's at the start;
- iteration 0 computes gradients only;
- at the start of iteration 1 every rank steps with iteration 0's gradients and sends
  its parameters for the topology's step 1;
- from then on, each iteration's backward pass ends, per bucket, with: take
  ``x <- (1 - a) x + a (W(s) x_sent)`` for the step ``s`` of the last send, step the
  optimizer (unscale and clip, ``scaler.step``, ``scaler.update`` after the last bucket,
  or clip and step), zero the gradients, step the scheduler, send the new ``x`` for step
  ``t + 1`` where ``t`` counts the training forward passes so far.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from totalreduce.topology import MixingTopology, mixing_matrix


@dataclass
class Rank:
    model: torch.nn.Module
    buckets: list[list[str]]
    optims: list[Any] = field(default_factory=list)
    scheds: list[Any] = field(default_factory=list)
    scaler: Any = None


class Reference:
    """``P`` copies of ``model`` trained as Decent-DP trains them; drive it like a loop."""

    def __init__(
        self,
        model: torch.nn.Module,
        p: int,
        topology: MixingTopology,
        optim_fn: Callable[..., Any],
        *,
        lr_scheduler_fn: Callable[..., Any] | None = None,
        buckets: list[list[str]] | None = None,
        grad_clip_norm: float = 0.0,
        scalers: list[Any] | None = None,
    ) -> None:
        names = [n for n, q in model.named_parameters() if q.requires_grad]
        self.ranks = [
            Rank(
                copy.deepcopy(model), buckets or [names], scaler=None if not scalers else scalers[r]
            )
            for r in range(p)
        ]
        self.topology = topology
        self.optim_fn = optim_fn
        self.lr_scheduler_fn = lr_scheduler_fn
        self.clip = grad_clip_norm
        self.adaptive = 1.0
        self.forwards = 0  # training forward passes so far (Decent-DP's step counter)
        self.built = False
        self.sent: list[dict[str, torch.Tensor]] | None = None
        self.sent_step = 0

    def params(self, r: int) -> dict[str, torch.Tensor]:
        return dict(self.ranks[r].model.named_parameters())

    def iteration(self, batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
                  loss_fn: Callable[..., torch.Tensor]) -> list[float]:  # fmt: skip
        """One training iteration on every rank (``batch(rank)`` gives its data)."""
        if self.forwards == 1 and not self.built:
            self.built = True
            for r, rank in enumerate(self.ranks):
                named = self.params(r)
                for bucket in rank.buckets:
                    opt = self.optim_fn([(n, named[n]) for n in bucket])
                    rank.optims.append(opt)
                    sched = self.lr_scheduler_fn(opt) if self.lr_scheduler_fn else None
                    rank.scheds.append(sched)
            for r in range(len(self.ranks)):
                self._step(r)
            self._send(1)
        self.forwards += 1
        losses = []
        for r, rank in enumerate(self.ranks):
            x, y = batch(r)
            loss = loss_fn(rank.model(x), y)
            rank.model.zero_grad()
            (rank.scaler.scale(loss) if rank.scaler else loss).backward()
            losses.append(loss.item())
        if self.built:
            self._mix()
            for r in range(len(self.ranks)):
                self._step(r)
            self._send(self.forwards + 1)
        return losses

    def _send(self, step: int) -> None:
        self.sent = [
            {n: q.detach().clone() for n, q in self.params(r).items()}
            for r in range(len(self.ranks))
        ]
        self.sent_step = step

    def _mix(self) -> None:
        assert self.sent is not None
        w = torch.as_tensor(mixing_matrix(self.topology, self.sent_step))
        with torch.no_grad():
            for r in range(len(self.ranks)):
                for n, q in self.params(r).items():
                    mixed = sum(w[r, j].item() * self.sent[j][n] for j in range(len(self.ranks)))
                    q.mul_(1 - self.adaptive).add_(mixed, alpha=self.adaptive)

    def _step(self, r: int) -> None:
        rank = self.ranks[r]
        named = self.params(r)
        for k, opt in enumerate(rank.optims):
            params = [named[n] for n in rank.buckets[k]]
            if rank.scaler is not None:
                if self.clip > 0:
                    rank.scaler.unscale_(opt)
                    torch.nn.utils.clip_grad_norm_(params, self.clip)
                rank.scaler.step(opt)
                if k == len(rank.optims) - 1:
                    rank.scaler.update()
            else:
                if self.clip > 0:
                    torch.nn.utils.clip_grad_norm_(params, self.clip)
                opt.step()
            opt.zero_grad()
            if rank.scheds[k] is not None:
                rank.scheds[k].step()

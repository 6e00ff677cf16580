"""``totalreduce bench --step``: training steps whose gradients are ready at different times,
in a different order on every rank.

A step of data-parallel training, on every rank: the forward over the model's
layers, then the backward, which makes one gradient per layer (the sizes of a
real model's gradients, ResNet-18's 62 by default).  The compute is simulated:
by default the host sleeps while an accelerator would compute (``sleep``), or
it keeps its core busy as CPU training does (``spin``).  Each rank's backward
makes its gradients in its own order (the reverse of the model's, with
neighbours swapped at random) and at its own speed (each step's compute scaled
by a factor within ``±jitter``), drawn from the step and the rank, so every
implementation meets the same schedules.  A layer's share of the compute grows
with its parameters (its count plus the mean count, so small tensors take time
too).  Before the forward of layer ``i``, a rank waits for the previous step's
gradient ``i`` (the optimizer needs it), so a step may start before its
predecessor's communication has ended.

Implementations, alternated round by round (a round is a few steps, then every
op waited; a step's time is the slowest rank's round over its steps):

- ``compute.only``: no communication; the floor of the step.
- ``mpi.Allreduce(fused)``: after the backward, one blocking ``Allreduce`` of
  all the gradients (views of one flat buffer: no copy).
- ``mpi.Iallreduce xL``: one ``Iallreduce`` per gradient, posted in the same
  order on every rank (reverse model order: a rank posts a gradient's once it
  and every gradient before it in that order are made), ``Testall`` after every
  layer's compute so that MPI progresses; the forward waits layer by layer.
- ``mpi.Iallreduce(buckets)``: DDP's way: consecutive gradients in reverse
  model order grouped into buckets of about ``bucket`` bytes, one
  ``Iallreduce`` per bucket once all its gradients are made, in bucket order.
- ``tr.allreduce_async xL``: each gradient submitted the moment it is made,
  with a higher priority the nearer its layer is to the input; the forward waits
  layer by layer.
- ``tr.allreduce_async(buckets)``: the same buckets as MPI's, each submitted the
  moment its gradients are made (in whatever order that is), the buckets nearer
  the input first: how ``DistributedOptimizer`` and the DDP hook send gradients.

``vs_mpi`` is the best MPI implementation's step time over this one's (above 1:
faster than the best of MPI).  After every round each rank checks the last
step's sums (exact small integers); ``#wrong`` counts the wrong elements.
"""

from __future__ import annotations

import abc
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

import totalreduce as tr

from .table import Result

COMPUTE = ("sleep", "spin")


@dataclass(frozen=True)
class Scenario:
    """What a step computes and makes; times in seconds."""

    counts: tuple[int, ...]
    forward_s: float
    backward_s: float
    jitter: float = 0.1
    swap: float = 0.3
    compute: str = "sleep"
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.counts or min(self.counts) < 1:
            raise ValueError(f"step scenario: every tensor needs >= 1 element, got {self.counts}")
        if self.forward_s < 0 or self.backward_s < 0:
            raise ValueError(
                f"step scenario: compute times must be >= 0, got forward {self.forward_s} s, "
                f"backward {self.backward_s} s"
            )
        if not 0 <= self.jitter < 1 or not 0 <= self.swap <= 1:
            raise ValueError(
                f"step scenario: need 0 <= jitter < 1 and 0 <= swap <= 1, "
                f"got jitter {self.jitter}, swap {self.swap}"
            )
        if self.compute not in COMPUTE:
            raise ValueError(
                f"step scenario: compute must be one of {COMPUTE}, got {self.compute!r}"
            )

    @property
    def shares(self) -> list[float]:
        """Each layer's share of a pass's compute (they add up to 1)."""
        extra = sum(self.counts) / len(self.counts)
        weights = [c + extra for c in self.counts]
        total = sum(weights)
        return [w / total for w in weights]

    def schedule(self, step: int, rank: int) -> tuple[list[int], float]:
        """Rank ``rank``'s backward order (layer indices) at ``step``, and its compute scale."""
        rng = random.Random(f"{self.seed}:{step}:{rank}")
        order = list(reversed(range(len(self.counts))))
        k = 0
        while k < len(order) - 1:
            if rng.random() < self.swap:
                order[k], order[k + 1] = order[k + 1], order[k]
                k += 1  # a layer moves by one place at most
            k += 1
        return order, 1.0 + self.jitter * (2.0 * rng.random() - 1.0)


def value(rank: int, step: int, layer: int) -> float:
    """What rank ``rank`` writes into gradient ``layer`` at ``step``: a small integer."""
    return float(rank + 1 + (step + layer) % 5)


def expected(p: int, step: int, layer: int) -> float:
    return float(sum(value(r, step, layer) for r in range(p)))


class _Compute:
    """Simulated compute on a timeline of its own, sleeping or spinning to keep to it.

    Compute and the host's own calls (the hooks) follow each other on the
    timeline: a hook's time moves it on, so a wait for communication delays
    the compute after it, but a late wake-up from ``sleep`` (tens of µs on
    Linux, 124 times per ResNet-18 step) does not, as an accelerator's queue
    would not wait for the host.
    """

    def __init__(self, spin: bool) -> None:
        self.spin = spin
        self.end = time.perf_counter()

    def start(self) -> None:
        self.end = time.perf_counter()

    def host(self, hook: Any, *args: Any) -> None:
        """Run ``hook(*args)``; its time moves the timeline on."""
        t0 = time.perf_counter()
        hook(*args)
        self.end += time.perf_counter() - t0

    def run(self, seconds: float, then: Any = None) -> None:
        """Compute for ``seconds``; ``then()`` (the gradient's write) runs within that time."""
        self.end += seconds
        if then is not None:
            then()
            self.end = max(self.end, time.perf_counter())  # a write longer than the compute
        if self.spin:
            while time.perf_counter() < self.end:
                pass
        else:
            left = self.end - time.perf_counter()
            if left > 0:
                time.sleep(left)


class Implementation:
    """How a step's gradients are reduced; the hooks the step calls."""

    name = "compute.only"

    def __init__(self, grads: Sequence[np.ndarray]) -> None:
        self.grads = grads

    def need(self, layer: int) -> None:
        """Before the forward of ``layer``: its gradient of the previous step must be reduced."""

    def made(self, layer: int) -> None:
        """The backward has just written gradient ``layer``."""

    def between(self) -> None:
        """After a layer's compute (forward or backward)."""

    def backward_done(self) -> None:
        """After the backward's last layer."""

    def finish(self) -> None:
        """The round's end: every op of it done."""


class MpiFused(Implementation):
    name = "mpi.Allreduce(fused)"

    def __init__(self, grads: Sequence[np.ndarray], flat: np.ndarray, comm: Any) -> None:
        super().__init__(grads)
        self.flat, self.comm = flat, comm

    def backward_done(self) -> None:
        from mpi4py import MPI

        self.comm.Allreduce(MPI.IN_PLACE, self.flat)


def plan_buckets(
    grads: Sequence[np.ndarray], bucket_bytes: int
) -> tuple[list[tuple[int, int]], list[int]]:
    """Runs ``[lo, hi)`` of consecutive layers, in reverse model order, each closed once it
    holds ``bucket_bytes`` (0: a run per layer), and each layer's run."""
    buckets: list[tuple[int, int]] = []
    hi, size = len(grads), 0
    for layer in reversed(range(len(grads))):
        size += grads[layer].nbytes
        if bucket_bytes <= 0 or size >= bucket_bytes or layer == 0:
            buckets.append((layer, hi))
            hi, size = layer, 0
    bucket_of = [0] * len(grads)
    for b, (lo, hi) in enumerate(buckets):
        for layer in range(lo, hi):
            bucket_of[layer] = b
    return buckets, bucket_of


class _Bucketed(Implementation, abc.ABC):
    """Gradients reduced in runs (:func:`plan_buckets`) once every gradient of a run is
    made; the next forward waits for a layer's run before the layer."""

    def __init__(self, grads: Sequence[np.ndarray], flat: np.ndarray, bucket_bytes: int) -> None:
        super().__init__(grads)
        self.flat = flat
        self.buckets, self.bucket_of = plan_buckets(grads, bucket_bytes)
        self.offsets = np.cumsum([0] + [g.size for g in grads])
        self.missing = [hi - lo for lo, hi in self.buckets]
        self.running: list[Any] = [None] * len(self.buckets)
        self.waiting: list[Any] = [None] * len(self.buckets)

    def part(self, b: int) -> np.ndarray:
        lo, hi = self.buckets[b]
        return self.flat[self.offsets[lo] : self.offsets[hi]]

    @abc.abstractmethod
    def start(self, b: int) -> Any:
        """Start run ``b``'s reduction; what ``finish_one`` waits on."""

    def made(self, layer: int) -> None:
        b = self.bucket_of[layer]
        self.missing[b] -= 1
        if self.missing[b] == 0:
            self.running[b] = self.start(b)

    def backward_done(self) -> None:
        # The next step's backward counts its gradients again; this step's runs are waited
        # for by the forward.
        self.missing = [hi - lo for lo, hi in self.buckets]
        self.waiting, self.running = self.running, [None] * len(self.buckets)

    def need(self, layer: int) -> None:
        b = self.bucket_of[layer]
        h = self.waiting[b]
        if h is not None:
            self.finish_one(h)
            self.waiting[b] = None

    def finish_one(self, h: Any) -> None:
        h.wait()

    def finish(self) -> None:
        for layer in range(len(self.grads)):
            self.need(layer)


class MpiBuckets(_Bucketed):
    """``Iallreduce`` of each run, posted in run order (the same on every rank: a run goes
    once it and every run before it are made); ``Testall`` between layers."""

    def __init__(
        self, grads: Sequence[np.ndarray], flat: np.ndarray, comm: Any, bucket_bytes: int
    ) -> None:
        super().__init__(grads, flat, bucket_bytes)
        self.comm = comm
        self.name = (
            f"mpi.Iallreduce x{len(grads)}" if bucket_bytes <= 0 else "mpi.Iallreduce(buckets)"
        )
        self.posted = 0
        self.pending: list[Any] = []

    def start(self, b: int) -> Any:
        from mpi4py import MPI

        req = self.comm.Iallreduce(MPI.IN_PLACE, self.part(b))
        self.pending.append(req)
        return req

    def made(self, layer: int) -> None:
        self.missing[self.bucket_of[layer]] -= 1
        while self.posted < len(self.buckets) and self.missing[self.posted] == 0:
            self.running[self.posted] = self.start(self.posted)
            self.posted += 1

    def between(self) -> None:
        from mpi4py import MPI

        if self.pending and MPI.Request.Testall(self.pending):
            self.pending.clear()

    def backward_done(self) -> None:
        super().backward_done()
        self.posted = 0

    def finish_one(self, h: Any) -> None:
        h.Wait()

    def finish(self) -> None:
        super().finish()
        self.pending.clear()


class TotalreduceBuckets(_Bucketed):
    """``tr.allreduce_async`` of each run the moment its gradients are made (in any order),
    the runs nearest the input first by priority: how ``DistributedOptimizer`` and the DDP
    hook send gradients (its fusion buckets)."""

    name = "tr.allreduce_async(buckets)"

    def start(self, b: int) -> Any:
        part = self.part(b)
        return tr.allreduce_async(part, name=f"bench.step.bucket{b}", out=part, priority=b)


class Totalreduce(Implementation):
    def __init__(self, grads: Sequence[np.ndarray]) -> None:
        super().__init__(grads)
        self.name = f"tr.allreduce_async x{len(grads)}"
        self.handles: list[Any] = [None] * len(grads)

    def made(self, layer: int) -> None:
        g = self.grads[layer]
        self.handles[layer] = tr.allreduce_async(
            g, name=f"bench.step.{layer}", out=g, priority=len(self.grads) - layer
        )

    def need(self, layer: int) -> None:
        h = self.handles[layer]
        if h is not None:
            h.wait()
            self.handles[layer] = None

    def finish(self) -> None:
        for layer in range(len(self.grads)):
            self.need(layer)


def run_round(
    impl: Implementation,
    scenario: Scenario,
    steps: int,
    first_step: int,
    rank: int,
    compute: _Compute,
) -> float:
    """``steps`` steps from ``first_step`` then every op waited: seconds on this rank."""
    grads, shares, host = impl.grads, scenario.shares, compute.host
    t0 = time.perf_counter()
    compute.start()
    for step in range(first_step, first_step + steps):
        order, scale = scenario.schedule(step, rank)
        for layer in range(len(grads)):
            host(impl.need, layer)
            compute.run(scenario.forward_s * scale * shares[layer])
            host(impl.between)
        for layer in order:
            g, v = grads[layer], value(rank, step, layer)
            compute.run(scenario.backward_s * scale * shares[layer], lambda g=g, v=v: g.fill(v))
            host(impl.made, layer)
            host(impl.between)
        host(impl.backward_done)
    host(impl.finish)
    return time.perf_counter() - t0


def wrong(grads: Sequence[np.ndarray], p: int, step: int) -> int:
    """Elements of the gradients that do not hold ``step``'s sums over the ranks."""
    return sum(int(np.count_nonzero(g != expected(p, step, i))) for i, g in enumerate(grads))


def run_scenario(
    comm: Any,
    scenario: Scenario,
    rounds: int,
    steps: int,
    bucket_bytes: int,
    check: bool = True,
) -> list[Result]:
    """Every implementation, alternated round by round after one warm-up round each."""
    from mpi4py import MPI

    p, rank = comm.Get_size(), comm.Get_rank()
    flat = np.zeros(sum(scenario.counts), np.float32)
    offsets = np.cumsum((0,) + scenario.counts)
    grads = [flat[offsets[i] : offsets[i + 1]] for i in range(len(scenario.counts))]
    impls: list[Implementation] = [
        Implementation(grads),
        MpiFused(grads, flat, comm),
        MpiBuckets(grads, flat, comm, 0),
        MpiBuckets(grads, flat, comm, bucket_bytes),
        Totalreduce(grads),
        TotalreduceBuckets(grads, flat, bucket_bytes),
    ]
    compute = _Compute(scenario.compute == "spin")
    times: dict[str, list[float]] = {i.name: [] for i in impls}
    bad = dict.fromkeys(times, 0)
    step = 0
    for rnd in range(1 + max(1, rounds)):
        order = list(impls)
        random.Random(rnd).shuffle(order)  # the same on every rank
        for impl in order:
            comm.Barrier()
            seconds = run_round(impl, scenario, steps, step, rank, compute)
            worst = comm.allreduce(seconds, op=MPI.MAX)
            step += steps
            if rnd > 0:
                times[impl.name].append(worst / steps)
            if check and impl.name != Implementation.name:
                bad[impl.name] += comm.allreduce(wrong(grads, p, step - 1), op=MPI.SUM)
    results = []
    count = int(flat.size)
    ms = (scenario.forward_s + scenario.backward_s) * 1e3
    for impl in impls:
        t = times[impl.name]
        r = Result("step", "allreduce", impl.name, count * 4, count, "float32", "sum", -1)
        r.ops = len(grads)
        r.time_us = statistics.median(t) * 1e6
        r.time_avg_us, r.time_min_us = statistics.fmean(t) * 1e6, min(t) * 1e6
        r.time_max_us = max(t) * 1e6
        r.wrong = None if impl.name == Implementation.name or not check else bad[impl.name]
        r.compute_ms = ms
        results.append(r)
    best = min(r.time_us or 0.0 for r in results if r.impl.startswith("mpi"))
    for r in results:
        r.vs_mpi = best / (r.time_us or 1.0)
    return results

"""CUDA gradients without stalls: copies on a side stream, ops submitted when their copy is done.

This module owns :class:`CudaLauncher`, one per :func:`DistributedOptimizer`
with CUDA parameters; the pinned host buffers it reuses come from a
:class:`~totalreduce.torch.tensors.PinnedPool`.  The engine works on host
memory, so a CUDA bucket goes:

1. the hook copies the gradient into the bucket's flat device buffer, on the
   current stream (as any gradient op);
2. when the bucket is complete, :meth:`CudaLauncher.submit` makes a side
   stream wait for the current one, enqueues the device-to-host copy into the
   bucket's pinned host buffer there and records an event; nothing blocks;
3. :meth:`CudaLauncher.poll` submits the op of every bucket whose event has
   completed (``event.query()``, never a wait).  It runs at every later hook,
   once at the end of backward (an autograd callback), and in ``synchronize()``,
   which alone may wait (:meth:`CudaLauncher.flush`), since the optimizer needs
   the results then anyway;
4. after the op, :meth:`CudaLauncher.land` enqueues the host-to-device copy on
   the side stream and makes the current stream wait for it, so the copy out of
   the bucket, and the optimizer after it, read the averaged values.

The streams and events are injectable, so the ordering logic is tested
without a GPU.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from .collectives import allreduce_async_
from .tensors import PinnedPool

__all__ = ["CudaLauncher", "PinnedPool"]

if TYPE_CHECKING:
    from .buckets import Bucket


class CudaLauncher:
    """Stages the CUDA buckets of one optimizer (see the module docstring).

    ``stream`` is the side stream, ``current`` returns the stream autograd and
    the optimizer run on, ``event`` makes an event (defaults: CUDA's, one side
    stream per device, made when a bucket of that device first needs it).
    """

    def __init__(
        self,
        pool: PinnedPool | None = None,
        *,
        stream: Any = None,
        current: Callable[[], Any] | None = None,
        event: Callable[[], Any] | None = None,
        stream_context: Callable[[Any], Any] | None = None,
    ) -> None:
        self.pool = pool or PinnedPool()
        self._stream = stream
        self._streams: dict[torch.device, Any] = {}
        self._current = current
        self.event = event or torch.cuda.Event
        self.stream_context = stream_context or torch.cuda.stream
        self._staged: list[tuple[Bucket, Any]] = []
        self._lock = threading.Lock()

    def side_stream(self, device: torch.device) -> Any:
        """The side stream for ``device`` (the injected one, if any)."""
        if self._stream is not None:
            return self._stream
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device=device)
        return self._streams[device]

    def current(self, device: torch.device) -> Any:
        """The stream autograd and the optimizer use on ``device``."""
        if self._current is not None:
            return self._current()
        return torch.cuda.current_stream(device)

    def submit(self, bucket: Bucket) -> None:
        """Start ``bucket``'s device-to-host copy; its op leaves once the copy is done."""
        device = bucket.device_buffer()
        if bucket.host is None:
            bucket.host = self.pool.acquire(device.numel(), device.dtype)
        bucket.staging = True
        side = self.side_stream(device.device)
        side.wait_stream(self.current(device.device))
        with self.stream_context(side):
            bucket.host.copy_(device, non_blocking=True)
            done = self.event()
            done.record(side)
        with self._lock:
            self._staged.append((bucket, done))

    def _launch(self, bucket: Bucket) -> None:
        assert bucket.host is not None
        bucket.handle = allreduce_async_(
            bucket.host,
            bucket.name,
            bucket.wire_op,
            bucket.plan.priority,
            service=bucket.service,
        )
        bucket.staging = False
        bucket.landing = True

    def poll(self) -> int:
        """Submit the op of every bucket whose copy has completed; never waits. How many."""
        with self._lock:
            ready, waiting = [], []
            for b, e in self._staged:
                (ready if e.query() else waiting).append((b, e))
            self._staged = waiting
        for b, _ in ready:
            self._launch(b)
        return len(ready)

    def flush(self) -> None:
        """Wait for every staged copy and submit its op (``synchronize()`` calls this)."""
        with self._lock:
            staged, self._staged = self._staged, []
        for b, e in staged:
            e.synchronize()
            self._launch(b)

    @property
    def staged(self) -> int:
        """How many buckets wait for their copy to finish before their op can leave."""
        with self._lock:
            return len(self._staged)

    def land(self, bucket: Bucket) -> None:
        """After the op: copy the result back to the device, ordered before its readers."""
        assert bucket.host is not None
        device = bucket.device_buffer()
        side = self.side_stream(device.device)
        with self.stream_context(side):
            device.copy_(bucket.host, non_blocking=True)
        self.current(device.device).wait_stream(side)

    def release(self, buckets: list[Bucket]) -> None:
        """Give the buckets' host buffers back to the pool."""
        for b in buckets:
            if b.host is not None:
                self.pool.release(b.host)
                b.host = None

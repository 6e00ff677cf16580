"""Gradient compression for the wire: Horovod's ``Compression.none`` and ``Compression.fp16``.

A compressor says which dtype a gradient travels in.  The optimizer's buckets
hold that dtype, so compressing is the one copy into the bucket that happens
anyway (a cast on the way in, and back on the way out), never an extra pass.

>>> opt = trt.DistributedOptimizer(sgd, named_parameters=model.named_parameters(),
...                                compression=trt.Compression.fp16)   # doctest: +SKIP
"""

from __future__ import annotations

import torch


class Compressor:
    """Sends floating-point gradients as ``wire_dtype`` (None: as they are)."""

    wire_dtype: torch.dtype | None = None

    @classmethod
    def wire(cls, dtype: torch.dtype) -> torch.dtype:
        """The dtype a gradient of ``dtype`` travels in."""
        if cls.wire_dtype is None or not dtype.is_floating_point:
            return dtype
        return cls.wire_dtype

    @classmethod
    def compress(cls, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.dtype]:
        """Horovod's interface: ``(tensor in the wire dtype, context to decompress)``."""
        return tensor.to(cls.wire(tensor.dtype)), tensor.dtype

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: torch.dtype) -> torch.Tensor:
        """Back to the dtype ``compress`` recorded."""
        return tensor.to(ctx)


class NoneCompressor(Compressor):
    """No compression: gradients travel in their own dtype."""


class FP16Compressor(Compressor):
    """Floating-point gradients travel as float16 (half of float32's bytes).

    The optimizer divides by the number of ranks before the sum when it
    averages in float16, as DDP's ``fp16_compress_hook`` does, so the 16-bit
    sum cannot overflow where the mean would not.
    """

    wire_dtype = torch.float16


class Compression:
    """Horovod's names: ``Compression.none`` and ``Compression.fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor

"""Benchmarks: totalreduce's collectives against MPI's in the same run, as nccl-tests prints them.

Run with ``mpiexec -n P totalreduce bench`` (or ``python -m totalreduce.bench``).
Every mode prints one row per size and implementation with nccl-tests'
columns (size, count, type, redop, root, then time, algbw, busbw and
``#wrong`` for the out-of-place and the in-place call) and the ratio to MPI's
counterpart measured in the same run; ``--csv``, ``--json`` and ``--plot``
write the same results to files.

- default: totalreduce's ring allreduce against ``Comm.Allreduce``, 4 KiB to
  64 MiB;
- ``--algorithm all``: every allreduce algorithm and ``auto``, plus
  reduce-scatter, all-gather and broadcast against ``Reduce_scatter_block``,
  ``Allgather`` and ``Bcast``;
- ``--neighbor``: ``neighbor_allreduce`` on three topologies beside an
  averaging allreduce (time only);
- ``--latency``: 8 B to 256 KiB, every allreduce algorithm, MPI, a bare
  Python ring loop (:mod:`.bare`, the floor of any Python engine) and the same
  ring compiled (:mod:`.floor`, one Numba function calling MPI: the floor of
  any compiled engine), then a burst of ResNet-50's 161 gradients and
  thousands of small ops in flight;
- ``--step``: training steps whose gradients (ResNet-18's 62 by default) are
  made at different times and in a different order on every rank, with
  simulated compute at two speeds: totalreduce's ops submitted as gradients are
  made against MPI's ``Allreduce`` after the backward, ``Iallreduce`` per
  gradient, and ``Iallreduce`` per bucket as DDP does (:mod:`.step`).

Modules: :mod:`.run` (command line and loop), :mod:`.cases` (what is timed and
checked), :mod:`.timing`, :mod:`.table` (text, CSV, JSON, plot), :mod:`.bare`,
:mod:`.floor`, :mod:`.resnet50`, :mod:`.resnet18`, :mod:`.step`, :mod:`.tune`
(``totalreduce tune``).

Benchmarks are not tests: nothing here asserts a figure.
"""

from __future__ import annotations

from .run import main

__all__ = ["main"]

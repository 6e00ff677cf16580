"""``env://`` under ``mpiexec`` without ``MASTER_ADDR``: MPI answers the rendezvous.

torch's ``env://`` init method needs ``MASTER_ADDR`` and ``MASTER_PORT`` (torchrun sets
them); ``mpiexec`` does not.  Under an MPI launcher with ``MASTER_ADDR`` unset, this
module's wrapper of torch's ``env`` handler runs the ``totalreduce://`` rendezvous instead
(rank and world size from MPI, a store on rank 0 found over MPI), so torchrun-style
scripts run unchanged under ``mpiexec`` with any backend.  With ``MASTER_ADDR`` set, or
without an MPI launcher, torch's handler runs as it always does.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

from ..launch import mpi_launch

_MARK = "_totalreduce_env_over_mpi"


def install() -> None:
    """Wrap torch's ``env`` rendezvous handler (idempotent)."""
    rdzv = importlib.import_module("torch.distributed.rendezvous")
    handlers = rdzv._rendezvous_handlers
    original = handlers.get("env")
    if original is None or getattr(original, _MARK, False):
        return

    def env_or_mpi(
        url: str, timeout: timedelta = timedelta(minutes=30), **kw: Any
    ) -> Iterator[Any]:
        if "MASTER_ADDR" not in os.environ and mpi_launch() is not None:
            from .process_group import rendezvous

            return rendezvous(url, timeout, **kw)
        return original(url, timeout=timeout, **kw)  # type: ignore[no-any-return]

    setattr(env_or_mpi, _MARK, True)
    handlers["env"] = env_or_mpi

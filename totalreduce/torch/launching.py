"""The rendezvous over MPI: the ``totalreduce://`` init method, and ``env://`` under
``mpiexec`` without ``MASTER_ADDR`` or for a daemon client.

:func:`rendezvous` is the ``totalreduce://`` init method (the backend's
:func:`~.process_group.register` registers it): rank, world size and a store from MPI.

torch's ``env://`` init method needs ``MASTER_ADDR`` and ``MASTER_PORT`` (torchrun sets
them); ``mpiexec`` does not.  Under an MPI launcher with ``MASTER_ADDR`` unset, this
module's wrapper of torch's ``env`` handler runs the ``totalreduce://`` rendezvous instead
(rank and world size from MPI, a store on rank 0 found over MPI), so torchrun-style
scripts run unchanged under ``mpiexec`` with any backend.  A daemon client
(``TOTALREDUCE_SERVICE=daemon``, or totalreduce already initialized) started without
``MASTER_ADDR``, ``RANK`` or ``WORLD_SIZE`` (plain ``python``, any launcher but torchrun)
gets the same: rank and world size from the node services.  Under torchrun (all three
set), or without an MPI launcher or a node service, torch's handler runs as it always does.
"""

from __future__ import annotations

import importlib
import os
import socket
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ..api import default_service, init, is_initialized
from ..errors import TotalReduceError
from ..launch import daemon_requested, mpi_launch
from .broadcast_state import broadcast_object

_MARK = "_totalreduce_env_over_mpi"


def rendezvous(url: str, timeout: timedelta = timedelta(minutes=5), **_kw: Any) -> Iterator[Any]:
    """The ``totalreduce://`` init method: rank, world size and a store from MPI.

    Rank 0 opens a ``TCPStore`` on a free port and broadcasts where it is over
    the totalreduce service (127.0.0.1 when every rank is on one node, else rank
    0's host name), so no ``MASTER_ADDR``, ``RANK`` or ``WORLD_SIZE`` is needed
    under ``mpiexec``.
    """
    service = init()
    _local, local_size, _cross, _nodes = service.node_layout()
    host = "127.0.0.1" if local_size == service.size else socket.gethostname()
    store = None
    if service.rank == 0:
        store = dist.TCPStore(host, 0, service.size, True, timeout=timeout, wait_for_workers=False)
        where = (host, int(store.port))
    else:
        where = None
    host, port = broadcast_object(where, 0, name="torch.distributed.rendezvous", service=service)
    if store is None:
        store = dist.TCPStore(host, port, service.size, False, timeout=timeout)
    yield store, service.rank, service.size
    raise TotalReduceError(f"the {url!r} rendezvous cannot run twice in one process group")


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
        if answered_here():
            return rendezvous(url, timeout, **kw)
        return original(url, timeout=timeout, **kw)  # type: ignore[no-any-return]

    setattr(env_or_mpi, _MARK, True)
    handlers["env"] = env_or_mpi


def answered_here() -> bool:
    """Whether totalreduce answers ``env://`` (torch's handler needs ``MASTER_ADDR``,
    ``RANK`` and ``WORLD_SIZE``): under an MPI launcher without ``MASTER_ADDR``; for a
    daemon client (asked for, or running) without any of the three."""
    env = os.environ
    if all(k in env for k in ("MASTER_ADDR", "RANK", "WORLD_SIZE")):
        return False  # (torchrun's: its store, its ranks)
    if "MASTER_ADDR" not in env and mpi_launch() is not None:
        return True
    if is_initialized():
        return getattr(getattr(default_service(), "config", None), "service", "") == "daemon"
    return daemon_requested()

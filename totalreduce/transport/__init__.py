"""Transports behind one protocol: ``mpi`` (mpi4py) and ``local`` (threads, for tests)."""

from __future__ import annotations

from typing import Any, Protocol

from .base import ANY_SOURCE, Transport

__all__ = ["ANY_SOURCE", "Transport", "open_transport"]


class TransportOptions(Protocol):
    """The options of a service's configuration that choose its transport."""

    @property
    def allow_serialized(self) -> bool: ...


def open_transport(config: TransportOptions, comm: Any = None) -> Transport:
    """The transport an embedded service runs over: MPI on ``comm`` (default: the world).

    ``config`` is the service's :class:`~totalreduce.service.config.Config`.
    totalreduce works on a private duplicate of ``comm``.  MPI is imported (and
    started) here, not when the package is imported.
    """
    from .mpi import MPITransport

    return MPITransport(comm, allow_serialized=config.allow_serialized)

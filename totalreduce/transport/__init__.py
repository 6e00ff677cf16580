"""Transports behind one protocol: ``mpi`` (mpi4py) and ``local`` (threads, for tests); and
daemon mode's shared memory between a node's service and its client processes
(``shm``, ``arena``) and the socket that connects them (``hello``)."""

from __future__ import annotations

from typing import Any, Protocol

from .base import ANY_SOURCE, Transport

__all__ = ["ANY_SOURCE", "Transport", "open_transport"]


class TransportOptions(Protocol):
    """The options of a service's configuration that choose its transport."""

    @property
    def allow_serialized(self) -> bool: ...

    @property
    def service(self) -> str: ...

    @property
    def socket(self) -> str: ...

    @property
    def local_rank(self) -> int: ...


def open_transport(config: TransportOptions, comm: Any = None) -> Transport:
    """The transport a service runs over, as ``config.service`` says.

    ``embedded``: MPI on ``comm`` (default: the world); totalreduce works on a
    private duplicate of it.  MPI is imported (and started) here, not when the
    package is imported.  ``daemon``: this process becomes a client rank of its
    node's service (``config.socket``, ``config.local_rank``); what it gets is a
    :class:`.hello.DaemonClient`, not a transport (it runs no engine), whose
    ``options`` hold the engine options every rank of that world shares.
    """
    if config.service == "daemon":
        if comm is not None:
            from ..errors import InvalidArgumentError

            raise InvalidArgumentError("comm= is an option of the embedded service")
        from .hello import attach

        local = config.local_rank if config.local_rank >= 0 else None
        return attach(config.socket or None, local)  # type: ignore[no-any-return]
    from .mpi import MPITransport

    return MPITransport(comm, allow_serialized=config.allow_serialized)

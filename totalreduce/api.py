"""The thin client API: module-level calls on the one default service ``init()`` creates.

>>> import totalreduce as tr                                        # doctest: +SKIP
>>> tr.init()                                                       # doctest: +SKIP
>>> h = tr.allreduce_async(grad, name="fc1.grad", op="avg", priority=10)  # doctest: +SKIP
>>> ...  # more backward work                                      # doctest: +SKIP
>>> grad = h.wait()                                                 # doctest: +SKIP
>>> tr.shutdown()                                                   # doctest: +SKIP
"""

from __future__ import annotations

import atexit
import os
import threading
from typing import Any

import numpy as np

from .errors import InvalidArgumentError, NotInitializedError
from .group import Group, set_rank_source
from .launch import MPILaunch, check_world, provide_torchrun_env
from .service.config import Config
from .service.handle import HandleLike, ServiceLike
from .service.service import Service
from .transport import open_transport

_default: ServiceLike | None = None
_init_lock = threading.Lock()


def init(comm: Any = None, **options: Any) -> ServiceLike:
    """Start the service of this rank over MPI (idempotent); returns it.

    ``comm`` is an ``mpi4py`` communicator to run over (default: the world;
    totalreduce works on a private duplicate of it).  Options are the fields
    of :class:`~totalreduce.service.config.Config`, also settable as
    ``TOTALREDUCE_<NAME>`` environment variables; keywords win.

    ``service="daemon"`` (or ``TOTALREDUCE_SERVICE=daemon``, or passing
    ``socket=``) makes this process a client rank of its node's ``totalreduce
    serve`` instead of an MPI rank: the same service, the same calls, over
    shared memory.  ``socket`` (or ``TOTALREDUCE_SOCKET``) is the service's
    path, ``local_rank`` (or ``TOTALREDUCE_LOCAL_RANK``) the slot to take.  See
    docs/daemon.md.
    """
    global _default
    if options.get("socket") is not None and options.get("service") is None:
        options["service"] = "daemon"  # a socket says which service to use
    with _init_lock:
        if _default is not None and not _default.closed:
            _check_same(_default, comm, options)
            return _default
        config = Config.load(**options)
        if config.service == "embedded" and (
            options.get("socket") is not None or options.get("local_rank") is not None
        ):
            raise InvalidArgumentError("socket= and local_rank= are options of service='daemon'")
        if config.service == "embedded" and os.environ.get("TOTALREDUCE_SOCKET"):
            raise InvalidArgumentError(
                f"TOTALREDUCE_SOCKET={os.environ['TOTALREDUCE_SOCKET']!r} names a node service, "
                "but this process runs embedded (its own MPI rank, alone unless launched by "
                "mpiexec): set TOTALREDUCE_SERVICE=daemon to be a client of that service, or "
                "unset TOTALREDUCE_SOCKET"
            )
        transport = open_transport(config, comm)
        try:
            if comm is None:  # the world: it must be the job the launcher started
                world = "the node services' job" if config.service == "daemon" else "its MPI world"
                check_world(transport.size, world)
            _default = Service(transport, config)
        except BaseException:
            transport.close()
            raise
        if comm is None and config.service == "embedded":
            local, local_size, _cross, _nodes = _default.node_layout()
            provide_torchrun_env(
                launch=MPILaunch("MPI", _default.rank, _default.size, local, local_size)
            )
        return _default


def _check_same(running: Any, comm: Any, options: dict[str, Any]) -> None:
    """``init()`` again is a no-op only if it asks for what runs: else say what differs."""
    from .errors import InvalidArgumentError

    if comm is not None:
        raise InvalidArgumentError(
            "totalreduce is running already; init(comm=...) cannot change its communicator "
            "(call shutdown() first)"
        )
    config = getattr(running, "config", None)
    if config is None or not options:
        return
    wanted = Config.load(env={}, **options)
    diff = [
        f"{k}={getattr(wanted, k)!r} (running: {getattr(config, k)!r})"
        for k, v in options.items()
        if v is not None and getattr(wanted, k) != getattr(config, k)
    ]
    if diff:
        raise InvalidArgumentError(
            f"totalreduce is running already with other options: {', '.join(diff)}; "
            "call shutdown() first to change them"
        )


def default_service() -> ServiceLike:
    """The default service; raises if ``init()`` was not called."""
    s = _default
    if s is None or s.closed:
        raise NotInitializedError("call totalreduce.init() first")
    return s


def is_initialized() -> bool:
    return _default is not None and not _default.closed


def rank() -> int:
    """This process's rank."""
    return default_service().rank


def size() -> int:
    """The number of ranks."""
    return default_service().size


set_rank_source(rank)  # Partition.active and .coords: the default service's rank


def _node_layout() -> tuple[int, int, int, int]:
    svc = default_service()
    if not hasattr(svc, "node_layout"):
        raise NotInitializedError(
            "local_rank(), local_size(), cross_rank() and cross_size() need a service that "
            "knows its node layout"
        )
    return svc.node_layout()


def local_rank() -> int:
    """This rank's index among the ranks on its node (Horovod's ``local_rank``)."""
    return _node_layout()[0]


def local_size() -> int:
    """The number of ranks on this rank's node (Horovod's ``local_size``)."""
    return _node_layout()[1]


def cross_rank() -> int:
    """This rank's index among the ranks with its local rank, one per node (Horovod's)."""
    return _node_layout()[2]


def cross_size() -> int:
    """The number of ranks with this rank's local rank: the node count on even nodes."""
    return _node_layout()[3]


def allreduce_async(
    x: Any,
    name: str | int | None = None,
    op: str = "sum",
    out: Any = None,
    priority: int = 0,
    algorithm: str | None = None,
    group: Group | None = None,
    dtype: str | None = None,
) -> HandleLike:
    """Start an allreduce of ``x``; see :meth:`Service.allreduce_async`.

    ``op``: ``"sum"``, ``"avg"``, ``"max"``, ``"min"``, ``"product"``, and on
    integer and bool arrays the bitwise ``"band"``, ``"bor"``, ``"bxor"``.
    Element types: float16, float32, float64, bfloat16 (``dtype="bfloat16"``),
    uint8, int8, int16, int32, int64 and bool.
    """
    return default_service().allreduce_async(x, name, op, out, priority, algorithm, group, dtype)


def allreduce(
    x: Any,
    name: str | int | None = None,
    op: str = "sum",
    out: Any = None,
    priority: int = 0,
    algorithm: str | None = None,
    group: Group | None = None,
    dtype: str | None = None,
) -> np.ndarray:
    """Reduce ``x`` across ranks and return the result (blocking)."""
    return default_service().allreduce(x, name, op, out, priority, algorithm, group, dtype)


def broadcast_async(
    x: Any,
    root: int = 0,
    name: str | int | None = None,
    out: Any = None,
    priority: int = 0,
    algorithm: str = "auto",
    group: Group | None = None,
    dtype: str | None = None,
) -> HandleLike:
    """Start a broadcast from ``root``; see :meth:`Service.broadcast_async`."""
    return default_service().broadcast_async(x, root, name, out, priority, algorithm, group, dtype)


def broadcast(
    x: Any,
    root: int = 0,
    name: str | int | None = None,
    out: Any = None,
    priority: int = 0,
    algorithm: str = "auto",
    group: Group | None = None,
    dtype: str | None = None,
) -> np.ndarray:
    """Return rank ``root``'s ``x`` on every rank (blocking)."""
    return default_service().broadcast(x, root, name, out, priority, algorithm, group, dtype)


def barrier_async(
    name: str | int | None = None, algorithm: str = "auto", group: Group | None = None
) -> HandleLike:
    """Start a barrier."""
    return default_service().barrier_async(name, algorithm=algorithm, group=group)


def barrier(
    name: str | int | None = None, algorithm: str = "auto", group: Group | None = None
) -> None:
    """Return once every rank (of ``group``) has entered the barrier."""
    default_service().barrier(name, algorithm=algorithm, group=group)


def pairwise_exchange_async(
    x: Any, steps: int, name: str | int | None = None, **kw: Any
) -> HandleLike:
    """Start Gloo's pairwise-exchange benchmark pattern; see the Service method."""
    return default_service().pairwise_exchange_async(x, steps, name, **kw)


def pairwise_exchange(x: Any, steps: int, name: str | int | None = None, **kw: Any) -> np.ndarray:
    """Gloo's pairwise-exchange benchmark pattern (blocking)."""
    return default_service().pairwise_exchange_async(x, steps, name, **kw).wait()


def reduce_scatter_async(
    x: Any, name: str | int | None = None, op: str = "sum", **kw: Any
) -> HandleLike:
    """Start a reduce-scatter; see :meth:`Service.reduce_scatter_async`."""
    return default_service().reduce_scatter_async(x, name, op, **kw)


def reduce_scatter(x: Any, name: str | int | None = None, op: str = "sum", **kw: Any) -> np.ndarray:
    """This rank's balanced part of the sum of every rank's ``x`` (a new array)."""
    return default_service().reduce_scatter(x, name, op, **kw)


def allgather_async(x: Any, name: str | int | None = None, **kw: Any) -> HandleLike:
    """Start an all-gather; see :meth:`Service.allgather_async`."""
    return default_service().allgather_async(x, name, **kw)


def allgather(x: Any, name: str | int | None = None, **kw: Any) -> np.ndarray:
    """Every rank's ``x`` concatenated in rank order (parts may differ in length)."""
    return default_service().allgather(x, name, **kw)


def neighbor_allreduce_async(x: Any, name: str | int | None = None, **kw: Any) -> HandleLike:
    """Start neighbor averaging; see :meth:`Service.neighbor_allreduce_async`."""
    return default_service().neighbor_allreduce_async(x, name, **kw)


def neighbor_allreduce(x: Any, name: str | int | None = None, **kw: Any) -> np.ndarray:
    """``x`` averaged with this rank's neighbors on a topology (blocking)."""
    return default_service().neighbor_allreduce(x, name, **kw)


def neighbor_allgather_async(x: Any, name: str | int | None = None, **kw: Any) -> HandleLike:
    """Start a neighbor all-gather; see :meth:`Service.neighbor_allgather_async`."""
    return default_service().neighbor_allgather_async(x, name, **kw)


def neighbor_allgather(x: Any, name: str | int | None = None, **kw: Any) -> np.ndarray:
    """The ``x`` of every in-neighbor, stacked in ascending rank order (blocking)."""
    return default_service().neighbor_allgather(x, name, **kw)


def hierarchical_neighbor_allreduce_async(
    x: Any, name: str | int | None = None, **kw: Any
) -> HandleLike:
    """Start node-then-neighbor-nodes averaging; see the Service method."""
    return default_service().hierarchical_neighbor_allreduce_async(x, name, **kw)


def hierarchical_neighbor_allreduce(x: Any, name: str | int | None = None, **kw: Any) -> np.ndarray:
    """Average within the node, then with neighbor nodes (blocking)."""
    return default_service().hierarchical_neighbor_allreduce(x, name, **kw)


def reduce_async(x: Any, root: int = 0, name: str | int | None = None, **kw: Any) -> HandleLike:
    """Start a reduce to ``root``; see :meth:`Service.reduce_async` (``op=``, ``out=``, ...)."""
    return default_service().reduce_async(x, root, name, **kw)


def reduce(x: Any, root: int = 0, name: str | int | None = None, **kw: Any) -> Any:
    """Reduce every rank's ``x`` into rank ``root``: the result there, None elsewhere.

    ``op`` is any of :func:`allreduce_async`'s; ``out=x`` reduces in place on the root.
    """
    return default_service().reduce(x, root, name, **kw)


def gather_async(x: Any, root: int = 0, name: str | int | None = None, **kw: Any) -> HandleLike:
    """Start a gather to ``root``; see :meth:`Service.gather_async`."""
    return default_service().gather_async(x, root, name, **kw)


def gather(x: Any, root: int = 0, name: str | int | None = None, **kw: Any) -> Any:
    """Every rank's ``x`` stacked on rank ``root`` (shape ``(P, *x.shape)``), None elsewhere."""
    return default_service().gather(x, root, name, **kw)


def scatter_async(x: Any, root: int = 0, name: str | int | None = None, **kw: Any) -> HandleLike:
    """Start a scatter from ``root``; see :meth:`Service.scatter_async`."""
    return default_service().scatter_async(x, root, name, **kw)


def scatter(x: Any, root: int = 0, name: str | int | None = None, **kw: Any) -> Any:
    """Part ``r`` of the root's ``x`` on rank ``r``; elsewhere ``x`` is the receiving array.

    >>> part = tr.scatter(table if tr.rank() == 0 else np.empty(4), root=0)  # doctest: +SKIP
    """
    return default_service().scatter(x, root, name, **kw)


def alltoall_async(x: Any, name: str | int | None = None, **kw: Any) -> HandleLike:
    """Start an all-to-all; see :meth:`Service.alltoall_async` (``splits=``, ``recv_splits=``)."""
    return default_service().alltoall_async(x, name, **kw)


def alltoall(x: Any, name: str | int | None = None, **kw: Any) -> np.ndarray:
    """Part ``j`` of ``x`` to rank ``j``; part ``j`` of the result from rank ``j`` (blocking).

    Equal parts by default; ``splits=[...]`` and ``recv_splits=[...]`` give
    uneven ones, as torch's ``all_to_all_single`` does.
    """
    return default_service().alltoall(x, name, **kw)


def send_async(x: Any, dst: int, tag: int = 0, **kw: Any) -> HandleLike:
    """Start sending ``x`` to rank ``dst``; see :meth:`Service.send_async`."""
    return default_service().send_async(x, dst, tag, **kw)


def send(x: Any, dst: int, tag: int = 0, **kw: Any) -> None:
    """Send ``x`` to rank ``dst`` with ``tag``; it meets ``dst``'s matching :func:`recv`.

    Messages from one rank to another on one tag arrive in the order sent (MPI's rule).
    """
    default_service().send(x, dst, tag, **kw)


def recv_async(x: Any, src: int, tag: int = 0, **kw: Any) -> HandleLike:
    """Start receiving from rank ``src`` into ``x``; see :meth:`Service.recv_async`."""
    return default_service().recv_async(x, src, tag, **kw)


def recv(x: Any, src: int, tag: int = 0, **kw: Any) -> np.ndarray:
    """Receive into ``x`` the next message from rank ``src`` with ``tag``; returns ``x``.

    ``x`` must have the sent element count and dtype (both ranks raise otherwise).
    """
    return default_service().recv(x, src, tag, **kw)


def poll(handle: HandleLike) -> bool:
    """True once ``handle``'s op has completed (never blocks)."""
    return handle.done()


def synchronize(handle: HandleLike, timeout: float | None = None) -> Any:
    """Wait for ``handle``'s op and return its result (Horovod's name for ``wait``)."""
    return handle.wait(timeout)


def shutdown(timeout: float | None = None) -> None:
    """Finish in-flight ops (up to ``timeout`` s) and stop the default service."""
    global _default
    with _init_lock:
        s, _default = _default, None
    if s is not None:
        s.shutdown(timeout)


atexit.register(shutdown)

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
import dataclasses
import os
import threading
from collections.abc import Callable
from typing import Any

from .declare import build_function as _build_function
from .declare import forward as _forward
from .declare import signature as _signature
from .errors import InvalidArgumentError, NotInitializedError
from .group import set_rank_source
from .launch import (
    MPILaunch,
    check_daemon_rank,
    check_world,
    launcher_slot,
    provide_torchrun_env,
)
from .ops_table import op as _op_declaration
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
    ``socket=`` or setting ``TOTALREDUCE_SOCKET`` without a service) makes this
    process a client rank of its node's ``totalreduce serve`` instead of an MPI
    rank: the same service, the same calls, over shared memory.  ``socket`` (or
    ``TOTALREDUCE_SOCKET``) is the service's path, ``local_rank`` (or
    ``TOTALREDUCE_LOCAL_RANK``) the slot to take.  See docs/daemon.md.
    """
    global _default
    if options.get("service") is None and (
        options.get("socket") is not None
        or (os.environ.get("TOTALREDUCE_SOCKET") and not os.environ.get("TOTALREDUCE_SERVICE"))
    ):
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
                "but service='embedded' asks for this process's own MPI rank: unset one of them"
            )
        if config.service == "daemon" and config.local_rank < 0:
            slot = launcher_slot()  # torchrun's LOCAL_RANK or srun's SLURM_LOCALID: that slot
            if slot is not None:
                config = dataclasses.replace(config, local_rank=slot[0])
        transport = open_transport(config, comm)
        try:
            if comm is None:  # the world: it must be the job the launcher started
                world = "the node services' job" if config.service == "daemon" else "its MPI world"
                check_world(transport.size, world)
                if config.service == "daemon":
                    local, local_size, node, _nodes = transport.node_layout()
                    where = str(getattr(transport, "socket_path", "its socket"))
                    check_daemon_rank(
                        transport.rank, transport.size, local, local_size, node, where
                    )
            _default = Service(transport, config)
        except BaseException:
            transport.close()
            raise
        if comm is None:
            local, local_size, _cross, _nodes = _default.node_layout()
            who = "MPI" if config.service == "embedded" else "totalreduce serve"
            provide_torchrun_env(
                launch=MPILaunch(who, _default.rank, _default.size, local, local_size)
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


# ---------------------------------------------------------------- the ops, from the table
#
# Each op's two functions come from its record in ops_table.py: ``{name}_async``
# calls the default service's ``{name}_async`` with the declared parameters, and
# ``{name}`` is the same call and ``.wait()`` (for an op declared ``direct``, the
# service's blocking ``{name}``, which has a path of its own).  Nothing else here takes an op's
# arguments (tests/test_declarations.py checks it).


def _numpy_forms(name: str) -> tuple[Callable[..., HandleLike], Callable[..., Any]]:
    """``{name}_async`` and ``{name}`` of the op ``name`` declares (see the comment above)."""
    decl = _op_declaration(name)
    params, more = decl.api_params(), decl.api_more
    start = _signature(params, more=more, returns="HandleLike")
    wait = _signature(params, more=more, returns=decl.returns.value)
    call = f"_service().{decl.method}({_forward(start)})"
    # An op declared ``direct`` blocks through the service's blocking method (its own path).
    blocking = (
        f"_service().{decl.name}({_forward(wait, in_order=True)})"
        if decl.direct
        else f"{call}.wait()"
    )
    env = {"_service": default_service}
    return (
        _build_function(
            decl.method, start, f"return {call}", env, doc=decl.async_doc, module=__name__,
            declared=(decl.name, "async"),
        ),
        _build_function(
            decl.name, wait, f"return {blocking}", env, doc=decl.doc, module=__name__,
            declared=(decl.name, "blocking"),
        ),
    )  # fmt: skip


allreduce_async, allreduce = _numpy_forms("allreduce")
broadcast_async, broadcast = _numpy_forms("broadcast")
barrier_async, barrier = _numpy_forms("barrier")
pairwise_exchange_async, pairwise_exchange = _numpy_forms("pairwise_exchange")
reduce_scatter_async, reduce_scatter = _numpy_forms("reduce_scatter")
allgather_async, allgather = _numpy_forms("allgather")
neighbor_allreduce_async, neighbor_allreduce = _numpy_forms("neighbor_allreduce")
neighbor_allgather_async, neighbor_allgather = _numpy_forms("neighbor_allgather")
hierarchical_neighbor_allreduce_async, hierarchical_neighbor_allreduce = _numpy_forms(
    "hierarchical_neighbor_allreduce"
)
reduce_async, reduce = _numpy_forms("reduce")
gather_async, gather = _numpy_forms("gather")
scatter_async, scatter = _numpy_forms("scatter")
alltoall_async, alltoall = _numpy_forms("alltoall")
send_async, send = _numpy_forms("send")
recv_async, recv = _numpy_forms("recv")


def empty(shape: Any, dtype: Any = "float32") -> Any:
    """A new, uninitialized array for op buffers.  In daemon mode it lives in the node's
    arena (shared memory with the node's service), so an ``allreduce``, ``broadcast`` or
    ``barrier`` of it makes no copy and the result lands in it in place; in embedded
    mode it is ``numpy.empty``.  Its memory goes back when the last array over it goes.

    >>> grad = tr.empty(1 << 20, "float32")                          # doctest: +SKIP
    >>> grad[:] = compute()                                           # doctest: +SKIP
    >>> tr.allreduce(grad, name="g", out=grad, op="avg")              # doctest: +SKIP
    """
    svc = default_service()
    make = getattr(svc, "empty", None)
    if make is None:
        import numpy as np

        return np.empty(shape, dtype)
    return make(shape, dtype)


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

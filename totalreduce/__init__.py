"""totalreduce: asynchronous, priority-driven collective communication for deep learning.

Every rank submits what is ready, in any order, with a priority; a background
comm thread moves it over self-describing frames and a Numba reduce thread
does the arithmetic; the training loop polls or waits only for what it needs.

    import totalreduce as tr
    tr.init()
    h = tr.allreduce_async(grad, name="fc1.grad", op="avg", priority=10)
    grad = h.wait()

``import totalreduce`` imports neither torch nor MPI; ``init()`` starts MPI.
"""

from __future__ import annotations

from .api import (
    allgather,
    allgather_async,
    allreduce,
    allreduce_async,
    alltoall,
    alltoall_async,
    barrier,
    barrier_async,
    broadcast,
    broadcast_async,
    cross_rank,
    cross_size,
    default_service,
    empty,
    gather,
    gather_async,
    hierarchical_neighbor_allreduce,
    hierarchical_neighbor_allreduce_async,
    init,
    is_initialized,
    local_rank,
    local_size,
    neighbor_allgather,
    neighbor_allgather_async,
    neighbor_allreduce,
    neighbor_allreduce_async,
    pairwise_exchange,
    pairwise_exchange_async,
    poll,
    rank,
    recv,
    recv_async,
    reduce,
    reduce_async,
    reduce_scatter,
    reduce_scatter_async,
    scatter,
    scatter_async,
    send,
    send_async,
    shutdown,
    size,
    synchronize,
)
from .errors import (
    FrameError,
    InvalidArgumentError,
    NotInitializedError,
    OpFailedError,
    OpMismatchError,
    OpTimeoutError,
    TotalReduceError,
    TransportError,
)
from .group import Group, Partition
from .service.config import Config
from .service.handle import Handle
from .service.service import Service

__version__ = "0.1.0"

__all__ = [
    "Config",
    "empty",
    "Group",
    "Partition",
    "allgather",
    "allgather_async",
    "hierarchical_neighbor_allreduce",
    "hierarchical_neighbor_allreduce_async",
    "neighbor_allgather",
    "neighbor_allgather_async",
    "neighbor_allreduce",
    "neighbor_allreduce_async",
    "pairwise_exchange",
    "pairwise_exchange_async",
    "reduce_scatter",
    "reduce_scatter_async",
    "FrameError",
    "Handle",
    "InvalidArgumentError",
    "NotInitializedError",
    "OpFailedError",
    "OpMismatchError",
    "OpTimeoutError",
    "Service",
    "TotalReduceError",
    "TransportError",
    "allreduce",
    "allreduce_async",
    "barrier",
    "barrier_async",
    "broadcast",
    "broadcast_async",
    "cross_rank",
    "cross_size",
    "init",
    "is_initialized",
    "local_rank",
    "local_size",
    "poll",
    "rank",
    "default_service",
    "shutdown",
    "size",
    "synchronize",
    "alltoall",
    "alltoall_async",
    "gather",
    "gather_async",
    "recv",
    "recv_async",
    "reduce",
    "reduce_async",
    "scatter",
    "scatter_async",
    "send",
    "send_async",
]

# Window ops (one-sided; BlueFog's names), every name listed once: totalreduce/windows.py.
from . import windows as _windows  # noqa: E402
from .windows import *  # noqa: E402, F403

__all__ += _windows.__all__

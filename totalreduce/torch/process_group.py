"""The ``"totalreduce"`` backend of ``torch.distributed``: c10d's collectives on the engine.

``import totalreduce.torch`` registers it, so unchanged torch code runs on
totalreduce with one word changed::

    import totalreduce.torch  # noqa: F401  (registers the backend)
    dist.init_process_group(backend="totalreduce", init_method="totalreduce://")  # mpiexec
    ddp = DistributedDataParallel(model)                # unchanged DDP

This module owns :class:`TotalReduceProcessGroup` (a Python
``torch.distributed.ProcessGroup``) and the creator torch calls for every
group.  Rules:

- **MPI underneath.** The world is the MPI world of ``totalreduce.init()``;
  torch's rank and world size must be MPI's, so launch with ``mpiexec``.
  ``init_method="totalreduce://"`` takes them, and a store, from MPI; the
  usual ``env://`` works too when ``RANK``/``WORLD_SIZE``/``MASTER_*`` match
  MPI.  Under ``torchrun`` (no MPI world) creating the group raises an error
  saying so.
- **Matching.** c10d calls the collectives of a group in the same order on
  every rank; an op is named after its group, kind, dtype, size and reduce op
  or root, so the k-th such call on one rank meets the k-th on the others and
  the set of names stays small however long training runs.
- **Async.** Every op returns at once with a ``Work`` (:mod:`.futures`);
  ``wait()`` blocks the caller only and raises the op's error.
- **Coverage.** ``all_reduce`` (SUM, AVG, MIN, MAX), ``broadcast``,
  ``all_gather``, ``all_gather_into_tensor``, ``reduce_scatter`` and
  ``reduce_scatter_tensor`` (SUM, AVG), ``barrier``, ``new_group``.  Any other
  op (``reduce``, ``gather``, ``scatter``, ``all_to_all``, ``send``/``recv``,
  PRODUCT and bitwise reductions) raises :class:`UnsupportedOpError` naming it.
"""

from __future__ import annotations

import importlib
import socket
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..api import init
from ..errors import InvalidArgumentError, TotalReduceError
from ..group import Group
from ..service.handle import ServiceLike
from .broadcast_state import broadcast_object
from .collectives import allgather_async, allreduce_async_, broadcast_async_, reduce_scatter_async
from .futures import torch_work
from .tensors import PinnedPool, TensorHandle

#: The name ``init_process_group(backend=...)`` takes.
BACKEND_NAME = "totalreduce"


class UnsupportedOpError(TotalReduceError, NotImplementedError):
    """A ``torch.distributed`` op the totalreduce backend does not provide."""


_REDUCE_OPS = {
    dist.ReduceOp.SUM: "sum",
    dist.ReduceOp.AVG: "avg",
    dist.ReduceOp.MIN: "min",
    dist.ReduceOp.MAX: "max",
}


def _reduce_op(what: str, op: Any, allowed: tuple[str, ...] = ("sum", "avg", "min", "max")) -> str:
    for torch_op, name in _REDUCE_OPS.items():
        if op == torch_op and name in allowed:
            return name
    raise UnsupportedOpError(
        f"the totalreduce backend's {what} takes ReduceOp {', '.join(a.upper() for a in allowed)}; "
        f"got {getattr(getattr(op, 'op', op), 'name', op)}"
    )


def _work(handles: list[TensorHandle], result: Any, finish: Any = None) -> Any:
    """A ``Work`` (:func:`~totalreduce.torch.futures.torch_work`) whose future is ``result``
    once every handle completed and ``finish`` (copies out of the engine's buffers) ran."""

    def value() -> Any:
        if finish is not None:
            finish()
        return result

    return torch_work(handles, value)


class TotalReduceProcessGroup(dist.ProcessGroup):
    """One ``torch.distributed`` group on a totalreduce service (see the module docstring).

    ``ranks`` are the group's ranks in the service's world, in group-rank
    order; ``group_id`` is torch's name of the group (the same on every rank).
    """

    def __init__(self, service: ServiceLike, ranks: list[int], group_id: str) -> None:
        me = ranks.index(service.rank)
        super().__init__(me, len(ranks))
        self.service = service
        self.ranks = list(ranks)
        self.group_id = group_id
        self._group = None if len(ranks) == service.size else Group(self.ranks)
        self._prefix = f"torch.distributed.{group_id}."
        # Staging copies (CUDA, non-contiguous tensors) reuse buffers: pinned ones are slow to make.
        self.staging = PinnedPool()

    # ------------------------------------------------------------------ naming

    def _name(self, kind: str, t: torch.Tensor, detail: Any = "") -> str:
        return f"{self._prefix}{kind}.{str(t.dtype).removeprefix('torch.')}.{t.numel()}.{detail}"

    def getBackendName(self) -> str:  # noqa: N802 - c10d's name
        return BACKEND_NAME

    def _tensors(self, what: str, tensors: Any) -> list[torch.Tensor]:
        if isinstance(tensors, torch.Tensor):
            return [tensors]
        out = list(tensors)
        if not out:
            raise InvalidArgumentError(f"{what} got no tensors")
        return out

    # ------------------------------------------------------------------ collectives

    def allreduce(self, tensors: Any, opts: Any = None) -> Any:
        """``dist.all_reduce``: in place, SUM, AVG, MIN or MAX."""
        op = _reduce_op("all_reduce", (opts or dist.AllreduceOptions()).reduceOp)
        ts = self._tensors("all_reduce", tensors)
        handles = [
            allreduce_async_(
                t,
                self._name("allreduce", t, op),
                op,
                group=self._group,
                staging=self.staging,
                service=self.service,
            )
            for t in ts
        ]
        return _work(handles, ts)

    def allreduce_coalesced(self, tensors: Any, opts: Any = None) -> Any:
        """``dist.all_reduce_coalesced``: one allreduce per tensor, all in flight together."""
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors: Any, opts: Any = None) -> Any:
        """``dist.broadcast``: in place from the group rank ``opts.rootRank``."""
        root = int((opts or dist.BroadcastOptions()).rootRank)
        ts = self._tensors("broadcast", tensors)
        handles = [
            broadcast_async_(
                t,
                root,
                self._name("broadcast", t, root),
                group=self._group,
                staging=self.staging,
                service=self.service,
            )
            for t in ts
        ]
        return _work(handles, ts)

    def allgather(self, output_lists: Any, inputs: Any, opts: Any = None) -> Any:
        """``dist.all_gather``: every rank's tensor into ``output_lists[0][r]``."""
        ins = self._tensors("all_gather", inputs)
        if len(ins) != 1 or len(output_lists) != 1:
            raise UnsupportedOpError("the totalreduce backend's all_gather takes one tensor")
        x, outs = ins[0], list(output_lists[0])
        if len(outs) != self.size() or any(o.numel() != x.numel() for o in outs):
            raise InvalidArgumentError(
                f"all_gather: expected {self.size()} output tensors of {x.numel()} elements, got "
                f"{[o.numel() for o in outs]}"
            )
        h = self._gather(x)

        def scatter_out() -> None:
            whole = h.wait()
            with torch.no_grad():
                for r, o in enumerate(outs):
                    o.copy_(whole[r * x.numel() : (r + 1) * x.numel()].view(o.shape))

        return _work([h], output_lists, scatter_out)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        """``dist.all_gather_into_tensor``: every rank's tensor, joined along dimension 0."""
        if output.numel() != input.numel() * self.size():
            raise InvalidArgumentError(
                f"all_gather_into_tensor: the output has {output.numel()} elements, expected "
                f"{self.size()} x {input.numel()}"
            )
        h = self._gather(input)

        def copy_out() -> None:
            with torch.no_grad():
                output.copy_(h.wait().view(output.shape))

        return _work([h], output, copy_out)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        """``dist.all_gather_into_tensor`` (torch >= 2.13 calls it by this name)."""
        return self._allgather_base(output, input, opts)

    def _gather(self, x: torch.Tensor) -> TensorHandle:
        return allgather_async(
            x,
            self._name("allgather", x),
            group=self._group,
            flat=True,
            staging=self.staging,
            service=self.service,
        )

    def _reduce_scatter_base(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> Any:
        """``dist.reduce_scatter_tensor``: part ``r`` of the sum (or mean) to group rank ``r``."""
        op = _reduce_op(
            "reduce_scatter_tensor",
            (opts or dist.ReduceScatterOptions()).reduceOp,
            ("sum", "avg"),
        )
        if input.numel() != output.numel() * self.size():
            raise InvalidArgumentError(
                f"reduce_scatter_tensor: the input has {input.numel()} elements, expected "
                f"{self.size()} x {output.numel()}"
            )
        h = reduce_scatter_async(
            input,
            self._name("reduce_scatter", input, op),
            op,
            group=self._group,
            staging=self.staging,
            service=self.service,
        )

        def copy_out() -> None:
            with torch.no_grad():
                output.copy_(h.wait().view(output.shape))

        return _work([h], output, copy_out)

    def reduce_scatter_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> Any:
        """``dist.reduce_scatter_tensor`` (torch >= 2.13 calls it by this name)."""
        return self._reduce_scatter_base(output, input, opts)

    def reduce_scatter(self, outputs: Any, input_lists: Any, opts: Any = None) -> Any:
        """``dist.reduce_scatter``: ``input_lists[0][r]`` of every rank summed into rank ``r``."""
        outs = self._tensors("reduce_scatter", outputs)
        if len(outs) != 1 or len(input_lists) != 1:
            raise UnsupportedOpError("the totalreduce backend's reduce_scatter takes one tensor")
        parts = list(input_lists[0])
        if len(parts) != self.size() or any(p.numel() != outs[0].numel() for p in parts):
            raise InvalidArgumentError(
                f"reduce_scatter: expected {self.size()} inputs of {outs[0].numel()} elements"
            )
        joined = torch.cat([p.reshape(-1) for p in parts])
        return self._reduce_scatter_base(outs[0], joined, opts)

    def barrier(self, opts: Any = None) -> Any:
        """``dist.barrier``: returns once every rank of the group has entered it."""
        h = self.service.barrier_async(f"{self._prefix}barrier", group=self._group)
        return _work([TensorHandle(h, lambda _raw: torch.empty(0))], None)

    # ------------------------------------------------------------------ what it refuses

    def _unsupported(self, op: str) -> UnsupportedOpError:
        return UnsupportedOpError(
            f"the totalreduce torch.distributed backend does not provide {op}; it provides "
            "all_reduce, broadcast, all_gather, all_gather_into_tensor, reduce_scatter, "
            "reduce_scatter_tensor and barrier (use backend='cpu:gloo' beside it for the rest)"
        )

    def reduce(self, *args: Any, **kwargs: Any) -> Any:
        raise self._unsupported("reduce")

    def gather(self, *args: Any, **kwargs: Any) -> Any:
        raise self._unsupported("gather")

    def scatter(self, *args: Any, **kwargs: Any) -> Any:
        raise self._unsupported("scatter")

    def alltoall(self, *args: Any, **kwargs: Any) -> Any:
        raise self._unsupported("all_to_all")

    def alltoall_base(self, *args: Any, **kwargs: Any) -> Any:
        raise self._unsupported("all_to_all_single")

    def send(self, *args: Any, **kwargs: Any) -> Any:
        raise self._unsupported("send")

    def recv(self, *args: Any, **kwargs: Any) -> Any:
        raise self._unsupported("recv")

    def recv_anysource(self, *args: Any, **kwargs: Any) -> Any:
        raise self._unsupported("recv from any source")

    def allgather_coalesced(self, *args: Any, **kwargs: Any) -> Any:
        raise self._unsupported("all_gather_coalesced")

    def monitored_barrier(self, *args: Any, **kwargs: Any) -> Any:
        raise self._unsupported("monitored_barrier")

    def __repr__(self) -> str:
        return (
            f"<TotalReduceProcessGroup {self.group_id!r} rank {self.rank()} of {self.size()} "
            f"(world ranks {self.ranks})>"
        )


def create_process_group(
    options: Any, _backend_options: Any = None, *, service: ServiceLike | None = None
) -> TotalReduceProcessGroup:
    """What torch calls for ``init_process_group``/``new_group`` with this backend.

    Starts (or reuses) the MPI service of ``totalreduce.init()`` (or uses
    ``service``) and checks that torch's view of the group agrees with it.
    """
    if service is None:
        service = init()
    ranks = [int(r) for r in options.global_ranks_in_group] or list(range(options.group_size))
    group_id = str(options.group_id)
    if len(ranks) != options.group_size or max(ranks, default=0) >= service.size:
        raise TotalReduceError(
            f"the totalreduce backend runs over MPI: torch asks for group {group_id!r} of "
            f"{options.group_size} ranks {ranks} but the MPI world has {service.size} "
            "(launch with mpiexec -n N; under torchrun there is no MPI world: use gloo or nccl "
            "there, or launch the same script with mpiexec)"
        )
    if service.rank not in ranks or ranks.index(service.rank) != options.group_rank:
        raise TotalReduceError(
            f"the totalreduce backend runs over MPI: torch says this process is rank "
            f"{options.group_rank} of group {group_id!r} (world ranks {ranks}), but it is MPI "
            f"rank {service.rank}; let MPI set the ranks (init_method='totalreduce://')"
        )
    return TotalReduceProcessGroup(service, ranks, group_id)


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


def register() -> None:
    """Register the backend and the ``totalreduce://`` init method (idempotent)."""
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(
            BACKEND_NAME, create_process_group, extended_api=True, devices=["cpu", "cuda"]
        )
    # The module, not the function torch.distributed re-exports under the same name.
    rdzv = importlib.import_module("torch.distributed.rendezvous")
    if BACKEND_NAME not in rdzv._rendezvous_handlers:
        rdzv.register_rendezvous_handler(BACKEND_NAME, rendezvous)

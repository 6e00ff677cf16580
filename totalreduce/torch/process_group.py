"""The ``"totalreduce"`` backend of ``torch.distributed``: c10d's collectives on the engine.

``import totalreduce.torch`` registers it, so unchanged torch code runs on
totalreduce with one word changed::

    import totalreduce.torch  # noqa: F401  (registers the backend)
    dist.init_process_group(backend="totalreduce", init_method="totalreduce://")  # mpiexec
    ddp = DistributedDataParallel(model)                # unchanged DDP

This module owns :class:`TotalReduceProcessGroup` (a Python
``torch.distributed.ProcessGroup``: c10d's ops), the creator torch calls for every
group and the registration.  The group's plumbing (its names, buffers and ``Work``
objects, the reduce ops) is its base, :class:`~.group_core.GroupCore`; the
``totalreduce://`` init method is :func:`~.launching.rendezvous`.  Rules:

- **totalreduce's world underneath.** The world is that of ``totalreduce.init()``:
  MPI's (launch with ``mpiexec``), or, with ``TOTALREDUCE_SERVICE=daemon``, the node
  services' (launch with ``torchrun``, ``srun`` or plain ``python``; each process takes
  the slot its ``LOCAL_RANK`` names).  torch's rank and world size must be
  totalreduce's.  ``init_method="totalreduce://"`` takes them, and a store, from
  totalreduce; the usual ``env://`` works too when ``RANK``/``WORLD_SIZE``/``MASTER_*``
  match.  Under ``torchrun`` without a node service (no MPI world) creating the group
  raises an error saying so.
- **Matching.** c10d calls the collectives of a group in the same order on
  every rank; an op is named after its group, kind, dtype, size and reduce op
  or root, so the k-th such call on one rank meets the k-th on the others and
  the set of names stays small however long training runs.
- **Async.** Every op returns at once with a ``Work`` (:mod:`.futures`);
  ``wait()`` blocks the caller only and raises the op's error.
- **Named.** torch keeps a group's name in its backend; this group is its own
  backend and keeps the name c10d sets, so DeviceMesh, DTensor, the
  functional collectives and ``torch.distributed.checkpoint`` find it.
- **Coverage.** Every op gloo has on CPU, each on the engine's op of the same
  kind: ``all_reduce`` and ``reduce`` (SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR,
  BXOR), ``broadcast``, ``all_gather`` (into a list or a tensor), ``gather``,
  ``scatter``, ``reduce_scatter`` (list or tensor), ``all_to_all`` and
  ``all_to_all_single`` (equal or unequal splits), ``send``/``recv`` (tags; not
  from any source), the coalesced forms, ``barrier`` and a
  ``monitored_barrier`` (``dist.monitored_barrier`` on a totalreduce group is routed to
  it); dtypes float16/32/64, bfloat16, int8/16/32/64,
  uint8 and bool, none widened.
- **Timeouts.** ``Work.wait()`` raises :class:`~totalreduce.OpTimeoutError`
  naming the op once ``opts.timeout`` (else the group's timeout) has passed
  since submission, and re-raises an op's failure.
"""

from __future__ import annotations

import importlib
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..api import init
from ..errors import InvalidArgumentError, OpTimeoutError, TotalReduceError
from ..service.handle import HandleLike, ServiceLike
from .collectives import (
    allgather_async,
    allreduce_async_,
    broadcast_async_,
    in_place_result,
    reduce_scatter_async,
)
from .group_core import (
    BACKEND_NAME,
    GroupCore,
    UnsupportedOpError,
    _joined,
    _Part,
    _reduce_op,
)
from .launching import rendezvous
from .tensors import TensorHandle, host_buffer


class TotalReduceProcessGroup(GroupCore):
    """One ``torch.distributed`` group on a totalreduce service (see the module docstring).

    ``ranks`` are the group's ranks in the service's world, in group-rank
    order; ``group_id`` is torch's name of the group (the same on every rank).
    """

    # ------------------------------------------------------------------ collectives

    def allreduce(self, tensors: Any, opts: Any = None) -> Any:
        """``dist.all_reduce``: in place, SUM, AVG, MIN or MAX."""
        op = _reduce_op("all_reduce", (opts or dist.AllreduceOptions()).reduceOp)
        ts = self._tensors("all_reduce", tensors)
        handles = [
            allreduce_async_(
                t,
                self._name("all_reduce", t, op),
                op,
                group=self._group,
                staging=self.staging,
                service=self.service,
            )
            for t in ts
        ]
        return self._work("all_reduce", opts, handles, ts)

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
        return self._work("broadcast", opts, handles, ts)

    def allgather(self, output_lists: Any, inputs: Any, opts: Any = None) -> Any:
        """``dist.all_gather``: every rank's tensor into ``output_lists[0][r]``."""
        return self._work("all_gather", opts, *self._all_gather(output_lists, inputs))

    def _all_gather(self, output_lists: Any, inputs: Any) -> _Part:
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

        return [h], output_lists, scatter_out

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        """``dist.all_gather_into_tensor``: every rank's tensor, joined along dimension 0."""
        parts = self._all_gather_into_tensor(output, input)
        return self._work("all_gather_into_tensor", opts, *parts)

    def _all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor) -> _Part:
        if output.numel() != input.numel() * self.size():
            raise InvalidArgumentError(
                f"all_gather_into_tensor: the output has {output.numel()} elements, expected "
                f"{self.size()} x {input.numel()}"
            )
        h = self._gather(input)

        def copy_out() -> None:
            with torch.no_grad():
                output.copy_(h.wait().view(output.shape))

        return [h], output, copy_out

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        """``dist.all_gather_into_tensor`` (torch >= 2.13 calls it by this name)."""
        return self._allgather_base(output, input, opts)

    def _gather(self, x: torch.Tensor) -> TensorHandle:
        # torch's all-gathers take equal parts: known, so not exchanged first (one op)
        return allgather_async(
            x,
            self._name("all_gather", x),
            group=self._group,
            flat=True,
            counts=(x.numel(),) * self.size(),
            staging=self.staging,
            service=self.service,
        )

    def _reduce_scatter_base(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> Any:
        """``dist.reduce_scatter_tensor``: part ``r`` of the sum (or mean) to group rank ``r``."""
        parts = self._reduce_scatter_tensor(output, input, opts)
        return self._work("reduce_scatter_tensor", opts, *parts)

    def _reduce_scatter_tensor(self, output: torch.Tensor, input: torch.Tensor, opts: Any) -> _Part:
        op = _reduce_op(
            "reduce_scatter_tensor",
            (opts or dist.ReduceScatterOptions()).reduceOp,
        )
        if input.numel() != output.numel() * self.size():
            raise InvalidArgumentError(
                f"reduce_scatter_tensor: the input has {input.numel()} elements, expected "
                f"{self.size()} x {output.numel()}"
            )
        h = reduce_scatter_async(
            input,
            self._name("reduce_scatter_tensor", input, op),
            op,
            group=self._group,
            staging=self.staging,
            service=self.service,
        )

        def copy_out() -> None:
            with torch.no_grad():
                output.copy_(h.wait().view(output.shape))

        return [h], output, copy_out

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
        return self._barrier(opts, "barrier")

    def _barrier(self, opts: Any, what: str) -> Any:
        h = self.service.barrier_async(f"{self._prefix}barrier", group=self._group)
        return self._work(what, opts, [h], None)

    def monitored_barrier(self, timeout: Any = None, wait_all_ranks: bool = False) -> None:
        """gloo's ``monitored_barrier``: a barrier that raises once ``timeout`` passed,
        naming the group ranks it still waits for (``dist.monitored_barrier`` on a
        totalreduce group comes here).  The engine knows every rank it waits for at
        once, so ``wait_all_ranks`` changes nothing.  The barrier stays in flight: a late
        rank that enters its own completes it."""
        if isinstance(timeout, timedelta):
            seconds: float | None = timeout.total_seconds()
        elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
            seconds = float(timeout)
        elif timeout is None:
            seconds = self.timeout_s
        else:
            raise InvalidArgumentError(
                f"monitored_barrier: timeout must be a timedelta or seconds, got {timeout!r}"
            )
        h = self.service.barrier_async(f"{self._prefix}monitored_barrier", group=self._group)
        try:
            h.wait(seconds)
        except OpTimeoutError as exc:
            waiting = self._missing(h)
            raise OpTimeoutError(
                f"monitored_barrier on torch.distributed group {self.group_id!r} (rank "
                f"{self.rank()} of {self.size()}): group ranks {waiting} did not pass it "
                f"within {seconds:g} s ({exc})"
            ) from None

    # ------------------------------------------------------------------ rooted and point-to-point

    def reduce(self, tensors: Any, opts: Any = None) -> Any:
        """``dist.reduce``: every rank's tensor reduced into group rank ``opts.rootRank``'s."""
        opts = opts or dist.ReduceOptions()
        op = _reduce_op("reduce", opts.reduceOp)
        root = int(opts.rootRank)
        ts = self._tensors("reduce", tensors)
        bufs = [self._buffer(t, "reduce") for t in ts]
        handles: list[HandleLike] = [
            TensorHandle(
                self.service.reduce_async(
                    b.array,
                    root,
                    self._name("reduce", b.tensor, f"{op}.{root}"),
                    op=op,
                    out=b.array if self.rank() == root else None,
                    group=self._group,
                    **b.engine_kwargs,
                ),
                in_place_result(b),
            )
            for b in bufs
        ]
        return self._work("reduce", opts, handles, ts)

    def gather(self, output_lists: Any, inputs: Any, opts: Any = None) -> Any:
        """``dist.gather``: every rank's tensor into ``output_lists[0][r]`` on the root."""
        opts = opts or dist.GatherOptions()
        root = int(opts.rootRank)
        ins = self._tensors("gather", inputs)
        if len(ins) != 1:
            raise UnsupportedOpError("the totalreduce backend's gather takes one tensor")
        b = self._buffer(ins[0], "gather")
        h = self.service.gather_async(
            b.array,
            root,
            self._name("gather", b.tensor, root),
            group=self._group,
            **b.engine_kwargs,
        )
        outs = list(output_lists[0]) if self.rank() == root else []

        def copy_out() -> None:
            b.release()
            if outs:
                whole = b.as_tensor(h.wait())
                with torch.no_grad():
                    for r, o in enumerate(outs):
                        o.copy_(whole[r].view(o.shape))

        return self._work("gather", opts, [h], output_lists, copy_out)

    def scatter(self, outputs: Any, input_lists: Any, opts: Any = None) -> Any:
        """``dist.scatter``: ``input_lists[0][r]`` of the root into rank ``r``'s output."""
        opts = opts or dist.ScatterOptions()
        root = int(opts.rootRank)
        outs = self._tensors("scatter", outputs)
        if len(outs) != 1:
            raise UnsupportedOpError("the totalreduce backend's scatter takes one tensor")
        out = self._buffer(outs[0], "scatter")
        if self.rank() == root:
            whole = torch.cat([p.detach().reshape(-1).cpu() for p in input_lists[0]])
            x = host_buffer(whole, "scatter")
            h = self.service.scatter_async(
                x.array,
                root,
                self._name("scatter", outs[0], root),
                out=out.array.reshape(-1),
                group=self._group,
                **x.engine_kwargs,
            )
        else:
            h = self.service.scatter_async(
                out.array,
                root,
                self._name("scatter", outs[0], root),
                group=self._group,
                **out.engine_kwargs,
            )
        return self._work("scatter", opts, [TensorHandle(h, in_place_result(out))], outs)

    def alltoall_base(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: Any,
        input_split_sizes: Any,
        opts: Any = None,
    ) -> Any:
        """``dist.all_to_all_single``: equal parts, or rows along dimension 0 as split."""
        what = "all_to_all_single"
        p = self.size()
        ob, ib = self._buffer(output, "all_to_all_single"), self._buffer(input, "all_to_all")
        splits = recv_splits = None
        if list(input_split_sizes) or list(output_split_sizes):
            in_row = input.numel() // max(input.shape[0], 1) if input.dim() else 1
            out_row = output.numel() // max(output.shape[0], 1) if output.dim() else 1
            ins = list(input_split_sizes) or [input.shape[0] // p] * p
            outs = list(output_split_sizes) or [output.shape[0] // p] * p
            splits = [int(n) * in_row for n in ins]
            recv_splits = [int(n) * out_row for n in outs]
        h = self.service.alltoall_async(
            ib.array.reshape(-1),
            # Uneven splits give every rank its own sizes: the name carries none then.
            self._name(what, input) if splits is None else self._uneven(what, input),
            splits=splits,
            recv_splits=recv_splits,
            out=ob.array.reshape(-1),
            group=self._group,
            **ib.engine_kwargs,
        )
        handles: list[HandleLike] = [TensorHandle(h, in_place_result(ob))]
        return self._work(what, opts, handles, output, ib.release)

    def alltoall(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> Any:
        """``dist.all_to_all``: ``input_tensors[j]`` to rank ``j``, rank ``j``'s into ``[j]``."""
        outs, ins = list(output_tensors), list(input_tensors)
        if len(outs) != self.size() or len(ins) != self.size():
            raise InvalidArgumentError(
                f"all_to_all on {self.size()} ranks takes {self.size()} input and output tensors; "
                f"got {len(ins)} and {len(outs)}"
            )
        joined_in = torch.cat([t.detach().reshape(-1).cpu() for t in ins])
        joined_out = torch.empty(sum(o.numel() for o in outs), dtype=outs[0].dtype)
        ib, ob = host_buffer(joined_in, "all_to_all"), host_buffer(joined_out, "all_to_all")
        h = self.service.alltoall_async(
            ib.array,
            self._uneven("all_to_all", joined_in, "_list"),
            splits=[t.numel() for t in ins],
            recv_splits=[o.numel() for o in outs],
            out=ob.array,
            group=self._group,
            **ib.engine_kwargs,
        )

        def copy_out() -> None:
            at = 0
            with torch.no_grad():
                for o in outs:
                    o.copy_(joined_out[at : at + o.numel()].view(o.shape))
                    at += o.numel()

        return self._work("all_to_all", opts, [h], outs, copy_out)

    def send(self, tensors: Any, dst: int, tag: int = 0) -> Any:
        """``dist.send``/``isend`` to group rank ``dst`` (completes once received there)."""
        bufs = [self._buffer(t, "send") for t in self._tensors("send", tensors)]
        handles = [
            self.service.send_async(b.array, self.ranks[int(dst)], int(tag), **b.engine_kwargs)
            for b in bufs
        ]
        return self._untimed("send", handles, None, lambda: [b.release() for b in bufs])

    def recv(self, tensors: Any, src: int, tag: int = 0) -> Any:
        """``dist.recv``/``irecv`` from group rank ``src`` into the tensor."""
        ts = self._tensors("recv", tensors)
        bufs = [self._buffer(t, "recv") for t in ts]
        handles: list[HandleLike] = [
            TensorHandle(
                self.service.recv_async(b.array, self.ranks[int(src)], int(tag), **b.engine_kwargs),
                in_place_result(b),
            )
            for b in bufs
        ]
        return self._untimed("recv", handles, ts)

    def recv_anysource(self, *args: Any, **kwargs: Any) -> Any:
        """Refused: a receive from any source has no place in name-and-generation matching."""
        raise UnsupportedOpError(
            "the totalreduce backend's recv needs src=: a receive from any source cannot be "
            "matched by name and generation"
        )

    # ------------------------------------------------------------------ coalesced forms
    # One Work over every part's handles: its future completes when all of them have.

    def allgather_coalesced(self, output_lists: Any, inputs: Any, opts: Any = None) -> Any:
        """``all_gather_coalesced``: one all_gather per input, all in flight together."""
        parts = [
            self._all_gather([outs], [x]) for outs, x in zip(output_lists, inputs, strict=True)
        ]
        return self._work("all_gather_coalesced", opts, *_joined(parts, output_lists))

    def allgather_into_tensor_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
        """The coalescing manager's all_gather_into_tensor: one per pair, all in flight."""
        parts = [self._all_gather_into_tensor(o, i) for o, i in zip(outputs, inputs, strict=True)]
        return self._work("all_gather_into_tensor_coalesced", opts, *_joined(parts, outputs))

    def reduce_scatter_tensor_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
        """The coalescing manager's reduce_scatter_tensor: one per pair, all in flight."""
        parts = [
            self._reduce_scatter_tensor(o, i, opts) for o, i in zip(outputs, inputs, strict=True)
        ]
        return self._work("reduce_scatter_tensor_coalesced", opts, *_joined(parts, outputs))

    def __repr__(self) -> str:
        return (
            f"<TotalReduceProcessGroup {self.group_id!r} rank {self.rank()} of {self.size()} "
            f"(world ranks {self.ranks})>"
        )


def create_process_group(
    options: Any, _backend_options: Any = None, *, service: ServiceLike | None = None
) -> TotalReduceProcessGroup:
    """What torch calls for ``init_process_group``/``new_group`` with this backend.

    Starts (or reuses) the service of ``totalreduce.init()`` (or uses ``service``) and
    checks that torch's view of the group agrees with it.
    """
    if service is None:
        service = init()
    ranks = [int(r) for r in options.global_ranks_in_group] or list(range(options.group_size))
    group_id = str(options.group_id)
    if len(ranks) != options.group_size or max(ranks, default=0) >= service.size:
        raise TotalReduceError(
            f"the totalreduce backend runs over totalreduce's world: torch asks for group "
            f"{group_id!r} of {options.group_size} ranks {ranks} but that world has "
            f"{service.size} (launch with mpiexec -n N, or, under torchrun, start a node "
            "service and set TOTALREDUCE_SERVICE=daemon: docs/daemon.md)"
        )
    if service.rank not in ranks or ranks.index(service.rank) != options.group_rank:
        raise TotalReduceError(
            f"the totalreduce backend runs over totalreduce's world: torch says this process "
            f"is rank {options.group_rank} of group {group_id!r} (world ranks {ranks}), but it "
            f"is {_whose(service)} rank {service.rank}; let totalreduce set the ranks "
            "(init_method='totalreduce://')"
        )
    return TotalReduceProcessGroup(
        service, ranks, group_id, getattr(options, "timeout", None) or timedelta(minutes=30)
    )


def _whose(service: ServiceLike) -> str:
    """Who gave ``service`` its rank: MPI, or the node services of daemon mode."""
    config = getattr(service, "config", None)
    return "the node services'" if getattr(config, "service", "") == "daemon" else "MPI"


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
    _route_monitored_barrier()


def _route_monitored_barrier() -> None:
    """``dist.monitored_barrier`` refuses every backend but gloo by name; on a totalreduce
    group it runs the group's own (a barrier that raises naming the op and the ranks it
    still waits for once ``timeout`` passed).  Every other group goes to torch's, unchanged.
    """
    c10d = importlib.import_module("torch.distributed.distributed_c10d")
    torchs = c10d.monitored_barrier
    if getattr(torchs, "__totalreduce__", False):
        return

    def monitored_barrier(
        group: Any = None, timeout: Any = None, wait_all_ranks: bool = False
    ) -> None:
        pg = group if group is not None else c10d._get_default_group()
        if isinstance(pg, TotalReduceProcessGroup):
            return pg.monitored_barrier(timeout, wait_all_ranks)
        return torchs(group, timeout, wait_all_ranks)  # type: ignore[no-any-return]

    monitored_barrier.__doc__ = torchs.__doc__
    monitored_barrier.__wrapped__ = torchs  # type: ignore[attr-defined]
    monitored_barrier.__totalreduce__ = True  # type: ignore[attr-defined]
    c10d.monitored_barrier = monitored_barrier
    dist.monitored_barrier = monitored_barrier

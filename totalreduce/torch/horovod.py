"""Horovod's module-level names that ``totalreduce.torch`` did not have, with Horovod's meaning.

``import totalreduce.torch as hvd`` then runs scripts that call ``hvd.alltoall``,
``hvd.reducescatter``, ``hvd.grouped_allreduce`` and ``hvd.join``:

- :func:`alltoall`: rows (dimension 0) split among the ranks, ``splits[j]`` rows to rank
  ``j`` (equal parts without ``splits``); returns the rows received, in rank order, and,
  when ``splits`` was given, how many came from each rank;
- :func:`reducescatter`: the sum (average by default, as Horovod) of every rank's tensor,
  split along dimension 0, earlier ranks taking one more row when it does not divide;
- :func:`grouped_allreduce`: a list of tensors reduced together (one handle for all);
- :func:`join`: this rank is out of data; returns the rank that joined last.  With a
  :class:`DistributedOptimizer` it keeps the others' steps going (its ``join()``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from ..declare import Alias, Form, Kind, Takes, build_function, forward, signature
from ..errors import InvalidArgumentError
from ..ops_table import op as op_declaration
from ..service.handle import ServiceLike
from .collectives import resolve_service, submit
from .tensors import TensorHandle, host_buffer


def _rows_split(rows: int, p: int) -> list[int]:
    """Horovod's split of ``rows`` among ``p`` ranks: earlier ranks take the remainder."""
    base, extra = divmod(rows, p)
    return [base + (1 if j < extra else 0) for j in range(p)]


def alltoall(
    tensor: torch.Tensor,
    splits: Sequence[int] | torch.Tensor | None = None,
    name: str | int | None = None,
    *,
    service: ServiceLike | None = None,
) -> Any:
    """Send ``splits[j]`` rows of ``tensor`` to rank ``j``; returns the rows received (and,
    with ``splits``, a tensor of how many rows came from each rank)."""
    svc = resolve_service(service)
    p = svc.size
    rows = tensor.shape[0] if tensor.dim() else 0
    row_elems = int(np.prod(tensor.shape[1:])) if tensor.dim() > 1 else 1
    given = splits is not None
    if splits is None:
        if rows % p:
            raise InvalidArgumentError(
                f"alltoall {name!r}: {rows} rows do not divide among {p} ranks; pass splits="
            )
        send_rows = [rows // p] * p
    else:
        listed = splits.tolist() if isinstance(splits, torch.Tensor) else splits
        send_rows = [int(v) for v in listed]
        if len(send_rows) != p or any(v < 0 for v in send_rows) or sum(send_rows) != rows:
            raise InvalidArgumentError(
                f"alltoall {name!r}: splits {send_rows} must be {p} counts >= 0 adding up to "
                f"the tensor's {rows} rows"
            )
    base = "alltoall" if name is None else str(name)
    counts = svc.alltoall(np.array(send_rows, dtype=np.int64), name=f"{base}.splits")
    recv_rows = [int(v) for v in counts]
    src = tensor.detach().contiguous().cpu()
    buf = host_buffer(src)
    out = svc.alltoall(
        buf.array.reshape(-1), name=base,
        splits=[r * row_elems for r in send_rows], recv_splits=[r * row_elems for r in recv_rows],
        **buf.engine_kwargs,
    )  # fmt: skip
    result = buf.as_tensor(out).reshape(sum(recv_rows), *tensor.shape[1:]).to(tensor.device)
    buf.release()
    if given:
        return result, torch.tensor(recv_rows, dtype=torch.int32)
    return result


def reducescatter(
    tensor: torch.Tensor,
    name: str | int | None = None,
    op: str | None = None,
    *,
    average: bool | None = None,
    service: ServiceLike | None = None,
) -> torch.Tensor:
    """Horovod's ``reducescatter``: this rank's rows of the reduction (average by default)."""
    svc = resolve_service(service)
    p = svc.size
    op_name = "avg" if op is None and average is None else ("avg" if average else (op or "sum"))
    op_name = {"Average": "avg", "Sum": "sum"}.get(op_name, op_name)
    if op_name not in ("avg", "sum"):
        raise InvalidArgumentError(f"reducescatter {name!r}: op must be average or sum, got {op!r}")
    rows = tensor.shape[0]
    parts = _rows_split(rows, p)
    base = "reducescatter" if name is None else str(name)
    # Each rank's part of every rank's tensor comes to it (one all-to-all: the bytes of a
    # direct reduce-scatter), then the parts add up here in rank order.
    gathered = alltoall(tensor, parts, name=base, service=service)[0]
    mine = parts[svc.rank]
    total = gathered.reshape(p, mine, *tensor.shape[1:]).sum(dim=0)
    return total / p if op_name == "avg" else total


class GroupHandle:
    """The handle of :func:`grouped_allreduce_async`: ``wait()`` returns the list."""

    def __init__(self, handles: list[TensorHandle]) -> None:
        self.handles = handles

    def done(self) -> bool:
        """Whether every op of the group completed (never blocks)."""
        return all(h.done() for h in self.handles)

    def wait(self, timeout: float | None = None) -> list[torch.Tensor]:
        """The reduced tensors, in the order given."""
        return [h.wait(timeout) for h in self.handles]


def _alias(op: str, name: str) -> Alias:
    return next(a for a in op_declaration(op).aliases if a.name == name)


def _grouped(op: str, alias: str, args: dict[str, Any]) -> GroupHandle:
    """Op ``op`` on every tensor of the list in ``args``: one op each, named ``name.k``
    (``alias.k`` without a name); an argument left None takes the op's default."""
    torch_decl = op_declaration(op).torch
    assert torch_decl is not None
    listed = next(p.name for p in _alias(op, alias).params if p.kind is Kind.INPUT)
    tensors = args.pop(listed)
    each = {p.name: p.default for p in torch_decl.params_of(Form.ASYNC) if not p.required}
    each.update((k, v) for k, v in args.items() if v is not None)
    base = alias if args.get("name") is None else str(args["name"])
    one = next(p.name for p in torch_decl.params if p.kind is Kind.INPUT)
    return GroupHandle(
        [
            submit(op, Form.ASYNC, {**each, one: t, "name": f"{base}.{k}"})
            for k, t in enumerate(tensors)
        ]
    )


def grouped_forms(op: str, alias: str) -> tuple[Callable[..., Any], ...]:
    """``{alias}_async`` and ``{alias}`` (Horovod's ``grouped_allreduce``): op ``op`` on every
    tensor of a list, with the alias's parameters from :mod:`totalreduce.ops_table`;
    ``wait()`` returns the list of results."""
    a = _alias(op, alias)
    assert a.derived and a.takes is Takes.LIST, f"{alias} is not a derived list form of {op}"
    out = []
    for form in (Form.ASYNC, Form.BLOCKING):
        if form not in a.forms:
            continue
        sig = signature(a.params, returns="list[torch.Tensor]" if form.blocking else "GroupHandle")
        call = f"_grouped({op!r}, {alias!r}, dict({forward(sig)}))"
        out.append(
            build_function(
                form.name_of(alias),
                sig,
                f"return {call}.wait()" if form.blocking else f"return {call}",
                {"_grouped": _grouped},
                doc=f"Blocking :func:`{alias}_async`." if form.blocking else a.doc,
                module=__name__,
                declared=(op, f"{a.dialect} {form.name.lower()}"),
            )
        )
    return tuple(out)


grouped_allreduce_async, grouped_allreduce = grouped_forms("allreduce", "grouped_allreduce")


def join(device: int = -1, *, service: ServiceLike | None = None) -> int:
    """This rank has no more data: returns, on every rank, the rank that joined last.

    With a :class:`DistributedOptimizer` alive, its ``join()`` runs (zeros keep the other
    ranks' steps going until they join too); otherwise every rank waits for the others.
    """
    from .optimizer import _live_optimizers

    del device  # Horovod's device argument: CPU or CUDA, the same here
    live = _live_optimizers()
    if live:
        return live[-1].join()
    svc = resolve_service(service)
    stamps = svc.allgather(np.array([time.time()], dtype=np.float64), name="hvd.join")
    return int(np.argmax(np.asarray(stamps).reshape(-1)))


# ---------------------------------------------------------------- what Horovod was built with

# Horovod scripts ask these to pick a code path (``if hvd.nccl_built(): ...``).  The answers
# describe totalreduce: MPI underneath (mpi4py), its own engine rather than the Gloo or NCCL
# libraries, CUDA tensors staged through host memory rather than reduced on the GPU.


def mpi_built() -> bool:
    """True: totalreduce runs over MPI (mpi4py) when it is installed."""
    import importlib.util

    return importlib.util.find_spec("mpi4py") is not None


def mpi_enabled() -> bool:
    """Whether this process's world runs over MPI (False before ``init()`` or in a
    one-rank world without MPI)."""
    from ..api import default_service, is_initialized

    if not is_initialized():
        return False
    t = default_service().transport
    return type(t).__module__.endswith(".mpi")


def mpi_threads_supported() -> bool:
    """Whether MPI runs with ``MPI_THREAD_MULTIPLE`` (the engine asks for it)."""
    import sys

    mpi = sys.modules.get("mpi4py.MPI")
    return bool(mpi is not None and mpi.Is_initialized()
                and mpi.Query_thread() == mpi.THREAD_MULTIPLE)  # fmt: skip


def gloo_built() -> bool:
    """False: totalreduce has Gloo's algorithms in its own engine, not the Gloo library."""
    return False


def gloo_enabled() -> bool:
    """False (see :func:`gloo_built`)."""
    return False


def nccl_built() -> bool:
    """False: CUDA tensors are staged through host memory, not reduced by NCCL."""
    return False


def cuda_built() -> bool:
    """False: no GPU kernels (CUDA tensors work, staged through host memory)."""
    return False


def rocm_built() -> bool:
    """False (see :func:`cuda_built`)."""
    return False


def ddl_built() -> bool:
    """False: no IBM DDL."""
    return False


def ccl_built() -> bool:
    """False: no oneCCL."""
    return False


def is_homogeneous() -> bool:
    """Whether every node runs as many ranks as this one, read off this rank's layout
    (``local_size * cross_size == size`` holds only then)."""
    from ..api import cross_size, local_size, size

    return bool(local_size() * cross_size() == size())


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Record a timeline of this rank's ops into ``file_path`` from now on (a Chrome trace,
    one file per rank: ``file_path.<rank>.json`` unless it has ``{rank}``).
    ``mark_cycles`` is Horovod's; there are no cycles here."""
    from ..api import default_service

    del mark_cycles
    default_service().start_timeline(file_path)


def stop_timeline() -> None:
    """Stop recording the timeline and write the rest of it."""
    from ..api import default_service

    default_service().stop_timeline()

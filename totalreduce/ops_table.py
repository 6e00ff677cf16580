"""Every op, declared once: the table the numpy API, the service and the torch layer derive from.

One :class:`~totalreduce.declare.OpDecl` per op says its name, its parameters
(kind and default; the service method ``{name}_async`` takes them in this
order), what it takes and returns, which of those parameters the numpy
functions name before ``**kw``, its torch forms and its Horovod and BlueFog
names.  From a record come:

- ``totalreduce.{name}_async`` and ``totalreduce.{name}`` (``api.py``: the
  blocking form is the ``_async`` form and ``.wait()``, or, for an op declared
  ``direct``, the service's blocking method);
- the service's blocking method ``Service.{name}`` (``service/service.py``);
- ``totalreduce.torch.{name}_async``, ``{name}_async_``, ``{name}`` and
  ``{name}_`` (``torch/collectives.py``), where ``torch`` declares them;
- the aliases (``torch/horovod.py``).

To add an op: write its service method ``{name}_async``, add its record here,
and name the derived functions where they are exported (one line each in
``api.py``, ``torch/collectives.py``, and the package's ``__init__``).
``tests/test_declarations.py`` checks that every layer agrees with the table.
The window ops (BlueFog's ``win_*``) have a table of their own,
:mod:`totalreduce.window_table`; ``WINDOW_OPS`` and ``window_op`` are importable from
here too.

Pure: no torch, no numpy, no MPI (``import totalreduce`` never imports torch).
"""

from __future__ import annotations

from .declare import (
    ALL_FORMS,
    ASYNC_FORMS,
    MORE,
    NEW_TENSOR_FORMS,
    Alias,
    Form,
    Kind,
    OpDecl,
    Param,
    Returns,
    Takes,
    TorchDecl,
)
from .window_table import WINDOW_OPS, window_op  # the window ops' table (re-exported)

__all__ = ["OPS", "WINDOW_OPS", "op", "window_op"]

# ---------------------------------------------------------------- parameters many ops share

X = Param("x", Kind.INPUT)
NAME = Param("name", Kind.NAME, None)
OP = Param("op", Kind.OP, "sum", annotation="str | ReduceOp")
OUT = Param("out", Kind.OUTPUT, None)
PRIORITY = Param("priority", Kind.PRIORITY, 0)
GROUP = Param("group", Kind.GROUP, None)
DTYPE = Param("dtype", Kind.DTYPE, None)
ROOT = Param("root", Kind.ROOT, 0)
PARTITION = Param("partition", Kind.PARTITION, None)
AXES = Param("axes", Kind.AXES, None)
TOPOLOGY = Param("topology", Kind.TOPOLOGY, None)
STEP = Param("step", Kind.STEP, None)

# The torch forms' own.
TENSOR = Param("tensor", Kind.INPUT, annotation="torch.Tensor")
TORCH_PRIORITY = PRIORITY.but(default=None)
TORCH_GROUP = GROUP.but(annotation="Any")
SERVICE = Param("service", Kind.SERVICE, None, keyword_only=True)
AVERAGE = Param("average", Kind.AVERAGE, None, keyword_only=True)
ROOT_RANK = Param("root_rank", Kind.ROOT_RANK, None, keyword_only=True)


def _staging(forms: frozenset[Form]) -> Param:
    return Param("staging", Kind.STAGING, None, keyword_only=True, forms=forms)


HOROVOD = "Horovod"
HOROVOD_MODULE = "totalreduce.torch.horovod"


# ---------------------------------------------------------------- the ops

OPS: tuple[OpDecl, ...] = (
    OpDecl(
        "allreduce",
        (X, NAME, OP, OUT, PRIORITY, Param("algorithm", Kind.ALGORITHM, None), GROUP, DTYPE),
        Takes.ONE,
        Returns.ARRAY,
        c10d=("all_reduce", "all_reduce_coalesced"),
        direct=True,
        doc="Reduce ``x`` across ranks and return the result (blocking).",
        async_doc="""Start an allreduce of ``x``; see :meth:`Service.allreduce_async`.

        ``op``: ``"sum"``, ``"avg"``, ``"max"``, ``"min"``, ``"product"``, and on
        integer and bool arrays the bitwise ``"band"``, ``"bor"``, ``"bxor"``.
        Element types: float16, float32, float64, bfloat16 (``dtype="bfloat16"``),
        uint8, int8, int16, int32, int64 and bool.
        """,
        torch=TorchDecl(
            (
                TENSOR,
                NAME,
                OP.but(default="avg", annotation="str"),
                TORCH_PRIORITY,
                AVERAGE,
                TORCH_GROUP.but(keyword_only=True, forms=ASYNC_FORMS),
                _staging(frozenset({Form.ASYNC_IN_PLACE})),
                # Horovod's: the wire dtype, and factors before and after the reduction.
                Param("compression", Kind.COMPRESSION, None, keyword_only=True),
                Param("prescale_factor", Kind.PRESCALE, 1.0, keyword_only=True),
                Param("postscale_factor", Kind.POSTSCALE, 1.0, keyword_only=True),
                SERVICE,
            ),
            ALL_FORMS,
            doc="""Start reducing ``tensor`` across ranks into a new tensor (``op``: avg, sum,
            max, min, adasum; Horovod's and BlueFog's ``average=True``/``False`` means
            avg/sum).  Horovod's ``compression=Compression.fp16`` sends a floating tensor as
            float16 (the result comes back in its own dtype); ``prescale_factor`` multiplies
            the input before the reduction and ``postscale_factor`` the result after it.

            >>> h = trt.allreduce_async(torch.ones(4), name="ones", op="sum")   # doctest: +SKIP
            >>> h.wait()                                                         # doctest: +SKIP
            tensor([4., 4., 4., 4.])
            """,
            doc_in_place="Start reducing ``tensor`` across ranks in place; ``wait()`` returns "
            "``tensor``.",
        ),
        aliases=(
            Alias(
                "grouped_allreduce",
                HOROVOD,
                HOROVOD_MODULE,
                (
                    Param("tensors", Kind.INPUT, annotation="Sequence[torch.Tensor]"),
                    AVERAGE.but(keyword_only=False),
                    NAME,
                    Param("op", Kind.OP, None),
                    SERVICE,
                ),
                "Start reducing every tensor of ``tensors`` (average by default, as Horovod).",
                takes=Takes.LIST,
                forms=NEW_TENSOR_FORMS,
                derived=True,
                note="one allreduce per tensor, named name.k; one handle for the list",
            ),
        ),
    ),
    OpDecl(
        "broadcast",
        (X, ROOT, NAME, OUT, PRIORITY, Param("algorithm", Kind.ALGORITHM, "auto"), GROUP, DTYPE),
        Takes.ONE,
        Returns.ARRAY,
        c10d=("broadcast",),
        direct=True,
        doc="Return rank ``root``'s ``x`` on every rank (blocking).",
        async_doc="Start a broadcast from ``root``; see :meth:`Service.broadcast_async`.",
        torch=TorchDecl(
            (
                TENSOR,
                ROOT,
                NAME,
                TORCH_PRIORITY,
                ROOT_RANK,
                TORCH_GROUP.but(keyword_only=True, forms=ASYNC_FORMS),
                _staging(frozenset({Form.ASYNC_IN_PLACE})),
                SERVICE,
            ),
            ALL_FORMS,
            doc="""Start copying rank ``root``'s ``tensor`` to every rank, into a new tensor.

            ``root_rank=`` is Horovod's name for ``root``.
            """,
            doc_in_place="Start overwriting ``tensor`` with rank ``root``'s, in place; "
            "``wait()`` returns it.",
        ),
    ),
    OpDecl(
        "barrier",
        (NAME, PRIORITY, Param("algorithm", Kind.ALGORITHM, "auto"), GROUP),
        Takes.NONE,
        Returns.NOTHING,
        c10d=("barrier", "monitored_barrier"),
        direct=True,
        api=("name", "algorithm", "group"),
        doc="Return once every rank (of ``group``) has entered the barrier.",
        async_doc="Start a barrier.",
        torch=TorchDecl(
            (NAME, SERVICE),
            frozenset({Form.BLOCKING}),
            doc="Return once every rank has entered the barrier (Horovod's ``hvd.barrier()``).",
        ),
    ),
    OpDecl(
        "pairwise_exchange",
        (X, Param("steps", Kind.COUNT), NAME, GROUP, PRIORITY),
        Takes.ONE,
        Returns.ARRAY,
        api=("x", "steps", "name", MORE),
        doc="Gloo's pairwise-exchange benchmark pattern (blocking).",
        async_doc="Start Gloo's pairwise-exchange benchmark pattern; see the Service method.",
    ),
    OpDecl(
        "reduce_scatter",
        (X, NAME, OP, PARTITION, AXES, GROUP, DTYPE, PRIORITY, Param("counts", Kind.SPLITS, None)),
        Takes.ONE,
        Returns.ARRAY,
        c10d=("reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_tensor_coalesced"),
        api=("x", "name", "op", MORE),
        direct=True,
        doc="This rank's balanced part of the sum of every rank's ``x`` (a new array).",
        async_doc="Start a reduce-scatter; see :meth:`Service.reduce_scatter_async`.",
        torch=TorchDecl(
            (
                TENSOR,
                NAME,
                OP.but(annotation="str"),
                PARTITION.but(annotation="Any"),
                AXES,
                TORCH_GROUP,
                TORCH_PRIORITY,
                _staging(frozenset({Form.ASYNC})),
                SERVICE,
            ),
            NEW_TENSOR_FORMS,
            doc="""Start a reduce-scatter; ``wait()`` returns this rank's part as a new tensor.

            Without ``partition`` the tensor is flattened and each rank gets its
            balanced 1-D part of the sum.  With ``partition=totalreduce.Partition(shape)``
            and ``axes=(k,)`` the sum runs over the ranks along partition dimension
            ``k`` and tensor dimension ``k`` is split among them (a 3x7x12 tensor on a
            2x2x3 partition along axis 2 gives 3x7x4).  A rank outside the partition
            gets a copy of its zero-volume input.
            """,
        ),
        aliases=(
            Alias(
                "reducescatter",
                HOROVOD,
                HOROVOD_MODULE,
                (
                    TENSOR,
                    NAME,
                    Param("op", Kind.OP, None),
                    AVERAGE,
                    SERVICE,
                ),
                "Horovod's ``reducescatter``: this rank's rows of the reduction (average by "
                "default).",
                note="rows of dimension 0, earlier ranks one more; average by default",
            ),
        ),
    ),
    OpDecl(
        "allgather",
        (X, NAME, PARTITION, AXES, GROUP, DTYPE, PRIORITY, Param("counts", Kind.SPLITS, None)),
        Takes.ONE,
        Returns.ARRAY,
        c10d=(
            "all_gather",
            "all_gather_into_tensor",
            "all_gather_coalesced",
            "all_gather_into_tensor_coalesced",
        ),
        api=("x", "name", MORE),
        direct=True,
        doc="Every rank's ``x`` concatenated in rank order (parts may differ in length).",
        async_doc="Start an all-gather; see :meth:`Service.allgather_async`.",
        torch=TorchDecl(
            (
                TENSOR,
                NAME,
                PARTITION.but(annotation="Any"),
                AXES,
                TORCH_GROUP,
                TORCH_PRIORITY,
                Param("flat", Kind.FLAT, False, keyword_only=True),
                Param("counts", Kind.SPLITS, None, keyword_only=True),
                _staging(frozenset({Form.ASYNC})),
                SERVICE,
            ),
            NEW_TENSOR_FORMS,
            rows=True,
            doc="""Start an all-gather: every rank's tensor joined in rank order, as a new tensor.

            Without ``partition`` the tensors are concatenated along dimension 0, as
            Horovod's and torch's ``allgather`` do: ranks may differ in dimension 0
            only (a ``(2, 5)`` and a ``(3, 5)`` give ``(5, 5)``; a 0-d tensor counts as
            ``(1,)``).  ``flat=True`` joins the flattened tensors into one 1-D tensor
            instead, whatever their shapes.  With ``partition`` and ``axes=(k,)`` the
            parts of the ranks along partition dimension ``k`` are joined along tensor
            dimension ``k`` (the adjoint of :func:`reduce_scatter_async`).  ``counts``
            (every rank's element count, where every rank knows them) spares the
            exchange of the sizes that comes first otherwise.

            >>> trt.allgather(torch.ones(2, 5)).shape     # on 3 ranks   # doctest: +SKIP
            torch.Size([6, 5])
            """,
        ),
    ),
    OpDecl(
        "neighbor_allreduce",
        (
            X,
            NAME,
            TOPOLOGY,
            STEP,
            Param("self_weight", Kind.WEIGHTS, None, annotation="float"),
            Param("src_weights", Kind.WEIGHTS, None),
            Param("dst_weights", Kind.SEND_WEIGHTS, None),
            OUT,
            DTYPE,
            PRIORITY,
        ),
        Takes.ONE,
        Returns.ARRAY,
        api=("x", "name", MORE),
        direct=True,
        doc="``x`` averaged with this rank's neighbors on a topology (blocking).",
        async_doc="Start neighbor averaging; see :meth:`Service.neighbor_allreduce_async`.",
        torch=TorchDecl(
            (
                TENSOR,
                NAME,
                TOPOLOGY,
                STEP,
                Param("self_weight", Kind.WEIGHTS, None, annotation="float"),
                Param("src_weights", Kind.WEIGHTS, None),
                Param("dst_weights", Kind.SEND_WEIGHTS, None),
                TORCH_PRIORITY,
                # BlueFog's older names of src_weights and dst_weights.
                Param("neighbor_weights", Kind.OLDER_NAME, None, True, of="src_weights"),
                Param("send_neighbors", Kind.OLDER_NAME, None, True, of="dst_weights"),
                # BlueFog's; the engine always checks that senders and receivers agree.
                Param("enable_topo_check", Kind.UNUSED, True, keyword_only=True),
                SERVICE,
            ),
            ALL_FORMS,
            bluefog_order=(
                "tensor",
                "self_weight",
                "src_weights",
                "dst_weights",
                "enable_topo_check",
                "name",
            ),
            doc="""Start averaging ``tensor`` with this rank's neighbors, into a new tensor.

            ``x_i <- sum_j W(step)[i, j] x_j`` with ``W`` the mixing matrix of
            ``topology`` (a name or a :mod:`totalreduce.topology` object) at ``step``
            (default: the op's generation; without a topology or weights, the one
            ``set_topology`` set), or BlueFog's dynamic ``self_weight`` /
            ``src_weights`` / ``dst_weights``.  Floating-point tensors only.
            BlueFog's positional order ``(tensor, self_weight, src_weights,
            dst_weights, enable_topo_check, name)`` works too: a float where the
            name goes is ``self_weight``.
            """,
            doc_in_place="In-place :func:`neighbor_allreduce_async`; ``wait()`` returns "
            "``tensor``.",
        ),
    ),
    OpDecl(
        "neighbor_allgather",
        (
            X,
            NAME,
            TOPOLOGY,
            STEP,
            Param("src_ranks", Kind.RANKS, None),
            Param("dst_ranks", Kind.RANKS, None),
            DTYPE,
            PRIORITY,
        ),
        Takes.ONE,
        Returns.ARRAY,
        api=("x", "name", MORE),
        direct=True,
        doc="The ``x`` of every in-neighbor, stacked in ascending rank order (blocking).",
        async_doc="Start a neighbor all-gather; see :meth:`Service.neighbor_allgather_async`.",
    ),
    OpDecl(
        "hierarchical_neighbor_allreduce",
        (
            X,
            NAME,
            TOPOLOGY,
            Param("local_size", Kind.COUNT, 1),
            STEP,
            OUT,
            DTYPE,
            PRIORITY,
            # BlueFog's machine weights, per call, instead of a machine topology's.
            Param("self_weight", Kind.WEIGHTS, None, annotation="float"),
            Param("src_machine_weights", Kind.WEIGHTS, None),
            Param("dst_machine_weights", Kind.SEND_WEIGHTS, None),
        ),
        Takes.ONE,
        Returns.ARRAY,
        api=("x", "name", MORE),
        doc="Average within the node, then with neighbor nodes (blocking).",
        async_doc="Start node-then-neighbor-nodes averaging; see the Service method.",
    ),
    OpDecl(
        "reduce",
        (X, ROOT, NAME, OP, OUT, PRIORITY, GROUP, DTYPE),
        Takes.ONE,
        Returns.ON_ROOT,
        c10d=("reduce",),
        api=("x", "root", "name", MORE),
        direct=True,
        doc="""Reduce every rank's ``x`` into rank ``root``: the result there, None elsewhere.

        ``op`` is any of :func:`allreduce_async`'s; ``out=x`` reduces in place on the root.
        """,
        async_doc="Start a reduce to ``root``; see :meth:`Service.reduce_async` (``op=``, "
        "``out=``, ...).",
    ),
    OpDecl(
        "gather",
        (X, ROOT, NAME, OUT, PRIORITY, GROUP, DTYPE),
        Takes.ONE,
        Returns.ON_ROOT,
        c10d=("gather",),
        api=("x", "root", "name", MORE),
        direct=True,
        doc="Every rank's ``x`` stacked on rank ``root`` (shape ``(P, *x.shape)``), None "
        "elsewhere.",
        async_doc="Start a gather to ``root``; see :meth:`Service.gather_async`.",
    ),
    OpDecl(
        "scatter",
        (X, ROOT, NAME, OUT, PRIORITY, GROUP, DTYPE),
        Takes.ONE,
        Returns.ARRAY,
        c10d=("scatter",),
        api=("x", "root", "name", MORE),
        direct=True,
        doc="""Part ``r`` of the root's ``x`` on rank ``r``; elsewhere ``x`` is the receiving array.

        >>> part = tr.scatter(table if tr.rank() == 0 else np.empty(4), root=0)  # doctest: +SKIP
        """,
        async_doc="Start a scatter from ``root``; see :meth:`Service.scatter_async`.",
    ),
    OpDecl(
        "alltoall",
        (
            X,
            NAME,
            Param("splits", Kind.SPLITS, None),
            Param("recv_splits", Kind.SPLITS, None),
            OUT,
            PRIORITY,
            GROUP,
            DTYPE,
        ),
        Takes.ONE,
        Returns.ARRAY,
        c10d=("all_to_all", "all_to_all_single"),
        api=("x", "name", MORE),
        direct=True,
        doc="Part ``j`` of ``x`` to rank ``j``; part ``j`` of the result from rank ``j`` "
        """(blocking).

        Equal parts by default; ``splits=[...]`` and ``recv_splits=[...]`` give
        uneven ones, as torch's ``all_to_all_single`` does.
        """,
        async_doc="Start an all-to-all; see :meth:`Service.alltoall_async` (``splits=``, "
        "``recv_splits=``).",
        aliases=(
            Alias(
                "alltoall",
                HOROVOD,
                HOROVOD_MODULE,
                (
                    TENSOR,
                    Param("splits", Kind.SPLITS, None, annotation="Sequence[int] | torch.Tensor"),
                    NAME,
                    SERVICE,
                ),
                "Send ``splits[j]`` rows of ``tensor`` to rank ``j``; returns the rows received "
                "(and, with ``splits``, a tensor of how many rows came from each rank).",
                note="rows of dimension 0; with splits, also the rows received from each rank",
            ),
        ),
    ),
    OpDecl(
        "send",
        (X, Param("dst", Kind.PEER), Param("tag", Kind.TAG, 0), PRIORITY, DTYPE),
        Takes.ONE,
        Returns.NOTHING,
        c10d=("send", "isend"),
        api=("x", "dst", "tag", MORE),
        doc="""Send ``x`` to rank ``dst`` with ``tag``; it meets ``dst``'s matching :func:`recv`.

        Messages from one rank to another on one tag arrive in the order sent (MPI's rule).
        """,
        async_doc="Start sending ``x`` to rank ``dst``; see :meth:`Service.send_async`.",
    ),
    OpDecl(
        "recv",
        (X, Param("src", Kind.PEER), Param("tag", Kind.TAG, 0), PRIORITY, DTYPE),
        Takes.ONE,
        Returns.ARRAY,
        c10d=("recv", "irecv"),
        api=("x", "src", "tag", MORE),
        doc="""Receive into ``x`` the next message from rank ``src`` with ``tag``; returns ``x``.

        ``x`` must have the sent element count and dtype (both ranks raise otherwise).
        """,
        async_doc="Start receiving from rank ``src`` into ``x``; see :meth:`Service.recv_async`.",
    ),
)

_BY_NAME = {d.name: d for d in OPS}
for _decl in OPS:
    _decl.check()
if len(_BY_NAME) != len(OPS):
    raise ValueError("two ops of one name in the table")


def op(name: str) -> OpDecl:
    """The record of op ``name``."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"no op {name!r} in the table; known: {', '.join(_BY_NAME)}") from None

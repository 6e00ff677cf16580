"""Collectives on torch tensors: the engine's ops, taking and returning tensors.

Each op has an ``_async`` form returning a :class:`~totalreduce.torch.TensorHandle`
and a blocking form; a trailing ``_`` means in place (Horovod's convention): the
result is written into the tensor passed, which ``wait()`` returns.  Without it
the result is a new tensor.  Every function takes ``service=`` (default: the
service ``totalreduce.init()`` started) and ``priority=`` (higher goes first;
None means 0); the ones the torch.distributed backend uses take ``staging=``, a
:class:`~totalreduce.torch.tensors.PinnedPool` to reuse staging buffers from.

Contiguous CPU tensors go to the engine without a copy, so a tensor must not be
modified until its op is done.  Other tensors are staged (see ``tensors.py``).

Every form is built from its op's record in :mod:`totalreduce.ops_table` by
:func:`tensor_forms`, and every call runs through :func:`submit`: the one place
where a torch call's arguments become the service call, and the engine's handle
a :class:`~totalreduce.torch.TensorHandle`.

>>> h = trt.allreduce_async(grad, name="fc1.weight", op="avg")   # doctest: +SKIP
>>> avg = h.wait()                                                # doctest: +SKIP
>>> trt.allreduce_(grad, name="fc1.weight")      # in place, blocking   # doctest: +SKIP
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from ..api import default_service
from ..declare import Form, Kind, OpDecl, Takes, build_function, forward, signature
from ..errors import InvalidArgumentError
from ..ops_table import op as op_declaration
from ..service.handle import ServiceLike
from .compression import Compression, Compressor
from .tensors import HostBuffer, TensorHandle, check_tensor, host_buffer

#: Horovod's op constants (``hvd.Average`` ...): the engine's op names.
Average = "avg"
Sum = "sum"
#: Horovod's Adasum (floating tensors): see :mod:`totalreduce.service.adasum`.
Adasum = "adasum"
Min = "min"
Max = "max"


def resolve_root(root: int, root_rank: int | None) -> int:
    """``root_rank`` (Horovod's name) when given, else ``root``; both given must agree."""
    if root_rank is None:
        return root
    if root not in (0, root_rank):
        raise InvalidArgumentError(f"root={root} and root_rank={root_rank} disagree; pass one")
    return root_rank


def resolve_service(service: ServiceLike | None) -> ServiceLike:
    """``service``, or the default one (``totalreduce.init()`` must have run)."""
    return default_service() if service is None else service


def priority_value(priority: Any) -> int:
    """The engine priority for ``priority`` (None means 0)."""
    if priority is None:
        return 0
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise InvalidArgumentError(f"priority must be an int or None, got {priority!r}")
    return priority


def in_place_result(buf: HostBuffer) -> Callable[[Any], torch.Tensor]:
    """A :class:`TensorHandle` finish for an op that wrote into ``buf``: the caller's tensor
    (a staged result copied back), the staging buffer released."""

    def finish(_raw: Any) -> torch.Tensor:
        out = buf.copy_back()
        buf.release()
        return out

    return finish


def new_tensor_result(buf: HostBuffer) -> Callable[[Any], torch.Tensor]:
    """A :class:`TensorHandle` finish for an op whose result is a new engine array: that
    array as a tensor of the input's dtype and device, the input's staging released."""

    def finish(raw: Any) -> torch.Tensor:
        out = buf.as_tensor(raw)
        buf.release()  # the input's staging copy; the result is the engine's own array
        return out

    return finish


def rows_result(buf: HostBuffer, name: Any) -> Callable[[Any], torch.Tensor]:
    """A finish joining every rank's tensor along dimension 0 (Horovod's and torch's
    all-gather): the gathered elements as rows of the input's row shape."""
    rows = tuple(buf.tensor.shape[1:])
    per_row = max(1, int(torch.Size(rows).numel()))

    def finish(raw: Any) -> torch.Tensor:
        out = buf.as_tensor(raw)
        buf.release()
        if out.numel() % per_row:
            raise InvalidArgumentError(
                f"allgather {name!r}: the ranks' tensors differ beyond dimension 0 "
                f"({out.numel()} elements gathered, not a multiple of this rank's row shape "
                f"{rows}); pass flat=True to join them flattened"
            )
        return out.reshape(-1, *rows)

    return finish


class _Plan:
    """How the arguments of one torch form become its service call, read off the op's record."""

    def __init__(self, decl: OpDecl, form: Form) -> None:
        t = decl.torch
        assert t is not None, f"{decl.name} declares no torch forms"
        engine = set(decl.param_names)
        params = t.params_of(form)
        kinds = {p.name: p.kind for p in params}
        self.method = decl.method
        self.in_place = form.in_place
        self.takes_tensor = decl.takes is Takes.ONE
        self.input = next((n for n, k in kinds.items() if k is Kind.INPUT), "")
        #: passed on under their own names (priority after its check)
        self.passed = tuple(n for n, k in kinds.items() if n in engine and k is not Kind.INPUT)
        self.priority = "priority" in self.passed
        self.older = tuple((p.name, p.of) for p in params if p.kind is Kind.OLDER_NAME)
        self.average = next((n for n, k in kinds.items() if k is Kind.AVERAGE), "")
        self.root_rank = next((n for n, k in kinds.items() if k is Kind.ROOT_RANK), "")
        self.topology = next((n for n, k in kinds.items() if k is Kind.TOPOLOGY), "")
        self.weights = tuple(n for n, k in kinds.items() if k is Kind.WEIGHTS)
        self.rows = t.rows
        self.bluefog = t.bluefog_order
        self.scaled = tuple(  # Horovod's compression, prescale_factor, postscale_factor
            next((n for n, k in kinds.items() if k is kind), "")
            for kind in (Kind.COMPRESSION, Kind.PRESCALE, Kind.POSTSCALE)
        )
        self.positional = tuple(p for p in params if not p.keyword_only)

    def from_bluefog(self, args: dict[str, Any]) -> dict[str, Any]:
        """``args`` read in BlueFog's positional order (see ``TorchDecl.bluefog_order``)."""
        slots = self.positional[: len(self.bluefog)]
        moved = dict(args)
        for p in slots:
            moved[p.name] = p.default
        for name, p in zip(self.bluefog, slots, strict=True):
            moved[name] = args[p.name]
        if not isinstance(moved.get("name"), (str, int)):
            moved["name"] = None  # BlueFog's name goes last; what came there is no name
        return moved


_PLANS: dict[tuple[str, Form], _Plan] = {}


def submit(name: str, form: Form, args: dict[str, Any]) -> Any:
    """Start op ``name`` in torch form ``form`` with ``args`` (that form's arguments, by name).

    Returns a :class:`TensorHandle` whose ``wait()`` gives the result tensor (the
    one passed, written in place, for the in-place forms); an op that takes no
    tensor (a barrier) returns the engine's handle.  The generated forms call
    :func:`run` with their plan directly.
    """
    return run(_PLANS[name, form], args)


def run(plan: _Plan, args: dict[str, Any]) -> Any:
    """:func:`submit` with the form's plan at hand (what every torch form calls)."""
    if plan.bluefog and isinstance(args.get("name"), float):  # BlueFog's self_weight
        args = plan.from_bluefog(args)
    svc = resolve_service(args["service"])
    call = {n: args[n] for n in plan.passed}
    if plan.priority:
        call["priority"] = priority_value(call["priority"])
    if plan.average and args[plan.average] is not None:
        call["op"] = "avg" if args[plan.average] else "sum"
    if plan.root_rank:
        call["root"] = resolve_root(call["root"], args[plan.root_rank])
    for older, of in plan.older:
        if call[of] is None:
            call[of] = args[older]
    if plan.topology and call[plan.topology] is None:
        from .bluefog import neighbor_defaults

        neighbor_defaults(call, svc)  # set_topology's topology, with BlueFog's weights
    if not plan.takes_tensor:
        return getattr(svc, plan.method)(**call)
    tensor = args[plan.input]
    if plan.scaled[0]:
        compression, pre, post = (args[n] for n in plan.scaled)
        if compression not in (None, Compression.none) or pre != 1.0 or post != 1.0:
            return _scaled(plan, svc, call, tensor, compression, pre, post)
    buf = host_buffer(tensor, plan.input, pool=args.get("staging"))
    if plan.in_place:
        call["out"] = buf.array
    h = getattr(svc, plan.method)(buf.array, **call, **buf.engine_kwargs)
    if plan.in_place:
        finish = in_place_result(buf)
    elif plan.rows and not args["flat"] and call["partition"] is None and tensor.dim() > 1:
        finish = rows_result(buf, h.name)
    else:
        finish = new_tensor_result(buf)
    return TensorHandle(h, finish)


def _scaled(
    plan: _Plan, svc: Any, call: dict[str, Any], tensor: Any, compression: Any, pre: Any,
    post: Any,
) -> TensorHandle:  # fmt: skip
    """Horovod's allreduce with ``compression``, ``prescale_factor``, ``postscale_factor``:
    the engine reduces a private copy (in the wire dtype, scaled), the result comes back
    in the tensor's dtype, scaled again, into the tensor for the in-place forms."""
    t = check_tensor(tensor, plan.input)
    if compression is not None and not (
        isinstance(compression, type) and issubclass(compression, Compressor)
    ):
        raise InvalidArgumentError(
            f"compression must be Compression.none or Compression.fp16, got {compression!r}"
        )
    for what, f in (("prescale_factor", pre), ("postscale_factor", post)):
        if isinstance(f, bool) or not isinstance(f, (int, float)):
            raise InvalidArgumentError(f"{what} must be a number, got {f!r}")
    if (pre != 1.0 or post != 1.0) and not t.is_floating_point():
        raise InvalidArgumentError(
            f"prescale_factor/postscale_factor scale floating tensors; {plan.input} is {t.dtype}"
        )
    with torch.no_grad():
        wire, ctx = (compression or Compression.none).compress(t.detach())
        wire = wire.mul(pre) if pre != 1.0 else wire.clone()  # private: the engine writes it
    buf = host_buffer(wire, plan.input)
    call = dict(call, out=buf.array)
    h = getattr(svc, plan.method)(buf.array, **call, **buf.engine_kwargs)

    def finish(_raw: Any) -> torch.Tensor:
        with torch.no_grad():
            out = (compression or Compression.none).decompress(buf.copy_back(), ctx)
            if post != 1.0:
                out = out.mul(post)
            if plan.in_place:
                t.copy_(out)
                return t  # type: ignore[no-any-return]
            return out.to(t.device) if out.device != t.device else out

    return TensorHandle(h, finish)


def tensor_forms(name: str) -> tuple[Callable[..., Any], ...]:
    """The torch forms op ``name`` declares, in :class:`~totalreduce.declare.Form` order
    (``_async``, ``_async_``, blocking, blocking ``_``), each a call of :func:`run`."""
    decl = op_declaration(name)
    assert decl.torch is not None, f"{name} declares no torch forms"
    handle = "TensorHandle" if decl.takes is Takes.ONE else "HandleLike"
    value = "torch.Tensor" if decl.takes is Takes.ONE else decl.returns.value
    out = []
    for form in Form:
        if form not in decl.torch.forms:
            continue
        plan = _PLANS[name, form] = _Plan(decl, form)
        sig = signature(decl.torch.params_of(form), returns=value if form.blocking else handle)
        call = f"_run(_plan, dict({forward(sig)}))"
        fn = build_function(
            form.name_of(name),
            sig,
            f"return {call}.wait()" if form.blocking else f"return {call}",
            {"_run": run, "_plan": plan},
            doc=_doc(decl, form),
            module=__name__,
            declared=(name, f"torch {form.name.lower()}"),
        )
        out.append(_bluefog_calls(fn, plan.bluefog) if plan.bluefog else fn)
    return tuple(out)


def _bluefog_calls(fn: Callable[..., Any], order: tuple[str, ...]) -> Callable[..., Any]:
    """``fn`` that also takes BlueFog's positional order (a float where the name goes is
    BlueFog's ``self_weight``) together with keywords, ``name=`` included:
    ``neighbor_allreduce(t, 0.5, src_weights, dst_weights, name="x")``.  Its signature
    (``inspect.signature``) stays the declared one."""

    def call(*args: Any, **kwargs: Any) -> Any:
        if len(args) < 2 or not isinstance(args[1], float):
            return fn(*args, **kwargs)
        if len(args) > len(order):
            raise TypeError(
                f"{fn.__name__}() takes at most {len(order)} positional arguments in BlueFog's "
                f"order ({', '.join(order)}), got {len(args)}"
            )
        named = dict(zip(order, args, strict=False))
        twice = sorted(set(named) & set(kwargs))
        if twice:
            raise TypeError(f"{fn.__name__}() got multiple values for {twice} (BlueFog's order)")
        return fn(**named, **kwargs)

    return functools.update_wrapper(call, fn)


def _doc(decl: OpDecl, form: Form) -> str:
    assert decl.torch is not None
    if form is Form.ASYNC:
        return decl.torch.doc
    if form is Form.ASYNC_IN_PLACE:
        return decl.torch.doc_in_place
    if Form.ASYNC in decl.torch.forms:
        start = (Form.ASYNC_IN_PLACE if form.in_place else Form.ASYNC).name_of(decl.name)
        what = "in place, returning ``tensor``" if form.in_place else "the result in a new tensor"
        return f"Blocking :func:`{start}`: {what}."
    return decl.torch.doc


# ---------------------------------------------------------------- the ops, from the table

allreduce_async, allreduce_async_, allreduce, allreduce_ = tensor_forms("allreduce")
broadcast_async, broadcast_async_, broadcast, broadcast_ = tensor_forms("broadcast")
reduce_scatter_async, reduce_scatter = tensor_forms("reduce_scatter")
allgather_async, allgather = tensor_forms("allgather")
(barrier,) = tensor_forms("barrier")
neighbor_allreduce_async, neighbor_allreduce_async_, neighbor_allreduce, neighbor_allreduce_ = (
    tensor_forms("neighbor_allreduce")
)


# ---------------------------------------------------------------- BlueFog's spellings

# BlueFog calls the ``_async`` forms ``_nonblocking`` and ``synchronize`` also ``wait``: the
# same functions (declared once, in totalreduce/ops_table.py), under BlueFog's names.

allreduce_nonblocking = allreduce_async
allreduce_nonblocking_ = allreduce_async_
broadcast_nonblocking = broadcast_async
broadcast_nonblocking_ = broadcast_async_
allgather_nonblocking = allgather_async
neighbor_allreduce_nonblocking = neighbor_allreduce_async

#: BlueFog's spelling -> the declared form it is.
NONBLOCKING = {
    "allreduce_nonblocking": "allreduce_async",
    "allreduce_nonblocking_": "allreduce_async_",
    "broadcast_nonblocking": "broadcast_async",
    "broadcast_nonblocking_": "broadcast_async_",
    "allgather_nonblocking": "allgather_async",
    "neighbor_allreduce_nonblocking": "neighbor_allreduce_async",
    "wait": "synchronize",
}


# ---------------------------------------------------------------- handles


def poll(handle: TensorHandle) -> bool:
    """True once ``handle``'s op has completed (never blocks)."""
    return handle.done()


def synchronize(handle: TensorHandle, timeout: float | None = None) -> torch.Tensor:
    """Wait for ``handle``'s op and return its tensor (Horovod's name for ``wait``)."""
    return handle.wait(timeout)


wait = synchronize  # BlueFog's name (see NONBLOCKING)

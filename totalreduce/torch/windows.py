"""BlueFog's window ops on tensors, and ``DistributedWinPutOptimizer``.

``import totalreduce.torch as bf`` runs BlueFog's asynchronous examples::

    bf.set_topology(topology_util.ExponentialTwoGraph(bf.size()))
    bf.turn_on_win_ops_with_associated_p()
    bf.win_create(x, name="x", zero_init=True)
    outdegree = len(bf.out_neighbor_ranks())
    for _ in range(steps):                       # push-sum: nobody waits for anybody
        bf.win_accumulate(x, name="x", self_weight=1 / (outdegree + 1),
                          dst_weights={r: 1 / (outdegree + 1) for r in bf.out_neighbor_ranks()})
        bf.win_update_then_collect(name="x")
    bf.barrier()
    bf.win_update_then_collect(name="x")         # what arrived last
    average = x / bf.win_associated_p(name="x")
    bf.win_free()

A window holds a CPU tensor's own memory (``win_update`` writes into it); the
topology is the one :func:`~totalreduce.torch.set_topology` set when the window
was created.  How the engine carries them: :mod:`totalreduce.service.windows`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from .. import windows as _w
from ..api import default_service
from ..declare import WinDecl, build_function, signature
from ..errors import InvalidArgumentError
from ..service.windows import WinHandle
from ..window_table import window_op
from .bluefog import is_topo_weighted, load_topology
from .tensors import array_to_tensor, check_tensor, host_buffer

__all__ = ["DistributedWinPutOptimizer"] + [n for n in _w.__all__ if n != "WinHandle"]

_lock = threading.Lock()
_tensors: dict[str, torch.Tensor] = {}  # window name -> the registered tensor


def _engine_view(tensor: Any, what: str) -> tuple[Any, dict[str, Any]]:
    """The numpy view of a CPU tensor's own memory (no staging: a window is that memory)."""
    t = check_tensor(tensor, what)
    if t.device.type != "cpu" or not t.is_contiguous():
        raise InvalidArgumentError(
            f"{what} must be a contiguous CPU tensor (a window is its memory); got one on "
            f"{t.device}{'' if t.is_contiguous() else ', not contiguous'}"
        )
    buf = host_buffer(t, what)
    return buf.array, buf.engine_kwargs


def _create(tensor: torch.Tensor, name: str, zero_init: bool) -> bool:
    arr, kw = _engine_view(tensor, f"win_create({name!r}): tensor")
    ok = _w.win_create(arr, name, zero_init, topology=load_topology(), **kw)
    with _lock:
        _tensors[name] = tensor
    return ok


def _free(name: str | None) -> bool:
    ok = _w.win_free(name)
    with _lock:
        if name is None:
            _tensors.clear()
        else:
            _tensors.pop(name, None)
    return ok


def _view(tensor: Any, what: str) -> Any:
    """The memory a put or accumulate reads (and, with ``self_weight``, scales): the
    tensor's own (a window op on a CPU tensor copies nothing until the message)."""
    arr, _ = _engine_view(tensor, f"{what}: tensor")
    return arr


def _registered(name: str, what: str) -> torch.Tensor:
    with _lock:
        t = _tensors.get(name)
    if t is None:
        default_service().windows.window(name, what)  # raises, naming the windows there
        raise InvalidArgumentError(f"{what}: window {name!r} was not created from a tensor")
    return t


def _update(
    name: str, self_weight: Any, neighbor_weights: Any, reset: bool, clone: bool
) -> torch.Tensor:
    t = _registered(name, f"win_update({name!r})")
    out = default_service().windows.update(
        name, self_weight, neighbor_weights, reset, clone, topology_weights=is_topo_weighted()
    )
    if not clone:
        return t
    kw = "bfloat16" if t.dtype == torch.bfloat16 else None
    return array_to_tensor(out, kw, t.dtype, t.device)


def _collect(name: str) -> torch.Tensor:
    t = _registered(name, f"win_update_then_collect({name!r})")
    default_service().windows.update_then_collect(name)
    return t


_ENV = {"_np": _w, "_view": _view, "_create": _create, "_free": _free, "_update": _update,
        "_collect": _collect}  # fmt: skip


def _torch_form(d: WinDecl, fname: str, returns: str, doc: str, form: str) -> Any:
    params = d.torch_params()
    sig = signature(params, returns=returns)
    if d.torch_body and form == "torch window":
        body = d.torch_body
    else:  # the numpy function on the tensor's memory
        args = ", ".join(
            f"_view(tensor, {fname!r})" if p.name == "tensor" else p.name for p in params
        )
        body = f"return _np.{fname}({args})"
    return build_function(fname, sig, body, _ENV, doc=doc, module=__name__,
                          declared=(d.name, form))  # fmt: skip


def _plain(op: str) -> Callable[..., Any]:
    """The torch function of window op ``op`` (see ``WINDOW_OPS``)."""
    d = window_op(op)
    returns = d.torch_returns or d.returns
    return _torch_form(d, d.name, returns, d.doc.replace("``x``", "``tensor``"), "torch window")  # type: ignore[no-any-return]


def _nonblocking(op: str) -> tuple[Callable[..., WinHandle], Callable[..., bool]]:
    d = window_op(op)
    doc = d.doc.replace("``x``", "``tensor``")
    return (
        _torch_form(d, f"{d.name}_nonblocking", "WinHandle",
                    f"Start: {doc}\n\n        Returns the transfer's handle (``win_wait``).",
                    "torch window nonblocking"),
        _torch_form(d, d.name, d.returns,
                    f"{doc}\n\n        Blocks until done (a put: landed); True.", "torch window"),
    )  # fmt: skip


win_create = _plain("win_create")
win_free = _plain("win_free")
win_put_nonblocking, win_put = _nonblocking("win_put")
win_accumulate_nonblocking, win_accumulate = _nonblocking("win_accumulate")
win_get_nonblocking, win_get = _nonblocking("win_get")
win_update = _plain("win_update")
win_update_then_collect = _plain("win_update_then_collect")
win_mutex = _plain("win_mutex")
get_win_version = _plain("get_win_version")
win_associated_p = _plain("win_associated_p")
turn_on_win_ops_with_associated_p = _plain("turn_on_win_ops_with_associated_p")
turn_off_win_ops_with_associated_p = _plain("turn_off_win_ops_with_associated_p")
win_poll = _w.win_poll
win_wait = _w.win_wait


def DistributedWinPutOptimizer(  # noqa: N802 - BlueFog's name, a factory like Horovod's
    optimizer: torch.optim.Optimizer,
    model: torch.nn.Module,
    num_steps_per_communication: int = 1,
    window_prefix: str | None = None,
) -> torch.optim.Optimizer:
    """BlueFog's asynchronous decentralized optimizer: parameters mix by window puts.

    Every parameter of ``model`` that requires a gradient becomes a window over the
    topology of :func:`~totalreduce.torch.set_topology` (so every rank builds it,
    as a collective).  Each ``step()`` first combines the parameter with what the
    in-neighbours last put (``win_update``: the plain average, or the topology's
    weights), then takes the wrapped optimizer's step, then (every
    ``num_steps_per_communication`` steps) puts the new values into the
    out-neighbours' windows without waiting: no rank waits for another, a slow
    one only mixes in older values.  ``free_windows()`` (or shutdown) frees the
    windows, with the neighbours.

    Returns an instance of a subclass of ``type(optimizer)`` sharing its state and
    parameter groups (as :func:`~totalreduce.torch.DistributedOptimizer` does).
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise InvalidArgumentError(
            f"DistributedWinPutOptimizer wraps a torch.optim.Optimizer, got "
            f"{type(optimizer).__name__}"
        )
    if not isinstance(model, torch.nn.Module):
        raise InvalidArgumentError(
            "DistributedWinPutOptimizer needs the model (a torch.nn.Module) whose parameters "
            f"become windows, got {type(model).__name__}"
        )
    k = int(num_steps_per_communication)
    if k < 1:
        raise InvalidArgumentError(f"num_steps_per_communication must be >= 1, got {k}")
    base = type(optimizer)
    cls = type(base.__name__, (_WinPutOptimizer, base), {"__module__": base.__module__})
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update(optimizer.__dict__)  # shared: one state, one set of groups
    prefix = "win_put_optimizer." if window_prefix is None else str(window_prefix)
    wrapped._trw_setup(model, k, prefix)
    return wrapped  # type: ignore[no-any-return]


class _WinPutOptimizer(torch.optim.Optimizer):
    """What :func:`DistributedWinPutOptimizer` mixes into the wrapped optimizer's class."""

    _trw_every: int
    _trw_steps: int
    _trw_windows: list[tuple[str, torch.Tensor]]
    _trw_handles: list[WinHandle]

    def _trw_setup(self, model: torch.nn.Module, every: int, prefix: str) -> None:
        self._trw_every = every
        self._trw_steps = 0
        self._trw_windows = []
        self._trw_handles = []
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if p.requires_grad:
                    name = f"{prefix}{pname}"
                    win_create(p.data, name)
                    self._trw_windows.append((name, p.data))

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Mix in the neighbours' latest values, step, then put the result (see the factory)."""
        self._trw_wait()
        with torch.no_grad():
            for name, _ in self._trw_windows:
                win_update(name)
        loss = super().step(closure)
        self._trw_steps += 1
        if self._trw_steps % self._trw_every == 0:
            with torch.no_grad():
                self._trw_handles = [win_put_nonblocking(t, n) for n, t in self._trw_windows]
        return loss

    def _trw_wait(self) -> None:
        handles, self._trw_handles = self._trw_handles, []
        for h in handles:
            h.wait()

    def free_windows(self) -> None:
        """Free the parameters' windows (collective among neighbours)."""
        self._trw_wait()
        for name, _ in self._trw_windows:
            win_free(name)
        self._trw_windows = []

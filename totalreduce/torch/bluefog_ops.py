"""BlueFog's remaining ``bluefog.torch`` calls, with BlueFog's signatures and meanings.

- :func:`hierarchical_neighbor_allreduce`: average inside each machine, then over the
  machine topology (``set_machine_topology``) or BlueFog's per-call machine weights;
- :func:`neighbor_allgather`: the in-neighbors' tensors joined along dimension 0 (ranks
  may differ in dimension 0);
- :func:`InferSourceFromDestinationRanks`, :func:`InferDestinationFromSourceRanks`:
  who sends to me, from everyone's destinations (a collective call);
- :func:`timeline_start_activity`, :func:`timeline_end_activity`, :func:`timeline_context`:
  activities of one's own on this rank's timeline;
- :func:`allreduce_parameters`, :func:`get_current_created_window_names`, the window ops'
  current names (``neighbor_win_put`` ...: BlueFog's ``win_put`` ... are their older
  names), and the switches with nothing to switch here (``set_skip_negotiate_stage``).

Example (BlueFog's hierarchical loop, with ``import totalreduce.torch as bf``)::

    bf.set_machine_topology(topology_util.ExponentialGraph(bf.machine_size()))
    x = bf.hierarchical_neighbor_allreduce(x, name="x")
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch

from ..errors import InvalidArgumentError, TotalReduceError
from ..topology import GetRecvWeights
from . import windows as _windows
from .bluefog import (
    in_neighbor_machine_ranks,
    is_machine_topo_weighted,
    load_machine_topology,
    load_topology,
    out_neighbor_machine_ranks,
)
from .collectives import allreduce_async_, new_tensor_result, priority_value, resolve_service
from .tensors import TensorHandle, array_to_tensor, host_buffer

# ---------------------------------------------------------------- hierarchical averaging


def _machine_weights(
    self_weight: Any, src: Any, dst: Any, machine: int
) -> tuple[float, dict[int, float], dict[int, float]]:
    """BlueFog's machine weights of a call: the machine topology's (all None) or as given."""
    given = (self_weight, src, dst)
    what = "hierarchical_neighbor_allreduce"
    if all(v is None for v in given):
        topo = load_machine_topology()
        if topo is None:
            raise TotalReduceError(
                f"{what}: no machine topology is set; call set_machine_topology(...) first, "
                "or pass self_weight, src_machine_weights and dst_machine_weights"
            )
        if is_machine_topo_weighted():
            sw, srcw = GetRecvWeights(topo, machine)
        else:
            sources = in_neighbor_machine_ranks()
            sw = 1.0 / (len(sources) + 1)
            srcw = dict.fromkeys(sources, sw)
        return sw, srcw, dict.fromkeys(out_neighbor_machine_ranks(), 1.0)
    if any(v is None for v in given):
        raise InvalidArgumentError(
            f"{what}: give self_weight, src_machine_weights and dst_machine_weights together, "
            f"or none of them (got self_weight={self_weight!r}, src_machine_weights={src!r}, "
            f"dst_machine_weights={dst!r})"
        )
    if not isinstance(src, Mapping):
        raise InvalidArgumentError(
            f"{what}: src_machine_weights must map machines to weights, got {src!r}"
        )
    if isinstance(self_weight, bool) or not isinstance(self_weight, (int, float)):
        raise InvalidArgumentError(f"{what}: self_weight must be a float, got {self_weight!r}")
    if len(set(dst)) != len(dst):
        raise InvalidArgumentError(f"{what}: dst_machine_weights repeat a machine: {list(dst)}")
    dstw = {int(m): float(w) for m, w in dst.items()} if isinstance(dst, Mapping) else {
        int(m): 1.0 for m in dst
    }  # fmt: skip
    if load_machine_topology() is not None:  # BlueFog's check: neighbors of the machine graph
        for name, keys, allowed in (
            ("src_machine_weights", set(src), set(in_neighbor_machine_ranks())),
            ("dst_machine_weights", set(dstw), set(out_neighbor_machine_ranks())),
        ):
            if not keys <= allowed:
                raise InvalidArgumentError(
                    f"{what}: {name} name machines {sorted(keys - allowed)} that are not "
                    f"neighbors of machine {machine} in the machine topology ({sorted(allowed)})"
                )
    return float(self_weight), {int(m): float(w) for m, w in src.items()}, dstw


def hierarchical_neighbor_allreduce_nonblocking(
    tensor: torch.Tensor,
    *,
    self_weight: float | None = None,
    src_machine_weights: Mapping[int, float] | None = None,
    dst_machine_weights: Mapping[int, float] | list[int] | None = None,
    enable_topo_check: bool = False,
    name: str | None = None,
    neighbor_machine_weights: Mapping[int, float] | None = None,
    send_neighbor_machines: Mapping[int, float] | list[int] | None = None,
    priority: int | None = None,
    service: Any = None,
) -> TensorHandle:
    """Start BlueFog's hierarchical averaging of ``tensor`` into a new tensor.

    Every machine (``local_size()`` consecutive ranks) first averages ``tensor`` over
    its ranks; the machine averages are then mixed over the machines:
    ``self_weight * own + sum(src_machine_weights[m] * dst_machine_weights_m[me] *
    machine m's)``.  With no weights, the machine topology (``set_machine_topology``)
    gives them: every out-neighbor machine is sent to, and equal weights over the
    machine and its in-neighbors (its own weights with ``is_weighted=True``).  With
    weights, all three: ``dst_machine_weights`` is ``{machine: weight}`` scaling what is
    sent, or a list of machines; every rank of a machine passes the same.  Local rank
    ``l`` of each machine exchanges with local rank ``l`` of the others, so all links work
    at once.  BlueFog's older ``neighbor_machine_weights`` and ``send_neighbor_machines``
    are accepted; ``enable_topo_check`` is accepted and always holds (a pattern that does
    not match fails, naming the ranks).
    """
    del enable_topo_check
    from .bluefog import _layout

    svc = resolve_service(service)
    src = src_machine_weights if src_machine_weights is not None else neighbor_machine_weights
    dst = dst_machine_weights if dst_machine_weights is not None else send_neighbor_machines
    rank, local_size, _ = _layout()
    sw, srcw, dstw = _machine_weights(self_weight, src, dst, rank // local_size)
    buf = host_buffer(tensor)
    h = svc.hierarchical_neighbor_allreduce_async(
        buf.array, name, local_size=local_size, priority=priority_value(priority),
        self_weight=sw, src_machine_weights=srcw, dst_machine_weights=dstw,
        **buf.engine_kwargs,
    )  # fmt: skip
    return TensorHandle(h, new_tensor_result(buf))


def hierarchical_neighbor_allreduce(
    tensor: torch.Tensor,
    *,
    self_weight: float | None = None,
    src_machine_weights: Mapping[int, float] | None = None,
    dst_machine_weights: Mapping[int, float] | list[int] | None = None,
    enable_topo_check: bool = False,
    name: str | None = None,
    neighbor_machine_weights: Mapping[int, float] | None = None,
    send_neighbor_machines: Mapping[int, float] | list[int] | None = None,
    priority: int | None = None,
    service: Any = None,
) -> torch.Tensor:
    """Blocking :func:`hierarchical_neighbor_allreduce_nonblocking`: the averaged tensor."""
    return hierarchical_neighbor_allreduce_nonblocking(
        tensor, self_weight=self_weight, src_machine_weights=src_machine_weights,
        dst_machine_weights=dst_machine_weights, enable_topo_check=enable_topo_check,
        name=name, neighbor_machine_weights=neighbor_machine_weights,
        send_neighbor_machines=send_neighbor_machines, priority=priority, service=service,
    ).wait()  # fmt: skip


# ---------------------------------------------------------------- neighbor all-gather


def _rank_list(ranks: Any, what: str, size: int, me: int) -> list[int]:
    out = []
    for r in ranks:
        if isinstance(r, bool) or not isinstance(r, (int, np.integer)) or not 0 <= r < size:
            raise InvalidArgumentError(f"neighbor_allgather: {what} holds {r!r}, not a rank")
        out.append(int(r))
    if len(set(out)) != len(out) or me in out:
        raise InvalidArgumentError(
            f"neighbor_allgather: {what} {out} repeat a rank or hold this rank ({me})"
        )
    return out


def neighbor_allgather_nonblocking(
    tensor: torch.Tensor,
    *,
    src_ranks: list[int] | None = None,
    dst_ranks: list[int] | None = None,
    enable_topo_check: bool = True,
    name: str | None = None,
    priority: int | None = None,
    service: Any = None,
) -> TensorHandle:
    """Start gathering the tensors of this rank's in-neighbors, joined along dimension 0.

    The sources are ``src_ranks`` (in the order given) while this rank sends to
    ``dst_ranks`` (give both, or neither), or the in-neighbors of the topology
    ``set_topology`` set (ascending).  Ranks may differ in dimension 0, as in BlueFog:
    every rank's row count travels first, in a small all-gather of its own (so this
    call waits for it; the tensors then travel without blocking).  ``enable_topo_check``
    is accepted and always holds.
    """
    del enable_topo_check
    svc = resolve_service(service)
    if (src_ranks is None) != (dst_ranks is None):
        raise InvalidArgumentError(
            "neighbor_allgather: give src_ranks and dst_ranks together, or neither (got "
            f"src_ranks={src_ranks!r}, dst_ranks={dst_ranks!r})"
        )
    t = tensor if tensor.dim() > 0 else tensor.reshape(1)
    rows = int(t.shape[0])
    base = name if name is not None else None
    counts = svc.allgather(
        np.array([rows], dtype=np.int64), None if base is None else f"{base}#rows"
    ).reshape(-1)
    most = int(counts.max())
    padded = t
    if rows < most:
        pad = torch.zeros((most - rows, *t.shape[1:]), dtype=t.dtype, device=t.device)
        padded = torch.cat([t, pad])
    buf = host_buffer(padded.contiguous())
    if src_ranks is None:
        order = None
        h = svc.neighbor_allgather_async(
            buf.array, base, topology=load_topology(), priority=priority_value(priority),
            **buf.engine_kwargs,
        )  # fmt: skip
        sources = sorted(_topology_sources(svc))
    else:
        assert dst_ranks is not None
        order = _rank_list(src_ranks, "src_ranks", svc.size, svc.rank)
        dsts = _rank_list(dst_ranks, "dst_ranks", svc.size, svc.rank)
        h = svc.neighbor_allgather_async(
            buf.array, base, src_ranks=order, dst_ranks=dsts,
            priority=priority_value(priority), **buf.engine_kwargs,
        )  # fmt: skip
        sources = sorted(order)

    def finish(raw: Any) -> torch.Tensor:
        got = array_to_tensor(raw, buf.engine_dtype, t.dtype, t.device)
        blocks = {s: got[k][: int(counts[s])] for k, s in enumerate(sources)}
        wanted = order if order is not None else sources
        if not wanted:
            return t.new_empty((0, *t.shape[1:]))
        return torch.cat([blocks[s] for s in wanted])

    return TensorHandle(h, finish)


def _topology_sources(svc: Any) -> list[int]:
    from ..topology import plan

    return list(plan(load_topology(), svc.rank, 0).src_weights)


def neighbor_allgather(
    tensor: torch.Tensor,
    *,
    src_ranks: list[int] | None = None,
    dst_ranks: list[int] | None = None,
    enable_topo_check: bool = True,
    name: str | None = None,
    priority: int | None = None,
    service: Any = None,
) -> torch.Tensor:
    """Blocking :func:`neighbor_allgather_nonblocking`: the in-neighbors' tensors, joined
    along dimension 0 (in ``src_ranks``' order when given, else ascending)."""
    return neighbor_allgather_nonblocking(
        tensor, src_ranks=src_ranks, dst_ranks=dst_ranks, enable_topo_check=enable_topo_check,
        name=name, priority=priority, service=service,
    ).wait()  # fmt: skip


# ---------------------------------------------------------------- inferring the other side


def _infer(ranks: Any, what: str, transpose: bool, matrix: bool) -> Any:
    svc = resolve_service(None)
    mine = _rank_list(ranks, what, svc.size, svc.rank)
    degrees = svc.allgather(np.array([len(mine)], dtype=np.int64), f"infer.{what}.degrees")
    flat = svc.allgather(np.array(mine, dtype=np.int64), f"infer.{what}.ranks")
    lists, at = [], 0
    for d in degrees.reshape(-1):
        lists.append(sorted(int(r) for r in flat[at : at + int(d)]))
        at += int(d)
    others = [k for k, listed in enumerate(lists) if svc.rank in listed]
    if not matrix:
        return others
    w = np.eye(svc.size)
    for k, listed in enumerate(lists):
        w[k, listed] = 1.0
    if transpose:
        w = w.T
    return others, w / w.sum(axis=0, keepdims=True)


def InferSourceFromDestinationRanks(  # noqa: N802 (BlueFog's name)
    dst_ranks: list[int], construct_adjacency_matrix: bool = False
) -> Any:
    """The ranks that send to this rank, from every rank's ``dst_ranks`` (a collective
    call: every rank calls it), ascending.  With ``construct_adjacency_matrix`` also the
    world's matrix ``A`` in BlueFog's orientation (``A[i, j]``: what ``j`` gives ``i``'s
    value), every rank weighing itself and its sources equally (each column sums to 1)."""
    return _infer(dst_ranks, "dst_ranks", False, construct_adjacency_matrix)


def InferDestinationFromSourceRanks(  # noqa: N802
    src_ranks: list[int], construct_adjacency_matrix: bool = False
) -> Any:
    """The ranks this rank sends to, from every rank's ``src_ranks`` (a collective call),
    ascending; with ``construct_adjacency_matrix`` also the matrix, as
    :func:`InferSourceFromDestinationRanks` gives it."""
    return _infer(src_ranks, "src_ranks", True, construct_adjacency_matrix)


# ---------------------------------------------------------------- utilities and spellings


def allreduce_parameters(params: Any) -> None:
    """Average every parameter over all ranks, in place: ``model.named_parameters()``,
    ``model.parameters()`` (a list) or a dict of name -> tensor, as BlueFog's."""
    if isinstance(params, Mapping):
        named = sorted(params.items())
    elif isinstance(params, (list, tuple)) or hasattr(params, "__iter__"):
        named = [p if isinstance(p, tuple) else (None, p) for p in params]
    else:
        raise InvalidArgumentError(f"allreduce_parameters: invalid params of type {type(params)}")
    handles = [
        allreduce_async_(p.data, f"allreduce_parameters.{n if n is not None else i}", "avg")
        for i, (n, p) in enumerate(named)
    ]
    for h in handles:
        h.wait()


def get_current_created_window_names() -> list[str]:
    """The names of the windows that exist now, sorted."""
    windows: Any = resolve_service(None)
    return sorted(windows.windows.names())


# BlueFog names its window ops neighbor_win_*; win_put ... are its older names of the same.
neighbor_win_put = _windows.win_put
neighbor_win_put_nonblocking = _windows.win_put_nonblocking
neighbor_win_get = _windows.win_get
neighbor_win_get_nonblocking = _windows.win_get_nonblocking
neighbor_win_accumulate = _windows.win_accumulate
neighbor_win_accumulate_nonblocking = _windows.win_accumulate_nonblocking

_negotiate = {"skip": False}


def set_skip_negotiate_stage(value: bool) -> None:
    """BlueFog's switch for its coordinator's negotiation.  totalreduce has no such stage
    (ops meet by name and generation, and a mismatch still fails, naming the ranks):
    the value is kept for :func:`get_skip_negotiate_stage` and changes nothing."""
    _negotiate["skip"] = bool(value)


def get_skip_negotiate_stage() -> bool:
    """The value :func:`set_skip_negotiate_stage` was given (False at first)."""
    return _negotiate["skip"]


def unified_mpi_window_model_supported() -> bool:
    """True: a window here is the tensor's own memory, one copy with no separate public
    view to synchronise (what MPI's unified memory model means)."""
    return True


# ---------------------------------------------------------------- timeline activities

_activities: dict[str, tuple[str, int]] = {}  # tensor name -> (activity, start in ns)
_activities_lock = threading.Lock()


def _timeline() -> Any:
    return getattr(resolve_service(None), "timeline", None)


def timeline_start_activity(tensor_name: str, activity_name: str) -> bool:
    """Start an activity of ``tensor_name`` on this rank's timeline (``TOTALREDUCE_TIMELINE``
    or ``start_timeline``); it appears, named ``activity_name``, once
    :func:`timeline_end_activity` ends it.  False, and nothing recorded, when no timeline
    records (as BlueFog's)."""
    if _timeline() is None:
        return False
    with _activities_lock:
        _activities[str(tensor_name)] = (str(activity_name), time.perf_counter_ns())
    return True


def timeline_end_activity(tensor_name: str) -> bool:
    """End the activity :func:`timeline_start_activity` started for ``tensor_name`` and
    record it; False when no timeline records or none was started."""
    trace = _timeline()
    with _activities_lock:
        started = _activities.pop(str(tensor_name), None)
    if trace is None or started is None:
        return False
    activity, t0 = started
    trace.compute(str(tensor_name), 0, activity, 0, t0, time.perf_counter_ns())
    return True


@contextlib.contextmanager
def timeline_context(tensor_name: str, activity_name: str) -> Iterator[None]:
    """Record the block as an activity of ``tensor_name`` (see
    :func:`timeline_start_activity`)."""
    timeline_start_activity(tensor_name, activity_name)
    try:
        yield
    finally:
        timeline_end_activity(tensor_name)


def suspend() -> None:
    """BlueFog's pause of its background thread for interactive sessions: no counterpart
    here; raises TotalReduceError saying so."""
    raise TotalReduceError(
        "suspend(): totalreduce's engine cannot be suspended (BlueFog's interactive suspend "
        "and resume have no counterpart); shutdown() ends it"
    )


def resume() -> None:
    """BlueFog's resume of :func:`suspend`: no counterpart here; raises TotalReduceError."""
    raise TotalReduceError(
        "resume(): totalreduce's engine is never suspended (BlueFog's interactive suspend "
        "and resume have no counterpart)"
    )

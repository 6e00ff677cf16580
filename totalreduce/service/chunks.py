"""Daemon mode: an op too large for a client's part of the arena runs as several thin ops.

An allreduce, broadcast, reduce-scatter or all-gather whose buffers would take more
than half of a client's part of the node's arena (:meth:`.thin.ThinClient.pieces`)
is cut into pieces of at most a quarter part each: piece ``i`` is a thin op of its
own under the op's name and generation, with a wire id of its own (piece 0 keeps the
name's, so a rank that cut nothing meets it there and the two fail naming their
counts).  The pieces are submitted in order; staging space for a later one waits for
an earlier one to give its space back (backpressure), so the node's copies, the
services' transfers and the copies back overlap, piece by piece.  Every rank cuts the
same way: from a size all ranks of the op know (the count of an allreduce or a
broadcast, the total of a reduce-scatter's or an all-gather's parts).

- Allreduce, broadcast: piece ``i`` is elements ``[a_i, b_i)`` of the input and the
  output (views: an array in the arena stays zero copy).
- Reduce-scatter: each rank's part is cut the same way; piece ``i`` is the ``i``-th cut of
  every part (gathered into one input) and lands in the ``i``-th cut of this rank's part.
- All-gather: piece ``i`` sends the ``i``-th cut of this rank's part; what comes back is
  put in place, part by part, as each piece ends.

The caller's handle ends when the last piece has (or at the first piece that fails).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ..algorithms.codes import AlgorithmCode, OpKind
from ..algorithms.schedule import balanced_parts
from ..dtypes import DType, ReduceOp
from ..group import Group
from .thin import ThinHandle

if TYPE_CHECKING:
    from .submit import OpSubmitter

#: The kinds that are cut into pieces when they are too large for the arena.
CUT = frozenset({OpKind.ALLREDUCE, OpKind.BROADCAST, OpKind.REDUCE_SCATTER, OpKind.ALLGATHER})

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def shared_bytes(kind: OpKind, x: np.ndarray, parts: tuple[int, ...] | None) -> int:
    """The size every rank of the op knows alike, which decides the cut."""
    if kind is OpKind.ALLGATHER:
        assert parts is not None
        return sum(parts) * x.itemsize
    return int(x.nbytes)


def piece_wire(wire: int, i: int) -> int:
    """Piece ``i``'s wire id: piece 0 keeps the op's."""
    return wire if i == 0 else ((wire ^ (i * _GOLDEN)) * _GOLDEN + i) & _MASK


def run(
    sub: OpSubmitter,
    pieces: int,
    kind: OpKind,
    x: np.ndarray,
    dtype: DType,
    out: np.ndarray,
    in_place: bool,
    name: str | int | None,
    op: ReduceOp,
    priority: Any,
    root: int,
    result: Any,
    *,
    group: Group | None,
    parts: tuple[int, ...] | None,
    finalize: Callable[[], Any] | None,
    reserved: tuple[str | int, int] | None,
    handle: ThinHandle | None,
    shown: OpKind | None,
    algorithm: AlgorithmCode,
) -> ThinHandle:
    """Submit the op as ``pieces`` thin ops; the handle that ends with the last of them."""
    thin = sub._thin
    assert thin is not None
    names = sub._names
    if reserved is None:
        sig = (kind.name.lower(), dtype.name.lower(), int(x.size), op.name.lower(), root)
        reserved = names.name(name, sig)
    op_name, gen = reserved
    final = handle or ThinHandle(
        thin, op_name, gen, shown or kind, result, lambda: names.ended(op_name)
    )
    wire = sub._wire_id(op_name)
    plan = _plan(kind, x, out, parts, pieces, group, sub.rank, sub.size)
    state = {"left": len(plan), "error": None}
    lock = threading.Lock()

    def ended(h: ThinHandle, back: Callable[[], None] | None) -> None:
        err = h.exception()
        if err is None and back is not None:
            try:
                back()
            except Exception as exc:  # never leave the caller waiting
                err = exc
        with lock:
            if final.done() or state["error"] is not None:
                return
            state["left"] -= 1
            if err is not None:
                state["error"] = err
            elif state["left"]:
                return
        value = None
        if err is None:
            try:
                value = finalize() if finalize is not None else result
            except Exception as exc:
                err = exc
        thin.settle(final, value, err)

    for i, (xi, oi, pi, back) in enumerate(plan):
        h = ThinHandle(thin, op_name, gen, shown or kind, None, _nothing)
        try:
            sub._thin_op(
                kind, xi, dtype, oi, in_place and pi is None, name, op, priority, root, None,
                group=group, parts=pi, reserved=reserved, handle=h, shown=shown,
                algorithm=algorithm, wire=piece_wire(wire, i),
            )  # fmt: skip
        except BaseException as exc:  # the pieces in flight end unheard; the name ends
            with lock:
                state["error"] = exc
            thin.settle(final, None, exc if isinstance(exc, Exception) else None)
            raise
        h.add_done_callback(lambda h, back=back: ended(h, back))
    return final


def _nothing() -> None:
    pass


def _plan(
    kind: OpKind,
    x: np.ndarray,
    out: np.ndarray,
    parts: tuple[int, ...] | None,
    pieces: int,
    group: Group | None,
    rank: int,
    size: int,
) -> list[tuple[np.ndarray, np.ndarray, tuple[int, ...] | None, Callable[[], None] | None]]:
    """Per piece: (input, output, parts, what to do once it ended)."""
    xf, of = x.reshape(-1), out.reshape(-1)
    if parts is None:  # allreduce, broadcast: element ranges, views of both
        return [
            (xf[a : a + n], of[a : a + n], None, None) for a, n in balanced_parts(xf.size, pieces)
        ]
    grp = group or Group.world(size)
    me = grp.rank_of(rank)
    assert me is not None
    starts = [int(s) for s in np.cumsum((0, *parts))[:-1]]  # where each part begins
    cuts = [balanced_parts(c, pieces) for c in parts]  # per group rank: its pieces
    plan: list[tuple[np.ndarray, np.ndarray, tuple[int, ...] | None, Callable[[], None] | None]]
    plan = []
    for i in range(pieces):
        pi = tuple(cut[i][1] for cut in cuts)
        a, n = cuts[me][i]
        if kind is OpKind.REDUCE_SCATTER:
            xi = np.concatenate([xf[s + cut[i][0] : s + cut[i][0] + cut[i][1]]
                                 for s, cut in zip(starts, cuts, strict=True)])  # fmt: skip
            plan.append((xi, of[a : a + n], pi, None))
        else:  # all-gather: this rank's cut out, every rank's cut back in place
            got = np.empty(sum(pi), dtype=out.dtype)
            plan.append((xf[a : a + n], got, pi, _put_back(of, got, starts, cuts, i)))
    return plan


def _put_back(
    of: np.ndarray, got: np.ndarray, starts: list[int], cuts: list[list[tuple[int, int]]], i: int
) -> Callable[[], None]:
    def back() -> None:
        at = 0
        for s, cut in zip(starts, cuts, strict=True):
            a, n = cut[i]
            of[s + a : s + a + n] = got[at : at + n]
            at += n

    return back

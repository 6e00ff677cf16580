"""Daemon mode: an op too large for a client's part of the arena runs as several thin ops.

An allreduce, broadcast, reduce-scatter, all-gather or all-to-all whose buffers would
take more than half of a client's part of the node's arena
(:meth:`.thin.ThinClient.pieces`) is cut into pieces of at most an eighth part each:
piece ``i`` is a thin op of its own under the op's name and generation, with a wire id
of its own (piece 0 keeps the name's, so a rank that cut nothing meets it there and the
two fail naming their counts). Two pieces are in flight at a time (:data:`IN_FLIGHT`):
the caller submits the first two, and a thread of the op's submits each later one when
the one two before it has ended, so one piece's copies overlap another's transfer, and a
large send and a large receive of one client fit its part together (each holds at most a
quarter of it). Every rank cuts the same way: from a size all ranks of the op know (the
count of an allreduce or a broadcast, the total of a reduce-scatter's or an all-gather's
parts; for an all-to-all its caller names one: ``P`` times a gather's part, a message's
size, a neighbor op's input times ``P - 1``; an all-to-all with uneven splits has none
and is not cut).

- Allreduce, broadcast: piece ``i`` is elements ``[a_i, b_i)`` of the input and the
  output (views: an array in the arena stays zero copy).
- Reduce-scatter: each rank's part is cut the same way; piece ``i`` is the ``i``-th cut of
  every part (gathered into one input) and lands in the ``i``-th cut of this rank's part.
- All-gather: piece ``i`` sends the ``i``-th cut of this rank's part; what comes back is
  put in place, part by part, as each piece ends.
- All-to-all (and the gathers, scatters, messages and neighbor ops built on it): every
  pair's block is cut alike on both sides (both know its size); piece ``i`` sends the
  ``i``-th cut of each block and puts the ``i``-th cuts it receives in place.

The caller's handle ends when the last piece has (or at the first piece that fails).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from ..algorithms.codes import OpKind
from ..algorithms.schedule import balanced_parts
from ..group import Group
from .thin import ThinHandle

#: The kinds that are cut into pieces when they are too large for the arena (an all-to-all
#: only where its caller names the size that decides).
CUT = frozenset({OpKind.ALLREDUCE, OpKind.BROADCAST, OpKind.REDUCE_SCATTER, OpKind.ALLGATHER,
                 OpKind.ALLTOALL})  # fmt: skip

#: Pieces of one op in flight at once: enough that one's copies overlap another's transfer,
#: few enough that a large send and a large receive of one client fit its part together.
IN_FLIGHT = 2
_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def shared_bytes(kind: OpKind, x: np.ndarray, parts: tuple[int, ...] | None, cut: int) -> int:
    """The size every rank of the op knows alike, which decides the cut (an all-to-all's
    is its caller's ``cut``, 0 where there is none)."""
    if kind is OpKind.ALLTOALL:
        return cut
    if kind is OpKind.ALLGATHER:
        assert parts is not None
        return sum(parts) * x.itemsize
    return int(x.nbytes)


def piece_wire(wire: int, i: int) -> int:
    """Piece ``i``'s wire id: piece 0 keeps the op's."""
    return wire if i == 0 else ((wire ^ (i * _GOLDEN)) * _GOLDEN + i) & _MASK


def run(sub: Any, pieces: int, call: dict[str, Any]) -> ThinHandle:
    """Submit an op as ``pieces`` thin ops; the handle that ends with the last of them.

    ``sub`` is the service (``service/submit.py``'s ``OpSubmitter``, which imports this
    module) and ``call`` the arguments of its ``_thin_op`` for the whole op, its name
    already reserved (``reserved``)."""
    thin = sub._thin
    assert thin is not None
    names = sub._names
    op_name, gen = call["reserved"]
    kind, x, result, finalize = call["kind"], call["x"], call["result"], call["finalize"]
    shown = call["shown"] or kind
    final = call["handle"] or ThinHandle(
        thin, op_name, gen, shown, result, lambda: names.ended(op_name)
    )
    wire = sub._wire_id(op_name)
    plan = _plan(kind, x, call["out"], call["parts"], pieces, call["group"], sub.rank, sub.size)
    state = {"left": len(plan), "error": None}
    lock = threading.Lock()
    #: pieces that ended, by index; the feeding thread waits on ``changed`` for the one
    #: ``IN_FLIGHT`` before its next, or for the op to fail (a piece made passive then
    #: may never end: a thread waiting on it alone would wait for ever)
    over: set[int] = set()
    changed = threading.Condition(lock)

    def ended(i: int, h: ThinHandle, back: Callable[[], None] | None) -> None:
        err = h.exception()
        if err is None and back is not None:
            try:
                back()
            except Exception as exc:  # never leave the caller waiting
                err = exc
        with lock:
            over.add(i)
            changed.notify_all()
            if final.done() or state["error"] is not None:
                return
            state["left"] -= 1
            if err is not None:
                err = _told(err, int(x.size), len(plan))
                state["error"] = err
                # The other pieces in flight may never end (a rank that did not cut has
                # no piece to meet them): nothing waits for them, shutdown included.
                for other in sent:
                    other.passive = True
            elif state["left"]:
                return
        value = None
        if err is None:
            try:
                value = finalize() if finalize is not None else result
            except Exception as exc:
                err = exc
        thin.settle(final, value, err)

    def submit(i: int) -> None:
        xi, oi, pi, back = plan[i]
        h = ThinHandle(thin, op_name, gen, shown, None, _nothing)
        in_place = call["in_place"] and pi is None
        sub._thin_op(**{**call, "x": xi, "out": oi, "in_place": in_place, "parts": pi,
                        "result": None, "finalize": None, "handle": h,
                        "wire": piece_wire(wire, i)})  # fmt: skip
        with lock:
            sent.append(h)
            if state["error"] is not None:  # the op failed meanwhile: this may never end
                h.passive = True
        h.add_done_callback(lambda h: ended(i, h, back))

    def fail(exc: BaseException) -> None:  # the pieces in flight end unheard; the name ends
        with lock:
            state["error"] = exc
            changed.notify_all()
        thin.settle(final, None, exc if isinstance(exc, Exception) else None)

    sent: list[ThinHandle] = []
    try:
        for i in range(min(IN_FLIGHT, len(plan))):
            if state["error"] is not None:
                break
            submit(i)
    except BaseException as exc:
        fail(exc)
        raise

    def feed() -> None:
        """The later pieces, each once the one ``IN_FLIGHT`` before it has ended (its
        callback ran: the client's watcher thread sees it end); none once the op failed."""
        try:
            for i in range(IN_FLIGHT, len(plan)):
                with lock:
                    while i - IN_FLIGHT not in over and state["error"] is None:
                        if thin.closed:
                            return
                        changed.wait(0.5)  # (a shutdown ends no op: looked at twice a second)
                if state["error"] is not None or final.done() or thin.closed:
                    return
                submit(i)
        except Exception as exc:
            fail(exc)

    if len(plan) > IN_FLIGHT:
        threading.Thread(target=feed, name=f"totalreduce-pieces-{sub.rank}", daemon=True).start()
    return final


def _nothing() -> None:
    pass


def _told(err: BaseException, count: int, pieces: int) -> BaseException:
    """A piece's error, saying that the counts it names are a piece's."""
    text = (
        f"{err} (this rank's op has {count} elements and ran in {pieces} pieces, as it does "
        "not fit half of a client's part of the node's arena: counts above are a piece's)"
    )
    try:
        told = type(err)(text)
    except Exception:  # an error type that takes other arguments: as it is
        return err
    told.__cause__ = err.__cause__
    return told


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
    if kind is OpKind.ALLTOALL:
        return _plan_alltoall(xf, of, parts, pieces)
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


def _plan_alltoall(
    xf: np.ndarray, of: np.ndarray, parts: tuple[int, ...], pieces: int
) -> list[tuple[np.ndarray, np.ndarray, tuple[int, ...] | None, Callable[[], None] | None]]:
    """An all-to-all's pieces: ``parts`` is (splits..., receives...) by group rank."""
    g = len(parts) // 2
    sends, recvs = parts[:g], parts[g:]
    s_at = [int(s) for s in np.cumsum((0, *sends))[:-1]]
    r_at = [int(s) for s in np.cumsum((0, *recvs))[:-1]]
    s_cuts = [balanced_parts(c, pieces) for c in sends]
    r_cuts = [balanced_parts(c, pieces) for c in recvs]
    plan: list[tuple[np.ndarray, np.ndarray, tuple[int, ...] | None, Callable[[], None] | None]]
    plan = []
    for i in range(pieces):
        xi = np.concatenate([xf[s + cut[i][0] : s + cut[i][0] + cut[i][1]]
                             for s, cut in zip(s_at, s_cuts, strict=True)])  # fmt: skip
        pi = (*(cut[i][1] for cut in s_cuts), *(cut[i][1] for cut in r_cuts))
        got = np.empty(sum(pi[g:]), dtype=of.dtype)
        plan.append((xi, got, pi, _put_back(of, got, r_at, r_cuts, i)))
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

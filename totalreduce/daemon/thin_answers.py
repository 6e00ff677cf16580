"""The arena thread's answers to its clients: results back into their buffers, completion
words and error texts, late errors, and the wake-up of a client that sleeps.

:class:`Answers` is a base of :class:`~.thin.ThinService`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..algorithms.codes import OpKind
from ..algorithms.rooted import offsets
from ..dtypes import DType
from ..kernels import copy_into, finish_average
from ..transport import arena as A
from ..transport.meeting import wake_client
from ..transport.shm import fence
from .thin_ops import (
    _A2A,
    _AG,
    _CLIENT_TERMS,
    _PARTED,
    _RS,
    _SESSION,
    _error_kind,
    _Mismatch,
    _Op,
    _Segments,
)

log = logging.getLogger("totalreduce.daemon")


class Answers:
    """Ends the node's ops (a base of :class:`~.thin.ThinService`)."""

    engine: Any
    arena: Any
    slots: int
    _inc: list[int]
    _efd: list[int | None]
    _ctl: list[np.ndarray]
    _ctl_at: list[int]
    _words: list[np.ndarray]
    _running: dict[tuple[int, int, int], Any]
    _answering: threading.Lock
    _meet_fail_rounds: Any

    def _finish(self, op: _Op, error: BaseException | None, h: Any = None) -> None:
        """The op ended among the nodes (any thread): results back, words set."""
        self._running.pop(op.key, None)
        d0 = op.first()
        if op.handle is not None:
            self._forget_unnamed(op.key[0], d0, op.handle)
        result = None
        if error is None and h is not None and int(d0[A.D_KIND]) in _PARTED:
            try:
                result = h.wait(0)
            except Exception as exc:
                error = exc
        if error is not None:
            self._fail(
                op, _error_kind(error), self._among_nodes_text(error, op.handle, d0, op.key[2])
            )
            return
        if not self._claim(op):
            return  # failed meanwhile (the service stops)
        try:
            self._results_back(op, result)
        except _Mismatch as exc:
            op.over = False
            self._fail(op, A.E_MISMATCH, str(exc))
            return
        except Exception as exc:  # never leave the clients waiting
            log.exception("the arena thread could not hand back %s", op.key)
            op.over = False
            self._fail(op, A.E_FAILED, f"the node's service could not hand the result back: {exc}")
            return
        for k, x in enumerate(op.descs):
            if x is not None:
                self._answer(k, op.incarnations[k], x, 0, "")
        op.release()

    def _forget_unnamed(self, wire: int, d: np.ndarray, h: Any) -> None:
        """An unnamed op ended among the services (its handle ``h``): its wire id comes
        once, but for the session agreement's (once per job), so the engine forgets it."""
        if int(d[A.D_FLAGS]) & A.F_UNNAMED:
            for name in getattr(h, "names", (h.name,)):  # a segmented op's every name
                self.engine.forget_name(name, h.generation if wire == _SESSION else None)

    def _results_back(self, op: _Op, result: np.ndarray | None) -> None:
        d = op.first()
        g = op.grp
        kind = int(d[A.D_KIND])
        if kind == int(OpKind.BARRIER):
            return
        dt = DType(int(d[A.D_DTYPE]))
        if kind == _A2A:
            self._alltoall_back(op, result, dt)
            return
        avg = bool(int(d[A.D_FLAGS]) & A.F_AVG)
        parts = op.parts[g.local[0][1]]
        buf = op.node_buf if result is None else result
        assert buf is not None
        if kind == _RS:
            assert parts is not None
            if avg:
                finish_average(buf, len(g.ranks), dt)
            at = 0
            for gi in g.members[g.where]:  # this node's block: its members' parts in order
                k = g.ranks[gi] % self.slots
                self._put(op, k, buf[at : at + parts[gi]], dt)
                at += parts[gi]
            return
        if kind == _AG:
            assert parts is not None
            if not g.identity:  # back to group order
                whole = np.empty(sum(parts), dtype=buf.dtype)
                starts, pos = offsets(parts), 0
                for gi in g.order:
                    whole[starts[gi] : starts[gi] + parts[gi]] = buf[pos : pos + parts[gi]]
                    pos += parts[gi]
                buf = whole
        elif avg:
            h = op.handle
            if isinstance(h, _Segments):  # the pass's op: its segments that went back
                for (lo, hi), back in zip(h.ranges, h.backed, strict=True):  # divided then
                    if not back:
                        finish_average(buf[lo:hi], len(g.ranks), dt)
            else:
                finish_average(buf, len(g.ranks), dt)
        for _, k in g.local:
            self._put(op, k, buf, dt)

    def _put(self, op: _Op, slot: int, src: np.ndarray, dt: DType) -> None:
        """The result ``src`` into slot ``slot``'s output (unless it is there already)."""
        x = op.descs[slot]
        assert x is not None
        at = int(x[A.D_OUT])
        if self.arena.offset_of(src) != at and self._inc[slot] == op.incarnations[slot]:
            copy_into(self.arena.view(at, src.size, src.dtype), src, dt)

    def _claim(self, op: _Op) -> bool:
        """Whether this caller ends ``op`` (its engine callback and a failure may race)."""
        with self._answering:
            if op.over:
                return False
            op.over = True
            return True

    def _fail(self, op: _Op, kind: int, why: str) -> None:
        """Fail ``op`` on this node's clients and on every node: an op the services run is
        aborted there; for one this node never started, the services' engine takes its
        next generation of the name and fails it everywhere (so every node counts it)."""
        if not self._claim(op):
            return
        op.why, op.fail_kind = why, kind
        h = op.handle
        d = next((x for x in op.descs if x is not None), None)
        # (the job's agreement has no name among the services before it starts there:
        # thin_session.py)
        if (
            h is None and d is not None and len(op.grp.nodes) > 1 and self.engine is not None
            and op.key[0] != _SESSION
        ):  # fmt: skip
            try:
                # (a segmented op's other segments fail where they started: the first
                # runs under this name)
                name = self._engine_name(op.key)
                self.engine.abort_next(name, _CLIENT_TERMS + why, kind == A.E_MISMATCH)
                if int(d[A.D_FLAGS]) & A.F_UNNAMED:
                    self.engine.forget_name(name)
            except Exception:
                log.debug("no abort for %s", op.key, exc_info=True)
        if h is not None and not h.done():
            try:
                if isinstance(h, _Segments):
                    h.abort(_CLIENT_TERMS + why, kind == A.E_MISMATCH)
                else:
                    self.engine.abort(
                        h.name, h.generation, _CLIENT_TERMS + why, kind == A.E_MISMATCH
                    )
            except Exception:
                log.debug("abort of %r failed", h.name, exc_info=True)
        for k, x in enumerate(op.descs):
            if x is not None:
                self._answer(k, op.incarnations[k], x, kind, why)
        self._running.pop(op.key, None)  # the engine's abort ends it there; nothing to drive
        op.release()

    def _fail_clash(
        self, ops: list[_Op], why: str, rounds: Sequence[tuple[int, int, int, list[int]]] = ()
    ) -> None:
        """Ops of one name and generation that ranks gave two routes or groups fail as a
        mismatch, with the meeting's ``rounds`` of them (channel, op slot, generation, the
        clients there): those that completed are raised late first (a rank that sees its op
        fail may look for the others' errors at once), the others fail then."""
        for o in ops:
            if o.over and not o.fail_kind:
                self._late(o, A.E_MISMATCH, why)
        if rounds:
            self._meet_fail_rounds(list(rounds), why)
        for o in ops:
            if not o.over:
                self._fail(o, A.E_MISMATCH, why)

    def _late(self, op: _Op, kind: int, why: str) -> None:
        """``op`` completed here, but it fails: each of its clients raises at its next call
        (the late errors of embedded mode)."""
        for k, x in enumerate(op.descs):
            if x is None or self._inc[k] != op.incarnations[k] or not self._inc[k]:
                continue
            ctl = self._ctl[k]
            with self._answering:
                n = int(ctl[A.C_LATE]) + 1
                A.write_error(ctl, -n, kind, f"{int(x[A.D_TICKET])}\x1e{why}")
                fence()
                ctl[A.C_LATE] = n

    def _answer(self, slot: int, inc: int, d: np.ndarray, kind: int, why: str) -> None:
        if self._inc[slot] != inc or not inc:
            return  # that client is gone: nobody reads its words
        ctl = self._ctl[slot]
        ticket = int(d[A.D_TICKET])
        with self._answering:  # the arena thread and the engine's callbacks
            if kind:
                A.write_error(ctl, ticket, kind, why)
            self._words[slot][(ticket - 1) % A.RING] = -ticket if kind else ticket
        fence()
        if ctl[A.C_SLEEPING]:
            wake_client(self._ctl_at[slot])

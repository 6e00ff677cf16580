"""Adasum: an allreduce whose combine adapts to the gradients (Horovod's ``op=hvd.Adasum``).

Two gradients combine as ``(1 - a.b/2|a|^2) a + (1 - a.b/2|b|^2) b``: orthogonal ones
add, equal ones average.  Over ranks it is recursive doubling on whole vectors: at
level ``d`` each rank exchanges its partial result with rank ``me ^ d`` (two
point-to-point ops of the engine, both directions at once) and both combine them
with the lower rank's vector as ``a`` (:func:`totalreduce.kernels.adasum_into`,
float64 sums), so every rank ends with the same bits.  With a number of ranks
that is not a power of two, the ranks past the largest power of two first fold
their gradient into rank ``me - m`` and get the result back at the end.

An op is a chain of stages; each stage's ops are submitted at once and the next
stage starts from the completion of the last one (on the thread that completed
it), so nothing waits in between and ``allreduce_async(op="adasum")`` returns at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..dtypes import DType
from ..errors import InvalidArgumentError, OpTimeoutError
from ..group import Group
from ..kernels import adasum_into, copy_into, narrow_into, widen_into

__all__ = ["AdasumHandle", "AdasumOps"]

_NARROW = (DType.FLOAT16, DType.BFLOAT16)
_FLOATS = (DType.FLOAT16, DType.BFLOAT16, DType.FLOAT32, DType.FLOAT64)


class AdasumHandle:
    """The handle of one Adasum allreduce (``done``, ``wait``, ``exception``, callbacks)."""

    def __init__(self, name: str | int, generation: int, result: Any) -> None:
        self.name = name
        self.generation = generation
        self._result = result
        self._event = threading.Event()
        self._error: BaseException | None = None
        self._current: list[Any] = []
        self._then: list[Callable[[Any], None]] = []
        self._lock = threading.Lock()

    def _finish(self, error: BaseException | None) -> None:
        with self._lock:
            if self._event.is_set():
                return
            self._error = error
            self._event.set()
            callbacks, self._then = self._then, []
        for fn in callbacks:
            fn(self)

    def add_done_callback(self, fn: Callable[[Any], None]) -> None:
        """Call ``fn(handle)`` once when the op ends (at once if it has)."""
        with self._lock:
            if not self._event.is_set():
                self._then.append(fn)
                return
        fn(self)

    def done(self) -> bool:
        """True once the op completed or failed (progresses the engine once)."""
        if not self._event.is_set():
            for h in list(self._current):
                h.done()
        return self._event.is_set()

    def exception(self) -> BaseException | None:
        return self._error

    def wait(self, timeout: float | None = None) -> Any:
        """Block until the whole chain is done; return the result."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._event.is_set():
            for h in list(self._current):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise OpTimeoutError(
                        f"op {self.name!r} generation {self.generation} (adasum) did not "
                        f"complete within {timeout} s"
                    )
                try:
                    h.wait(left)
                except OpTimeoutError:
                    raise
                except Exception:  # noqa: S112 - the chain reports it below
                    continue
            if not self._current and not self._event.wait(0.01):
                continue
        if self._error is not None:
            raise self._error
        return self._result

    def __repr__(self) -> str:
        state = "done" if self._event.is_set() else "in flight"
        return f"<AdasumHandle op={self.name!r} generation={self.generation} {state}>"


class AdasumOps:
    """``allreduce_async(x, op="adasum")`` (mixed into the service)."""

    rank: int

    def _adasum(
        self, arr: np.ndarray, dt: DType, name: Any, out: np.ndarray, grp: Group, priority: Any
    ) -> AdasumHandle:
        if dt not in _FLOATS:
            raise InvalidArgumentError(
                f"allreduce op 'adasum' combines floating gradients (float16, bfloat16, "
                f"float32, float64), got {dt.name.lower()}"
            )
        sig = ("allreduce", dt.name.lower(), int(arr.size), "adasum", 0)  # the caller's dtype
        op_name, gen = self._names.name(name, sig)  # type: ignore[attr-defined]
        names = self._names  # type: ignore[attr-defined]
        handle = AdasumHandle(op_name, gen, out.reshape(arr.shape))
        members = list(grp.ranks)
        p = len(members)
        me = members.index(self.rank)
        # 16-bit floats combine (and travel) as float32, rounded back once at the end.
        user_dt, dt = dt, (DType.FLOAT32 if dt in _NARROW else dt)
        vec = np.empty(arr.size, dtype=dt.numpy)
        if user_dt in _NARROW:
            widen_into(vec, arr.reshape(-1), user_dt)
        else:
            copy_into(vec, arr.reshape(-1), dt)
        tmp = np.empty_like(vec)
        m = 1
        while m * 2 <= p:
            m *= 2

        def point(send: bool, peer: int, level: str) -> Any:
            src, dst = (me, peer) if send else (peer, me)
            sub = f"{op_name}/adasum {level} {members[src]}->{members[dst]}"
            pair = Group(sorted((members[src], members[dst])))
            empty = np.empty(0, dtype=vec.dtype)
            if send:
                return self._point(vec, empty, dt, pair, members[src], sub, priority, None)  # type: ignore[attr-defined]
            return self._point(empty, tmp, dt, pair, members[src], sub, priority, tmp)  # type: ignore[attr-defined]

        # The stages: (ops to start, what to do once they all completed).
        stages: list[tuple[Callable[[], list[Any]], Callable[[], None]]] = []
        if me >= m:  # fold in, get the result back
            stages.append((lambda: [point(True, me - m, "fold")], lambda: None))
            stages.append((lambda: [point(False, me - m, "back")], lambda: copy_into(vec, tmp, dt)))
        else:
            if me + m < p:
                stages.append(
                    (lambda: [point(False, me + m, "fold")], lambda: adasum_into(vec, vec, tmp, dt))
                )
            d = 1
            while d < m:
                partner = me ^ d
                lower_is_me = me < partner

                def combine(lower_is_me: bool = lower_is_me) -> None:
                    if lower_is_me:
                        adasum_into(vec, vec, tmp, dt)
                    else:
                        adasum_into(vec, tmp, vec, dt)

                stages.append(
                    (
                        lambda partner=partner, d=d: [
                            point(True, partner, str(d)),
                            point(False, partner, str(d)),
                        ],
                        combine,
                    )
                )
                d *= 2
            if me + m < p:
                stages.append((lambda: [point(True, me + m, "back")], lambda: None))

        finished = [False]
        finish_lock = threading.Lock()

        def finish(error: BaseException | None) -> None:
            with finish_lock:
                if finished[0]:
                    return
                finished[0] = True
            names.ended(op_name)
            if error is None and user_dt in _NARROW:
                narrow_into(out.reshape(-1), vec, user_dt)
            elif error is None:
                copy_into(out.reshape(-1), vec, dt)
            handle._current = []
            handle._finish(error)

        def run(k: int) -> None:
            if k == len(stages):
                finish(None)
                return
            start, after = stages[k]
            ops = start()
            handle._current = ops
            left = [len(ops)]
            lock = threading.Lock()

            def one_done(h: Any) -> None:
                err = h.exception()
                if err is not None:
                    finish(err)
                    return
                with lock:
                    left[0] -= 1
                    last = left[0] == 0
                if last and not handle._event.is_set():
                    try:
                        after()
                    except Exception as exc:  # a kernel refusing: fail the op, not the loop
                        finish(exc)
                        return
                    run(k + 1)

            for h in ops:
                h.add_done_callback(one_done)

        try:
            run(0)
        except BaseException:
            names.ended(op_name)
            raise
        return handle

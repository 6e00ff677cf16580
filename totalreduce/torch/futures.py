"""From engine handles to torch futures and ``Work``: the one place torch futures complete.

This module owns :func:`torch_future` and :func:`torch_work`, the adapter every
part of ``totalreduce.torch`` uses to hand an engine op to torch (the DDP comm
hooks, the ``"totalreduce"`` process group, with its timeouts), and the thread
that completes those futures.  ``Work`` objects handed to torch are this
module's; a result tensor is made by the op's :class:`~.tensors.TensorHandle`
(its ``wait()``), which ``finish`` reads.  When the engine changes how
completions reach Python, this module is what changes.

Two rules, learned from a survivor that segfaulted when its peer died:

- **An error must be an error in C++.**  ``torch.futures.Future.set_exception``
  does not fail the future: it completes it *successfully* with the exception
  object as its value and installs a Python-only "unwrap" function that raises
  it when Python calls ``wait()`` (pytorch/pytorch#50983).  C++ consumers never
  see the error: DDP's reducer reads the value as the bucket's tensors, gets an
  empty list and indexes it (signal 11 in ``backward()``), a Python comm hook's
  result fails with "Unable to cast ... to Tensor", and the ``Work`` of
  ``_create_work_from_future`` returns True from ``wait()``.  The only way to
  fail a torch future from Python is to raise inside a ``then`` callback: torch
  then marks the child future with a C++ error.  So every future handed out is
  ``source.then(finish)``; the adapter completes ``source`` and ``finish``
  either returns the result or raises the op's error.
- **Completed on the completion thread, not the comm thread.**  Completing a
  torch future runs, on the completing thread, every callback chained on it
  (DDP's, a user's ``fut.then(...)``) and the copies out of the engine's
  buffers.  On the comm thread those would stall every other op, and a callback
  that waits on another op would raise (the loop cannot wait for itself).  A
  completion thread completes them instead (another starts while one is blocked
  in a callback); a thread blocked in
  :meth:`Work.wait <torch_work>` completes its own op at once (it has just
  driven the engine to it), so synchronous torch.distributed calls cross no
  thread hand-off.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..errors import OpTimeoutError
from ..service.handle import HandleLike

log = logging.getLogger("totalreduce.torch.futures")

__all__ = ["torch_future", "torch_work"]


class _Completion:
    """One torch future fed by engine handles: completed once, by whoever settles first.

    ``future`` (what torch and users get) is ``source.then(self._finish)``;
    settling sets ``source``, which runs ``_finish`` on the settling thread.
    """

    __slots__ = ("handles", "finish", "future", "error", "_source", "_left", "_settled", "_lock")

    def __init__(self, handles: Sequence[HandleLike], finish: Callable[[], Any]) -> None:
        self.handles = list(handles)
        self.finish = finish
        self.error: BaseException | None = None
        self._source: torch.futures.Future[None] = torch.futures.Future()
        self.future: torch.futures.Future[Any] = self._source.then(self._finish)
        self._left = len(self.handles)
        self._settled = False
        self._lock = threading.Lock()

    def start(self) -> None:
        """Watch the handles (after construction, so a callback never sees a half-built self)."""
        if not self.handles:
            self.settle()
            return
        for h in self.handles:
            h.add_done_callback(self._one_done)

    def _one_done(self, h: HandleLike) -> None:
        # Runs on the comm thread (or a thread driving the engine): only hand over.
        with self._lock:
            self._left -= 1
            ready = self._left == 0 or h.exception() is not None
        if ready:
            _COMPLETER.put(self)

    def settle(self) -> None:
        """Complete the future (once): its value, or the op's error as a C++ error."""
        with self._lock:
            if self._settled:
                return
            self._settled = True
        self._source.set_result(None)  # runs _finish, then the future's callbacks, here

    def _finish(self, _source: torch.futures.Future[None]) -> Any:
        error = next((e for h in self.handles if (e := h.exception()) is not None), None)
        if error is None:
            try:
                for h in self.handles:
                    h.wait()  # done already; copies staged results back (CUDA, non-contiguous)
                return self.finish()
            except BaseException as exc:  # a failed copy must reach the waiter
                error = exc
        self.error = error
        # Raising here is what makes torch fail the future in C++ (see the module docstring).
        raise error


class _Completer:
    """The threads that settle completions handed over by the comm thread.

    One thread does the work while callbacks are short.  A callback chained on a
    future may block, even on another totalreduce future (as it may on gloo's);
    that future is completed here too, so a completion that finds no thread idle
    starts another (idle extra threads leave after ``_IDLE_S``).
    """

    _IDLE_S = 2.0

    def __init__(self) -> None:
        self._queue: deque[_Completion] = deque()
        self._cond = threading.Condition(threading.Lock())
        self._pid = -1
        self._threads = 0
        self._idle = 0
        self._busy = 0  # threads inside settle(): inside torch's C++ (future callbacks)

    def put(self, completion: _Completion) -> None:
        with self._cond:
            if self._pid != os.getpid():  # first use, or a forked child without the threads
                self._pid, self._threads, self._idle = os.getpid(), 0, 0
            self._queue.append(completion)
            if self._idle >= len(self._queue):
                self._cond.notify()
                return
            self._threads += 1
        threading.Thread(target=self._run, name="totalreduce-torch-futures", daemon=True).start()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._idle += 1
                while not self._queue:
                    if not self._cond.wait(self._IDLE_S) and self._threads > 1 and not self._queue:
                        self._idle -= 1
                        self._threads -= 1
                        return
                self._idle -= 1
                completion = self._queue.popleft()
                self._busy += 1
            try:
                completion.settle()
            except Exception:  # torch's own failure; the future's waiters must not kill us
                log.exception("completing a torch future failed")
            finally:
                with self._cond:
                    self._busy -= 1
                    self._cond.notify_all()

    def drain(self, timeout: float) -> bool:
        """Wait until no completion is queued or being settled (True), or ``timeout``."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._pid == os.getpid() and (self._queue or self._busy):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.05))
        return True


_COMPLETER = _Completer()


def _at_exit() -> None:
    """Before the interpreter finalizes: stop the engine (its last failures complete
    futures) and let every completion finish.  A completion thread caught inside torch's
    C++ (a future's callbacks) when the interpreter finalizes is unwound by force there,
    which aborts the process ("terminate called without an active exception")."""
    from ..api import shutdown

    try:
        shutdown()
    finally:
        if not _COMPLETER.drain(10.0):
            log.warning("torch futures still completing at exit")


atexit.register(_at_exit)  # runs before totalreduce's own (registered earlier)


def torch_future(
    handles: Sequence[HandleLike], finish: Callable[[], Any]
) -> torch.futures.Future[Any]:
    """A torch future that completes when every handle has: with ``finish()``, or the error.

    ``finish`` runs once, after every handle completed (each handle's ``wait()``
    has copied its staged result back), and its return value is the future's.
    The first handle to fail, or ``finish`` raising, fails the future as C++
    sees it too (DDP's reducer, ``Work.wait()``), so ``wait()`` raises a
    ``RuntimeError`` that names the op and the ranks.

    >>> fut = torch_future([h], lambda: h.wait())   # doctest: +SKIP
    """
    c = _Completion(handles, finish)
    c.start()
    return c.future


class _Work(dist.Work):
    """A ``torch.distributed`` ``Work`` over engine handles (see :func:`torch_work`)."""

    # Python objects of Work subclasses die with their last Python reference even
    # while C++ holds the Work (pytorch/pytorch#79176); a C++ caller of wait() on
    # such an orphan would find no override and block.  Each one therefore stays
    # referenced here until its op ended and someone took its future or waited
    # (with hold_until_claimed=False: until its op ended, whoever holds it).
    _alive: set[_Work] = set()
    _alive_lock = threading.Lock()

    def __init__(
        self,
        completion: _Completion,
        timeout_s: float | None = None,
        timeout_error: Callable[[], str] | None = None,
        hold_until_claimed: bool = True,
    ) -> None:
        super().__init__()
        self._completion = completion
        self._claimed = not hold_until_claimed
        self._deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self._timeout_error = timeout_error
        with _Work._alive_lock:
            _Work._alive.add(self)
        completion.future.add_done_callback(lambda _f: self._release())

    def _release(self) -> None:
        if self._claimed and self._completion.future.done():
            with _Work._alive_lock:
                _Work._alive.discard(self)

    def _claim(self) -> None:
        self._claimed = True
        self._release()

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Block until the op completes (driving the engine); raise its error if it failed.

        ``timeout`` (torch passes ``timedelta(0)`` for none), or the work's own
        deadline (``torch_work(timeout_s=...)``, counted from submission), raises
        :class:`~totalreduce.OpTimeoutError` when it runs out; the op stays in flight.
        """
        self._claim()
        deadline = self._deadline
        if timeout is not None and timeout > timedelta(0):
            asked = time.monotonic() + timeout.total_seconds()
            deadline = asked if deadline is None else min(deadline, asked)
        c = self._completion
        try:
            for h in c.handles:
                h.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        except BaseException as exc:
            if any(h.exception() is not None for h in c.handles):
                pass  # the op failed: settled below, raising its own error
            elif isinstance(exc, OpTimeoutError) and self._timeout_error is not None:
                raise OpTimeoutError(self._timeout_error()) from exc  # the op goes on
            else:
                raise  # a timeout: the op goes on
        c.settle()  # here, at once, unless the completion thread is at it already
        try:
            c.future.wait()  # until whichever thread settles it has run finish
        except BaseException:  # torch's wrapper of c.error; raise the op's own error
            pass
        if c.error is not None:
            raise c.error
        return True

    def get_future(self) -> torch.futures.Future[Any]:
        """The future DDP and ``work.get_future()`` wait on."""
        self._claim()
        return self._completion.future

    def is_completed(self) -> bool:
        """True once the op completed or failed (and its future is set)."""
        return bool(self._completion.future.done())

    def is_success(self) -> bool:
        """True once the op completed without an error."""
        return self.is_completed() and self._completion.error is None

    def exception(self) -> BaseException | None:
        """The op's error once it failed, else None."""
        return self._completion.error

    def result(self) -> Any:
        """The future's value (after :meth:`wait`)."""
        self.wait()
        return self._completion.future.value()


def torch_work(
    handles: Sequence[HandleLike],
    finish: Callable[[], Any],
    *,
    timeout_s: float | None = None,
    timeout_error: Callable[[], str] | None = None,
    hold_until_claimed: bool = True,
) -> dist.Work:
    """A ``torch.distributed`` ``Work`` over ``handles``, for a process group to return.

    ``get_future()`` is :func:`torch_future` of the same handles and ``finish``;
    ``wait()`` drives the engine in the calling thread, completes the future
    there and raises the op's own error (a :class:`~totalreduce.TotalReduceError`,
    which is a ``RuntimeError``) naming the op and the ranks.  With
    ``timeout_s``, ``wait()`` raises :class:`~totalreduce.OpTimeoutError` once that
    many seconds have passed since this call, with the message
    ``timeout_error()`` (the engine's, naming the ranks waited for, is its cause).
    The ``Work`` stays referenced until its op ended and someone waited on it or
    took its future (pytorch/pytorch#79176); ``hold_until_claimed=False`` lets it
    go once its op ended, so a ``Work`` nobody waits on is not kept (the backend's
    collectives).
    """
    c = _Completion(handles, finish)
    work = _Work(c, timeout_s, timeout_error, hold_until_claimed)
    c.start()
    return work

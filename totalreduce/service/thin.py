"""The thin path of a daemon client: ops handed to the node's service through the arena.

In daemon mode an ``allreduce``, ``broadcast``, ``barrier``, ``reduce_scatter`` or
``allgather`` (over the world or a group) does not go through this process's engine: the client
checks and names it as in embedded mode, places its buffer in the node's arena
(:mod:`~totalreduce.transport.arena`; zero copy if the array lives there, else
one copy in and one out), writes one descriptor into its submission ring and
returns a :class:`ThinHandle`.  The node's service reduces the node's buffers in
place, runs the op among the nodes' services, writes the result back and sets
the op's completion word.  ``done()`` reads that word; ``wait()`` spins briefly,
then sleeps on this client's eventfd, which the service writes when it sees the
client's sleeping flag.  No thread of this process takes part, unless a caller
adds a done callback to an op in flight: then one thread watches the words.

:class:`ThinHandle` and :class:`ThinClient` (submitting, completing, waiting) are here;
where the client's buffers go in its part of the arena is its base
:class:`~.thin_buffers.ThinBuffers`.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..algorithms.codes import OpKind
from ..dtypes import DType, ReduceOp
from ..errors import (
    InvalidArgumentError,
    OpFailedError,
    OpMismatchError,
    OpTimeoutError,
    TotalReduceError,
    TransportError,
)
from ..transport import arena as A
from ..transport.shm import drain_eventfd, fence, signal_eventfd
from .thin_buffers import ThinBuffers

log = logging.getLogger("totalreduce.thin")

#: How long ``wait()`` checks the completion word of a small op (a result of at most
#: :data:`SMALL_BYTES`, or none) before it sleeps on the eventfd, yielding the core between
#: looks: as long as such an op takes among nodes (70-150 µs), so the service seldom has to
#: write the eventfd (about 10 µs of its time on the 2-core machine) and the client wake.
SPIN_S = 200e-6
#: A larger op takes milliseconds, next to which a wake-up is nothing: its waiter spins
#: this long, and leaves the cores to the services (on the 2-core machine a 1 ms spin
#: made 4 MiB ops between nodes slower).
LARGE_SPIN_S = 50e-6
SMALL_BYTES = 256 << 10
_KINDS = {OpKind.ALLREDUCE: "allreduce", OpKind.BROADCAST: "broadcast", OpKind.BARRIER: "barrier",
          OpKind.REDUCE_SCATTER: "reduce-scatter", OpKind.ALLGATHER: "all-gather",
          OpKind.ALLTOALL: "all-to-all", OpKind.REDUCE: "reduce", OpKind.GATHER: "gather",
          OpKind.SCATTER: "scatter", OpKind.SEND_RECV: "message",
          OpKind.NEIGHBOR_ALLREDUCE: "neighbor allreduce",
          OpKind.NEIGHBOR_ALLGATHER: "neighbor all-gather",
          OpKind.PAIRWISE_EXCHANGE: "pairwise exchange"}  # fmt: skip
_ERRORS: dict[int, type[TotalReduceError]] = {
    A.E_FAILED: OpFailedError,
    A.E_MISMATCH: OpMismatchError,
    A.E_INVALID: InvalidArgumentError,
    A.E_TRANSPORT: TransportError,
}


class ThinHandle:
    """One op handed to the node's service (the same calls as :class:`~.handle.Handle`)."""

    __slots__ = (
        "name", "generation", "kind", "_client", "_ticket", "_result", "_blocks", "_out",
        "_out_at", "_finalize", "_done", "_error", "_then", "_ended", "passive",
    )  # fmt: skip

    def __init__(
        self,
        client: ThinClient,
        name: str | int,
        generation: int,
        kind: OpKind,
        result: Any,
        ended: Callable[[], None],
    ) -> None:
        self.name = name
        self.generation = generation
        self.kind = kind
        self._client = client
        self._ticket = 0
        self._result = result
        self._blocks: tuple[int, ...] = ()  # arena blocks it holds until it ends
        self._out: np.ndarray | None = None  # where a staged result goes
        self._out_at = -1  # ... from this arena offset
        self._finalize: Callable[[], Any] | None = None
        self._done = False
        self._error: BaseException | None = None
        self._then: list[Callable[[Any], None]] | None = None
        self._ended = ended
        #: a window's standing receive, or a piece of an op that failed: it may wait for
        #: ever, so nothing blocks on it (room, shutdown)
        self.passive = False

    def hold(
        self,
        blocks: tuple[int, ...],
        out: np.ndarray | None = None,
        out_at: int = -1,
        finalize: Callable[[], Any] | None = None,
    ) -> ThinHandle:
        """The arena blocks it frees when it ends; ``out``: where the result is copied
        from ``out_at`` then; ``finalize()``: its result, made then."""
        self._blocks, self._out, self._out_at, self._finalize = blocks, out, out_at, finalize
        return self

    def done(self) -> bool:
        """True once the op completed or failed (reads its completion word; never blocks)."""
        return self._done or self._client.check(self)

    def exception(self) -> BaseException | None:
        return self._error

    def wait(self, timeout: float | None = None) -> Any:
        """Block until the op completes; return its result (raise its error)."""
        if not self._done and not self._client.check(self):
            self._client.block(self, timeout)
        if self._error is not None:
            raise self._error
        return self._result

    def add_done_callback(self, fn: Callable[[Any], None]) -> None:
        """Call ``fn(handle)`` once when the op ends (at once if it has; else on a
        watcher thread, or on the thread that finds it done)."""
        client = self._client
        if not self._done:
            client.check(self)  # ended already (nobody read its word yet): ``fn`` runs now
        with client.lock:
            if not self._done:
                if self._then is None:
                    self._then = []
                self._then.append(fn)
                client.watch()
                return
        fn(self)

    def __repr__(self) -> str:
        state = "done" if self.done() else "in flight"
        return f"<ThinHandle op={self.name!r} generation={self.generation} {state}>"


class ThinClient(ThinBuffers):
    """This process's side of the arena: its slot's ring, words and buffers (placed by its
    base :class:`~.thin_buffers.ThinBuffers`)."""

    def __init__(self, link: Any) -> None:
        w = link.welcome
        self.arena = link.arena
        self.slot = int(w.local)
        self.rank, self.size = int(w.rank), int(w.size)
        self.service_pid = int(w.pid)
        self.where = link.where
        self.efd, self.service_efd = link.eventfd, link.service_eventfd
        self.sock: socket.socket = link.sock
        self.header = self.arena.header
        self.ctl = self.arena.control(self.slot)
        self.ring = self.ctl[A.RING_WORD : A.DONE_WORD].reshape(A.RING, A.D_WORDS)
        self.words = self.ctl[A.DONE_WORD : A.DONE_WORD + A.RING]
        self.space = A.Allocator(self.arena.data_start(self.slot), self.arena.data_bytes)
        self.lock = threading.RLock()  # submission, completion, the in-flight table
        self._tail = int(self.ctl[A.C_TAIL])  # descriptors written
        self._ticket = self._tail  # the last ticket given
        self._words: set[int] = set()  # completion words of the ops in flight
        self._flight: dict[int, ThinHandle] = {}  # ticket -> handle, oldest first
        self._consts: dict[tuple[int, ...], int] = {}  # const_block's blocks
        #: the last ops completed here, by ticket: what a late error names
        self._ended_ops: dict[int, tuple[OpKind, str | int, int]] = {}
        self._late_seen = int(self.ctl[A.C_LATE])
        self._sleeper = threading.Lock()  # one thread sleeps on the eventfd at a time
        self._woken = threading.Condition()
        self._watcher: threading.Thread | None = None
        #: bumped whenever an op with callbacks is given to the watcher (:meth:`watch`):
        #: a watcher asleep on the ops it listed before wakes to list them again
        self._watched = 0
        self.gone: str | None = None  # the service died: every op fails, saying so
        self.closed = False
        #: The timeline recorder (the service's, when one records): the ops' lives, waits.
        self.trace: Any = None

    # ------------------------------------------------------------------ submitting

    def _oldest(self) -> ThinHandle | None:
        """The oldest op in flight that is sure to end (not a standing receive)."""
        with self.lock:  # the watcher takes ended ops out meanwhile
            return next((h for h in self._flight.values() if not h.passive), None)

    def submit(
        self,
        h: ThinHandle,
        *,
        wire: int,
        dtype: DType,
        count: int,
        op: ReduceOp,
        root: int,
        priority: int,
        at_in: int,
        at_out: int,
        unnamed: bool,
        group: int = -1,
        context: int = 0,
        aux: int = -1,
        kind: OpKind | None = None,
        algorithm: int = 0,
        passive: bool = False,
    ) -> ThinHandle:
        """Write the op's descriptor; the service takes it from here.  ``passive``: a
        window's standing receive (no stall warnings; nothing waits for it to make room)."""
        if self.gone is not None:
            self._release(h)
            raise self._gone_error(h)
        while len(self._flight) >= A.RING - 1:  # completion words all in use: the oldest first
            oldest = self._oldest()
            if oldest is None and not any([self.check(x) for x in list(self._flight.values())]):
                self._release(h)
                raise InvalidArgumentError(
                    f"rank {self.rank}: {len(self._flight)} standing receives of windows are "
                    "in flight, as many as this client may have ops; free some windows"
                )
            if oldest is not None:
                self.block(oldest, None)
        with self.lock:
            pos = self._tail + 1
            d = self.ring[(pos - 1) % A.RING]
            t = self.new_ticket()
            d[A.D_KIND], d[A.D_GEN] = int(h.kind if kind is None else kind), h.generation
            d[A.D_WIRE] = A.signed(wire)
            d[A.D_DTYPE], d[A.D_COUNT], d[A.D_OP], d[A.D_ROOT] = int(dtype), count, int(op), root
            d[A.D_PRIO], d[A.D_IN], d[A.D_OUT] = priority, at_in, at_out
            d[A.D_FLAGS] = (
                (A.F_AVG if op is ReduceOp.AVG else 0)
                | (A.F_UNNAMED if unnamed else 0)
                | (A.F_PASSIVE if passive else 0)
            )
            d[A.D_GROUP], d[A.D_CTX], d[A.D_AUX] = group, A.signed(context), aux
            d[A.D_ALGO] = algorithm
            d[A.D_TICKET] = t
            h._ticket = t
            h.passive = passive
            self._flight[t] = h
            self.ctl[A.C_TAIL] = self._tail = pos
            if h._then:  # callbacks came before it was in flight (chain()'s final op)
                self.watch()
        return self._posted(h, priority)

    def submit_again(self, h: ThinHandle, row: np.ndarray, priority: int, at: int) -> ThinHandle:
        """Write the descriptor of a repeat: ``row``, an earlier descriptor of the same op
        (the express path's record), with ``h``'s generation, ``priority`` and its buffer
        at arena offset ``at`` (input and output: in place).  The caller checked that the
        service is there, a completion word is free and no late error waits."""
        with self.lock:
            pos = self._tail + 1
            d = self.ring[(pos - 1) % A.RING]
            t = self.new_ticket()
            d[:] = row
            d[A.D_GEN], d[A.D_PRIO], d[A.D_IN], d[A.D_OUT] = h.generation, priority, at, at
            d[A.D_TICKET] = h._ticket = t
            self._flight[t] = h
            self.ctl[A.C_TAIL] = self._tail = pos
            if h._then:
                self.watch()
        return self._posted(h, priority)

    def _posted(self, h: ThinHandle, priority: int) -> ThinHandle:
        """The descriptor of ``h`` is in the ring: the timeline, and the service woken if
        it sleeps."""
        trace = self.trace
        if trace is not None:
            trace.op(h.name, h.generation, "submitted", priority)
        fence()
        if self.header[A.H_SERVICE_SLEEPING]:
            signal_eventfd(self.service_efd)
        return h

    def last_row(self) -> np.ndarray:
        """A copy of the last descriptor written (an express record keeps it)."""
        return self.ring[(self._tail - 1) % A.RING].copy()

    def busy(self) -> bool:
        """Whether a submission must take the whole way: the service is gone, every
        completion word is in use, or a late error waits to be raised."""
        return (
            self.gone is not None
            or len(self._flight) >= A.RING - 1
            or int(self.ctl[A.C_LATE]) != self._late_seen
        )

    def new_ticket(self) -> int:
        """The next op's ticket (``lock`` held).  A ticket names the op's completion word
        (``(ticket - 1) % RING``); a standing receive keeps its word while later ops come
        and go, so a ticket whose word an op in flight holds is skipped."""
        t = self._ticket + 1
        while (t - 1) % A.RING in self._words:
            t += 1
        self._ticket = t
        self._words.add((t - 1) % A.RING)
        return t

    # ------------------------------------------------------------------ completing

    def check(self, h: ThinHandle) -> bool:
        """Finish ``h`` if its completion word says it ended; whether it has."""
        t = h._ticket
        if t == 0:
            return h._done
        w = int(self.words[(t - 1) % A.RING])
        if w == t:
            self._complete(h, None)
        elif w == -t:
            kind, text = A.read_error(self.ctl, t) or (A.E_FAILED, "the service failed it")
            verb = _KINDS.get(h.kind, "op")
            err = _ERRORS.get(kind, OpFailedError)(
                f"rank {self.rank}: {verb} {h.name!r} generation {h.generation}: {text}"
            )
            self._complete(h, err)
        elif self.gone is not None:
            self._complete(h, self._gone_error(h))
        return h._done

    def raise_late(self) -> None:
        """Raise the next late error the service posted, if any: an op that completed here
        failed elsewhere (ranks that disagreed on its group), so its result may be wrong."""
        posted = int(self.ctl[A.C_LATE])
        if posted == self._late_seen:
            return
        self._late_seen += 1
        kind, text = A.read_error(self.ctl, -self._late_seen) or (A.E_FAILED, "\x1e")
        ticket, _, why = text.partition("\x1e")
        what = self._ended_ops.get(int(ticket) if ticket.isdigit() else 0)
        op = (
            "an op"
            if what is None
            else f"{_KINDS.get(what[0], 'op')} {what[1]!r} generation {what[2]}"
        )
        raise _ERRORS.get(kind, OpFailedError)(
            f"rank {self.rank}: {op} completed here, but failed elsewhere: {why}"
        )

    def _gone_error(self, h: ThinHandle) -> TransportError:
        return TransportError(
            f"rank {self.rank}: {_KINDS.get(h.kind, 'op')} {h.name!r} generation "
            f"{h.generation}: {self.gone}"
        )

    def _complete(self, h: ThinHandle, error: BaseException | None) -> None:
        with self.lock:
            if h._done:
                return
            if error is None and h._out_at >= 0 and h._out is not None and h._out.nbytes:
                h._out.reshape(-1).view(np.uint8)[:] = self.arena.view(
                    h._out_at, h._out.nbytes, np.uint8
                )
            if self._flight.pop(h._ticket, None) is not None:
                self._words.discard((h._ticket - 1) % A.RING)
            if error is None and h._ticket:
                ended = self._ended_ops
                ended[h._ticket] = (h.kind, h.name, h.generation)
                if len(ended) > A.RING:
                    del ended[next(iter(ended))]
            self._release(h)
            if error is None and h._finalize is not None:
                try:
                    h._result = h._finalize()
                except Exception as exc:
                    error = exc
            h._error = error
            h._done = True
            callbacks, h._then = h._then, None
            trace = self.trace
            if trace is not None:
                trace.op(h.name, h.generation, "failed" if error else "done", 0)
        if callbacks:
            for fn in callbacks:
                try:
                    fn(h)
                except Exception:
                    log.exception("rank %d: a done callback of %r raised", self.rank, h.name)

    def _release(self, h: ThinHandle) -> None:
        for at in h._blocks:
            self.space.free(at)
        h._blocks = ()
        h._ended()

    def settle(self, h: ThinHandle, result: Any, error: BaseException | None) -> None:
        """End ``h``, an op this client did not submit (it ran elsewhere, or in pieces),
        with ``result``; a thread asleep in this client wakes to see it."""
        if error is None:
            h._result = result
        self._complete(h, error)
        if self.ctl[A.C_SLEEPING] and not self.closed:
            signal_eventfd(self.efd)

    def chain(self, first: ThinHandle, final: ThinHandle, then: Callable[[], None]) -> ThinHandle:
        """``final``, which ``then()`` submits once ``first`` has ended well (on the thread
        that sees it end); if ``first`` fails, or ``then`` raises, ``final`` fails so."""

        def go(h: ThinHandle) -> None:
            err = h.exception()
            if err is None:
                try:
                    then()
                    return
                except Exception as exc:
                    err = exc
            self.settle(final, None, err)

        first.add_done_callback(go)
        return final

    def block(self, h: ThinHandle, timeout: float | None) -> None:
        """Until ``h`` is done: spin for :data:`SPIN_S` (:data:`LARGE_SPIN_S` for a large op),
        then sleep on the eventfd."""
        t0_ns = time.perf_counter_ns()
        try:
            self._block(h, timeout)
        finally:
            trace = self.trace
            if trace is not None:
                trace.wait(h.name, h.generation, t0_ns, time.perf_counter_ns())

    def _block(self, h: ThinHandle, timeout: float | None) -> None:
        t0 = time.perf_counter()
        r = h._result
        spin = LARGE_SPIN_S if r.__class__ is np.ndarray and r.nbytes > SMALL_BYTES else SPIN_S
        while time.perf_counter() - t0 < spin:
            if self.check(h):
                return
            os.sched_yield()
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.check(h):
            left = 0.5 if deadline is None else min(0.5, deadline - time.monotonic())
            if left <= 0:
                raise OpTimeoutError(
                    f"rank {self.rank}: {_KINDS.get(h.kind, 'op')} {h.name!r} generation "
                    f"{h.generation} did not complete within {timeout} s (the node's service "
                    f"pid {self.service_pid} has it)"
                )
            self._sleep(lambda: self.check(h), left)

    def _sleep(self, ready: Callable[[], bool], timeout: float) -> None:
        if self._sleeper.acquire(blocking=False):
            try:
                self.ctl[A.C_SLEEPING] = 1
                fence()
                if not ready():
                    try:
                        r, _, _ = select.select((self.efd, self.sock), (), (), timeout)
                    except InterruptedError:
                        r = []
                    if self.sock in r:
                        self._check_service()
                self.ctl[A.C_SLEEPING] = 0
                drain_eventfd(self.efd)
            finally:
                self._sleeper.release()
            with self._woken:
                self._woken.notify_all()
        else:
            with self._woken:
                self._woken.wait(min(timeout, 0.002))

    def _check_service(self) -> None:
        """The socket is readable: the service closed it (it is gone), or said something."""
        try:
            data = self.sock.recv(65536, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data:
            return  # nothing but hello traffic travels there; ignore it
        self.gone = (
            f"the node's service (pid {self.service_pid}, {self.where}) is gone; the ops it "
            "had fail"
        )
        for h in list(self._flight.values()):
            self._complete(h, self._gone_error(h))

    def watch(self) -> None:
        """Start the watcher thread (callbacks of ops in flight run on it), if not running
        (``lock`` held: the watcher decides to leave under it, see :meth:`_watch`); if it
        runs, have it look at the ops again (it sleeps on those it listed, and the new
        one may end without a signal: it could end before anyone here slept)."""
        self._watched += 1
        if self._watcher is None or not self._watcher.is_alive():
            self._watcher = threading.Thread(
                target=self._watch, name=f"totalreduce-thin-{self.rank}", daemon=True
            )
            self._watcher.start()
        elif self.ctl[A.C_SLEEPING] and not self.closed:
            signal_eventfd(self.efd)

    def _watch(self) -> None:
        me = threading.current_thread()
        while not self.closed:
            with self.lock:
                waiting = [h for h in self._flight.values() if h._then]
                listed = self._watched
                if not waiting:
                    # It leaves: said under the lock, where add_done_callback adds a
                    # callback and calls watch().  A thread that found nothing to watch
                    # is still alive until it has returned; were it left as the watcher,
                    # a callback added meanwhile would have no thread to run it.
                    if self._watcher is me:
                        self._watcher = None
                    return
            if any([self.check(h) for h in waiting]):
                continue

            def ready(w: list[ThinHandle] = waiting, n: int = listed) -> bool:
                return self._watched != n or any(self.check(h) for h in w)

            self._sleep(ready, 0.5)

    def in_flight(self) -> list[ThinHandle]:
        with self.lock:
            return list(self._flight.values())

    def close(self) -> None:
        """No more ops (shutdown): let go of the eventfds and the arena's mapping."""
        if self.closed:
            return
        self.closed = True
        for fd in (self.efd, self.service_efd):
            try:
                os.close(fd)
            except OSError:
                pass
        self.arena.close()

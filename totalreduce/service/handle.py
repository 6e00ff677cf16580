"""Handles: what an ``*_async`` call returns, to poll or wait on one op.

:class:`HandleLike` is what every handle offers (the embedded :class:`Handle`,
``totalreduce.torch.TensorHandle``); :class:`ServiceLike` is what
``totalreduce.default_service()`` returns: the calls the module-level API and
``totalreduce.torch`` make on a service.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from ..engine.completion import Completion
from ..lane.payload import describe_op

if TYPE_CHECKING:
    import numpy as np

    from ..dtypes import ReduceOp
    from ..engine.loop import CommLoop
    from ..group import Group, Partition
    from ..lane.payload import OpSpec
    from .names import NameTable


# Orders the taking of a handle's callbacks (only when it has some: see Handle._finish).
_CALLBACKS = threading.Lock()


@runtime_checkable
class HandleLike(Protocol):
    """One submitted op: poll it with ``done()``, block on it with ``wait()``."""

    @property
    def name(self) -> str | int:
        """The op's name."""
        ...

    @property
    def generation(self) -> int:
        """How many earlier ops of this name this rank submitted."""
        ...

    def done(self) -> bool:
        """True once the op completed or failed; never blocks."""
        ...

    def wait(self, timeout: float | None = None) -> Any:
        """Block until the op completes (or ``timeout`` seconds pass); return its result."""
        ...

    def exception(self) -> BaseException | None:
        """The op's error once done, else None."""
        ...

    def add_done_callback(self, fn: Callable[[Any], None]) -> None:
        """Call ``fn(handle)`` once when the op ends."""
        ...


@runtime_checkable
class ServiceLike(Protocol):
    """What ``totalreduce.default_service()`` returns: the calls of the API and of the torch layer.

    The embedded :class:`~totalreduce.Service` implements all of it.
    """

    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    @property
    def closed(self) -> bool: ...

    def allreduce_async(
        self,
        x: Any,
        name: str | int | None = None,
        op: str | ReduceOp = "sum",
        out: Any = None,
        priority: int = 0,
        algorithm: str | None = None,
        group: Group | None = None,
        dtype: str | None = None,
    ) -> HandleLike: ...

    def allreduce(
        self,
        x: Any,
        name: str | int | None = None,
        op: str | ReduceOp = "sum",
        out: Any = None,
        priority: int = 0,
        algorithm: str | None = None,
        group: Group | None = None,
        dtype: str | None = None,
    ) -> np.ndarray: ...

    def broadcast_async(
        self,
        x: Any,
        root: int = 0,
        name: str | int | None = None,
        out: Any = None,
        priority: int = 0,
        algorithm: str = "auto",
        group: Group | None = None,
        dtype: str | None = None,
    ) -> HandleLike: ...

    def broadcast(
        self,
        x: Any,
        root: int = 0,
        name: str | int | None = None,
        out: Any = None,
        priority: int = 0,
        algorithm: str = "auto",
        group: Group | None = None,
        dtype: str | None = None,
    ) -> np.ndarray: ...

    def barrier_async(
        self,
        name: str | int | None = None,
        priority: int = 0,
        algorithm: str = "auto",
        group: Group | None = None,
    ) -> HandleLike: ...

    def barrier(
        self,
        name: str | int | None = None,
        algorithm: str = "auto",
        group: Group | None = None,
    ) -> None: ...

    def pairwise_exchange_async(
        self,
        x: Any,
        steps: int,
        name: str | int | None = None,
        group: Group | None = None,
        priority: int = 0,
    ) -> HandleLike: ...

    def reduce_scatter_async(
        self,
        x: Any,
        name: str | int | None = None,
        op: str | ReduceOp = "sum",
        partition: Partition | None = None,
        axes: Any = None,
        group: Group | None = None,
        dtype: str | None = None,
        priority: int = 0,
    ) -> HandleLike: ...

    def reduce_scatter(
        self, x: Any, name: str | int | None = None, op: str = "sum", **kw: Any
    ) -> Any: ...

    def allgather_async(
        self,
        x: Any,
        name: str | int | None = None,
        partition: Partition | None = None,
        axes: Any = None,
        group: Group | None = None,
        dtype: str | None = None,
        priority: int = 0,
        counts: Sequence[int] | None = None,
    ) -> HandleLike: ...

    def allgather(self, x: Any, name: str | int | None = None, **kw: Any) -> Any: ...

    def neighbor_allreduce_async(
        self,
        x: Any,
        name: str | int | None = None,
        topology: Any = None,
        step: int | None = None,
        self_weight: float | None = None,
        src_weights: Any = None,
        dst_weights: Any = None,
        out: Any = None,
        dtype: str | None = None,
        priority: int = 0,
    ) -> HandleLike: ...

    def neighbor_allreduce(
        self, x: Any, name: str | int | None = None, **kw: Any
    ) -> np.ndarray: ...

    def neighbor_allgather_async(
        self,
        x: Any,
        name: str | int | None = None,
        topology: Any = None,
        step: int | None = None,
        src_ranks: Any = None,
        dst_ranks: Any = None,
        dtype: str | None = None,
        priority: int = 0,
    ) -> HandleLike: ...

    def neighbor_allgather(
        self, x: Any, name: str | int | None = None, **kw: Any
    ) -> np.ndarray: ...

    def hierarchical_neighbor_allreduce_async(
        self,
        x: Any,
        name: str | int | None = None,
        topology: Any = None,
        local_size: int = 1,
        step: int | None = None,
        out: Any = None,
        dtype: str | None = None,
        priority: int = 0,
        self_weight: float | None = None,
        src_machine_weights: Any = None,
        dst_machine_weights: Any = None,
    ) -> HandleLike: ...

    def hierarchical_neighbor_allreduce(
        self, x: Any, name: str | int | None = None, **kw: Any
    ) -> np.ndarray: ...

    def reduce_async(
        self, x: Any, root: int = 0, name: str | int | None = None, **kw: Any
    ) -> HandleLike: ...

    def reduce(self, x: Any, root: int = 0, name: str | int | None = None, **kw: Any) -> Any: ...

    def gather_async(
        self, x: Any, root: int = 0, name: str | int | None = None, **kw: Any
    ) -> HandleLike: ...

    def gather(self, x: Any, root: int = 0, name: str | int | None = None, **kw: Any) -> Any: ...

    def scatter_async(
        self, x: Any, root: int = 0, name: str | int | None = None, **kw: Any
    ) -> HandleLike: ...

    def scatter(self, x: Any, root: int = 0, name: str | int | None = None, **kw: Any) -> Any: ...

    def alltoall_async(self, x: Any, name: str | int | None = None, **kw: Any) -> HandleLike: ...

    def alltoall(self, x: Any, name: str | int | None = None, **kw: Any) -> np.ndarray: ...

    def send_async(self, x: Any, dst: int, tag: int = 0, **kw: Any) -> HandleLike: ...

    def send(self, x: Any, dst: int, tag: int = 0, **kw: Any) -> None: ...

    def recv_async(self, x: Any, src: int, tag: int = 0, **kw: Any) -> HandleLike: ...

    def recv(self, x: Any, src: int, tag: int = 0, **kw: Any) -> np.ndarray: ...

    def node_layout(self) -> tuple[int, int, int, int]:
        """(local_rank, local_size, cross_rank, cross_size) of this rank."""
        ...

    def shutdown(self, timeout: float | None = None) -> None: ...


class Handle:
    """One submitted op on this rank.

    ``done()`` never blocks; ``wait(timeout=None)`` blocks until the op
    completes and returns its result (raising the op's error if it failed, or
    :class:`~totalreduce.OpTimeoutError` if ``timeout`` seconds pass first; the
    op stays in flight and can be waited on again).  The waiting thread drives
    the engine's loop itself, as ``MPI_Wait`` progresses MPI, so the op crosses
    no thread hand-off; waiting also marks the op urgent: among ops of equal
    priority its segments go first, here and (after a moment) on the peers.

    >>> h = tr.allreduce_async(grad, name="fc1.grad", op="avg")   # doctest: +SKIP
    >>> ...                                                        # doctest: +SKIP
    >>> grad_avg = h.wait()                                        # doctest: +SKIP
    """

    __slots__ = (
        "name",
        "generation",
        "_event",
        "_error",
        "_result",
        "_finalize",
        "_spec",
        "_loop",
        "_then",
        "_lop",
        "_names",
    )

    def __init__(
        self,
        name: str | int,
        generation: int,
        result: Any,
        loop: CommLoop | None = None,
        finalize: Callable[[], Any] | None = None,
    ) -> None:
        self.name = name
        self.generation = generation
        self._event = Completion()
        self._error: BaseException | None = None
        self._result = result
        # Shapes the raw output into the caller's result on first use (e.g.
        # moves a split dimension back into place): done by the waiter, not
        # the comm thread.
        self._finalize = finalize
        self._spec: OpSpec | None = None
        self._loop = loop
        self._then: list[Callable[[Handle], None]] | None = None
        #: Its op in the compiled lane, when it entered there from the submitting
        #: thread (the express path): ``wait()`` tries it first, without the way there.
        self._lop: Any = None
        #: The name table its op's name was taken from (``_ended`` gives it back).
        self._names: NameTable | None = None

    def _ended(self, error: BaseException | None) -> None:
        """The op's ``on_done``: its name's generation is no longer in flight, then
        :meth:`_finish`.  A bound method, not a closure per op: one object for the
        garbage collector to track, where a closure and its cells are five."""
        names = self._names
        if names is not None:
            names.ended(self.name)
        self._finish(error)

    def _attach(self, spec: OpSpec) -> None:
        self._spec = spec

    def _spec_now(self) -> OpSpec | None:
        """The op this handle stands for now (a later phase's, once it is submitted)."""
        return self._spec

    def _finish(self, error: BaseException | None) -> None:
        """Called once by the comm thread when the op ends."""
        self._error = error
        self._spec = None
        self._lop = None
        self._event.set()
        # Set first, then look: add_done_callback looks at the word again after adding,
        # so a callback is taken (under the lock) by this thread or by that one, once.
        if self._then is not None:
            with _CALLBACKS:
                callbacks, self._then = self._then, None
            if callbacks:
                for fn in callbacks:
                    fn(self)

    def add_done_callback(self, fn: Callable[[Handle], None]) -> None:
        """Call ``fn(handle)`` once when the op ends (at once if it has).

        It runs on whichever thread completes the op: the comm thread, or a thread
        driving the engine in ``wait()`` or ``done()`` (or here, if the op is done
        already).  Keep it short, take no lock that such a thread may hold, and never
        wait on another op inside it (that raises).
        """
        with _CALLBACKS:
            if self._event.is_set():
                callbacks = [fn]
            else:
                if self._then is None:
                    self._then = []
                self._then.append(fn)
                if not self._event.is_set():
                    return  # _finish takes it
                # It ended meanwhile, and _finish may have looked before the list was there.
                callbacks, self._then = self._then, None
        for cb in callbacks or ():
            cb(self)

    def done(self) -> bool:
        """True once the op completed or failed; progresses the engine once, as ``MPI_Test``."""
        if not self._event.is_set() and self._loop is not None:
            self._loop.driving.poll()
        return self._event.is_set()

    def exception(self) -> BaseException | None:
        """The op's error once done, else None."""
        return self._error

    def drive(self, span: float, outer: bool = False) -> bool:
        """Progress the engine for up to ``span`` seconds as ``wait()`` does, without
        raising when the time is up; True once the op has ended.  A node's service drives
        its ops among the services so, between looks at its clients' rings; with
        ``outer``, a lane op's drive ends early once the lane's outer words move (a
        client submitted: ``Lane.watch_outer``)."""
        if self._event.is_set():
            return True
        loop = self._loop
        if loop is None:
            return False
        return loop.driving.progress(self._event, span, self._spec, self._spec_now, outer=outer)

    def wait(self, timeout: float | None = None) -> Any:
        """Block until the op completes; return its result."""
        if not self._event.is_set():
            spec = self._spec
            loop = self._loop
            if loop is None:
                if not self._event.wait(timeout):
                    raise TimeoutError(f"op {self.name!r} did not complete within {timeout} s")
            else:
                trace = loop.trace  # read once: stop_timeline may clear it meanwhile
                t0 = 0 if trace is None else time.perf_counter_ns()
                lop = self._lop
                tried = lop is not None and timeout is None
                driving = loop.driving
                finished = (tried and driving.try_op(lop, self._event, 2e-4)) or driving.progress(
                    self._event, timeout, spec, self._spec_now, tried
                )
                if trace is not None:
                    trace.wait(self.name, self.generation, t0, time.perf_counter_ns())
                if not finished:
                    stalls = loop.stalls
                    raise stalls.timeout_error(spec, self.name, self.generation, timeout or 0.0)
        if self._error is not None:
            raise self._error
        if self._finalize is not None:
            self._result = self._finalize()
            self._finalize = None
        return self._result

    def __repr__(self) -> str:
        state = "done" if self.done() else "in flight"
        return f"<Handle op={self.name!r} generation={self.generation} {state}>"


class ExpressOp(Handle):
    """An async repeat's handle (``service/express.py``), which is also its op's spec and
    its lane op: one object per repeat where the whole way makes a handle, an ``OpSpec``
    and a ``LaneOp``.  What differs between repeats (generation, priority, buffers,
    urgency, a group's context, the lane's slot and fields: ``lane.lane_op``) is in its
    slots; the rest of what the engine reads of a spec comes from its express record.
    ``spec`` is the op itself; ``_spec`` and ``_lop`` (a handle's links to its spec and
    its lane op) are too while it is in flight, without a reference to itself (no cycle
    for the garbage collector)."""

    __slots__ = (
        "_ex", "priority", "inbuf", "outbuf", "context", "urgent",
        "slot", "seq", "keep", "pooled", "t0", "probed", "warned", "have", "error",
        "_flag", "_ev",
    )  # fmt: skip

    #: An express repeat is never chained after another op, nor a standing receive.
    after = None
    passive = False

    def __init__(
        self, ex: Any, name: str | int, generation: int, result: Any, loop: CommLoop,
        names: NameTable, priority: int, inbuf: np.ndarray, outbuf: np.ndarray,
        urgent: bool, context: int = 0,
    ) -> None:  # fmt: skip
        # (Handle's fields, without its completion word: the op is its own)
        self.name = name
        self.generation = generation
        self._flag = False
        self._ev: threading.Event | None = None
        self._error: BaseException | None = None
        self._result = result
        self._finalize = None
        self._loop = loop
        self._then = None
        self._names = names
        self._ex = ex
        self.priority = priority
        self.inbuf = inbuf
        self.outbuf = outbuf
        self.urgent = urgent
        self.context = context
        self.slot = -1  # not in the lane (yet)
        self.seq = 0

    # -- the handle's links to its spec and lane op: itself, while in flight
    def _in_flight(self) -> Any:
        return None if self._flag else self

    def _ignore(self, value: Any) -> None:
        pass

    _spec = property(_in_flight, _ignore)  # type: ignore[assignment]
    _lop = property(_in_flight, _ignore)  # type: ignore[assignment]

    # -- its completion word: the op is its own (``Completion``'s words and methods)
    def _itself(self) -> Any:
        return self

    _event = property(_itself, _ignore)  # type: ignore[assignment]
    is_set = Completion.is_set
    set = Completion.set
    #: What a driver sleeps on (``Driver.sleep``): ``Completion.wait``, not the handle's.
    sleep = Completion.wait

    # -- what the engine reads of an OpSpec
    @property
    def spec(self) -> ExpressOp:
        return self

    @property
    def key(self) -> tuple[int, int]:
        return (self._ex.wid, self.generation)

    @property
    def wire_id(self) -> int:
        return self._ex.wid  # type: ignore[no-any-return]

    @property
    def kind(self) -> Any:
        return self._ex.kind

    @property
    def algorithm(self) -> Any:
        return self._ex.code

    @property
    def dtype(self) -> Any:
        return self._ex.dt

    @property
    def count(self) -> int:
        return self._ex.count  # type: ignore[no-any-return]

    @property
    def op(self) -> Any:
        return self._ex.rop

    @property
    def schedule(self) -> Any:
        return self._ex.sched

    @property
    def plan(self) -> Any:
        return self._ex.plan

    @property
    def group(self) -> tuple[int, ...]:
        return self._ex.group  # type: ignore[no-any-return]

    @property
    def param(self) -> int:
        return self._ex.param  # type: ignore[no-any-return]

    @property
    def in_place(self) -> bool:
        return self._ex.in_place  # type: ignore[no-any-return]

    def describe(self) -> str:
        return describe_op(self.name, self.generation)

    #: The op's completion callback (``OpSpec.on_done``): its name's generation given
    #: back, then the handle finished.
    on_done = Handle._ended

    def __repr__(self) -> str:
        return Handle.__repr__(self)


def done_handle(name: str | int | None, result: Any) -> Handle:
    """A handle that is complete already (ranks outside a partition)."""
    h = Handle("" if name is None else name, -1, result)
    h._finish(None)
    return h

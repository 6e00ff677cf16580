"""The service: the comm thread and the reduce thread of one rank, and the client calls.

A :class:`Service` owns a transport, a :class:`~totalreduce.engine.loop.CommLoop`
run by its communication thread, and a reducer run by its reduce thread.  The
client methods check arguments in the caller's thread (so invalid calls raise
before anything is sent), give each op its name and generation, compile its
schedule and queue it; the comm thread does the rest.

Name and generation: the k-th submission of name N on a rank matches the k-th
submission of N on every other rank.  An unnamed op is named from the count of
unnamed calls on this rank, so unnamed calls match by call order, as in MPI.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..dtypes import DType, ReduceOp
from ..engine.loop import CommLoop, LoopConfig
from ..engine.payload import OpSpec
from ..engine.wire import OpKind, wire_id
from ..errors import InvalidArgumentError, NotInitializedError, TotalReduceError
from ..transport.base import Transport
from .config import Config
from .handle import Handle
from .ops import choose_allreduce, compile_op

log = logging.getLogger("totalreduce.service")


@dataclass
class _NameState:
    next_generation: int = 0
    in_flight: int = 0
    signature: tuple[Any, ...] = ()


def as_array(x: Any, what: str) -> np.ndarray:
    """A numpy view of ``x`` (array or buffer) after the checks every op needs."""
    arr = (
        x
        if isinstance(x, np.ndarray)
        else np.asarray(memoryview(x) if not hasattr(x, "__array__") else x)
    )
    if not arr.flags.c_contiguous:
        raise InvalidArgumentError(
            f"{what} is not C-contiguous (shape {arr.shape}, strides {arr.strides}); "
            "pass np.ascontiguousarray(...)"
        )
    try:
        DType.of(arr.dtype)
    except ValueError as exc:
        raise InvalidArgumentError(f"{what}: {exc}") from None
    return arr


class Service:
    """One rank's totalreduce engine and its client API (see the module docstring)."""

    def __init__(self, transport: Transport, config: Config | None = None) -> None:
        from .reducer import Reducer, execute  # the Numba kernels: only when a service starts

        self.config = config or Config.load()
        self.transport = transport
        self.rank = transport.rank
        self.size = transport.size
        cfg = self.config
        self.loop = CommLoop(
            transport,
            LoopConfig(
                micro_bytes=cfg.micro_bytes,
                max_inflight_sends=cfg.max_inflight_sends,
                floating_pool_bytes=cfg.floating_pool_bytes,
                stall_warning_s=cfg.stall_warning_s,
                backoff_max_s=cfg.backoff_max_s,
                idle_backoff_max_s=cfg.idle_backoff_max_s,
                inline_compute_bytes=cfg.inline_compute_bytes,
            ),
            execute=execute,
        )
        self.reducer = Reducer(self.loop.compute, self.loop.notify)
        self._lock = threading.Lock()
        self._names: dict[str | int, _NameState] = {}
        self._unnamed = 0
        self._closed = False
        self._stop = threading.Event()
        self._world = tuple(range(self.size))
        self._comm_thread = threading.Thread(
            target=self._run_loop, name=f"totalreduce-comm-{self.rank}", daemon=True
        )
        self._reduce_thread = threading.Thread(
            target=self.reducer.run, name=f"totalreduce-reduce-{self.rank}", daemon=True
        )
        self._reduce_thread.start()
        self._comm_thread.start()

    def _run_loop(self) -> None:
        try:
            self.loop.run(self._stop)
        except BaseException:  # already logged and handed to every op by the loop
            pass

    # ------------------------------------------------------------------ submission

    def _check_open(self) -> None:
        if self._closed:
            raise NotInitializedError("totalreduce was shut down; call init() again to use it")
        if self.loop.fatal is not None:
            raise TotalReduceError(f"the comm thread stopped: {self.loop.fatal}")

    def _name(self, name: str | int | None, signature: tuple[Any, ...]) -> tuple[str | int, int]:
        """Name and generation of a new op; checks a reused name keeps its shape."""
        with self._lock:
            if name is None:
                name = f"__unnamed__.{self._unnamed}"
                self._unnamed += 1
            elif isinstance(name, bool) or not isinstance(name, (str, int)):
                raise InvalidArgumentError(f"op names are str or int, got {name!r}")
            st = self._names.get(name)
            if st is None:
                st = self._names[name] = _NameState()
            if st.in_flight and st.signature != signature:
                raise InvalidArgumentError(
                    f"op {name!r}: generation {st.next_generation - 1} is still in flight as "
                    f"{_sig_text(st.signature)}; this call is {_sig_text(signature)}"
                )
            st.signature = signature
            st.in_flight += 1
            gen = st.next_generation
            st.next_generation += 1
            return name, gen

    def _ended(self, name: str | int) -> None:
        with self._lock:
            st = self._names.get(name)
            if st is not None:
                st.in_flight -= 1
                if (
                    name.__class__ is str
                    and str(name).startswith("__unnamed__.")
                    and not st.in_flight
                ):
                    del self._names[name]

    def _output(self, x: np.ndarray, out: Any, what: str = "out") -> tuple[np.ndarray, bool]:
        if out is None:
            return np.empty_like(x), False
        o = as_array(out, what)
        if o.dtype != x.dtype or o.size != x.size:
            raise InvalidArgumentError(
                f"{what} has dtype {o.dtype} and {o.size} elements; expected {x.dtype} and {x.size}"
            )
        if not o.flags.writeable:
            raise InvalidArgumentError(f"{what} is read-only")
        same = o.ctypes.data == x.ctypes.data
        if not same and np.shares_memory(o, x):
            raise InvalidArgumentError(f"{what} overlaps the input without being the same array")
        return o, same

    def _submit(
        self,
        kind: OpKind,
        x: np.ndarray,
        out: np.ndarray,
        in_place: bool,
        name: str | int | None,
        op: ReduceOp,
        priority: int,
        algorithm: str,
        param: int = 0,
        options: tuple[tuple[str, Any], ...] = (),
        result: Any = None,
    ) -> Handle:
        self._check_open()
        if isinstance(priority, bool) or not isinstance(priority, (int, np.integer)):
            raise InvalidArgumentError(f"priority must be an int, got {priority!r}")
        dtype = DType.of(x.dtype)
        count = int(x.size)
        seg = max(1, self.config.segment_bytes // dtype.itemsize)
        code, sched, plan = compile_op(
            kind, algorithm, self.rank, self.size, count, op is ReduceOp.AVG, seg, options
        )
        signature = (kind.name.lower(), dtype.name.lower(), count, op.name.lower(), param)
        op_name, gen = self._name(name, signature)
        handle = Handle(op_name, gen, out.reshape(x.shape) if result is None else result)

        def done(error: BaseException | None) -> None:
            self._ended(op_name)
            handle._finish(error)

        spec = OpSpec(
            name=op_name,
            wire_id=wire_id(op_name),
            generation=gen,
            kind=kind,
            algorithm=code,
            dtype=dtype,
            count=count,
            op=op,
            priority=int(priority),
            inbuf=x.reshape(-1),
            outbuf=out.reshape(-1),
            schedule=sched,
            plan=plan,
            group=self._world,
            param=param,
            in_place=in_place,
            on_done=done,
        )
        handle._attach(spec)
        handle._wake = self.loop.notify
        self.loop.submit(spec)
        return handle

    # ------------------------------------------------------------------ client API

    def allreduce_async(
        self,
        x: Any,
        name: str | int | None = None,
        op: str | ReduceOp = "sum",
        out: Any = None,
        priority: int = 0,
        algorithm: str | None = None,
    ) -> Handle:
        """Start reducing ``x`` across all ranks; ``wait()`` returns the result.

        ``out`` receives the result (a new array by default; ``out=x`` reduces in
        place).  ``op`` is ``sum``, ``avg``, ``max`` or ``min``.  Higher
        ``priority`` goes first.
        """
        arr = as_array(x, "x")
        rop = _reduce_op(op)
        o, in_place = self._output(arr, out)
        algo = choose_allreduce(algorithm or self.config.algorithm, self.size, arr.nbytes)
        return self._submit(OpKind.ALLREDUCE, arr, o, in_place, name, rop, priority, algo)

    def allreduce(
        self,
        x: Any,
        name: str | int | None = None,
        op: str | ReduceOp = "sum",
        out: Any = None,
        priority: int = 0,
        algorithm: str | None = None,
    ) -> np.ndarray:
        """Blocking :meth:`allreduce_async`: returns the reduced array."""
        return self.allreduce_async(x, name, op, out, priority, algorithm).wait()

    def broadcast_async(
        self,
        x: Any,
        root: int = 0,
        name: str | int | None = None,
        out: Any = None,
        priority: int = 0,
        algorithm: str = "one_to_all",
    ) -> Handle:
        """Start copying ``x`` of rank ``root`` to every rank; ``wait()`` returns it.

        Every rank passes an array of the same shape and dtype; ``out=x``
        overwrites ``x`` in place on the receivers, as ``MPI_Bcast`` does.
        ``algorithm`` is ``one_to_all`` or ``pipelined`` (large buffers).
        """
        arr = as_array(x, "x")
        if isinstance(root, bool) or not isinstance(root, (int, np.integer)):
            raise InvalidArgumentError(f"broadcast root must be an int, got {root!r}")
        if not 0 <= root < self.size:
            raise InvalidArgumentError(f"broadcast root {root} outside 0..{self.size - 1}")
        if algorithm not in ("one_to_all", "pipelined"):
            raise InvalidArgumentError(
                f"unknown broadcast algorithm {algorithm!r}; known: one_to_all, pipelined"
            )
        o, in_place = self._output(arr, out)
        return self._submit(
            OpKind.BROADCAST,
            arr,
            o,
            in_place,
            name,
            ReduceOp.SUM,
            priority,
            algorithm,
            param=int(root),
            options=(("root", int(root)),),
        )

    def broadcast(
        self,
        x: Any,
        root: int = 0,
        name: str | int | None = None,
        out: Any = None,
        priority: int = 0,
        algorithm: str = "one_to_all",
    ) -> np.ndarray:
        """Blocking :meth:`broadcast_async`."""
        return self.broadcast_async(x, root, name, out, priority, algorithm).wait()

    def barrier_async(
        self, name: str | int | None = None, priority: int = 0, algorithm: str = "all_to_all"
    ) -> Handle:
        """Start a barrier: ``wait()`` returns once every rank has entered it."""
        if algorithm not in ("all_to_all", "all_to_one"):
            raise InvalidArgumentError(
                f"unknown barrier algorithm {algorithm!r}; known: all_to_all, all_to_one"
            )
        empty = np.empty(0, dtype=np.int64)
        return self._submit(
            OpKind.BARRIER,
            empty,
            empty,
            True,
            name,
            ReduceOp.SUM,
            priority,
            algorithm,
            result=None,
        )

    def barrier(self, name: str | int | None = None, algorithm: str = "all_to_all") -> None:
        """Blocking barrier."""
        self.barrier_async(name, algorithm=algorithm).wait()

    # ------------------------------------------------------------------ lifecycle

    def shutdown(self, timeout: float | None = None) -> None:
        """Let in-flight ops finish (up to ``timeout``), then stop the threads.

        Ops still in flight after the timeout fail with an error naming them.
        """
        if self._closed:
            return
        self._closed = True
        limit = self.config.shutdown_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + limit
        while self.loop.busy and time.monotonic() < deadline:
            time.sleep(0.001)
        left = self.loop.stalled()
        self._stop.set()
        self.loop.notify()
        self._comm_thread.join(timeout=10)
        if left:
            err = TotalReduceError(f"shut down with ops in flight: {'; '.join(left)}")
            log.error("%s", err)
            self.loop._fail_all(err)
        self.loop.compute.close()
        self._reduce_thread.join(timeout=10)
        self.transport.close()

    @property
    def closed(self) -> bool:
        return self._closed


def _reduce_op(op: Any) -> ReduceOp:
    try:
        return ReduceOp.of(op)
    except ValueError as exc:
        raise InvalidArgumentError(str(exc)) from None


def _sig_text(sig: tuple[Any, ...]) -> str:
    if not sig:
        return "?"
    kind, dtype, count, op, param = sig
    return f"{kind} of {count} {dtype} (op {op}, param {param})"

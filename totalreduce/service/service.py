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
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..algorithms.codes import AlgorithmCode, OpKind
from ..algorithms.schedule import Schedule, balanced_parts
from ..dtypes import DType, ReduceOp
from ..engine.loop import CommLoop, LoopConfig
from ..engine.payload import OpSpec
from ..engine.wire import wire_id
from ..errors import InvalidArgumentError, NotInitializedError, TotalReduceError
from ..group import Group, Partition
from ..transport.base import Transport
from .config import Config
from .handle import Handle
from .ops import alias_for, choose_allreduce, choose_broadcast, compile_op, plan_for
from .ops import cached_edge as _cached_edge

log = logging.getLogger("totalreduce.service")


@dataclass
class _NameState:
    next_generation: int = 0
    in_flight: int = 0
    signature: tuple[Any, ...] = ()


def as_array(x: Any, what: str, dtype: str | None = None) -> tuple[np.ndarray, DType]:
    """A numpy view of ``x`` (array or buffer) and its element type, after the usual checks.

    ``dtype="bfloat16"`` declares a 16-bit integer array to hold bfloat16 bit
    patterns (numpy has no bfloat16).
    """
    if isinstance(x, np.ndarray):
        arr = x
    elif hasattr(x, "__array__"):
        arr = np.asarray(x)
    else:
        try:
            arr = np.asarray(memoryview(x))
        except TypeError:
            raise InvalidArgumentError(
                f"{what} must be a numpy array or a buffer, got {type(x).__name__}"
            ) from None
    if not arr.flags.c_contiguous:
        raise InvalidArgumentError(
            f"{what} is not C-contiguous (shape {arr.shape}, strides {arr.strides}); "
            "pass np.ascontiguousarray(...)"
        )
    if dtype is not None:
        try:
            dt = DType.of(dtype)
        except ValueError as exc:
            raise InvalidArgumentError(f"{what}: {exc}") from None
        if dt is DType.BFLOAT16:
            if arr.dtype.itemsize != 2 or arr.dtype.kind not in "iu":
                raise InvalidArgumentError(
                    f"{what}: dtype='bfloat16' needs a 16-bit integer array of bit patterns, "
                    f"got {arr.dtype}"
                )
            return arr.view(np.uint16), dt
        if np.dtype(dt.numpy) != arr.dtype:
            raise InvalidArgumentError(f"{what} has dtype {arr.dtype}, dtype= says {dtype}")
        return arr, dt
    try:
        return arr, DType.of(arr.dtype)
    except ValueError as exc:
        raise InvalidArgumentError(f"{what}: {exc}") from None


def _done_handle(name: Any, result: Any) -> Handle:
    """A handle that is complete already (ranks outside a partition)."""
    h = Handle("" if name is None else name, -1, result)
    h._finish(None)
    return h


class Service:
    """One rank's totalreduce engine and its client API (see the module docstring)."""

    def __init__(self, transport: Transport, config: Config | None = None) -> None:
        from .reducer import Reducer, execute, run  # the Numba kernels: only when a service starts

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
                stall_shutdown_s=cfg.stall_shutdown_s,
                backoff_max_s=cfg.backoff_max_s,
                idle_backoff_max_s=cfg.idle_backoff_max_s,
                inline_compute_bytes=cfg.inline_compute_bytes,
                segment_bytes=cfg.segment_bytes,
            ),
            execute=execute,
            run=run,
        )
        self.reducer = Reducer(self.loop.compute, self.loop.notify)
        if cfg.timeline:
            from ..timeline import Timeline

            self.loop.trace = self.reducer.trace = Timeline(cfg.timeline, self.rank)
        self._lock = threading.Lock()
        self._names: dict[str | int, _NameState] = {}
        self._unnamed = 0
        self._closed = False
        self._stop = threading.Event()
        self._world_group = Group.world(self.size)
        self._comm_thread = threading.Thread(
            target=self._run_loop, name=f"totalreduce-comm-{self.rank}", daemon=True
        )
        self._reduce_thread = threading.Thread(
            target=self.reducer.run, name=f"totalreduce-reduce-{self.rank}", daemon=True
        )
        self._reduce_thread.start()
        self._comm_thread.start()

    def _run_loop(self) -> None:
        self.loop.run(self._stop)

    # ------------------------------------------------------------------ submission

    def _check_open(self) -> None:
        if self._closed:
            raise NotInitializedError("totalreduce was shut down; call init() again to use it")
        if self.loop.fatal is not None:
            raise TotalReduceError(f"the comm thread stopped: {self.loop.fatal}")
        late = self.loop.late_errors
        if late:
            # An op this rank finished failed elsewhere: its result may be wrong.
            raise late.popleft()

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
        want = x.size
        if out is None:
            return np.empty(want, dtype=x.dtype), False
        o, _ = as_array(out, what, "bfloat16" if x.dtype == np.uint16 else None)
        if o.dtype != x.dtype or o.size != want:
            raise InvalidArgumentError(
                f"{what} has dtype {o.dtype} and {o.size} elements; expected {x.dtype} and {want}"
            )
        if not o.flags.writeable:
            raise InvalidArgumentError(f"{what} is read-only")
        same = o.ctypes.data == x.ctypes.data and o.nbytes == x.nbytes
        if not same and np.shares_memory(o, x):
            raise InvalidArgumentError(f"{what} overlaps the input without being the same array")
        return o, same

    def _group(self, group: Group | None) -> tuple[Group, int]:
        """The group an op runs over and this rank's rank in it."""
        if group is None:
            return self._world_group, self.rank
        if not isinstance(group, Group):
            group = Group(group)
        bad = [r for r in group.ranks if r >= self.size]
        if bad:
            raise InvalidArgumentError(
                f"group {group} names ranks {bad} outside 0..{self.size - 1}"
            )
        me = group.rank_of(self.rank)
        if me is None:
            raise InvalidArgumentError(f"rank {self.rank} is not a member of {group}")
        return group, me

    @staticmethod
    def _priority(priority: Any) -> int:
        if isinstance(priority, bool) or not isinstance(priority, (int, np.integer)):
            raise InvalidArgumentError(f"priority must be an int, got {priority!r}")
        return int(priority)

    def _launch(
        self,
        *,
        kind: OpKind,
        name: str | int,
        generation: int,
        code: AlgorithmCode,
        schedule: Schedule,
        x: np.ndarray,
        out: np.ndarray,
        in_place: bool,
        dtype: DType,
        op: ReduceOp,
        priority: int,
        group: Group,
        param: int,
        on_done: Callable[[BaseException | None], None],
        handle: Handle | None = None,
    ) -> None:
        """Queue a named, compiled op for the comm thread (any thread may call this)."""
        seg = max(1, self.config.segment_bytes // dtype.itemsize)
        if in_place:
            aliased = alias_for(schedule)
            if aliased is not None:
                schedule = aliased
        spec = OpSpec(
            name=name,
            wire_id=wire_id(name),
            generation=generation,
            kind=kind,
            algorithm=code,
            dtype=dtype,
            # All-gather-v inputs differ per rank; the whole output does not.
            count=int(out.size) if kind is OpKind.ALLGATHER else int(x.size),
            op=op,
            priority=priority,
            inbuf=x.reshape(-1),
            outbuf=out.reshape(-1),
            schedule=schedule,
            plan=plan_for(schedule, seg),
            group=group.ranks,
            context=0 if group is self._world_group else group.context,
            param=param,
            in_place=in_place,
            on_done=on_done,
        )
        if handle is not None:
            handle._attach(spec)
        self.loop.submit(spec)

    def _simple(
        self,
        *,
        kind: OpKind,
        x: np.ndarray,
        dtype: DType,
        out: np.ndarray,
        in_place: bool,
        name: str | int | None,
        op: ReduceOp,
        priority: Any,
        group: Group,
        code: AlgorithmCode,
        schedule: Schedule,
        param: int = 0,
        result: Any = None,
        finalize: Callable[[], Any] | None = None,
        reserved: tuple[str | int, int] | None = None,
    ) -> Handle:
        """Name (unless ``reserved`` already), launch and return the handle of a one-phase op."""
        self._check_open()
        prio = self._priority(priority)
        if reserved is None:
            sig = (kind.name.lower(), dtype.name.lower(), int(x.size), op.name.lower(), param)
            op_name, gen = self._name(name, sig)
        else:
            op_name, gen = reserved
        handle = Handle(op_name, gen, result, self.loop, finalize)

        def done(error: BaseException | None) -> None:
            self._ended(op_name)
            handle._finish(error)

        self._launch(
            kind=kind,
            name=op_name,
            generation=gen,
            code=code,
            schedule=schedule,
            x=x,
            out=out,
            in_place=in_place,
            dtype=dtype,
            op=op,
            priority=prio,
            group=group,
            param=param,
            on_done=done,
            handle=handle,
        )
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
        group: Group | None = None,
        dtype: str | None = None,
    ) -> Handle:
        """Start reducing ``x`` across all ranks (or ``group``); ``wait()`` returns the result.

        ``out`` receives the result (a new array by default; ``out=x`` reduces in
        place).  ``op`` is ``sum``, ``avg``, ``max`` or ``min``.  Higher
        ``priority`` goes first.  ``dtype="bfloat16"`` marks a ``uint16`` array
        as bfloat16 bit patterns.
        """
        arr, dt = as_array(x, "x", dtype)
        rop = reduce_op(op)
        o, in_place = self._output(arr, out)
        grp, me = self._group(group)
        algo = choose_allreduce(
            algorithm or self.config.algorithm,
            grp.size,
            arr.nbytes,
            self.config.tuning_file or None,
            dt.name.lower(),
        )
        code, sched = compile_op(
            OpKind.ALLREDUCE, algo, me, grp.size, int(arr.size), rop is ReduceOp.AVG
        )
        return self._simple(
            kind=OpKind.ALLREDUCE,
            x=arr,
            dtype=dt,
            out=o,
            in_place=in_place,
            name=name,
            op=rop,
            priority=priority,
            group=grp,
            code=code,
            schedule=sched,
            result=o.reshape(arr.shape),
        )

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
    ) -> np.ndarray:
        """Blocking :meth:`allreduce_async`: returns the reduced array."""
        return self.allreduce_async(x, name, op, out, priority, algorithm, group, dtype).wait()

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
    ) -> Handle:
        """Start copying ``x`` of rank ``root`` to every rank; ``wait()`` returns it.

        Every rank passes an array of the same shape and dtype; ``out=x``
        overwrites ``x`` in place on the receivers, as ``MPI_Bcast`` does.
        ``algorithm`` is ``one_to_all``, ``pipelined`` (large buffers) or ``auto`` (the tuning
        table's choice, like allreduce's).  With a
        ``group``, ``root`` is a rank of the group.
        """
        arr, dt = as_array(x, "x", dtype)
        grp, me = self._group(group)
        if isinstance(root, bool) or not isinstance(root, (int, np.integer)):
            raise InvalidArgumentError(f"broadcast root must be an int, got {root!r}")
        if not 0 <= root < grp.size:
            raise InvalidArgumentError(f"broadcast root {root} outside 0..{grp.size - 1}")
        algorithm = choose_broadcast(
            algorithm, grp.size, arr.nbytes, self.config.tuning_file or None, dt.name.lower()
        )
        o, in_place = self._output(arr, out)
        code, sched = compile_op(
            OpKind.BROADCAST, algorithm, me, grp.size, int(arr.size), False, (("root", int(root)),)
        )
        return self._simple(
            kind=OpKind.BROADCAST,
            x=arr,
            dtype=dt,
            out=o,
            in_place=in_place,
            name=name,
            op=ReduceOp.SUM,
            priority=priority,
            group=grp,
            code=code,
            schedule=sched,
            param=int(root),
            result=o.reshape(arr.shape),
        )

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
    ) -> np.ndarray:
        """Blocking :meth:`broadcast_async`."""
        return self.broadcast_async(x, root, name, out, priority, algorithm, group, dtype).wait()

    def barrier_async(
        self,
        name: str | int | None = None,
        priority: int = 0,
        algorithm: str = "all_to_all",
        group: Group | None = None,
    ) -> Handle:
        """Start a barrier: ``wait()`` returns once every rank (of ``group``) has entered it."""
        if algorithm not in ("all_to_all", "all_to_one"):
            raise InvalidArgumentError(
                f"unknown barrier algorithm {algorithm!r}; known: all_to_all, all_to_one"
            )
        grp, me = self._group(group)
        code, sched = compile_op(OpKind.BARRIER, algorithm, me, grp.size, 0, False)
        empty = np.empty(0, dtype=np.int64)
        return self._simple(
            kind=OpKind.BARRIER,
            x=empty,
            dtype=DType.INT64,
            out=empty,
            in_place=True,
            name=name,
            op=ReduceOp.SUM,
            priority=priority,
            group=grp,
            code=code,
            schedule=sched,
        )

    def barrier(
        self,
        name: str | int | None = None,
        algorithm: str = "all_to_all",
        group: Group | None = None,
    ) -> None:
        """Blocking barrier."""
        self.barrier_async(name, algorithm=algorithm, group=group).wait()

    def pairwise_exchange_async(
        self,
        x: Any,
        steps: int,
        name: str | int | None = None,
        group: Group | None = None,
        priority: int = 0,
    ) -> Handle:
        """Gloo's benchmark pattern: ``steps`` pairwise swaps of ``x.size / steps`` elements.

        Needs a power-of-two number of ranks and ``1 <= steps <= lg P``.  Part
        ``k`` of the result is part ``k`` of the input of rank ``r XOR 2^k``.
        """
        arr, dt = as_array(x, "x")
        grp, me = self._group(group)
        if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)):
            raise InvalidArgumentError(f"steps must be an int, got {steps!r}")
        try:
            code, sched = compile_op(
                OpKind.PAIRWISE_EXCHANGE,
                "pairwise",
                me,
                grp.size,
                int(arr.size),
                False,
                (("steps", int(steps)),),
            )
        except ValueError as exc:
            raise InvalidArgumentError(str(exc)) from None
        o = np.empty_like(arr)
        return self._simple(
            kind=OpKind.PAIRWISE_EXCHANGE,
            x=arr,
            dtype=dt,
            out=o,
            in_place=False,
            name=name,
            op=ReduceOp.SUM,
            priority=priority,
            group=grp,
            code=code,
            schedule=sched,
            param=int(steps),
            result=o,
        )

    # ---------------------------------------------------------- reduce-scatter / all-gather

    def _split_axis(
        self, arr: np.ndarray, partition: Partition | None, axes: Any, group: Group | None
    ) -> tuple[Group, int, np.ndarray, int, tuple[int, ...], int] | None:
        """(group, group rank, flat moved input, axis, other dims, rows), or None: nothing to do.

        The tensor's split dimension is moved to the front, so that every rank's
        part is one contiguous block of whole rows.  None for a rank outside the
        partition, and for no partition dimension (``axes=()``): a group of one
        along no dimension, whose part is the whole input.
        """
        if partition is None:
            if axes not in (None, (), (0,), 0):
                raise InvalidArgumentError("axes= needs partition=; without one the array is flat")
            grp, me = self._group(group)
            flat = arr.reshape(-1)
            return grp, me, flat, 0, (), int(flat.size)
        if group is not None:
            raise InvalidArgumentError("pass group= to Partition(shape, group), not to the op")
        if not isinstance(partition, Partition):
            raise InvalidArgumentError(
                f"partition must be a totalreduce.Partition, got {partition!r}"
            )
        ax = (axes,) if isinstance(axes, (int, np.integer)) else tuple(axes or ())
        if not ax:
            return None
        if len(ax) != 1:
            raise InvalidArgumentError(
                "reduce-scatter/all-gather run along exactly one partition dimension, "
                f"got axes={axes}"
            )
        k = int(ax[0])
        if not 0 <= k < len(partition.shape):
            raise InvalidArgumentError(f"axis {k} outside partition of shape {partition.shape}")
        if not partition.is_active(self.rank):
            return None
        if arr.ndim <= k:
            raise InvalidArgumentError(
                f"tensor of shape {arr.shape} has no dimension {k} to split along"
            )
        grp = partition.axis_group(self.rank, k)
        me = grp.rank_of(self.rank)
        assert me is not None
        moved = np.ascontiguousarray(np.moveaxis(arr, k, 0))
        return grp, me, moved.reshape(-1), k, moved.shape[1:], int(arr.shape[k])

    @staticmethod
    def _unsplit(
        flat: np.ndarray, rows: int, others: tuple[int, ...], axis: int
    ) -> Callable[[], Any]:
        def finalize() -> np.ndarray:
            block = flat.reshape((rows, *others))
            return np.ascontiguousarray(np.moveaxis(block, 0, axis)) if axis else block

        return finalize

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
    ) -> Handle:
        """Reduce ``x`` across ranks and return this rank's balanced part (a new array).

        Without a partition, ``x`` is flattened and rank ``r`` of ``P`` (of the
        world or ``group``) gets ``balanced_parts(x.size, P)[r]`` of the sum (the
        first ``x.size % P`` ranks one element more).  With
        ``partition=Partition(shape)`` and ``axes=(k,)``, the sum runs over the
        ranks along partition dimension ``k`` and tensor dimension ``k`` is split
        among them in the same balanced way (seed 003: a 3x7x12 input on a 2x2x3
        partition along axis 2 gives 3x7x4).  A rank outside the partition gets
        a copy of its (zero-volume) input; with no partition dimension
        (``axes=()``) every rank gets a copy of its input.
        """
        arr, dt = as_array(x, "x", dtype)
        rop = reduce_op(op)
        split = self._split_axis(arr, partition, axes, group)
        if split is None:
            return _done_handle(name, arr.copy())
        grp, me, flat, axis, others, length = split
        rest = int(np.prod(others)) if others else 1
        rows = [n for _, n in balanced_parts(length, grp.size)]
        counts = tuple(n * rest for n in rows)
        out = np.empty(counts[me], dtype=arr.dtype)
        code, sched = compile_op(
            OpKind.REDUCE_SCATTER,
            "ring",
            me,
            grp.size,
            int(flat.size),
            rop is ReduceOp.AVG,
            (("counts", counts),),
        )
        if partition is None:
            finalize = None
            result: Any = out
        else:
            finalize = self._unsplit(out, rows[me], others, axis)
            result = None
        return self._simple(
            kind=OpKind.REDUCE_SCATTER,
            x=flat,
            dtype=dt,
            out=out,
            in_place=False,
            name=name,
            op=rop,
            priority=priority,
            group=grp,
            code=code,
            schedule=sched,
            result=result,
            finalize=finalize,
        )

    def reduce_scatter(
        self, x: Any, name: str | int | None = None, op: str = "sum", **kw: Any
    ) -> Any:
        """Blocking :meth:`reduce_scatter_async`."""
        return self.reduce_scatter_async(x, name, op, **kw).wait()

    def allgather_async(
        self,
        x: Any,
        name: str | int | None = None,
        partition: Partition | None = None,
        axes: Any = None,
        group: Group | None = None,
        dtype: str | None = None,
        priority: int = 0,
    ) -> Handle:
        """Concatenate every rank's ``x`` in rank order (parts may differ in length).

        Without a partition the parts are flattened and joined into one 1-D
        array; with ``partition`` and ``axes=(k,)`` the parts of the ranks along
        partition dimension ``k`` are joined along tensor dimension ``k`` (the
        adjoint of :meth:`reduce_scatter_async`).  The part sizes are exchanged
        first, so no rank needs to know the others'.
        """
        arr, dt = as_array(x, "x", dtype)
        split = self._split_axis(arr, partition, axes, group)
        if split is None:
            return _done_handle(name, arr.copy())
        self._check_open()
        prio = self._priority(priority)
        grp, me, flat, axis, others, _length = split
        rest = int(np.prod(others)) if others else 1
        op_name, gen = self._name(name, ("allgather", dt.name.lower(), -1, "sum", 0))
        count_name, count_gen = self._name(f"{op_name}#counts", ("allgather", "int64", 1, "sum", 0))
        mine = np.array([flat.size], dtype=np.int64)
        sizes = np.empty(grp.size, dtype=np.int64)
        box: dict[str, Any] = {}

        def finalize() -> np.ndarray:
            out = box["out"]
            if partition is None:
                return out
            return self._unsplit(out, out.size // rest if rest else 0, others, axis)()

        handle = Handle(op_name, gen, None, self.loop, finalize)

        def data_done(error: BaseException | None) -> None:
            self._ended(op_name)
            handle._finish(error)

        def counts_done(error: BaseException | None) -> None:
            self._ended(count_name)
            if error is not None:
                self._ended(op_name)
                handle._finish(error)
                return
            counts = tuple(int(c) for c in sizes)
            out = np.empty(sum(counts), dtype=arr.dtype)
            box["out"] = out
            try:
                code, sched = compile_op(
                    OpKind.ALLGATHER,
                    "ring",
                    me,
                    grp.size,
                    int(flat.size),
                    False,
                    (("counts", counts),),
                )
            except Exception as exc:  # bad counts from a peer: fail, don't hang
                self._ended(op_name)
                handle._finish(InvalidArgumentError(f"all-gather {op_name!r}: {exc}"))
                return
            self._launch(
                kind=OpKind.ALLGATHER,
                name=op_name,
                generation=gen,
                code=code,
                schedule=sched,
                x=flat,
                out=out,
                in_place=False,
                dtype=dt,
                op=ReduceOp.SUM,
                priority=prio,
                group=grp,
                param=0,
                on_done=data_done,
                handle=handle,
            )

        code, sched = compile_op(
            OpKind.ALLGATHER, "ring", me, grp.size, 1, False, (("counts", (1,) * grp.size),)
        )
        self._launch(
            kind=OpKind.ALLGATHER,
            name=count_name,
            generation=count_gen,
            code=code,
            schedule=sched,
            x=mine,
            out=sizes,
            in_place=False,
            dtype=DType.INT64,
            op=ReduceOp.SUM,
            priority=prio,
            group=grp,
            param=0,
            on_done=counts_done,
            handle=handle,
        )
        return handle

    def allgather(self, x: Any, name: str | int | None = None, **kw: Any) -> Any:
        """Blocking :meth:`allgather_async`."""
        return self.allgather_async(x, name, **kw).wait()

    # ---------------------------------------------------------- neighbor averaging

    def _topology(self, topology: Any, size: int) -> Any:
        from ..topology import get_topology

        try:
            return get_topology(topology, size)
        except ValueError as exc:
            raise InvalidArgumentError(str(exc)) from None

    def _neighbor_weights(
        self,
        topology: Any,
        step: int,
        self_weight: float | None,
        src_weights: Any,
        dst_weights: Any,
    ) -> tuple[float, dict[int, float], dict[int, float]]:
        """BlueFog's weights: from the topology at ``step``, or as given (dynamic)."""
        given = (self_weight, src_weights, dst_weights)
        if any(v is not None for v in given):
            if src_weights is None or self_weight is None:
                raise InvalidArgumentError(
                    "dynamic neighbor_allreduce needs self_weight and src_weights "
                    "(and dst_weights, or a topology to take the destinations from)"
                )
            src = {int(k): float(v) for k, v in dict(src_weights).items()}
            if dst_weights is None:
                if topology is None:
                    raise InvalidArgumentError(
                        "neighbor_allreduce with src_weights needs dst_weights or a topology"
                    )
                from ..topology import plan

                dst = {
                    d: 1.0
                    for d in plan(self._topology(topology, self.size), self.rank, step).dst_ranks
                }
            elif isinstance(dst_weights, dict):
                dst = {int(k): float(v) for k, v in dst_weights.items()}
            else:
                dst = {int(d): 1.0 for d in dst_weights}
            return float(self_weight), src, dst
        from ..topology import plan

        p = plan(self._topology(topology or "exponential-2", self.size), self.rank, step)
        return p.self_weight, dict(p.src_weights), {d: 1.0 for d in p.dst_ranks}

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
    ) -> Handle:
        """Average ``x`` with this rank's neighbors: ``x_i <- sum_j W[i, j] x_j``.

        ``topology`` is a name or a topology object (see
        :mod:`totalreduce.topology`; default ``exponential-2``).  A Decent-DP
        topology (``complete``, ``ring``, ``exp``, ``alternating-exp-ring``)
        averages over the rank's edge of the step with the edge's weight (an
        allreduce over the edge's group); a BlueFog graph uses its mixing matrix.
        ``step`` defaults to this op's generation, so calling it every iteration
        with the same ``name`` walks a dynamic topology by itself.

        Dynamic weights (BlueFog's meaning): ``self_weight``, ``src_weights``
        (``{rank: weight}`` of what this rank receives) and ``dst_weights``
        (``{rank: weight}`` scaling what it sends, or a list of ranks) given per
        call.  A send/receive pattern that does not match between ranks fails
        on the ranks involved, naming them.
        """
        arr, dt = as_array(x, "x", dtype)
        if dt not in (DType.FLOAT16, DType.FLOAT32, DType.FLOAT64, DType.BFLOAT16):
            raise InvalidArgumentError(
                f"neighbor averaging needs a floating-point array, got {dt.name.lower()}"
            )
        self._check_open()
        prio = self._priority(priority)
        o, in_place = self._output(arr, out)
        n = int(arr.size)
        edge_topo = None
        if topology is not None and not any(v is not None for v in (self_weight, src_weights)):
            from ..topology import Topology

            topo = self._topology(topology, self.size)
            if isinstance(topo, Topology):
                edge_topo = topo
            topology = topo
        op_name, gen = self._name(name, ("neighbor_allreduce", dt.name.lower(), n, "avg", 0))
        t = gen if step is None else int(step)
        try:
            if edge_topo is not None:
                edge = edge_topo.edge_of(self.rank, t)
                grp = (
                    self._world_group if len(edge.ranks) == self.size else Group(sorted(edge.ranks))
                )
                me = grp.rank_of(self.rank)
                assert me is not None
                sched = _cached_edge(me, grp.size, n, float(edge.weight))
                code = AlgorithmCode.EDGE
            else:
                from ..algorithms.neighbor import neighbor_allreduce

                sw, src, dst = self._neighbor_weights(
                    topology, t, self_weight, src_weights, dst_weights
                )
                sched = neighbor_allreduce(
                    self.rank, self.size, n, self_weight=sw, src_weights=src, dst_weights=dst
                )
                grp = self._world_group
                code = AlgorithmCode.NEIGHBOR
        except (ValueError, TypeError) as exc:
            self._ended(op_name)
            raise InvalidArgumentError(f"neighbor_allreduce {op_name!r} step {t}: {exc}") from None
        return self._simple(
            kind=OpKind.NEIGHBOR_ALLREDUCE,
            x=arr,
            dtype=dt,
            out=o,
            in_place=in_place,
            name=op_name,
            op=ReduceOp.SUM,
            priority=prio,
            group=grp,
            code=code,
            schedule=sched,
            result=o.reshape(arr.shape),
            reserved=(op_name, gen),
        )

    def neighbor_allreduce(self, x: Any, name: str | int | None = None, **kw: Any) -> np.ndarray:
        """Blocking :meth:`neighbor_allreduce_async`."""
        return self.neighbor_allreduce_async(x, name, **kw).wait()

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
    ) -> Handle:
        """Gather the ``x`` of every in-neighbor: shape ``(len(sources), *x.shape)``.

        Sources are in ascending rank order; they come from ``topology`` at
        ``step`` (default: this op's generation), or from ``src_ranks`` and
        ``dst_ranks`` given per call.  All ranks pass arrays of the same shape.
        """
        arr, dt = as_array(x, "x", dtype)
        self._check_open()
        prio = self._priority(priority)
        n = int(arr.size)
        op_name, gen = self._name(name, ("neighbor_allgather", dt.name.lower(), n, "sum", 0))
        t = gen if step is None else int(step)
        try:
            if src_ranks is not None or dst_ranks is not None:
                if src_ranks is None or dst_ranks is None:
                    raise ValueError("give both src_ranks and dst_ranks")
                src, dst = sorted(int(r) for r in src_ranks), sorted(int(r) for r in dst_ranks)
            else:
                from ..topology import plan

                p = plan(self._topology(topology or "exponential-2", self.size), self.rank, t)
                src, dst = sorted(p.src_weights), sorted(p.dst_ranks)
            from ..algorithms.neighbor import neighbor_allgather

            sched = neighbor_allgather(self.rank, self.size, n, src_ranks=src, dst_ranks=dst)
        except (ValueError, TypeError, InvalidArgumentError) as exc:
            self._ended(op_name)
            raise InvalidArgumentError(f"neighbor_allgather {op_name!r} step {t}: {exc}") from None
        out = np.empty(len(src) * n, dtype=arr.dtype)
        return self._simple(
            kind=OpKind.NEIGHBOR_ALLGATHER,
            x=arr,
            dtype=dt,
            out=out,
            in_place=False,
            name=op_name,
            op=ReduceOp.SUM,
            priority=prio,
            group=self._world_group,
            code=AlgorithmCode.NEIGHBOR,
            schedule=sched,
            result=out.reshape((len(src), *arr.shape)),
            reserved=(op_name, gen),
        )

    def neighbor_allgather(self, x: Any, name: str | int | None = None, **kw: Any) -> np.ndarray:
        """Blocking :meth:`neighbor_allgather_async`."""
        return self.neighbor_allgather_async(x, name, **kw).wait()

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
    ) -> Handle:
        """Average within each node, then with neighbor nodes on a machine topology.

        Ranks ``node * local_size .. node * local_size + local_size - 1`` form a
        node.  Phase 1 averages over the node (an allreduce over its group);
        phase 2 averages node results over ``topology``, a topology of the
        ``size // local_size`` nodes (name or object; default ``exponential-2``):
        local rank ``l`` of a node exchanges with local rank ``l`` of its neighbor
        nodes, so every link of a node is used in parallel and every rank ends
        with its node's averaged result.
        """
        arr, dt = as_array(x, "x", dtype)
        if (
            not isinstance(local_size, (int, np.integer))
            or local_size < 1
            or self.size % local_size
        ):
            raise InvalidArgumentError(
                f"local_size must divide the world size {self.size}, got {local_size!r}"
            )
        if dt not in (DType.FLOAT16, DType.FLOAT32, DType.FLOAT64, DType.BFLOAT16):
            raise InvalidArgumentError(
                f"neighbor averaging needs a floating-point array, got {dt.name.lower()}"
            )
        self._check_open()
        prio = self._priority(priority)
        o, in_place = self._output(arr, out)
        n = int(arr.size)
        L = int(local_size)
        node, local = divmod(self.rank, L)
        nodes = self.size // L
        local_grp = Group(range(node * L, node * L + L))
        machine_topo = self._topology(topology or "exponential-2", nodes)
        op_name, gen = self._name(name, ("hierarchical", dt.name.lower(), n, "avg", L))
        local_name, local_gen = self._name(
            f"{op_name}#node", ("allreduce", dt.name.lower(), n, "avg", 0)
        )
        t = gen if step is None else int(step)
        mid = np.empty(n, dtype=arr.dtype)
        handle = Handle(op_name, gen, o.reshape(arr.shape), self.loop)

        def machine_done(error: BaseException | None) -> None:
            self._ended(op_name)
            handle._finish(error)

        def local_done(error: BaseException | None) -> None:
            self._ended(local_name)
            if error is not None:
                self._ended(op_name)
                handle._finish(error)
                return
            try:
                from ..algorithms.neighbor import neighbor_allreduce
                from ..topology import Topology, plan

                if isinstance(machine_topo, Topology):
                    edge = machine_topo.edge_of(node, t)
                    grp = Group(sorted(m * L + local for m in edge.ranks))
                    me = grp.rank_of(self.rank)
                    assert me is not None
                    sched = _cached_edge(me, grp.size, n, float(edge.weight))
                    code = AlgorithmCode.EDGE
                else:
                    p = plan(machine_topo, node, t)
                    sched = neighbor_allreduce(
                        self.rank,
                        self.size,
                        n,
                        self_weight=p.self_weight,
                        src_weights={m * L + local: w for m, w in p.src_weights.items()},
                        dst_weights={m * L + local: 1.0 for m in p.dst_ranks},
                    )
                    grp = self._world_group
                    code = AlgorithmCode.NEIGHBOR
            except Exception as exc:  # a bad topology must fail the op, not the comm thread
                self._ended(op_name)
                handle._finish(InvalidArgumentError(f"hierarchical {op_name!r}: {exc}"))
                return
            self._launch(
                kind=OpKind.NEIGHBOR_ALLREDUCE,
                name=op_name,
                generation=gen,
                code=code,
                schedule=sched,
                x=mid,
                out=o,
                in_place=False,
                dtype=dt,
                op=ReduceOp.SUM,
                priority=prio,
                group=grp,
                param=L,
                on_done=machine_done,
                handle=handle,
            )

        code, sched = compile_op(OpKind.ALLREDUCE, "ring", local, L, n, True)
        self._launch(
            kind=OpKind.ALLREDUCE,
            name=local_name,
            generation=local_gen,
            code=code,
            schedule=sched,
            x=arr,
            out=mid,
            in_place=False,
            dtype=dt,
            op=ReduceOp.AVG,
            priority=prio,
            group=local_grp,
            param=0,
            on_done=local_done,
            handle=handle,
        )
        return handle

    def hierarchical_neighbor_allreduce(
        self, x: Any, name: str | int | None = None, **kw: Any
    ) -> np.ndarray:
        """Blocking :meth:`hierarchical_neighbor_allreduce_async`."""
        return self.hierarchical_neighbor_allreduce_async(x, name, **kw).wait()

    def node_layout(self) -> tuple[int, int, int, int]:
        """(local_rank, local_size, cross_rank, cross_size) of this rank, from the transport."""
        return self.transport.node_layout()

    # ------------------------------------------------------------------ faults

    def abort(self, name: str | int, generation: int, reason: str) -> None:
        """Fail op ``name`` generation ``generation`` here and on every other rank.

        Every rank's handle of that op fails with ``OpFailedError(reason)``, even
        on ranks (including this one) that have not submitted it yet.
        """
        self.loop.request_abort((wire_id(name), int(generation)), str(name), reason)

    # ------------------------------------------------------------------ lifecycle

    def shutdown(self, timeout: float | None = None) -> None:
        """Let in-flight ops finish (up to ``timeout``), then stop the threads.

        Ops still in flight after the timeout fail with an error naming them.
        """
        if self._closed:
            return
        self._closed = True
        limit = self.config.shutdown_timeout_s if timeout is None else timeout
        if timeout is None and getattr(sys, "last_value", None) is not None:
            limit = 0.0  # the program is dying of an exception: do not keep peers waiting
        deadline = time.monotonic() + limit
        while (self.loop.busy or self.loop.sending) and time.monotonic() < deadline:
            self.loop.poll()
            time.sleep(0.0005)
        # Let the last control messages (credit, errors) leave.
        for _ in range(20):
            self.loop.poll()
        left = self.loop.stalled()
        self._stop.set()
        self.loop.notify()
        self._comm_thread.join(timeout=10)
        if left:
            err = TotalReduceError(f"shut down with ops in flight: {'; '.join(left)}")
            log.error("%s", err)
            self.loop.fail_all(err)
        self.loop.say_goodbye()
        deadline = time.monotonic() + 1.0  # let the goodbyes (and what is queued before them) leave
        while self.loop.sending and time.monotonic() < deadline:
            self.loop.poll()
            time.sleep(0.001)
        self.loop.compute.close()
        self._reduce_thread.join(timeout=10)
        if self.loop.trace is not None:
            self.loop.trace.close()
        self.transport.close()

    @property
    def closed(self) -> bool:
        return self._closed


def reduce_op(op: Any) -> ReduceOp:
    """The ReduceOp a call names, or InvalidArgumentError listing the known ones."""
    try:
        return ReduceOp.of(op)
    except ValueError as exc:
        raise InvalidArgumentError(str(exc)) from None


def _sig_text(sig: tuple[Any, ...]) -> str:
    if not sig:
        return "?"
    kind, dtype, count, op, param = sig
    return f"{kind} of {count} {dtype} (op {op}, param {param})"

"""Whole-array collectives: allreduce, broadcast, barrier and the pairwise exchange.

Each is one op with one compiled schedule (:func:`~.ops.compile_op`), named,
launched and returned as a :class:`~.handle.Handle` by :meth:`OpSubmitter._simple`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..algorithms.codes import AlgorithmCode, OpKind
from ..algorithms.schedule import balanced_parts
from ..dtypes import DType, ReduceOp
from ..errors import InvalidArgumentError
from ..group import Group
from . import checks, express, tuning
from .checks import as_array
from .handle import Handle
from .ops import (
    choose_allreduce,
    choose_broadcast,
    compile_op,
)
from .submit import OpSubmitter
from .thin import ThinHandle


class CollectiveOps(OpSubmitter):
    """Allreduce, broadcast, barrier and pairwise exchange of a service."""

    _routes: dict[tuple[Any, ...], tuple[AlgorithmCode, Any]]
    _express: dict[tuple[Any, ...], express.Express]

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
    ) -> Handle | ThinHandle:
        """Start reducing ``x`` across all ranks (or ``group``); ``wait()`` returns the result.

        ``out`` receives the result (a new array by default; ``out=x`` reduces in
        place).  ``op`` is ``sum``, ``avg``, ``max``, ``min``, ``product``
        (or ``prod``), or, on integer and bool arrays only, the bitwise
        ``band``, ``bor`` and ``bxor`` (a ReduceOp works too).  Integer sums
        and products wrap; on bool, ``sum`` and ``max`` are a logical or,
        ``product`` and ``min`` a logical and (as in gloo), and ``avg`` is
        refused.  Higher ``priority`` goes first.  ``dtype="bfloat16"`` marks a ``uint16`` array
        as bfloat16 bit patterns.  ``op="adasum"`` (floating arrays) combines by Horovod's
        Adasum rule instead of adding (:mod:`totalreduce.service.adasum`).
        """
        if name is not None and group is None and dtype is None:
            # A repeat of a shape this name had: the express path (service/express.py).
            if self._thin is not None:
                if out is x or out is None:  # daemon mode: the record keeps the descriptor
                    key = (express.THIN, name, op, algorithm)
                    th = express.thin_start(self, key, x, out, priority)
                    if th is not None:
                        return th
            else:
                ex = express.lookup(self._express, (name, op, out is x, algorithm), x)
                if ex is not None:
                    h = express.start(self, ex, name, x, out, priority)
                    if h is not None:
                        return h
        elif (
            name is not None
            and dtype is None
            and group.__class__ is Group
            and self._thin is not None
            and (out is x or out is None)
        ):  # daemon mode over a group: the record's key names its ranks
            key = (express.THIN, name, op, algorithm, group.ranks)  # type: ignore[union-attr]
            th = express.thin_start(self, key, x, out, priority)
            if th is not None:
                return th
        arr, dt = as_array(x, "x", dtype)
        if isinstance(op, str) and op.lower() == "adasum":  # Horovod's: service/adasum.py
            o, _ = checks.output(arr, out)
            grp, _ = self._group(group)
            return self._adasum(arr, dt, name, o, grp, priority)  # type: ignore[attr-defined, no-any-return]
        rop = checks.reduce_op(op, dt, "allreduce")
        o, in_place = checks.output(arr, out)
        grp, me = self._group(group)
        wanted = algorithm or self.config.algorithm
        avg = rop is ReduceOp.AVG
        algo = self._thin_for(OpKind.ALLREDUCE, wanted, arr.nbytes, dt)
        if algo is not None:
            th = self._thin_op(  # the node's service runs it (service/thin.py)
                OpKind.ALLREDUCE, arr, dt, o, in_place, name, rop, priority, 0,
                o.reshape(arr.shape), group=grp, algorithm=algo,
            )  # fmt: skip
            if name is not None and group is None and dtype is None:  # (any out: a record
                # serves async repeats in place or into a new array, blocking ones into out)
                express.thin_remember(self, (express.THIN, name, op, algorithm), x, th)
            elif name is not None and dtype is None and group.__class__ is Group:
                ranks = group.ranks  # type: ignore[union-attr]
                express.thin_remember(self, (express.THIN, name, op, algorithm, ranks), x, th,
                                      ranks)  # fmt: skip
            return th
        _not_hierarchical(wanted)
        route = (wanted, grp.ranks, arr.nbytes, dt, arr.size, avg, tuning.EPOCH[0])
        hit = self._routes.get(route)
        if hit is None:
            algo = choose_allreduce(
                wanted, grp.size, arr.nbytes, self.config.tuning_file or None, dt.name.lower()
            )
            hit = compile_op(OpKind.ALLREDUCE, algo, me, grp.size, int(arr.size), avg)
            if len(self._routes) >= 4096:
                self._routes.clear()
            self._routes[route] = hit
        code, sched = hit
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
            express_key=(
                (name, op, out is x, algorithm)
                if name.__class__ in (str, int)
                and (algorithm is None or algorithm.__class__ is str)
                and group is None
                and dtype is None
                and arr is x
                and in_place == (out is x)  # not for a view of x as out: the key says `out is x`
                and op.__class__ in (str, ReduceOp)
                else None
            ),
        )

    def _allreduce_direct(
        self,
        x: Any,
        name: str | int | None = None,
        op: str | ReduceOp = "sum",
        out: Any = None,
        priority: int = 0,
        algorithm: str | None = None,
        group: Group | None = None,
        dtype: str | None = None,
    ) -> Any:
        """The blocking ``allreduce``: a repeat the compiled lane runs is entered and driven
        to its end in this call, with no handle (``express.run``; in daemon mode, a repeat
        on arrays of the arena, over the world or a ``Group``, submitted and waited for
        in one compiled call: ``express.thin_now``); anything else is
        ``allreduce_async(...).wait()``."""
        if name is not None and group is None and dtype is None:
            if self._thin is None:
                ex = express.lookup(self._express, (name, op, out is x, algorithm), x)
                if ex is not None:
                    got = express.run(self, ex, name, x, out, priority)
                    if got is not express.MISSED:
                        return got
            else:  # daemon mode: one compiled call (the meeting, or the ring)
                key = (express.THIN, name, op, algorithm)
                got = express.thin_now(self, key, x, priority, out)
                if got is not None:
                    return got
        elif (
            name is not None
            and dtype is None
            and group.__class__ is Group
            and self._thin is not None
        ):
            # daemon mode, over a group: one compiled call into the ring (its record's key
            # names the group's ranks; the first call keeps the record)
            ranks = group.ranks  # type: ignore[union-attr]
            key = (express.THIN, name, op, algorithm, ranks)
            got = express.thin_now(self, key, x, priority, out)
            if got is not None:
                return got
        return self.allreduce_async(x, name, op, out, priority, algorithm, group, dtype).wait()

    def _thin_for(
        self, kind: OpKind, algorithm: str, nbytes: int, dt: DType
    ) -> AlgorithmCode | None:
        """The algorithm among the nodes' services (NONE: theirs to choose) if an op goes
        the thin path (daemon mode; one too large for the arena runs as pieces), else
        None.  A named algorithm is checked here, as in embedded mode, and runs among the
        services."""
        if self._thin is None:
            return None
        if algorithm in ("auto", "hierarchical"):
            return AlgorithmCode.NONE
        table = self.config.tuning_file or None
        if kind is OpKind.ALLREDUCE:
            algorithm = choose_allreduce(algorithm, self.size, nbytes, table, dt.name.lower())
        elif kind is OpKind.BROADCAST:
            algorithm = choose_broadcast(algorithm, self.size, nbytes, table, dt.name.lower())
        return AlgorithmCode[algorithm.upper()]

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
    ) -> Handle | ThinHandle:
        """Start copying ``x`` of rank ``root`` to every rank; ``wait()`` returns it.

        Every rank passes an array of the same shape and dtype; ``out=x``
        overwrites ``x`` in place on the receivers, as ``MPI_Bcast`` does.
        ``algorithm`` is ``one_to_all``, ``pipelined`` (large buffers) or ``auto`` (the tuning
        table's choice, like allreduce's).  With a
        ``group``, ``root`` is a rank of the group.
        """
        express_key = None
        if name is not None and group is None and dtype is None and root.__class__ is int:
            # A repeat of a shape this name had: the express path (service/express.py).
            express_key = ("bc", name, root, out is x, algorithm)
            ex = express.lookup(self._express, express_key, x)
            if ex is not None:
                h = express.start(self, ex, name, x, out, priority)
                if h is not None:
                    return h
        arr, dt = as_array(x, "x", dtype)
        grp, me = self._group(group)
        if isinstance(root, bool) or not isinstance(root, (int, np.integer)):
            raise InvalidArgumentError(f"broadcast root must be an int, got {root!r}")
        if not 0 <= root < grp.size:
            raise InvalidArgumentError(f"broadcast root {root} outside 0..{grp.size - 1}")
        o, in_place = checks.output(arr, out)
        algo = self._thin_for(OpKind.BROADCAST, algorithm, arr.nbytes, dt)
        if algo is not None:
            return self._thin_op(
                OpKind.BROADCAST, arr, dt, o, in_place, name, ReduceOp.SUM, priority, int(root),
                o.reshape(arr.shape), group=grp, algorithm=algo,
            )  # fmt: skip
        _not_hierarchical(algorithm)
        algorithm = choose_broadcast(
            algorithm, grp.size, arr.nbytes, self.config.tuning_file or None, dt.name.lower()
        )
        code, sched = compile_op(
            OpKind.BROADCAST, algorithm, me, grp.size, int(arr.size), False,
            (("root", int(root)),),
        )  # fmt: skip
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
            express_key=express_key,
        )

    def _broadcast_direct(
        self,
        x: Any,
        root: int = 0,
        name: str | int | None = None,
        out: Any = None,
        priority: int = 0,
        algorithm: str = "auto",
        group: Group | None = None,
        dtype: str | None = None,
    ) -> Any:
        """The blocking ``broadcast``: a repeat the compiled lane runs is entered and driven
        to its end in this call, with no handle (``express.run``; in daemon mode, over the
        world or a ``Group``, a repeat in place on an array of the arena, submitted and
        waited for in one compiled call, or met at a one-node service's meeting place:
        ``express.thin_now``; into a new array or another, staged in the arena,
        ``express.thin_parted_now``); anything else is ``broadcast_async(...).wait()``."""
        ranks = None
        if group is not None and group.__class__ is Group:
            ranks = group.ranks  # daemon mode: a group's record's key names its ranks
        if (
            name is not None and dtype is None and root.__class__ is int
            and self._thin is not None and (group is None or ranks is not None)
        ):  # fmt: skip
            tail = () if ranks is None else (ranks,)
            if out is x:
                key = (express.THIN_BC, name, root, algorithm, *tail)
                got = express.thin_now(self, key, x, priority, x, OpKind.BROADCAST)
                if got is not None:
                    return got
                h = self.broadcast_async(x, root, name, out, priority, algorithm, group, dtype)
                express.thin_bcast_remember(self, key, x, h, ranks)
                return h.wait()
            # into a new array or another: staged, as the whole way
            key = (express.THIN_BCO, name, root, algorithm, *tail)
            got = express.thin_parted_now(self, key, x, priority, out)
            if got is not None:
                return got
            h = self.broadcast_async(x, root, name, out, priority, algorithm, group, dtype)
            express.thin_parted_remember(self, key, x, h, OpKind.BROADCAST, root, ranks)
            return h.wait()
        if name is not None and group is None and dtype is None and root.__class__ is int:
            ex = express.lookup(self._express, ("bc", name, root, out is x, algorithm), x)
            if ex is not None:
                got = express.run(self, ex, name, x, out, priority)
                if got is not express.MISSED:
                    return got
        return self.broadcast_async(x, root, name, out, priority, algorithm, group, dtype).wait()

    def barrier_async(
        self,
        name: str | int | None = None,
        priority: int = 0,
        algorithm: str = "auto",
        group: Group | None = None,
    ) -> Handle | ThinHandle:
        """Start a barrier: ``wait()`` returns once every rank (of ``group``) has entered it.

        ``algorithm``: ``all_to_all``, ``all_to_one``, ``hierarchical`` (daemon mode) or
        ``auto`` (hierarchical in daemon mode, else all-to-all).
        """
        if algorithm not in ("auto", "all_to_all", "all_to_one", "hierarchical"):
            raise InvalidArgumentError(
                f"unknown barrier algorithm {algorithm!r}; known: auto, all_to_all, all_to_one, "
                "hierarchical"
            )
        grp, me = self._group(group)
        algo = self._thin_for(OpKind.BARRIER, algorithm, 0, DType.INT64)
        if algo is not None:
            none = np.empty(0, dtype=np.int64)
            return self._thin_op(
                OpKind.BARRIER, none, DType.INT64, none, True, name, ReduceOp.SUM, priority, 0,
                None, group=grp, algorithm=algo,
            )  # fmt: skip
        _not_hierarchical(algorithm)
        flat = "all_to_all" if algorithm == "auto" else algorithm
        code, sched = compile_op(OpKind.BARRIER, flat, me, grp.size, 0, False)
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

    def _barrier_direct(
        self,
        name: str | int | None = None,
        algorithm: str = "auto",
        group: Group | None = None,
    ) -> None:
        """The blocking ``barrier``: in daemon mode a repeat of a named barrier of the world
        or of a ``Group`` is one compiled call (``express.thin_barrier``); anything else is
        ``barrier_async(...).wait()``."""
        ranks = None
        if group is not None and group.__class__ is Group:
            ranks = group.ranks  # a group's record's key names its ranks
        if (
            self._thin is None
            or name is None
            or (group is not None and ranks is None)
            or algorithm != "auto"
        ):
            self.barrier_async(name, 0, algorithm, group).wait()
            return
        if express.thin_barrier(self, name, 0, ranks):
            return
        h = self.barrier_async(name, 0, algorithm, group)
        express.thin_barrier_remember(self, name, h, ranks)
        h.wait()

    def pairwise_exchange_async(
        self,
        x: Any,
        steps: int,
        name: str | int | None = None,
        group: Group | None = None,
        priority: int = 0,
    ) -> Handle | ThinHandle:
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
        if self._thin is not None:
            return self._thin_pairwise(arr, dt, o, int(steps), name, grp, me, priority)
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

    def _thin_pairwise(
        self, arr: np.ndarray, dt: DType, o: np.ndarray, steps: int, name: str | int | None,
        grp: Group, me: int, priority: int,
    ) -> ThinHandle:  # fmt: skip
        """Daemon mode: the pairwise exchange as one all-to-all on the thin path.  Part
        ``k`` goes to (and comes from) group rank ``me ^ 2**k``; an all-to-all lays its
        blocks out by rank, so the parts travel in their partners' order and are put back
        in step order at the end."""
        self._check_open()
        checks.priority(priority)  # before the name: a refused call must not use a generation
        sig = ("pairwise_exchange", dt.name.lower(), int(arr.size), "sum", steps)
        reserved = self._names.name(name, sig)
        parts = balanced_parts(int(arr.size), steps)
        order = sorted(range(steps), key=lambda k: me ^ (1 << k))  # steps by partner
        sends = [0] * grp.size
        for k, (_, n) in enumerate(parts):
            sends[me ^ (1 << k)] = n
        flat = arr.reshape(-1)
        x = np.concatenate([flat[parts[k][0] : parts[k][0] + parts[k][1]] for k in order])
        got = np.empty_like(x)
        dest = o.reshape(-1)

        def in_step_order() -> np.ndarray:
            at = 0
            for k in order:
                off, n = parts[k]
                dest[off : off + n] = got[at : at + n]
                at += n
            return o

        return self._thin_op(
            OpKind.ALLTOALL, x, dt, got, False, name, ReduceOp.SUM, priority, 0, None,
            group=grp, parts=(*sends, *sends), finalize=in_step_order, reserved=reserved,
            shown=OpKind.PAIRWISE_EXCHANGE, cut=arr.nbytes,
        )  # fmt: skip


def _not_hierarchical(algorithm: str | None) -> None:
    """Outside daemon mode (which runs every op through the nodes' services), refuse the
    algorithm that means that."""
    if algorithm == "hierarchical":
        raise InvalidArgumentError(
            "algorithm 'hierarchical' runs through the nodes' services: it needs daemon mode"
        )

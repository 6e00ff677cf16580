"""Rooted and personalised ops: reduce, gather, scatter, all-to-all, and send/recv.

Each is one op with one schedule of :mod:`totalreduce.algorithms.rooted`, named,
launched and returned as a :class:`~.handle.Handle` by :meth:`OpSubmitter._simple`.

Send/recv is the two-rank op of that module too: the k-th ``send`` from rank
``s`` to rank ``d`` with tag ``t`` meets the k-th ``recv`` on ``d`` from ``s``
with tag ``t``, because both name the op after ``(s, d, t)`` and names match
by generation, which is MPI's matching by (source, tag, order).  What the
schedule model cannot express is a receive from any source (the receiver would
have to know the name before the message says it), so ``recv`` needs ``src``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..algorithms.codes import OpKind
from ..dtypes import DType, ReduceOp
from ..errors import InvalidArgumentError
from ..group import Group
from . import checks, express
from .checks import as_array
from .handle import Handle
from .ops import compile_op
from .submit import OpSubmitter
from .thin import ThinHandle


def _int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InvalidArgumentError(f"{what} must be an int, got {value!r}")
    return int(value)


#: The keyword arguments a blocking repeat may be given and still take its record.
_PRIORITY = frozenset({"priority"})
_OP_PRIORITY = frozenset({"op", "priority"})


def _named(name: Any) -> bool:
    """Can a repeat under ``name`` take the express path (a str or int name)?"""
    return name.__class__ in (str, int)


def _root(op: str, root: Any, grp: Group) -> int:
    r = _int(root, f"{op} root")
    if not 0 <= r < grp.size:
        raise InvalidArgumentError(f"{op} root {r} outside 0..{grp.size - 1}")
    return r


def _writable(out: Any, dtype: np.dtype, size: int, what: str) -> np.ndarray:
    """``out`` checked to hold ``size`` elements of ``dtype`` (a new array for None)."""
    if out is None:
        return np.empty(size, dtype=dtype)
    o, _ = as_array(out, what, "bfloat16" if dtype == np.uint16 else None)
    if o.dtype != dtype or o.size != size:
        raise InvalidArgumentError(
            f"{what} has dtype {o.dtype} and {o.size} elements; expected {dtype} and {size}"
        )
    if not o.flags.writeable:
        raise InvalidArgumentError(f"{what} is read-only")
    return o


class RootedOps(OpSubmitter):
    """Reduce, gather, scatter, all-to-all and send/recv of a service."""

    def reduce_async(
        self,
        x: Any,
        root: int = 0,
        name: str | int | None = None,
        op: str | ReduceOp = "sum",
        out: Any = None,
        priority: int = 0,
        group: Group | None = None,
        dtype: str | None = None,
    ) -> Handle | ThinHandle:
        """Start reducing ``x`` of every rank into rank ``root``; ``wait()`` returns the
        result on the root and None elsewhere.

        ``op`` as for :meth:`allreduce_async`; ``out`` (the root's only) receives
        the result, ``out=x`` reduces in place.  With a ``group``, ``root`` is a
        rank of the group.
        """
        plain = out is None and group is None and dtype is None and root.__class__ is int
        if plain and name is not None:
            # A repeat of a shape this name had: the express path (service/express.py).
            ex = express.lookup(self._express, ("red", name, root, op, 0), x)
            if ex is not None:
                h = express.start(self, ex, name, x, None, priority)
                if h is not None:
                    return h
        arr, dt = as_array(x, "x", dtype)
        rop = checks.reduce_op(op, dt, "reduce")
        grp, me = self._group(group)
        r = _root("reduce", root, grp)
        if me == r:
            o, in_place = checks.output(arr, out)
            result: Any = o.reshape(arr.shape)
        else:
            o, in_place, result = np.empty(0, dtype=arr.dtype), False, None
        if self._thin is not None:
            # daemon mode: an allreduce on the thin path, its result kept on the root only
            if me != r:
                o, in_place = np.empty(arr.size, dtype=arr.dtype), False
            return self._thin_op(
                OpKind.ALLREDUCE, arr.reshape(-1), dt, o.reshape(-1), in_place, name, rop,
                priority, 0, result, group=grp, shown=OpKind.REDUCE,
            )  # fmt: skip
        code, sched = compile_op(
            OpKind.REDUCE, "direct", me, grp.size, int(arr.size), rop is ReduceOp.AVG,
            (("root", r),),
        )  # fmt: skip
        return self._simple(
            kind=OpKind.REDUCE, x=arr, dtype=dt, out=o, in_place=in_place, name=name, op=rop,
            priority=priority, group=grp, code=code, schedule=sched, param=r, result=result,
            express_key=(
                ("red", name, root, op, 0)
                if plain and arr is x and _named(name) and op.__class__ in (str, ReduceOp)
                else None
            ),
            express_result=True,
        )  # fmt: skip

    def _reduce_direct(self, x: Any, root: int = 0, name: str | int | None = None,
                       **kw: Any) -> Any:  # fmt: skip
        """The blocking ``reduce``: a repeat (``out``, ``group`` and ``dtype`` not given) is
        entered into the compiled lane and driven to its end in this call, with no handle
        (``express.run``); anything else is ``reduce_async(...).wait()``."""
        if name is not None and root.__class__ is int and kw.keys() <= _OP_PRIORITY:
            key = ("red", name, root, kw.get("op", "sum"), 0)
            ex = express.lookup(self._express, key, x)
            if ex is not None:
                got = express.run(self, ex, name, x, None, kw.get("priority", 0))
                if got is not express.MISSED:
                    return got
        return self.reduce_async(x, root, name, **kw).wait()

    def _gather_direct(self, x: Any, root: int = 0, name: str | int | None = None,
                       **kw: Any) -> Any:  # fmt: skip
        """The blocking ``gather``, as :meth:`_reduce_direct` is ``reduce``'s."""
        if name is not None and root.__class__ is int and kw.keys() <= _PRIORITY:
            ex = express.lookup(self._express, ("ga", name, root), x)
            if ex is not None:
                got = express.run(self, ex, name, x, None, kw.get("priority", 0))
                if got is not express.MISSED:
                    return got
        return self.gather_async(x, root, name, **kw).wait()

    def _scatter_direct(self, x: Any, root: int = 0, name: str | int | None = None,
                        **kw: Any) -> Any:  # fmt: skip
        """The blocking ``scatter``, as :meth:`_reduce_direct` is ``reduce``'s."""
        if name is not None and root.__class__ is int and kw.keys() <= _PRIORITY:
            ex = express.lookup(self._express, ("sc", name, root), x)
            if ex is not None:
                got = express.run(self, ex, name, x, None, kw.get("priority", 0))
                if got is not express.MISSED:
                    return got
        return self.scatter_async(x, root, name, **kw).wait()

    def _alltoall_direct(self, x: Any, name: str | int | None = None, **kw: Any) -> Any:
        """The blocking ``alltoall`` (equal parts, no ``out``, ``group`` or ``dtype``), as
        :meth:`_reduce_direct` is ``reduce``'s."""
        if name is not None and kw.keys() <= _PRIORITY:
            ex = express.lookup(self._express, ("a2a", name), x)
            if ex is not None:
                got = express.run(self, ex, name, x, None, kw.get("priority", 0))
                if got is not express.MISSED:
                    return got
        return self.alltoall_async(x, name, **kw).wait()

    def gather_async(
        self,
        x: Any,
        root: int = 0,
        name: str | int | None = None,
        out: Any = None,
        priority: int = 0,
        group: Group | None = None,
        dtype: str | None = None,
    ) -> Handle | ThinHandle:
        """Start gathering every rank's ``x`` on rank ``root``; ``wait()`` returns, on the
        root, an array of shape ``(P, *x.shape)`` (rank ``r``'s ``x`` at ``[r]``) and None
        elsewhere.

        Every rank passes the same shape and dtype; ``out`` (the root's only) holds
        ``P * x.size`` elements.
        """
        plain = out is None and group is None and dtype is None and root.__class__ is int
        if plain and name is not None:
            # A repeat of a shape this name had: the express path (service/express.py).
            ex = express.lookup(self._express, ("ga", name, root), x)
            if ex is not None:
                h = express.start(self, ex, name, x, None, priority)
                if h is not None:
                    return h
        arr, dt = as_array(x, "x", dtype)
        grp, me = self._group(group)
        r = _root("gather", root, grp)
        result: Any = None
        if me == r:
            o = _writable(out, arr.dtype, grp.size * arr.size, "out")
            result = o.reshape((grp.size, *arr.shape))
        else:
            o = np.empty(0, dtype=arr.dtype)
        if self._thin is not None:
            # daemon mode: an all-to-all on the thin path, every part to the root
            n, p = int(arr.size), grp.size
            sends = [n if j == r else 0 for j in range(p)]
            recvs = [n] * p if me == r else [0] * p
            return self._thin_op(
                OpKind.ALLTOALL, arr.reshape(-1), dt, o.reshape(-1), False, name, ReduceOp.SUM,
                priority, 0, result, group=grp, parts=(*sends, *recvs), shown=OpKind.GATHER,
                cut=p * arr.nbytes,
            )  # fmt: skip
        code, sched = compile_op(
            OpKind.GATHER, "direct", me, grp.size, int(arr.size), False, (("root", r),)
        )
        return self._simple(
            kind=OpKind.GATHER, x=arr, dtype=dt, out=o, in_place=False, name=name,
            op=ReduceOp.SUM, priority=priority, group=grp, code=code, schedule=sched, param=r,
            result=result,
            express_key=("ga", name, root) if plain and arr is x and _named(name) else None,
            express_result=True,
        )  # fmt: skip

    def scatter_async(
        self,
        x: Any,
        root: int = 0,
        name: str | int | None = None,
        out: Any = None,
        priority: int = 0,
        group: Group | None = None,
        dtype: str | None = None,
    ) -> Handle | ThinHandle:
        """Start scattering the root's ``x`` (``P`` equal parts along its first axis, or of
        its flat elements): ``wait()`` returns this rank's part.

        On the root ``x`` holds the data; on every other rank ``x`` is the
        receiving array (its shape and dtype say what comes; it is the result,
        as ``out=`` would be) unless ``out`` is given.  Every rank's part has the
        same number of elements.
        """
        plain = out is None and group is None and dtype is None and root.__class__ is int
        if plain and name is not None:
            # A repeat of a shape this name had: the express path (service/express.py).
            ex = express.lookup(self._express, ("sc", name, root), x)
            if ex is not None:
                h = express.start(self, ex, name, x, None, priority)
                if h is not None:
                    return h
        arr, dt = as_array(x, "x", dtype)
        grp, me = self._group(group)
        r = _root("scatter", root, grp)
        if me == r:
            if arr.size % grp.size:
                raise InvalidArgumentError(
                    f"scatter: the root's x has {arr.size} elements, not a multiple of the "
                    f"{grp.size} ranks"
                )
            n = arr.size // grp.size
            shape = arr.shape[1:] if arr.ndim > 1 and arr.shape[0] == grp.size else (n,)
            o = _writable(out, arr.dtype, n, "out")
            src = arr
        else:  # x (or out) is where this rank's part lands
            what = "x" if out is None else "out"
            target = arr if out is None else as_array(out, "out", dtype)[0]
            o = _writable(target, arr.dtype, int(target.size), what)
            n, shape, src = int(o.size), target.shape, np.empty(0, dtype=arr.dtype)
        if self._thin is not None:
            # daemon mode: an all-to-all on the thin path, a part from the root to each
            p = grp.size
            sends = [n] * p if me == r else [0] * p
            recvs = [n if j == r else 0 for j in range(p)]
            return self._thin_op(
                OpKind.ALLTOALL, src.reshape(-1), dt, o.reshape(-1), False, name, ReduceOp.SUM,
                priority, 0, o.reshape(shape), group=grp, parts=(*sends, *recvs),
                shown=OpKind.SCATTER, cut=p * n * arr.itemsize,
            )  # fmt: skip
        code, sched = compile_op(OpKind.SCATTER, "direct", me, grp.size, n, False, (("root", r),))
        return self._simple(
            kind=OpKind.SCATTER, x=src, dtype=dt, out=o, in_place=False, name=name,
            op=ReduceOp.SUM, priority=priority, group=grp, code=code, schedule=sched, param=r,
            result=o.reshape(shape), count=n,
            express_key=(
                ("sc", name, root) if plain and arr is x and arr.size and _named(name) else None
            ),
            express_array=arr, express_result=True, express_into_x=me != r,
        )  # fmt: skip

    def alltoall_async(
        self,
        x: Any,
        name: str | int | None = None,
        splits: Sequence[int] | None = None,
        recv_splits: Sequence[int] | None = None,
        out: Any = None,
        priority: int = 0,
        group: Group | None = None,
        dtype: str | None = None,
    ) -> Handle | ThinHandle:
        """Start an all-to-all: part ``j`` of ``x`` goes to rank ``j``, and part ``j`` of the
        result comes from rank ``j``; ``wait()`` returns the flat result.

        Without ``splits`` the parts are equal (``x.size / P`` elements each).
        ``splits[j]`` / ``recv_splits[j]`` give the elements sent to / received
        from rank ``j`` (torch's ``all_to_all_single`` input and output split
        sizes); the two ranks of each pair must agree, or both fail naming the
        counts.  ``out=x`` works (the input is copied first).
        """
        plain = (
            splits is None and recv_splits is None and out is None and group is None
            and dtype is None
        )  # fmt: skip
        if plain and name is not None:
            # A repeat of a shape this name had: the express path (service/express.py).
            ex = express.lookup(self._express, ("a2a", name), x)
            if ex is not None:
                h = express.start(self, ex, name, x, None, priority)
                if h is not None:
                    return h
        arr, dt = as_array(x, "x", dtype)
        grp, me = self._group(group)
        p = grp.size
        if splits is None:
            if arr.size % p:
                raise InvalidArgumentError(
                    f"alltoall: x has {arr.size} elements, not a multiple of the {p} ranks; "
                    "pass splits="
                )
            send = [arr.size // p] * p
        else:
            send = [_int(v, "alltoall splits entry") for v in splits]
        recv = send if recv_splits is None else [_int(v, "recv_splits entry") for v in recv_splits]
        for what, sizes in (("splits", send), ("recv_splits", recv)):
            if len(sizes) != p or any(v < 0 for v in sizes):
                raise InvalidArgumentError(f"alltoall {what} must be {p} counts >= 0, got {sizes}")
        if sum(send) != arr.size:
            raise InvalidArgumentError(
                f"alltoall splits {send} add up to {sum(send)}, but x has {arr.size} elements"
            )
        if send[me] != recv[me]:
            raise InvalidArgumentError(
                f"alltoall: rank {self.rank} sends itself {send[me]} elements (splits) but "
                f"expects {recv[me]} (recv_splits)"
            )
        total = sum(recv)
        if out is None:
            o, in_place = np.empty(total, dtype=arr.dtype), False
        else:
            o = _writable(out, arr.dtype, total, "out")
            in_place = o.ctypes.data == arr.ctypes.data and o.nbytes == arr.nbytes
            if not in_place and np.shares_memory(o, arr):
                raise InvalidArgumentError("out overlaps x without being the same array")
        equal = splits is None and recv_splits is None
        thin = self._thin
        # Uneven parts: no rank knows the others' sizes, so none is cut (one too large for
        # its part of the arena raises there); equal ones are cut by their size if large.
        if thin is not None:
            # daemon mode: the node's service runs it (service/thin.py)
            return self._thin_op(
                OpKind.ALLTOALL, arr.reshape(-1), dt, o, in_place, name, ReduceOp.SUM, priority,
                0, o.reshape(arr.shape) if equal and out is None else o, group=grp,
                parts=(*send, *recv), cut=max(arr.nbytes, o.nbytes) if equal else 0,
            )  # fmt: skip
        result = o.reshape(arr.shape) if equal and out is None else o
        return self._alltoall(
            arr, dt, o, in_place, name, priority, grp, send, recv, result, equal,
            express_key=("a2a", name) if plain and arr is x and _named(name) else None,
        )  # fmt: skip

    def _alltoall(
        self, arr: np.ndarray, dt: DType, o: np.ndarray, in_place: bool, name: str | int | None,
        priority: Any, grp: Group, send: list[int], recv: list[int], result: Any, equal: bool,
        passive: bool = False, express_key: tuple[Any, ...] | None = None,
    ) -> Handle:  # fmt: skip
        """The engine's all-to-all of checked arguments; ``passive``: it may wait for ever
        (a node's service's part of a window's standing receive: no stall warnings)."""
        me = grp.rank_of(self.rank)
        assert me is not None
        code, sched = compile_op(
            OpKind.ALLTOALL, "direct", me, grp.size, int(arr.size), False,
            (("split", tuple(send)), ("recv_split", tuple(recv))),
        )  # fmt: skip
        # Equal parts: every rank has the same count.  Uneven ones: each pair's
        # frames are checked against the receive they fill instead.
        return self._simple(
            kind=OpKind.ALLTOALL, x=arr, dtype=dt, out=o, in_place=in_place, name=name,
            op=ReduceOp.SUM, priority=priority, group=grp, code=code, schedule=sched,
            param=0 if equal else 1, result=result, count=int(arr.size) if equal else 0,
            passive=passive, express_key=express_key, express_result=True,
        )  # fmt: skip

    def _p2p(self, what: str, peer: Any, tag: Any, sending: bool) -> tuple[int, str, Group]:
        """The sender, the op name and the two-rank group of a message."""
        peer_rank = _int(peer, f"{what} {'dst' if sending else 'src'}")
        t = _int(tag, f"{what} tag")
        if not 0 <= peer_rank < self.size:
            raise InvalidArgumentError(f"{what}: rank {peer_rank} outside 0..{self.size - 1}")
        if peer_rank == self.rank:
            raise InvalidArgumentError(f"{what}: rank {self.rank} cannot {what} to itself")
        src, dst = (self.rank, peer_rank) if sending else (peer_rank, self.rank)
        return src, f"send {src}->{dst} tag {t}", Group(sorted((src, dst)))

    def send_async(
        self, x: Any, dst: int, tag: int = 0, priority: int = 0, dtype: str | None = None
    ) -> Handle | ThinHandle:
        """Start sending ``x`` to rank ``dst`` with ``tag``; ``wait()`` returns None once
        the matching receive is posted there and ``x`` may be reused (a synchronous
        send, ``MPI_Ssend``'s rule: two ranks that both send before they receive
        wait for each other; use the ``_async`` forms for exchanges).

        The k-th send to ``dst`` with ``tag`` meets the k-th :meth:`recv` there from
        this rank with ``tag`` (MPI's order); the receiver's array must have the
        same number of elements and dtype, or both raise naming the two.
        """
        arr, dt = as_array(x, "x", dtype)
        src, name, grp = self._p2p("send", dst, tag, True)
        return self._point(arr, np.empty(0, dtype=arr.dtype), dt, grp, src, name, priority, None)

    def recv_async(
        self, x: Any, src: int, tag: int = 0, priority: int = 0, dtype: str | None = None
    ) -> Handle | ThinHandle:
        """Start receiving from rank ``src`` with ``tag`` into ``x``; ``wait()`` returns ``x``.

        ``src`` must be given: a receive from any source has no place in the
        name-and-generation matching (see the module docstring).
        """
        arr, dt = as_array(x, "x", dtype)
        if not arr.flags.writeable:
            raise InvalidArgumentError("recv: x is read-only")
        s, name, grp = self._p2p("recv", src, tag, False)
        empty = np.empty(0, dtype=arr.dtype)
        return self._point(empty, arr.reshape(-1), dt, grp, s, name, priority, arr)

    def _point(
        self,
        x: np.ndarray,
        o: np.ndarray,
        dt: DType,
        grp: Group,
        src: int,
        name: str,
        priority: Any,
        result: Any,
        passive: bool = False,
    ) -> Handle | ThinHandle:
        """A message from ``src`` to the other rank of ``grp``.  ``passive``: a window's
        standing receive, which may wait for ever.  In daemon mode it takes the thin path
        (in pieces if large)."""
        n = int(max(x.size, o.size))
        me = grp.rank_of(self.rank)
        assert me is not None
        sender = grp.rank_of(src)
        code, sched = compile_op(OpKind.SEND_RECV, "direct", me, 2, n, False, (("sender", sender),))
        self._check_open()
        checks.priority(priority)  # before the name: a refused call must not use a generation
        # Consecutive messages on one tag may differ in size: no signature to keep.
        reserved = self._names.name(name, ("send_recv", "", 0, "", 0))
        if self._thin is not None:
            # daemon mode: a two-rank all-to-all on the thin path (in pieces if large)
            sends = [x.size if j != sender else 0 for j in range(2)] if me == sender else [0, 0]
            recvs = [o.size if j == sender else 0 for j in range(2)] if me != sender else [0, 0]
            return self._thin_op(
                OpKind.ALLTOALL, x.reshape(-1), dt, o, False, name, ReduceOp.SUM, priority, 0,
                result, group=grp, parts=(*sends, *recvs), reserved=reserved,
                shown=OpKind.SEND_RECV, passive=passive, cut=n * x.itemsize,
            )  # fmt: skip
        return self._simple(
            kind=OpKind.SEND_RECV, x=x, dtype=dt, out=o, in_place=False, name=None,
            op=ReduceOp.SUM, priority=priority, group=grp, code=code, schedule=sched,
            result=result, reserved=reserved, count=n, passive=passive,
        )  # fmt: skip

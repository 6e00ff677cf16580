"""Submission: turn a checked, named, compiled op into an engine op and queue it.

:class:`OpSubmitter` is the base of the service's op families
(:mod:`.collectives`, :mod:`.partitions`, :mod:`.neighbors`): it holds what
they share (the configuration, the comm loop, the name table, the world
group) and builds the :class:`~totalreduce.lane.payload.OpSpec` of an op.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from ..algorithms.codes import AlgorithmCode, OpKind
from ..algorithms.schedule import Schedule
from ..dtypes import DType, ReduceOp
from ..engine.loop import CommLoop
from ..engine.wire import wire_id
from ..errors import InvalidArgumentError, NotInitializedError, TotalReduceError
from ..group import Group
from ..lane.payload import OpSpec
from ..transport.base import Transport
from . import checks, chunks
from .config import Config
from .handle import Handle
from .names import NameTable
from .ops import alias_for, plan_for
from .thin import ThinClient, ThinHandle

#: (type, name, salt) -> wire id; the type keeps the name 1 apart from True and "1".
_WIRE_IDS: dict[tuple[type, str | int, int], int] = {}


class OpSubmitter:
    """What every op family of a service shares; :class:`~.service.Service` sets it up."""

    config: Config
    transport: Transport
    rank: int
    size: int
    #: The engine's loop once started (embedded mode; a daemon client runs none), else None.
    _loop: CommLoop | None
    _start_engine: Callable[[], CommLoop]
    _names: NameTable
    _world_group: Group
    _salt: int
    _express: dict[tuple[Any, ...], Any]
    _closed: bool
    _stop: threading.Event
    #: Daemon mode: the thin path to the node's service (every op), else None.
    _thin: ThinClient | None

    @property
    def loop(self) -> CommLoop:
        """The engine's loop (started here if it was not yet: a daemon client's)."""
        lp = self._loop
        return lp if lp is not None else self._start_engine()

    def _check_open(self) -> None:
        if self._closed:
            raise NotInitializedError("totalreduce was shut down; call init() again to use it")
        thin = self._thin
        if thin is not None:
            thin.raise_late()  # an op that completed here failed elsewhere
        lp = self._loop
        if lp is None:
            return
        if lp.fatal is not None:
            raise TotalReduceError(f"the comm thread stopped: {lp.fatal}")
        late = lp.late_errors
        if late and self._raise_late:
            # An op this rank finished failed elsewhere: its result may be wrong.
            raise late.popleft()

    def _wire_id(self, name: str | int) -> int:
        """The op's id on the wire (remembered per name: a hash per op costs a frame)."""
        ids = _WIRE_IDS
        key = (name.__class__, name, self._salt)
        wid = ids.get(key)
        if wid is None:
            wid = wire_id(name) ^ self._salt
            if len(ids) >= 65536:
                ids.clear()
            ids[key] = wid
        return wid

    def _group(self, group: Group | None) -> tuple[Group, int]:
        """The group an op runs over and this rank's rank in it."""
        return checks.group_of(group, self._world_group, self.rank)

    def _spec(
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
        count: int | None = None,
    ) -> OpSpec:
        """The engine's description of a named, compiled op (any thread may call this).

        ``count`` is the count every rank's frames carry (the ranks must agree on
        it); by default the input's size (the output's for an all-gather).
        """
        if count is None:
            # All-gather-v inputs differ per rank; the whole output does not.
            count = int(out.size) if kind is OpKind.ALLGATHER else int(x.size)
        seg = max(1, self.config.segment_bytes // dtype.itemsize)
        if in_place:
            aliased = alias_for(schedule)
            if aliased is not None:
                schedule = aliased
        return OpSpec(
            name=name,
            wire_id=self._wire_id(name),
            generation=generation,
            kind=kind,
            algorithm=code,
            dtype=dtype,
            count=count,
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

    def _submit(self, spec: OpSpec, handle: Handle | None = None) -> None:
        """Queue an op for the comm thread (any thread may call this)."""
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
        count: int | None = None,
        passive: bool = False,
        express_key: tuple[Any, ...] | None = None,
        express_array: np.ndarray | None = None,
        express_sig: tuple[Any, ...] | None = None,
        express_result: bool = False,
        express_into_x: bool = False,
    ) -> Handle:
        """Name (unless ``reserved`` already), launch and return the handle of a one-phase op.

        ``express_key``: keep an express record under it (``service/express.py``); its name's
        signature ``express_sig`` where the name is ``reserved``; ``express_result``: a
        repeat's new result takes ``result``'s shape (else the kind says it);
        ``express_into_x``: a scatter's receiver (its ``x`` is the output)."""
        self._check_open()
        prio = checks.priority(priority)
        if reserved is None:
            sig = (kind.name.lower(), dtype.name.lower(), int(x.size), op.name.lower(), param)
            op_name, gen = self._names.name(name, sig)
        else:
            op_name, gen = reserved
        handle = Handle(op_name, gen, result, self.loop, finalize)
        handle._names = self._names
        spec = self._spec(
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
            on_done=handle._ended,
            count=count,
        )
        spec.passive = passive
        if express_key is not None and (reserved is None or express_sig is not None):
            from . import express  # repeats take the express path

            # the record keeps the caller's array's shape (``x`` may be its flat view)
            express.remember(
                self, express_key, spec, x if express_array is None else express_array,
                sig if express_sig is None else express_sig,
                result if express_result else express.BY_KIND, express_into_x,
            )  # fmt: skip
        self._submit(spec, handle)
        return handle

    def _thin_op(
        self,
        kind: OpKind,
        x: np.ndarray,
        dtype: DType,
        out: np.ndarray,
        in_place: bool,
        name: str | int | None,
        op: ReduceOp,
        priority: Any,
        root: int,
        result: Any,
        *,
        group: Group | None = None,
        parts: tuple[int, ...] | None = None,
        finalize: Callable[[], Any] | None = None,
        reserved: tuple[str | int, int] | None = None,
        handle: ThinHandle | None = None,
        shown: OpKind | None = None,
        algorithm: AlgorithmCode = AlgorithmCode.NONE,
        passive: bool = False,
        wire: int | None = None,
        cut: int = 0,
    ) -> ThinHandle:
        """Name an op and hand it to the node's service through the arena (daemon mode).

        The buffers the service works on: the output itself if it lives in the arena
        (the input too, or a copy of it in the output), else a staging block of the
        client's part of the arena that the result is copied out of.  A reduce-scatter
        or all-gather (``parts``: elements per group rank) places its input and output
        apart.  ``group`` (None: the world) and ``parts`` travel as blocks of the arena
        the client keeps.  ``reserved`` is a name already taken, ``handle`` a handle
        already returned to the caller (an all-gather whose sizes came first); ``shown``
        the kind its errors name (a gather that runs as an all-to-all); ``algorithm`` the
        one the services run it by among the nodes (NONE: theirs to choose); ``passive``
        marks a window's standing receive.  An allreduce, broadcast, reduce-scatter or
        all-gather too large for the arena runs as pieces (:mod:`.chunks`), each given its
        ``wire`` id; an all-to-all too, if ``cut`` (bytes) names the size that decides,
        one every rank of the op knows alike.
        """
        self._check_open()
        thin = self._thin
        assert thin is not None
        prio = checks.priority(priority)
        if reserved is None:
            sig = (kind.name.lower(), dtype.name.lower(), int(x.size), op.name.lower(), root)
            op_name, gen = self._names.name(name, sig)
        else:
            op_name, gen = reserved
        if wire is None and kind in chunks.CUT:
            pieces = thin.pieces(chunks.shared_bytes(kind, x, parts, cut))
            if pieces > 1:
                return chunks.run(self, pieces, {
                    "kind": kind, "x": x, "dtype": dtype, "out": out, "in_place": in_place,
                    "name": name, "op": op, "priority": priority, "root": root,
                    "result": result, "group": group, "parts": parts, "finalize": finalize,
                    "reserved": (op_name, gen), "handle": handle, "shown": shown,
                    "algorithm": algorithm, "passive": passive,
                })  # fmt: skip
        names = self._names
        blocks: list[int] = []
        try:
            back = None
            grp = self._world_group if group is None else group
            at_group, ctx = -1, 0
            if grp is not self._world_group:
                at_group, own = thin.const_block((grp.size, *grp.ranks))
                ctx = grp.context
                if own >= 0:
                    blocks.append(own)
            at_aux = -1
            if kind is OpKind.BARRIER:
                at_in = at_out = -1
            elif parts is not None:  # reduce-scatter, all-gather: input and output apart
                need = sum(a.nbytes for a in (x, out) if thin.arena.offset_of(a) < 0)
                if need > thin.arena.data_bytes:
                    raise InvalidArgumentError(
                        f"{kind.name.lower()} {op_name!r}: its {need} bytes of staging do not "
                        f"fit this client's {thin.arena.data_bytes} bytes of the node's arena "
                        "(start the service with a larger --arena-bytes)"
                    )
                at_aux, own = thin.const_block((len(parts), *parts))
                if own >= 0:
                    blocks.append(own)
                at_in, staged = thin.place(x, fill=x)
                if staged >= 0:
                    blocks.append(staged)
                at_out, staged = thin.place(out, fill=None)
                if staged >= 0:
                    blocks.append(staged)
                    back = out
            else:
                receiver = kind is OpKind.BROADCAST and self.rank != grp.ranks[root]
                at_out, staged = thin.place(out, fill=None if receiver else x)
                if staged >= 0:  # the result is copied out of the staging block
                    blocks.append(staged)
                    back = out
                    at_in = at_out
                elif in_place or receiver:
                    at_in = at_out
                else:
                    at_in = thin.arena.offset_of(x) if x.flags.c_contiguous else -1
                    if at_in < 0:
                        out.reshape(-1)[:] = x.reshape(-1)
                        at_in = at_out
        except BaseException:
            for at in blocks:
                thin.space.free(at)
            if handle is None:  # else ending the handle ends the name
                names.ended(op_name)
            raise
        if handle is None:
            handle = ThinHandle(
                thin, op_name, gen, shown or kind, result, lambda: names.ended(op_name)
            )
        handle.hold(tuple(blocks), back, at_out if back is not None else -1, finalize)
        return thin.submit(
            handle,
            wire=self._wire_id(op_name) if wire is None else wire,
            dtype=dtype,
            count=int(x.size),
            op=op,
            root=root,
            priority=prio,
            at_in=at_in,
            at_out=at_out,
            unnamed=name is None,
            group=at_group,
            context=ctx,
            aux=at_aux,
            kind=kind,
            algorithm=int(algorithm),
            passive=passive,
        )

"""Neighbor ops on a virtual topology: averaging, all-gather, and node-then-machine averaging.

The topology and its weights come from :mod:`.weights`; the schedules from
:mod:`totalreduce.algorithms.neighbor`.  ``step`` defaults to the op's
generation, so calling an op every iteration with the same name walks a
dynamic topology by itself.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..algorithms.codes import AlgorithmCode, OpKind
from ..algorithms.schedule import Schedule
from ..dtypes import DType, ReduceOp
from ..errors import InvalidArgumentError
from ..group import Group
from ..kernels import axpy_into, copy_into, scale_into
from ..lane.payload import OpSpec
from . import checks, express
from .checks import as_array
from .handle import Handle
from .ops import cached_edge, cached_neighbor_allgather, cached_neighbor_allreduce, compile_op
from .submit import OpSubmitter
from .thin import ThinHandle
from .weights import (
    DEFAULT_TOPOLOGY,
    edge_topology,
    graph_weights,
    neighbor_ranks,
    neighbor_weights,
    resolve_topology,
    static_graph,
)


class NeighborOps(OpSubmitter):
    """Neighbor averaging, neighbor all-gather and hierarchical averaging of a service."""

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
    ) -> Handle | ThinHandle:
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
        key = None
        if name is not None and step is None and dtype is None:
            # A repeat of a shape this name had: the express path (service/express.py).
            key = _neighbor_key(name, topology, out is x, self_weight, src_weights, dst_weights)
            if key is not None:
                ex = express.lookup(self._express, key, x)
                if ex is not None:
                    h = express.start(self, ex, name, x, out, priority)
                    if h is not None:
                        return h
        arr, dt = as_array(x, "x", dtype)
        checks.floating(dt)
        self._check_open()
        prio = checks.priority(priority)
        o, in_place = checks.output(arr, out)
        n = int(arr.size)
        edge_topo = None
        if topology is not None and not any(v is not None for v in (self_weight, src_weights)):
            topology = resolve_topology(topology, self.size)
            if edge_topology(topology):
                edge_topo = topology
        op_name, gen = self._names.name(name, ("neighbor_allreduce", dt.name.lower(), n, "avg", 0))
        t = gen if step is None else int(step)
        try:
            if edge_topo is not None:
                edge = edge_topo.edge_of(self.rank, t)
                grp = (
                    self._world_group if len(edge.ranks) == self.size else Group(sorted(edge.ranks))
                )
                me = grp.rank_of(self.rank)
                assert me is not None
                sched = cached_edge(me, grp.size, n, float(edge.weight))
                code = AlgorithmCode.EDGE
                if self._thin is not None:
                    # daemon mode: a sum over the edge's group on the thin path, then
                    # Decent-DP's rule: w x + (1 - w) / (k - 1) * (the others' sum)
                    return self._thin_edge(arr, dt, o, in_place, name, (op_name, gen), prio,
                                           grp, float(edge.weight))  # fmt: skip
            else:
                sw, src, dst = neighbor_weights(
                    self.rank, self.size, topology, t, self_weight, src_weights, dst_weights
                )
                sched = cached_neighbor_allreduce(
                    self.rank, self.size, n, float(sw), tuple(src.items()), tuple(dst.items())
                )
                grp = self._world_group
                code = AlgorithmCode.NEIGHBOR
                if self._thin is not None:
                    # daemon mode: an all-to-all on the thin path moves the scaled copies
                    return self._thin_exchange(
                        arr, dt, o, in_place, name, (op_name, gen), prio, src, dst, sw
                    )
        except (ValueError, TypeError) as exc:
            self._names.ended(op_name)
            raise InvalidArgumentError(f"neighbor_allreduce {op_name!r} step {t}: {exc}") from None
        # A record where the schedule is the same at every step: a static graph's, or the
        # weights given with their destinations (the topology and step then play no part).
        if key is not None and (
            arr is not x
            or name.__class__ not in (str, int)
            or edge_topo is not None
            or not (
                (src_weights is not None and dst_weights is not None)
                or static_graph(topology or DEFAULT_TOPOLOGY, self.size)
            )
        ):
            key = None
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
            express_key=key,
            express_sig=("neighbor_allreduce", dt.name.lower(), n, "avg", 0),
            express_result=True,
        )

    def _neighbor_allreduce_direct(self, x: Any, name: str | int | None = None,
                                   **kw: Any) -> Any:  # fmt: skip
        """The blocking ``neighbor_allreduce``: a repeat the compiled lane runs is entered
        and driven to its end in this call, with no handle (``express.run``); anything
        else is ``neighbor_allreduce_async(...).wait()``."""
        if name is not None and kw.keys() <= _NAR_KW:
            get = kw.get
            if get("step") is None and get("dtype") is None:
                out = get("out")
                key = _neighbor_key(
                    name, get("topology"), out is x, get("self_weight"), get("src_weights"),
                    get("dst_weights"),
                )  # fmt: skip
                ex = None if key is None else express.lookup(self._express, key, x)
                if ex is not None:
                    got = express.run(self, ex, name, x, out, get("priority", 0))
                    if got is not express.MISSED:
                        return got
        return self.neighbor_allreduce_async(x, name, **kw).wait()

    def _neighbor_allgather_direct(self, x: Any, name: str | int | None = None,
                                   **kw: Any) -> Any:  # fmt: skip
        """The blocking ``neighbor_allgather``, as :meth:`_neighbor_allreduce_direct` is
        ``neighbor_allreduce``'s."""
        if name is not None and kw.keys() <= _NAG_KW:
            get = kw.get
            if get("step") is None and get("dtype") is None:
                key = _neighbor_key(
                    name, get("topology"), False, None, get("src_ranks"), get("dst_ranks"), "nag"
                )
                ex = None if key is None else express.lookup(self._express, key, x)
                if ex is not None:
                    got = express.run(self, ex, name, x, None, get("priority", 0))
                    if got is not express.MISSED:
                        return got
        return self.neighbor_allgather_async(x, name, **kw).wait()

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
    ) -> Handle | ThinHandle:
        """Gather the ``x`` of every in-neighbor: shape ``(len(sources), *x.shape)``.

        Sources are in ascending rank order; they come from ``topology`` at
        ``step`` (default: this op's generation), or from ``src_ranks`` and
        ``dst_ranks`` given per call.  All ranks pass arrays of the same shape.
        """
        key = None
        if name is not None and step is None and dtype is None:
            # A repeat of a shape this name had: the express path (service/express.py).
            key = _neighbor_key(name, topology, False, None, src_ranks, dst_ranks, "nag")
            if key is not None:
                ex = express.lookup(self._express, key, x)
                if ex is not None:
                    h = express.start(self, ex, name, x, None, priority)
                    if h is not None:
                        return h
        arr, dt = as_array(x, "x", dtype)
        self._check_open()
        prio = checks.priority(priority)
        n = int(arr.size)
        op_name, gen = self._names.name(name, ("neighbor_allgather", dt.name.lower(), n, "sum", 0))
        t = gen if step is None else int(step)
        try:
            src, dst = neighbor_ranks(self.rank, self.size, topology, t, src_ranks, dst_ranks)
            sched = cached_neighbor_allgather(self.rank, self.size, n, tuple(src), tuple(dst))
        except (ValueError, TypeError, InvalidArgumentError) as exc:
            self._names.ended(op_name)
            raise InvalidArgumentError(f"neighbor_allgather {op_name!r} step {t}: {exc}") from None
        out = np.empty(len(src) * n, dtype=arr.dtype)
        if self._thin is not None:
            # daemon mode: an all-to-all on the thin path
            return self._thin_exchange(
                arr, dt, out, False, name, (op_name, gen), prio, dict.fromkeys(src, 1.0),
                dict.fromkeys(dst, 1.0), None,
            )  # fmt: skip
        if key is not None and (  # as neighbor_allreduce_async keeps its record
            arr is not x
            or name.__class__ not in (str, int)
            or not (
                (src_ranks is not None and dst_ranks is not None)
                or static_graph(topology or DEFAULT_TOPOLOGY, self.size)
            )
        ):
            key = None
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
            express_key=key,
            express_sig=("neighbor_allgather", dt.name.lower(), n, "sum", 0),
            express_result=True,
        )

    def _thin_exchange(
        self,
        arr: np.ndarray,
        dt: DType,
        out: np.ndarray,
        in_place: bool,
        name: str | int | None,
        reserved: tuple[str | int, int],
        priority: int,
        src: dict[int, float],
        dst: dict[int, float],
        self_weight: float | None,
        handle: ThinHandle | None = None,
    ) -> ThinHandle:
        """A neighbor op as an all-to-all on the thin path (daemon mode): this rank's input,
        scaled by each destination's weight, to every destination; a block from every
        source.  ``self_weight`` None: a neighbor all-gather (``out`` gets the blocks, in
        source order); else ``out`` = ``self_weight * x + sum(src[s] * block of s)``.
        One too large for the arena is cut into pieces alike on every rank: by its input
        times ``P - 1``, the most neighbors any rank may have, not its own."""
        n = int(arr.size)
        flat = arr.reshape(-1)
        dsts, srcs = sorted(dst), sorted(src)
        send = np.empty(len(dsts) * n, dtype=arr.dtype)
        for i, r in enumerate(dsts):
            piece = send[i * n : (i + 1) * n]
            copy_into(piece, flat, dt)
            if dst[r] != 1.0:
                scale_into(piece, dst[r], dt)
        sends = [n if r in dst else 0 for r in range(self.size)]
        recvs = [n if r in src else 0 for r in range(self.size)]
        if self_weight is None:
            result: Any = out.reshape((len(srcs), *arr.shape))
            got = out.reshape(-1)
            finalize = None
        else:
            got = np.empty(len(srcs) * n, dtype=arr.dtype)
            mine = flat.copy() if in_place else flat  # out may be x

            def finalize() -> Any:
                o = out.reshape(-1)
                copy_into(o, mine, dt)
                scale_into(o, self_weight, dt)
                for i, r in enumerate(srcs):
                    axpy_into(o, got[i * n : (i + 1) * n], src[r], dt)
                return out.reshape(arr.shape)

            result = None
        return self._thin_op(
            OpKind.ALLTOALL, send, dt, got, False, name, ReduceOp.SUM, priority, 0, result,
            parts=(*sends, *recvs), finalize=finalize, reserved=reserved, handle=handle,
            shown=OpKind.NEIGHBOR_ALLGATHER if self_weight is None else OpKind.NEIGHBOR_ALLREDUCE,
            cut=max(self.size - 1, 1) * arr.nbytes,
        )  # fmt: skip

    def _thin_edge(
        self,
        arr: np.ndarray,
        dt: DType,
        out: np.ndarray,
        in_place: bool,
        name: str | int | None,
        reserved: tuple[str | int, int],
        priority: int,
        grp: Group,
        weight: float,
        handle: ThinHandle | None = None,
    ) -> ThinHandle:
        """Decent-DP's edge averaging on the thin path: the edge's sum, then its rule."""
        flat = arr.reshape(-1)
        mine = flat.copy() if in_place else flat
        k = grp.size

        def finalize() -> Any:
            o = out.reshape(-1)
            if k > 1:
                b = (1.0 - weight) / (k - 1)
                scale_into(o, b, dt)
                axpy_into(o, mine, weight - b, dt)
            return out.reshape(arr.shape)

        return self._thin_op(
            OpKind.ALLREDUCE, flat, dt, out.reshape(-1), in_place, name, ReduceOp.SUM, priority,
            0, None, group=grp, finalize=finalize, reserved=reserved, handle=handle,
            shown=OpKind.NEIGHBOR_ALLREDUCE,
        )  # fmt: skip

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
    ) -> Handle | ThinHandle:
        """Average within each node, then with neighbor nodes on a machine topology.

        Ranks ``node * local_size .. node * local_size + local_size - 1`` form a
        node.  Phase 1 averages over the node (an allreduce over its group);
        phase 2 averages node results over ``topology``, a topology of the
        ``size // local_size`` nodes (name or object; default ``exponential-2``):
        local rank ``l`` of a node exchanges with local rank ``l`` of its neighbor
        nodes, so every link of a node is used in parallel and every rank ends
        with its node's averaged result.

        Or BlueFog's machine weights, given per call instead of a topology's:
        ``self_weight`` for the node's own average, ``src_machine_weights``
        (``{node: weight}``) for the nodes it receives from and
        ``dst_machine_weights`` (``{node: weight}`` scaling what it sends, or a
        list of nodes): all three, as :meth:`neighbor_allreduce_async` takes
        ranks.  Every rank of a node must pass the same.

        Both phases are compiled and submitted here, in the caller's thread (a
        bad topology raises at the call), as a chain: the engine starts the
        machine phase, whose input is the node phase's output, when the node
        phase completes, and fails it if the node phase fails.
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
        checks.floating(dt)
        self._check_open()
        prio = checks.priority(priority)
        o, in_place = checks.output(arr, out)
        n = int(arr.size)
        L = int(local_size)
        node, local = divmod(self.rank, L)
        local_grp = Group(range(node * L, node * L + L))
        given = (self_weight, src_machine_weights, dst_machine_weights)
        if any(v is not None for v in given):
            if any(v is None for v in given):
                raise InvalidArgumentError(
                    "hierarchical_neighbor_allreduce: give self_weight, src_machine_weights "
                    "and dst_machine_weights together, or none of them (got "
                    f"self_weight={self_weight!r}, src_machine_weights={src_machine_weights!r}, "
                    f"dst_machine_weights={dst_machine_weights!r})"
                )
            if topology is not None:
                raise InvalidArgumentError(
                    "hierarchical_neighbor_allreduce: machine weights replace the topology; "
                    "pass one or the other"
                )
            machine_topo: Any = (self_weight, src_machine_weights, dst_machine_weights)
        else:
            machine_topo = resolve_topology(topology or DEFAULT_TOPOLOGY, self.size // L)
        names = self._names
        op_name, gen = names.name(name, ("hierarchical", dt.name.lower(), n, "avg", L))
        local_name, local_gen = names.name(
            f"{op_name}#node", ("allreduce", dt.name.lower(), n, "avg", 0)
        )
        t = gen if step is None else int(step)
        try:
            grp, code, sched = self._machine_phase(machine_topo, L, t, n)
        except Exception as exc:  # a bad topology fails the call, with the op's name
            names.ended(local_name)
            names.ended(op_name)
            raise InvalidArgumentError(f"hierarchical {op_name!r}: {exc}") from None
        mid = np.empty(n, dtype=arr.dtype)
        if self._thin is not None:
            # daemon mode: both phases on the thin path, the second submitted (by the thin
            # client's watcher thread) when the first has completed
            return self._thin_hierarchical(
                arr, dt, o, mid, name, (op_name, gen), (local_name, local_gen), prio,
                local_grp, machine_topo, L, t,
            )  # fmt: skip
        handle = Handle(op_name, gen, o.reshape(arr.shape), self.loop)

        def machine_done(error: BaseException | None) -> None:
            names.ended(op_name)
            handle._finish(error)

        machine: OpSpec = self._spec(
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
        )

        def local_done(error: BaseException | None) -> None:
            names.ended(local_name)  # the machine phase starts (or fails) in the engine

        code, sched = compile_op(OpKind.ALLREDUCE, "ring", local, L, n, True)
        node_phase = self._spec(
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
        )
        machine.after = node_phase.key  # a chain: it reads what the node phase wrote
        self._submit(node_phase, handle)
        self._submit(machine)
        return handle

    def _thin_hierarchical(
        self,
        arr: np.ndarray,
        dt: DType,
        o: np.ndarray,
        mid: np.ndarray,
        name: str | int | None,
        reserved: tuple[str | int, int],
        local: tuple[str | int, int],
        priority: int,
        local_grp: Group,
        machine_topo: Any,
        L: int,
        step: int,
    ) -> ThinHandle:
        """Hierarchical neighbor averaging on the thin path: the node's average (a group
        allreduce), then the machine phase as a neighbor allreduce of that among the ranks
        of the same local rank."""
        thin = self._thin
        assert thin is not None
        names = self._names
        op_name, gen = reserved
        node, me = divmod(self.rank, L)
        weights = None if edge_topology(machine_topo) else machine_weights(
            machine_topo, node, self.size // L, step
        )  # fmt: skip
        final = ThinHandle(
            thin, op_name, gen, OpKind.NEIGHBOR_ALLREDUCE, None, lambda: names.ended(op_name)
        )
        try:
            first = self._thin_op(
                OpKind.ALLREDUCE, arr.reshape(-1), dt, mid, False, name, ReduceOp.AVG, priority,
                0, None, group=local_grp, reserved=local,
            )  # fmt: skip
        except BaseException:
            names.ended(op_name)
            raise
        shaped = mid.reshape(arr.shape)

        def machine() -> None:
            if weights is None:
                edge = machine_topo.edge_of(node, step)
                grp = Group(sorted(m * L + me for m in edge.ranks))
                self._thin_edge(shaped, dt, o, False, name, reserved, priority, grp,
                                float(edge.weight), handle=final)  # fmt: skip
            else:
                sw, src, dst = weights
                self._thin_exchange(
                    shaped, dt, o, False, name, reserved, priority,
                    {m * L + me: w for m, w in src.items()},
                    {m * L + me: w for m, w in dst.items()}, sw, handle=final,
                )  # fmt: skip

        return thin.chain(first, final, machine)

    def _machine_phase(
        self, machine_topo: Any, L: int, step: int, n: int
    ) -> tuple[Group, AlgorithmCode, Schedule]:
        """Group, code and schedule of the machine phase of hierarchical averaging."""
        node, local = divmod(self.rank, L)
        if edge_topology(machine_topo):
            edge = machine_topo.edge_of(node, step)
            grp = Group(sorted(m * L + local for m in edge.ranks))
            me = grp.rank_of(self.rank)
            assert me is not None
            return grp, AlgorithmCode.EDGE, cached_edge(me, grp.size, n, float(edge.weight))
        from ..algorithms.neighbor import neighbor_allreduce

        sw, src, dst = machine_weights(machine_topo, node, self.size // L, step)
        sched = neighbor_allreduce(
            self.rank,
            self.size,
            n,
            self_weight=sw,
            src_weights={m * L + local: w for m, w in src.items()},
            dst_weights={m * L + local: w for m, w in dst.items()},
        )
        return self._world_group, AlgorithmCode.NEIGHBOR, sched


def _given(weights: Any) -> Any:
    """Weights (or ranks) given to a neighbor op, as part of an express key: None, the
    items of a dict, the ranks of a list or tuple; ``_UNUSUAL`` for anything else."""
    if weights is None:
        return None
    c = weights.__class__
    if c is dict:
        return ("d", *weights.items())
    if c is list or c is tuple:
        return ("l", *weights)
    return _UNUSUAL


_UNUSUAL: Any = object()
#: The keyword arguments of a blocking repeat its direct path looks at (others: the
#: ``_async`` form's way).
_NAR_KW = frozenset(
    {"topology", "step", "self_weight", "src_weights", "dst_weights", "out", "dtype", "priority"}
)
_NAG_KW = frozenset({"topology", "step", "src_ranks", "dst_ranks", "dtype", "priority"})


def _neighbor_key(
    name: Any, topology: Any, in_place: bool, self_weight: Any, src: Any, dst: Any,
    kind: str = "nar",
) -> tuple[Any, ...] | None:  # fmt: skip
    """The express key of a neighbor op's call (None: it goes the whole way): everything
    it was given that shapes it, the weights' values included (a repeat given other
    weights, or the same dict changed since, is another key)."""
    s, d = _given(src), _given(dst)
    if s is _UNUSUAL or d is _UNUSUAL:
        return None
    return (kind, name, topology, in_place, self_weight, s, d)


def machine_weights(
    machine_topo: Any, node: int, nodes: int, step: int
) -> tuple[float, dict[int, float], dict[int, float]]:
    """``(self_weight, {node: weight received}, {node: weight sent})`` of ``node`` in the
    machine phase: a graph topology's at ``step``, or the ``(self_weight,
    src_machine_weights, dst_machine_weights)`` given (node ids checked and a node named
    among both its own sources and destinations folded in, as for ranks)."""
    if not isinstance(machine_topo, tuple):
        sw, src, dst = graph_weights(machine_topo, node, step)
        return sw, src, dst
    self_weight, src_weights, dst_weights = machine_topo
    for what, given in (("src_machine_weights", src_weights), ("dst_machine_weights", dst_weights)):
        for m in given:
            if isinstance(m, bool) or not isinstance(m, (int, np.integer)) or not 0 <= m < nodes:
                raise ValueError(f"{what}: machine {m!r} is not one of the {nodes} machines")
    if len(set(dst_weights)) != len(dst_weights):
        raise ValueError(f"dst_machine_weights repeat a machine: {list(dst_weights)}")
    return neighbor_weights(node, nodes, None, step, self_weight, src_weights, dst_weights)

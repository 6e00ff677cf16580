"""Hierarchical (three-phase) collectives over clients and one relay per node, Gloo's.

Daemon mode no longer runs these schedules: its services reduce their clients'
buffers in the node's arena and run an ordinary algorithm among themselves
(``daemon/thin.py``).  They stay as the reference of a hierarchical allreduce
pipelined by segments, and the simulator checks them for every layout.

Engine ranks (:class:`NodeLayout`): with ``N`` nodes of ``L`` clients each,
the clients are ranks ``0 .. C-1`` (``C = N·L``; slot ``k`` of node ``n`` is
rank ``n·L + k``) and the relay of node ``n`` (the node's service process) is
rank ``C + n``; ``C + N`` ranks in all.  Only clients have an input: a relay's
schedule has ``count = 0`` and ``out_count = count``, and works in its
``OUTPUT`` (and ``WORK`` where the cross-node algorithm wants one).

Every rank's schedule has the same steps, numbered across the phases; a rank
that has nothing to do in a phase has empty steps there, so a send at step
``s`` is always received at step ``s`` on its peer.

Allreduce (:func:`allreduce_hierarchical`), ``X`` the cross-node algorithm's
step count:

1. Step ``0``, local reduce: each client sends its input to its relay.  The
   relay receives the first client's with ``COPY`` and the others' with
   ``REDUCE``, all into its whole ``OUTPUT`` and in that one step: the
   reductions wait for the copy (write after write) but not for each other
   (same-step commutative receives), so ``max`` and ``min`` are right and the
   ``L - 1`` reductions land in any order.
2. Steps ``1 .. X``, cross-node allreduce among the relays: the schedule of a
   registered allreduce (``cross``, default the ring) compiled for
   ``(node, N)``, made in place (:func:`~.schedule.alias_input`: its input is
   the relay's ``OUTPUT``) and with its peers mapped to relay ranks.
3. Step ``X + 1``, local broadcast: the relay sends its ``OUTPUT`` to each of
   its clients, which receive it into their ``OUTPUT`` (``COPY``).  For an
   ``avg`` the clients divide by ``C`` in the epilogue (floor on integers);
   a relay's ``OUTPUT`` keeps the plain sum.

Nothing waits for a whole phase: the waits are per segment
(:func:`~.schedule.plan_segments`), so a relay forwards segment *k* to the
other relays once its ``L`` contributions to *k* have landed, and returns it to
its clients once the cross-node exchange has finished with *k*, while later
segments are still arriving.

Cost, ``S`` bytes: a client sends and receives ``S`` once; a relay receives
``L · S`` and sends ``L · S`` locally, plus the cross-node algorithm's traffic
for ``N`` ranks; ``X + 2`` steps.

Broadcast (:func:`broadcast_hierarchical`) from a client ``root`` of node
``n0``, ``Y`` the cross-node broadcast's step count:

1. Step ``0``: the root (which copies its input to its ``OUTPUT`` in the
   prologue, as :mod:`.broadcast` does) sends it to its relay.
2. Steps ``1 .. Y``: a broadcast among the relays from ``n0``'s (one-to-all
   or pipelined chain, remapped like the allreduce's).
3. Step ``Y + 1``: each relay sends to its clients, the root excepted.

Barrier (:func:`barrier_hierarchical`), three steps: clients to their relay;
relays all-to-all; relays to their clients.  As in the all-to-one barrier of
:mod:`.barrier`, each notification is a one-element token in ``WORK`` rather
than an empty frame: an empty region overlaps nothing, so a relay's step-1
sends would not wait for its clients' arrivals, nor its step-2 releases for
the other relays'.  The relay receives every token into the same element, so
its sends wait for all of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .barrier import TOKEN
from .broadcast import broadcast_one_to_all, broadcast_pipelined
from .codes import AlgorithmCode, OpKind
from .registry import ALLREDUCE
from .ring import allreduce_epilogue
from .schedule import (
    Action,
    Buffer,
    LocalKind,
    LocalOp,
    Recv,
    Region,
    Schedule,
    Send,
    Step,
    alias_input,
)

#: Cross-node broadcasts by name (the names of ``registry.BROADCAST``).
CROSS_BROADCAST: dict[str, Callable[..., Schedule]] = {
    "one_to_all": broadcast_one_to_all,
    "pipelined": broadcast_pipelined,
}


@dataclass(frozen=True)
class NodeLayout:
    """``nodes`` nodes of ``local`` clients each, plus one relay per node.

    >>> lay = NodeLayout(nodes=2, local=3)
    >>> lay.clients, lay.world, lay.relay_of(1), lay.node_of(4), list(lay.clients_of(1))
    (6, 8, 7, 1, [3, 4, 5])
    """

    nodes: int
    local: int

    def __post_init__(self) -> None:
        for name in ("nodes", "local"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"NodeLayout {name} must be an int >= 1, got {value!r}")

    @property
    def clients(self) -> int:
        """Client ranks, ``0 .. clients - 1``."""
        return self.nodes * self.local

    @property
    def world(self) -> int:
        """All engine ranks: the clients, then one relay per node."""
        return self.clients + self.nodes

    def check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world:
            raise ValueError(
                f"rank {rank} outside 0..{self.world - 1} "
                f"({self.nodes} nodes x {self.local} clients + {self.nodes} relays)"
            )

    def check_node(self, node: int) -> None:
        if not 0 <= node < self.nodes:
            raise ValueError(f"node {node} outside 0..{self.nodes - 1}")

    def is_relay(self, rank: int) -> bool:
        self.check_rank(rank)
        return rank >= self.clients

    def node_of(self, rank: int) -> int:
        """The node of a client or relay rank."""
        if self.is_relay(rank):
            return rank - self.clients
        return rank // self.local

    def relay_of(self, node: int) -> int:
        self.check_node(node)
        return self.clients + node

    def clients_of(self, node: int) -> range:
        self.check_node(node)
        return range(node * self.local, (node + 1) * self.local)


# Per-phase hints for a frame that matches no receive (``Schedule.unexpected``).
_LOCAL_IN = (
    "rank {sender} sent a node-local frame to rank {me}, which expects none from it at this "
    "step (do all ranks use the same node layout, nodes and clients per node?)"
)
_CROSS = (
    "rank {sender} sent a cross-node frame to rank {me}, which expects none from it at this "
    "step (do all relays use the same node layout and cross-node algorithm?)"
)
_LOCAL_OUT = (
    "rank {sender} sent a node-local result to rank {me}, which expects none from it at this "
    "step (do all ranks use the same node layout, nodes and clients per node?)"
)


def _hints(cross_steps: int) -> tuple[str, ...]:
    return (_LOCAL_IN,) + (_CROSS,) * cross_steps + (_LOCAL_OUT,)


def _whole(count: int) -> Region:
    return Region(Buffer.OUTPUT, 0, count)


def _on_relays(inner: Schedule, layout: NodeLayout) -> tuple[Step, ...]:
    """The steps of a cross-node schedule for ``(node, nodes)``, in place, on relay ranks.

    Its ``INPUT`` becomes the relay's ``OUTPUT`` (:func:`alias_input`), its
    peers the relays of those nodes.  It must need no local operations: there
    is no place for them between the phases.
    """
    aliased = alias_input(inner)
    if aliased is None or aliased.prologue or aliased.epilogue:
        raise ValueError(
            "the cross-node schedule cannot run in place on the relay's output "
            f"(node {inner.rank} of {inner.size})"
        )
    steps = []
    for st in aliased.steps:
        steps.append(
            Step(
                sends=tuple(Send(layout.relay_of(s.peer), s.region) for s in st.sends),
                recvs=tuple(
                    Recv(layout.relay_of(r.peer), r.region, r.action, r.weight) for r in st.recvs
                ),
            )
        )
    return tuple(steps)


def _cross_allreduce(name: str) -> Callable[..., Schedule]:
    try:
        return ALLREDUCE[name]
    except KeyError:
        known = ", ".join(sorted(ALLREDUCE))
        raise ValueError(f"unknown cross-node allreduce {name!r}; known: {known}") from None


def _cross_broadcast(name: str) -> Callable[..., Schedule]:
    try:
        return CROSS_BROADCAST[name]
    except KeyError:
        known = ", ".join(sorted(CROSS_BROADCAST))
        raise ValueError(f"unknown cross-node broadcast {name!r}; known: {known}") from None


def _check_count(count: int) -> None:
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")


def _cross_steps(inner: Schedule, reference: Schedule) -> int:
    """The cross-node step count, which every relay must share."""
    if len(inner.steps) != len(reference.steps):
        raise ValueError(
            f"cross-node schedule has {len(inner.steps)} steps on node {inner.rank} "
            f"but {len(reference.steps)} on node {reference.rank}"
        )
    return len(reference.steps)


def allreduce_hierarchical(
    rank: int,
    layout: NodeLayout,
    count: int,
    *,
    average: bool = False,
    cross: str = "ring",
) -> Schedule:
    """Three-phase allreduce schedule for engine ``rank`` (client or relay) of ``layout``.

    ``cross`` names the registered allreduce the relays run among themselves.

    >>> lay = NodeLayout(2, 2)
    >>> [len(allreduce_hierarchical(r, lay, 10).steps) for r in range(lay.world)]
    [4, 4, 4, 4, 4, 4]
    >>> allreduce_hierarchical(4, lay, 10).count, allreduce_hierarchical(4, lay, 10).out_count
    (0, 10)
    """
    layout.check_rank(rank)
    _check_count(count)
    algorithm = _cross_allreduce(cross)
    node = layout.node_of(rank)
    reference = algorithm(0, layout.nodes, count)
    whole = _whole(count)
    if layout.is_relay(rank):
        inner = reference if node == 0 else algorithm(node, layout.nodes, count)
        x = _cross_steps(inner, reference)
        clients = layout.clients_of(node)
        gather = Step(
            recvs=tuple(
                Recv(c, whole, Action.COPY if i == 0 else Action.REDUCE)
                for i, c in enumerate(clients)
            )
        )
        scatter = Step(sends=tuple(Send(c, whole) for c in clients))
        return Schedule(
            rank=rank,
            size=layout.world,
            count=0,
            out_count=count,
            steps=(gather, *_on_relays(inner, layout), scatter),
            work_count=inner.work_count,
            unexpected=_hints(x),
        )
    x = len(reference.steps)
    relay = layout.relay_of(node)
    steps = (
        Step(sends=(Send(relay, Region(Buffer.INPUT, 0, count)),)),
        *(Step() for _ in range(x)),
        Step(recvs=(Recv(relay, whole, Action.COPY),)),
    )
    return Schedule(
        rank=rank,
        size=layout.world,
        count=count,
        out_count=count,
        steps=steps,
        epilogue=allreduce_epilogue(count, layout.clients, average),
        unexpected=_hints(x),
    )


def broadcast_hierarchical(
    rank: int,
    layout: NodeLayout,
    count: int,
    *,
    root: int,
    cross: str = "one_to_all",
    chunks: int | None = None,
) -> Schedule:
    """Three-phase broadcast schedule from client ``root`` for engine ``rank`` of ``layout``.

    ``cross`` names the broadcast among the relays (``"one_to_all"`` or
    ``"pipelined"``, the latter in ``chunks`` pieces).

    >>> lay = NodeLayout(3, 2)
    >>> s = broadcast_hierarchical(lay.relay_of(1), lay, 10, root=3)
    >>> [len(st.sends) for st in s.steps], [len(st.recvs) for st in s.steps]
    ([0, 2, 2, 1], [1, 2, 0, 0])

    (Steps 1 and 2 among the relays carry the cross-node broadcast's data, the
    other relays' confirmation tokens and its release: see :mod:`.broadcast`.)
    """
    layout.check_rank(rank)
    _check_count(count)
    if not 0 <= root < layout.clients:
        raise ValueError(
            f"hierarchical broadcast root {root} must be a client rank, 0..{layout.clients - 1}"
        )
    make = _cross_broadcast(cross)
    options = {} if chunks is None else {"chunks": chunks}
    home = layout.node_of(root)
    node = layout.node_of(rank)
    reference = make(home, layout.nodes, count, root=home, **options)
    whole = _whole(count)
    if layout.is_relay(rank):
        inner = reference if node == home else make(node, layout.nodes, count, root=home, **options)
        y = _cross_steps(inner, reference)
        first = Step(recvs=(Recv(root, whole, Action.COPY),)) if node == home else Step()
        last = Step(sends=tuple(Send(c, whole) for c in layout.clients_of(node) if c != root))
        return Schedule(
            rank=rank,
            size=layout.world,
            count=0,
            out_count=count,
            steps=(first, *_on_relays(inner, layout), last),
            work_count=inner.work_count,
            unexpected=_hints(y),
        )
    y = len(reference.steps)
    relay = layout.relay_of(node)
    prologue: tuple[LocalOp, ...] = ()
    if rank == root:
        prologue = (LocalOp(LocalKind.COPY, whole, Region(Buffer.INPUT, 0, count)),)
        steps = (Step(sends=(Send(relay, whole),)), *(Step() for _ in range(y + 1)))
    else:
        steps = (*(Step() for _ in range(y + 1)), Step(recvs=(Recv(relay, whole, Action.COPY),)))
    return Schedule(
        rank=rank,
        size=layout.world,
        count=count,
        out_count=count,
        steps=steps,
        prologue=prologue,
        unexpected=_hints(y),
    )


def barrier_hierarchical(rank: int, layout: NodeLayout) -> Schedule:
    """Three-step barrier for engine ``rank`` of ``layout``: gather, relays all-to-all, release.

    >>> lay = NodeLayout(2, 3)
    >>> [len(st.recvs) for st in barrier_hierarchical(lay.relay_of(0), lay).steps]
    [3, 1, 0]
    """
    layout.check_rank(rank)
    node = layout.node_of(rank)
    if layout.is_relay(rank):
        clients = layout.clients_of(node)
        others = [layout.relay_of(n) for n in range(layout.nodes) if n != node]
        steps = (
            # COPY, not REDUCE: a token has no reduce op.  Every token lands in
            # the same element, so each later send waits for all of them.
            Step(recvs=tuple(Recv(c, TOKEN, Action.COPY) for c in clients)),
            Step(
                sends=tuple(Send(p, TOKEN) for p in others),
                recvs=tuple(Recv(p, TOKEN, Action.COPY) for p in others),
            ),
            Step(sends=tuple(Send(c, TOKEN) for c in clients)),
        )
    else:
        relay = layout.relay_of(node)
        steps = (
            Step(sends=(Send(relay, TOKEN),)),
            Step(),
            Step(recvs=(Recv(relay, TOKEN, Action.COPY),)),
        )
    return Schedule(
        rank=rank,
        size=layout.world,
        count=0,
        out_count=0,
        steps=steps,
        work_count=1,
        unexpected=_hints(1),
    )


def hierarchical_schedule(
    kind: OpKind,
    rank: int,
    layout: NodeLayout,
    count: int,
    *,
    op_average: bool = False,
    root: int = 0,
    cross: str = "ring",
    broadcast_cross: str = "one_to_all",
) -> Schedule:
    """The hierarchical schedule of ``kind`` for engine ``rank``, from what a frame says.

    ``cross`` is the relays' allreduce, ``broadcast_cross`` their broadcast.
    Reduce-scatter and all-gather have none: they run flat.

    >>> hierarchical_schedule(OpKind.BARRIER, 0, NodeLayout(2, 2), 0).work_count
    1
    """
    kind = OpKind(kind)
    if kind is OpKind.ALLREDUCE:
        return allreduce_hierarchical(rank, layout, count, average=op_average, cross=cross)
    if kind is OpKind.BROADCAST:
        return broadcast_hierarchical(rank, layout, count, root=root, cross=broadcast_cross)
    if kind is OpKind.BARRIER:
        if count != 0:
            raise ValueError(f"a barrier moves no data, got count {count}")
        return barrier_hierarchical(rank, layout)
    raise ValueError(f"no hierarchical schedule for {OpKind(kind).name}")


_CROSS_CODES = {
    "ring": AlgorithmCode.RING,
    "ring_chunked": AlgorithmCode.RING_CHUNKED,
    "halving_doubling": AlgorithmCode.HALVING_DOUBLING,
    "recursive_doubling": AlgorithmCode.RECURSIVE_DOUBLING,
    "bcube": AlgorithmCode.BCUBE,
    "one_to_all": AlgorithmCode.ONE_TO_ALL,
    "pipelined": AlgorithmCode.PIPELINED,
}
_CROSS_NAMES = {int(code): name for name, code in _CROSS_CODES.items()}


def join_param(root: int = 0, cross: str = "ring", broadcast_cross: str = "one_to_all") -> int:
    """The ``param`` a hierarchical op's frames carry: root and the relays' algorithms.

    >>> split_param(join_param(5, "recursive_doubling", "pipelined"))
    (5, 'recursive_doubling', 'pipelined')
    """
    if not 0 <= root < 1 << 32:
        raise ValueError(f"root {root} out of range")
    return root | int(_CROSS_CODES[cross]) << 32 | int(_CROSS_CODES[broadcast_cross]) << 40


def split_param(param: int) -> tuple[int, str, str]:
    """(root, cross, broadcast_cross) of a frame's ``param``; ValueError if it names none."""
    try:
        cross = _CROSS_NAMES[(param >> 32) & 0xFF]
        bcast = _CROSS_NAMES[(param >> 40) & 0xFF]
    except KeyError:
        raise ValueError(f"param {param:#x} names no relay algorithm") from None
    return param & 0xFFFFFFFF, cross, bcast

"""Schedules: a collective algorithm compiled, for one rank, into data.

An algorithm (one module per algorithm in this package) turns
``(kind, rank, size, count, options)`` into a :class:`Schedule`: local
operations before the exchange (``prologue``), numbered :class:`Step` s of
sends and receives, and local operations after it (``epilogue``).  The engine
executes any schedule without knowing which algorithm made it, and the pure
simulator (``algorithms/simulator.py``) executes all ranks' schedules in memory
to prove them.

Buffers.  A schedule addresses three arrays of the op by :class:`Buffer`:
``INPUT`` (the caller's array, read only), ``OUTPUT`` (the result) and
``WORK`` (a scratch array the engine allocates with ``work_count`` elements).
Regions are element ranges of one of them.

Ordering.  Steps carry no explicit waits: :func:`plan_segments` derives them
from the regions, so an algorithm cannot forget one.  A send of step *j* reads
its region after every earlier receive that writes any of it has been applied
(read after write); a receive of step *j* is applied after every earlier
receive into its region (write after write) and after every send of steps
``<= j`` that reads its region has completed (write after read: the wire may
still be reading it).  Receives of the same step that combine into the same
elements with a commutative action (reduce, accumulate) do not wait for each
other.  The waits are computed per segment, so segment *k* of step *j + 1* can
go out while segment *k + 1* of step *j* is still on the wire: that is the
pipelining of the ring.
"""

from __future__ import annotations

import bisect
import enum
from dataclasses import dataclass, field


class Buffer(enum.IntEnum):
    """Which array of an op a region lies in."""

    INPUT = 0
    OUTPUT = 1
    WORK = 2


class Action(enum.IntEnum):
    """What a receive does with the data it gets."""

    COPY = 1  # dst = received
    REDUCE = 2  # dst = dst (op) received, with the op's reduce operation
    ACCUMULATE = 3  # dst = dst + weight * received


class LocalKind(enum.IntEnum):
    """Local operations of a prologue or epilogue."""

    COPY = 1  # dst = src
    SCALE = 2  # dst = weight * src   (src may be dst)
    AVERAGE = 3  # dst = dst / divisor (floor division on integers)
    ACCUMULATE = 4  # dst = dst + weight * src


COMMUTATIVE = frozenset({Action.REDUCE, Action.ACCUMULATE})


@dataclass(frozen=True)
class Region:
    """``count`` elements of ``buffer`` starting at element ``offset``."""

    buffer: Buffer
    offset: int
    count: int

    @property
    def end(self) -> int:
        return self.offset + self.count


@dataclass(frozen=True)
class Send:
    """Send ``region`` to rank ``peer``."""

    peer: int
    region: Region


@dataclass(frozen=True)
class Recv:
    """Receive ``region.count`` elements from rank ``peer`` and apply ``action``.

    A ``REDUCE`` with ``src`` (a region of ``INPUT`` of the same size) writes
    ``src (op) received`` into ``region``: the first write of a region can take
    its local operand straight from the input, so no prologue copy is needed.
    """

    peer: int
    region: Region
    action: Action = Action.COPY
    weight: float = 1.0
    src: Region | None = None


@dataclass(frozen=True)
class Step:
    """One communication step: its sends and receives may proceed concurrently.

    A step receives at most once from each peer, so ``(step, peer)`` names a
    receive on the wire.
    """

    sends: tuple[Send, ...] = ()
    recvs: tuple[Recv, ...] = ()


@dataclass(frozen=True)
class LocalOp:
    """A local operation on whole regions, run before or after the steps."""

    kind: LocalKind
    dst: Region
    src: Region | None = None
    weight: float = 1.0
    divisor: int = 1


@dataclass(frozen=True)
class Schedule:
    """What one rank does for one collective.

    ``count`` is the element count of the input, ``out_count`` of the output,
    ``work_count`` of the scratch array (0: none).  ``reads_input`` says that
    steps send from ``INPUT`` while writing ``OUTPUT``, so an in-place call
    needs a private copy of the input.
    """

    rank: int
    size: int
    count: int
    out_count: int
    steps: tuple[Step, ...] = ()
    prologue: tuple[LocalOp, ...] = ()
    epilogue: tuple[LocalOp, ...] = ()
    work_count: int = 0
    reads_input: bool = False
    #: Per step, what a frame that matches no receive of this rank means for this
    #: algorithm, with ``{sender}`` and ``{me}`` for the ranks (empty: the generic text).
    unexpected: tuple[str, ...] = ()

    def bytes_sent(self, itemsize: int) -> int:
        """Payload bytes this rank puts on the wire."""
        return itemsize * sum(s.region.count for st in self.steps for s in st.sends)

    def validate(self) -> None:
        """Check regions lie inside their buffers and peers are valid."""
        limits = {Buffer.INPUT: self.count, Buffer.OUTPUT: self.out_count}
        limits[Buffer.WORK] = self.work_count

        def check(region: Region, what: str) -> None:
            if region.offset < 0 or region.count < 0 or region.end > limits[region.buffer]:
                raise ValueError(
                    f"rank {self.rank}: {what} region {region} outside "
                    f"{region.buffer.name} of {limits[region.buffer]} elements"
                )

        for j, step in enumerate(self.steps):
            peers = set()
            for s in step.sends:
                if not 0 <= s.peer < self.size or s.peer == self.rank:
                    raise ValueError(f"rank {self.rank}: step {j} sends to invalid peer {s.peer}")
                check(s.region, f"step {j} send")
            for r in step.recvs:
                if not 0 <= r.peer < self.size or r.peer == self.rank:
                    raise ValueError(
                        f"rank {self.rank}: step {j} receives from invalid peer {r.peer}"
                    )
                if r.peer in peers:
                    raise ValueError(
                        f"rank {self.rank}: step {j} receives twice from rank {r.peer}"
                    )
                if r.region.buffer is Buffer.INPUT:
                    raise ValueError(f"rank {self.rank}: step {j} receives into INPUT")
                if r.src is not None and (
                    r.action is not Action.REDUCE
                    or r.src.buffer is not Buffer.INPUT
                    or r.src.count != r.region.count
                ):
                    raise ValueError(
                        f"rank {self.rank}: step {j}: a receive's src must be an INPUT region "
                        f"of the same size, with REDUCE (got {r.src} for {r.region})"
                    )
                peers.add(r.peer)
                check(r.region, f"step {j} recv")
        for op in self.prologue + self.epilogue:
            check(op.dst, "local op")
            if op.src is not None:
                check(op.src, "local op")


def balanced_parts(count: int, parts: int) -> list[tuple[int, int]]:
    """(offset, count) of ``parts`` near-equal pieces; the first ``count % parts`` get one more."""
    base, extra = divmod(count, parts)
    out = []
    offset = 0
    for i in range(parts):
        n = base + (1 if i < extra else 0)
        out.append((offset, n))
        offset += n
    return out


# ---------------------------------------------------------------------------
# Segment plan: the schedule cut into segments, with the waits between them.


@dataclass(frozen=True)
class SendSegment:
    step: int
    peer: int
    segment: int
    region: Region


@dataclass(frozen=True)
class RecvSegment:
    step: int
    peer: int
    segment: int
    region: Region
    action: Action
    weight: float
    src: Region | None = None


@dataclass
class SegmentPlan:
    """A schedule cut into segments of at most ``segment_elems`` elements.

    ``send_waits[i]`` / ``recv_waits[k]`` count what send segment *i* / receive
    segment *k* waits for; ``after_recv[k]`` and ``after_send[i]`` list, as
    ``(is_send, index)``, who waits for receive *k* / send *i*.  Every region
    produces at least one segment, so a step with empty regions still sends a
    (zero-byte) frame: ranks always exchange the frames that carry the op's
    description, and a zero-byte op still synchronises.
    """

    sends: list[SendSegment]
    recvs: list[RecvSegment]
    recv_index: dict[tuple[int, int, int], int]
    send_waits: list[int]
    recv_waits: list[int]
    after_send: list[list[tuple[bool, int]]] = field(default_factory=list)
    after_recv: list[list[tuple[bool, int]]] = field(default_factory=list)
    #: ``(step, peer, segment)`` of each send segment -> its index
    send_index: dict[tuple[int, int, int], int] = field(default_factory=dict)


def cut(region: Region, segment_elems: int) -> list[Region]:
    """Cut a region into segments (at least one, possibly empty)."""
    if region.count == 0:
        return [region]
    return [
        Region(region.buffer, o, min(segment_elems, region.end - o))
        for o in range(region.offset, region.end, segment_elems)
    ]


class _AccessMap:
    """Per-buffer interval map: element ranges -> (writers, readers since the write)."""

    def __init__(self) -> None:
        # Parallel sorted lists: interval starts, and per interval its state.
        # An interval runs from starts[i] to starts[i + 1] (the last to infinity).
        self.starts: list[int] = [0]
        self.state: list[tuple[tuple[int, ...], tuple[int, ...], int, int]] = [((), (), -1, 0)]

    def _split(self, at: int) -> int:
        i = bisect.bisect_right(self.starts, at) - 1
        if self.starts[i] != at:
            self.starts.insert(i + 1, at)
            self.state.insert(i + 1, self.state[i])
            return i + 1
        return i

    def span(self, lo: int, hi: int) -> range:
        a = self._split(lo)
        b = self._split(hi)
        return range(a, b)


def plan_segments(schedule: Schedule, segment_elems: int) -> SegmentPlan:
    """Cut ``schedule`` into segments and derive every wait between them."""
    if segment_elems < 1:
        raise ValueError(f"segment_elems must be >= 1, got {segment_elems}")
    sends: list[SendSegment] = []
    recvs: list[RecvSegment] = []
    recv_index: dict[tuple[int, int, int], int] = {}
    send_deps: list[set[int]] = []  # recv ids a send waits for
    recv_deps: list[tuple[set[int], set[int]]] = []  # (recv ids, send ids) a recv waits for
    maps = {b: _AccessMap() for b in Buffer}
    # state per interval: (writer recv ids, reader send ids, writer step, writer action)

    for j, step in enumerate(schedule.steps):
        for s in step.sends:
            for k, reg in enumerate(cut(s.region, segment_elems)):
                i = len(sends)
                sends.append(SendSegment(j, s.peer, k, reg))
                deps: set[int] = set()
                if reg.count:
                    m = maps[reg.buffer]
                    for t in m.span(reg.offset, reg.end):
                        writers, readers, wstep, wact = m.state[t]
                        deps.update(writers)
                        m.state[t] = (writers, readers + (i,), wstep, wact)
                send_deps.append(deps)
        for r in step.recvs:
            for k, reg in enumerate(cut(r.region, segment_elems)):
                q = len(recvs)
                src = None
                if r.src is not None:  # INPUT is read-only: no waits needed on it
                    src = Region(
                        r.src.buffer, r.src.offset + reg.offset - r.region.offset, reg.count
                    )
                recvs.append(RecvSegment(j, r.peer, k, reg, r.action, r.weight, src))
                recv_index[(j, r.peer, k)] = q
                rdeps: set[int] = set()
                sdeps: set[int] = set()
                if reg.count:
                    m = maps[reg.buffer]
                    for t in m.span(reg.offset, reg.end):
                        writers, readers, wstep, wact = m.state[t]
                        sdeps.update(readers)
                        if wstep == j and wact == r.action and r.action in COMMUTATIVE:
                            # Same-step commutative combines: no order between them;
                            # later accesses wait for all of them.
                            earlier = set()
                            for w in writers:
                                earlier |= recv_deps[w][0]
                            rdeps.update(earlier)
                            m.state[t] = (writers + (q,), readers, j, r.action)
                        else:
                            rdeps.update(writers)
                            m.state[t] = ((q,), (), j, r.action)
                recv_deps.append((rdeps, sdeps))

    send_waits = [len(d) for d in send_deps]
    recv_waits = [len(a) + len(b) for a, b in recv_deps]
    after_send: list[list[tuple[bool, int]]] = [[] for _ in sends]
    after_recv: list[list[tuple[bool, int]]] = [[] for _ in recvs]
    for i, deps in enumerate(send_deps):
        for q in deps:
            after_recv[q].append((True, i))
    for q, (rd, sd) in enumerate(recv_deps):
        for w in rd:
            after_recv[w].append((False, q))
        for i in sd:
            after_send[i].append((False, q))
    send_index = {(x.step, x.peer, x.segment): i for i, x in enumerate(sends)}
    return SegmentPlan(
        sends, recvs, recv_index, send_waits, recv_waits, after_send, after_recv, send_index
    )


def alias_input(schedule: Schedule) -> Schedule | None:
    """The schedule for an in-place call, where ``INPUT`` and ``OUTPUT`` are one array.

    Every ``INPUT`` region becomes the same ``OUTPUT`` region, so that
    :func:`plan_segments` sees (and orders) the accesses that now share
    memory.  Returns None when the schedule cannot run aliased (it reads the
    input after writing the output, or a receive's ``src`` is not its own
    destination), in which case the caller must give it a private input copy.
    """
    if schedule.reads_input or schedule.count != schedule.out_count:
        return None

    def out(reg: Region) -> Region:
        return Region(Buffer.OUTPUT, reg.offset, reg.count) if reg.buffer is Buffer.INPUT else reg

    steps = []
    for st in schedule.steps:
        recvs = []
        for r in st.recvs:
            if r.src is not None and out(r.src) != r.region:
                return None
            recvs.append(Recv(r.peer, r.region, r.action, r.weight))
        steps.append(Step(tuple(Send(x.peer, out(x.region)) for x in st.sends), tuple(recvs)))

    def local(ops: tuple[LocalOp, ...]) -> tuple[LocalOp, ...]:
        kept = []
        for op in ops:
            src = None if op.src is None else out(op.src)
            if op.kind is LocalKind.COPY and src == op.dst:
                continue  # copying the array onto itself
            kept.append(LocalOp(op.kind, op.dst, src, op.weight, op.divisor))
        return tuple(kept)

    return Schedule(
        rank=schedule.rank,
        size=schedule.size,
        count=schedule.count,
        out_count=schedule.out_count,
        steps=tuple(steps),
        prologue=local(schedule.prologue),
        epilogue=local(schedule.epilogue),
        work_count=schedule.work_count,
        reads_input=False,
        unexpected=schedule.unexpected,
    )

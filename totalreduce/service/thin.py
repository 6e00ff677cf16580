"""The thin path of a daemon client: ops handed to the node's service through the arena.

In daemon mode an ``allreduce``, ``broadcast``, ``barrier``, ``reduce_scatter`` or
``allgather`` (over the world or a group) does not go through this process's engine: the client
checks and names it as in embedded mode, places its buffer in the node's arena
(:mod:`~totalreduce.transport.arena`; zero copy if the array lives there, else
one copy in and one out), writes one descriptor into its submission ring and
returns a :class:`ThinHandle`.  The node's service reduces the node's buffers in
place, runs the op among the nodes' services, writes the result back and sets
the op's completion word.  ``done()`` reads that word; ``wait()`` spins briefly,
then sleeps on the futex word of this client's control block, which whoever sets one
of its words bumps and wakes when it sees the client asleep.  No thread of this process
takes part, unless a caller adds a done callback to an op in flight: then one thread
watches the words.

On a service of one node, the world's allreduces, broadcasts and barriers never reach
the service: the node's clients meet in the arena's meeting place
(:mod:`~totalreduce.transport.meeting`), and the last to arrive runs the op, setting
every client's completion word as the service would.  So do those over a group whose
ranks all live on the node, on a service of any number of nodes (reduced in the group's
order, as the rings reduce them).  A
blocking repeat in place on an array of the arena is one compiled call
(:meth:`ThinClient.now`): arrive, wait (helping with slices of a large op), done, no
handle made.

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
from ..engine.wire import SESSION_ID
from ..errors import (
    InvalidArgumentError,
    OpFailedError,
    OpMismatchError,
    OpTimeoutError,
    TotalReduceError,
    TransportError,
)
from ..transport import arena as A
from ..transport import meeting as M
from ..transport import ring_call as RC
from ..transport.shm import fence, signal_eventfd
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
#: How long a compiled wait sleeps at most before this client looks at its socket (the
#: service gone).
CHECK_S = M.CHECK_NS / 1e9
_SPIN_NS, _LARGE_SPIN_NS = int(SPIN_S * 1e9), int(LARGE_SPIN_S * 1e9)
#: The kinds that meet in the arena on a one-node service.
_MEET_KINDS = frozenset({int(OpKind.ALLREDUCE), int(OpKind.BROADCAST), int(OpKind.BARRIER)})
_SESSION = A.signed(SESSION_ID)
#: Whether an op over a group of the node's clients meets in the arena too (on a service
#: of any number of nodes), as the world's do on one node (``TOTALREDUCE_MEET_GROUPS=0``:
#: into the ring).
MEET_GROUPS = os.environ.get("TOTALREDUCE_MEET_GROUPS", "1") != "0"
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


def descriptor(
    kind: int, wire: int, dtype: DType, count: int, op: ReduceOp, root: int, flags: int,
    group: int, context: int, aux: int, algorithm: int,
) -> np.ndarray:  # fmt: skip
    """An op's descriptor with these fields (``group``, ``aux``: arena offsets of its
    group's and its parts' blocks, or -1); its ticket, generation, priority and buffers
    are written when it is submitted."""
    row = np.zeros(A.D_WORDS, np.int64)
    row[A.D_KIND], row[A.D_WIRE] = kind, A.signed(wire)
    row[A.D_DTYPE], row[A.D_COUNT] = int(dtype), count
    row[A.D_OP], row[A.D_ROOT] = int(op), root
    row[A.D_FLAGS] = flags
    row[A.D_GROUP], row[A.D_CTX], row[A.D_AUX] = group, A.signed(context), aux
    row[A.D_ALGO] = algorithm
    return row


def _shape_words(shape: int, count: int, root: int) -> str:
    """What an op of the meeting's ``shape`` word, ``count`` and ``root`` is, in words."""
    kind, dt, op, _, _ = M.unpack_shape(shape)
    try:
        text = f"{_KINDS.get(OpKind(kind), 'op')}, count {count} {DType(dt).name.lower()}"
    except ValueError:
        text = f"kind {kind}, count {count} dtype {dt}"
    if kind == int(OpKind.ALLREDUCE):
        try:
            text += f" (op {ReduceOp(op).name.lower()})"
        except ValueError:
            text += f" (op {op})"
    if kind == int(OpKind.BROADCAST):
        text += f" from root {root}"
    return text


class ThinHandle:
    """One op handed to the node's service (the same calls as :class:`~.handle.Handle`)."""

    __slots__ = (
        "name", "generation", "kind", "_client", "_ticket", "_result", "_blocks", "_out",
        "_out_at", "_finalize", "_done", "_error", "_then", "_ended", "passive", "_meet",
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
        #: the meeting's op slot it arrived in (channel * DEPTH + slot), -1: none
        self._meet = -1

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
        #: the address of this slot's control block (its futex word, C_SLEEPING)
        self._ctl_at = self.arena.base + self.arena.slot_start(self.slot)
        self._late_seen = int(self.ctl[A.C_LATE])
        #: tickets (taken by compare-and-swap, :func:`.meeting.take_ticket`), the ring's
        #: positions taken (:mod:`.ring_call`: a descriptor's place, any thread, no lock),
        #: the completion words in use, this client's op in flight in each op slot of the
        #: meeting, and the ops that ended in compiled calls
        self.st = M.state(int(self.ctl[A.C_TAIL]), self._late_seen)
        #: (and what the ring's compiled calls take from there: where the words are, the
        #: service's eventfd, how long a wait on the service polls before it yields the core:
        #: not at all where the job's processes on the host, services and clients, outnumber
        #: the cores, H_HOST_PROCS)
        RC.bind(
            self.st,
            self._ctl_at,
            self.arena.base,
            self.service_efd,
            M.pure_spin_ns(max(self.arena.slots + 1, int(self.header[A.H_HOST_PROCS]))),
        )
        #: the meeting's config: None where the service does not have its clients meet
        self.meet: np.ndarray | None = (
            M.config(self.arena, self.slot) if int(self.header[A.H_MEET_ON]) else None
        )
        #: whether the world's ops meet there too (a one-node service), not only groups'
        self.meet_world = int(self.header[A.H_MEET_ON]) == A.MEET_WORLD
        self._flight: dict[int, ThinHandle] = {}  # ticket -> handle, oldest first
        self._consts: dict[tuple[int, ...], int] = {}  # const_block's blocks
        #: the last ops completed here by a handle, by ticket % RING: (ticket, kind, name,
        #: generation), what a late error names (those that ended in a compiled call are in
        #: ``st``, their kind and name an index into ``_whats``)
        self._ended_ops: list[tuple[int, OpKind, str | int, int] | None] = [None] * A.RING
        self._whats: list[tuple[OpKind, str | int]] = []
        #: each thread's last descriptor and meeting record (an express record keeps them:
        #: another thread's op, submitted meanwhile, is not this one's)
        self._last = threading.local()
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

    def _room(self, h: ThinHandle) -> None:
        """Wait until a completion word is free (the oldest op first), or raise."""
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
        """Write the op's descriptor; the service takes it from here (or, for the world's
        allreduces, broadcasts and barriers on a one-node service, and those over a group
        whose ranks all live on this node on any service, arrive at the meeting).
        ``passive``: a window's standing receive (no stall warnings; nothing waits for it
        to make room)."""
        if self.gone is not None:
            self._release(h)
            raise self._gone_error(h)
        self._room(h)
        k = int(h.kind if kind is None else kind)
        flags = (
            (A.F_AVG if op is ReduceOp.AVG else 0)
            | (A.F_UNNAMED if unnamed else 0)
            | (A.F_PASSIVE if passive else 0)
        )
        row = descriptor(k, wire, dtype, count, op, root, flags, group, context, aux, algorithm)
        row[A.D_GEN], row[A.D_PRIO], row[A.D_IN], row[A.D_OUT] = (
            h.generation, priority, at_in, at_out,
        )  # fmt: skip
        rec = None
        if (
            self.meet is not None
            and k in _MEET_KINDS
            and not flags & (A.F_UNNAMED | A.F_PASSIVE)
            and row[A.D_WIRE] != _SESSION
        ):
            shape = M.pack_shape(k, int(dtype), int(op), flags, algorithm)
            if context == 0 and group == -1:
                if self.meet_world:  # (a world of several nodes: the ring, on every rank)
                    rec = M.record(int(row[A.D_WIRE]), shape, count, root)
            elif MEET_GROUPS and group >= 0 and M.runs_here(k, int(dtype), int(op), flags):
                slots = self.group_slots(group)
                if slots is not None:
                    wire = int(row[A.D_WIRE])
                    rec = M.record(wire, shape, count, root, slots, A.signed(context))
        self._last.op = (row, rec)
        if rec is not None and self._arrive(h, rec, priority, at_in, at_out):
            return h
        return self._ring(h, row, priority, at_in, at_out, passive)

    def submit_again(
        self, h: ThinHandle, row: np.ndarray, priority: int, at: int, rec: np.ndarray | None = None
    ) -> ThinHandle:
        """Submit a repeat: ``row``, an earlier descriptor of the same op (the express
        path's record), with ``h``'s generation, ``priority`` and its buffer at arena
        offset ``at`` (input and output: in place); it meets the others at the meeting
        if ``rec`` (that op's meeting record) is given.  The caller checked that the
        service is there, a completion word is free and no late error waits."""
        if rec is not None and self._arrive(h, rec, priority, at, at):
            return h
        return self._ring(h, row, priority, at, at)

    def _ring(
        self, h: ThinHandle, row: np.ndarray, priority: int, at_in: int, at_out: int,
        passive: bool = False,
    ) -> ThinHandle:  # fmt: skip
        """Write descriptor ``row`` with ``h``'s generation, ``priority`` and places
        ``at_in``, ``at_out`` (its ticket taken here) into the submission ring, and wake
        the service if it sleeps: one compiled call (:func:`.ring_call.ring_submit`),
        unless every completion word is in use (then it waits for one first)."""
        h.passive = passive
        st, gen = self.st, h.generation
        with self.lock:
            t = int(RC.ring_submit(st, row, gen, priority, at_in, at_out, 0))
            if t < 0:
                t = self.new_ticket()
                RC.ring_submit(st, row, gen, priority, at_in, at_out, t)
            h._ticket = t
            self._flight[t] = h
            if h._then:  # callbacks came before it was in flight (chain()'s final op)
                self.watch()
        trace = self.trace
        if trace is not None:
            trace.op(h.name, gen, "submitted", priority)
        return h

    def group_slots(self, at: int) -> tuple[int, ...] | None:
        """The slots of the node's clients that are the group of the block at arena offset
        ``at`` (its size, then its ranks), in group order (the order the meeting reduces
        in, as the rings do), if every rank of the group is a client of this node, else
        None: the group's ops then take the ring.  Every member decides alike, from the
        group's ranks and the node's ranks alone (rank ``r`` lives on node
        ``r // slots``), so no two members of an op take different routes for its
        group; a group of more than :data:`~.meeting.ORDER_SLOTS` ranks whose slots do
        not ascend takes the ring too."""
        n = int(self.arena.view(at, 1, np.dtype(np.int64))[0])
        if not 0 < n <= M.GROUP_SLOTS:
            return None
        ranks = self.arena.view(at, 1 + n, np.dtype(np.int64))[1:].tolist()
        base = self.rank - self.slot
        top = min(self.arena.slots, M.GROUP_SLOTS)
        slots = tuple(r - base for r in ranks)
        if any(not 0 <= k < top for k in slots) or len(set(slots)) != n:
            return None
        if n > M.ORDER_SLOTS and any(a > b for a, b in zip(slots, slots[1:], strict=False)):
            return None
        return slots

    def meet_mismatch(self, idx: int, gen: int) -> str | None:
        """What a mismatch found at the meeting says of generation ``gen``'s round of op
        slot ``idx`` (the two ranks that disagree, and what each gave), None if none was."""
        cf = self.meet
        if cf is None or idx < 0:
            return None
        out = np.zeros(8, np.int64)
        if not M.mismatch(cf, idx, gen // M.DEPTH + 1, out):
            return None
        base = self.rank - self.slot
        said = []
        for j in range(2):
            shape, count, root = (int(v) for v in out[2 + 3 * j : 5 + 3 * j])
            said.append(f"rank {base + int(out[j])}: {_shape_words(shape, count, root)}")
        return "the ranks disagree at the node's meeting: " + "; ".join(said)

    def _wake_service(self) -> None:
        fence()
        if self.header[A.H_SERVICE_SLEEPING]:
            signal_eventfd(self.service_efd)

    def _arrive(
        self, h: ThinHandle, rec: np.ndarray, priority: int, at_in: int, at_out: int
    ) -> bool:
        """Arrive at the meeting with ``h`` (``rec``: its op's meeting record); False if it
        must take the ring instead (no channel is free, or its op slot's state makes no
        sense for this generation: a new process in an old slot)."""
        cf, st = self.meet, self.st
        assert cf is not None
        gen = h.generation
        c = int(M.channel(cf, rec))
        if c < 0:
            return False
        idx = c * M.DEPTH + gen % M.DEPTH
        while True:
            t = self.new_ticket()
            h._ticket, h._meet = t, idx
            with self.lock:
                self._flight[t] = h
            code = int(M.meet_post(cf, st, rec, gen, t, priority, at_in, at_out))
            kind = code & M.P_MASK
            if kind in (M.P_BUSY, M.P_WEIRD, M.P_FULL):  # not arrived
                with self.lock:
                    self._flight.pop(t, None)
                M.release(st, t, -1)
                h._ticket, h._meet = 0, -1
                if kind != M.P_BUSY:
                    return False
                self._await_slot(idx)
                continue
            break
        if code & M.WAKE_SERVICE:
            self._wake_service()
        trace = self.trace
        if trace is not None:
            trace.op(h.name, h.generation, "submitted", priority)
        if kind == M.P_FAILED:  # its round had failed (a client gone, a mismatch): not arrived
            h._meet = -1
            self._complete(h, self._meet_failed(h, idx))
        elif h._then:
            with self.lock:
                self.watch()
        return True

    def _await_slot(self, idx: int) -> None:
        """This client's op of the previous round of op slot ``idx`` has not been seen to
        end: wait for it (a name with more than ``DEPTH`` generations in flight)."""
        st = self.st
        t = int(st[M.ST_PEND + idx])
        while t and int(st[M.ST_PEND + idx]) == t:
            prev = self._flight.get(t)
            if prev is not None:
                self.block(prev, None)
            else:  # a blocking call of another thread: it ends on its own
                time.sleep(0.0005)

    def meeting_why(self) -> str:
        """What the service said when it last failed ops of the meeting."""
        assert self.meet is not None
        at = int(self.meet[M.CF_MEET]) - self.arena.base + M.M_WHY
        raw = self.arena.bytes[at : at + M.WHY_BYTES].tobytes()
        return raw.split(b"\0", 1)[0].decode("utf-8", "replace") or "the op failed"

    def now(
        self, name: str | int, gen: int, row: np.ndarray, rec: np.ndarray, x: np.ndarray,
        at: int, priority: int, ended: Callable[[], None], hold: Callable[[], None],
        kind: OpKind = OpKind.ALLREDUCE,
    ) -> np.ndarray:  # fmt: skip
        """A blocking repeat of an op (an allreduce or a broadcast, ``kind``, in place on
        ``x``, an array of the arena at ``at``; a barrier: ``x`` empty, ``at`` -1),
        generation ``gen`` of ``name`` taken: arrive at the meeting and wait, in one
        compiled call (no handle, no lock); ``x`` once it ended.  Anything else (its
        peers late, the op slot busy, a failure) makes a handle and waits the usual way
        (``hold()`` first: the name's generation is in flight from then on; ``ended()``
        when it ends)."""
        cf, st = self.meet, self.st
        assert cf is not None
        t = int(M.take_ticket(st))
        if t > 0:
            spin = 200_000 if x.nbytes <= SMALL_BYTES else 50_000
            code = int(M.meet_now(cf, st, rec, gen, t, priority, at, spin, M.CHECK_NS))
            if code == M.P_DONE:  # (its generation was never counted in flight: nothing ends)
                return x
        else:
            code = M.P_FULL
        hold()
        how = code & M.P_MASK
        h = ThinHandle(self, name, gen, kind, x, ended)  # (its errors name the op's kind)
        if code & M.WAKE_SERVICE:
            self._wake_service()
        if how == M.P_DONE:
            M.release(st, t, -1)
            ended()
            return x
        if how in (M.P_BUSY, M.P_WEIRD, M.P_FULL):  # not arrived: the way a handle goes
            if t > 0:
                M.release(st, t, -1)
            self._room(h)
            self.submit_again(h, row, priority, at, rec)
        elif how == M.P_FAILED:
            M.release(st, t, -1)
            self._complete(h, self._meet_failed(h, int(rec[M.R_CH]) * M.DEPTH + gen % M.DEPTH))
        else:  # on its way (or the service has it): a handle in flight
            d = M.DEPTH
            h._ticket, h._meet = t, int(rec[M.R_CH]) * d + gen % d
            with self.lock:
                self._flight[t] = h
        return h.wait()  # type: ignore[no-any-return]

    def what(self, kind: OpKind, name: str | int) -> int:
        """The index that ops ended in a compiled call keep of their ``kind`` and ``name``
        (what a late error about one names): taken once per express record."""
        self._whats.append((kind, name))
        return len(self._whats) - 1

    def ring_now(
        self, name: str | int, gen: int, row: np.ndarray, result: Any, nbytes: int,
        at_in: int, at_out: int, priority: int, hold: Callable[[], None],
        ended: Callable[[], None], what: int, kind: OpKind = OpKind.ALLREDUCE,
    ) -> Any:  # fmt: skip
        """A blocking repeat among the nodes (descriptor ``row``, an earlier one of the
        op, with generation ``gen`` of ``name`` taken, ``priority`` and its buffers at
        arena offsets ``at_in``, ``at_out``): submitted and waited for in one compiled
        call (:func:`.ring_call.ring_now`: no handle, lock or table in Python); then
        ``result``.  A failure raises the error a handle would; an op still on its way
        after :data:`CHECK_S` is held (``hold()``: its generation in flight, ``ended()``
        when it ends) and waited for in compiled calls between looks at the socket; one
        that found no free completion word (another thread's ops hold them all) takes
        the ring with a handle.  ``what``: :meth:`what`'s index of the op."""
        spin = _SPIN_NS if nbytes <= SMALL_BYTES else _LARGE_SPIN_NS
        trace = self.trace
        if trace is not None:
            trace.op(name, gen, "submitted", priority)
            t0_ns = time.perf_counter_ns()
        code = int(RC.ring_now(self.st, row, gen, priority, at_in, at_out, spin, M.CHECK_NS, what))
        if code != RC.R_DONE:
            self._ring_rest(code, name, gen, row, result, at_in, at_out, priority, hold,
                            ended, what, kind)  # fmt: skip
        if trace is not None:
            trace.wait(name, gen, t0_ns, time.perf_counter_ns())
            trace.op(name, gen, "done", 0)
        return result

    def _ring_rest(
        self, code: int, name: str | int, gen: int, row: np.ndarray, result: Any,
        at_in: int, at_out: int, priority: int, hold: Callable[[], None],
        ended: Callable[[], None], what: int, kind: OpKind,
    ) -> None:  # fmt: skip
        """What a compiled repeat among the nodes did not end (see :meth:`ring_now`)."""
        hold()
        if code == RC.R_BUSY:  # nothing taken: the handle's way
            h = ThinHandle(self, name, gen, kind, result, ended)
            self._room(h)
            self._ring(h, row, priority, at_in, at_out)
            h.wait()
            return
        t, how = code >> RC.R_SHIFT, code & RC.R_MASK
        given_back = False
        try:
            while how == RC.R_PENDING:
                self._look_at_socket()
                if self.gone is not None:
                    raise TransportError(
                        f"rank {self.rank}: {_KINDS.get(kind, 'op')} {name!r} generation "
                        f"{gen}: {self.gone}"
                    )
                w = int(RC.ring_wait(self.st, t, M.FOREVER, 0, M.CHECK_NS))
                if w == RC.W_DONE:
                    RC.ended(self.st, t, gen, what)
                    given_back = True
                    return
                if w == RC.W_FAILED:
                    how = RC.R_FAILED
            ekind, text = A.read_error(self.ctl, t) or (A.E_FAILED, "the service failed it")
            raise self._op_error(kind, name, gen, text, ekind)
        finally:
            if not given_back:
                M.release(self.st, t, -1)
            ended()

    def last_row(self) -> np.ndarray:
        """A copy of the last descriptor this thread wrote (an express record keeps it);
        KeyError if it wrote none."""
        last = getattr(self._last, "op", None)
        if last is None:
            raise KeyError("no descriptor written on this thread")
        return last[0].copy()  # type: ignore[no-any-return]

    def last_meet(self) -> np.ndarray | None:
        """The meeting record of the last op submitted, None if it does not meet."""
        last = getattr(self._last, "op", None)
        rec = None if last is None else last[1]
        return None if rec is None else rec.copy()

    def busy(self) -> bool:
        """Whether a submission must take the whole way: the service is gone, every
        completion word is in use, or a late error waits to be raised."""
        return (
            self.gone is not None
            or len(self._flight) >= A.RING - 1
            or int(self.ctl[A.C_LATE]) != self._late_seen
        )

    def new_ticket(self) -> int:
        """The next op's ticket (any thread).  A ticket names the op's completion word
        (``(ticket - 1) % RING``); a word that an op in flight holds (a standing receive
        keeps its word while later ops come and go) is skipped."""
        while True:
            t = int(M.take_ticket(self.st))
            if t > 0:
                return t
            oldest = self._oldest()  # every word in use (blocking calls of other threads)
            if oldest is not None:
                self.block(oldest, None)
            else:
                time.sleep(0.0005)

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
            mis = self.meet_mismatch(h._meet, h.generation) if h._meet >= 0 else None
            if mis is not None:
                self._complete(h, self._failed_error(h, mis, A.E_MISMATCH))
                return True
            kind, text = A.read_error(self.ctl, t) or (A.E_FAILED, "the service failed it")
            self._complete(h, self._failed_error(h, text, kind))
        elif self.gone is not None:
            self._complete(h, self._gone_error(h))
        return h._done

    def _meet_failed(self, h: ThinHandle, idx: int) -> BaseException:
        """The error of ``h``, which found its round of op slot ``idx`` failed."""
        mis = self.meet_mismatch(idx, h.generation)
        if mis is not None:
            return self._failed_error(h, mis, A.E_MISMATCH)
        return self._failed_error(h, self.meeting_why())

    def _failed_error(self, h: ThinHandle, text: str, kind: int = A.E_FAILED) -> BaseException:
        return self._op_error(h.kind, h.name, h.generation, text, kind)

    def _op_error(
        self, op: OpKind, name: str | int, gen: int, text: str, kind: int = A.E_FAILED
    ) -> BaseException:
        verb = _KINDS.get(op, "op")
        return _ERRORS.get(kind, OpFailedError)(
            f"rank {self.rank}: {verb} {name!r} generation {gen}: {text}"
        )

    def raise_late(self) -> None:
        """Raise the next late error the service posted, if any: an op that completed here
        failed elsewhere (ranks that disagreed on its group), so its result may be wrong."""
        posted = int(self.ctl[A.C_LATE])
        if posted == self._late_seen:
            return
        self._late_seen += 1
        self.st[M.ST_LATE] = self._late_seen
        kind, text = A.read_error(self.ctl, -self._late_seen) or (A.E_FAILED, "\x1e")
        ticket, _, why = text.partition("\x1e")
        t = int(ticket) if ticket.isdigit() else 0
        what = self._ended_ops[t % A.RING]
        e = M.ST_ENDED + 3 * (t % A.RING)
        if t and int(self.st[e]) == t and 0 <= int(self.st[e + 2]) < len(self._whats):
            k, n = self._whats[int(self.st[e + 2])]  # it ended in a compiled call
            what = (t, k, n, int(self.st[e + 1]))
        op = (
            "an op"
            if what is None or what[0] != t
            else f"{_KINDS.get(what[1], 'op')} {what[2]!r} generation {what[3]}"
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
            t = h._ticket
            if error is None and h._out_at >= 0 and h._out is not None and h._out.nbytes:
                h._out.reshape(-1).view(np.uint8)[:] = self.arena.view(
                    h._out_at, h._out.nbytes, np.uint8
                )
            if self._flight.pop(t, None) is not None:
                st = self.st
                st[M.ST_INUSE + (t - 1) % A.RING] = 0
                idx = h._meet
                if idx >= 0 and st[M.ST_PEND + idx] == t:
                    st[M.ST_PEND + idx] = 0
            if error is None and t:
                self._ended_ops[t % A.RING] = (t, h.kind, h.name, h.generation)
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
        if not self.closed:
            M.wake_client(self._ctl_at)

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
        then sleep on the futex word (an op of the meeting: in compiled code, helping with
        its slices)."""
        t0_ns = time.perf_counter_ns()
        try:
            if h._meet >= 0 and not self.closed:
                self._meet_block(h, timeout)
            else:
                self._block(h, timeout)
        finally:
            trace = self.trace
            if trace is not None:
                trace.wait(h.name, h.generation, t0_ns, time.perf_counter_ns())

    def _spin_s(self, h: ThinHandle) -> float:
        r = h._result
        return LARGE_SPIN_S if r.__class__ is np.ndarray and r.nbytes > SMALL_BYTES else SPIN_S

    def _meet_block(self, h: ThinHandle, timeout: float | None) -> None:
        cf = self.meet
        assert cf is not None
        spin = int(self._spin_s(h) * 1e9)
        deadline = M.FOREVER if timeout is None else int(M.now()) + int(timeout * 1e9)
        t, idx = h._ticket, h._meet
        rf = h.generation // M.DEPTH + 1
        while not self.check(h):
            w = int(M.meet_wait(cf, self.st, t, idx, rf, deadline, spin, M.CHECK_NS))
            if w == M.W_TIMEOUT and not self.check(h):
                raise self._timeout_error(h, timeout)
            if w == M.W_CHECK:
                self._look_at_socket()
            spin = 0

    def _timeout_error(self, h: ThinHandle, timeout: float | None) -> OpTimeoutError:
        return OpTimeoutError(
            f"rank {self.rank}: {_KINDS.get(h.kind, 'op')} {h.name!r} generation "
            f"{h.generation} did not complete within {timeout} s (the node's service "
            f"pid {self.service_pid} has it)"
        )

    def _block(self, h: ThinHandle, timeout: float | None) -> None:
        t = h._ticket
        if t > 0 and not self.closed:  # the op's word: waited for in compiled calls
            spin = int(self._spin_s(h) * 1e9)
            deadline = M.FOREVER if timeout is None else int(RC.now()) + int(timeout * 1e9)
            while not self.check(h):
                w = int(RC.ring_wait(self.st, t, deadline, spin, M.CHECK_NS))
                if w == RC.W_TIMEOUT and not self.check(h):
                    raise self._timeout_error(h, timeout)
                if w == RC.W_CHECK:
                    self._look_at_socket()
                spin = 0
            return
        t0 = time.perf_counter()
        spin = self._spin_s(h)
        while time.perf_counter() - t0 < spin:
            if self.check(h):
                return
            os.sched_yield()
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.check(h):
            left = 0.5 if deadline is None else min(0.5, deadline - time.monotonic())
            if left <= 0:
                raise self._timeout_error(h, timeout)
            self._sleep(lambda: self.check(h), left)

    def _sleep(self, ready: Callable[[], bool], timeout: float) -> None:
        """Sleep on the futex word until whoever sets a word of this client wakes it (or
        ``timeout``, at most :data:`CHECK_S`), unless ``ready()``; then look at the socket."""
        at = self._ctl_at
        seq = int(M.futex_seq(at))
        M.sleepers(at, 1)
        try:
            if not ready() and not self.closed:
                M.sleep(at, seq, int(max(0.0, min(timeout, CHECK_S)) * 1e9))
        finally:
            M.sleepers(at, -1)
        self._look_at_socket()

    def _look_at_socket(self) -> None:
        """Whether the service said something or went away (its socket readable)."""
        if self.closed or self.gone is not None:
            return
        try:
            r, _, _ = select.select((self.sock,), (), (), 0)
        except (OSError, ValueError):
            r = [self.sock]
        if r:
            self._check_service()

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
        elif not self.closed:
            M.wake_client(self._ctl_at)

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

"""The node's side of the thin path: its clients' hierarchical ops, run from the arena.

One thread (``totalreduce-arena``) reads every attached client's submission ring
(:mod:`~totalreduce.transport.arena`), through the compiled pass of :mod:`.arena_pass`:
the world's allreduces, broadcasts and barriers of the raw kernels' types run there
(on several nodes, this module starts their step among the nodes and hands the result
back through it); everything else comes here, in order, as below.  An op (an
allreduce, broadcast, barrier, reduce-scatter or all-gather, over the world or a group)
starts when all the node's clients in its group have submitted it (the same wire id,
generation and group):

1. **on the node**: the clients' inputs are reduced into the first client's output,
   in place in the arena, with the kernels of :mod:`totalreduce.kernels` (a
   reduce-scatter's into a buffer of the service's; an all-gather's parts are joined);
2. **among the nodes**: that buffer is allreduced (broadcast from the root's node;
   a barrier; reduce-scattered or all-gathered with the nodes' parts) over MPI by
   ``engine``, an ordinary embedded service whose ranks are the nodes' services (the
   compiled lane runs it), over the nodes the group spans; an op whose group lies on
   one node has no such step.  A large allreduce or broadcast runs in segments
   (:class:`~.thin_ops._Segments`), two among the nodes at a time; the pass's ops make
   each segment's node's part just before it starts, and hand its result back (3.)
   as it ends;
3. **back**: ``avg`` divides, the result (or each client's part of it) is copied into
   the clients' outputs and every client's completion word is set (its eventfd written
   if it sleeps).

Ranks that disagree on an op's shape fail it on every rank with an error naming
them.  A client that dies fails the ops of its session on every node (the
engine's abort, and, on the other nodes, its rank's GONE, which its node's service
sends them through ``engine``: :meth:`ThinService.client_notice`); the session's
later ops fail at once.

On a service of one node the clients run the world's allreduces, broadcasts and barriers
among themselves, in the arena's meeting place, without this thread
(:mod:`~totalreduce.transport.meeting`), and those of groups of its clients too (on a
service of several nodes, only those: a group whose ranks all live on the node); what it
does for them is rare (:mod:`.thin_meeting`).

Here: the thread and its events, and taking and starting the ops Python has.  Its
bases: :mod:`.thin_fast` (the compiled pass's side: what it took, and its ops among the
nodes; with the service's compiled loop, :mod:`.service_loop`, a repeat among the nodes runs
from its descriptors to its completion words with no Python), :mod:`.thin_meeting` (the
meeting's escapes, deaths and stalls),
:mod:`.thin_ops` (an op of the node, the checks of a descriptor),
:mod:`.thin_nodes` (the step among the services), :mod:`.thin_clash` (ranks of different
nodes that disagree on an op's group, found by the services' probes) and
:mod:`.thin_answers` (results, completion words and errors back to the clients).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any

import numpy as np

from ..algorithms.codes import OpKind
from ..algorithms.rooted import offsets
from ..dtypes import DType, ReduceOp
from ..engine.driving import set_timer_slack
from ..kernels import copy_into, reduce_into
from ..lane.lane_service import ServiceRepeats
from ..service import express
from ..transport import arena as A
from ..transport import meeting, ring_call
from ..transport.shm import fence, new_eventfd, signal_eventfd, sleep_on
from . import arena_pass, service_loop
from .thin_answers import Answers
from .thin_clash import NodeClashes
from .thin_fast import PassOps
from .thin_meeting import MeetingOps
from .thin_nodes import AmongNodes
from .thin_ops import (
    _A2A,
    _AG,
    _PARTED,
    _RS,
    _SHAPE,
    Descriptors,
    _Grp,
    _Mismatch,
    _Op,
    _shape_text,
)
from .thin_session import Sessions

log = logging.getLogger("totalreduce.daemon")

#: How long the arena thread keeps looking after its last descriptor before it sleeps.
SPIN_S = 50e-6
#: With ops among the services in flight: how long it drives their engine at a time.  A
#: drive of a lane op ends sooner when a client writes its ring or another thread leaves
#: this one work (the lane's outer words, :meth:`ThinService._watch_rings`): the span
#: bounds what nothing signals (the stall looks; an op the lane does not run).
DRIVE_S = 1e-3


def meeting_default() -> bool:
    """Whether a one-node service has its clients meet in the arena
    (``TOTALREDUCE_MEETING``, in the service's environment: ``0`` turns it off)."""
    return os.environ.get("TOTALREDUCE_MEETING", "1").strip().lower() not in ("0", "off", "no")


class ThinService(PassOps, Descriptors, AmongNodes, Answers, Sessions, MeetingOps, NodeClashes):
    """The arena thread of one node's service."""

    def __init__(
        self, arena: A.Arena, node: int, nodes: int, engine: Any, stall_warning_s: float = 60.0,
        pipe_min_bytes: int = arena_pass.PIPE_MIN_BYTES, meeting_on: bool | None = None,
    ) -> None:  # fmt: skip
        """``meeting_on``: whether the node's clients meet in the arena (None:
        :func:`meeting_default`): for the world's ops and their groups' on a one-node
        service, for groups of the node's clients only on a service of several nodes."""
        self.arena = arena
        self.stall_warning_s = stall_warning_s
        self._next_look = time.monotonic() + 1.0
        self.node, self.nodes = node, nodes
        self.slots = arena.slots
        self.size = nodes * self.slots
        self.engine = engine
        self.eventfd = new_eventfd()
        self._ctl = [arena.control(k) for k in range(self.slots)]
        #: each slot's control block's address (its futex word: :func:`.meeting.wake_client`)
        self._ctl_at = [arena.base + arena.slot_start(k) for k in range(self.slots)]
        self._words = [c[A.DONE_WORD : A.DONE_WORD + A.RING] for c in self._ctl]
        self._efd: list[int | None] = [None] * self.slots
        self._inc = [0] * self.slots  # the incarnation attached to each slot, 0 if none
        #: the compiled pass (arena_pass.py): the world's common ops, no Python on one
        #: node; on several, Python only starts them among the nodes and hears them end
        self._fast = fast = arena_pass.Table(
            self.slots, nodes, node, arena.data_bytes, pipe_min_bytes
        )
        self.pipe_min_bytes = pipe_min_bytes  # segmented ops among the nodes (thin_nodes)
        fast.lo[:] = [arena.data_start(k) for k in range(self.slots)]
        fast.cw[:] = [arena.slot_start(k) // 8 for k in range(self.slots)]
        fast.st[arena_pass.S_ON] = 1
        self._head = fast.heads  # descriptors taken from each slot's ring
        self._mem = arena.bytes.view(np.int64)
        #: the pass's ops running among the nodes: token -> [entry, engine handle, the
        #: _Op that Python made of it once it took the op over (an event came), or None]
        self._fast_running: dict[int, list[Any]] = {}
        self._fast_tokens = 0
        self._fast_shapes: dict[tuple[int, ...], tuple[np.ndarray, Any]] = {}
        #: what the engine's comm thread left this thread to do: a pass's op (or one of
        #: its segments) ended among the nodes
        self._fast_ended: deque[Callable[[], None]] = deque()
        arena_pass.prepare()
        meeting.prepare()
        ring_call.prepare()  # the clients' (compiled once here, before any attaches)
        #: the compiled loop of a service of several nodes (service_loop.py): a repeat among
        #: the nodes from descriptor to completion word with no Python
        self._loop_shapes: service_loop.Shapes | None = None
        self._repeats: ServiceRepeats | None = None
        loop = getattr(engine, "loop", None)
        if (
            nodes > 1
            and getattr(loop, "lane", None) is not None
            and hasattr(engine, "_names")
            and service_loop.service_loop_default()
        ):
            service_loop.prepare()
            self._loop_shapes = service_loop.Shapes()
            self._repeats = ServiceRepeats(engine, express._make)
        self._init_meeting(meeting_default() if meeting_on is None else meeting_on, nodes == 1)
        #: held while this thread handles an event or the meeting's work, and while a new
        #: session zeroes the meeting place (on the socket's thread)
        self._event_lock = threading.Lock()
        self._world = _Grp(tuple(range(self.size)), 0, node, self.slots)
        self._groups: dict[tuple[int, int, int], _Grp] = {}  # (slot, offset, context) -> group
        self._segment_groups: dict[int, Any] = {}  # context -> services' group (thin_nodes)
        #: ops still collecting their local members' descriptors, by (wire id, generation):
        #: one per group of that name (two only when ranks disagree on it, or groups differ)
        self._pending: dict[tuple[int, int], list[_Op]] = {}
        self._running: dict[tuple[int, int, int], _Op] = {}
        #: ops whose local descriptors all came, lately, by (wire id, generation): a rank's
        #: descriptor of the name with another group meets them (it waits for ranks that
        #: will not submit it again)
        self._collected: OrderedDict[tuple[int, int], _Op] = OrderedDict()
        self._events: deque[tuple[Any, ...]] = deque()
        self._gone: dict[int, str] = {}  # client ranks that left or died, and how
        self._answering = threading.Lock()
        self._stop = threading.Event()
        self._init_sessions()  # which session of each node this one's job is made of
        if engine is not None:  # what the other services tell of their clients
            quiet = getattr(engine, "quiet_late_errors", None)
            if quiet is not None:  # logged here (_start), never raised into an op's start
                quiet()
            engine.loop.on_client_notice = self.client_notice
            self._watch_rings(engine.loop)
        self._init_clashes()  # (before any op: thin_clash.py)
        self._thread = threading.Thread(target=self._run, name="totalreduce-arena", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ from other threads

    def attach(self, slot: int, incarnation: int, efd: int) -> None:
        """A client took ``slot`` (its control block is zeroed here, before its welcome)."""
        self.arena.reset(slot)
        self._events.append(("attach", slot, incarnation, efd))
        self._kick()

    def detach(self, slot: int, why: str | None) -> None:
        """The client of ``slot`` left (``why`` is None) or died (``why`` says how)."""
        self._events.append(("detach", slot, why, self._meet_serial))
        self._kick()

    def busy(self) -> bool:
        """Whether ops run here (every local client submitted them; windows' standing
        receives aside): a stopping service gives them time to end."""
        return bool(self._fast_running) or any(not o.standing for o in list(self._running.values()))

    def client_notice(self, kind: str, rank: int, session: int = 0, agreed: int = 0) -> None:
        """Another node's service says its client rank ``rank`` ``"died"``, that a new
        process has it (``"joined"``), or that its session ended (``"ended"``), in its
        session ``session``, which agreed with the others under ``agreed`` (0: not yet;
        :mod:`.thin_session`): the engine among the services carries it.  Session 0 (a
        service that numbers none: tests) is any session's."""
        if session:
            self._events.append(("notice", kind, rank, session, agreed))
            self._kick()
        elif kind == "died":
            self.peer_left(rank, "died")
        elif kind == "joined":
            self.peer_joined(rank)

    def peer_left(self, rank: int, how: str) -> None:
        """A client rank of any node ``"left"`` (it said goodbye) or ``"died"``."""
        if 0 <= rank < self.size:
            died = how == "died"
            why = "died (its process ended without saying goodbye)" if died else "left"
            self._events.append(("left", rank, why, died))
            self._kick()

    def peer_joined(self, rank: int) -> None:
        """A new process has client rank ``rank`` (its node's service said so)."""
        if 0 <= rank < self.size:
            self._events.append(("joined", rank))
            self._kick()

    def new_session(self, epoch: int = 0) -> None:
        """The node's session ``epoch`` starts (before its first client attaches): the
        meeting place is zeroed here, once this thread has handled what came before."""
        if self._meet_on:
            deadline = time.monotonic() + 2.0
            while self._events and self._thread.is_alive() and time.monotonic() < deadline:
                time.sleep(0.0005)
            with self._event_lock:
                self._meet_reset()
        self._events.append(("session", epoch))
        self._kick()

    def end_session(self) -> None:
        """The node's session ended: its last client left (after it detached)."""
        self._events.append(("ended",))
        self._kick()

    def stop(self, why: str = "the node's service stops") -> None:
        """Fail what is in flight (saying ``why``), then end the thread."""
        self._events.append(("left", -1, why, True))
        self._kick()
        deadline = time.monotonic() + 5
        while self._events and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.001)
        self._stop.set()
        signal_eventfd(self.eventfd)
        self._thread.join(timeout=5)
        self._fast_shapes.clear()  # (views of the arena: its mapping may go now)
        if self._loop_shapes is not None:
            self._loop_shapes.clear()

    def _kick(self) -> None:
        self._fast.st[arena_pass.S_KICKED] = 1  # ends a drive among the nodes
        signal_eventfd(self.eventfd)

    def _watch_rings(self, loop: Any) -> None:
        """Make the rings' tails and the kick flag the outer words of the services'
        lane: this thread's drive of an op among the nodes (``h.drive(..., outer=True)``)
        ends as soon as a client submits (the tails' sum differs from the one the last
        pass saw, ``S_TAILS``) or another thread leaves it work (``S_KICKED``), so what
        they bring waits for no drive's span.  The arena and the table outlive the
        engine's waits: only this thread asks for the words, and it ends first."""
        arena, addr = self.arena, self._fast.st.ctypes.data
        at = arena.base + arena.slot_start(0) + 8 * A.C_TAIL
        seen, flag = addr + 8 * arena_pass.S_TAILS, addr + 8 * arena_pass.S_KICKED
        loop.watch_outer(at, arena.slot_bytes, self.slots, seen, flag)

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        set_timer_slack()  # its naps in the lane (Config.nap_s) as short as asked
        header = self.arena.header
        last = time.perf_counter()
        kicked = self._fast.st
        while not self._stop.is_set():
            try:
                kicked[arena_pass.S_KICKED] = 0  # before the looks: a kick after them is seen
                if self._fast_ended:
                    while self._fast_ended:
                        self._fast_ended.popleft()()
                    last = time.perf_counter()
                if self._events:
                    self._eject(None)  # Python's tables have every op when it handles one
                    with self._event_lock:
                        self._event(self._events.popleft())
                    self._fast.st[arena_pass.S_ON] = 0 if self._gone else 1
                    continue
                if self._meet_busy():
                    with self._event_lock:
                        self._meet_work()
                    last = time.perf_counter()
                    continue
                if time.monotonic() >= self._next_look:
                    self._look_for_stalls()
                if self._drain(spin=True):
                    last = time.perf_counter()
                    continue
                oldest = next((o for o in self._running.values() if not o.standing), None)
                h = None if oldest is None else oldest.handle
                if h is None and self._fast_running:
                    h = next(iter(self._fast_running.values()))[1]
                if h is not None:
                    # Ops among the services: this thread drives their engine, as a thread
                    # in wait() does (compiled passes for the lane's ops; the comm thread
                    # steps aside), DRIVE_S at a time between looks at the rings.
                    h.drive(DRIVE_S, outer=True)
                    last = time.perf_counter()  # (an op may have ended: spin from here)
                    continue
                if time.perf_counter() - last < SPIN_S:
                    os.sched_yield()
                    continue
                header[A.H_SERVICE_SLEEPING] = 1
                fence()
                if not self._events and not self._meet_busy() and not self._drain():
                    sleep_on(self.eventfd, 0.5)
                header[A.H_SERVICE_SLEEPING] = 0
                last = time.perf_counter()
            except Exception:
                log.exception("the arena thread failed")
                time.sleep(0.01)

    def _event(self, ev: tuple[Any, ...]) -> None:
        if ev[0] == "attach":
            _, slot, inc, efd = ev
            self._close_efd(slot)
            self._inc[slot], self._efd[slot], self._head[slot] = inc, efd, 0
            self._fast.incs[slot] = inc
            self._gone.pop(self.node * self.slots + slot, None)
            self._meet_gone()
            self._tell("joined", self.node * self.slots + slot)  # (the session is under way)
        elif ev[0] == "detach":
            _, slot, why, serial = ev
            self._inc[slot] = self._fast.incs[slot] = 0
            self._close_efd(slot)
            rank = self.node * self.slots + slot
            if why is not None:
                self._tell("died", rank)  # its ops fail on every node that agreed with it
                self._left(rank, why, died=True)
            else:  # ops waiting for it here never complete: they fail, on every node
                self._left(rank, "left", died=False)
            self._meet_gone(why is not None, serial)
        elif ev[0] == "left":
            _, rank, why, died = ev
            self._left(rank, why, died)
            self._meet_gone(died)
        elif ev[0] == "joined":
            self._gone.pop(ev[1], None)
        elif ev[0] == "notice":
            self._notice(*ev[1:])
        elif ev[0] == "session":
            self._gone.clear()
            self._pending.clear()  # what the last job left unfinished
            self._collected.clear()
            self._fast.forget_dones()
            self._session_begins(ev[1])
        elif ev[0] == "ended":
            self._session_ends()

    def _close_efd(self, slot: int) -> None:
        with self._answering:
            efd, self._efd[slot] = self._efd[slot], None
        if efd is not None:
            os.close(efd)

    # ------------------------------------------------------------------ ops

    def _take(self, slot: int, d: np.ndarray) -> None:
        rank = self.node * self.slots + slot
        bad = self._malformed(d)
        grp: _Grp | None = None
        parts: tuple[int, ...] | None = None
        if not bad:
            grp, bad = self._group_of(slot, d)
        if grp is not None and not bad:
            kind = int(d[A.D_KIND])
            if kind == int(OpKind.BROADCAST) and int(d[A.D_ROOT]) >= len(grp.ranks):
                bad = f"root {int(d[A.D_ROOT])} is outside its group of {len(grp.ranks)}"
            elif kind in _PARTED:
                parts, bad = self._parts_of(slot, d, grp)
        if bad or grp is None:
            log.warning("rank %d: a malformed descriptor: %s", rank, bad)
            self._answer(slot, self._inc[slot], d, A.E_INVALID, f"a malformed descriptor: {bad}")
            return
        wire, gen, ctx = int(d[A.D_WIRE]), int(d[A.D_GEN]), int(d[A.D_CTX])
        ops = self._pending.setdefault((wire, gen), [])
        op = next((o for o in ops if o.key[2] == ctx), None)
        if op is None:
            op = _Op((wire, gen, ctx), self.slots, grp)
            ops.append(op)
        if op.descs[slot] is not None:
            self._answer(slot, self._inc[slot], d, A.E_INVALID, "submitted twice by this rank")
            return
        op.descs[slot] = d
        op.parts[slot] = parts
        op.incarnations[slot] = self._inc[slot]
        op.seen += 1
        # Ranks of this node that disagree on the group: each expected the other's op.
        clash = [
            o for o in ops
            if o is not op and (slot in o.grp.slots or any(o.descs[k] is not None
                                                           for k in op.grp.slots))
        ]  # fmt: skip
        if op.seen == op.expect:
            ops.remove(op)
            if not ops:
                del self._pending[wire, gen]
            collected = self._collected
            collected[wire, gen] = op
            if len(collected) > 4 * A.RING:
                collected.popitem(last=False)
        done = self._collected.get((wire, gen))
        if done is None:  # the compiled pass may have answered it: Python never saw it
            done = self._pass_done(wire, gen)
        if done is not None and done is not op and done.key[2] != ctx:
            if any(done.descs[k] is not None for k in op.grp.slots):
                clash.append(done)
        if op.over:  # failed before this rank's part came: it fails the same way
            self._answer(slot, op.incarnations[slot], d, op.fail_kind, op.why)
            return
        if clash:
            texts = sorted(
                (self.node * self.slots + k, f"group {list(o.grp.ranks)}")
                for o in [op, *clash]
                for k, x in enumerate(o.descs)
                if x is not None
            )
            why = "the ranks disagree on the group: " + "; ".join(
                f"rank {r}: {t}" for r, t in texts
            )
            both = [op, *clash]
            for o in both:  # (first: a rank that sees its op fail may look for them at once)
                if o.over and not o.fail_kind:  # it completed: its ranks hear it late
                    self._late(o, A.E_MISMATCH, why)
            for o in both:
                if not (o.over and not o.fail_kind):
                    self._fail(o, A.E_MISMATCH, why)
            return
        other = next((x for x in op.descs if x is not None and x is not d), d)
        k_other = next(k for k, x in enumerate(op.descs) if x is other)
        kind = int(d[A.D_KIND])
        fields = _SHAPE if kind not in (_AG, _A2A) else tuple(f for f in _SHAPE if f != A.D_COUNT)
        same_parts = kind == _A2A or op.parts[k_other] == parts  # an all-to-all's differ
        # (a message's sender and its standing receiver differ in F_PASSIVE only)
        flags = (int(other[A.D_FLAGS]) ^ int(d[A.D_FLAGS])) & ~A.F_PASSIVE
        if flags or any(int(other[f]) != int(d[f]) for f in fields) or not same_parts:
            shapes = [
                f"rank {self.node * self.slots + k}: {_shape_text(x, op.parts[k])}"
                for k, x in enumerate(op.descs)
                if x is not None
            ]
            self._fail(op, A.E_MISMATCH, "the ranks disagree: " + "; ".join(shapes))
            return
        gone = next((r for r in self._gone if r < 0 or r in grp.rankset), None)
        if gone is not None:
            why = self._gone[gone]
            self._fail(op, A.E_FAILED, f"rank {gone} {why}" if gone >= 0 else why)
        elif op.seen == op.expect:
            self._start(op)

    def _start(self, op: _Op) -> None:
        d = op.first()
        g = op.grp
        kind = int(d[A.D_KIND])
        parts = op.parts[g.local[0][1]]
        try:
            dt = DType(int(d[A.D_DTYPE]))
            count = int(d[A.D_COUNT])
            bufs = self._buffers(op, dt, count) if kind != int(OpKind.BARRIER) else ([], [])
        except (ValueError, IndexError) as exc:
            self._fail(op, A.E_INVALID, f"a malformed descriptor ({exc})")
            return
        rop = ReduceOp(int(d[A.D_OP])) if kind in (int(OpKind.ALLREDUCE), _RS) else ReduceOp.SUM
        if rop is ReduceOp.AVG:
            rop = ReduceOp.SUM  # summed here and among the nodes, divided at the end
        ins, outs = bufs
        node_buf: np.ndarray | None = None
        try:
            if kind == int(OpKind.ALLREDUCE):
                node_buf = outs[0]
                self._reduce(node_buf, ins, rop, dt)
            elif kind == _RS:
                node_buf = np.empty(count, dtype=dt.numpy)
                self._reduce(node_buf, ins, rop, dt)
                assert parts is not None
                if not g.identity:  # each node's parts together, in node order
                    at = offsets(parts)
                    node_buf = np.concatenate([node_buf[at[i] : at[i] + parts[i]] for i in g.order])
            elif kind == _AG:
                node_buf = ins[0] if len(ins) == 1 else np.concatenate(ins)
            elif kind == _A2A:
                node_buf = self._alltoall_out(op, ins, outs)
            elif kind == int(OpKind.BROADCAST):
                root = g.ranks[int(d[A.D_ROOT])]
                if root // self.slots == self.node:
                    at_root = next(i for i, (_, k) in enumerate(g.local) if k == root % self.slots)
                    node_buf = outs[at_root]
                    if ins[at_root] is not node_buf:
                        copy_into(node_buf, ins[at_root], dt)
                else:
                    node_buf = outs[0]
        except (TypeError, ValueError) as exc:  # only a client's garbage gets here
            self._fail(op, A.E_INVALID, f"the node could not reduce it: {exc}")
            return
        except _Mismatch as exc:
            self._fail(op, A.E_MISMATCH, str(exc))
            return
        op.node_buf = node_buf
        if len(g.nodes) == 1 or self.engine is None:
            self._finish(op, None)
            return
        if self._is_session(op):  # the job's agreement: under a name of its sessions
            self._session_start(op)
            return
        op.standing = op.passive  # all its local members are in: it stays so
        self._running[op.key] = op
        for late in self.engine.take_late_errors():  # about ops answered already
            log.warning("an op among the services failed elsewhere after it ended here: %s", late)
        try:
            handle = op.handle = self._among_nodes(op, kind, node_buf, rop, dt, d, parts)
        except Exception as exc:
            self._running.pop(op.key, None)
            self._fail(op, A.E_FAILED, f"the services could not start it: {exc}")
            return
        # Its end is handled on this thread, as the pass's ops' are: the engine's comm
        # thread may end it, and this thread iterates ``_running`` meanwhile.
        handle.add_done_callback(
            lambda h: self._on_arena_thread(lambda: self._finish(op, h.exception(), h))
        )

    def _reduce(self, dst: np.ndarray, ins: list[np.ndarray], rop: ReduceOp, dt: DType) -> None:
        """``dst`` = the local members' inputs reduced (in group order)."""
        if ins[0] is not dst:
            copy_into(dst, ins[0], dt)
        for x in ins[1:]:
            reduce_into(dst, x, rop, dt)

    def _buffers(self, op: _Op, dt: DType, count: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """The local members' input and output buffers (group order), checked to lie in
        their parts of the arena."""
        npdt = dt.numpy
        kind = int(op.first()[A.D_KIND])
        ins: list[np.ndarray] = []
        outs: list[np.ndarray] = []
        for g, k in op.grp.local:
            d = op.descs[k]
            assert d is not None
            n_in = n_out = count
            parts = op.parts[k]
            if kind == _RS:
                assert parts is not None
                n_out = parts[g]
            elif kind == _AG:
                assert parts is not None
                n_in, n_out = parts[g], sum(parts)
            elif kind == _A2A:  # each rank's input its own size
                assert parts is not None
                n_in, n_out = int(d[A.D_COUNT]), sum(parts[len(op.grp.ranks) :])
            lo = self.arena.data_start(k)
            hi = lo + self.arena.data_bytes
            at_in, at_out = int(d[A.D_IN]), int(d[A.D_OUT])
            for at, n in ((at_in, n_in), (at_out, n_out)):
                if not lo <= at <= hi - n * npdt.itemsize:
                    raise ValueError(
                        f"rank {self.node * self.slots + k}'s buffer [{at}, "
                        f"{at + n * npdt.itemsize}) is outside its part of the arena"
                    )
            out = self.arena.view(at_out, n_out, npdt)
            outs.append(out)
            ins.append(
                out if at_in == at_out and n_in == n_out else self.arena.view(at_in, n_in, npdt)
            )
        return ins, outs

    def _look_for_stalls(self) -> None:
        """Warn about ops some of the node's clients submitted long ago and others never
        did (once per ``stall_warning_s``), naming both."""
        self._eject(1.0)  # ops waiting that long: Python's inspector looks at them too
        with self._event_lock:
            self._meet_stalls()
            self._meet_ring_clashes()
        now = time.monotonic()
        self._next_look = now + 1.0
        for op in [o for ops in self._pending.values() for o in ops]:
            if op.over or op.passive or now - max(op.since, op.warned) < self.stall_warning_s:
                continue
            op.warned = now
            d = next(x for x in op.descs if x is not None)
            base = self.node * self.slots
            have = [base + k for k, x in enumerate(op.descs) if x is not None]
            missing = [base + k for _, k in op.grp.local if op.descs[k] is None]
            log.warning(
                "%s #%016x generation %d has waited %.0f s on node %d: ranks %s submitted it, "
                "ranks %s have not", _shape_text(d), op.key[0] & ((1 << 64) - 1), op.key[1],
                now - op.since, self.node, have, missing,
            )  # fmt: skip

    def _left(self, rank: int, why: str, died: bool) -> None:
        """Client rank ``rank`` left or died (-1: the service stops).

        The ops this node has not started need it and fail, and so do later ones until
        a new process takes the rank.  Those the services run fail too if it died (or
        the service stops); if it left, it took part in every op it submitted, so they
        go on.
        """
        if rank in self._gone and not died:
            return
        self._gone[rank] = why
        why = f"rank {rank} {why}" if rank >= 0 else why
        if self._pending or (died and self._running):
            log.info("the arena's ops in flight fail: %s", why)
        if died:
            for op in list(self._running.values()):
                if rank < 0 or rank in op.grp.rankset:
                    self._fail(op, A.E_FAILED, why)
        for ops in list(self._pending.values()):  # kept: the parts still to come fail too
            for op in ops:
                if rank < 0 or rank in op.grp.rankset:
                    self._fail(op, A.E_FAILED, why)

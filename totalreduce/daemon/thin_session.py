"""The arena thread's sessions among the nodes: which session of each node a job is made
of, so that nothing of one job (a death, an error, a frame) can meet the next.

Each node numbers its own sessions (its sets of clients, ``Node.epoch``).  A job is one
session of every node, and its clients' first op, the session agreement (``wire id
SESSION_ID``, an allreduce of their nodes' numbers), is where they meet.  Among the
services that op runs under a name made from the sessions it joins: the *agreement's
name*, of the vector ``V`` of every node's session number as this service knows them.
Session numbers only grow, so no name comes twice: an error or a frame that an old
agreement left in the services' engine (the op failed on one node, and was never
started on another) can never meet a new one.  What each service knows of the others
comes from them, in order, through the engine among the services
(:meth:`~totalreduce.engine.peers.Peers.tell_services`): a client joined the
node's session ``e`` (so ``e`` is under way), a client of session ``e`` died, session
``e`` ended; the last two say under which name ``e`` agreed (0: none yet).

- A node starts its agreement among the services once all its clients submitted it and
  it knows a session under way on every other node (none failed or ended).
- A death fails this node's ops only if it is in the session this one agreed with
  (the same name): a death in a session this one never agreed with (it died waiting
  in ``init()`` while this node had no client, or its notice comes after this node
  started again) is only noted.
- If a session this node agreed with ended or failed under another name, or under none
  (a view of it that was already stale), the agreement cannot end: this node abandons
  that name (aborting it among the services with a reason that says so, so the others
  do the same rather than fail) and agrees again once it knows the sessions under way.
  The clients keep waiting in ``init()``, as for a node whose clients have not come.

When the node's session ends, it says so (with its name) and forgets the names of the
session's ops among the services, so the engine's table of names stays bounded over
jobs.  :class:`Sessions` is a base of :class:`~.thin.ThinService`.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from ..algorithms.codes import OpKind
from ..dtypes import DType, ReduceOp
from ..engine.wire import wire_id
from ..transport import arena as A
from .thin_ops import _SESSION, _Op

log = logging.getLogger("totalreduce.daemon")

#: What another node's session is, as this service knows it.
NONE, UNDER_WAY, FAILED, ENDED = 0, 1, 2, 3
#: Starts the reason of an agreement abandoned (its sessions were not all under way):
#: a service whose agreement fails with it agrees again instead of failing its clients.
MOVED = "the agreement among the services starts again: "
#: Names of ops among the services a session keeps, to forget when it ends (more are
#: left to the engine's table).
MAX_NAMES = 1 << 16


def agreement_name(sessions: tuple[int, ...]) -> int:
    """The name among the services of the agreement of the nodes' ``sessions``."""
    name = A.signed(wire_id("\0session agreement " + " ".join(map(str, sessions))))
    return name or 1


class Sessions:
    """The node's sessions among the nodes (a base of :class:`~.thin.ThinService`)."""

    engine: Any
    node: int
    nodes: int
    slots: int
    size: int
    _world: Any
    _running: dict[tuple[int, int, int], _Op]
    _fast_shapes: dict[tuple[int, ...], Any]
    _engine_op: Any
    _on_arena_thread: Any
    _finish: Any
    _fail: Any
    _left: Any

    def _init_sessions(self) -> None:
        self._epoch = 0  # this node's session, 0: none
        #: every other node's session: [number, NONE / UNDER_WAY / FAILED / ENDED]
        self._views = [[0, NONE] for _ in range(self.nodes)]
        self._agreed = 0  # the name this session agreed under (or is agreeing under)
        self._agreed_v: tuple[int, ...] | None = None  # the sessions that name joins
        self._moved: set[int] = set()  # names this session abandoned
        self._session_op: _Op | None = None  # its agreement, until it is answered
        self._session_seed: np.ndarray | None = None  # the node's part of it
        #: the names of this session's ops among the services, and the last session's
        self._names_used: set[int] = set()
        self._names_before: set[int] = set()

    # ------------------------------------------------------------------ this node

    def _tell(self, what: str, rank: int) -> None:
        """Tell the other services, in order, what this node's session did."""
        if self.engine is not None:
            self.engine.loop.tell_services(what, rank, self._epoch, self._agreed)

    def _session_begins(self, epoch: int) -> None:
        self._epoch = epoch
        self._agreed, self._agreed_v, self._session_op = 0, None, None
        self._moved.clear()

    def _session_ends(self) -> None:
        """The node's last client left: an agreement still running fails (the others
        that agreed with it hear why), the others hear that the session ended, and the
        engine forgets the names of its ops."""
        op = self._session_op
        if op is not None and not op.over:
            self._fail(
                op, A.E_FAILED, f"node {self.node}'s session {self._epoch} ended before the "
                "job's clients had all attached",
            )  # fmt: skip
        self._tell("ended", self.node * self.slots)
        self._session_begins(0)
        self._fast_shapes.clear()  # express records of its ops among the services
        if self.engine is not None:
            for name in self._names_before | self._names_used:
                self.engine.forget_name(name)  # (one still in flight: the next session's)
        self._names_before, self._names_used = self._names_used, set()

    def _note_name(self, name: int) -> None:
        if len(self._names_used) < MAX_NAMES:
            self._names_used.add(name)

    # ------------------------------------------------------------------ the agreement

    def _is_session(self, op: _Op) -> bool:
        d = op.first()
        return (
            op.key[0] == _SESSION and op.key[2] == 0 and int(d[A.D_KIND]) == int(OpKind.ALLREDUCE)
            and int(d[A.D_DTYPE]) == int(DType.INT64) and int(d[A.D_COUNT]) == 1
            and self.engine is not None and self.nodes > 1
        )  # fmt: skip

    def _session_start(self, op: _Op) -> None:
        """The node's part of its agreement is made (in ``op.node_buf``): agree among the
        services once the others' sessions are known."""
        assert op.node_buf is not None
        self._running[op.key] = op
        op.standing = True  # (no stall warning while it waits for the other nodes)
        self._session_op = op
        self._session_seed = op.node_buf.copy()
        self._session_try()

    def _session_try(self) -> None:
        op = self._session_op
        if op is None or op.over or op.handle is not None or op.node_buf is None:
            return
        views = self._views
        if any(views[m][1] != UNDER_WAY for m in range(self.nodes) if m != self.node):
            return  # (a node with no session under way: its clients have not come)
        sessions = tuple(self._epoch if m == self.node else views[m][0] for m in range(self.nodes))
        name = agreement_name(sessions)
        if name in self._moved:
            return  # abandoned: the next news of the others tells what is under way
        assert self._session_seed is not None
        op.node_buf[:] = self._session_seed
        d = op.first()
        try:
            h = self._engine_op(
                (name, 0, 0), self._world, int(OpKind.ALLREDUCE), op.node_buf, ReduceOp.MAX,
                DType.INT64, d,
            )  # fmt: skip
        except Exception as exc:
            self._fail(op, A.E_FAILED, f"the services could not start it: {exc}")
            return
        op.handle, op.standing = h, False
        self._agreed, self._agreed_v = name, sessions
        log.info("session %d: the job is the nodes' sessions %s (agreeing as #%016x)",
                 self._epoch, list(sessions), name & ((1 << 64) - 1))  # fmt: skip
        h.add_done_callback(
            lambda h: self._on_arena_thread(lambda: self._session_ended(op, h, name))
        )

    def _session_ended(self, op: _Op, h: Any, name: int) -> None:
        """The agreement ``op`` under ``name`` ended among the services (this thread)."""
        if op.handle is not h:  # abandoned, or failed here meanwhile
            self.engine.forget_name(name, h.generation)
            return
        error = h.exception()
        if error is not None and MOVED in str(error) and not op.over:
            self._move(name, None)  # another service abandoned it: so does this one
            self.engine.forget_name(name, h.generation)
            self._session_try()
            return
        self._finish(op, error, h)

    def _move(self, name: int, why: str | None) -> None:
        """Abandon the agreement under ``name`` (``why``: this service found it cannot
        end, and aborts it among the services so the others move too)."""
        op = self._session_op
        self._moved.add(name)
        self._agreed, self._agreed_v = 0, None
        if op is None:
            return
        h, op.handle, op.standing = op.handle, None, True
        if why is not None:
            log.info("session %d: %s%s", self._epoch, MOVED, why)
            if h is not None and not h.done():
                self.engine.abort(name, h.generation, MOVED + why)

    # ------------------------------------------------------------------ the others' news

    def _notice(self, what: str, rank: int, epoch: int, agreed: int) -> None:
        """Another node's service said that its client ``rank`` joined (``"joined"``) or
        died (``"died"``) in its session ``epoch``, or that session ended (``"ended"``),
        having agreed under ``agreed`` (0: not)."""
        if not 0 <= rank < self.size or rank // self.slots == self.node:
            return
        m = rank // self.slots
        view = self._views[m]
        if epoch < view[0]:
            return  # older than what this service knows (notices come in order)
        if what == "joined":
            if epoch > view[0]:  # a new session (the last one's end was told first)
                view[:] = [epoch, UNDER_WAY]
            self._session_try()
            return
        view[:] = [epoch, FAILED if what == "died" else ENDED]
        self._stale(m, epoch, what, agreed)
        if what == "died":
            v = self._agreed_v
            if v is not None and v[m] == epoch and agreed == self._agreed:
                # a death in the job: its ops fail here too, now and later
                self._left(rank, "died (its process ended without saying goodbye)", True)

    def _stale(self, m: int, epoch: int, what: str, agreed: int) -> None:
        """Node ``m``'s session ``epoch`` failed or ended under ``agreed``: an agreement
        of this node with it under another name cannot end, and starts again."""
        op, v = self._session_op, self._agreed_v
        if op is None or op.over or v is None or v[m] != epoch or agreed == self._agreed:
            return
        h = op.handle
        if h is not None and h.done() and h.exception() is None:
            return  # it ended (its callback comes): every node was in it
        self._move(self._agreed, f"node {m}'s session {epoch} {what} before it agreed with "
                   f"session {self._epoch} of node {self.node}")  # fmt: skip
        self._session_try()

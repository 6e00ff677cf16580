"""The main loop's peers: ranks that fail, leave, die and come back.

:class:`PeerHooks` is a base of :class:`~.loop.CommLoop`.  A peer that speaks
garbage or whose link fails is a bad peer (``_bad_peer``): every op with it fails,
now and later; one whose process is gone, where the transport can tell
(``alive``), too (``_check_peers``).  A peer that shuts down says goodbye (BYE,
``say_goodbye``): the ops that still need it fail, those with only local work left
finish.  In daemon mode a node's service tells every rank that a client's process
died (GONE, ``peer_gone``) or that a new process has its rank (JOIN, ``rejoin``);
each notice names the process (its incarnation), so a late one about an earlier
process is ignored (``_current``).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import OpFailedError, TotalReduceError, TransportError
from ..transport.base import Transport
from . import wire
from .floating import FloatingList
from .link import Link
from .payload import OpKey, Payload
from .sending import _NO_SHAPE, _RECV
from .wire import BYE, F_AUX, F_WID

if TYPE_CHECKING:
    from .lane import Lane

log = logging.getLogger("totalreduce.engine")


class PeerHooks:
    """The main loop's peers (see the module docstring)."""

    rank: int
    size: int
    world: int
    incarnation: int
    t: Transport
    lane: Lane | None
    lock: threading.Lock
    table: dict[OpKey, Payload]
    floating: FloatingList
    submissions: deque[Any]
    bad_peers: dict[int, TotalReduceError]
    _incarnations: list[int]
    _via: int | None
    _left: set[int]
    #: (rank, "left" or "died"): a node's service hears of its clients' ranks going.
    on_peer_left: Callable[[int, str], None] | None
    on_peer_joined: Callable[[int], None] | None
    _unreachable: set[int]
    _reqs: list[Any]
    _owners: list[tuple[int, Any]]
    _links: list[Link]
    _dirty: set[int]

    # provided by CommLoop and its other bases
    _ring: Callable[[], None]
    _fail: Callable[..., None]
    _control: Callable[..., None]
    _flush: Callable[[], None]
    _poll_requests: Callable[[], bool]
    _drop_floating: Callable[[Any], None]
    _lane_pump: Callable[[], bool]
    _lane_fail_with: Callable[..., None]
    _lane_fail_all: Callable[[BaseException], None]

    # ------------------------------------------------------------------ peers that fail

    def _who(self, rank: int) -> str:
        """A rank in words: the nodes' services (daemon mode) are ranks after the users'."""
        if rank < self.size:
            return f"rank {rank}"
        return f"the service of node {rank - self.size} (rank {rank})"

    def _check_peers(self) -> None:
        """Fail every op of a peer whose process is gone (where the transport can tell)."""
        peers = {w for p in self.table.values() for w in p.spec.group}
        if self.lane is not None:
            peers.update(w for lop in self.lane.ops.values() for w in lop.spec.group)
        peers.discard(self.rank)
        for peer in sorted(peers - set(self.bad_peers)):
            if self.t.alive(peer) is False:
                self._bad_peer(
                    peer,
                    TransportError(
                        f"rank {self.rank}: {self._who(peer)} is gone (its process exited); "
                        "every op with it fails"
                    ),
                )

    def _bad_peer(self, peer: int, err: TotalReduceError, *, reachable: bool = True) -> None:
        """A peer spoke garbage or failed: fail every op it is part of, now and later.

        Its ops' errors still go to it when it can be reached (it may be able to stop its
        own ops); its bodies will not come, so receives posted for it are cancelled.
        """
        if peer in self.bad_peers and peer not in self._left:
            return
        if not reachable:
            self._unreachable.add(peer)
        for p in [p for p in self.table.values() if peer in p.group_rank]:
            self._fail(p, type(err)(f"{p.spec.describe()}: {err}"), tell_peers=True)
        self._lane_fail_with(peer, lambda s: type(err)(f"{s.describe()}: {err}"))
        self.bad_peers[peer] = err
        log.error("%s", err)
        self._cancel_from(peer)
        if peer == self._via:
            self._cut_off(peer)

    def _cancel_from(self, peer: int) -> None:
        """Cancel receives posted for bodies from ``peer``; they complete empty (given up)."""
        for what, obj in self._owners:
            if what == _RECV and obj[0].source == peer:
                self.t.cancel(obj[0].req)

    def _cut_off(self, via: int) -> None:
        """Every message goes through rank ``via`` and it is gone: every op fails."""
        self._lane_fail_all(OpFailedError(f"rank {self.rank}: {self._who(via)} stopped"))
        for p in list(self.table.values()):
            self._fail(
                p,
                OpFailedError(
                    f"rank {self.rank}: {p.spec.describe()}: {self._who(via)} stopped; this "
                    "rank reaches no other rank without it"
                ),
                tell_peers=False,
            )

    # ------------------------------------------------------------------ peers leaving, rejoining

    def say_goodbye(self) -> None:
        """Tell every peer this service stops: their ops with this rank fail at once."""
        with self.lock:
            for peer in range(self.world):
                if peer != self.rank and peer not in self.bad_peers:
                    self._control(peer, BYE, _NO_SHAPE, (self.incarnation, 0))
            self._flush()

    def peer_gone(self, peer: int, incarnation: int = 0) -> None:
        """Daemon mode, a node's service: client rank ``peer``'s process (``incarnation``)
        died (any thread).  Its ops fail here and, told by GONE, on every rank, as if it
        had said BYE."""
        self.submissions.append(("gone", peer, int(incarnation)))
        self._ring()

    def rejoin(self, peer: int, incarnation: int = 0) -> None:
        """Daemon mode, a node's service: a new process (``incarnation``) has client rank
        ``peer`` (any thread).  Every rank that saw the old one leave forgets it (JOIN), and
        a late BYE or GONE of the old one is ignored."""
        self.submissions.append(("rejoin", peer, int(incarnation)))
        self._ring()

    def _on_bye(self, source: int, f: wire.Frame, buf: np.ndarray, off: int) -> None:
        """Rank ``source`` shuts down."""
        if self._current(source, f[F_WID]):  # else an earlier process's goodbye
            self._peer_left(source)

    def _on_gone(self, source: int, f: wire.Frame, buf: np.ndarray, off: int) -> None:
        """A node's service says client rank ``f[F_AUX]``'s process died."""
        peer, inc = f[F_AUX], f[F_WID]
        if 0 <= peer < self.size and peer != self.rank and peer != source:
            if peer not in self._left and self._current(peer, inc):
                self._peer_left(peer, died=True)

    def _on_join(self, source: int, f: wire.Frame, buf: np.ndarray, off: int) -> None:
        """A node's service says a new process has client rank ``f[F_AUX]``."""
        peer, inc = f[F_AUX], f[F_WID]
        if 0 <= peer < self.size and peer != self.rank and peer != source:
            if inc >= self._incarnations[peer]:  # else an earlier process's JOIN
                self._incarnations[peer] = inc
                self._rejoin(peer)

    def _peer_left(self, peer: int, died: bool = False) -> None:
        """Rank ``peer`` shut down: it sends nothing more (every frame it sent has come,
        in order), so the ops that still need it fail; those with only local work left
        finish."""
        why = f"rank {peer} stopped (its service shut down: the program ended or failed)"
        if self.on_peer_left is not None:  # a node's service: its arena ops hear it too
            self.on_peer_left(peer, "died" if died else "left")
        if self._reqs:  # sends it received may not be marked done here yet
            self._poll_requests()
        self.bad_peers[peer] = OpFailedError(f"rank {self.rank}: {why}; ops with it fail")
        self._left.add(peer)
        if self.lane is not None:
            self._lane_pump()  # what it sent before its goodbye has arrived: take it first
        hit = [p for p in self.table.values() if peer in p.group_rank and p.needs(peer)]
        if not hit:
            log.info("rank %d: %s", self.rank, why)
        for p in hit:
            self._fail(p, self._left_error(p, peer), tell_peers=True)
        self._lane_fail_with(
            peer,
            lambda s: OpFailedError(
                f"rank {self.rank}: {s.describe()}: {self._who(peer)} stopped (its service "
                "shut down: the program ended or failed) before it completed"
            ),
            only_needed=True,
        )
        self._cancel_from(peer)
        if peer == self._via:
            self._cut_off(peer)

    def _left_error(self, p: Payload, peer: int) -> OpFailedError:
        return OpFailedError(
            f"rank {self.rank}: {p.spec.describe()}: {self._who(peer)} stopped (its service "
            "shut down: the program ended or failed) before it completed"
        )

    def _current(self, peer: int, incarnation: int) -> bool:
        """Whether a BYE or GONE about client rank ``peer``'s process ``incarnation`` is
        about the process this rank knows.  In daemon mode a node forwards what comes for
        a slot between jobs to the slot's next client, so a goodbye of a rank's process
        from the job before can reach the next job's ranks, before or after the JOIN of
        the rank's new process: only a notice about the process JOIN announced counts.
        """
        if self.world == self.size or peer >= self.size:
            return True  # embedded (no incarnations), or a node's service
        known = self._incarnations[peer]
        return known > 0 and incarnation >= known

    def _announce(self, ftype: int, peer: int, incarnation: int) -> None:
        for world in range(self.world):
            if world not in (self.rank, peer) and world not in self._unreachable:
                self._control(world, ftype, _NO_SHAPE, (incarnation, 0), aux=peer)

    def _rejoin(self, peer: int) -> None:
        """Forget the process that had rank ``peer`` if it left (its ops failed then).

        Between nodes' services a JOIN travels on MPI's control tag and the new
        process's own frames in envelopes on another tag, so MPI does not order them:
        a frame of the new process could be counted before the JOIN resets its
        credits.  Its session agreement at ``init()`` comes first in practice (every
        client waits for it before its first op), which is what the tests exercise.
        """
        if self.on_peer_joined is not None:
            self.on_peer_joined(peer)
        if peer not in self._left and peer not in self.bad_peers:
            return  # never seen leave: nothing to forget (a rank's first process)
        self.bad_peers.pop(peer, None)
        self._left.discard(peer)
        self._unreachable.discard(peer)
        for key in self.floating.keys_from(peer):
            for ff in self.floating.take(key):
                self._drop_floating(ff)
        self._links[peer].reset()
        self._dirty.discard(peer)

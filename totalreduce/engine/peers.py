"""Peers: ranks that fail, leave, die and come back.

:class:`Peers` is an object of :class:`~.loop.CommLoop`'s (``loop.peers``) that owns the
loop's membership: the bad peers (``bad``), those that said goodbye (``left``, a subset)
and those nothing goes to (``unreachable``).  A peer that speaks garbage or whose link
fails is a bad peer (:meth:`~Peers.mark_bad`): every op with it fails, now and later; one
whose process is gone, where the transport can tell (``alive``), too
(:meth:`~Peers.check_alive`).  A peer that shuts down says goodbye (BYE,
:meth:`~Peers.say_goodbye`): the ops that still need it fail, those with only local work left
finish.  Among daemon mode's node services, whose engine has no client ranks,
GONE and JOIN carry what one service saw of its own clients to the others: a
client's process died (``tell_services("died", ...)``), a new process has its
rank (``"joined"``) or the node's session ended (``"ended"``: a JOIN of step 1),
each with the node's session number and the name its session agreed under (the
frame's generation and wire id); the others hear it through ``on_client_notice``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np

from ..errors import OpFailedError, TotalReduceError, TransportError
from ..lane.payload import NO_SHAPE, OpKey
from ..protocol import BYE, F_AUX, F_GEN, F_STEP, F_WID, GONE, JOIN
from .parts import Loop

log = logging.getLogger("totalreduce.engine")


class Peers:
    """The loop's membership (see the module docstring)."""

    def __init__(self, loop: Loop) -> None:
        self._loop = loop
        #: Peers that spoke garbage, failed or left: every op with them fails.
        self.bad: dict[int, TotalReduceError] = {}
        #: Peers that said goodbye (a subset of :attr:`bad`): what they sent before is kept.
        self.left: set[int] = set()
        #: Peers whose link failed: nothing goes to them.
        self.unreachable: set[int] = set()
        #: The engine among daemon services: ("died", "joined" or "ended", client rank,
        #: session, agreement's name) that another service told with GONE or JOIN
        #: (:meth:`tell_services`).
        self.on_client_notice: Callable[[str, int, int, int], None] | None = None

    def who(self, rank: int) -> str:
        """A rank in words (error texts)."""
        return f"rank {rank}"

    def refused(self, source: int) -> bool:
        """What ``source`` sends is not trusted (a bad peer that did not say goodbye)."""
        return source in self.bad and source not in self.left

    def shut_out(self, dest: int) -> bool:
        """Nothing goes to rank ``dest`` (its link failed, or it left)."""
        return dest in self.unreachable or dest in self.left

    def blocking(self, group: tuple[int, ...]) -> TotalReduceError | None:
        """The error of the first bad peer in ``group`` that did not leave (None: none)."""
        bad = self.bad
        if not bad:
            return None
        for world in group:
            if world in bad and world not in self.left:
                return bad[world]
        return None

    # ------------------------------------------------------------------ peers that fail

    def check_alive(self) -> None:
        """Fail every op of a peer whose process is gone (where the transport can tell)."""
        loop = self._loop
        peers: set[int] = set()
        if loop.lane is not None:
            peers.update(w for lop in loop.lane.ops.values() for w in lop.spec.group)
        peers.discard(loop.rank)
        for peer in sorted(peers - set(self.bad)):
            if loop.t.alive(peer) is False:
                self.mark_bad(
                    peer,
                    TransportError(
                        f"rank {loop.rank}: rank {peer} is gone (its process exited); "
                        "every op with it fails"
                    ),
                )

    def mark_bad(self, peer: int, err: TotalReduceError, *, reachable: bool = True) -> None:
        """A peer spoke garbage or failed: fail every op it is part of, now and later.

        Its ops' errors still go to it when it can be reached (it may be able to stop its
        own ops).
        """
        if peer in self.bad and peer not in self.left:
            return
        if not reachable:
            self.unreachable.add(peer)
        loop = self._loop
        if loop.lane is not None:  # its messages are dropped, what it left here freed
            loop.lane.drop_peer(peer)
        loop.lane_errors.fail_with(peer, lambda s: type(err)(f"{s.describe()}: {err}"))
        self.bad[peer] = err
        log.error("%s", err)

    # ------------------------------------------------------------------ peers leaving, rejoining

    def say_goodbye(self) -> None:
        """Tell every peer this service stops: their ops with this rank fail at once."""
        loop = self._loop
        with loop.lock:
            for peer in range(loop.world):
                if peer != loop.rank and peer not in self.bad:
                    loop.control.send(peer, BYE, NO_SHAPE, (0, 0))
            loop.control.flush()

    def tell_services(self, what: str, client: int, session: int = 0, agreed: int = 0) -> None:
        """A node's service (any thread): tell every other service that its client rank
        ``client`` ``"died"`` (GONE), that a new process has it (``"joined"``, JOIN), or
        that the node's session ended (``"ended"``, JOIN of step 1; ``client`` is a rank
        of the node), in the node's session ``session``, whose agreement among the
        services ran under the name ``agreed`` (0: none yet).  In order, as told."""
        ftype = GONE if what == "died" else JOIN
        step = 1 if what == "ended" else 0
        key = (int(agreed) & ((1 << 64) - 1), int(session))
        self._loop.submissions.append(("notice", ftype, int(client), key, step))
        self._loop.ring()

    def on_bye(self, source: int, f: tuple[int, ...], buf: np.ndarray, off: int) -> None:
        """Rank ``source`` shuts down (BYE's handler)."""
        self.left_peer(source)

    def on_gone(self, source: int, f: tuple[int, ...], buf: np.ndarray, off: int) -> None:
        """Another node's service says its client rank ``f[F_AUX]``'s process died."""
        if self.on_client_notice is not None:
            self.on_client_notice("died", int(f[F_AUX]), int(f[F_GEN]), _signed(f[F_WID]))

    def on_join(self, source: int, f: tuple[int, ...], buf: np.ndarray, off: int) -> None:
        """Another node's service says a new process has its client rank ``f[F_AUX]``
        (step 1: that its session ended)."""
        if self.on_client_notice is not None:
            what = "ended" if f[F_STEP] else "joined"
            self.on_client_notice(what, int(f[F_AUX]), int(f[F_GEN]), _signed(f[F_WID]))

    def left_peer(self, peer: int) -> None:
        """Rank ``peer`` shut down: it sends nothing more (every frame it sent has come,
        in order), so the ops that still need it fail; those with only local work left
        finish."""
        loop = self._loop
        why = f"rank {peer} stopped (its service shut down: the program ended or failed)"
        self.bad[peer] = OpFailedError(f"rank {loop.rank}: {why}; ops with it fail")
        self.left.add(peer)
        # Its frames before the goodbye came before it, in the same lane's messages; its
        # bodies travel on tags of their own: one pass tests those still arriving.
        lane = loop.lane
        if lane is not None:
            loop.ops.pump()
        if lane is None or not any(
            peer in lop.spec.group and lane.needs(lop, peer) for lop in lane.ops.values()
        ):
            log.info("rank %d: %s", loop.rank, why)
        loop.lane_errors.fail_with(
            peer,
            lambda s: OpFailedError(
                f"rank {loop.rank}: {s.describe()}: rank {peer} stopped (its service "
                "shut down: the program ended or failed) before it completed"
            ),
            only_needed=True,
        )

    def announce(self, ftype: int, client: int, key: OpKey = (0, 0), step: int = 0) -> None:
        """Send a node's notice (GONE or JOIN) to every service that can be reached."""
        loop = self._loop
        for peer in range(loop.world):
            if peer != loop.rank and peer not in self.unreachable:
                loop.control.send(peer, ftype, NO_SHAPE, key, aux=client, step=step)


def _signed(word: int) -> int:
    """A frame's unsigned 64-bit word as the signed name a node's service gave it."""
    return word - (1 << 64) if word >= 1 << 63 else word

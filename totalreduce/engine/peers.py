"""Peers: ranks that fail, leave, die and come back.

:class:`PeerHooks` is a base of :class:`~.loop.CommLoop`.  A peer that speaks
garbage or whose link fails is a bad peer (``_bad_peer``): every op with it fails,
now and later; one whose process is gone, where the transport can tell
(``alive``), too (``_check_peers``).  A peer that shuts down says goodbye (BYE,
``say_goodbye``): the ops that still need it fail, those with only local work left
finish.  Among daemon mode's node services, whose engine has no client ranks,
GONE and JOIN carry what one service saw of its own clients to the others: a
client's process died (``tell_services("died", ...)``), a new process has its
rank (``"joined"``) or the node's session ended (``"ended"``: a JOIN of step 1),
each with the node's session number and the name its session agreed under (the
frame's generation and wire id); the others hear it through ``on_client_notice``.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import OpFailedError, TotalReduceError, TransportError
from ..lane.payload import NO_SHAPE
from ..protocol import BYE, F_AUX, F_GEN, F_STEP, F_WID, GONE, JOIN
from ..transport.base import Transport

if TYPE_CHECKING:
    from ..lane.lane import Lane

log = logging.getLogger("totalreduce.engine")


class PeerHooks:
    """Peers (see the module docstring)."""

    rank: int
    size: int
    world: int
    t: Transport
    lane: Lane | None
    lock: threading.Lock
    submissions: deque[Any]
    bad_peers: dict[int, TotalReduceError]
    _left: set[int]
    #: The engine among daemon services: ("died", "joined" or "ended", client rank,
    #: session, agreement's name) that another service told with GONE or JOIN
    #: (:meth:`tell_services`).
    on_client_notice: Callable[[str, int, int, int], None] | None
    _unreachable: set[int]

    # provided by CommLoop and its other bases
    _ring: Callable[[], None]
    _control: Callable[..., None]
    _lane_fail_with: Callable[..., None]
    _lane_fail_all: Callable[[BaseException], None]
    _lane_pump: Callable[[], bool]
    _ctl_flush: Callable[[], None]

    # ------------------------------------------------------------------ peers that fail

    def _who(self, rank: int) -> str:
        """A rank in words (error texts)."""
        return f"rank {rank}"

    def _check_peers(self) -> None:
        """Fail every op of a peer whose process is gone (where the transport can tell)."""
        peers: set[int] = set()
        if self.lane is not None:
            peers.update(w for lop in self.lane.ops.values() for w in lop.spec.group)
        peers.discard(self.rank)
        for peer in sorted(peers - set(self.bad_peers)):
            if self.t.alive(peer) is False:
                self._bad_peer(
                    peer,
                    TransportError(
                        f"rank {self.rank}: rank {peer} is gone (its process exited); "
                        "every op with it fails"
                    ),
                )

    def _bad_peer(self, peer: int, err: TotalReduceError, *, reachable: bool = True) -> None:
        """A peer spoke garbage or failed: fail every op it is part of, now and later.

        Its ops' errors still go to it when it can be reached (it may be able to stop its
        own ops).
        """
        if peer in self.bad_peers and peer not in self._left:
            return
        if not reachable:
            self._unreachable.add(peer)
        if self.lane is not None:  # its messages are dropped, what it left here freed
            self.lane.drop_peer(peer)
        self._lane_fail_with(peer, lambda s: type(err)(f"{s.describe()}: {err}"))
        self.bad_peers[peer] = err
        log.error("%s", err)

    # ------------------------------------------------------------------ peers leaving, rejoining

    def say_goodbye(self) -> None:
        """Tell every peer this service stops: their ops with this rank fail at once."""
        with self.lock:
            for peer in range(self.world):
                if peer != self.rank and peer not in self.bad_peers:
                    self._control(peer, BYE, NO_SHAPE, (0, 0))
            self._ctl_flush()

    def tell_services(self, what: str, client: int, session: int = 0, agreed: int = 0) -> None:
        """A node's service (any thread): tell every other service that its client rank
        ``client`` ``"died"`` (GONE), that a new process has it (``"joined"``, JOIN), or
        that the node's session ended (``"ended"``, JOIN of step 1; ``client`` is a rank
        of the node), in the node's session ``session``, whose agreement among the
        services ran under the name ``agreed`` (0: none yet).  In order, as told."""
        ftype = GONE if what == "died" else JOIN
        step = 1 if what == "ended" else 0
        key = (int(agreed) & ((1 << 64) - 1), int(session))
        self.submissions.append(("notice", ftype, int(client), key, step))
        self._ring()

    def _on_bye(self, source: int, f: tuple[int, ...], buf: np.ndarray, off: int) -> None:
        """Rank ``source`` shuts down."""
        self._peer_left(source)

    def _on_gone(self, source: int, f: tuple[int, ...], buf: np.ndarray, off: int) -> None:
        """Another node's service says its client rank ``f[F_AUX]``'s process died."""
        if self.on_client_notice is not None:
            self.on_client_notice("died", int(f[F_AUX]), int(f[F_GEN]), _signed(f[F_WID]))

    def _on_join(self, source: int, f: tuple[int, ...], buf: np.ndarray, off: int) -> None:
        """Another node's service says a new process has its client rank ``f[F_AUX]``
        (step 1: that its session ended)."""
        if self.on_client_notice is not None:
            what = "ended" if f[F_STEP] else "joined"
            self.on_client_notice(what, int(f[F_AUX]), int(f[F_GEN]), _signed(f[F_WID]))

    def _peer_left(self, peer: int) -> None:
        """Rank ``peer`` shut down: it sends nothing more (every frame it sent has come,
        in order), so the ops that still need it fail; those with only local work left
        finish."""
        why = f"rank {peer} stopped (its service shut down: the program ended or failed)"
        self.bad_peers[peer] = OpFailedError(f"rank {self.rank}: {why}; ops with it fail")
        self._left.add(peer)
        # Its frames before the goodbye came before it, in the same lane's messages; its
        # bodies travel on tags of their own: one pass tests those still arriving.
        lane = self.lane
        if lane is not None:
            self._lane_pump()
        if lane is None or not any(
            peer in lop.spec.group and lane.needs(lop, peer) for lop in lane.ops.values()
        ):
            log.info("rank %d: %s", self.rank, why)
        self._lane_fail_with(
            peer,
            lambda s: OpFailedError(
                f"rank {self.rank}: {s.describe()}: rank {peer} stopped (its service "
                "shut down: the program ended or failed) before it completed"
            ),
            only_needed=True,
        )

    def _announce(
        self, ftype: int, client: int, key: tuple[int, int] = (0, 0), step: int = 0
    ) -> None:
        for peer in range(self.world):
            if peer != self.rank and peer not in self._unreachable:
                self._control(peer, ftype, NO_SHAPE, key, aux=client, step=step)


def _signed(word: int) -> int:
    """A frame's unsigned 64-bit word as the signed name a node's service gave it."""
    return word - (1 << 64) if word >= 1 << 63 else word

"""The stall inspector: ops that stopped moving, and whom they wait for.

:class:`StallInspector` is an object of :class:`~.loop.CommLoop`'s (``loop.stalls``) that
owns its timers.  A pass runs it a few times per ``stall_warning_s`` at most
(``run_once``, when :attr:`~StallInspector.last` is :attr:`~StallInspector.every`
seconds old): halfway to the warning a stalled op asks its group who has submitted it
(PROBE; submitted ranks answer HAVE), so the warning (``stall_warning_s``) names the
ranks that have not, not only the neighbour the op waits on; with ``stall_shutdown_s``
the op fails.  The texts of a ``wait(timeout=...)`` that ran out and of ``stalled()``
say whom each op waits for.

The loop's owner may :meth:`~StallInspector.watch` the probes: then a stalled op probes
its group every ``every_s`` seconds from the start (besides the probe halfway to the
warning), its PROBE carries the owner's note of it (``note(spec)``: bytes), and a PROBE of
an op this rank never had (neither in flight nor completed) goes to the owner's
``stray(source, key, body)`` (on the comm thread, with the loop's lock held): a node's
service finds there ranks of its node that gave the op's name and generation another group.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import OpTimeoutError
from ..lane.payload import NO_SHAPE, OpSpec
from ..protocol import F_GEN, F_NBYTES, F_WID, HAVE, PROBE
from .parts import Loop

if TYPE_CHECKING:
    from ..lane.lane import LaneOp

log = logging.getLogger("totalreduce.engine")


class StallInspector:
    """The stall inspector of one loop (see the module docstring)."""

    def __init__(self, loop: Loop) -> None:
        self._loop = loop
        cfg = loop.cfg
        stall = [x for x in (cfg.stall_warning_s, cfg.stall_shutdown_s) if x > 0]
        #: Seconds between two checks: a quarter of the shortest limit, at most 1 s.
        self.every: float = min([1.0] + [x / 4 for x in stall])
        #: When the last check ran (``time.monotonic()``); the loop's fast paths step aside
        #: for a pass once it is :attr:`every` seconds old.
        self.last: float = time.monotonic()
        #: The owner's note of an op for its probes (:meth:`watch`).
        self.note: Callable[[OpSpec], bytes] | None = None
        #: The owner's handler of a probe of an op this rank never had (:meth:`watch`).
        self.stray: Callable[[int, tuple[int, int], bytes], None] | None = None
        #: Seconds between a watched op's early probes (0: none, only the halfway one).
        self.early_s: float = 0.0
        #: When each op in flight last probed early (:meth:`watch`).
        self._early: dict[tuple[int, int], float] = {}

    def watch(
        self, note: Callable[[OpSpec], bytes], stray: Callable[[int, tuple[int, int], bytes], None],
        every_s: float = 1.0,
    ) -> None:  # fmt: skip
        """Probe stalled ops every ``every_s`` seconds, each PROBE with ``note(spec)`` as
        its body, and hand a probe of an op this rank never had to ``stray`` (see the
        module docstring)."""
        self.note, self.stray, self.early_s = note, stray, every_s
        self.every = min(self.every, every_s)

    # ------------------------------------------------------------------ stalls

    def check(self, now: float) -> None:
        """Probe, warn about and (with ``stall_shutdown_s``) fail lane ops that stopped
        moving.  Halfway to the warning, a stalled op asks its group who has submitted it
        (PROBE; submitted ranks answer HAVE), so the warning names the ranks that have
        not, not only the neighbour the op waits on."""
        loop = self._loop
        warn, shut = loop.cfg.stall_warning_s, loop.cfg.stall_shutdown_s
        first = min(x for x in (warn, shut, float("inf")) if x > 0)
        lane = loop.lane
        if lane is None:
            return
        early = self.early_s
        if early > 0 and self._early:
            self._early = {k: t for k, t in self._early.items() if k in lane.by_key}
        for lop in list(lane.ops.values()):
            spec = lop.spec
            if spec.passive:
                continue  # a window's standing receive waits as long as its peer likes
            idle = now - lop.t0
            if not lop.probed and idle >= first / 2:
                lop.probed = True
                self._probe(spec)
            elif early > 0 and idle >= early and now - self._early.get(spec.key, 0.0) >= early:
                self._early[spec.key] = now
                self._probe(spec)
            timeout = self._verdict(lop, idle, warn, shut)
            if timeout is not None:
                loop.lane_errors.fail(lop, timeout, tell_peers=True)
            elif warn > 0 and idle >= warn:
                lop.warned = True

    def _probe(self, spec: OpSpec) -> None:
        """Ask op ``spec``'s group who has submitted it (PROBE, with the owner's note)."""
        loop = self._loop
        shape = (int(spec.dtype), int(spec.kind), int(spec.algorithm), int(spec.op),
                 spec.count, spec.param, spec.context)  # fmt: skip
        body = b""
        if self.note is not None:
            try:
                body = self.note(spec)
            except Exception:  # a note is a hint: never stop the loop for it
                log.debug("no note for %s", spec.key, exc_info=True)
        for world in spec.group:
            if world != loop.rank:
                loop.control.send(world, PROBE, shape, spec.key, body=body)

    def _verdict(self, lop: LaneOp, idle: float, warn: float, shut: float) -> OpTimeoutError | None:
        """An op idle for ``idle`` s: the timeout error to fail it with past
        ``stall_shutdown_s``; else, past ``stall_warning_s``, a warning logged once (the
        caller marks the op warned)."""
        spec = lop.spec
        if shut > 0 and idle >= shut:
            return OpTimeoutError(
                f"{spec.describe()}: no progress for {idle:.0f} s "
                f"(stall_shutdown_s={shut:g}); {self._text(lop)}"
            )
        if warn > 0 and idle >= warn and not lop.warned:
            log.warning(
                "rank %d: %s made no progress for %.0f s; %s",
                self._loop.rank, spec.describe(), idle, self._text(lop),
            )  # fmt: skip
        return None

    def _text(self, lop: LaneOp) -> str:
        """Whom a stalled op waits for."""
        loop = self._loop
        lane = loop.lane
        assert lane is not None
        recv_from = lane.waiting_on(lop)
        # After the probe every rank that submitted the op has answered HAVE: the others are
        # missing, whether this rank waits on them or on a rank that waits on them.
        missing = [w for w in lop.spec.group if w != loop.rank and w not in lop.have]
        text = f"ranks {missing} have not submitted it; " if missing and lop.probed else ""
        return text + f"it waits for frames from ranks {recv_from}"

    def on_probe(self, source: int, f: tuple[int, ...], buf: np.ndarray, off: int) -> None:
        """A stalled op's rank asks who has submitted it: answer HAVE if this rank has."""
        loop = self._loop
        key = (f[F_WID], f[F_GEN])
        if key in loop.failures.completed or (loop.lane is not None and key in loop.lane.by_key):
            loop.control.send(source, HAVE, NO_SHAPE, key)
        elif self.stray is not None and f[F_NBYTES]:
            try:
                self.stray(source, key, bytes(buf[off : off + f[F_NBYTES]]))
            except Exception:  # the owner's look must not stop the loop
                log.exception("rank %d: the look at a probe of %s failed", loop.rank, key)

    def on_have(self, source: int, f: tuple[int, ...], buf: np.ndarray, off: int) -> None:
        """Rank ``source`` has submitted the op this rank probed for."""
        lane = self._loop.lane
        if lane is not None and (f[F_WID], f[F_GEN]) in lane.by_key:
            lop = lane.by_key[(f[F_WID], f[F_GEN])]
            have = lop.have if isinstance(lop.have, set) else set(lop.have)
            have.add(source)
            lop.have = have

    # ------------------------------------------------------------------ for error messages

    def stalled(self) -> list[str]:
        """Descriptions of the ops in flight and whom they wait for (for error messages)."""
        loop = self._loop
        out = []
        with loop.lock:  # the comm thread may be in a pass
            lane = loop.lane
            if lane is not None:
                for lop in list(lane.ops.values()):
                    if lop.spec.passive:
                        continue
                    recv_from = lane.waiting_on(lop)
                    out.append(f"{lop.spec.describe()} waits for ranks {recv_from}")
        return out

    def waiting_for(self, spec: OpSpec) -> list[int]:
        """World ranks op ``spec`` still expects frames from ([] once it left the lane)."""
        loop = self._loop
        with loop.lock:  # another thread may be in a pass
            lane = loop.lane
            lop = None if lane is None else lane.by_key.get(spec.key)
            if lane is not None and lop is not None and lop.spec is spec:
                return lane.waiting_on(lop)
        return []

    def timeout_error(
        self, spec: OpSpec | None, name: Any, generation: int, timeout: float
    ) -> OpTimeoutError:
        """The error of a ``wait(timeout=...)`` that ran out, naming whom the op waits for."""
        loop = self._loop
        who = ""
        with loop.lock:  # another thread may be in a pass
            lane = loop.lane
            lop = None if spec is None or lane is None else lane.by_key.get(spec.key)
            if lane is not None and lop is not None:
                who = f"; it waits for frames from ranks {lane.waiting_on(lop)}"
        return OpTimeoutError(
            f"op {name!r} generation {generation} did not complete within {timeout} s on rank "
            f"{loop.rank}{who} (it stays in flight; wait again or check the peers)"
        )

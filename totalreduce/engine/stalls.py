"""The stall inspector of the main loop: ops that stopped moving, and whom they wait for.

:class:`StallHooks` is a base of :class:`~.loop.CommLoop`.  Every pass checks, a few
times per ``stall_warning_s`` at most (``run_once``), the ops in flight: halfway to
the warning a stalled op asks its group who has submitted it (PROBE; submitted
ranks answer HAVE), so the warning (``stall_warning_s``) names the ranks that have
not, not only the neighbour the op waits on; with ``stall_shutdown_s`` the op fails.
An op a peer gave up sending to fails here if its peer's error does not come.  The
texts of a ``wait(timeout=...)`` that ran out and of ``stalled()`` say whom each op
waits for.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import OpFailedError, OpTimeoutError
from . import wire
from .payload import OpKey, OpSpec, Payload
from .sending import _NO_SHAPE
from .wire import F_GEN, F_WID, HAVE, PROBE

if TYPE_CHECKING:
    from .lane import Lane

log = logging.getLogger("totalreduce.engine")


class StallHooks:
    """The stall inspector of the main loop (see the module docstring)."""

    rank: int
    cfg: Any  # totalreduce.config.Config
    lane: Lane | None
    lock: threading.Lock
    table: dict[OpKey, Payload]
    completed: OrderedDict[OpKey, tuple[Any, ...]]

    # provided by CommLoop and its other bases
    _fail: Callable[..., None]
    _control: Callable[..., None]
    _lane_stalls: Callable[[float, float, float, float], None]

    # ------------------------------------------------------------------ stalls

    def _check_stalls(self, now: float) -> None:
        """Probe, warn about and (with ``stall_shutdown_s``) fail ops that stopped moving.

        Halfway to the warning, a stalled op asks its group who has submitted it
        (PROBE; submitted ranks answer HAVE), so the warning names the ranks that
        have not, not only the neighbour the op waits on.
        """
        warn, shut = self.cfg.stall_warning_s, self.cfg.stall_shutdown_s
        first = min(x for x in (warn, shut, float("inf")) if x > 0)
        self._lane_stalls(now, first, warn, shut)
        for p in list(self.table.values()):
            if p.spec.passive:
                continue  # a window's standing receive waits as long as its peer likes
            if p.given_up is not None and now - p.given_up[0] > 1.0:
                self._fail(p, OpFailedError(p.given_up[1]), tell_peers=True)
                continue
            idle = now - p.last_progress
            if not p.probed and idle >= first / 2:
                p.probed = True
                for world in p.spec.group:
                    if world != self.rank and world not in p.heard:
                        self._control(world, PROBE, p.shape, p.key)
            timeout = self._stall_verdict(
                p.spec, idle, warn, shut, p.warned, functools.partial(self._stall_text, p)
            )
            if timeout is not None:
                self._fail(p, timeout, tell_peers=True)
            elif warn > 0 and idle >= warn:
                p.warned = True

    def _stall_verdict(
        self,
        spec: OpSpec,
        idle: float,
        warn: float,
        shut: float,
        warned: bool,
        text: Callable[[], str],
    ) -> OpTimeoutError | None:
        """An op idle for ``idle`` s: the timeout error to fail it with past
        ``stall_shutdown_s``; else, past ``stall_warning_s``, a warning logged once (the
        caller marks the op warned).  For the main loop's ops and the lane's alike."""
        if shut > 0 and idle >= shut:
            return OpTimeoutError(
                f"{spec.describe()}: no progress for {idle:.0f} s "
                f"(stall_shutdown_s={shut:g}); {text()}"
            )
        if warn > 0 and idle >= warn and not warned:
            log.warning(
                "rank %d: %s made no progress for %.0f s; %s",
                self.rank, spec.describe(), idle, text(),
            )  # fmt: skip
        return None

    def _stall_text(self, p: Payload) -> str:
        recv_from, send_to = p.waiting_on()
        missing = p.missing(self.rank)
        text = f"ranks {missing} have not submitted it; " if missing else ""
        text += f"it waits for frames from ranks {recv_from}"
        if send_to:
            text += f" and has frames for ranks {send_to}"
        return text

    def _on_probe(self, source: int, f: wire.Frame, buf: np.ndarray, off: int) -> None:
        """A stalled op's rank asks who has submitted it: answer HAVE if this rank has."""
        key = (f[F_WID], f[F_GEN])
        if (
            key in self.table
            or key in self.completed
            or (self.lane is not None and key in self.lane.by_key)
        ):
            self._control(source, HAVE, _NO_SHAPE, key)

    def _on_have(self, source: int, f: wire.Frame, buf: np.ndarray, off: int) -> None:
        """Rank ``source`` has submitted the op this rank probed for."""
        p = self.table.get((f[F_WID], f[F_GEN]))
        if p is not None:
            p.have.add(source)
        elif self.lane is not None and (f[F_WID], f[F_GEN]) in self.lane.by_key:
            lop = self.lane.by_key[(f[F_WID], f[F_GEN])]
            have = lop.have if isinstance(lop.have, set) else set(lop.have)
            have.add(source)
            lop.have = have

    # ------------------------------------------------------------------ for error messages

    def stalled(self) -> list[str]:
        """Descriptions of the ops in flight and whom they wait for (for error messages)."""
        out = []
        with self.lock:  # the comm thread may be in a pass
            for p in list(self.table.values()):
                if p.spec.passive:
                    continue
                recv_from, _ = p.waiting_on()
                out.append(f"{p.spec.describe()} waits for ranks {recv_from}")
            if self.lane is not None:
                for lop in list(self.lane.ops.values()):
                    if lop.spec.passive:
                        continue
                    recv_from = self.lane.waiting_on(lop)
                    out.append(f"{lop.spec.describe()} waits for ranks {recv_from}")
        return out

    def waiting_for(self, spec: OpSpec) -> list[int]:
        """World ranks op ``spec`` still expects frames from, in the main loop or the
        compiled lane ([] once it left both)."""
        with self.lock:  # another thread may be in a pass
            p = self.table.get(spec.key)
            if p is not None:
                return p.waiting_on()[0]
            lane = self.lane
            lop = None if lane is None else lane.by_key.get(spec.key)
            if lane is not None and lop is not None and lop.spec is spec:
                return lane.waiting_on(lop)
        return []

    def timeout_error(
        self, spec: OpSpec | None, name: Any, generation: int, timeout: float
    ) -> OpTimeoutError:
        """The error of a ``wait(timeout=...)`` that ran out, naming whom the op waits for."""
        who = ""
        with self.lock:  # another thread may be in a pass
            p = None if spec is None else self.table.get(spec.key)
            lane = self.lane
            lop = None if spec is None or lane is None else lane.by_key.get(spec.key)
            if p is not None:
                recv_from, send_to = p.waiting_on()
                who = f"; it waits for frames from ranks {recv_from}"
                if send_to:
                    who += f" and has frames for ranks {send_to}"
            elif lane is not None and lop is not None:
                who = f"; it waits for frames from ranks {lane.waiting_on(lop)}"
        return OpTimeoutError(
            f"op {name!r} generation {generation} did not complete within {timeout} s on rank "
            f"{self.rank}{who} (it stays in flight; wait again or check the peers)"
        )

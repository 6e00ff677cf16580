"""The stall inspector: ops that stopped moving, and whom they wait for.

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

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import OpTimeoutError
from ..lane.payload import NO_SHAPE, OpKey, OpSpec
from ..protocol import F_GEN, F_WID, HAVE

if TYPE_CHECKING:
    from ..lane.lane import Lane

log = logging.getLogger("totalreduce.engine")


class StallHooks:
    """The stall inspector (see the module docstring)."""

    rank: int
    cfg: Any  # totalreduce.config.Config
    lane: Lane | None
    lock: threading.Lock
    completed: OrderedDict[OpKey, tuple[Any, ...]]

    # provided by CommLoop and its other bases
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
        caller marks the op warned)."""
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

    def _on_probe(self, source: int, f: tuple[int, ...], buf: np.ndarray, off: int) -> None:
        """A stalled op's rank asks who has submitted it: answer HAVE if this rank has."""
        key = (f[F_WID], f[F_GEN])
        if key in self.completed or (self.lane is not None and key in self.lane.by_key):
            self._control(source, HAVE, NO_SHAPE, key)

    def _on_have(self, source: int, f: tuple[int, ...], buf: np.ndarray, off: int) -> None:
        """Rank ``source`` has submitted the op this rank probed for."""
        if self.lane is not None and (f[F_WID], f[F_GEN]) in self.lane.by_key:
            lop = self.lane.by_key[(f[F_WID], f[F_GEN])]
            have = lop.have if isinstance(lop.have, set) else set(lop.have)
            have.add(source)
            lop.have = have

    # ------------------------------------------------------------------ for error messages

    def stalled(self) -> list[str]:
        """Descriptions of the ops in flight and whom they wait for (for error messages)."""
        out = []
        with self.lock:  # the comm thread may be in a pass
            if self.lane is not None:
                for lop in list(self.lane.ops.values()):
                    if lop.spec.passive:
                        continue
                    recv_from = self.lane.waiting_on(lop)
                    out.append(f"{lop.spec.describe()} waits for ranks {recv_from}")
        return out

    def waiting_for(self, spec: OpSpec) -> list[int]:
        """World ranks op ``spec`` still expects frames from ([] once it left the lane)."""
        with self.lock:  # another thread may be in a pass
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
            lane = self.lane
            lop = None if spec is None or lane is None else lane.by_key.get(spec.key)
            if lane is not None and lop is not None:
                who = f"; it waits for frames from ranks {lane.waiting_on(lop)}"
        return OpTimeoutError(
            f"op {name!r} generation {generation} did not complete within {timeout} s on rank "
            f"{self.rank}{who} (it stays in flight; wait again or check the peers)"
        )

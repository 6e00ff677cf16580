"""Thread lifecycle: start a service's comm thread, and shut it down.

The comm thread runs the engine's :class:`~totalreduce.engine.loop.CommLoop` and its
compiled lane (threads blocked in ``wait()`` run them too; the lane does its own
arithmetic, so there is no reduce thread).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Any

import numpy as np

from ..engine.loop import CommLoop
from ..engine.wire import wire_id
from ..errors import InvalidArgumentError, NotInitializedError, TotalReduceError
from ..group import Group
from ..transport.base import Transport
from .config import Config
from .names import NameTable
from .records import Records
from .submit import OpSubmitter

log = logging.getLogger("totalreduce.service")


class Lifecycle(OpSubmitter):
    """Starts (:meth:`_start`) and stops (:meth:`shutdown`) the threads of a service."""

    def _start(self, transport: Transport, config: Config) -> None:
        """Set up the name table and the rest; start the engine, unless this is a daemon
        client (which runs none: the node's service runs its ops)."""
        shared = getattr(transport, "options", None)
        if shared:  # a client of a daemon world: the service's engine options hold
            config = config.joining(shared, getattr(transport, "socket_path", "the service"))
        self.config = config
        self.transport = transport
        self._windows: Any = None  # made by the first window call (Service.windows)
        self._windows_lock = threading.Lock()
        # (algorithm asked, group, bytes, dtype, count, avg) -> (code, schedule) of an
        # allreduce: a training step repeats its shapes, and choosing costs more than a frame.
        self._routes: dict[tuple[Any, ...], tuple[Any, Any]] = {}
        # (name, op, in place) -> what a repeat of that allreduce needs (service/express.py),
        # within config.express_bytes (service/records.py)
        self._express: dict[tuple[Any, ...], Any] = Records(config.express_bytes)
        self.rank = transport.rank
        self.size = transport.size
        self._names = NameTable()
        self._closed = False
        #: whether an op that completed here but failed elsewhere raises at the next call
        #: (a node's service logs them instead: :meth:`Service.quiet_late_errors`)
        self._raise_late = True
        self._stop = threading.Event()
        self._world_group = Group.world(self.size)
        # Daemon mode: the node's session is mixed into every op's wire id, so a new job
        # never meets what the services remember of an old one.
        self._salt = 0
        self._loop = None
        self._engine_lock = threading.Lock()
        self._trace: Any = None  # the timeline recorder, when one records
        if config.timeline:
            from ..timeline import Timeline

            self._trace = Timeline(config.timeline, self.rank)
        link = getattr(transport, "arena", None)  # a daemon's client: the node's arena
        if link is None:
            self._thin = None
            self._start_engine()
            return
        from .thin import ThinClient

        self._thin = ThinClient(link)
        self._thin.trace = self._trace
        self._join_session(int(getattr(transport, "epoch", 0)))

    def _start_engine(self) -> CommLoop:
        """Start the engine: the loop, its compiled lane, and the comm thread (once; any
        thread)."""
        with self._engine_lock:
            if self._loop is not None:
                return self._loop
            if self._closed:
                raise NotInitializedError("totalreduce was shut down; call init() again to use it")
            if getattr(self, "_thin", None) is not None:
                raise TotalReduceError(
                    f"rank {self.rank} is a daemon client: it runs no engine (its node's service "
                    f"at {getattr(self.transport, 'socket_path', '?')} runs its ops)"
                )
            cfg, transport = self.config, self.transport
            loop = CommLoop(transport, cfg)
            bind = getattr(transport, "native_binding", None)  # compiled code calls it
            if bind is None:
                raise TotalReduceError(
                    f"the transport {getattr(transport, 'description', type(transport).__name__)}"
                    " has no compiled binding: the compiled lane, which runs every op, cannot "
                    "run over it"
                )
            from ..lane.lane import Lane
            from ..protocol import BODY_TAG_BASE, LANE_BODY_SPAN

            # The lane's bodies have tags of their own, from BODY_TAG_BASE, where MPI's
            # tags reach that far (Lane.why_not names what cannot run without them).
            body_tag = BODY_TAG_BASE
            if body_tag + LANE_BODY_SPAN - 1 > int(getattr(transport, "tag_ub", 0)):
                body_tag = -1
            lane = Lane(
                bind(),
                self.rank,
                self.size,
                cfg.micro_bytes,
                pool_bytes=cfg.floating_pool_bytes,
                segment_bytes=cfg.segment_bytes,
                body_tag=body_tag,
                plan_bytes=cfg.lane_plan_bytes,
            )
            lane.tag_ub = int(getattr(transport, "tag_ub", 0))
            loop.attach_lane(lane)
            loop.trace = self._trace
            self._comm_thread = threading.Thread(
                target=self._run_loop, name=f"totalreduce-comm-{self.rank}", daemon=True
            )
            self._loop = loop
            self._comm_thread.start()
            return loop

    def _join_session(self, epoch: int) -> None:
        """Daemon mode: agree with every client of the job on its session, before any op.

        Each node counts its own sessions (its sets of clients); the job's clients take
        the largest of their nodes' numbers and mix it into every op's wire id, so a
        job that reuses the names of an earlier one never meets what the services
        remember of it.  Returns when every client of the job has attached (as
        ``MPI_Init`` does), warning every ``stall_warning_s`` while it waits.  The
        agreement is a hierarchical allreduce (max) on the thin path.
        """
        from ..algorithms.codes import OpKind
        from ..dtypes import DType, ReduceOp
        from ..engine.wire import SESSION_ID
        from ..errors import OpTimeoutError
        from .thin import ThinHandle

        thin = self._thin
        assert thin is not None  # a daemon world's client
        x = np.array([epoch], dtype=np.int64)
        at, staged = thin.place(x, fill=x)
        out = np.empty_like(x)
        handle = ThinHandle(thin, "totalreduce session", 0, OpKind.ALLREDUCE, out, lambda: None)
        handle.hold((staged,) if staged >= 0 else (), out, staged)
        thin.submit(
            handle, wire=SESSION_ID, dtype=DType.INT64, count=1, op=ReduceOp.MAX, root=0,
            priority=0, at_in=at, at_out=at, unnamed=True,
        )  # fmt: skip
        waited = 0.0
        try:
            while True:
                try:
                    handle.wait(max(1.0, self.config.stall_warning_s))
                    break
                except OpTimeoutError:
                    waited += max(1.0, self.config.stall_warning_s)
                    log.warning(
                        "rank %d: init() has waited %.0f s for the other clients of the job to "
                        "attach to their nodes' services (%s)", self.rank, waited,
                        getattr(self.transport, "socket_path", "the service"),
                    )  # fmt: skip
        except BaseException:
            self.shutdown(timeout=0)
            raise
        self._salt = wire_id(f"\0session {int(out[0])}")
        self._express.clear()  # their wire ids had the old salt

    def _run_loop(self) -> None:
        self.loop.driving.run(self._stop)

    def shutdown(self, timeout: float | None = None) -> None:
        """Let in-flight ops finish (up to ``timeout``), then stop the threads.

        Ops still in flight after the timeout fail with an error naming them.
        """
        if self._closed:
            return
        limit = self.config.shutdown_timeout_s if timeout is None else timeout
        if timeout is None and getattr(sys, "last_value", None) is not None:
            limit = 0.0  # the program is dying of an exception: do not keep peers waiting
        deadline = time.monotonic() + limit
        if self._windows is not None:  # freed with the neighbours while they still listen
            self._windows.close(limit)
        self._closed = True
        if self._thin is not None:  # the node's service has these: wait for them too
            for h in self._thin.in_flight():
                if h.passive:  # may never end (a failed op's other pieces)
                    continue
                try:
                    h.wait(max(0.0, deadline - time.monotonic()))
                except Exception:
                    pass
            self._thin.close()
        with self._engine_lock:  # no engine starts from here on (_closed is set)
            pass
        if self._loop is None:  # a daemon client
            if self._trace is not None:
                self._trace.close()
            self.transport.close()
            return
        while (self.loop.busy or self.loop.sending) and time.monotonic() < deadline:
            self.loop.driving.poll()
            time.sleep(0.0005)
        # Let the last control messages (credit, errors) leave.
        for _ in range(20):
            self.loop.driving.poll()
        left = self.loop.stalls.stalled()
        self._stop.set()
        self.loop.notify()
        self._comm_thread.join(timeout=10)
        if left:
            err = TotalReduceError(f"shut down with ops in flight: {'; '.join(left)}")
            log.error("%s", err)
            self.loop.failures.fail_all(err)
        self.loop.peers.say_goodbye()
        # Let the goodbyes (and what is queued before them) leave, and every send complete:
        # the transport must not close, nor the buffers go, under a send still in flight.
        deadline = time.monotonic() + 1.0
        while (self.loop.sending or self.loop.sends_in_flight) and time.monotonic() < deadline:
            self.loop.driving.poll()
            time.sleep(0.001)
        if self.loop.trace is not None:
            self.loop.trace.close()
        self.transport.close()

    def start_timeline(self, path: str) -> None:
        """Record a timeline of this rank's ops into ``path`` from now on (Horovod's
        ``start_timeline``; ``TOTALREDUCE_TIMELINE`` does it from the start).  One that
        is recording ends first."""
        from ..timeline import Timeline

        if not isinstance(path, str) or not path:
            raise InvalidArgumentError(f"start_timeline: path must be a file path, got {path!r}")
        self.stop_timeline()
        self._set_trace(Timeline(path, self.rank))

    def stop_timeline(self) -> None:
        """Stop recording the timeline and write the rest of it (nothing if none records)."""
        old = self._trace
        self._set_trace(None)
        if old is not None:
            old.close()

    @property
    def timeline(self) -> Any:
        """The timeline recorder in use (a :class:`totalreduce.timeline.Timeline`), or None
        when none records."""
        return self._trace

    def _set_trace(self, trace: Any) -> None:
        """Record into ``trace`` from now on (None: stop), here and in the running engine."""
        self._trace = trace
        if self._thin is not None:
            self._thin.trace = trace
        lp = self._loop
        if lp is not None:
            with lp.lock:  # the comm thread reads the recorder only inside a pass
                lp.trace = trace

    @property
    def closed(self) -> bool:
        return self._closed

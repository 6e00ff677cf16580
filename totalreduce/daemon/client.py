"""The client of a node's service: the embedded API, served by another process.

A :class:`DaemonClient` is what ``totalreduce.init(service="daemon")`` returns.
It has the methods of the embedded :class:`~totalreduce.Service`
(``allreduce_async``, ``broadcast_async``, ``barrier_async``, their blocking
forms, ``rank``, ``size``, ``shutdown``), so code written against the
embedded mode runs unchanged; ``rank`` and ``size`` count training processes
(``node * N + local rank`` of ``nodes * N``).

Data path.  Arrays from :meth:`DaemonClient.empty` live in shared memory the
service has mapped: submitting them sends a few dozen bytes over the socket
and copies nothing.  Any other array is copied once into a staging region
(also shared), and a result that has no registered ``out`` is copied once out
of it.  Completion is a flag in the client's control block: ``done()`` reads it
from memory, ``wait()`` polls it with a backoff from 1 us up to 1 ms (checking
now and then that the service is still there), never spinning a core.

Errors match the embedded mode's: bad arguments raise at the call, before
anything is sent; an op's failure (on any node) is raised by ``wait()``; a
service that goes away fails every op in flight.

>>> c = DaemonClient("/run/user/1000/totalreduce/node0.sock")   # doctest: +SKIP
>>> g = c.empty(1 << 20, np.float32)     # registered once, reused every step  # doctest: +SKIP
>>> h = c.allreduce_async(g, name="fc1.grad", op="avg", out=g)                 # doctest: +SKIP
>>> h.wait() is g                                                               # doctest: +SKIP
"""

from __future__ import annotations

import atexit
import bisect
import logging
import os
import select
import socket
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from ..dtypes import DType, ReduceOp
from ..errors import (
    InvalidArgumentError,
    NotInitializedError,
    OpFailedError,
    OpMismatchError,
    OpTimeoutError,
    TotalReduceError,
)
from ..service.service import as_array, reduce_op
from . import protocol, shm
from .sockets import find_socket
from .timing import precise_sleeps

log = logging.getLogger("totalreduce.daemon.client")

ENV_LOCAL_RANK = "TOTALREDUCE_LOCAL_RANK"
DEFAULT_SLOTS = 8192
_STAGING_MIN = 8 << 20
_STAGING_MAX = 1 << 30
_LIVENESS_S = 0.05
# wait(): sleep this short, then block on the wake-up descriptor instead
_BLOCK_AFTER_S = 64e-6
_ERRORS: dict[int, type[TotalReduceError]] = {
    shm.ERROR_FAILED: OpFailedError,
    shm.ERROR_MISMATCH: OpMismatchError,
    shm.ERROR_INVALID: InvalidArgumentError,
    shm.ERROR_OTHER: TotalReduceError,
}


class DaemonHandle:
    """One op submitted to the service; the daemon-mode twin of :class:`~totalreduce.Handle`.

    ``done()`` reads the op's completion flag in shared memory (no system
    call); ``wait(timeout=None)`` polls it with a growing sleep and returns the
    result, raises the op's error, or raises
    :class:`~totalreduce.OpTimeoutError` (the op stays in flight).
    """

    __slots__ = (
        "name",
        "generation",
        "_client",
        "_slot",
        "_seq",
        "_ended",
        "_error",
        "_result",
        "_finish",
        "_then",
        "__weakref__",
    )

    def __init__(
        self,
        client: DaemonClient,
        name: str | int,
        generation: int,
        slot: int,
        seq: int,
        result: Any,
        finish: Callable[[bool], Any] | None,
    ) -> None:
        self.name = name
        self.generation = generation
        self._client = client
        self._slot = slot
        self._seq = seq
        self._ended = False
        self._error: BaseException | None = None
        self._result = result
        self._finish = finish
        self._then: list[Callable[[DaemonHandle], None]] = []

    def done(self) -> bool:
        """True once the op completed or failed."""
        if self._ended:
            return True
        if self._client._state(self._slot) == shm.PENDING:
            return False
        self._client._settle(self)
        return True

    def exception(self) -> BaseException | None:
        """The op's error once done, else None."""
        self.done()
        return self._error

    def add_done_callback(self, fn: Callable[[DaemonHandle], None]) -> None:
        """Call ``fn(handle)`` when the op ends (at once if it has).

        In daemon mode the callback runs on a watcher thread of the client (started
        at the first use), or in whichever thread first sees the op end.
        """
        with self._client._lock:
            if not self._ended:
                self._then.append(fn)
                self._client._watch()
                return
        fn(self)

    def wait(self, timeout: float | None = None) -> Any:
        """Block until the op ends; return its result (raise its error)."""
        if not self.done():
            precise_sleeps()
            deadline = None if timeout is None else time.monotonic() + timeout
            pause = 1e-6
            check = time.monotonic() + _LIVENESS_S
            while not self.done():
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    raise OpTimeoutError(
                        f"op {self.name!r} generation {self.generation} did not complete "
                        f"within {timeout} s (it stays in flight; wait again or check the peers)"
                    )
                if now >= check:
                    self._client._check_alive()
                    if self._client._dead is not None and not self.done():
                        self._client._settle(self)
                        break
                    check = now + _LIVENESS_S
                    continue
                nap = pause if deadline is None else min(pause, max(deadline - now, 0))
                if pause < _BLOCK_AFTER_S:
                    time.sleep(nap)
                else:  # a long op: sleep until the service signals, at most ``nap``
                    self._client._block(self._slot, nap)
                pause = min(pause * 2, 1e-3)
        if self._error is not None:
            raise self._error
        return self._result

    def __repr__(self) -> str:
        state = "done" if self.done() else "in flight"
        return f"<DaemonHandle op={self.name!r} generation={self.generation} {state}>"


class _Staging:
    """Shared regions, grown on demand, for arrays that were not allocated by the client."""

    def __init__(self, client: DaemonClient) -> None:
        self.client = client
        self.parts: list[tuple[int, shm.SharedRegion, shm.FreeList]] = []

    def alloc(self, nbytes: int) -> tuple[int, shm.SharedRegion, int]:
        for rid, region, free in self.parts:
            off = free.alloc(nbytes)
            if off is not None:
                return rid, region, off
        last = self.parts[-1][1].size if self.parts else _STAGING_MIN // 2
        size = max(shm.round_up(nbytes), min(2 * last, _STAGING_MAX))
        region = shm.SharedRegion.create(size, "staging")
        rid = self.client._register(region)
        free = shm.FreeList(region.size)
        self.parts.append((rid, region, free))
        off = free.alloc(nbytes)
        assert off is not None
        return rid, region, off

    def free(self, rid: int, offset: int, nbytes: int) -> None:
        for r, _region, free in self.parts:
            if r == rid:
                free.free(offset, nbytes)
                return


class DaemonClient:
    """A training process's connection to its node's service (see the module docstring).

    ``path`` is the service's socket (default: ``$TOTALREDUCE_SOCKET``, else the
    only socket in the default directory).  ``local_rank`` asks for a local rank
    (default ``$TOTALREDUCE_LOCAL_RANK``, else the lowest free one).  ``slots``
    bounds the ops one client may have in flight.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        local_rank: int | None = None,
        slots: int = DEFAULT_SLOTS,
        connect_timeout: float = 30.0,
    ) -> None:
        self.path = find_socket(path)
        if local_rank is None and os.environ.get(ENV_LOCAL_RANK, "").strip():
            try:
                local_rank = int(os.environ[ENV_LOCAL_RANK])
            except ValueError:
                raise InvalidArgumentError(
                    f"{ENV_LOCAL_RANK} must be an integer, got {os.environ[ENV_LOCAL_RANK]!r}"
                ) from None
        if local_rank is not None and (isinstance(local_rank, bool) or local_rank < 0):
            raise InvalidArgumentError(f"local_rank must be an int >= 0, got {local_rank!r}")
        self._lock = threading.RLock()
        self._send_lock = threading.Lock()
        self._closed = False
        self._dead: str | None = None
        self._reader = protocol.MessageReader()
        self._sock = self._connect(connect_timeout)
        try:
            self._control = shm.ControlBlock.create(slots)
            assert self._control.region.fd is not None
            self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            self._sock.settimeout(connect_timeout)
            protocol.send(
                self._sock,
                {
                    "t": "hello",
                    "v": protocol.VERSION,
                    "pid": os.getpid(),
                    "local_rank": local_rank,
                    "slots": slots,
                },
                (self._control.region.fd, self._wake),
            )
            self._control.region.close_fd()
            welcome = self._reply("welcome")
        except BaseException:
            self._sock.close()
            if hasattr(self, "_wake"):
                os.close(self._wake)
            raise
        self.rank: int = int(welcome["rank"])
        self.size: int = int(welcome["size"])
        self.local_rank: int = int(welcome["local_rank"])
        self.local_size: int = int(welcome["local_size"])
        self.node: int = int(welcome["node"])
        self.nodes: int = int(welcome["nodes"])
        self.client_id: int = int(welcome["client"])
        self.job: int = int(welcome["job"])
        self._free_slots = list(range(slots - 1, -1, -1))
        self._pending: dict[int, DaemonHandle] = {}
        self._seq = 0
        self._next_region = 1
        self._regions: dict[int, shm.SharedRegion] = {}
        # address ranges of registered memory: sorted starts, and (end, id, region) per start
        self._starts: list[int] = []
        self._spans: dict[int, tuple[int, int, shm.SharedRegion]] = {}
        self._staging = _Staging(self)
        self._names: dict[str | int, int] = {}
        self._unnamed = 0
        self._watcher: threading.Thread | None = None
        self._waiters = 0
        me = weakref.ref(self)
        atexit.register(_close_at_exit, me)
        log.info(
            "attached to %s as rank %d of %d (local rank %d of %d)",
            self.path,
            self.rank,
            self.size,
            self.local_rank,
            self.local_size,
        )

    # ------------------------------------------------------------------ connection

    def _connect(self, timeout: float) -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(timeout)
        try:
            s.connect(str(self.path))
        except FileNotFoundError:
            s.close()
            raise TotalReduceError(
                f"no totalreduce service at {self.path}: start one with `mpiexec -n NODES "
                "totalreduce serve`"
            ) from None
        except PermissionError:
            s.close()
            raise TotalReduceError(
                f"not allowed to connect to {self.path}: the service belongs to another user"
            ) from None
        except OSError as exc:
            s.close()
            raise TotalReduceError(f"cannot connect to the service at {self.path}: {exc}") from None
        return s

    def _reply(self, want: str, region: int | None = None) -> dict[str, Any]:
        """Read messages until the reply ``want`` (or an error about this request)."""
        while True:
            try:
                msg = protocol.read_message(self._sock, self._reader)
            except (OSError, protocol.ProtocolError) as exc:
                self._lost(f"the connection failed while waiting for {want!r}: {exc}")
                raise TotalReduceError(self._dead or str(exc)) from None
            t = msg.get("t")
            if t == want and (region is None or msg.get("region") == region):
                return msg
            if t == "error":
                text = str(msg.get("message"))
                if msg.get("fatal") or msg.get("region") == region or want == "welcome":
                    if msg.get("fatal"):
                        self._lost(f"the service closed the connection: {text}")
                    raise TotalReduceError(f"the service at {self.path} refused: {text}")
                log.warning("the service reported: %s", text)

    def _block(self, slot: int, timeout: float) -> None:
        """Sleep up to ``timeout`` or until the service signals that some op ended.

        The service signals only while the control block counts a waiter; the
        count is raised before the slot is checked one last time, and a signal
        that still slips through costs at most ``timeout``.
        """
        control = self._control
        with self._lock:
            self._waiters += 1
            control.waiters = self._waiters
        try:
            if control.state(slot) != shm.PENDING or self._dead is not None:
                return
            ready, _, _ = select.select([self._wake, self._sock], [], [], timeout)
            if self._wake in ready:
                try:
                    os.eventfd_read(self._wake)
                except BlockingIOError:
                    pass  # another waiting thread took it
            if self._sock in ready:
                self._check_alive()
        except (OSError, ValueError):  # closed by a shutdown in another thread
            time.sleep(timeout)
        finally:
            with self._lock:
                self._waiters -= 1
                control.waiters = self._waiters

    def _check_alive(self) -> None:
        """Notice (cheaply) that the service went away; fails every op in flight if so."""
        if self._dead is not None or self._closed:
            return
        with self._send_lock:
            try:
                ready, _, _ = select.select([self._sock], [], [], 0)
                if not ready:
                    return
                self._sock.setblocking(False)
                try:
                    more = protocol.receive(self._sock, self._reader)
                finally:
                    self._sock.setblocking(True)
            except BlockingIOError:
                return
            except (OSError, protocol.ProtocolError) as exc:
                self._lost(f"the connection to the service failed: {exc}")
                return
            while True:
                try:
                    msg = self._reader.next()
                except protocol.ProtocolError as exc:
                    self._lost(f"the service sent a bad message: {exc}")
                    return
                if msg is None:
                    break
                if msg.get("t") == "error":
                    if msg.get("fatal"):
                        self._lost(f"the service closed the connection: {msg.get('message')}")
                        return
                    log.warning("the service reported: %s", msg.get("message"))
            if not more:
                self._lost(f"the service at {self.path} closed the connection")

    def _lost(self, why: str) -> None:
        if self._dead is None:
            self._dead = why
            log.error("%s", why)

    def _send(self, msg: dict[str, Any], fds: tuple[int, ...] = ()) -> None:
        if self._dead is not None:
            raise TotalReduceError(self._dead)
        with self._send_lock:
            try:
                protocol.send(self._sock, msg, fds)
            except OSError as exc:
                self._lost(f"the connection to the service at {self.path} failed: {exc}")
                raise TotalReduceError(self._dead or str(exc)) from None

    def _register(self, region: shm.SharedRegion) -> int:
        with self._lock:
            rid = self._next_region
            self._next_region += 1
            assert region.fd is not None
            with self._send_lock:
                try:
                    protocol.send(
                        self._sock,
                        {"t": "register", "region": rid, "size": region.size},
                        (region.fd,),
                    )
                except OSError as exc:
                    self._lost(f"the connection to the service failed: {exc}")
                    raise TotalReduceError(self._dead or str(exc)) from None
                region.close_fd()
                self._reply("registered", rid)
            self._regions[rid] = region
            start = region.address
            bisect.insort(self._starts, start)
            self._spans[start] = (start + region.size, rid, region)
            return rid

    def _unregister(self, rid: int) -> None:
        with self._lock:
            region = self._regions.pop(rid, None)
            if region is None:
                return
            start = region.address
            self._spans.pop(start, None)
            i = bisect.bisect_left(self._starts, start)
            if i < len(self._starts) and self._starts[i] == start:
                del self._starts[i]
            if not self._closed and self._dead is None:
                try:
                    self._send({"t": "unregister", "region": rid})
                except TotalReduceError:
                    pass

    def _locate(self, arr: np.ndarray) -> tuple[int, int] | None:
        """(region id, offset) if ``arr`` lies in registered memory."""
        if not self._starts or arr.nbytes == 0:
            return None
        addr = int(arr.ctypes.data)
        i = bisect.bisect_right(self._starts, addr) - 1
        if i < 0:
            return None
        start = self._starts[i]
        end, rid, _ = self._spans[start]
        if addr + arr.nbytes <= end:
            return rid, addr - start
        return None

    # ------------------------------------------------------------------ registered memory

    def empty(self, shape: int | tuple[int, ...], dtype: Any = np.float32) -> np.ndarray:
        """A new array in memory the service reads and writes directly (zeros at first).

        Ops on it (as ``x`` or ``out``) copy nothing; allocate gradient buffers
        this way once and reuse them every step.  The memory is released when the
        array (and every view of it) is garbage.
        """
        self._check_open()
        dt = np.dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64))
        region = shm.SharedRegion.create(max(count * dt.itemsize, 1), "array")
        rid = self._register(region)
        base = region.array(0, count, dt)
        # every view of the result keeps ``base`` alive: release when the last one dies
        weakref.finalize(base, _release_region, weakref.ref(self), rid)
        return base.reshape(shape)

    def zeros(self, shape: int | tuple[int, ...], dtype: Any = np.float32) -> np.ndarray:
        """Same as :meth:`empty` (new shared memory is zero-filled)."""
        return self.empty(shape, dtype)

    # ------------------------------------------------------------------ submission

    def _check_open(self) -> None:
        if self._closed:
            raise NotInitializedError("totalreduce was shut down; call init() again to use it")
        if self._dead is not None:
            raise TotalReduceError(self._dead)

    def _generation(self, name: str | int | None) -> tuple[str | int | None, int]:
        if name is None:
            k = self._unnamed
            self._unnamed += 1
            return None, k
        if isinstance(name, bool) or not isinstance(name, (str, int)):
            raise InvalidArgumentError(f"op names are str or int, got {name!r}")
        if isinstance(name, str) and not 0 < len(name) <= protocol.MAX_NAME:
            raise InvalidArgumentError(f"op names are 1..{protocol.MAX_NAME} characters long")
        if isinstance(name, int) and not -(1 << 63) <= name < (1 << 63):
            raise InvalidArgumentError(f"integer op names must fit 64 bits, got {name}")
        gen = self._names.get(name, 0)
        self._names[name] = gen + 1
        return name, gen

    def _place(
        self, arr: np.ndarray, copy_in: bool, blocks: list[tuple[int, int, int]]
    ) -> tuple[tuple[int, int], np.ndarray | None]:
        """Where ``arr`` is in shared memory: itself if registered, else a staging block."""
        found = self._locate(arr)
        if found is not None:
            return found, None
        place, view = self._stage(arr, blocks)
        if copy_in and arr.size:
            np.copyto(view, arr.reshape(-1))
        return place, view

    def _stage(
        self, like: np.ndarray, blocks: list[tuple[int, int, int]]
    ) -> tuple[tuple[int, int], np.ndarray]:
        """A staging block for an array of ``like``'s size and dtype."""
        nbytes = max(like.nbytes, 1)
        rid, region, off = self._staging.alloc(nbytes)
        blocks.append((rid, off, nbytes))
        return (rid, off), region.array(off, like.size, like.dtype)

    def _submit(
        self,
        kind: str,
        x: np.ndarray | None,
        dt: DType,
        out: Any,
        name: str | int | None,
        priority: Any,
        algorithm: str | None,
        op: ReduceOp = ReduceOp.SUM,
        root: int = 0,
    ) -> DaemonHandle:
        if isinstance(priority, bool) or not isinstance(priority, (int, np.integer)):
            raise InvalidArgumentError(f"priority must be an int, got {priority!r}")
        if not -(1 << 31) <= int(priority) <= 1 << 31:
            raise InvalidArgumentError(f"priority must fit 32 bits, got {priority}")
        msg: dict[str, Any] = {"t": "op", "kind": kind, "prio": int(priority), "algo": algorithm}
        o: np.ndarray | None = None
        if x is not None:
            o = _output(x, out)
        with self._lock:
            self._check_open()
            if not self._free_slots:
                self._sweep()
            if not self._free_slots:
                raise TotalReduceError(
                    f"{len(self._pending)} ops in flight, the most a client may have; wait for "
                    "some first (or connect with more slots)"
                )
            op_name, gen = self._generation(name)
            blocks: list[tuple[int, int, int]] = []
            finish: Callable[[], Any] | None = None
            result: Any = None
            try:
                if x is not None:
                    assert o is not None
                    src, staged_in = self._place(x, True, blocks)
                    if out is None:  # a new result array: staged, copied out once
                        dst, staged_out = self._stage(x, blocks)
                        finish = _copy_new(staged_out, x.shape)
                    else:
                        if o.ctypes.data == x.ctypes.data and staged_in is not None:
                            dst, staged_out = src, staged_in  # in place, staged once
                        else:
                            dst, staged_out = self._place(o, False, blocks)
                        shaped = o.reshape(x.shape)
                        if staged_out is None:
                            result = shaped
                        else:
                            finish = _copy_back(staged_out, o, shaped)
                    msg.update(
                        dtype=dt.name.lower(),
                        count=int(x.size),
                        op=op.name.lower(),
                        root=int(root),
                        **{"in": list(src), "out": list(dst)},
                    )
                slot = self._free_slots.pop()
                self._seq += 1
                seq = self._seq
                self._control.arm(slot, seq)
                msg.update(slot=slot, seq=seq, name=op_name, gen=gen)
                try:
                    self._send(msg)
                except BaseException:
                    self._free_slots.append(slot)
                    raise
            except BaseException:
                for rid, off, nbytes in blocks:
                    self._staging.free(rid, off, nbytes)
                raise
            shown = op_name if op_name is not None else f"__unnamed__.{gen}"
            h = DaemonHandle(
                self,
                shown,
                gen if op_name is not None else 0,
                slot,
                seq,
                result,
                _staged(finish, blocks, self._staging),
            )
            self._pending[slot] = h
            return h

    def _state(self, slot: int) -> int:
        return self._control.state(slot)

    def _settle(self, h: DaemonHandle) -> None:
        """The op of ``h`` ended: read its outcome, copy a staged result, free its slot."""
        with self._lock:
            if h._ended:
                return
            state = self._control.state(h._slot)
            if state == shm.FAILED:
                kind, text = self._control.error(h._slot)
                h._error = _ERRORS.get(kind, TotalReduceError)(text)
            elif state == shm.PENDING:  # only when the service is gone
                h._error = TotalReduceError(self._dead or "the op was abandoned")
            if h._finish is not None:
                try:
                    value = h._finish(h._error is None)
                    if h._error is None:
                        h._result = value
                except Exception as exc:  # a result that cannot be delivered is the op's error
                    h._error = TotalReduceError(f"op {h.name!r}: {exc}")
                h._finish = None
            h._ended = True
            self._pending.pop(h._slot, None)
            self._free_slots.append(h._slot)
            then, h._then = h._then, []
        for fn in then:
            try:
                fn(h)
            except Exception:
                log.exception("a done callback of op %r failed", h.name)

    def _sweep(self) -> None:
        for h in list(self._pending.values()):
            h.done()

    def _watch(self) -> None:
        """Start the thread that runs done callbacks (once, on first use)."""
        if self._watcher is None:
            self._watcher = threading.Thread(
                target=self._watch_loop, name="totalreduce-client-watch", daemon=True
            )
            self._watcher.start()

    def _watch_loop(self) -> None:
        pause = 1e-6
        while not self._closed:
            with self._lock:
                waiting = [h for h in self._pending.values() if h._then]
            progressed = False
            for h in waiting:
                if h.done():
                    progressed = True
            if self._dead is not None:
                self._abandon()
            pause = 1e-6 if progressed else min(pause * 2, 1e-3)
            time.sleep(pause)

    def _abandon(self) -> None:
        """The service is gone: end every op in flight with that error."""
        for h in list(self._pending.values()):
            self._settle(h)

    # ------------------------------------------------------------------ client API

    def allreduce_async(
        self,
        x: Any,
        name: str | int | None = None,
        op: str | ReduceOp = "sum",
        out: Any = None,
        priority: int = 0,
        algorithm: str | None = None,
        group: Any = None,
        dtype: str | None = None,
    ) -> DaemonHandle:
        """Start reducing ``x`` across every training process; ``wait()`` returns the result.

        As :meth:`totalreduce.Service.allreduce_async`; ``op`` is ``sum``, ``avg``,
        ``max`` or ``min``.  ``group`` is not supported in daemon mode.
        """
        _no_group(group)
        arr, dt = as_array(x, "x", dtype)
        rop = reduce_op(op)
        _check_algorithm(algorithm)
        return self._submit("allreduce", arr, dt, out, name, priority, algorithm, op=rop)

    def allreduce(
        self,
        x: Any,
        name: str | int | None = None,
        op: str | ReduceOp = "sum",
        out: Any = None,
        priority: int = 0,
        algorithm: str | None = None,
        group: Any = None,
        dtype: str | None = None,
    ) -> np.ndarray:
        """Blocking :meth:`allreduce_async`: returns the reduced array."""
        return self.allreduce_async(x, name, op, out, priority, algorithm, group, dtype).wait()

    def broadcast_async(
        self,
        x: Any,
        root: int = 0,
        name: str | int | None = None,
        out: Any = None,
        priority: int = 0,
        algorithm: str = "auto",
        group: Any = None,
        dtype: str | None = None,
    ) -> DaemonHandle:
        """Start copying ``x`` of training process ``root`` to every one; ``wait()`` returns it.

        ``root`` counts training processes (``node * N + local rank``), like ``rank``.
        """
        _no_group(group)
        arr, dt = as_array(x, "x", dtype)
        if isinstance(root, bool) or not isinstance(root, (int, np.integer)):
            raise InvalidArgumentError(f"broadcast root must be an int, got {root!r}")
        if not 0 <= root < self.size:
            raise InvalidArgumentError(f"broadcast root {root} outside 0..{self.size - 1}")
        if algorithm not in ("auto", "one_to_all", "pipelined"):
            raise InvalidArgumentError(
                f"unknown broadcast algorithm {algorithm!r}; known: auto, one_to_all, pipelined"
            )
        return self._submit("broadcast", arr, dt, out, name, priority, algorithm, root=int(root))

    def broadcast(
        self,
        x: Any,
        root: int = 0,
        name: str | int | None = None,
        out: Any = None,
        priority: int = 0,
        algorithm: str = "auto",
        group: Any = None,
        dtype: str | None = None,
    ) -> np.ndarray:
        """Blocking :meth:`broadcast_async`."""
        return self.broadcast_async(x, root, name, out, priority, algorithm, group, dtype).wait()

    def barrier_async(
        self,
        name: str | int | None = None,
        priority: int = 0,
        algorithm: str = "all_to_all",
        group: Any = None,
    ) -> DaemonHandle:
        """Start a barrier over every training process."""
        _no_group(group)
        if algorithm not in ("all_to_all", "all_to_one"):
            raise InvalidArgumentError(
                f"unknown barrier algorithm {algorithm!r}; known: all_to_all, all_to_one"
            )
        return self._submit("barrier", None, DType.INT64, None, name, priority, algorithm)

    def barrier(
        self, name: str | int | None = None, algorithm: str = "all_to_all", group: Any = None
    ) -> None:
        """Blocking barrier."""
        self.barrier_async(name, algorithm=algorithm, group=group).wait()

    # ------------------------------------------------------------------ lifecycle

    def shutdown(self, timeout: float | None = None) -> None:
        """Let this client's ops finish (up to ``timeout``, default 30 s), then detach.

        Ops still in flight after the timeout fail; detaching with ops in flight
        fails the job on every node (the other training processes get an error
        naming this client instead of waiting for it).
        """
        if self._closed:
            return
        limit = 30.0 if timeout is None else timeout
        deadline = time.monotonic() + limit
        pause = 1e-5
        while self._pending and time.monotonic() < deadline and self._dead is None:
            self._sweep()
            self._check_alive()
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
        with self._lock:
            self._closed = True
            left = list(self._pending.values())
        if left:
            log.error(
                "detaching with %d ops in flight: %s",
                len(left),
                ", ".join(f"{h.name!r} generation {h.generation}" for h in left[:5]),
            )
        if self._dead is None:
            try:
                with self._send_lock:
                    protocol.send(self._sock, {"t": "bye"})
            except OSError:
                pass
        self._sock.close()
        os.close(self._wake)
        self._dead = self._dead or "this client was shut down"
        for h in left:
            with self._lock:
                h._error = TotalReduceError(
                    f"op {h.name!r} generation {h.generation}: shut down while in flight"
                )
            self._settle(h)
        self._regions.clear()
        self._starts.clear()
        self._spans.clear()

    @property
    def closed(self) -> bool:
        return self._closed

    def __repr__(self) -> str:
        return (
            f"<DaemonClient {self.path} rank {self.rank} of {self.size} "
            f"(node {self.node}, local rank {self.local_rank})>"
        )


# ---------------------------------------------------------------------- helpers


def connect(path: str | os.PathLike[str] | None = None, **options: Any) -> DaemonClient:
    """``DaemonClient(path, **options)``; what ``totalreduce.init(service="daemon")`` calls."""
    known = {"local_rank", "slots", "connect_timeout"}
    unknown = set(options) - known
    if unknown:
        raise InvalidArgumentError(
            f"option(s) {sorted(unknown)} belong to the service, not to a daemon-mode client: "
            "pass them to `totalreduce serve` (TOTALREDUCE_* in its environment); client "
            f"options: socket, {', '.join(sorted(known))}"
        )
    return DaemonClient(path, **options)


def _output(x: np.ndarray, out: Any) -> np.ndarray:
    if out is None:
        return x
    o = out if isinstance(out, np.ndarray) else as_array(out, "out", None)[0]
    if o.dtype != x.dtype or o.size != x.size:
        raise InvalidArgumentError(
            f"out has dtype {o.dtype} and {o.size} elements; expected {x.dtype} and {x.size}"
        )
    if not o.flags.c_contiguous:
        raise InvalidArgumentError("out is not C-contiguous")
    if not o.flags.writeable:
        raise InvalidArgumentError("out is read-only")
    same = o.ctypes.data == x.ctypes.data and o.nbytes == x.nbytes
    if not same and np.shares_memory(o, x):
        raise InvalidArgumentError("out overlaps the input without being the same array")
    return o


def _no_group(group: Any) -> None:
    if group is not None:
        raise InvalidArgumentError(
            "group= is not supported in daemon mode: ops run over every training process"
        )


def _check_algorithm(algorithm: str | None) -> None:
    if algorithm is None or algorithm == "auto":
        return
    from ..algorithms import registry

    if algorithm not in registry.ALLREDUCE:
        raise InvalidArgumentError(
            f"unknown allreduce algorithm {algorithm!r}; known: auto, "
            f"{', '.join(sorted(registry.ALLREDUCE))}"
        )


def _copy_new(staged: np.ndarray, shape: tuple[int, ...]) -> Callable[[], np.ndarray]:
    def finish() -> np.ndarray:
        return staged.copy().reshape(shape)

    return finish


def _copy_back(staged: np.ndarray, out: np.ndarray, result: Any) -> Callable[[], Any]:
    def finish() -> Any:
        np.copyto(out.reshape(-1), staged)
        return result

    return finish


def _staged(
    finish: Callable[[], Any] | None, blocks: list[tuple[int, int, int]], staging: _Staging
) -> Callable[[bool], Any] | None:
    """What settling the op does: on success ``finish``; always free the staging blocks."""
    if finish is None and not blocks:
        return None

    def settle(ok: bool) -> Any:
        try:
            return finish() if ok and finish is not None else None
        finally:
            for rid, off, nbytes in blocks:
                staging.free(rid, off, nbytes)

    return settle


def _release_region(ref: weakref.ref[DaemonClient], rid: int) -> None:
    client = ref()
    if client is not None:
        client._unregister(rid)


def _close_at_exit(ref: weakref.ref[DaemonClient]) -> None:
    client = ref()
    if client is not None and not client.closed:
        client.shutdown(timeout=10)

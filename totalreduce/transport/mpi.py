"""The MPI transport: mpi4py non-blocking point-to-point on a private communicator.

It asks MPI for ``MPI_THREAD_MULTIPLE`` (mpi4py's default request) and checks
what it got: the comm thread calls MPI while the user's threads may too, so a
level below ``MULTIPLE`` is refused unless the caller states that its own code
makes no MPI calls while the service runs (``SERIALIZED`` then suffices).  All
traffic runs on a duplicate of the world (or of the communicator given), so the
user's own MPI messages never match ours.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Any

import numpy as np

from ..errors import TransportError
from ..protocol import CLOSE_TAG  # the last message to each peer (``close``)
from .base import OversizeMessage, pid_alive

log = logging.getLogger("totalreduce.transport.mpi")

_LEVELS = {0: "SINGLE", 1: "FUNNELED", 2: "SERIALIZED", 3: "MULTIPLE"}

#: How long ``close`` waits for its peers to close (they shut down at about the same time).
CLOSE_WAIT_S = 1.0
_NOTHING = np.empty(0, dtype=np.uint8)
#: Communicators closed while a peer might still send on them: never freed (see ``close``).
_RETIRED: list[Any] = []


class MPITransport:
    """Point-to-point over a duplicated MPI communicator."""

    def __init__(self, comm: Any = None, *, allow_serialized: bool = False) -> None:
        self._MPI = MPI = _started()
        level = MPI.Query_thread()
        wanted = MPI.THREAD_SERIALIZED if allow_serialized else MPI.THREAD_MULTIPLE
        if level < wanted:
            raise TransportError(
                f"MPI provides thread level {_LEVELS.get(level, level)}, totalreduce needs "
                f"{_LEVELS[wanted]} (its comm thread calls MPI beside your threads); use an MPI "
                "built with thread support, or if your code makes no MPI calls while "
                "totalreduce runs, pass allow_serialized=True with a SERIALIZED library"
            )
        base = MPI.COMM_WORLD if comm is None else comm
        self.comm = base.Dup()
        self.comm.Set_name("totalreduce")
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        name = MPI.Get_library_version().splitlines()[0].strip()
        self.description = f"mpi ({name}, thread level {_LEVELS.get(level, level)})"
        self._status = MPI.Status()
        self._statuses: list[Any] = []
        self._closed = False
        # Body tags rotate through at most this many values (MPI guarantees 32767).
        tag_ub = self.comm.Get_attr(MPI.TAG_UB)
        self.tag_ub = int(tag_ub or 32767)
        # Where each rank's process runs, so a dead local peer can be noticed even
        # where MPI reports no failure (once, at start: one small allgather).
        self._host = socket.gethostname()
        self._where: list[tuple[str, int]] = self.comm.allgather((self._host, os.getpid()))
        self._layout = self._split_node(MPI)

    def _split_node(self, MPI: Any) -> tuple[int, int, int, int]:
        """(local_rank, local_size, cross_rank, cross_size), asked of MPI once, here.

        Horovod's meanings: the node is MPI's shared-memory split (ordered by
        rank); the cross group of a rank is every rank with the same local rank,
        ordered by rank.  Done before the comm thread starts, so no later caller
        touches MPI beside it.
        """
        node = self.comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        try:
            local_rank, local_size = node.Get_rank(), node.Get_size()
        finally:
            node.Free()
        local_ranks = self.comm.allgather(local_rank)
        cross = [r for r, lr in enumerate(local_ranks) if lr == local_rank]
        return local_rank, local_size, cross.index(self.rank), len(cross)

    def node_layout(self) -> tuple[int, int, int, int]:
        """(local_rank, local_size, cross_rank, cross_size) of this rank, from MPI's node split."""
        return self._layout

    def _spec(self, buf: np.ndarray) -> list[Any]:
        return [buf, self._MPI.BYTE]

    def _error(self, what: str, peer: int | None, exc: Exception) -> TransportError:
        who = "" if peer is None or peer < 0 else f" with rank {peer}"
        err = TransportError(f"rank {self.rank}: MPI {what}{who} failed: {exc}")
        err.peer = peer  # type: ignore[attr-defined]
        return err

    def native_binding(self) -> Any:
        """The record compiled code calls MPI on this transport's communicator with
        (:func:`.mpi_native.binding`; the communicator returns error codes)."""
        from . import mpi_native

        return mpi_native.binding(self.comm)

    def isend(self, buf: np.ndarray, dest: int, tag: int) -> Any:
        try:
            return self.comm.Isend(self._spec(buf), dest=dest, tag=tag)
        except self._MPI.Exception as exc:
            raise self._error("send", dest, exc) from None

    def irecv(self, buf: np.ndarray, source: int, tag: int) -> Any:
        src = self._MPI.ANY_SOURCE if source < 0 else source
        try:
            return self.comm.Irecv(self._spec(buf), source=src, tag=tag)
        except self._MPI.Exception as exc:
            raise self._error("receive", source, exc) from None

    def test(self, req: Any) -> tuple[bool, int, int]:
        st = self._status
        try:
            done = req.Test(st)
        except self._MPI.Exception as exc:
            raise self._error("test", st.Get_source(), exc) from None
        if done:
            return True, st.Get_source(), st.Get_count(self._MPI.BYTE)
        return False, -1, 0

    def testsome(self, reqs: list[Any], counts: list[int] | None = None) -> list[int]:
        if not reqs:
            return []
        MPI = self._MPI
        statuses = self._statuses
        while len(statuses) < len(reqs):
            statuses.append(MPI.Status())
        try:
            done = MPI.Request.Testsome(reqs, statuses if counts is not None else None)
        except MPI.Exception:
            return self._test_each(reqs, counts)
        if not done:
            return []
        if counts is not None:
            counts.extend(statuses[k].Get_count(MPI.BYTE) for k in range(len(done)))
        return list(done)

    def _test_each(self, reqs: list[Any], counts: list[int] | None) -> list[int]:
        """After a failed Testsome: test one by one, so no completion is lost and the
        failures name their peers."""
        MPI = self._MPI
        st = MPI.Status()
        done: list[int] = []
        failed: list[int] = []
        first: Exception | None = None
        peer = -1
        for i, r in enumerate(reqs):
            try:
                if r.Test(st):
                    done.append(i)
                    if counts is not None:
                        counts.append(st.Get_count(MPI.BYTE))
            except MPI.Exception as exc:
                failed.append(i)
                if first is None:
                    first, peer = exc, st.Get_source()
        if not failed:
            return done
        err = self._error("test", peer, first or RuntimeError("request failed"))
        err.done, err.failed = done, failed  # type: ignore[attr-defined]
        raise err

    def poll_message(self, tag: int, limit: int) -> tuple[int, np.ndarray] | None:
        MPI = self._MPI
        st = self._status
        try:
            msg = self.comm.Improbe(MPI.ANY_SOURCE, tag, st)
        except MPI.Exception as exc:
            raise self._error("probe", None, exc) from None
        if msg is None:
            return None
        source = st.Get_source()
        n = st.Get_count(MPI.BYTE)
        if n > limit:
            try:  # consume it into a small buffer: MPI reports the truncation
                msg.Recv([np.empty(64, dtype=np.uint8), MPI.BYTE])
            except MPI.Exception:
                pass
            raise OversizeMessage(source, n, limit)
        buf = np.empty(n, dtype=np.uint8)
        try:
            msg.Recv([buf, MPI.BYTE])
        except MPI.Exception as exc:
            raise self._error("receive", source, exc) from None
        return source, buf

    def alive(self, peer: int) -> bool | None:
        host, pid = self._where[peer]
        if host != self._host:
            return None  # another node: only MPI can tell, by failing a call
        return pid_alive(pid)

    def cancel(self, req: Any) -> None:
        try:
            req.Cancel()  # completes (as cancelled) in a later testsome
        except self._MPI.Exception as exc:  # the request may have failed with its peer
            log.debug("cancelling a request failed: %s", exc)

    def close(self, wait_s: float = CLOSE_WAIT_S) -> None:
        """Free the communicator once nothing more can come on it (:meth:`_part`); one a
        peer may still send on is kept, never freed, so that MPI never gives its context id
        to a later transport's communicator (a message left on it would match there)."""
        if not self._closed:
            self._closed = True
            if self._MPI.Is_finalized():  # at interpreter exit, after mpi4py's finalize
                return
            gone = [p for p in range(self.size) if p != self.rank and self.alive(p) is False]
            if self._part(wait_s, set(gone)):
                try:
                    self.comm.Free()
                except Exception as exc:  # the job may be tearing down
                    log.debug("freeing the communicator failed: %s", exc)
            else:
                _RETIRED.append(self.comm)
            if gone:
                _finalize_without_peers(self._MPI, gone)

    def _part(self, wait_s: float, gone: set[int]) -> bool:
        """Send every live peer this transport's last message (``CLOSE_TAG``) and receive,
        discarding it, whatever comes until each peer's last message has come: True when
        every peer's came (nothing more will) and every send completed within ``wait_s``.

        A message left unreceived on a freed communicator stays in MPI's queue under its
        context id, which MPI hands to the next communicator it creates: a later
        ``init()``'s engine received an earlier engine's goodbye and took its peer for gone.
        MPI delivers the messages of one sender that match one probe in order, and the probe
        here matches every tag, so a peer's last message comes after all it sent before."""
        MPI = self._MPI
        waiting = {p for p in range(self.size) if p != self.rank and p not in gone}
        if not waiting:
            return True
        st = MPI.Status()
        deadline = time.monotonic() + wait_s
        delay = 1e-5
        try:
            sends = [self.comm.Isend([_NOTHING, MPI.BYTE], p, CLOSE_TAG) for p in sorted(waiting)]
            while waiting and time.monotonic() < deadline:
                msg = self.comm.Improbe(MPI.ANY_SOURCE, MPI.ANY_TAG, st)
                if msg is None:
                    waiting = {p for p in waiting if self.alive(p) is not False}
                    time.sleep(delay)  # peers still closing: never spin
                    delay = min(2 * delay, 1e-3)
                    continue
                msg.Recv([np.empty(st.Get_count(MPI.BYTE), dtype=np.uint8), MPI.BYTE])
                if st.Get_tag() == CLOSE_TAG:
                    waiting.discard(st.Get_source())
            while not MPI.Request.Testall(sends) and time.monotonic() < deadline:
                time.sleep(1e-4)
            sent = MPI.Request.Testall(sends)
        except MPI.Exception as exc:  # a peer failed meanwhile
            log.debug("rank %d: parting from the peers failed: %s", self.rank, exc)
            return False
        if waiting or not sent:
            log.debug(
                "rank %d: ranks %s did not close within %.1f s: the communicator is kept",
                self.rank, sorted(waiting), wait_s,
            )  # fmt: skip
            return False
        return True


def _finalize_without_peers(MPI: Any, gone: list[int]) -> None:
    """Make this process's ``MPI_Finalize`` local: ranks ``gone`` exited without it.

    MPICH's ``MPI_Finalize`` waits at a barrier of the process manager for every
    rank, so after a peer that never finalized (``os._exit``, a signal) the
    survivor would hang at interpreter exit (mpi4py finalizes then).  A peer that
    finalized cannot have exited before this rank reached that barrier, so a
    peer already gone here is one that never will.  MPICH's control variable
    ``MPIR_CVAR_NO_COLLECTIVE_FINALIZE`` (set through the MPI tool interface)
    skips the barrier; with another MPI, or where it cannot be set, nothing
    changes.
    """
    import ctypes

    vendor = MPI.get_vendor()[0] if hasattr(MPI, "get_vendor") else ""
    if vendor != "MPICH":
        log.warning("ranks %s exited without finalizing MPI; MPI_Finalize may hang", gone)
        return
    try:
        lib = ctypes.CDLL("libmpi.so.12")  # the copy mpi4py loaded (same soname)
        provided, index, count = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
        handle, one = ctypes.c_void_p(), ctypes.c_int(1)
        ok = (
            lib.MPI_T_init_thread(MPI.THREAD_MULTIPLE, ctypes.byref(provided)) == 0
            and lib.MPI_T_cvar_get_index(b"MPIR_CVAR_NO_COLLECTIVE_FINALIZE", ctypes.byref(index))
            == 0
            and lib.MPI_T_cvar_handle_alloc(index, None, ctypes.byref(handle), ctypes.byref(count))
            == 0
            and lib.MPI_T_cvar_write(handle, ctypes.byref(one)) == 0
        )
    except (OSError, AttributeError) as exc:
        ok = False
        log.debug("the MPI tool interface is not reachable: %s", exc)
    if ok:
        log.info("ranks %s exited without finalizing MPI: finalizing locally", gone)
    else:
        log.warning("ranks %s exited without finalizing MPI; MPI_Finalize may hang", gone)


def _started() -> Any:
    """mpi4py's ``MPI``, initialized here (asking for ``MPI_THREAD_MULTIPLE``) if it was not."""
    from mpi4py import MPI

    if not MPI.Is_initialized():
        MPI.Init_thread(MPI.THREAD_MULTIPLE)
    return MPI


def world() -> tuple[int, int]:
    """This process's rank in MPI's world and the world's size (MPI started if need be)."""
    MPI = _started()
    return MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()


def world_max(values: list[int]) -> list[int]:
    """The element-wise maximum of ``values`` over MPI's world (collective, blocking; on a
    communicator of its own)."""
    MPI = _started()
    comm = MPI.COMM_WORLD.Dup()
    try:
        mine = np.array(values, np.int64)
        out = np.empty_like(mine)
        comm.Allreduce(mine, out, op=MPI.MAX)
    finally:
        comm.Free()
    return [int(v) for v in out]

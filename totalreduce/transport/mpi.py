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
from typing import Any

import numpy as np

from ..errors import TransportError

log = logging.getLogger("totalreduce.transport.mpi")

_LEVELS = {0: "SINGLE", 1: "FUNNELED", 2: "SERIALIZED", 3: "MULTIPLE"}


class MPITransport:
    """Point-to-point over a duplicated MPI communicator."""

    def __init__(self, comm: Any = None, *, allow_serialized: bool = False) -> None:
        from mpi4py import MPI

        self._MPI = MPI
        if not MPI.Is_initialized():
            MPI.Init_thread(MPI.THREAD_MULTIPLE)
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
        self._closed = False
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

    def isend(self, buf: np.ndarray, dest: int, tag: int) -> Any:
        return self.comm.Isend(self._spec(buf), dest=dest, tag=tag)

    def irecv(self, buf: np.ndarray, source: int, tag: int) -> Any:
        src = self._MPI.ANY_SOURCE if source < 0 else source
        return self.comm.Irecv(self._spec(buf), source=src, tag=tag)

    def test(self, req: Any) -> tuple[bool, int, int]:
        st = self._status
        if req.Test(st):
            return True, st.Get_source(), st.Get_count(self._MPI.BYTE)
        return False, -1, 0

    def testsome(self, reqs: list[Any]) -> list[int]:
        if not reqs:
            return []
        done = self._MPI.Request.Testsome(reqs)
        return list(done) if done else []

    def cancel(self, req: Any) -> None:
        req.Cancel()
        req.Wait()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                self.comm.Free()
            except Exception as exc:  # the job may be tearing down
                log.debug("freeing the communicator failed: %s", exc)

"""The local transport's compiled side: MPI's point-to-point calls for ranks that are threads
of one process, as C functions (Numba ``cfunc``) that compiled code calls through the same
binding record as the MPI library's (:mod:`.mpi_native`).

The compiled lane talks to its peers only through that record: function addresses, handle
values, the status layout.  :meth:`NativeWorld.binding` fills one with these functions
instead of ``libmpi``'s, so the lane runs unchanged over the local transport, and a new
transport is a new set of such functions, in ``transport/``.

What they keep of MPI:

- matching: a receive takes the earliest message from its source (or any) on its tag (or
  any); messages of one sender on one tag are never overtaken;
- ``MPI_Isend`` is a rendezvous: the receiver copies from the sender's buffer when a
  receive matches it, and only then does the send complete (as the Python local transport
  does), so a buffer reused while its send is in flight shows up as a wrong result;
- ``MPI_Improbe`` / ``MPI_Mrecv``, ``MPI_Test`` / ``Testall`` / ``Testsome`` (completed
  handles become ``MPI_REQUEST_NULL``; all-null gives ``MPI_UNDEFINED``), ``MPI_Cancel``
  of a receive not matched yet (or a send not matched yet), ``MPI_Request_free`` of a
  pending request (freed when it completes), ``MPI_Get_count``, ``MPI_Test_cancelled``;
- truncation: a message longer than its receive fills the receive and fails it with
  ``ERR_TRUNCATE`` (``Testsome``: ``ERR_IN_STATUS``, the status names it).

The world is one ``int64`` array: a header, a table of ``capacity`` entries (one per
pending send or receive, and the free list through them), and per rank two lists (messages
not received yet, receives not matched yet).  A request handle is the address of its entry,
8 bytes, as Open MPI's pointer handles are.  One spin lock guards the world (it spins
briefly, then yields the core: ranks may outnumber cores); tests that find nothing done
and probes of an empty list take no lock.  A world that runs out of entries fails the call
with ``ERR_NO_MEM``, which the lane reports as an MPI error naming the peer.

Three modules: this one holds :class:`NativeWorld` (a world's array and its ranks' binding
records); :mod:`.local_calls` the C functions; :mod:`.local_tables` the array's layout, the
lock, the lists and the matching they are written with, and the error codes
(:func:`error_text` and the ``ERR_*`` codes are importable from here too).
"""

from __future__ import annotations

import numpy as np

from . import mpi_native as M
from .local_calls import (
    cancel,
    get_count,
    improbe,
    iprobe,
    irecv,
    isend,
    mrecv,
    request_free,
    test,
    test_cancelled,
    testall,
    testsome,
)
from .local_tables import (
    ANY_SOURCE,
    ANY_TAG,
    DEFAULT_CAPACITY,
    E_NEXT,
    E_WORDS,
    ERR_COUNT,
    ERR_IN_STATUS,
    ERR_NO_MEM,
    ERR_OTHER,
    ERR_RANK,
    ERR_TAG,
    ERR_TRUNCATE,
    H_CAP,
    H_FREE,
    H_HOLDS,
    H_JITTER,
    H_LEN,
    H_PEAK,
    H_RNG,
    H_SIZE,
    H_USED,
    NULL,
    S_BYTES,
    S_ERROR,
    S_SOURCE,
    S_TAG,
    UNDEFINED,
    X_N,
    error_text,
)

__all__ = [
    "DEFAULT_CAPACITY",
    "ERR_COUNT",
    "ERR_IN_STATUS",
    "ERR_NO_MEM",
    "ERR_OTHER",
    "ERR_RANK",
    "ERR_TAG",
    "ERR_TRUNCATE",
    "NativeWorld",
    "error_text",
]


# ---------------------------------------------------------------------------- the world


class NativeWorld:
    """The compiled message layer of one :class:`~.local.LocalWorld`: ``size`` ranks,
    ``capacity`` entries (pending sends and receives, all ranks together).

    ``jitter`` (0..1): the chance that a send is held back for one to four calls into the
    world before a receive can see it, which reorders messages across senders (never a
    sender's own to one rank), as the Python side's ``jitter`` does."""

    def __init__(
        self, size: int, capacity: int = DEFAULT_CAPACITY, *, jitter: float = 0.0, seed: int = 0
    ) -> None:
        self.size = size
        self.capacity = capacity
        boxes = H_LEN + capacity * E_WORDS
        w = np.zeros(boxes + size * X_N + size * size, dtype=np.int64)
        w[H_SIZE] = size
        w[H_CAP] = capacity
        w[H_JITTER] = int(min(max(jitter, 0.0), 1.0) * (1 << 20))
        w[H_RNG] = (seed * 0x9E3779B1 + 0x2545F4914F6CDD1D) & 0x3FFFFFFFFFFFFFFF or 1
        nxt = np.arange(1, capacity + 1, dtype=np.int64)
        nxt[-1] = -1
        w[H_LEN + E_NEXT : H_LEN + capacity * E_WORDS : E_WORDS] = nxt
        w[H_FREE] = 0
        w[boxes : boxes + size * X_N] = -1  # every list empty
        self.words = w
        self._comms = [np.array([w.ctypes.data, r, size], dtype=np.int64) for r in range(size)]

    @property
    def in_use(self) -> int:
        """Entries in use now (pending sends and receives, requests not tested yet)."""
        return int(self.words[H_USED])

    @property
    def peak(self) -> int:
        return int(self.words[H_PEAK])

    @property
    def holds(self) -> int:
        """Sends the jitter has held back so far."""
        return int(self.words[H_HOLDS])

    def binding(self, rank: int) -> np.ndarray:
        """The record :mod:`.mpi_native`'s wrappers (and the lane) take, for ``rank``."""
        b = np.zeros(M.B_LEN, dtype=np.int64)
        for slot, fn in (
            (M.B_ISEND, isend),
            (M.B_IRECV, irecv),
            (M.B_TEST, test),
            (M.B_TESTALL, testall),
            (M.B_TESTSOME, testsome),
            (M.B_IPROBE, iprobe),
            (M.B_IMPROBE, improbe),
            (M.B_MRECV, mrecv),
            (M.B_CANCEL, cancel),
            (M.B_REQUEST_FREE, request_free),
            (M.B_GET_COUNT, get_count),
            (M.B_TEST_CANCELLED, test_cancelled),
        ):
            b[slot] = int(fn.address or 0)
        b[M.B_HANDLE_BYTES] = 8
        b[M.B_BYTE] = 1
        b[M.B_COMM] = self._comms[rank].ctypes.data
        b[M.B_REQUEST_NULL] = NULL
        b[M.B_MESSAGE_NULL] = NULL
        b[M.B_STATUS_BYTES] = S_BYTES
        b[M.B_STATUS_SOURCE] = S_SOURCE
        b[M.B_STATUS_TAG] = S_TAG
        b[M.B_STATUS_ERROR] = S_ERROR
        b[M.B_ANY_SOURCE] = ANY_SOURCE
        b[M.B_ANY_TAG] = ANY_TAG
        b[M.B_UNDEFINED] = UNDEFINED
        b[M.B_RANK] = rank
        b[M.B_SIZE] = self.size
        b[M.B_KIND] = M.KIND_LOCAL
        return b

"""MPI from compiled code: the few functions a compiled loop calls, found in the MPI library
mpi4py loaded, with handles of that library's ABI.

This module owns the binding record and the ``@njit`` wrappers around each MPI call.
:func:`binding` returns the record for one communicator: an ``int64`` numpy array of
function addresses (``MPI_Isend``, ``MPI_Irecv``, ``MPI_Test``, ``MPI_Testall``,
``MPI_Testsome``, ``MPI_Iprobe``, ``MPI_Improbe``, ``MPI_Mrecv``, ``MPI_Cancel``,
``MPI_Request_free``, ``MPI_Get_count``, ``MPI_Test_cancelled``), handle values
(``MPI_BYTE``, the communicator, ``MPI_REQUEST_NULL``, ``MPI_MESSAGE_NULL``) and the
status layout.  Compiled code takes the record as an argument, so no address is baked
into cached machine code and every wrapper caches on disk.

The two ABIs differ where it matters here: MPICH's handles are C ``int`` (4 bytes),
Open MPI's are pointers (8 bytes); ``MPI_Status`` is 20 bytes with ``MPI_SOURCE`` at
offset 8 in MPICH, 24 bytes with it at offset 0 in Open MPI.  Nothing here assumes
either: the handle width comes from mpi4py (``MPI._sizeof``), each wrapper calls with the
C types of that width, and the status offsets are found by filling an mpi4py ``Status``
with known values and reading its memory back.  Every handle is stored as a signed
integer of the ABI's width, sign-extended to 64 bits: mpi4py hands MPICH's handles out
as unsigned values (above 2^63 for some), which cost Numba's dispatcher 44 µs a call.

Request and message handles live in memory the caller owns (``handle_bytes`` each; see
:func:`request_array`); the wrappers take their addresses.  Every wrapper returns ``0``
(or a flag / count, as documented) on success and ``-code`` when MPI returned the error
``code``, which happens only on a communicator with ``MPI_ERRORS_RETURN``; it never raises.

Importing this module compiles nothing; the wrappers compile (and cache) on first call.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from ..errors import TransportError
from ..native.intrinsics import ccall_i32, ld_i32
from ..protocol import (  # the binding record's words: declared with the protocol
    B_ANY_SOURCE,
    B_ANY_TAG,
    B_BYTE,
    B_CANCEL,
    B_COMM,
    B_GET_COUNT,
    B_HANDLE_BYTES,
    B_IMPROBE,
    B_IPROBE,
    B_IRECV,
    B_ISEND,
    B_LEN,
    B_MESSAGE_NULL,
    B_MRECV,
    B_RANK,
    B_REQUEST_FREE,
    B_REQUEST_NULL,
    B_SIZE,
    B_STATUS_BYTES,
    B_STATUS_ERROR,
    B_STATUS_SOURCE,
    B_STATUS_TAG,
    B_TEST,
    B_TEST_CANCELLED,
    B_TESTALL,
    B_TESTSOME,
    B_UNDEFINED,
)
from ..protocol import B_KIND as B_KIND  # re-exported: the world modules read them here
from ..protocol import KIND_LOCAL as KIND_LOCAL
from ..protocol import KIND_MPI as KIND_MPI

# ---------------------------------------------------------------------------- the record

#: The binding record (``int64`` words the compiled lane reads the MPI library through):
#: its words are declared in :mod:`totalreduce.protocol` (``B_*``, ``KIND_*``).

#: The largest status any known ABI has (MPICH 20 bytes, Open MPI 24, the MPI-5 ABI 32):
#: room for one on the stack of a wrapper that was given no status to fill.
STATUS_MAX = 64

#: A message longer than a C ``int`` counts (the wrappers pass counts as ``int``).
ERR_COUNT = 1 << 30

_FUNCTIONS = {
    B_ISEND: "MPI_Isend",
    B_IRECV: "MPI_Irecv",
    B_TEST: "MPI_Test",
    B_TESTALL: "MPI_Testall",
    B_TESTSOME: "MPI_Testsome",
    B_IPROBE: "MPI_Iprobe",
    B_IMPROBE: "MPI_Improbe",
    B_MRECV: "MPI_Mrecv",
    B_CANCEL: "MPI_Cancel",
    B_REQUEST_FREE: "MPI_Request_free",
    B_GET_COUNT: "MPI_Get_count",
    B_TEST_CANCELLED: "MPI_Test_cancelled",
}

_INT_MAX = (1 << 31) - 1


def _signed(value: int, nbytes: int) -> int:
    """``value`` (as mpi4py hands it out, possibly unsigned) as a signed ``nbytes`` integer."""
    bits = 8 * nbytes
    value &= (1 << bits) - 1
    return value - (1 << bits) if value >> (bits - 1) else value


def _loaded_libmpi_paths() -> list[str]:
    """The MPI libraries mapped into this process (Linux: ``/proc/self/maps``)."""
    paths: list[str] = []
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            for line in maps:
                path = line.rstrip("\n").split(None, 5)[-1] if line.count(" ") >= 5 else ""
                # libmpi.so.12 (MPICH, Intel MPI), libmpi.so.40 (Open MPI), libmpi_abi.so
                if os.path.basename(path).startswith("libmpi") and path not in paths:
                    paths.append(path)
    except OSError:
        pass
    return paths


def libmpi() -> ctypes.CDLL:
    """The MPI library mpi4py loaded (never a second copy).

    mpi4py opens ``libmpi`` with ``RTLD_LOCAL`` (its symbols are not global), so the
    process's default namespace does not find them; the library is reopened by the path
    it was mapped from, with ``RTLD_NOLOAD``: that returns the loaded copy or fails.
    """
    import mpi4py.MPI  # noqa: F401  (loads the library)

    tried: list[str] = []
    mode = getattr(os, "RTLD_NOLOAD", 0) | getattr(os, "RTLD_LAZY", 1)
    for path in _loaded_libmpi_paths():
        try:
            lib = ctypes.CDLL(path, mode)
            _ = lib.MPI_Isend
            return lib
        except (OSError, AttributeError) as exc:
            tried.append(f"{path}: {exc}")
    try:  # a library linked into the process, or loaded RTLD_GLOBAL
        lib = ctypes.CDLL(None)
        _ = lib.MPI_Isend
        return lib
    except (OSError, AttributeError) as exc:
        tried.append(f"the process's global symbols: {exc}")
    raise TransportError("cannot find the MPI library mpi4py loaded: " + "; ".join(tried))


def status_layout() -> tuple[int, int, int, int]:
    """``(size, source offset, tag offset, error offset)`` of this library's ``MPI_Status``.

    Found by writing distinct values into an mpi4py ``Status`` and locating them in
    its memory: no ABI's layout is assumed.
    """
    from mpi4py import MPI

    size = MPI._sizeof(MPI.Status)
    st = MPI.Status()
    marks = {"source": 0x5A31_0001, "tag": 0x5A31_0002, "error": 0x5A31_0003}
    st.source, st.tag, st.error = marks["source"], marks["tag"], marks["error"]
    raw = (ctypes.c_int32 * (size // 4)).from_address(MPI._addressof(st))
    words = list(raw)
    offsets = {}
    for name, mark in marks.items():
        if words.count(mark) != 1:
            raise TransportError(
                f"cannot find MPI_Status.MPI_{name.upper()} in this library's status "
                f"({size} bytes: {bytes(raw).hex()})"
            )
        offsets[name] = 4 * words.index(mark)
    return size, offsets["source"], offsets["tag"], offsets["error"]


def binding(comm: Any) -> np.ndarray:
    """The record compiled code uses to call MPI on ``comm`` (an mpi4py communicator).

    The communicator must outlive every use of the record.  Errors come back as codes
    only on a communicator with ``MPI_ERRORS_RETURN`` (the caller sets it); with MPI's
    default handler, an error aborts.
    """
    from mpi4py import MPI

    lib = libmpi()
    hb = MPI._sizeof(MPI.Request)
    sizes = {
        "MPI_Comm": MPI._sizeof(MPI.Comm),
        "MPI_Datatype": MPI._sizeof(MPI.Datatype),
        "MPI_Message": MPI._sizeof(MPI.Message),
        "MPI_Request": hb,
    }
    if hb not in (4, 8) or any(s != hb for s in sizes.values()):
        raise TransportError(f"unsupported MPI handle sizes {sizes} (4 or 8 bytes, all alike)")
    b = np.zeros(B_LEN, dtype=np.int64)
    for slot, name in _FUNCTIONS.items():
        b[slot] = ctypes.cast(getattr(lib, name), ctypes.c_void_p).value or 0
        if b[slot] == 0:
            raise TransportError(f"the MPI library has no {name}")
    b[B_HANDLE_BYTES] = hb
    b[B_BYTE] = _signed(MPI._handleof(MPI.BYTE), hb)
    b[B_COMM] = _signed(MPI._handleof(comm), hb)
    b[B_REQUEST_NULL] = _signed(MPI._handleof(MPI.REQUEST_NULL), hb)
    b[B_MESSAGE_NULL] = _signed(MPI._handleof(MPI.MESSAGE_NULL), hb)
    size, src, tag, err = status_layout()
    if size > STATUS_MAX:
        raise TransportError(f"MPI_Status of {size} bytes (at most {STATUS_MAX} supported)")
    b[B_STATUS_BYTES], b[B_STATUS_SOURCE], b[B_STATUS_TAG], b[B_STATUS_ERROR] = (
        size,
        src,
        tag,
        err,
    )
    b[B_ANY_SOURCE] = MPI.ANY_SOURCE
    b[B_ANY_TAG] = MPI.ANY_TAG
    b[B_UNDEFINED] = MPI.UNDEFINED
    b[B_RANK] = comm.Get_rank()
    b[B_SIZE] = comm.Get_size()
    return b


def error_text(code: int) -> str:
    """What a wrapper's ``-code`` means: MPI's error string for ``code`` (positive)."""
    if code == ERR_COUNT:
        return "a message longer than a C int counts (2**31 - 1 bytes)"
    from mpi4py import MPI

    try:
        return f"{MPI.Get_error_string(code).strip()} (MPI error {code})"
    except Exception:  # a code the library does not know
        return f"MPI error {code}"


def handle_dtype(b: np.ndarray) -> np.dtype:
    """The numpy type of one handle of the record's ABI (``int32`` or ``int64``)."""
    return np.dtype(np.int32 if int(b[B_HANDLE_BYTES]) == 4 else np.int64)


def request_array(b: np.ndarray, n: int) -> np.ndarray:
    """``n`` request handles, each ``MPI_REQUEST_NULL``: room for the wrappers to post into."""
    return np.full(n, b[B_REQUEST_NULL], dtype=handle_dtype(b))


def status_array(b: np.ndarray, n: int) -> np.ndarray:
    """Room for ``n`` statuses (``n * status_bytes``), for ``mpi_testall`` / ``mpi_testsome``."""
    return np.zeros(n * int(b[B_STATUS_BYTES]), dtype=np.uint8)


# ---------------------------------------------------------------------------- compiled


def _make_stack_slot(nbytes: int):  # type: ignore[no-untyped-def]
    @intrinsic
    def stack_slot(typingctx):  # type: ignore[no-untyped-def]
        def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
            slot = cgutils.alloca_once(builder, ir.ArrayType(ir.IntType(64), nbytes // 8))
            return builder.ptrtoint(slot, ir.IntType(64))

        return types.int64(), codegen

    return stack_slot


#: The address of 8 (or ``STATUS_MAX``) bytes in the calling function's stack frame: for
#: an ``int`` flag or a status that MPI writes and the wrapper reads before it returns.
_stack_word = _make_stack_slot(8)
_stack_status = _make_stack_slot(STATUS_MAX)


@njit(nogil=True, cache=True)
def _code(rc: np.int32) -> np.int64:
    return np.int64(0) if rc == 0 else -np.int64(rc)


@njit(nogil=True, cache=True)
def mpi_isend(b, addr, nbytes, peer, tag, req_addr):  # type: ignore[no-untyped-def]
    """Post ``MPI_Isend`` of ``nbytes`` at ``addr`` to ``peer`` on ``tag``; the request is
    written at ``req_addr``.  0 or -code (``-ERR_COUNT`` if ``nbytes`` exceeds an int)."""
    if nbytes > _INT_MAX:
        return -np.int64(ERR_COUNT)
    if b[B_HANDLE_BYTES] == 4:
        rc = ccall_i32(
            b[B_ISEND],
            (
                np.int64(addr),
                np.int32(nbytes),
                np.int32(b[B_BYTE]),
                np.int32(peer),
                np.int32(tag),
                np.int32(b[B_COMM]),
                np.int64(req_addr),
            ),
        )
    else:
        rc = ccall_i32(
            b[B_ISEND],
            (
                np.int64(addr),
                np.int32(nbytes),
                b[B_BYTE],
                np.int32(peer),
                np.int32(tag),
                b[B_COMM],
                np.int64(req_addr),
            ),
        )
    return _code(rc)


@njit(nogil=True, cache=True)
def mpi_irecv(b, addr, nbytes, peer, tag, req_addr):  # type: ignore[no-untyped-def]
    """Post ``MPI_Irecv`` of at most ``nbytes`` into ``addr`` from ``peer``
    (``b[B_ANY_SOURCE]``: any; MPICH's is -2, Open MPI's -1) on ``tag`` (``b[B_ANY_TAG]``:
    any); the request is written at ``req_addr``.  0 or -code."""
    if nbytes > _INT_MAX:
        return -np.int64(ERR_COUNT)
    if b[B_HANDLE_BYTES] == 4:
        rc = ccall_i32(
            b[B_IRECV],
            (
                np.int64(addr),
                np.int32(nbytes),
                np.int32(b[B_BYTE]),
                np.int32(peer),
                np.int32(tag),
                np.int32(b[B_COMM]),
                np.int64(req_addr),
            ),
        )
    else:
        rc = ccall_i32(
            b[B_IRECV],
            (
                np.int64(addr),
                np.int32(nbytes),
                b[B_BYTE],
                np.int32(peer),
                np.int32(tag),
                b[B_COMM],
                np.int64(req_addr),
            ),
        )
    return _code(rc)


@njit(nogil=True, cache=True)
def mpi_test(b, req_addr, status_addr):  # type: ignore[no-untyped-def]
    """``MPI_Test`` on the request at ``req_addr``: 1 done (the handle becomes
    ``MPI_REQUEST_NULL``; its status is written at ``status_addr`` unless that is 0),
    0 not yet, or -code."""
    flag = _stack_word()
    scratch = _stack_status()
    st = status_addr if status_addr != 0 else scratch
    rc = ccall_i32(b[B_TEST], (np.int64(req_addr), flag, np.int64(st)))
    if rc != 0:
        return -np.int64(rc)
    return np.int64(1) if ld_i32(flag) != 0 else np.int64(0)


@njit(nogil=True, cache=True)
def mpi_testall(b, count, reqs_addr, statuses_addr):  # type: ignore[no-untyped-def]
    """``MPI_Testall`` on ``count`` requests stored from ``reqs_addr``: 1 all done (their
    statuses written from ``statuses_addr``, ``count * status_bytes`` of room), 0 not
    yet, or -code (``MPI_ERR_IN_STATUS``: each status's error field says which failed)."""
    flag = _stack_word()
    rc = ccall_i32(
        b[B_TESTALL], (np.int32(count), np.int64(reqs_addr), flag, np.int64(statuses_addr))
    )
    if rc != 0:
        return -np.int64(rc)
    return np.int64(1) if ld_i32(flag) != 0 else np.int64(0)


@njit(nogil=True, cache=True)
def mpi_testsome(b, count, reqs_addr, indices_addr, statuses_addr):  # type: ignore[no-untyped-def]
    """``MPI_Testsome`` on ``count`` requests from ``reqs_addr``: how many completed (their
    positions as C ints from ``indices_addr``, statuses from ``statuses_addr``; each
    needs room for ``count``), ``b[B_UNDEFINED]`` if none was active, or -code."""
    outcount = _stack_word()
    rc = ccall_i32(
        b[B_TESTSOME],
        (
            np.int32(count),
            np.int64(reqs_addr),
            outcount,
            np.int64(indices_addr),
            np.int64(statuses_addr),
        ),
    )
    if rc != 0:
        return -np.int64(rc)
    return np.int64(ld_i32(outcount))


@njit(nogil=True, cache=True)
def mpi_iprobe(b, peer, tag, status_addr):  # type: ignore[no-untyped-def]
    """``MPI_Iprobe``: 1 a message from ``peer`` on ``tag`` is waiting (its status at
    ``status_addr``), 0 none, or -code."""
    flag = _stack_word()
    if b[B_HANDLE_BYTES] == 4:
        rc = ccall_i32(
            b[B_IPROBE],
            (np.int32(peer), np.int32(tag), np.int32(b[B_COMM]), flag, np.int64(status_addr)),
        )
    else:
        rc = ccall_i32(
            b[B_IPROBE], (np.int32(peer), np.int32(tag), b[B_COMM], flag, np.int64(status_addr))
        )
    if rc != 0:
        return -np.int64(rc)
    return np.int64(1) if ld_i32(flag) != 0 else np.int64(0)


@njit(nogil=True, cache=True)
def mpi_improbe(b, peer, tag, msg_addr, status_addr):  # type: ignore[no-untyped-def]
    """``MPI_Improbe``: 1 a message from ``peer`` on ``tag`` is matched and held (its
    handle written at ``msg_addr``, its status at ``status_addr``) until
    :func:`mpi_mrecv`; 0 none; or -code."""
    flag = _stack_word()
    if b[B_HANDLE_BYTES] == 4:
        rc = ccall_i32(
            b[B_IMPROBE],
            (
                np.int32(peer),
                np.int32(tag),
                np.int32(b[B_COMM]),
                flag,
                np.int64(msg_addr),
                np.int64(status_addr),
            ),
        )
    else:
        rc = ccall_i32(
            b[B_IMPROBE],
            (
                np.int32(peer),
                np.int32(tag),
                b[B_COMM],
                flag,
                np.int64(msg_addr),
                np.int64(status_addr),
            ),
        )
    if rc != 0:
        return -np.int64(rc)
    return np.int64(1) if ld_i32(flag) != 0 else np.int64(0)


@njit(nogil=True, cache=True)
def mpi_mrecv(b, addr, nbytes, msg_addr, status_addr):  # type: ignore[no-untyped-def]
    """``MPI_Mrecv`` of the held message at ``msg_addr`` into ``nbytes`` at ``addr``
    (blocking, but the message has arrived); 0 or -code (a longer message: MPI's
    truncation error)."""
    if nbytes > _INT_MAX:
        return -np.int64(ERR_COUNT)
    if b[B_HANDLE_BYTES] == 4:
        rc = ccall_i32(
            b[B_MRECV],
            (
                np.int64(addr),
                np.int32(nbytes),
                np.int32(b[B_BYTE]),
                np.int64(msg_addr),
                np.int64(status_addr),
            ),
        )
    else:
        rc = ccall_i32(
            b[B_MRECV],
            (
                np.int64(addr),
                np.int32(nbytes),
                b[B_BYTE],
                np.int64(msg_addr),
                np.int64(status_addr),
            ),
        )
    return _code(rc)


@njit(nogil=True, cache=True)
def mpi_cancel(b, req_addr):  # type: ignore[no-untyped-def]
    """``MPI_Cancel`` of the request at ``req_addr`` (it completes in a later test); 0 or
    -code."""
    return _code(ccall_i32(b[B_CANCEL], (np.int64(req_addr),)))


@njit(nogil=True, cache=True)
def mpi_request_free(b, req_addr):  # type: ignore[no-untyped-def]
    """``MPI_Request_free`` of the request at ``req_addr``; 0 or -code."""
    return _code(ccall_i32(b[B_REQUEST_FREE], (np.int64(req_addr),)))


@njit(nogil=True, cache=True)
def mpi_get_count(b, status_addr):  # type: ignore[no-untyped-def]
    """Bytes the status at ``status_addr`` received (``MPI_Get_count`` in ``MPI_BYTE``), or
    -code."""
    count = _stack_word()
    if b[B_HANDLE_BYTES] == 4:
        rc = ccall_i32(b[B_GET_COUNT], (np.int64(status_addr), np.int32(b[B_BYTE]), count))
    else:
        rc = ccall_i32(b[B_GET_COUNT], (np.int64(status_addr), b[B_BYTE], count))
    if rc != 0:
        return -np.int64(rc)
    return np.int64(ld_i32(count))


@njit(nogil=True, cache=True)
def mpi_test_cancelled(b, status_addr):  # type: ignore[no-untyped-def]
    """1 if the status at ``status_addr`` is of a cancelled request, 0 if not, or -code."""
    flag = _stack_word()
    rc = ccall_i32(b[B_TEST_CANCELLED], (np.int64(status_addr), flag))
    if rc != 0:
        return -np.int64(rc)
    return np.int64(1) if ld_i32(flag) != 0 else np.int64(0)


@njit(nogil=True, cache=True)
def status_source(b, status_addr):  # type: ignore[no-untyped-def]
    """``MPI_SOURCE`` of the status at ``status_addr``."""
    return np.int64(ld_i32(status_addr + b[B_STATUS_SOURCE]))


@njit(nogil=True, cache=True)
def status_tag(b, status_addr):  # type: ignore[no-untyped-def]
    """``MPI_TAG`` of the status at ``status_addr``."""
    return np.int64(ld_i32(status_addr + b[B_STATUS_TAG]))


@njit(nogil=True, cache=True)
def status_error(b, status_addr):  # type: ignore[no-untyped-def]
    """``MPI_ERROR`` of the status at ``status_addr``."""
    return np.int64(ld_i32(status_addr + b[B_STATUS_ERROR]))

"""Run under ``mpiexec -n P``: the compiled MPI binding against whichever MPI mpi4py loaded.

``python mpi_native_worker.py HANDLE_BYTES`` checks that the handles are that wide, then
round trips of several sizes (status source, tag and count), ``MPI_Test`` /
``MPI_Testall`` / ``MPI_Testsome``, probing and matched receives from compiled code,
cancelling, an error returned as a code, and the compiled floor ring's sums (exact,
out of place and in place).  Prints ``MPI-NATIVE OK <rank> <handle bytes>`` at the end.
"""

from __future__ import annotations

import sys

import numpy as np
from mpi4py import MPI
from numba import njit

from totalreduce.bench.floor import floor_ring
from totalreduce.transport import mpi_native as mn

SIZES = (0, 1, 17, 4096, 65539, 1 << 20)


def pattern(nbytes: int, rank: int, salt: int) -> np.ndarray:
    return ((np.arange(nbytes, dtype=np.int64) * 31 + rank * 7 + salt) % 251).astype(np.uint8)


def check_handles(b: np.ndarray, want: int) -> None:
    hb = int(b[mn.B_HANDLE_BYTES])
    assert hb == want, f"handles of {hb} bytes, expected {want}"
    assert hb == MPI._sizeof(MPI.Comm) == MPI._sizeof(MPI.Request)
    assert mn.request_array(b, 3).dtype == np.dtype(f"int{8 * hb}")
    lo, hi = -(1 << (8 * hb - 1)), (1 << (8 * hb - 1)) - 1
    for slot in (mn.B_BYTE, mn.B_COMM, mn.B_REQUEST_NULL, mn.B_MESSAGE_NULL):
        assert lo <= int(b[slot]) <= hi, (slot, int(b[slot]))
    # Open MPI's handles are addresses: wider than 32 bits on a 64-bit process.
    if hb == 8:
        assert not (-(1 << 31) <= int(b[mn.B_COMM]) < (1 << 31)), hex(int(b[mn.B_COMM]))
    size, src, tag, err = mn.status_layout()
    assert size == MPI._sizeof(MPI.Status) == int(b[mn.B_STATUS_BYTES])
    assert len({src, tag, err}) == 3 and max(src, tag, err) + 4 <= size


def round_trips(comm: MPI.Comm, b: np.ndarray) -> None:
    """Each rank sends every size to its right and receives from its left, by source and
    by any source / any tag, checking data and status."""
    p, rank = comm.Get_size(), comm.Get_rank()
    right, left = (rank + 1) % p, (rank - 1) % p
    reqs = mn.request_array(b, 2)
    sts = mn.status_array(b, 2)
    hb, sb = reqs.itemsize, int(b[mn.B_STATUS_BYTES])
    ra, sa = reqs.ctypes.data, sts.ctypes.data
    for i, n in enumerate(SIZES):
        for any_match in (False, True):
            tag = 100 + 2 * i + any_match
            out = pattern(n, rank, tag)
            got = np.zeros(n + 8, dtype=np.uint8)
            source = int(b[mn.B_ANY_SOURCE]) if any_match else left
            rtag = int(b[mn.B_ANY_TAG]) if any_match else tag
            assert mn.mpi_irecv(b, got.ctypes.data, got.size, source, rtag, ra) == 0
            assert mn.mpi_isend(b, out.ctypes.data, n, right, tag, ra + hb) == 0
            if any_match:  # one request at a time, through MPI_Test
                for k in (0, 1):
                    while (flag := mn.mpi_test(b, ra + k * hb, sa + k * sb)) == 0:
                        pass
                    assert flag == 1, flag
            else:
                while (flag := mn.mpi_testall(b, 2, ra, sa)) == 0:
                    pass
                assert flag == 1, flag
            assert mn.status_source(b, sa) == left, (n, mn.status_source(b, sa))
            assert mn.status_tag(b, sa) == tag, (n, mn.status_tag(b, sa))
            assert mn.mpi_get_count(b, sa) == n, (n, mn.mpi_get_count(b, sa))
            assert mn.status_error(b, sa) == 0
            assert np.array_equal(got[:n], pattern(n, left, tag)), n
            assert (got[n:] == 0).all()
            assert (reqs == b[mn.B_REQUEST_NULL]).all(), reqs
    comm.Barrier()


def test_some(comm: MPI.Comm, b: np.ndarray) -> None:
    """Four receives from the left, completed through MPI_Testsome."""
    p, rank = comm.Get_size(), comm.Get_rank()
    right, left = (rank + 1) % p, (rank - 1) % p
    reqs = mn.request_array(b, 8)
    sts = mn.status_array(b, 8)
    idx = np.zeros(8, dtype=np.int32)
    hb, sb = reqs.itemsize, int(b[mn.B_STATUS_BYTES])
    bufs = [np.zeros(64, dtype=np.uint8) for _ in range(4)]
    outs = [pattern(10 + k, rank, k) for k in range(4)]
    for k in range(4):
        assert (
            mn.mpi_irecv(b, bufs[k].ctypes.data, 64, left, 300 + k, reqs.ctypes.data + k * hb) == 0
        )
    for k in range(4):
        addr = reqs.ctypes.data + (4 + k) * hb
        assert mn.mpi_isend(b, outs[k].ctypes.data, outs[k].size, right, 300 + k, addr) == 0
    seen: set[int] = set()
    while len(seen) < 8:
        n = mn.mpi_testsome(b, 8, reqs.ctypes.data, idx.ctypes.data, sts.ctypes.data)
        assert n >= 0, n
        for j in range(n if n != b[mn.B_UNDEFINED] else 0):
            k = int(idx[j])
            assert k not in seen
            seen.add(k)
            if k < 4:
                st = sts.ctypes.data + j * sb
                assert mn.status_tag(b, st) == 300 + k
                assert mn.mpi_get_count(b, st) == 10 + k
    for k in range(4):
        assert np.array_equal(bufs[k][: 10 + k], pattern(10 + k, left, k))
    comm.Barrier()


@njit(nogil=True, cache=True)
def _probe_and_receive(b, tag, buf, ws):  # type: ignore[no-untyped-def]
    """From compiled code: wait for a message on ``tag`` with MPI_Improbe, receive it with
    MPI_Mrecv; returns (source, bytes)."""
    msg = ws.ctypes.data
    st = msg + 8
    while True:
        r = mn.mpi_improbe(b, b[mn.B_ANY_SOURCE], tag, msg, st)
        if r != 0:
            break
    if r < 0:
        return r, np.int64(0)
    n = mn.mpi_get_count(b, st)
    rc = mn.mpi_mrecv(b, buf.ctypes.data, buf.size, msg, st)
    if rc < 0:
        return rc, np.int64(0)
    return mn.status_source(b, st), n


def probe(comm: MPI.Comm, b: np.ndarray) -> None:
    p, rank = comm.Get_size(), comm.Get_rank()
    right, left = (rank + 1) % p, (rank - 1) % p
    out = pattern(777, rank, 5)
    reqs = mn.request_array(b, 1)
    st = mn.status_array(b, 1)
    assert mn.mpi_isend(b, out.ctypes.data, out.size, right, 400, reqs.ctypes.data) == 0
    # Iprobe sees it before it is received, from the left, with its length.
    while (flag := mn.mpi_iprobe(b, left, 400, st.ctypes.data)) == 0:
        pass
    assert flag == 1 and mn.mpi_get_count(b, st.ctypes.data) == 777
    got = np.zeros(1000, dtype=np.uint8)
    ws = np.zeros(16, dtype=np.int64)
    source, n = _probe_and_receive(b, np.int64(400), got, ws)
    assert (source, n) == (left, 777), (source, n)
    assert np.array_equal(got[:777], pattern(777, left, 5))
    while mn.mpi_test(b, reqs.ctypes.data, 0) == 0:
        pass
    comm.Barrier()


def cancel_and_errors(comm: MPI.Comm, b: np.ndarray) -> None:
    p = comm.Get_size()
    reqs = mn.request_array(b, 1)
    st = mn.status_array(b, 1)
    buf = np.zeros(8, dtype=np.uint8)
    # A receive nothing will match, cancelled: it completes, and its status says so.
    assert mn.mpi_irecv(b, buf.ctypes.data, 8, 0, 999, reqs.ctypes.data) == 0
    assert mn.mpi_cancel(b, reqs.ctypes.data) == 0
    while (flag := mn.mpi_test(b, reqs.ctypes.data, st.ctypes.data)) == 0:
        pass
    assert flag == 1 and mn.mpi_test_cancelled(b, st.ctypes.data) == 1
    # A send to a rank that does not exist: a negative code, not an abort.
    rc = mn.mpi_isend(b, buf.ctypes.data, 8, p + 5, 1, reqs.ctypes.data)
    assert rc < 0, rc
    assert "rank" in mn.error_text(int(-rc)).lower(), mn.error_text(int(-rc))
    # A request freed while active still delivers its message.
    rank = comm.Get_rank()
    right, left = (rank + 1) % p, (rank - 1) % p
    out = pattern(33, rank, 9)
    assert mn.mpi_isend(b, out.ctypes.data, 33, right, 500, reqs.ctypes.data) == 0
    assert mn.mpi_request_free(b, reqs.ctypes.data) == 0
    assert reqs[0] == b[mn.B_REQUEST_NULL]
    got = np.zeros(33, dtype=np.uint8)
    comm.Recv(got, source=left, tag=500)
    assert np.array_equal(got, pattern(33, left, 9))
    comm.Barrier()


def floor(comm: MPI.Comm) -> None:
    p, rank = comm.Get_size(), comm.Get_rank()
    for n in (0, 1, p - 1, p + 1, 1000, 4096, 262147):

        def inp(r: int, n: int = n) -> np.ndarray:
            return ((np.arange(n) * 7 + r * 3) % 11 + r).astype(np.float32)

        want = inp(0)
        for r in range(1, p):
            want += inp(r)
        x = inp(rank)
        out = np.full_like(x, -1.0)
        scratch = np.empty(-(-n // p), dtype=np.float32)
        floor_ring(comm, x, out, scratch)()
        assert np.array_equal(out, want), (n, out[:8], want[:8])
        assert np.array_equal(x, inp(rank))
        floor_ring(comm, x, x, scratch)()  # in place
        assert np.array_equal(x, want), n
        # np.sum in float32 over the ranks' inputs gives the same bits.
        assert np.array_equal(x, np.sum([inp(r) for r in range(p)], axis=0, dtype=np.float32))
    comm.Barrier()


def main() -> None:
    want_bytes = int(sys.argv[1])
    comm = MPI.COMM_WORLD.Dup()
    comm.Set_errhandler(MPI.ERRORS_RETURN)
    b = mn.binding(comm)
    check_handles(b, want_bytes)
    round_trips(comm, b)
    test_some(comm, b)
    probe(comm, b)
    cancel_and_errors(comm, b)
    floor(comm)
    print(f"MPI-NATIVE OK {comm.Get_rank()} {int(b[mn.B_HANDLE_BYTES])}", flush=True)
    comm.Free()


if __name__ == "__main__":
    main()

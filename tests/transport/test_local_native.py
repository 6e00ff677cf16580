"""The local transport's compiled message layer, called as the lane calls MPI: through
:mod:`totalreduce.transport.mpi_native`'s wrappers and a binding record."""

from __future__ import annotations

import random
import threading

import numpy as np

from totalreduce.transport import mpi_native as M
from totalreduce.transport.local import LocalWorld
from totalreduce.transport.local_native import (
    ERR_IN_STATUS,
    ERR_NO_MEM,
    ERR_RANK,
    ERR_TAG,
    ERR_TRUNCATE,
    NativeWorld,
    error_text,
)


class Rank:
    """One rank's end: its record, and room for requests and statuses."""

    def __init__(self, world: NativeWorld, rank: int, nreq: int = 8) -> None:
        self.b = world.binding(rank)
        self.reqs = M.request_array(self.b, nreq)
        self.status = M.status_array(self.b, nreq)
        self.idx = np.zeros(nreq, dtype=np.int32)
        self.msg = np.zeros(1, dtype=np.int64)

    def req(self, k: int) -> int:
        return self.reqs.ctypes.data + 8 * k

    def send(self, buf: np.ndarray, dest: int, tag: int, k: int = 0) -> int:
        return M.mpi_isend(self.b, buf.ctypes.data, buf.nbytes, dest, tag, self.req(k))

    def recv(self, buf: np.ndarray, source: int, tag: int, k: int = 0) -> int:
        return M.mpi_irecv(self.b, buf.ctypes.data, buf.nbytes, source, tag, self.req(k))

    def test(self, k: int = 0) -> int:
        return M.mpi_test(self.b, self.req(k), self.status.ctypes.data)

    @property
    def st(self) -> int:
        return self.status.ctypes.data

    def source(self, k: int = 0) -> int:
        return M.status_source(self.b, self.st + k * int(self.b[M.B_STATUS_BYTES]))

    def tag(self, k: int = 0) -> int:
        return M.status_tag(self.b, self.st + k * int(self.b[M.B_STATUS_BYTES]))

    def count(self) -> int:
        return M.mpi_get_count(self.b, self.st)


def test_a_send_completes_when_a_receive_takes_it_and_reads_the_buffer_then() -> None:
    w = NativeWorld(2)
    a, b = Rank(w, 0), Rank(w, 1)
    src = np.arange(10, dtype=np.uint8)
    assert a.send(src, 1, 7) == 0
    assert a.test() == 0  # a rendezvous: nothing has taken it
    src[0] = 99  # the receiver reads the buffer when it matches, as on a network
    dst = np.zeros(16, dtype=np.uint8)
    assert b.recv(dst, 0, 7) == 0
    assert b.test() == 1
    assert (b.source(), b.tag(), b.count()) == (0, 7, 10)
    assert dst[:10].tolist() == [99] + list(range(1, 10))
    assert a.test() == 1
    assert a.reqs[0] == b.reqs[0] == int(a.b[M.B_REQUEST_NULL])
    assert w.in_use == 0


def test_matching_keeps_each_senders_order_and_any_source_takes_the_earliest() -> None:
    w = NativeWorld(3)
    r0, r1, r2 = Rank(w, 0, 16), Rank(w, 1, 16), Rank(w, 2, 16)
    bufs = [np.full(4, v, dtype=np.uint8) for v in range(6)]
    r0.send(bufs[0], 2, 5, 0)
    r1.send(bufs[1], 2, 5, 0)
    r0.send(bufs[2], 2, 6, 1)  # another tag
    r0.send(bufs[3], 2, 5, 2)
    got = []
    for k in range(3):
        d = np.zeros(4, dtype=np.uint8)
        r2.recv(d, int(r2.b[M.B_ANY_SOURCE]), 5, k)
        assert r2.test(k) == 1
        got.append((r2.source(), int(d[0])))
    assert got == [(0, 0), (1, 1), (0, 3)]
    d = np.zeros(4, dtype=np.uint8)
    r2.recv(d, 0, int(r2.b[M.B_ANY_TAG]))  # any tag: what is left, tag 6
    assert r2.test() == 1 and (r2.tag(), int(d[0])) == (6, 2)
    # receives posted first match in the order they were posted
    d1, d2 = np.zeros(4, dtype=np.uint8), np.zeros(4, dtype=np.uint8)
    r2.recv(d1, 1, 9, 0)
    r2.recv(d2, 1, 9, 1)
    r1.send(bufs[4], 2, 9, 1)
    r1.send(bufs[5], 2, 9, 2)
    assert r2.test(0) == 1 and r2.test(1) == 1
    assert (int(d1[0]), int(d2[0])) == (4, 5)


def test_improbe_holds_a_message_for_mrecv() -> None:
    w = NativeWorld(2)
    a, b = Rank(w, 0), Rank(w, 1)
    msg = b.msg.ctypes.data
    assert M.mpi_improbe(b.b, int(b.b[M.B_ANY_SOURCE]), 3, msg, b.st) == 0  # nothing yet
    src = np.arange(6, dtype=np.uint8)
    a.send(src, 1, 3)
    assert M.mpi_iprobe(b.b, 0, 3, b.st) == 1 and b.count() == 6
    assert M.mpi_improbe(b.b, int(b.b[M.B_ANY_SOURCE]), 3, msg, b.st) == 1
    assert (b.source(), b.count()) == (0, 6)
    assert M.mpi_iprobe(b.b, 0, 3, b.st) == 0  # taken: no other probe sees it
    assert a.test() == 0
    d = np.zeros(8, dtype=np.uint8)
    assert M.mpi_mrecv(b.b, d.ctypes.data, 8, msg, b.st) == 0
    assert d[:6].tolist() == list(range(6)) and b.msg[0] == int(b.b[M.B_MESSAGE_NULL])
    assert a.test() == 1 and w.in_use == 0


def test_testsome_and_testall() -> None:
    w = NativeWorld(2)
    a, b = Rank(w, 0), Rank(w, 1)
    idx = a.idx.ctypes.data
    assert M.mpi_testsome(a.b, 4, a.reqs.ctypes.data, idx, a.st) == int(a.b[M.B_UNDEFINED])
    bufs = [np.full(3, k, dtype=np.uint8) for k in range(4)]
    for k in range(4):
        a.send(bufs[k], 1, 10 + k, k)
    assert M.mpi_testsome(a.b, 4, a.reqs.ctypes.data, idx, a.st) == 0
    assert M.mpi_testall(a.b, 4, a.reqs.ctypes.data, a.st) == 0
    dst = [np.zeros(3, dtype=np.uint8) for _ in range(4)]  # alive until received
    for k in (2, 0):
        b.recv(dst[k], 0, 10 + k, k)
    assert M.mpi_testsome(a.b, 4, a.reqs.ctypes.data, idx, a.st) == 2
    assert sorted(a.idx[:2].tolist()) == [0, 2]
    for k in (1, 3):
        b.recv(dst[k], 0, 10 + k, k)
    assert M.mpi_testall(a.b, 4, a.reqs.ctypes.data, a.st) == 1
    assert M.mpi_testall(b.b, 4, b.reqs.ctypes.data, b.st) == 1
    assert [b.tag(k) for k in range(4)] == [10, 11, 12, 13]
    assert w.in_use == 0


def test_cancel_a_receive_or_a_send_nobody_took() -> None:
    w = NativeWorld(2)
    a, b = Rank(w, 0), Rank(w, 1)
    x = np.zeros(4, dtype=np.uint8)
    b.recv(x, 0, 1)
    assert M.mpi_cancel(b.b, b.req(0)) == 0
    assert b.test() == 1 and M.mpi_test_cancelled(b.b, b.st) == 1
    a.send(x, 1, 1)
    assert M.mpi_cancel(a.b, a.req(0)) == 0
    assert a.test() == 1 and M.mpi_test_cancelled(a.b, a.st) == 1
    assert M.mpi_iprobe(b.b, 0, 1, b.st) == 0  # the cancelled send is gone
    # a matched receive is not cancelled
    ones = np.ones(4, dtype=np.uint8)  # a send reads its buffer when it is taken
    a.send(ones, 1, 2)
    d = np.zeros(4, dtype=np.uint8)
    b.recv(d, 0, 2)
    M.mpi_cancel(b.b, b.req(0))
    assert b.test() == 1 and M.mpi_test_cancelled(b.b, b.st) == 0 and d.tolist() == [1] * 4
    assert a.test() == 1 and w.in_use == 0


def test_a_freed_request_is_released_when_it_completes() -> None:
    w = NativeWorld(2)
    a, b = Rank(w, 0), Rank(w, 1)
    src = np.arange(4, dtype=np.uint8)
    a.send(src, 1, 4)
    assert M.mpi_request_free(a.b, a.req(0)) == 0 and w.in_use == 1
    d = np.zeros(4, dtype=np.uint8)
    b.recv(d, 0, 4)
    assert b.test() == 1 and d.tolist() == [0, 1, 2, 3]
    assert w.in_use == 0


def test_truncation_fails_the_receive_and_names_it() -> None:
    w = NativeWorld(2)
    a, b = Rank(w, 0), Rank(w, 1)
    big = np.arange(32, dtype=np.uint8)  # sends read it when taken: kept alive
    a.send(big, 1, 5)
    d = np.zeros(16, dtype=np.uint8)
    b.recv(d, 0, 5)
    assert b.test() == -ERR_TRUNCATE
    assert d.tolist() == list(range(16))
    assert "truncated" in error_text(ERR_TRUNCATE)
    a.send(big, 1, 6, 1)
    b.recv(d, 0, 6, 1)
    assert M.mpi_testsome(b.b, 2, b.reqs.ctypes.data, b.idx.ctypes.data, b.st) == -ERR_IN_STATUS
    assert M.status_error(b.b, b.st) == ERR_TRUNCATE
    # a probed message longer than the receive
    a.send(big, 1, 7, 2)
    assert M.mpi_improbe(b.b, 0, 7, b.msg.ctypes.data, b.st) == 1
    assert M.mpi_mrecv(b.b, d.ctypes.data, 16, b.msg.ctypes.data, b.st) == -ERR_TRUNCATE


def test_bad_arguments_and_a_full_world_are_error_codes() -> None:
    w = NativeWorld(2, capacity=2)
    a = Rank(w, 0)
    x = np.zeros(4, dtype=np.uint8)
    assert a.send(x, 2, 1) == -ERR_RANK
    assert a.send(x, -1, 1) == -ERR_RANK
    assert a.send(x, 1, -5) == -ERR_TAG
    assert a.send(x, 1, 1, 0) == 0 and a.send(x, 1, 1, 1) == 0
    assert a.send(x, 1, 1, 2) == -ERR_NO_MEM
    assert "in use" in error_text(ERR_NO_MEM)
    assert w.peak == 2


def test_threads_exchange_concurrently_in_order() -> None:
    """Four ranks as threads, each sending 300 messages of mixed sizes to every other
    while receiving from any source: every message arrives whole, each sender's in order."""
    size, n = 4, 300
    w = NativeWorld(size)
    failures: list[str] = []

    def rank_main(r: int) -> None:
        me = Rank(w, r, nreq=2 * size * n)
        rng = random.Random(r)
        sends = []
        for k in range(n):
            for p in range(size):
                if p != r:
                    m = rng.choice([8, 100, 5000])
                    buf = np.full(m, (r * 31 + k) % 251, dtype=np.uint8)
                    buf[:8] = np.frombuffer(np.int64(k).tobytes(), dtype=np.uint8)
                    sends.append(buf)
                    assert me.send(buf, p, 11, len(sends) - 1) == 0
        seen = {p: -1 for p in range(size) if p != r}
        any_source = int(me.b[M.B_ANY_SOURCE])
        d = np.zeros(5000, dtype=np.uint8)
        rk = len(sends)
        for _ in range(n * (size - 1)):
            assert me.recv(d, any_source, 11, rk) == 0
            while me.test(rk) != 1:
                pass
            src, cnt = me.source(), me.count()
            k = int(np.frombuffer(d[:8].tobytes(), dtype=np.int64)[0])
            if k != seen[src] + 1 or not np.all(d[8:cnt] == (src * 31 + k) % 251):
                failures.append(f"rank {r}: from {src} got {k} after {seen[src]}")
            seen[src] = k
        nsend = len(sends)
        while M.mpi_testall(me.b, nsend, me.reqs.ctypes.data, 0) != 1:
            pass

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert failures == []
    assert w.in_use == 0


def test_local_transports_offer_the_binding() -> None:
    """Every in-process transport has the compiled binding (the lane is the one engine)."""
    world = LocalWorld(2)
    t = world.transport(1)
    b = t.native_binding()
    assert int(b[M.B_RANK]) == 1 and int(b[M.B_SIZE]) == 2
    assert int(b[M.B_KIND]) == M.KIND_LOCAL
    assert world.native() is world.native()


def test_jitter_holds_a_send_back_for_a_few_calls_and_keeps_a_senders_order() -> None:
    w = NativeWorld(2, jitter=1.0)  # every send is held back
    a, b = Rank(w, 0), Rank(w, 1)
    first, second = np.full(4, 1, dtype=np.uint8), np.full(4, 2, dtype=np.uint8)
    a.send(first, 1, 3, 0)
    a.send(second, 1, 3, 1)
    calls = 0
    while M.mpi_iprobe(b.b, 0, 3, b.st) == 0:
        calls += 1
        assert calls < 20, "a held send never became visible"
    assert calls >= 1
    got = []
    for k in range(2):
        d = np.zeros(4, dtype=np.uint8)
        b.recv(d, 0, 3, k)
        while b.test(k) != 1:
            pass
        got.append(int(d[0]))
    assert got == [1, 2]
    # a receive posted before the send becomes visible takes it when it does
    d = np.zeros(4, dtype=np.uint8)
    b.recv(d, 0, 4, 0)
    a.send(first, 1, 4, 2)
    while b.test(0) != 1:
        pass
    assert int(d[0]) == 1
    while M.mpi_testall(a.b, 3, a.reqs.ctypes.data, 0) != 1:
        pass
    assert w.in_use == 0


def test_jitter_reorders_across_senders_only() -> None:
    """Three senders, one receiver taking from any source: each sender's messages arrive in
    order, and some message overtakes another sender's earlier one."""
    w = NativeWorld(4, jitter=0.5, seed=3)
    senders = [Rank(w, r, nreq=64) for r in range(3)]
    recv = Rank(w, 3, nreq=2)
    bufs = []
    for k in range(40):
        for r, s in enumerate(senders):
            buf = np.array([r, k], dtype=np.uint8)
            bufs.append(buf)
            s.send(buf, 3, 0, k)
    order = []
    d = np.zeros(2, dtype=np.uint8)
    for _ in range(120):
        recv.recv(d, int(recv.b[M.B_ANY_SOURCE]), 0, 0)
        while recv.test(0) != 1:
            pass
        order.append((int(d[0]), int(d[1])))
    for r in range(3):
        assert [k for s, k in order if s == r] == list(range(40))
    posted = [(k, r) for k in range(40) for r in range(3)]
    assert [(k, s) for s, k in order] != posted  # reordered across senders
    for s in senders:
        while M.mpi_testall(s.b, 40, s.reqs.ctypes.data, 0) != 1:
            pass
    assert w.in_use == 0

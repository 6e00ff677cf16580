"""The node's meeting place (transport/meeting.py), its compiled functions alone: clients as
threads of this process over one arena, no service.

Tickets taken by compare-and-swap are unique and skip words in use; every client finds the
same channel for a name, and a full table says so alike; a round opens only once the last
one is over; the last arrival runs the op, and waiting clients share a large op's slices;
the bits are the slot-order reduction's; the first arrival of a round never runs it, and
a client whose previous op of the slot was not seen to end is told so (nothing arrives);
an op the meeting cannot run escapes through the queue; a round the service fails is
answered by it, against the completer, and its word is never written over a later op's.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

from totalreduce.dtypes import DType, ReduceOp
from totalreduce.transport import arena as A
from totalreduce.transport import meeting as M

_AR, _BC, _BAR = 1, 2, 3


class Place:
    """An arena of ``L`` slots with its meeting place on, and each client's arrays."""

    def __init__(self, L: int, data: int = 8 << 20) -> None:
        self.L = L
        self.arena = A.Arena.create(L, data)
        self.arena.header[A.H_MEET_ON] = 1
        self.cf = [M.config(self.arena, k) for k in range(L)]
        self.st = [M.state(0) for _ in range(L)]

    def buf(self, k: int, nbytes: int, dtype: Any, second: bool = False) -> tuple[int, np.ndarray]:
        at = self.arena.data_start(k) + (self.arena.data_bytes // 2 if second else 0)
        n = nbytes // np.dtype(dtype).itemsize
        return at, self.arena.view(at, n, np.dtype(dtype))

    def word(self, k: int, ticket: int) -> int:
        return int(self.arena.control(k)[A.DONE_WORD + (ticket - 1) % A.RING])

    def counts(self) -> tuple[int, int]:
        mem = self.arena.view(int(self.arena.header[A.H_MEET]), 512, np.dtype(np.int64))
        return int(mem[M.M_RAN // 8]), int(mem[M.M_ESCAPED // 8])

    def close(self) -> None:
        self.arena.close()


def rec(wire: int, kind: int, dt: DType, op: ReduceOp, count: int, root: int = 0) -> np.ndarray:
    flags = A.F_AVG if op is ReduceOp.AVG else 0
    return M.record(wire, M.pack_shape(kind, int(dt), int(op), flags, 0), count, root)


def blocking(p: Place, k: int, r: np.ndarray, gen: int, at: int) -> int:
    """One blocking op of client ``k`` (waits up to 30 s): its meet_now code."""
    t = int(M.take_ticket(p.st[k]))
    return int(M.meet_now(p.cf[k], p.st[k], r, gen, t, 0, at, 200_000, 30_000_000_000))


def together(L: int, fn: Any) -> list[Any]:
    """``fn(k)`` on ``L`` threads at once; their results."""
    out: list[Any] = [None] * L
    errors: list[BaseException] = []

    def run(k: int) -> None:
        try:
            out[k] = fn(k)
        except BaseException as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(L)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return out


def test_tickets_are_unique_and_skip_words_in_use() -> None:
    st = M.state(10)
    st[M.ST_INUSE + 11 % A.RING] = 1  # ticket 12's word is held (a standing receive)
    got = [int(M.take_ticket(st)) for _ in range(5)]
    assert got == [11, 13, 14, 15, 16]
    M.release(st, 13, -1)
    assert int(M.take_ticket(st)) == 17  # tickets only grow, words come back
    seen = together(4, lambda k: [int(M.take_ticket(st)) for _ in range(500)])
    flat = [t for ts in seen for t in ts]
    assert len(set(flat)) == len(flat)


def test_every_client_finds_the_same_channel_and_a_full_table_alike() -> None:
    p = Place(3)
    try:
        wires = [(1 << 40) + 7919 * i for i in range(int(p.cf[0][M.CF_C]))]
        for w in wires[:50]:
            assert len({int(M.lookup(p.cf[k], w)) for k in range(3)}) == 1
        chans = [int(M.lookup(p.cf[0], w)) for w in wires]
        assert sorted(chans) == list(range(len(wires)))  # every channel taken once
        assert int(M.lookup(p.cf[1], (1 << 50) + 3)) == -1  # a new name: none left
        assert int(M.lookup(p.cf[2], wires[-1])) == chans[-1]  # an old one still found
        assert int(M.lookup(p.cf[0], 0)) == -1
    finally:
        p.close()


@pytest.mark.parametrize("L", [1, 2, 3, 4])
def test_the_last_arrival_runs_the_op_with_the_slot_order_bits(L: int) -> None:
    p = Place(L)
    try:
        rng = np.random.default_rng(L)
        n = 3 * (M.SLICE_BYTES // 4) + 5  # four slices
        xs = [rng.standard_normal(n).astype(np.float32) for _ in range(L)]
        want = xs[0].copy()
        for x in xs[1:]:
            want += x
        r = rec(99, _AR, DType.FLOAT32, ReduceOp.SUM, n)

        def go(k: int) -> int:
            at, view = p.buf(k, 4 * n, np.float32)
            view[:] = xs[k]
            return blocking(p, k, r.copy(), 0, at)

        assert together(L, go) == [M.P_DONE] * L
        for k in range(L):
            np.testing.assert_array_equal(p.buf(k, 4 * n, np.float32)[1], want)
        assert p.counts() == (1, 0)
    finally:
        p.close()


def test_waiting_clients_share_the_slices_of_a_large_op() -> None:
    """The first arrival waits; the last runs slices, and the waiter, woken, claims some
    too: every slice done once (the sum would show a slice done twice, in place)."""
    p = Place(2, data=64 << 20)
    try:
        n = (32 << 20) // 4
        r = rec(5, _AR, DType.INT64, ReduceOp.SUM, n // 2)
        for k in range(2):
            p.buf(k, 4 * n, np.int64)[1][:] = k + 1
        assert (
            together(2, lambda k: blocking(p, k, r.copy(), 0, p.buf(k, 8, np.int64)[0]))
            == [M.P_DONE] * 2
        )
        for k in range(2):
            assert (p.buf(k, 4 * n, np.int64)[1] == 3).all()
    finally:
        p.close()


def test_a_broadcast_and_a_barrier() -> None:
    p = Place(3)
    try:
        for root in range(3):
            r = rec(40 + root, _BC, DType.INT32, ReduceOp.SUM, 100, root)

            def go(k: int, root: int = root, r: np.ndarray = r) -> int:
                at, x = p.buf(k, 400, np.int32)
                x[:] = np.arange(100) * (k + 1)
                return blocking(p, k, r.copy(), 0, at)

            assert together(3, go) == [M.P_DONE] * 3
            for k in range(3):
                np.testing.assert_array_equal(
                    p.buf(k, 400, np.int32)[1], np.arange(100) * (root + 1)
                )
        b = rec(77, _BAR, DType.INT64, ReduceOp.SUM, 0)
        for gen in range(20):  # more generations than op slots: rounds reopen
            assert together(3, lambda k, g=gen: blocking(p, k, b.copy(), g, -1)) == [M.P_DONE] * 3
    finally:
        p.close()


def test_a_round_opens_only_once_its_clients_previous_op_there_was_seen_to_end() -> None:
    p = Place(2)
    try:
        r0, r1 = (rec(11, _BAR, DType.INT64, ReduceOp.SUM, 0) for _ in range(2))
        t = int(M.take_ticket(p.st[0]))
        assert int(M.meet_post(p.cf[0], p.st[0], r0, 0, t, 0, -1, -1)) == M.P_WAIT
        # generation DEPTH lands in the same op slot: client 0's op there has not ended
        t2 = int(M.take_ticket(p.st[0]))
        assert int(M.meet_post(p.cf[0], p.st[0], r0, M.DEPTH, t2, 0, -1, -1)) == M.P_BUSY
        # client 1 a round ahead of an op slot whose round is not over: it makes no sense
        t3 = int(M.take_ticket(p.st[1]))
        assert int(M.meet_post(p.cf[1], p.st[1], r1, M.DEPTH, t3, 0, -1, -1)) == M.P_WEIRD
        t4 = int(M.take_ticket(p.st[1]))
        assert int(M.meet_post(p.cf[1], p.st[1], r1, 0, t4, 0, -1, -1)) == M.P_DONE
        assert p.word(0, t) == t and p.word(1, t4) == t4
        assert int(M.meet_wait(p.cf[0], p.st[0], t, int(r0[M.R_CH]) * M.DEPTH, 1, M.FOREVER, 0,
                               M.CHECK_NS)) == M.W_DONE  # fmt: skip
        M.release(p.st[0], t, int(r0[M.R_CH]) * M.DEPTH)
        assert int(M.meet_post(p.cf[0], p.st[0], r0, M.DEPTH, t2, 0, -1, -1)) == M.P_WAIT
    finally:
        p.close()


def test_a_wait_times_out_and_a_wait_returns_to_look_at_the_socket() -> None:
    p = Place(2)
    try:
        r = rec(12, _BAR, DType.INT64, ReduceOp.SUM, 0)
        t = int(M.take_ticket(p.st[0]))
        assert int(M.meet_post(p.cf[0], p.st[0], r, 0, t, 0, -1, -1)) == M.P_WAIT
        idx = int(r[M.R_CH]) * M.DEPTH
        now = int(M.now())
        assert int(M.meet_wait(p.cf[0], p.st[0], t, idx, 1, now + 2_000_000, 0, M.CHECK_NS)) == (
            M.W_TIMEOUT
        )
        assert int(M.meet_wait(p.cf[0], p.st[0], t, idx, 1, M.FOREVER, 0, 3_000_000)) == M.W_CHECK
    finally:
        p.close()


def test_what_the_meeting_cannot_run_escapes_through_the_queue() -> None:
    p = Place(2)
    try:
        shapes = [
            rec(21, _AR, DType.INT64, ReduceOp.SUM, 10),
            rec(21, _AR, DType.INT64, ReduceOp.SUM, 11),  # the counts differ
        ]
        ats = [p.buf(k, 88, np.int64)[0] for k in range(2)]
        codes = [
            int(M.meet_post(p.cf[k], p.st[k], shapes[k], 0, int(M.take_ticket(p.st[k])), 0,
                            ats[k], ats[k]))
            for k in range(2)
        ]  # fmt: skip
        assert codes == [M.P_WAIT, M.P_ESCAPED | M.WAKE_SERVICE]
        payload = int(M.queue_take(p.cf[0], 0))
        assert payload >> 24 == int(shapes[0][M.R_CH]) * M.DEPTH
        assert int(M.queue_take(p.cf[0], 1)) == -1
        int8 = rec(22, _AR, DType.INT8, ReduceOp.SUM, 4)  # no raw kernel: the service's
        outside = rec(23, _AR, DType.INT64, ReduceOp.SUM, 4)
        for r, at in ((int8, ats), (outside, [ats[0], ats[0]])):  # client 1's in 0's part
            got = [
                int(M.meet_post(p.cf[k], p.st[k], r.copy(), 0, int(M.take_ticket(p.st[k])), 0,
                                at[k], at[k]))
                for k in range(2)
            ]  # fmt: skip
            assert got[1] == M.P_ESCAPED | M.WAKE_SERVICE
        assert p.counts() == (0, 3)
    finally:
        p.close()


def test_a_round_the_service_fails_stays_failed_and_its_words_only_go_forward() -> None:
    p = Place(3)
    try:
        r = rec(31, _BAR, DType.INT64, ReduceOp.SUM, 0)
        t = int(M.take_ticket(p.st[0]))
        assert int(M.meet_post(p.cf[0], p.st[0], r.copy(), 0, t, 0, -1, -1)) == M.P_WAIT
        c = int(M.lookup(p.cf[0], 31))
        assert int(M.fail_round(p.cf[0], c, 0, 0)) >= 0
        assert int(M.fail_round(p.cf[0], c, 0, 0)) == -1  # once
        late = int(M.take_ticket(p.st[1]))
        assert int(M.meet_post(p.cf[1], p.st[1], r.copy(), 0, late, 0, -1, -1)) == M.P_FAILED
        ctl = p.arena.base + p.arena.slot_start(0)
        M.fail_word(ctl, t)
        assert p.word(0, t) == -t
        later = t + A.RING  # the same word, a later op's ticket: left alone
        p.arena.control(0)[A.DONE_WORD + (later - 1) % A.RING] = later
        M.fail_word(ctl, t)
        assert p.word(0, later) == later
        # the next round of that op slot opens: the failed one is over
        for k in range(3):
            M.release(p.st[k], 0, int(r[M.R_CH] if r[M.R_CH] >= 0 else c) * M.DEPTH)
        p.st[0][M.ST_PEND + c * M.DEPTH] = 0
        got = together(3, lambda k: blocking(p, k, r.copy(), M.DEPTH, -1))
        assert got == [M.P_DONE] * 3
    finally:
        p.close()

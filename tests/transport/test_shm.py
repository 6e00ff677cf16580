"""The shared-memory channels, the client transport and the relay on one node (no MPI)."""

from __future__ import annotations

import fcntl
import multiprocessing
import os
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from totalreduce.errors import TotalReduceError, TransportError
from totalreduce.transport.base import ANY_SOURCE, OversizeMessage
from totalreduce.transport.relay import RelayTransport
from totalreduce.transport.shm import (
    Channel,
    SharedRegion,
    ShmClientTransport,
    new_eventfd,
)

CAP = 16 << 10  # small rings: most messages stream
FORK = multiprocessing.get_context("fork")


def payload(src: int, dst: int, tag: int, seq: int, top: int) -> np.ndarray:
    """The seq-th message src sends dst on tag: size and bytes derived from the four."""
    rng = random.Random(hash((src, dst, tag, seq)))
    n = rng.choice([0, 1, 7, 31, 32, 33, rng.randrange(top + 1)])
    return np.frombuffer(rng.randbytes(n), dtype=np.uint8)


def client_of(relay: RelayTransport, slot: int, channel: Channel, cfd: int) -> ShmClientTransport:
    L = relay.local_clients
    return ShmClientTransport(
        relay.node * L + slot,
        relay.size,
        relay.relays,
        relay.rank,
        Channel.attach(os.dup(channel.fd), channel.size),
        cfd,
        os.dup(relay.eventfd),
        relay.pid,
        tag_span=relay.tag_span,
    )


def node(L: int, capacity: int = CAP) -> tuple[RelayTransport, list[ShmClientTransport]]:
    """A relay without MPI and L clients in this process."""
    relay = RelayTransport(None, L, capacity)
    clients = []
    for k in range(L):
        ch = relay.new_channel()
        cfd = new_eventfd()
        clients.append(client_of(relay, k, ch, cfd))
        relay.attach(k, ch, os.dup(cfd), os.getpid())
    return relay, clients


def until(t: Any, cond: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        t.wait(0.01)
        t.testsome([])  # wait() moves no data: progress here, as the engine's passes do


class Driver:
    """Runs a relay's progress in a thread of its own (it is the one thread using it)."""

    def __init__(self, relay: RelayTransport) -> None:
        self.relay = relay
        self.stop = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop:
            self.relay.wait(0.05)
            self.relay.testsome([])

    def close(self) -> None:
        self.stop = True
        self.relay.wake()
        self.thread.join(10)


def exchange(t: Any, peers: list[int], tags: list[int], count: int, top: int) -> None:
    """Send ``count`` messages to every peer on every tag; receive the same from them
    with ANY_SOURCE receives and check bytes and per-(source, tag) order."""
    sends = []
    for seq in range(count):
        for dst in peers:
            for tag in tags:
                sends.append(t.isend(payload(t.rank, dst, tag, seq, top), dst, tag))
    want = {(s, tag): 0 for s in peers for tag in tags}
    expected = count * len(peers) * len(tags)
    got = 0
    while got < expected:
        tag = tags[got % len(tags)]
        buf = np.empty(top, dtype=np.uint8)
        req = t.irecv(buf, ANY_SOURCE, tag)
        until(t, lambda req=req: t.test(req)[0])
        _, src, n = t.test(req)
        seq = want[(src, tag)]
        want[(src, tag)] += 1
        assert np.array_equal(buf[:n], payload(src, t.rank, tag, seq, top)), (src, tag, seq)
        got += 1
    until(t, lambda: len(t.testsome(sends)) == len(sends))


def spin_until(cond: Callable[[], bool], timeout: float = 20.0) -> None:
    """Busy-poll (for latency measurements only), bounded."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("timed out")


def run_threads(fns: list[Callable[[], None]], timeout: float = 60) -> None:
    errors: list[BaseException] = []

    def body(fn: Callable[[], None]) -> None:
        try:
            fn()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(f,), daemon=True) for f in fns]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout)
        assert not th.is_alive(), "a thread did not finish"
    if errors:
        raise errors[0]


def test_clients_and_relay_in_threads() -> None:
    """Every rank sends every other (and itself) random sizes up to 3x the ring."""
    relay, clients = node(3)
    ranks = [0, 1, 2, relay.rank]
    clients_done = threading.Event()
    relay_errors: list[BaseException] = []

    def relay_side() -> None:
        try:
            exchange(relay, ranks, [1, 2], 6, 3 * CAP)
        except BaseException as exc:
            relay_errors.append(exc)
        while not clients_done.is_set():  # it still forwards for the clients
            relay.wait(0.01)
            relay.testsome([])

    try:
        relay_thread = threading.Thread(target=run_threads, args=([relay_side],), daemon=True)
        relay_thread.start()
        try:
            run_threads([lambda t=t: exchange(t, ranks, [1, 2], 6, 3 * CAP) for t in clients])
        finally:
            clients_done.set()
            relay_thread.join(10)
        assert not relay_errors, relay_errors
    finally:
        for t in [*clients, relay]:
            t.close()


def test_unexpected_messages_cancel_and_poll() -> None:
    relay, (a, b) = node(2)
    try:
        big = np.arange(5 * CAP, dtype=np.uint8)
        s1 = a.isend(big, 1, 4)  # nobody has posted: unexpected at b, streamed
        s2 = a.isend(np.full(3, 7, np.uint8), 1, 4)
        drv = Driver(relay)
        try:
            until(a, lambda: len(a.testsome([s1, s2])) == 2)
            # unexpected, wholly arrived: the first receive takes the first message
            time.sleep(0.05)
            b.testsome([])
            out = np.empty(5 * CAP, dtype=np.uint8)
            r = b.irecv(out, 0, 4)
            until(b, lambda: b.test(r)[0])
            assert b.test(r) == (True, 0, big.nbytes) and np.array_equal(out, big)
            small = np.empty(3, dtype=np.uint8)
            assert b.test(b.irecv(small, ANY_SOURCE, 4)) == (True, 0, 3)
            # cancel an unmatched receive: it completes, cancelled
            r = b.irecv(np.empty(4, dtype=np.uint8), 0, 9)
            b.cancel(r)
            assert b.testsome([r]) == [0] and r.cancelled
            # poll_message: whole messages, oversize refused and dropped
            a.isend(np.zeros(100, np.uint8), 1, 3)
            a.isend(np.arange(10, dtype=np.uint8), 1, 3)
            until(b, lambda: len(b._matcher.unexpected) == 2)
            with pytest.raises(OversizeMessage):
                b.poll_message(3, 50)
            src, msg = b.poll_message(3, 50)
            assert src == 0 and np.array_equal(msg, np.arange(10))
            assert b.poll_message(3, 50) is None
            # a receive too small for its message fails in testsome, naming the peer
            a.isend(np.zeros(100, np.uint8), 1, 6)
            r = b.irecv(np.empty(10, dtype=np.uint8), 0, 6)
            ok = b.irecv(np.empty(10, dtype=np.uint8), 0, 3)
            a.isend(np.zeros(1, np.uint8), 1, 3)
            with pytest.raises(TransportError, match="truncated") as info:
                until(b, lambda: b.testsome([ok, r]) == [0] and r.done)
                b.testsome([ok, r])
            assert info.value.failed == [1] and info.value.peer == 0
        finally:
            drv.close()
    finally:
        for t in (a, b, relay):
            t.close()


def test_seals_and_size_checked_on_attach() -> None:
    fd = os.memfd_create("plain", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, Channel.size_for(CAP))
    with pytest.raises(TotalReduceError, match="not sealed"):
        Channel.attach(fd, Channel.size_for(CAP))
    ch = Channel.create(CAP)
    with pytest.raises(TotalReduceError, match="bytes, not"):
        Channel.attach(os.dup(ch.fd), ch.size + 4096)
    region = SharedRegion.create(ch.size, "other")
    with pytest.raises(TotalReduceError, match="not a totalreduce channel"):
        Channel.attach(os.dup(region.fd), region.size)
    seals = fcntl.fcntl(ch.fd, fcntl.F_GET_SEALS)
    assert seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_GROW
    Channel.attach(os.dup(ch.fd), ch.size).close()
    ch.close()
    region.close_fd()


def test_detach_reset_and_reattach() -> None:
    relay, (a, b) = node(2)
    try:
        # a partial message from a client that goes away fails the receive it matched
        r = relay.irecv(np.empty(4 * CAP, dtype=np.uint8), 0, 5)
        a.isend(np.ones(4 * CAP, dtype=np.uint8), relay.rank, 5)
        relay.testsome([r])  # reads what fits in the ring
        assert not r.done
        assert relay.alive(0) is True
        old = relay._slots[0].channel
        done = relay.detach(0)
        with pytest.raises(TransportError, match="went away") as info:
            relay.testsome([r])
        assert info.value.peer == 0 and done.is_set()
        assert relay.alive(0) is False
        s = relay.isend(np.ones(10, np.uint8), 0, 5)
        assert relay.testsome([s]) == [0]  # dropped at once
        a.close()
        # the reset channel serves a new client
        ch = old
        assert ch.c2s.head() == ch.c2s.tail() == 0
        cfd = new_eventfd()
        a2 = client_of(relay, 0, ch, cfd)
        relay.attach(0, ch, os.dup(cfd), os.getpid())
        drv = Driver(relay)
        try:
            s = a2.isend(np.arange(50, dtype=np.uint8), 1, 8)
            out = np.empty(50, dtype=np.uint8)
            r = b.irecv(out, 0, 8)
            until(b, lambda: b.test(r)[0])
            assert np.array_equal(out, np.arange(50)) and relay.alive(0) is True
            until(a2, lambda: a2.testsome([s]) == [0])
        finally:
            drv.close()
        a2.close()
    finally:
        for t in (b, relay):
            t.close()


def test_channel_reset_empties_rings() -> None:
    ch = Channel.create(CAP)
    a = ShmClientTransport(
        0,
        1,
        1,
        1,
        Channel.attach(os.dup(ch.fd), ch.size),
        new_eventfd(),
        new_eventfd(),
        os.getpid(),
    )
    a.isend(np.ones(100, np.uint8), 1, 1)
    assert ch.c2s.head() == 132 and ch.c2s.tail() == 0
    a.close()
    ch.reset()
    assert ch.c2s.head() == ch.c2s.tail() == ch.s2c.head() == 0
    ch.close()


# ---------------------------------------------------------------------- across processes


def _echo_child(relay_rank: int, fd: int, size: int, cfd: int, rfd: int, ppid: int) -> None:
    """A client in a forked process: echo every message on tags 1..2 back to the relay,
    in order, then answer a wake-up test (os._exit code says how it went)."""
    code = 1
    try:
        t = ShmClientTransport(0, 1, 1, relay_rank, Channel.attach(fd, size), cfd, rfd, ppid)
        for _ in range(60):
            buf = np.empty(4 * CAP, dtype=np.uint8)
            r = t.irecv(buf, ANY_SOURCE, 1)
            until(t, lambda r=r: t.test(r)[0])
            _, src, n = t.test(r)
            s = t.isend(buf[:n].copy(), src, 2)
            until(t, lambda s=s: t.testsome([s]) == [0])
        # latency: the relay sends the time it wrote; we report how long wait took to see it
        stamp = np.empty(8, dtype=np.uint8)
        r = t.irecv(stamp, relay_rank, 3)
        t.isend(np.zeros(1, np.uint8), relay_rank, 4)  # "I am about to sleep"
        while not t.test(r)[0]:
            t.wait(5.0)
        late = time.monotonic() - float(stamp.view(np.float64)[0])
        s = t.isend(np.array([late], dtype=np.float64).view(np.uint8), relay_rank, 5)
        until(t, lambda: t.testsome([s]) == [0])
        code = 0
    except BaseException as exc:  # reported through the exit code
        print("child failed:", repr(exc), flush=True)
    os._exit(code)


def test_forked_client_echo_and_wake_latency() -> None:
    relay = RelayTransport(None, 1, CAP)
    ch = relay.new_channel()
    cfd = new_eventfd()
    proc = FORK.Process(
        target=_echo_child,
        args=(relay.rank, os.dup(ch.fd), ch.size, cfd, os.dup(relay.eventfd), os.getpid()),
    )
    proc.start()
    try:
        relay.attach(0, ch, cfd, proc.pid)
        sizes = []
        sends = []
        for i in range(60):
            data = payload(relay.rank, 0, 1, i, 4 * CAP)
            sizes.append(data)
            sends.append(relay.isend(data, 0, 1))
        for i in range(60):  # echoes come back in order
            out = np.empty(4 * CAP, dtype=np.uint8)
            r = relay.irecv(out, 0, 2)
            until(relay, lambda r=r: relay.test(r)[0])
            _, src, n = relay.test(r)
            assert src == 0 and np.array_equal(out[:n], sizes[i]), i
        assert len(relay.testsome(sends)) == 60
        # wake-up latency, relay -> sleeping client
        ready = relay.irecv(np.empty(1, dtype=np.uint8), 0, 4)
        until(relay, lambda: relay.test(ready)[0])
        time.sleep(0.2)  # let the child fall asleep
        relay.isend(np.array([time.monotonic()], dtype=np.float64).view(np.uint8), 0, 3)
        back = np.empty(8, dtype=np.uint8)
        r = relay.irecv(back, 0, 5)
        until(relay, lambda: relay.test(r)[0])
        assert float(back.view(np.float64)[0]) < 0.5
        proc.join(20)
        assert proc.exitcode == 0
        assert relay.alive(0) is False  # its process is gone (reaped)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(5)
        relay.close()


def _send_later(fd: int, size: int, cfd: int, rfd: int, ppid: int, delay: float) -> None:
    try:
        t = ShmClientTransport(0, 1, 1, 1, Channel.attach(fd, size), cfd, rfd, ppid)
        time.sleep(delay)
        s = t.isend(np.array([time.monotonic()], dtype=np.float64).view(np.uint8), 1, 7)
        until(t, lambda: t.testsome([s]) == [0])
        os._exit(0)
    except BaseException:
        os._exit(1)


def test_relay_wait_wakes_on_client_write_and_alive() -> None:
    relay = RelayTransport(None, 1, CAP)
    ch = relay.new_channel()
    cfd = new_eventfd()
    proc = FORK.Process(
        target=_send_later,
        args=(os.dup(ch.fd), ch.size, cfd, os.dup(relay.eventfd), os.getpid(), 0.3),
    )
    proc.start()
    try:
        relay.attach(0, ch, cfd, proc.pid)
        stamp = np.empty(8, dtype=np.uint8)
        r = relay.irecv(stamp, 0, 7)
        assert relay.alive(0) is True
        t0 = time.monotonic()
        while not relay.test(r)[0] and time.monotonic() - t0 < 10:
            relay.wait(5.0)  # one wait: woken by the write, not by its timeout
        assert relay.test(r)[0]
        assert time.monotonic() - float(stamp.view(np.float64)[0]) < 0.5
        proc.join(10)
        assert proc.exitcode == 0 and relay.alive(0) is False
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(5)
        relay.close()


def _sleep_child(seconds: float) -> None:
    time.sleep(seconds)
    os._exit(0)


def test_client_alive_follows_the_relay_process() -> None:
    proc = FORK.Process(target=_sleep_child, args=(0.2,))
    proc.start()
    ch = Channel.create(CAP)
    t = ShmClientTransport(
        0, 2, 1, 2, Channel.attach(os.dup(ch.fd), ch.size), new_eventfd(), new_eventfd(), proc.pid
    )
    try:
        assert t.alive(2) is True and t.alive(0) is True and t.alive(1) is None
        proc.join(10)
        assert t.alive(2) is False
    finally:
        t.close()
        ch.close()


def test_wake_interrupts_wait() -> None:
    relay, (a,) = node(1)
    try:
        took = []

        def sleeper() -> None:
            t0 = time.monotonic()
            a.wait(10.0)
            took.append(time.monotonic() - t0)

        th = threading.Thread(target=sleeper)
        th.start()
        time.sleep(0.1)
        a.wake()
        th.join(5)
        assert took and took[0] < 0.5
        relay.wake()  # before the wait: it returns at once
        t0 = time.monotonic()
        relay.wait(10.0)
        assert time.monotonic() - t0 < 0.5
    finally:
        a.close()
        relay.close()


def test_ring_latency_between_processes() -> None:
    """Round trips client <-> relay across processes (reported, loosely bounded)."""
    relay = RelayTransport(None, 1, CAP)
    ch = relay.new_channel()
    cfd = new_eventfd()

    def child(fd: int, size: int, cfd: int, rfd: int, ppid: int) -> None:
        try:
            t = ShmClientTransport(0, 1, 1, 1, Channel.attach(fd, size), cfd, rfd, ppid)
            buf = np.empty(8, dtype=np.uint8)
            for _ in range(300):
                r = t.irecv(buf, 1, 1)
                spin_until(lambda r=r: t.test(r)[0])
                t.isend(buf, 1, 2)
            until(t, lambda: not t._writer.q)
            os._exit(0)
        except BaseException:
            os._exit(1)

    proc = FORK.Process(
        target=child, args=(os.dup(ch.fd), ch.size, cfd, os.dup(relay.eventfd), os.getpid())
    )
    proc.start()
    try:
        relay.attach(0, ch, cfd, proc.pid)
        buf = np.zeros(8, dtype=np.uint8)
        times = []
        for _ in range(300):
            t0 = time.perf_counter()
            relay.isend(buf, 0, 1)
            r = relay.irecv(buf, 0, 2)
            spin_until(lambda r=r: relay.test(r)[0])
            times.append(time.perf_counter() - t0)
        proc.join(10)
        assert proc.exitcode == 0
        one_way = sorted(times)[len(times) // 2] / 2
        print(f"one-way small-message latency through a ring: {one_way * 1e6:.1f} us (median)")
        assert one_way < 0.05
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(5)
        relay.close()


def test_what_a_departing_client_wrote_is_still_delivered() -> None:
    """A client writes its last messages and leaves before the relay read them: the detach
    drains its ring first, so a local peer and the relay itself still get them."""
    relay, (a, b) = node(2)
    try:
        to_b = np.arange(300, dtype=np.uint8)
        to_relay = np.arange(40, dtype=np.uint8)
        sends = [a.isend(to_b, 1, 5), a.isend(to_relay, relay.rank, 6)]
        assert a.testsome(sends) == [0, 1]  # written into the ring: done for the client
        gone = relay.detach(0)  # before the relay ever looked at the ring
        got_relay = np.zeros(40, np.uint8)
        r = relay.irecv(got_relay, 0, 6)
        until(relay, lambda: gone.is_set())
        until(relay, lambda: relay.test(r)[0])
        got_b = np.zeros(300, np.uint8)
        rb = b.irecv(got_b, 0, 5)
        until(b, lambda: (relay.testsome([]), b.test(rb)[0])[1])
        assert np.array_equal(got_b, to_b) and np.array_equal(got_relay, to_relay)
    finally:
        a.close()
        b.close()
        relay.close()

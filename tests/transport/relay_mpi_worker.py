"""One node of test_relay_mpi.py: run under ``mpiexec -n NODES``.

Each MPI rank is a node: a RelayTransport over MPI and L client transports in
threads of this process.  Every client sends to every other client (local and
remote) and to every relay; every relay sends to every client and to the other
relays; random sizes up to 2 MiB through 256 KiB rings.  Receivers use
ANY_SOURCE receives and check the bytes and the per-(source, tag) order.
Prints ``OK <node>`` on success.
"""

from __future__ import annotations

import os
import random
import sys
import threading
import time

import numpy as np
from mpi4py import MPI

from totalreduce.transport.base import ANY_SOURCE
from totalreduce.transport.relay import RelayTransport
from totalreduce.transport.shm import Channel, ShmClientTransport, new_eventfd

L = 2
CAP = 256 << 10
TOP = 2 << 20
TAGS = [1, 2]
COUNT = 3
DONE_TAG = 99
DEADLINE = time.monotonic() + 150


def payload(src: int, dst: int, tag: int, seq: int) -> np.ndarray:
    rng = random.Random(f"{src}-{dst}-{tag}-{seq}")
    n = rng.choice([0, 1, 33, rng.randrange(CAP), rng.randrange(TOP + 1), TOP])
    return np.frombuffer(rng.randbytes(n), dtype=np.uint8)


def until(t, cond) -> None:
    while not cond():
        if time.monotonic() > DEADLINE:
            raise AssertionError(f"rank {t.rank}: timed out")
        t.wait(0.01)
        t.testsome([])  # wait() moves no data: progress here, as the engine's passes do


def exchange(t, send_to: list[int], recv_from: list[int]) -> None:
    sends = [
        t.isend(payload(t.rank, dst, tag, seq), dst, tag)
        for seq in range(COUNT)
        for dst in send_to
        for tag in TAGS
    ]
    want = {(s, tag): 0 for s in recv_from for tag in TAGS}
    expected = COUNT * len(recv_from) * len(TAGS)
    for got in range(expected):
        tag = TAGS[got % len(TAGS)]
        buf = np.empty(TOP, dtype=np.uint8)
        req = t.irecv(buf, ANY_SOURCE, tag)
        until(t, lambda req=req: t.test(req)[0])
        _, src, n = t.test(req)
        seq = want[(src, tag)]
        want[(src, tag)] += 1
        exp = payload(src, t.rank, tag, seq)
        assert n == exp.nbytes and np.array_equal(buf[:n], exp), (t.rank, src, tag, seq, n)
    until(t, lambda: len(t.testsome(sends)) == len(sends))


def main() -> int:
    comm = MPI.COMM_WORLD.Dup()
    relay = RelayTransport(comm, L, CAP)
    C, nodes = relay.size, relay.relays
    clients_all = list(range(C))
    relays_all = list(range(C, C + nodes))
    clients = []
    for k in range(L):
        ch = relay.new_channel()
        cfd = new_eventfd()
        clients.append(
            ShmClientTransport(
                relay.node * L + k,
                C,
                nodes,
                relay.rank,
                Channel.attach(os.dup(ch.fd), ch.size),
                cfd,
                os.dup(relay.eventfd),
                os.getpid(),
                tag_span=relay.tag_span,
            )
        )
        relay.attach(k, ch, os.dup(cfd), os.getpid())
    errors: list[BaseException] = []

    def client(t: ShmClientTransport) -> None:
        try:
            others = [r for r in clients_all if r != t.rank]
            exchange(t, others + relays_all, others + relays_all)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(t,), daemon=True) for t in clients]
    for th in threads:
        th.start()
    try:
        other_relays = [r for r in relays_all if r != relay.rank]
        exchange(relay, clients_all + other_relays, clients_all + other_relays)
        # Keep forwarding until this node's clients and every other node are done.
        until(relay, lambda: not any(th.is_alive() for th in threads))
        flag = np.zeros(1, dtype=np.uint8)
        flag[0] = 1 if not errors else 2
        sends = [relay.isend(flag, r, DONE_TAG) for r in other_relays]
        for r in other_relays:
            got = np.empty(1, dtype=np.uint8)
            req = relay.irecv(got, r, DONE_TAG)
            until(relay, lambda req=req: relay.test(req)[0])
        until(relay, lambda: len(relay.testsome(sends)) == len(sends))
    except BaseException as exc:
        errors.append(exc)
    if errors:
        print(f"FAIL node {relay.node}: {errors[0]!r}", flush=True)
        return 1
    for t in clients:
        t.close()
    relay.close()
    comm.Free()
    print(f"OK {relay.node}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

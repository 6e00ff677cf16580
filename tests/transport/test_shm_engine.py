"""The engine (Service / CommLoop) over a relay and shared-memory clients on one node.

The relay runs a Service of its own that submits nothing: it joins hierarchical ops
from their frames, and its comm loop's passes forward the clients' messages for
flat ones.  Exact integer results.
"""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from totalreduce.algorithms.hierarchical import NodeLayout
from totalreduce.daemon.adopt import MAX_OP_BYTES, relay_adopter
from totalreduce.service.config import Config
from totalreduce.service.service import Service
from totalreduce.transport.shm import Channel, ShmClientTransport, new_eventfd

MPI = pytest.importorskip("mpi4py.MPI", reason="the relay transport needs mpi4py")

from totalreduce.transport.relay import RelayTransport  # noqa: E402


@pytest.mark.parametrize("L", [2, 3])
def test_collectives_among_clients_through_the_relay(L: int) -> None:
    relay = RelayTransport(MPI.COMM_SELF, L, 64 << 10)
    clients = []
    for k in range(L):
        ch = relay.new_channel()
        cfd = new_eventfd()
        clients.append(
            ShmClientTransport(
                k,
                L,
                1,
                relay.rank,
                Channel.attach(os.dup(ch.fd), ch.size),
                cfd,
                os.dup(relay.eventfd),
                os.getpid(),
                tag_span=relay.tag_span,
            )
        )
        relay.attach(k, ch, os.dup(cfd), os.getpid())
    config = Config.load(env={})
    relay_service = Service(relay, config)
    # The relay joins hierarchical ops (auto in daemon mode) from their frames.
    relay_service.loop.adopt = relay_adopter(
        NodeLayout(1, L), relay.rank, config.segment_bytes, MAX_OP_BYTES
    )
    # A client's start returns once the whole job is there: start them together.
    services: list = [relay_service] + [None] * L

    def start(k: int) -> None:
        services[k + 1] = Service(clients[k], config)

    starters = [threading.Thread(target=start, args=(k,), daemon=True) for k in range(L)]
    for t in starters:
        t.start()
    for t in starters:
        t.join(60)
    assert all(s is not None for s in services), "a client did not start"
    results: list = [None] * L
    errors: list = []

    def body(k: int) -> None:
        try:
            s = services[k + 1]
            x = np.arange(200_000, dtype=np.int64) * (k + 1)  # bodies far larger than a ring
            a = s.allreduce(x, name="a")
            flat = s.allreduce(x, name="flat", algorithm="ring")  # among the clients only
            g = s.allgather(np.full(3, k, np.int32), name="g")
            b = s.broadcast(np.arange(10, dtype=np.int64) + k, root=L - 1, name="b")
            small = [s.allreduce(np.full(4, k, np.int64), name="s") for _ in range(5)]
            results[k] = (a, g, b, small, flat)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(k,), daemon=True) for k in range(L)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
            assert not t.is_alive(), "a client did not finish"
        assert not errors, errors
        total = L * (L + 1) // 2
        for k in range(L):
            a, g, b, small, flat = results[k]
            assert np.array_equal(a, np.arange(200_000, dtype=np.int64) * total)
            assert np.array_equal(flat, a)
            assert np.array_equal(g, np.repeat(np.arange(L, dtype=np.int32), 3))
            assert np.array_equal(b, np.arange(10, dtype=np.int64) + L - 1)
            for v in small:
                assert np.array_equal(v, np.full(4, L * (L - 1) // 2, np.int64))
    finally:
        for s in services[1:]:
            s.shutdown(timeout=5)
        services[0].shutdown(timeout=5)

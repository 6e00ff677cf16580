"""The sessions of daemon mode among the nodes, without processes: two nodes' arena threads
and the engine among the services on an in-process world, clients that attach, die and
come back as the socket side (``daemon/node.py``) would make them (thin_session.py).

- a client killed while it waits in ``init()`` for a node that has no client: a later job
  agrees (its agreement under a name of its own sessions), again and again;
- a node that agreed with a session that then died before agreeing: it abandons that
  agreement and agrees with the next session, its clients waiting meanwhile;
- a death in the job: the other node's clients fail, naming the rank; one that comes in
  a session that never agreed with it is only noted.
"""

from __future__ import annotations

import os
import socket
import time
from contextlib import ExitStack
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from conftest import local_services
from totalreduce.algorithms.codes import OpKind
from totalreduce.daemon import thin_session
from totalreduce.daemon.thin import ThinService
from totalreduce.dtypes import DType, ReduceOp
from totalreduce.engine.wire import SESSION_ID
from totalreduce.errors import OpFailedError
from totalreduce.service.thin import ThinClient, ThinHandle
from totalreduce.transport.arena import Arena
from totalreduce.transport.shm import new_eventfd


class Node:
    """One node's service, and its sessions as ``Node`` in daemon/node.py keeps them."""

    def __init__(self, stack: ExitStack, node: int, nodes: int, slots: int, engine: Any) -> None:
        self.node, self.nodes, self.slots = node, nodes, slots
        self.arena = Arena.create(slots, 1 << 20)
        self.service = ThinService(self.arena, node, nodes, engine)
        stack.callback(self.arena.close)
        stack.callback(self.service.stop)
        self.stack = stack
        self.sessions = 0
        self.incarnation = 0
        self.clients: dict[int, ThinClient] = {}

    def attach(self, slot: int) -> ThinClient:
        """A client takes ``slot`` (the node's next session if it had none)."""
        if not self.clients:
            self.sessions += 1
            self.service.new_session(self.sessions)
        self.incarnation += 1
        efd = new_eventfd()
        self.service.attach(slot, self.incarnation, os.dup(efd))
        mine, theirs = socket.socketpair()
        self.stack.callback(theirs.close)
        self.stack.callback(mine.close)
        assert self.arena.fd is not None
        rank = self.node * self.slots + slot
        link = SimpleNamespace(
            arena=Arena.attach(os.dup(self.arena.fd), self.arena.size),
            welcome=SimpleNamespace(
                local=slot, rank=rank, size=self.nodes * self.slots, pid=os.getpid()
            ),
            where="test",
            eventfd=efd,
            service_eventfd=os.dup(self.service.eventfd),
            sock=mine,
        )
        c = self.clients[slot] = ThinClient(link)
        self.stack.callback(c.close)
        return c

    def kill(self, slot: int) -> None:
        """The client of ``slot`` dies (its connection ended without bye)."""
        self.clients.pop(slot)
        self.service.detach(slot, "died (its connection ended without bye)")
        if not self.clients:
            self.service.end_session()

    def leave(self, slot: int) -> None:
        self.clients.pop(slot)
        self.service.detach(slot, None)
        if not self.clients:
            self.service.end_session()


def agree(c: ThinClient, epoch: int) -> ThinHandle:
    """What ``init()`` submits: the session agreement (lifecycle._join_session)."""
    x = np.array([epoch], dtype=np.int64)
    at, staged = c.place(x, fill=x)
    out = np.empty_like(x)
    h = ThinHandle(c, "totalreduce session", 0, OpKind.ALLREDUCE, out, lambda: None)
    h.hold((staged,) if staged >= 0 else (), out, staged)
    return c.submit(
        h, wire=SESSION_ID, dtype=DType.INT64, count=1, op=ReduceOp.MAX, root=0, priority=0,
        at_in=at, at_out=at, unnamed=True,
    )  # fmt: skip


def allreduce(c: ThinClient, name: str, gen: int, x: np.ndarray) -> ThinHandle:
    at, staged = c.place(x, fill=x)
    out = np.empty_like(x)
    h = ThinHandle(c, name, gen, OpKind.ALLREDUCE, out, lambda: None)
    h.hold((staged,), out, staged)
    return c.submit(
        h, wire=hash(name) & ((1 << 62) - 1), dtype=DType.of(x.dtype), count=x.size,
        op=ReduceOp.SUM, root=0, priority=0, at_in=at, at_out=at, unnamed=False,
    )  # fmt: skip


def job(nodes: list[Node], salt: str) -> None:
    """Every slot of every node takes a client that agrees, then runs an allreduce: exact."""
    cs = [n.attach(k) for n in nodes for k in range(n.slots)]
    want = max(n.sessions for n in nodes)
    hs = [agree(c, nodes[c.rank // nodes[0].slots].sessions) for c in cs]
    for h in hs:
        assert int(h.wait(30)[0]) == want
    data = [np.arange(5, dtype=np.int64) * (r + 1) for r in range(len(cs))]
    hs = [allreduce(c, f"{salt}.{want}", 0, data[c.rank]) for c in cs]
    for h in hs:
        assert np.array_equal(h.wait(30), sum(data))
    for n in nodes:
        for k in range(n.slots):
            n.leave(k)


def settle(nodes: list[Node]) -> None:
    """Let the services' notices arrive and their events run."""
    deadline = time.monotonic() + 10
    while any(n.service._events for n in nodes) and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)


def test_a_client_killed_in_init_alone_poisons_no_later_job() -> None:
    """Node 0's client dies waiting in init() while node 1 has none, three times (node 1
    counts fewer sessions): each later job agrees and runs, exact."""
    with ExitStack() as stack:
        engines = stack.enter_context(local_services(2))
        nodes = [Node(stack, n, 2, 1, engines[n]) for n in range(2)]
        for i in range(3):
            c = nodes[0].attach(0)
            h = agree(c, nodes[0].sessions)
            time.sleep(0.1)  # in: node 0 waits for node 1's session
            nodes[0].kill(0)
            assert not h.done()  # (its client is gone: nobody reads it)
            settle(nodes)
            job(nodes, f"w{i}")


@pytest.mark.parametrize("n", [2, 3], ids=["2-nodes", "3-nodes"])
def test_an_agreement_with_a_session_that_died_unagreed_starts_again(n: int) -> None:
    """The other nodes' two clients agree with node 0's session 1, whose only client dies
    before node 0 could agree (its second never came): they abandon that agreement (on
    three nodes, one may hear it first from the other's abort), their clients wait, and
    agree with node 0's next session."""
    with ExitStack() as stack:
        engines = stack.enter_context(local_services(n))
        nodes = [Node(stack, k, n, 2, engines[k]) for k in range(n)]
        a0 = nodes[0].attach(0)
        settle(nodes)
        others = [c for node in nodes[1:] for c in (node.attach(0), node.attach(1))]
        hb = [agree(c, 1) for c in others]
        ha = agree(a0, 1)
        first = thin_session.agreement_name((1,) * n)
        deadline = time.monotonic() + 10
        while any(x.service._agreed != first for x in nodes[1:]):
            assert time.monotonic() < deadline, [x.service._agreed for x in nodes]
            time.sleep(0.01)
        nodes[0].kill(0)
        deadline = time.monotonic() + 10
        while any(first not in x.service._moved for x in nodes[1:]):  # (its news travels)
            assert time.monotonic() < deadline, [x.service._moved for x in nodes]
            time.sleep(0.01)
        settle(nodes)
        assert not any(h.done() for h in hb) and not ha.done()
        assert all(x.service._agreed == 0 for x in nodes[1:])
        cs = [nodes[0].attach(k) for k in range(2)]  # node 0's session 2
        hs = [agree(c, 2) for c in cs]
        for h in hs + hb:
            assert int(h.wait(30)[0]) == 2
        for x in nodes:
            assert x.service._agreed == thin_session.agreement_name((2,) + (1,) * (n - 1))
        data = [np.full(3, r + 1, np.int64) for r in range(2 * n)]
        hs = [allreduce(c, "after", 0, data[c.rank]) for c in cs + others]
        for h in hs:
            assert np.array_equal(h.wait(30), sum(data))


def test_a_death_in_the_job_fails_the_other_node_and_the_next_job_runs() -> None:
    """After the agreement, node 1's client dies: node 0's op with it fails naming rank 1;
    the next job, on both nodes, runs."""
    with ExitStack() as stack:
        engines = stack.enter_context(local_services(2))
        nodes = [Node(stack, n, 2, 1, engines[n]) for n in range(2)]
        cs = [n.attach(0) for n in nodes]
        for h in [agree(c, 1) for c in cs]:
            assert int(h.wait(30)[0]) == 1
        pending = allreduce(cs[0], "w", 0, np.ones(4, np.int64))
        nodes[1].kill(0)
        with pytest.raises(OpFailedError, match="rank 1"):
            pending.wait(30)
        later = allreduce(cs[0], "w", 1, np.ones(4, np.int64))  # later ones too
        with pytest.raises(OpFailedError, match="rank 1"):
            later.wait(30)
        nodes[0].leave(0)
        settle(nodes)
        job(nodes, "next")

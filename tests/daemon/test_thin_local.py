"""The thin path's node side without processes: one node's service (daemon/thin.py) and its
``L`` clients (service/thin.py) in one process, over one arena, for L = 1..4.

What a node does alone is exact in int64: the local reduction of every op, broadcast from
every slot, barriers, ``avg`` (floor on integers), ops submitted in a different random
order by every client with random priorities, a mismatch naming both ranks, a malformed
descriptor, and a client that dies with ops in flight (the others' fail, naming it).
"""

from __future__ import annotations

import gc
import os
import random
import socket
import threading
import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from totalreduce.algorithms.codes import OpKind
from totalreduce.daemon.thin import ThinService  # noqa: I001 (the node's side)
from totalreduce.dtypes import DType, ReduceOp
from totalreduce.errors import InvalidArgumentError, OpFailedError, OpMismatchError
from totalreduce.service import chunks
from totalreduce.service.names import NameTable
from totalreduce.service.thin import ThinClient, ThinHandle
from totalreduce.transport.arena import Arena
from totalreduce.transport.shm import new_eventfd


class Node:
    """A node's arena thread and ``slots`` clients attached to it."""

    def __init__(
        self, slots: int, stall_warning_s: float = 60.0, *, node: int = 0, nodes: int = 1,
        engine: Any = None, meeting: bool = True,
    ) -> None:  # fmt: skip
        """Node ``node`` of ``nodes`` (``engine``: the services' engine among them);
        ``meeting``: a one-node service's clients meet in the arena (else the rings)."""
        self.arena = Arena.create(slots, 4 << 20)
        self.service = ThinService(
            self.arena, node, nodes, engine, stall_warning_s=stall_warning_s, meeting_on=meeting
        )
        self.clients: list[ThinClient] = []
        self.socks: list[socket.socket] = []
        self.node, self.nodes, self.slots = node, nodes, slots
        self.incarnations = 0
        for k in range(slots):
            self.clients.append(self._attach(k))

    def _attach(self, k: int) -> ThinClient:
        """A new client process in slot ``k`` (attached to the service, as a hello does)."""
        efd = new_eventfd()
        self.incarnations += 1
        self.service.attach(k, self.incarnations, os.dup(efd))
        mine, theirs = socket.socketpair()
        self.socks.append(theirs)
        assert self.arena.fd is not None
        link = SimpleNamespace(
            arena=Arena.attach(os.dup(self.arena.fd), self.arena.size),
            welcome=SimpleNamespace(
                local=k, rank=self.node * self.slots + k, size=self.nodes * self.slots,
                pid=os.getpid(),
            ),
            where="test",
            eventfd=efd,
            service_eventfd=os.dup(self.service.eventfd),
            sock=mine,
        )  # fmt: skip
        return ThinClient(link)

    def replace(self, k: int) -> None:
        """Slot ``k``'s client left (its detach handled): a new one takes the slot."""
        self.clients[k].close()
        self.clients[k] = self._attach(k)

    def submit(
        self, k: int, kind: OpKind, name: str, x: np.ndarray | None, *, op: ReduceOp = ReduceOp.SUM,
        root: int = 0, prio: int = 0, gen: int = 0,
    ) -> ThinHandle:  # fmt: skip
        c = self.clients[k]
        if x is None:
            at, staged, out = -1, -1, None
            dt, count = DType.INT64, 0
        else:
            out = np.empty_like(x)
            at, staged = c.place(x, fill=x)
            dt, count = DType.of(x.dtype), x.size
        h = ThinHandle(c, name, gen, kind, out, lambda: None)
        h.hold((staged,) if staged >= 0 else (), out, staged)
        wire = hash(name) & ((1 << 62) - 1)
        return c.submit(h, wire=wire, dtype=dt, count=count, op=op, root=root, priority=prio,
                        at_in=at, at_out=at, unnamed=False)  # fmt: skip

    def close(self) -> None:
        self.service.stop()
        for c in self.clients:
            c.close()
        for s in self.socks:
            s.close()
        self.arena.close()


ROUTES = [(L, meet) for meet in (True, False) for L in (1, 2, 3, 4)]


@pytest.fixture(params=ROUTES, ids=lambda p: f"L{p[0]}-{'meeting' if p[1] else 'rings'}")
def node(request: Any) -> Any:
    """A node of 1-4 clients, meeting in the arena or going through the service's rings."""
    n = Node(request.param[0], meeting=request.param[1])
    yield n
    n.close()


def data(k: int, name: int, n: int = 37) -> np.ndarray:
    return (np.arange(n, dtype=np.int64) * (name + 1) + 1000 * k - 7 * name) % 101 - 50


def test_every_op_in_random_orders_is_exact(node: Node) -> None:
    L = len(node.clients)
    ops = (
        [("ar", i) for i in range(40)]
        + [("bc", i) for i in range(12)]
        + [("bar", i) for i in range(6)]
    )
    results: list[dict[Any, Any]] = [{} for _ in range(L)]

    def client(k: int) -> None:
        rng = random.Random(k)
        mine = list(ops)
        rng.shuffle(mine)
        hs = {}
        for kind, i in mine:
            if kind == "ar":
                op = [ReduceOp.SUM, ReduceOp.MAX, ReduceOp.MIN, ReduceOp.AVG][i % 4]
                hs[kind, i] = node.submit(k, OpKind.ALLREDUCE, f"ar{i}", data(k, i), op=op,
                                          prio=rng.randrange(5))  # fmt: skip
            elif kind == "bc":
                hs[kind, i] = node.submit(k, OpKind.BROADCAST, f"bc{i}", data(k, i), root=i % L)
            else:
                hs[kind, i] = node.submit(k, OpKind.BARRIER, f"bar{i}", None)
        for key, h in hs.items():
            results[k][key] = h.wait(30)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(L)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for k in range(L):
        for i in range(40):
            stack = np.stack([data(r, i) for r in range(L)])
            want = [stack.sum(0), stack.max(0), stack.min(0), stack.sum(0) // L][i % 4]
            assert np.array_equal(results[k]["ar", i], want), (k, i)
        for i in range(12):
            assert np.array_equal(results[k]["bc", i], data(i % L, i)), (k, i)
        assert all(results[k]["bar", i] is None for i in range(6))


@pytest.fixture(
    params=[p for p in ROUTES if p[0] > 1],
    ids=lambda p: f"L{p[0]}-{'meeting' if p[1] else 'rings'}",
)
def shared(request: Any) -> Any:
    """A node with two clients or more."""
    n = Node(request.param[0], meeting=request.param[1])
    yield n
    n.close()


def test_a_mismatch_names_both_ranks_and_the_name_goes_on(shared: Node) -> None:
    node = shared
    L = len(node.clients)
    hs = [node.submit(k, OpKind.ALLREDUCE, "mm", np.ones(5 + (k == 1), np.int64)) for k in range(L)]
    for h in hs:
        with pytest.raises(
            OpMismatchError, match="rank 0: allreduce, count 5 int64.*rank 1: allreduce, count 6"
        ):
            h.wait(30)
    again = [node.submit(k, OpKind.ALLREDUCE, "mm", np.ones(5, np.int64), gen=1) for k in range(L)]
    assert all(np.array_equal(h.wait(30), np.full(5, L)) for h in again)


def test_a_malformed_descriptor_fails_alone(node: Node) -> None:
    c = node.clients[0]
    h = node.submit(0, OpKind.ALLREDUCE, "bad", np.ones(3, np.int64), root=0)
    # the same descriptor again, its kind broken (what only a buggy client writes)
    bad = ThinHandle(c, "bad", 1, 77, None, lambda: None)  # type: ignore[arg-type]
    c.submit(bad, wire=5, dtype=DType.INT64, count=3, op=ReduceOp.SUM, root=0, priority=0,
             at_in=-1, at_out=-1, unnamed=False)  # fmt: skip
    with pytest.raises(InvalidArgumentError, match="malformed descriptor: kind 77"):
        bad.wait(30)
    rest = [
        node.submit(k, OpKind.ALLREDUCE, "bad", np.ones(3, np.int64))
        for k in range(1, len(node.clients))
    ]
    assert np.array_equal(h.wait(30), np.full(3, len(node.clients)))
    assert all(np.array_equal(x.wait(30), np.full(3, len(node.clients))) for x in rest)


def test_a_client_that_dies_fails_the_ops_waiting_for_it(shared: Node) -> None:
    node = shared
    L = len(node.clients)
    hs = [
        node.submit(k, OpKind.ALLREDUCE, f"d{i}", np.ones(4, np.int64))
        for k in range(L - 1)
        for i in range(3)
    ]
    node.service.detach(L - 1, "died (its connection ended without bye)")
    for h in hs:
        with pytest.raises(OpFailedError, match=f"rank {L - 1} died"):
            h.wait(30)
    later = node.submit(0, OpKind.BARRIER, "later", None)
    with pytest.raises(OpFailedError, match=f"rank {L - 1} died"):
        later.wait(30)


@pytest.mark.parametrize("meeting", [True, False], ids=["meeting", "rings"])
def test_an_op_a_client_never_submits_is_named_in_a_stall_warning(
    caplog: Any, meeting: bool
) -> None:
    node = Node(3, stall_warning_s=0.3, meeting=meeting)
    try:
        with caplog.at_level("WARNING", logger="totalreduce.daemon"):
            hs = [node.submit(k, OpKind.ALLREDUCE, "late", np.ones(2, np.int64)) for k in (0, 2)]
            deadline = time.monotonic() + 10
            while "have waited" not in caplog.text and "has waited" not in caplog.text:
                assert time.monotonic() < deadline, caplog.text
                time.sleep(0.05)
        assert "ranks [0, 2] submitted it, ranks [1] have not" in caplog.text, caplog.text
        assert "allreduce, count 2 int64" in caplog.text
        late = node.submit(1, OpKind.ALLREDUCE, "late", np.ones(2, np.int64))
        assert all(np.array_equal(h.wait(30), np.full(2, 3)) for h in [*hs, late])
    finally:
        node.close()


def test_the_thin_path_records_into_the_timeline(tmp_path: Any) -> None:
    from totalreduce.timeline import Timeline, load

    node = Node(2)
    try:
        for k, c in enumerate(node.clients):
            c.trace = Timeline(str(tmp_path / "tl"), k)
        first = node.submit(0, OpKind.ALLREDUCE, "timed", np.ones(3, np.int64))
        waiter = threading.Thread(target=first.wait, args=(30,))
        waiter.start()  # rank 0 waits before rank 1 submits: its timeline has the wait
        time.sleep(0.05)
        node.submit(1, OpKind.ALLREDUCE, "timed", np.ones(3, np.int64)).wait(30)
        waiter.join(30)
        for c in node.clients:
            c.trace.close()
    finally:
        node.close()
    for k in range(2):
        events = load(tmp_path / f"tl.{k}.json")
        life = [e for e in events if e.get("name") == "timed" and e.get("cat") == "op"]
        assert len(life) == 1 and life[0]["args"]["status"] == "done", life
        assert life[0]["dur"] > 0 and "submitted_us" in life[0]["args"], life
    assert any(e.get("name", "").startswith("wait ") for e in load(tmp_path / "tl.0.json"))


def test_empty_if_room_keeps_half_the_part_for_staging() -> None:
    """A cache's buffers (the DDP comm hook's) take the client's part only while it stays at
    most half used, never wait, and give their block back with their last array."""
    node = Node(1)
    try:
        c = node.clients[0]
        half = node.arena.data_bytes // 2
        a = c.empty_if_room(half // 8 - 16, np.float64)
        assert a is not None and a.shape == (half // 8 - 16,) and c.arena.offset_of(a) >= 0
        assert c.empty_if_room(1024, np.float64) is None  # past half: None, at once
        b = c.empty_if_room(8, np.float32)  # what is left of the half
        assert b is not None
        used = c.space.used_bytes
        del a
        gc.collect()
        assert c.space.used_bytes < used  # its block went back with it
        a2 = c.empty_if_room(half // 16, np.float64)
        assert a2 is not None
        a2[:] = 3.0
        node.submit(0, OpKind.ALLREDUCE, "x", a2).wait(30)  # an op of it, in place
        assert (a2 == 3.0).all()
    finally:
        node.close()


def test_a_callback_added_while_the_watcher_leaves_still_runs(monkeypatch: Any) -> None:
    """The watcher thread that runs the done callbacks of ops in flight leaves when it
    finds none; a callback added between that and the thread's end (it is still alive)
    starts another.  Nobody else looks at the op: DDP's reducer waits on the torch future
    only, which that callback completes (a DDP job hung in ``finalize_backward``)."""
    node = Node(2)
    try:
        c = node.clients[0]
        watch = c._watch
        left, go = threading.Event(), threading.Event()
        calls = [0]

        def watch_then_linger() -> None:
            calls[0] += 1
            watch()
            if calls[0] == 1:  # found nothing to watch, returned: still alive a while
                left.set()
                go.wait(30)

        monkeypatch.setattr(c, "_watch", watch_then_linger)
        ran: list[str] = []
        first = node.submit(0, OpKind.ALLREDUCE, "a", data(0, 0))
        first.add_done_callback(lambda h: ran.append("a"))  # the watcher starts
        node.submit(1, OpKind.ALLREDUCE, "a", data(1, 0)).wait(30)
        assert left.wait(30) and ran == ["a"]  # the watcher ran it, then found nothing
        lingering = c._watcher
        second = node.submit(0, OpKind.ALLREDUCE, "b", data(0, 1))
        done = threading.Event()
        second.add_done_callback(lambda h: (ran.append("b"), done.set()))
        go.set()
        if lingering is not None:
            lingering.join(30)
        node.submit(1, OpKind.ALLREDUCE, "b", data(1, 1)).wait(30)
        assert done.wait(10), "the callback of an op that completed never ran"
        assert ran == ["a", "b"] and second.done()
    finally:
        go.set()
        node.close()


def test_a_chained_op_with_a_callback_submitted_after_the_watcher_left_runs_it() -> None:
    """``chain()`` hands its final op out before ``then()`` submits it, so a callback can
    be on it before it is in flight (an all-gather without counts, a torch future on
    it).  If the watcher thread left meanwhile (the first op ended on another thread),
    the submission itself starts one: else nothing would run the callback."""
    node = Node(2)
    try:
        c = node.clients[0]
        real_check = c.check
        blind = threading.Event()
        blind.set()

        def check(h: ThinHandle) -> bool:  # the first watcher never ends an op itself
            if blind.is_set() and threading.current_thread() is c._watcher:
                return bool(h._done)
            return bool(real_check(h))

        c.check = check  # type: ignore[method-assign]
        x = np.arange(4, dtype=np.int64)
        first = node.submit(0, OpKind.ALLREDUCE, "a", x.copy())
        out = np.empty_like(x)
        final = ThinHandle(c, "b", 0, OpKind.ALLREDUCE, out, lambda: None)
        left: list[bool] = []

        def then() -> None:
            deadline = time.monotonic() + 10
            while c._watcher is not None and time.monotonic() < deadline:
                time.sleep(0.001)
            left.append(c._watcher is None)
            blind.clear()
            at, staged = c.place(x, fill=x)
            final.hold((staged,) if staged >= 0 else (), out, staged)
            c.submit(final, wire=hash("b") & ((1 << 62) - 1), dtype=DType.INT64, count=4,
                     op=ReduceOp.SUM, root=0, priority=0, at_in=at, at_out=at,
                     unnamed=False)  # fmt: skip

        c.chain(first, final, then)
        ran = threading.Event()
        final.add_done_callback(lambda h: ran.set())  # the watcher (watching `first`) is alive
        node.submit(1, OpKind.ALLREDUCE, "a", x.copy())
        first.wait(10)  # this thread ends `first`: go() runs then() here
        node.submit(1, OpKind.ALLREDUCE, "b", x.copy()).wait(10)
        assert left == [True]  # the case this test is about
        assert ran.wait(10), "the callback of a chained op that completed never ran"
        np.testing.assert_array_equal(final.wait(10), 2 * x)
    finally:
        node.close()


def test_a_callback_added_to_an_op_that_ended_unread_runs_at_once() -> None:
    """An op can end at the service while nothing in its client has read its completion
    word (its own callbacks come later; the watcher sleeps on the ops it listed, and the
    service's signal for this one came and went).  A callback added then runs at once, as
    ``add_done_callback`` says, not when the watcher next wakes (up to 0.5 s later)."""
    node = Node(2)
    try:
        c = node.clients[0]
        x = np.arange(4, dtype=np.int64)
        alone = node.submit(0, OpKind.ALLREDUCE, "a", x.copy())  # rank 1 never submits it
        alone.add_done_callback(lambda h: None)  # the watcher starts, and sleeps on it
        ended = node.submit(0, OpKind.ALLREDUCE, "b", x.copy())
        node.submit(1, OpKind.ALLREDUCE, "b", x.copy()).wait(10)
        time.sleep(0.05)  # the watcher woke at its signal, found its list unchanged: asleep
        assert c._watcher is not None and c._watcher.is_alive()
        ran: list[int] = []
        ended.add_done_callback(lambda h: ran.append(1))
        assert ran == [1], "the callback of an op that had ended did not run at once"
        np.testing.assert_array_equal(ended.wait(0), 2 * x)
        assert not alone.done()
    finally:
        node.close()


def test_a_cut_op_whose_piece_failed_leaves_no_thread_waiting() -> None:
    """An op too large for the arena runs as pieces (service/chunks.py), two in flight;
    a thread of the op's submits each later piece once the one two before it ended.  When
    a piece fails, the op fails and its pieces in flight are let go (they may never end):
    that thread must end too, not wait on one of them until shutdown."""
    node = Node(1)
    try:
        c = node.clients[0]
        names = NameTable()
        calls: list[dict[str, Any]] = []
        sub = SimpleNamespace(
            _thin=c, _names=names, _wire_id=lambda name: 12345, rank=0, size=1,
            _thin_op=lambda **kw: calls.append(kw),
        )  # fmt: skip
        before = set(threading.enumerate())
        x = np.arange(64, dtype=np.float32)
        reserved = names.name("big", ("allreduce", "float32", 64, "sum", 0))
        call = {
            "reserved": reserved, "kind": OpKind.ALLREDUCE, "x": x, "out": x, "result": x,
            "finalize": None, "shown": None, "handle": None, "parts": None, "group": None,
            "in_place": True,
        }  # fmt: skip
        final = chunks.run(sub, 4, call)
        assert len(calls) == chunks.IN_FLIGHT
        feeders = [t for t in threading.enumerate() if t not in before and "pieces" in t.name]
        assert len(feeders) == 1
        first, second = (kw["handle"] for kw in calls)
        c.settle(second, None, OpFailedError("piece 1 failed"))  # before the first ends
        with pytest.raises(OpFailedError, match="piece 1 failed"):
            final.wait(5)
        assert first.passive and not first.done()
        feeders[0].join(5)
        assert not feeders[0].is_alive(), "the thread feeding the pieces still waits"
        assert len(calls) == chunks.IN_FLIGHT  # no later piece went out
    finally:
        node.close()


class _EngineHandle:
    """An op among the services of :class:`_Engine`: it ends when the test says so."""

    def __init__(self, x: np.ndarray) -> None:
        self.x, self.name, self.generation = x, 0, 0
        self.callbacks: list[Any] = []
        self.ended = threading.Event()

    def add_done_callback(self, fn: Any) -> None:
        self.callbacks.append(fn)

    def exception(self) -> BaseException | None:
        return None

    def done(self) -> bool:
        return self.ended.is_set()

    def drive(self, seconds: float, outer: bool = False) -> None:  # the arena thread drives
        self.ended.wait(seconds)


class _Engine:
    """The services' engine, as a node's service sees it, with no other node behind it."""

    def __init__(self) -> None:
        self.loop = SimpleNamespace(on_client_notice=None, watch_outer=lambda *words: None)
        self.started: list[_EngineHandle] = []

    def take_late_errors(self) -> list[BaseException]:
        return []

    def allreduce_async(self, x: np.ndarray, **kw: Any) -> _EngineHandle:
        h = _EngineHandle(x)
        self.started.append(h)
        return h


def test_an_op_among_the_nodes_is_finished_on_the_arena_thread() -> None:
    """An op among the nodes that Python started (here an int16 allreduce: the compiled
    pass takes no int16) ends on whichever thread ends it in the services' engine, often
    its comm thread.  Its end is handled on the arena thread, which reads and changes the
    table of running ops: from another thread the two met ('dictionary changed size
    during iteration', the arena thread logging a failure and pausing)."""
    engine = _Engine()
    node = Node(1, nodes=2, engine=engine)
    service, c = node.service, node.clients[0]
    finished_on: list[threading.Thread] = []
    real_finish = service._finish

    def finish(*args: Any) -> None:
        finished_on.append(threading.current_thread())
        real_finish(*args)

    service._finish = finish  # type: ignore[method-assign]
    try:
        x = np.arange(5, dtype=np.int16)
        out = np.empty_like(x)
        at, staged = c.place(x, fill=x)
        h = ThinHandle(c, "g", 0, OpKind.ALLREDUCE, out, lambda: None)
        h.hold((staged,), out, staged)
        c.submit(h, wire=77, dtype=DType.INT16, count=5, op=ReduceOp.SUM, root=0, priority=0,
                 at_in=at, at_out=at, unnamed=False)  # fmt: skip
        deadline = time.monotonic() + 10
        while not engine.started and time.monotonic() < deadline:
            time.sleep(0.001)
        assert len(engine.started) == 1, "the op was not started among the nodes"
        op = engine.started[0]
        op.x *= 3  # what the other node's part made of it
        op.ended.set()
        for fn in op.callbacks:  # the engine's comm thread, say, ends it: here, this thread
            fn(op)
        np.testing.assert_array_equal(h.wait(10), 3 * x)
        assert finished_on == [service._thread]
    finally:
        node.close()


def _loop_entered(node: Node) -> int:
    """Repeats the node's service's compiled loop entered among the nodes."""
    from totalreduce.transport import arena as A

    return int(node.service.arena.header[A.H_LOOP_ENTERED])


@pytest.mark.parametrize("loop", [False, True], ids=["python", "compiled-loop"])
def test_repeats_among_two_nodes_start_from_the_engines_express_record(
    monkeypatch: pytest.MonkeyPatch, loop: bool
) -> None:
    """Two nodes' services in one process, their engine among the nodes over the in-process
    transport, one client each.  A world allreduce the compiled pass takes goes among the
    nodes; its first call the whole way (``_engine_op``), its repeats straight from the
    engine's express record of that call (``_fast_repeat``), or, with the service's
    compiled loop on, from the third call in that loop.  Exact results either way, the
    repeats taken so, and a new shape (another count) or another reduce op the whole way
    again."""
    from conftest import local_services

    monkeypatch.setenv("TOTALREDUCE_SERVICE_LOOP", "1" if loop else "0")
    with local_services(2) as engines:
        nodes = [Node(1, node=k, nodes=2, engine=engines[k]) for k in (0, 1)]
        repeats = [0, 0]
        for k, node in enumerate(nodes):
            service = node.service
            real = service._fast_repeat

            def counted(*args: Any, k: int = k, real: Any = real) -> bool:
                taken = bool(real(*args))
                repeats[k] += taken
                return taken

            service._fast_repeat = counted  # type: ignore[method-assign]
        try:
            gens: dict[tuple[str, int, ReduceOp], int] = {}

            def allreduce(name: str, n: int, op: ReduceOp, step: int) -> list[np.ndarray]:
                gen = gens.get((name, n, op), 0)
                gens[name, n, op] = gen + 1
                hs = []
                for k, node in enumerate(nodes):
                    c = node.clients[0]
                    x = np.arange(n, dtype=np.float32) * (k + 1) + step
                    at, staged = c.place(x, fill=x)
                    h = ThinHandle(c, name, gen, OpKind.ALLREDUCE, np.empty_like(x), lambda: None)
                    h.hold((staged,), h._result, staged)
                    hs.append(c.submit(h, wire=hash((name, n)) & ((1 << 62) - 1),
                                       dtype=DType.FLOAT32, count=n, op=op, root=0, priority=0,
                                       at_in=at, at_out=at, unnamed=False))  # fmt: skip
                return [h.wait(30) for h in hs]

            def took(want: list[int]) -> list[int]:
                """Repeats from Python's express record or the loop, once ``want`` (up to
                10 s: a service counts its repeat when the call that started it returns,
                which may be just after the clients had their results)."""
                deadline = time.monotonic() + 10
                while True:
                    got = [repeats[k] + _loop_entered(nodes[k]) for k in (0, 1)]
                    if got == want or time.monotonic() > deadline:
                        return got
                    time.sleep(0.01)

            for step in range(6):
                for got in allreduce("grad", 1000, ReduceOp.SUM, step):
                    np.testing.assert_array_equal(
                        got, np.arange(1000, dtype=np.float32) * 3 + 2 * step
                    )
            assert took([5, 5]) == [5, 5], repeats
            if loop:  # the second call starts from the record, the later ones in the loop
                assert min(_loop_entered(node) for node in nodes) >= 1, repeats
            else:
                assert repeats == [5, 5], repeats
            for got in allreduce("grad.b", 7, ReduceOp.MAX, 1):  # another name and shape
                np.testing.assert_array_equal(got, np.arange(7, dtype=np.float32) * 2 + 1)
            assert took([5, 5]) == [5, 5], repeats
            for got in allreduce("grad.b", 7, ReduceOp.MAX, 2):
                np.testing.assert_array_equal(got, np.arange(7, dtype=np.float32) * 2 + 2)
            assert took([6, 6]) == [6, 6], repeats
        finally:
            for node in nodes:
                node.close()


@pytest.mark.parametrize("loop", [False, True], ids=["python", "compiled-loop"])
def test_a_repeat_with_nothing_else_among_the_nodes_ends_on_the_arena_thread(
    monkeypatch: pytest.MonkeyPatch, loop: bool
) -> None:
    """With no other op among the nodes in flight, the arena thread drives a repeat to its
    end at once (``express.now``: no handle, no callback back to the thread); results stay
    exact, and a repeat that does not end there goes on as a handle.  With the service's
    compiled loop on, the repeats from the third take it instead (the route counted in
    the arena's header)."""
    from conftest import local_services
    from totalreduce.service import express

    ended = [0, 0]  # ended in the first try, went on as a handle
    real = express.now

    def counted(*args: Any) -> Any:
        r = real(*args)
        if r is not None:
            ended[0 if r[1] is None else 1] += 1
        return r

    monkeypatch.setattr(express, "now", counted)
    monkeypatch.setenv("TOTALREDUCE_SERVICE_LOOP", "1" if loop else "0")
    with local_services(2) as engines:
        nodes = [Node(1, node=k, nodes=2, engine=engines[k]) for k in (0, 1)]
        try:
            for step in range(20):
                hs = []
                for k, node in enumerate(nodes):
                    c = node.clients[0]
                    x = np.arange(500, dtype=np.float32) * (k + 1) + step
                    at, staged = c.place(x, fill=x)
                    h = ThinHandle(c, "g", step, OpKind.ALLREDUCE, np.empty_like(x), lambda: None)
                    h.hold((staged,), h._result, staged)
                    hs.append(c.submit(h, wire=77, dtype=DType.FLOAT32, count=500,
                                       op=ReduceOp.SUM, root=0, priority=0, at_in=at,
                                       at_out=at, unnamed=False))  # fmt: skip
                for h in hs:
                    got = h.wait(30)
                    np.testing.assert_array_equal(
                        got, np.arange(500, dtype=np.float32) * 3 + 2 * step
                    )
            took = [_loop_entered(node) for node in nodes]
        finally:
            for node in nodes:
                node.close()
    if loop:  # repeats from the third (the first two start from Python) in the compiled loop
        # (one repeat of a node at times goes Python's way, found so 3 times in 6 runs on
        # 2026-12-05 since control frames travel in the lane: results exact; not explained yet)
        assert min(took) >= 17 or min(took) + sum(ended) >= 18, (took, ended)
        return
    assert took == [0, 0], took
    assert ended[0] > 0, ended  # the first call of the shape goes the whole way, repeats not
    assert sum(ended) <= 2 * 19, ended


def test_a_large_array_of_the_arena_is_placed_on_a_huge_page() -> None:
    """``empty`` of a huge page or more starts on one (so MPI and the kernels see huge
    pages where the kernel makes them), and its ops run in place as any other's."""
    from totalreduce.transport.arena import HUGE_BYTES

    node = Node(2)
    try:
        arrays = [c.empty(HUGE_BYTES // 8, np.int64) for c in node.clients]
        for k, (c, a) in enumerate(zip(node.clients, arrays, strict=True)):
            assert c.arena.offset_of(a) % HUGE_BYTES == 0
            a[:] = np.arange(a.size) + k
        hs = [node.submit(k, OpKind.ALLREDUCE, "big", a) for k, a in enumerate(arrays)]
        for h in hs:
            h.wait(30)
        for a in arrays:
            assert np.array_equal(a, 2 * np.arange(a.size) + 1)
    finally:
        node.close()


def test_the_arena_thread_spins_after_an_op_among_the_nodes_ends(monkeypatch: Any) -> None:
    """After its last work the arena thread spins ``SPIN_S`` before it sleeps, so that a
    client's next op (submitted just after it saw the last end) finds it awake.  The end of
    an op among the nodes is work: the spin counts from there, not from the op's start (it
    did, and a thread that had driven an op longer than ``SPIN_S`` slept at once after it,
    so one 4 KiB op in six between two nodes paid a wake-up of the service)."""
    from totalreduce.daemon import thin as thin_service

    sleeps: list[float] = []
    real_sleep = thin_service.sleep_on

    def counted(fd: int, timeout: float) -> None:
        sleeps.append(time.monotonic())
        real_sleep(fd, timeout)

    monkeypatch.setattr(thin_service, "SPIN_S", 1.0)
    monkeypatch.setattr(thin_service, "sleep_on", counted)
    engine = _Engine()
    node = Node(1, nodes=2, engine=engine)
    c = node.clients[0]
    try:
        x = np.arange(5, dtype=np.int16)  # Python starts it among the nodes (int16)
        at, staged = c.place(x, fill=x)
        h = ThinHandle(c, "g", 0, OpKind.ALLREDUCE, np.empty_like(x), lambda: None)
        h.hold((staged,), h._result, staged)
        c.submit(h, wire=78, dtype=DType.INT16, count=5, op=ReduceOp.SUM, root=0, priority=0,
                 at_in=at, at_out=at, unnamed=False)  # fmt: skip
        deadline = time.monotonic() + 10
        while not engine.started and time.monotonic() < deadline:
            time.sleep(0.001)
        op = engine.started[0]
        time.sleep(1.3)  # the arena thread drives it, longer than SPIN_S
        ended = time.monotonic()
        op.ended.set()
        for fn in op.callbacks:
            fn(op)
        h.wait(10)
        time.sleep(0.3)
        assert not [t for t in sleeps if t > ended], "the arena thread slept right after the end"
    finally:
        node.close()


def test_one_name_of_two_shapes_in_turn_between_the_loop_and_python(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two nodes in one process, the service's compiled loop on: one name whose count
    changes every few steps (its row replaced, its first calls of each shape Python's,
    the others the loop's) keeps its generations in step with Python's name table: every
    op exact, none submitted twice, the loop taking most repeats."""
    from conftest import local_services

    monkeypatch.setenv("TOTALREDUCE_SERVICE_LOOP", "1")
    counts = [1000] * 5 + [7] * 5 + [1000] * 5 + [7] * 3 + [1000] * 2
    with local_services(2) as engines:
        nodes = [Node(1, node=k, nodes=2, engine=engines[k]) for k in (0, 1)]
        try:
            for step, n in enumerate(counts):
                hs = []
                for k, node in enumerate(nodes):
                    c = node.clients[0]
                    x = np.arange(n, dtype=np.float64) * (k + 1) + step
                    at, staged = c.place(x, fill=x)
                    h = ThinHandle(c, "g", step, OpKind.ALLREDUCE, np.empty_like(x), lambda: None)
                    h.hold((staged,), h._result, staged)
                    hs.append(c.submit(h, wire=99, dtype=DType.FLOAT64, count=n,
                                       op=ReduceOp.SUM, root=0, priority=0, at_in=at,
                                       at_out=at, unnamed=False))  # fmt: skip
                for h in hs:
                    np.testing.assert_array_equal(
                        h.wait(30), np.arange(n, dtype=np.float64) * 3 + 2 * step
                    )
            took = [_loop_entered(node) for node in nodes]
            # the service records what its loop ran when the loop's call returns, which may
            # be just after the clients had their results: wait for that (a few ms)
            deadline = time.monotonic() + 10
            while True:
                gens = [e._names.next_generation(99) for e in engines]
                if gens == [len(counts)] * 2 or time.monotonic() > deadline:
                    break
                time.sleep(0.01)
        finally:
            for node in nodes:
                node.close()
    assert gens == [len(counts)] * 2, gens
    assert min(took) >= 6, took  # (each shape's first two calls start from Python)

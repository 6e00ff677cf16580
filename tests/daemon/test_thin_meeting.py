"""The node's meeting place with its service and clients in one process (tests/daemon/
test_thin_local.py's ``Node``): a one-node service's clients run the world's allreduces,
broadcasts and barriers among themselves in the arena.

Every element type and op gives the bits the service's rings give (the meeting on, then
off), from 0 elements to ops of many slices, on 1-4 clients; the types and shapes the
meeting cannot run reach the service's Python, which runs them or names the ranks that
disagree; repeats take the meeting (its count of ops run), and a blocking repeat is one
compiled call with no handle; a name with more generations in flight than the meeting's
op slots waits for its oldest; a client that leaves fails only the rounds that wait for
it, and a new process in its slot works on.  Ops over a group of the node's clients meet
there too (while the others run theirs), a mismatch among a group's members fails them
all when the second arrives, and a member that waits for its peer sleeps.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from totalreduce.algorithms.codes import OpKind
from totalreduce.dtypes import DType, ReduceOp
from totalreduce.errors import OpFailedError, OpMismatchError
from totalreduce.group import Group
from totalreduce.service.thin import ThinHandle
from totalreduce.transport import arena as A
from totalreduce.transport import meeting as M

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from test_thin_local import Node  # noqa: E402


def counts(node: Node) -> tuple[int, int]:
    """(ops run at the meeting, ops handed to the service) so far."""
    at = int(node.arena.header[A.H_MEET])
    mem = node.arena.view(at, 512, np.dtype(np.int64))
    return int(mem[M.M_RAN // 8]), int(mem[M.M_ESCAPED // 8])


def submit(node: Node, k: int, kind: OpKind, wire: int, gen: int, x: np.ndarray | None,
           dt: DType, op: ReduceOp = ReduceOp.SUM, root: int = 0) -> ThinHandle:  # fmt: skip
    """Client ``k``'s op (staged: its result a new array), generation ``gen`` of ``wire``."""
    c = node.clients[k]
    if x is None:
        at, staged, out, count = -1, -1, None, 0
    else:
        out = np.empty_like(x)
        at, staged = c.place(x, fill=x)
        count = x.size
    h = ThinHandle(c, f"w{wire}", gen, kind, out, lambda: None)
    h.hold((staged,) if staged >= 0 else (), out, staged)
    return c.submit(h, wire=wire, dtype=dt, count=count, op=op, root=root, priority=0,
                    at_in=at, at_out=at, unnamed=False)  # fmt: skip


def run(node: Node, kind: OpKind, wire: int, gen: int, xs: list[Any], dt: DType,
        op: ReduceOp = ReduceOp.SUM, root: int = 0) -> list[Any]:  # fmt: skip
    """Every client submits at once (threads); every result."""
    hs: list[Any] = [None] * len(xs)

    def go(k: int) -> None:
        hs[k] = submit(node, k, kind, wire, gen, xs[k], dt, op, root)

    threads = [threading.Thread(target=go, args=(k,)) for k in range(len(xs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return [h.wait(30) for h in hs]


#: (numpy type, DType, ops): every element type of the API and its ops
TYPES = [
    (np.float16, DType.FLOAT16, "sum avg max min product"),
    (np.uint16, DType.BFLOAT16, "sum avg max min product"),
    (np.float32, DType.FLOAT32, "sum avg max min product"),
    (np.float64, DType.FLOAT64, "sum avg max min product"),
    (np.int32, DType.INT32, "sum avg max min product band bor bxor"),
    (np.int64, DType.INT64, "sum avg max min product band bor bxor"),
    (np.uint8, DType.UINT8, "sum max band"),
    (np.int8, DType.INT8, "sum min bxor"),
    (np.int16, DType.INT16, "sum avg bor"),
    (np.bool_, DType.BOOL, "sum product"),
]
#: element counts: none, one, a few, two slices of float32 and more than one of any
SIZES = [0, 1, 37, M.SLICE_BYTES // 4 + 3]


def inputs(rng: np.random.Generator, npdt: Any, dt: DType, L: int, n: int) -> list[np.ndarray]:
    if dt is DType.BFLOAT16:
        f = rng.standard_normal((L, n)).astype(np.float32)
        return list((f.view(np.uint32) >> 16).astype(np.uint16))
    if npdt is np.bool_:
        return list(rng.integers(0, 2, (L, n)).astype(np.bool_))
    if np.dtype(npdt).kind == "f":
        return list(rng.standard_normal((L, n)).astype(npdt))
    return list(rng.integers(-3, 4, (L, n)).astype(npdt))


@pytest.mark.parametrize("L", [1, 2, 3, 4])
def test_every_type_op_and_size_gives_the_rings_bits(L: int) -> None:
    met, rings = Node(L), Node(L, meeting=False)
    try:
        rng = np.random.default_rng(L)
        wire = 1000
        for npdt, dt, ops in TYPES:
            for name in ops.split():
                op = ReduceOp[name.upper()]
                for n in SIZES if dt in (DType.FLOAT32, DType.INT8) else SIZES[:3]:
                    wire += 1
                    xs = inputs(rng, npdt, dt, L, n)
                    got = run(met, OpKind.ALLREDUCE, wire, 0, [x.copy() for x in xs], dt, op)
                    want = run(rings, OpKind.ALLREDUCE, wire, 0, [x.copy() for x in xs], dt, op)
                    for k in range(L):
                        assert got[k].tobytes() == want[k].tobytes(), (npdt, name, n, k)
        raw = sum(
            len(ops.split()) * (len(SIZES) if dt is DType.FLOAT32 else 3)
            for _, dt, ops in TYPES[:6]
        )
        ran, escaped = counts(met)
        assert ran == raw and escaped == wire - 1000 - raw, (ran, escaped, raw)
    finally:
        met.close()
        rings.close()


@pytest.mark.parametrize("L", [2, 3])
def test_broadcasts_from_every_root_and_barriers(L: int) -> None:
    node = Node(L)
    try:
        for root in range(L):
            for gen, n in enumerate((0, 5, M.SLICE_BYTES // 8 * 3)):
                xs = [np.arange(n, dtype=np.float64) * (k + 1) for k in range(L)]
                got = run(node, OpKind.BROADCAST, 50 + root, gen, xs, DType.FLOAT64, root=root)
                assert all(np.array_equal(g, xs[root]) for g in got)
        for gen in range(3 * M.DEPTH):
            assert run(node, OpKind.BARRIER, 60, gen, [None] * L, DType.INT64) == [None] * L
        assert counts(node) == (3 * L + 3 * M.DEPTH, 0)
    finally:
        node.close()


def test_more_generations_in_flight_than_op_slots_wait_for_the_oldest() -> None:
    """Client 0 submits 3 x DEPTH generations of a name before client 1 submits any: from
    the (DEPTH + 1)-th on, each waits for its op slot's previous round, which ends once
    client 1 comes (on another thread); every result exact."""
    node = Node(2)
    try:
        n = 3 * M.DEPTH
        got: list[Any] = []

        def first() -> None:
            hs = [
                submit(node, 0, OpKind.ALLREDUCE, 70, g, np.full(3, g, np.int64), DType.INT64)
                for g in range(n)
            ]
            got.extend(h.wait(30) for h in hs)

        t = threading.Thread(target=first)
        t.start()
        late = [
            submit(node, 1, OpKind.ALLREDUCE, 70, g, np.full(3, 10 * g, np.int64), DType.INT64)
            for g in range(n)
        ]
        t.join(60)
        assert [list(h.wait(30)) for h in late] == [[11 * g] * 3 for g in range(n)]
        assert [list(x) for x in got] == [[11 * g] * 3 for g in range(n)]
    finally:
        node.close()


def test_a_blocking_repeat_is_one_call_with_no_handle(monkeypatch: Any) -> None:
    """``ThinClient.now`` on arrays of the arena: no ThinHandle is made while its peers
    are there; one whose peer comes late gets a handle and still ends exact."""
    node = Node(2)
    made = [0]
    real = ThinHandle.__init__

    def counting(self: ThinHandle, *args: Any, **kw: Any) -> None:
        made[0] += 1
        real(self, *args, **kw)

    monkeypatch.setattr(ThinHandle, "__init__", counting)
    try:
        xs = [c.empty(1000, np.float32) for c in node.clients]
        rec = M.record(88, M.pack_shape(1, int(DType.FLOAT32), 1, 0, 0), 1000, 0)
        row = np.zeros(A.D_WORDS, np.int64)
        ended = [0]

        def step(k: int, gen: int) -> Any:
            c, x = node.clients[k], xs[k]
            x[:] = k + gen
            at = c.arena.offset_of(x)
            return c.now("g", gen, row, rec.copy() if gen == 0 else recs[k], x, at, 0,
                         lambda: ended.__setitem__(0, ended[0] + 1), lambda: None)  # fmt: skip

        recs = [rec.copy(), rec.copy()]

        def both(gen: int) -> list[Any]:
            outs: list[Any] = [None, None]
            ts = [
                threading.Thread(target=lambda k=k: outs.__setitem__(k, step(k, gen)))
                for k in (0, 1)
            ]
            for t in ts:
                t.start()
            for t in ts:
                t.join(30)
            return outs

        for gen in range(50):
            outs = both(gen)
            assert all(o is xs[k] for k, o in enumerate(outs))
            assert all((x == 2 * gen + 1).all() for x in xs)
        assert ended[0] == 0  # a generation that ended in its call was never held
        ran = counts(node)[0]
        late: list[Any] = []
        t = threading.Thread(target=lambda: late.append(step(0, 50)))
        t.start()
        t.join(0.3)  # client 0 waits alone past its compiled call's first try
        step(1, 50)
        t.join(30)
        assert (xs[0] == 101).all() and (xs[1] == 101).all()
        assert counts(node)[0] == ran + 1
        assert made[0] <= 1, made  # at most the late one's
        assert ended[0] == made[0]  # which was held, and so ended
    finally:
        node.close()


def test_a_mismatch_escapes_and_names_both_ranks() -> None:
    node = Node(3)
    try:
        xs = [np.ones(4 + (k == 2), np.int64) for k in range(3)]
        hs = [submit(node, k, OpKind.ALLREDUCE, 90, 0, xs[k], DType.INT64) for k in range(3)]
        for h in hs:
            with pytest.raises(OpMismatchError, match="rank 1: allreduce, count 4.*rank 2: allred"):
                h.wait(30)
        kinds = [OpKind.ALLREDUCE, OpKind.BROADCAST, OpKind.ALLREDUCE]  # kinds differ
        hs = [submit(node, k, kinds[k], 90, 1, np.ones(4, np.int64), DType.INT64) for k in range(3)]
        for h in hs:
            with pytest.raises(OpMismatchError, match="broadcast"):
                h.wait(30)
        got = run(node, OpKind.ALLREDUCE, 90, 2, [np.ones(4, np.int64)] * 3, DType.INT64)
        assert all(list(g) == [3] * 4 for g in got)
    finally:
        node.close()


def test_a_client_that_leaves_fails_the_rounds_waiting_for_it_and_its_successor_works() -> None:
    node = Node(2)
    try:
        h = submit(node, 0, OpKind.ALLREDUCE, 95, 0, np.ones(2, np.int64), DType.INT64)
        node.service.detach(1, None)  # left, saying goodbye
        with pytest.raises(OpFailedError, match="rank 1 left"):
            h.wait(30)
        late = submit(node, 0, OpKind.BARRIER, 96, 0, None, DType.INT64)
        with pytest.raises(OpFailedError, match="rank 1 left"):
            late.wait(30)
        node.replace(1)  # a new process takes the slot: the session's new names work
        got = run(node, OpKind.ALLREDUCE, 97, 0, [np.ones(2, np.int64)] * 2, DType.INT64)
        assert all(list(g) == [2, 2] for g in got)
    finally:
        node.close()


def gsubmit(node: Node, k: int, ranks: list[int], kind: OpKind, wire: int, gen: int,
            x: np.ndarray | None, dt: DType, root: int = 0) -> ThinHandle:  # fmt: skip
    """Client ``k``'s op over the group of ``ranks`` (staged), generation ``gen`` of ``wire``."""
    c = node.clients[k]
    g = Group(ranks)
    at_group, _ = c.const_block((g.size, *g.ranks))
    if x is None:
        at, staged, out, count = -1, -1, None, 0
    else:
        out = np.empty_like(x)
        at, staged = c.place(x, fill=x)
        count = x.size
    h = ThinHandle(c, f"w{wire}", gen, kind, out, lambda: None)
    h.hold((staged,) if staged >= 0 else (), out, staged)
    return c.submit(
        h, wire=wire, dtype=dt, count=count, op=ReduceOp.SUM, root=root, priority=0,
        at_in=at, at_out=at, unnamed=False, group=at_group, context=g.context,
    )  # fmt: skip


GROUP_TYPES = [(np.float32, DType.FLOAT32), (np.float64, DType.FLOAT64), (np.int64, DType.INT64)]
GROUP_SIZES = [37, pytest.param(M.SLICE_BYTES // 4 + 3, marks=pytest.mark.full)]


@pytest.mark.parametrize("n", GROUP_SIZES)
def test_a_group_of_two_of_three_meets_exactly_while_the_third_runs_its_own(n: int) -> None:
    """Allreduces, broadcasts and barriers over [0, 2] meet (the meeting's count of ops
    run, none handed to the service), exact in every type, while client 1 runs ops over
    its own group of one, also at the meeting."""
    node = Node(3)
    rng = np.random.default_rng(5)
    try:
        ran0, esc0 = counts(node)
        stop = threading.Event()
        alone: list[Any] = []

        def third() -> None:
            gen = 0
            while not stop.is_set() and gen < 400:
                x = np.full(5, gen, np.int64)
                h = gsubmit(node, 1, [1], OpKind.ALLREDUCE, 301, gen, x, DType.INT64)
                alone.append(h.wait(30))
                gen += 1

        t = threading.Thread(target=third)
        t.start()
        ops = 0
        for j, (npdt, dt) in enumerate(GROUP_TYPES):
            for gen in range(3):  # a name's repeats (the same channel)
                xs = list(rng.standard_normal((2, n)) * 100)
                xs = [np.asarray(v).astype(npdt) for v in xs]
                hs = [gsubmit(node, k, [0, 2], OpKind.ALLREDUCE, 310 + j, gen, xs[i], dt)
                      for i, k in enumerate((0, 2))]  # fmt: skip
                want = xs[0] + xs[1]
                for h in hs:
                    assert h.wait(30).tobytes() == want.tobytes()
                hs = [gsubmit(node, k, [0, 2], OpKind.BROADCAST, 320 + j, gen, xs[i], dt, root=1)
                      for i, k in enumerate((0, 2))]  # fmt: skip
                for h in hs:
                    assert h.wait(30).tobytes() == xs[1].tobytes()
                hs = [gsubmit(node, k, [0, 2], OpKind.BARRIER, 330, 3 * j + gen, None, dt)
                      for k in (0, 2)]  # fmt: skip
                for h in hs:
                    h.wait(30)
                ops += 3
        stop.set()
        t.join(60)
        assert [int(a[0]) for a in alone] == list(range(len(alone)))
        ran, esc = counts(node)
        assert (ran - ran0, esc - esc0) == (ops + len(alone), 0)  # all met, none escaped
    finally:
        node.close()


def test_a_mismatch_in_a_group_fails_every_member_at_once_naming_both() -> None:
    """Counts (then types) that differ fail both members as soon as the second arrives
    (no stall look), each naming both ranks and what each gave; the name goes on."""
    node = Node(3)
    try:
        h0 = gsubmit(node, 0, [0, 2], OpKind.ALLREDUCE, 340, 0, np.ones(4, np.int64), DType.INT64)
        h2 = gsubmit(node, 2, [0, 2], OpKind.ALLREDUCE, 340, 0, np.ones(5, np.int64), DType.INT64)
        for h in (h0, h2):
            with pytest.raises(
                OpMismatchError,
                match=r"generation 0: .*rank 0: allreduce, count 4 int64 \(op sum\); "
                r"rank 2: allreduce, count 5 int64",
            ):
                h.wait(1.0)  # (a stall look would take longer: an OpTimeoutError)
        h0 = gsubmit(node, 0, [0, 2], OpKind.ALLREDUCE, 340, 1, np.ones(4, np.int64), DType.INT64)
        h2 = gsubmit(node, 2, [0, 2], OpKind.ALLREDUCE, 340, 1, np.ones(4), DType.FLOAT64)
        for h in (h0, h2):
            with pytest.raises(OpMismatchError, match="count 4 int64.*count 4 float64"):
                h.wait(1.0)
        got = [gsubmit(node, k, [0, 2], OpKind.ALLREDUCE, 340, 2, np.ones(4, np.int64),
                       DType.INT64) for k in (0, 2)]  # fmt: skip
        assert all(list(h.wait(30)) == [2] * 4 for h in got)
    finally:
        node.close()


def test_a_group_member_waiting_for_its_peer_sleeps() -> None:
    """A member whose peer comes 0.5 s late waits asleep (futex): its thread's CPU time
    is a small part of the wait, and the op then ends exactly."""
    node = Node(2)
    try:
        t0, w0 = time.thread_time(), time.monotonic()
        h = gsubmit(node, 0, [0, 1], OpKind.ALLREDUCE, 350, 0, np.ones(3, np.int64), DType.INT64)

        def late() -> None:
            time.sleep(0.5)
            gsubmit(node, 1, [0, 1], OpKind.ALLREDUCE, 350, 0, np.ones(3, np.int64),
                    DType.INT64).wait(30)  # fmt: skip

        t = threading.Thread(target=late)
        t.start()
        assert list(h.wait(30)) == [2, 2, 2]
        cpu, wall = time.thread_time() - t0, time.monotonic() - w0
        t.join(30)
        assert wall >= 0.45 and cpu < 0.1 * wall, (cpu, wall)
    finally:
        node.close()


@pytest.mark.parametrize("n", GROUP_SIZES)
def test_a_group_out_of_order_meets_reduced_in_its_order(n: int) -> None:
    """[2, 0, 1] meets (the meeting's count of ops run), its allreduces reduced in group
    order: the rings' bits (the same ops with the meeting off), not slot order's (the
    first element is chosen to tell them apart); a broadcast's root is a group rank."""
    met, rings = Node(3), Node(3, meeting=False)
    rng = np.random.default_rng(11)
    order = [2, 0, 1]
    try:
        ran0, esc0 = counts(met)
        for j, (npdt, dt) in enumerate(GROUP_TYPES):
            xs = [np.asarray(v).astype(npdt) for v in rng.standard_normal((3, n)) * 100]
            if dt is not DType.INT64:
                xs[0][0], xs[1][0], xs[2][0] = 1e20, 1, -1e20  # (-1e20 + 1e20) + 1 = 1
            got = {}
            for node in (met, rings):
                hs = [gsubmit(node, k, order, OpKind.ALLREDUCE, 360 + j, 0, xs[k], dt)
                      for k in range(3)]  # fmt: skip
                got[node] = [h.wait(30) for h in hs]
                hs = [gsubmit(node, k, order, OpKind.BROADCAST, 370 + j, 0, xs[k], dt, root=1)
                      for k in range(3)]  # fmt: skip
                assert all(h.wait(30).tobytes() == xs[0].tobytes() for h in hs)
            want = (xs[2] + xs[0]) + xs[1]
            for k in range(3):
                assert got[met][k].tobytes() == got[rings][k].tobytes() == want.tobytes()
            if dt is not DType.INT64:
                assert got[met][0][0] == 1 and ((xs[0] + xs[1]) + xs[2])[0] == 0
        assert counts(met) == (ran0 + 2 * len(GROUP_TYPES), esc0)  # all met, none escaped
    finally:
        met.close()
        rings.close()

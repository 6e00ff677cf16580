"""The arena thread's compiled pass (daemon/arena_pass.py).

Two levels: the compiled function itself over a fake arena (what it takes, what it
hands Python and in which order, the wake-up list, a full table), and a node's
service with its clients in one process (tests/daemon/test_thin_local.py's ``Node``):
the same ops give the same bits whether the pass or Python ran them, the pass runs the
common ops without Python, and everything else still ends as it did.
"""

from __future__ import annotations

import ctypes
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from totalreduce.algorithms.codes import AlgorithmCode, OpKind
from totalreduce.daemon import arena_pass as P
from totalreduce.daemon.thin import ThinService
from totalreduce.dtypes import DType, ReduceOp
from totalreduce.errors import InvalidArgumentError, OpFailedError, OpMismatchError
from totalreduce.service.thin import ThinHandle
from totalreduce.transport import arena as A

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from test_thin_local import Node  # noqa: E402

# ---------------------------------------------------------------- the function alone

DATA = 1 << 16  # data bytes per slot of the fake arena


class Fake:
    """A fake arena of ``slots`` slots (int64 words), and the pass's table over it."""

    def __init__(self, slots: int, nodes: int = 1, pipe_min_bytes: int = P.PIPE_MIN_BYTES) -> None:
        self.slots = slots
        self.ctl_words = A.ERROR_WORD
        self.data_words = DATA // 8
        self.slot_words = self.ctl_words + self.data_words
        self.mem = np.zeros(slots * self.slot_words, np.int64)
        self.t = t = P.Table(slots, nodes, 0, DATA, pipe_min_bytes)
        t.cw[:] = [k * self.slot_words for k in range(slots)]
        t.lo[:] = [8 * (k * self.slot_words + self.ctl_words) for k in range(slots)]
        t.incs[:] = 1
        t.st[P.S_ON] = 1
        self.base = self.mem.ctypes.data
        self.tickets = [0] * slots

    def write(self, k: int, **fields: int) -> int:
        """A descriptor into slot ``k``'s ring (fields by name, D_ left out); its ticket."""
        cw = int(self.t.cw[k])
        tail = int(self.mem[cw + A.C_TAIL])
        row = cw + A.RING_WORD + (tail % A.RING) * A.D_WORDS
        d = self.mem[row : row + A.D_WORDS]
        d[:] = 0
        self.tickets[k] += 1
        d[A.D_TICKET] = self.tickets[k]
        d[A.D_KIND], d[A.D_DTYPE], d[A.D_OP] = int(OpKind.ALLREDUCE), int(DType.INT64), 1
        d[A.D_IN] = d[A.D_OUT] = int(self.t.lo[k])
        d[A.D_GROUP], d[A.D_AUX] = -1, -1
        for name, v in fields.items():
            d[getattr(A, "D_" + name.upper())] = v
        self.mem[cw + A.C_TAIL] = tail + 1
        return self.tickets[k]

    def data(self, k: int, n: int) -> np.ndarray:
        at = (int(self.t.lo[k])) // 8
        return self.mem[at : at + n]

    def word(self, k: int, ticket: int) -> int:
        return int(self.mem[int(self.t.cw[k]) + A.DONE_WORD + (ticket - 1) % A.RING])

    def run(self) -> int:
        return int(P.arena_pass(self.t.buf, self.t.lay, self.mem, self.base))

    def eject(self, older_ns: int) -> int:
        return int(P.arena_eject(self.t.buf, self.t.lay, older_ns))

    def started(self) -> list[int]:
        """The entries the last pass left Python to start among the nodes."""
        return self.t.starts[: int(self.t.st[P.S_NSTART])].tolist()

    def queued(self) -> list[tuple[int, int, int]]:
        """(slot, wire, generation) of what the last call handed Python, in order."""
        t = self.t
        return [
            (int(t.outslot[i]), int(t.outq[i, A.D_WIRE]), int(t.outq[i, A.D_GEN]))
            for i in range(int(t.st[P.S_NOUT]))
        ]


def test_an_allreduce_of_every_slot_runs_and_sets_every_word() -> None:
    f = Fake(3)
    for k in range(3):
        f.data(k, 5)[:] = np.arange(5) + 10 * k
    t0 = f.write(0, wire=7, count=5)
    assert f.run() == 1 and f.word(0, t0) == 0 and f.t.st[P.S_LIVE] == 1
    t1, t2 = f.write(1, wire=7, count=5), f.write(2, wire=7, count=5)
    assert f.run() == 2
    assert f.t.st[P.S_LIVE] == 0 and f.t.st[P.S_NOUT] == 0
    assert [f.word(k, t) for k, t in enumerate((t0, t1, t2))] == [t0, t1, t2]
    for k in range(3):
        assert f.data(k, 5).tolist() == (3 * np.arange(5) + 30).tolist()
    assert f.t.heads.tolist() == [1, 1, 1]


def test_what_the_pass_does_not_take_goes_to_python_in_order() -> None:
    f = Fake(2)
    f.write(0, wire=1, count=4)  # taken
    f.write(0, wire=2, count=4, ctx=99)  # a group's: Python's
    f.write(0, wire=3, count=4, dtype=int(DType.UINT8))  # not a raw kernel's type
    f.write(0, wire=4, count=4, algo=int(AlgorithmCode.RING))  # an algorithm named
    f.write(0, wire=5, count=4, kind=int(OpKind.REDUCE_SCATTER))
    f.write(0, wire=6, count=4, dtype=int(DType.FLOAT32), op=int(ReduceOp.BAND))
    f.write(0, wire=8, count=DATA)  # does not fit the slot's data
    f.write(0, wire=9, count=4, out=123)  # outside its part of the arena
    f.write(0, wire=10, count=4, kind=int(OpKind.BROADCAST), root=2)  # root outside the world
    assert f.run() == 9
    assert f.queued() == [(0, w, 0) for w in (2, 3, 4, 5, 6, 8, 9, 10)]
    assert f.t.st[P.S_LIVE] == 1
    # the second part of a key Python has follows it there, whatever it is
    f.write(1, wire=2, count=4)
    assert f.run() == 1 and f.queued() == [(1, 2, 0)]


def test_a_groups_op_waits_for_its_members_and_reduces_in_group_order() -> None:
    """A group of slots 3, 1, 2 (in that order): the pass waits for those three, adds
    their inputs in group order (Python's), answers them only and counts the op as one it
    ran alone; slot 0, no member, goes to Python with the name."""
    f = Fake(4)
    ctx = -0x1234_5678_9ABC
    assert f.t.put_group(ctx, (3, 1, 2)) == 1 and f.t.put_group(ctx, (3, 1, 2)) == 1
    rng = np.random.default_rng(5)
    xs = [rng.standard_normal(64) * 1e3 for _ in range(4)]
    for k in range(4):
        f.data(k, 64)[:] = xs[k].view(np.int64)
    before = f.data(0, 64).copy()
    dt = int(DType.FLOAT64)
    t3, t1 = (f.write(k, wire=7, count=64, ctx=ctx, dtype=dt) for k in (3, 1))
    assert f.run() == 2 and f.t.st[P.S_LIVE] == 1 and f.word(3, t3) == 0
    t2 = f.write(2, wire=7, count=64, ctx=ctx, dtype=dt)
    assert f.run() == 1 and f.t.st[P.S_LIVE] == 0 and f.t.st[P.S_NOUT] == 0
    assert [f.word(k, t) for k, t in ((3, t3), (1, t1), (2, t2))] == [t3, t1, t2]
    want = (xs[3] + xs[1]) + xs[2]
    assert not np.array_equal(want, (xs[1] + xs[2]) + xs[3])  # (the order shows)
    for k in (1, 2, 3):
        assert np.array_equal(f.data(k, 64).view(np.float64), want)
    assert np.array_equal(f.data(0, 64), before)
    assert f.mem[P.AR_H_PASS_GROUP] == 1  # (the fake's header word: slot 0's, unused)
    f.write(0, wire=8, count=64, ctx=ctx, dtype=dt)  # no member of it
    assert f.run() == 1 and f.queued() == [(0, 8, 0)]


def test_ranks_that_disagree_on_a_known_group_go_to_python_in_order() -> None:
    """Two groups the table knows, one name and generation: slot 1's descriptor meets
    slot 0's op and both go to Python, in the order they came (Python names both ranks'
    groups)."""
    f = Fake(3)
    f.t.put_group(11, (0, 1))
    f.t.put_group(12, (1, 0, 2))
    f.write(0, wire=4, count=4, ctx=11)
    f.write(1, wire=4, count=4, ctx=12)
    assert f.run() == 2 and f.queued() == [(0, 4, 0), (1, 4, 0)]  # (the pass reads slot 0 first)
    assert f.t.st[P.S_LIVE] == 0


def test_a_groups_avg_divides_by_the_groups_size() -> None:
    f = Fake(3)
    f.t.put_group(77, (2, 0))
    f.data(0, 4)[:] = [10, 20, 30, 40]
    f.data(2, 4)[:] = [2, 4, 6, 8]
    for k in (2, 0):
        f.write(k, wire=5, count=4, ctx=77, op=int(ReduceOp.AVG), flags=A.F_AVG)
    assert f.run() == 2 and f.t.st[P.S_LIVE] == 0
    assert f.data(0, 4).tolist() == f.data(2, 4).tolist() == [6, 12, 18, 24]


def test_a_group_across_nodes_is_the_loops_or_pythons_untouched() -> None:
    """A group of rank 1 (slot 1 here) and rank 2 (the other node): outside the service's
    loop its descriptor goes to Python as it came; inside, it is a start whose node's
    part is not made yet, and what the loop leaves to Python of it goes there the same."""
    for looping in (0, 1):
        f = Fake(2, nodes=2)
        f.t.put_group(55, (1, 2))
        f.t.st[P.S_LOOPING] = looping
        f.data(1, 4)[:] = [1, 2, 3, 4]
        f.write(1, wire=9, count=4, ctx=55, out=int(f.t.lo[1]) + 64)
        assert f.run() == 1 and f.t.st[P.S_LIVE] == looping  # (a start stays till it ends)
        if not looping:
            assert f.queued() == [(1, 9, 0)] and f.started() == []
            continue
        (e,) = f.started()
        assert f.queued() == [] and f.data(1, 12)[8:].tolist() == [0, 0, 0, 0]
        assert P.entry_buffer(f.t.buf, f.t.lay, e) == int(f.t.lo[1]) + 64
        assert P.entry_group(f.t.buf, f.t.lay, e) == (1, 1, 2, 2)
        P.arena_hand_over(f.t.buf, f.t.lay, 0)
        assert f.queued() == [(1, 9, 0)] and f.started() == [] and f.t.st[P.S_LIVE] == 0
        # the name's other parts are Python's from now on
        f.write(0, wire=9, count=4)
        assert f.run() == 1 and f.queued() == [(0, 9, 0)]


def test_a_disagreement_hands_python_the_op_in_the_order_it_came() -> None:
    f = Fake(3)
    f.write(2, wire=5, count=4)
    assert f.run() == 1
    f.write(0, wire=5, count=4)
    assert f.run() == 1 and f.t.st[P.S_LIVE] == 1
    f.write(1, wire=5, count=6)  # another count: Python says who disagrees
    assert f.run() == 1
    assert f.queued() == [(2, 5, 0), (0, 5, 0), (1, 5, 0)]
    assert f.t.st[P.S_LIVE] == 0
    f.write(0, wire=5, count=4, gen=1)  # the name's next generation is the pass's again
    assert f.run() == 1 and f.queued() == [] and f.t.st[P.S_LIVE] == 1


def test_a_second_submission_by_one_rank_goes_to_python() -> None:
    f = Fake(2)
    f.write(0, wire=5, count=4)
    f.write(0, wire=5, count=4)
    assert f.run() == 2
    assert f.queued() == [(0, 5, 0), (0, 5, 0)]


def test_on_several_nodes_the_node_part_is_done_and_python_starts_the_rest() -> None:
    """Node 0 of two, two slots: an avg allreduce complete here is reduced into the first
    client's output and listed to start; after the nodes' step, arena_finish divides by
    the world's size, copies it back and sets the words."""
    f = Fake(2, nodes=2)
    for k in range(2):
        f.data(k, 3)[:] = [10 * k + 1, 10 * k + 2, 10 * k + 3]
    t0 = f.write(0, wire=5, count=3, op=int(ReduceOp.AVG), flags=A.F_AVG)
    assert f.run() == 1 and f.queued() == [] and f.started() == []
    t1 = f.write(1, wire=5, count=3, op=int(ReduceOp.AVG), flags=A.F_AVG)
    assert f.run() == 1 and f.queued() == []
    (e,) = f.started()
    assert f.data(0, 3).tolist() == [12, 14, 16]  # the node's sum, not divided yet
    assert f.word(0, t0) == 0 and f.word(1, t1) == 0
    assert P._find(f.t.keys, f.t.bucket, f.t.next, 5, 0) == -1  # out of the buckets
    f.write(1, wire=5, count=3, op=int(ReduceOp.AVG), flags=A.F_AVG)  # a second one
    assert f.run() == 1 and f.queued() == [(1, 5, 0)]  # goes to Python
    f.data(0, 3)[:] += [100, 100, 100]  # what the other node gave
    P.arena_finish(f.t.buf, f.t.lay, f.mem, f.base, e, 1)
    assert f.data(0, 3).tolist() == [28, 28, 29]  # (112, 114, 116) // 4
    assert f.data(1, 3).tolist() == [28, 28, 29]
    assert f.word(0, t0) == t0 and f.word(1, t1) == t1
    assert f.t.st[P.S_LIVE] == 0


def test_a_segmented_op_is_made_and_handed_back_by_ranges() -> None:
    """An avg allreduce of 10 int64 (80 bytes) with segments from 64 bytes: the pass lists
    it to start but leaves its node's part to Python's ranges (arena_local); each range's
    result goes back divided (arena_back), and arena_finish then only sets the words."""
    f = Fake(2, nodes=2, pipe_min_bytes=64)
    for k in range(2):
        f.data(k, 10)[:] = np.arange(10) + 100 * k
    ts = [f.write(k, wire=5, count=10, op=int(ReduceOp.AVG), flags=A.F_AVG) for k in range(2)]
    f.run()
    (e,) = f.started()
    assert P.pipelined(f.t.st, f.t.descs[e, 0])
    assert f.data(0, 10).tolist() == list(range(10))  # not made yet
    P.arena_local(f.t.buf, f.t.lay, f.base, e, 0, 4)
    assert f.data(0, 10).tolist() == [100, 102, 104, 106, 4, 5, 6, 7, 8, 9]
    P.arena_local(f.t.buf, f.t.lay, f.base, e, 4, 10)
    f.data(0, 10)[:] += 2  # what the other node gave: the world's sum is even, 4 ranks
    P.arena_back(f.t.buf, f.t.lay, f.base, e, 4, 10)
    assert f.data(1, 10)[4:].tolist() == [(102 + 2 * i) // 4 for i in range(4, 10)]
    assert f.data(1, 10)[:4].tolist() == [100, 101, 102, 103]  # not back yet
    assert f.word(0, ts[0]) == 0
    P.arena_back(f.t.buf, f.t.lay, f.base, e, 0, 4)
    P.arena_finish(f.t.buf, f.t.lay, f.mem, f.base, e, 0)
    want = [(102 + 2 * i) // 4 for i in range(10)]
    assert f.data(0, 10).tolist() == want and f.data(1, 10).tolist() == want  # once divided
    assert f.word(0, ts[0]) == ts[0] and f.word(1, ts[1]) == ts[1]
    # under the least bytes, on one node, or of one client: made whole by the pass
    for slots, nodes, count in ((2, 2, 7), (2, 1, 10), (1, 2, 10)):
        g = Fake(slots, nodes=nodes, pipe_min_bytes=64)
        d = g.t.descs[0, 0]
        d[A.D_KIND], d[A.D_DTYPE], d[A.D_COUNT] = int(OpKind.ALLREDUCE), int(DType.INT64), count
        assert not P.pipelined(g.t.st, d)


def test_a_broadcast_from_another_node_lands_in_the_first_clients_output() -> None:
    f = Fake(2, nodes=2)
    for k in range(2):
        f.data(k, 2)[:] = [7 + k, 7 + k]
    f.write(0, wire=9, count=2, kind=int(OpKind.BROADCAST), root=3)  # node 1's second
    f.write(1, wire=9, count=2, kind=int(OpKind.BROADCAST), root=3)
    f.run()
    (e,) = f.started()
    assert P.node_buffer(f.t.st, f.t.descs, e) == f.t.lo[0]
    f.data(0, 2)[:] = [42, 43]
    P.arena_finish(f.t.buf, f.t.lay, f.mem, f.base, e, 1)
    assert f.data(1, 2).tolist() == [42, 43]
    f.write(0, wire=9, count=2, kind=int(OpKind.BROADCAST), root=1, gen=1)  # from here
    f.write(1, wire=9, count=2, kind=int(OpKind.BROADCAST), root=1, gen=1)
    f.data(1, 2)[:] = [5, 6]
    f.run()
    (e,) = f.started()
    assert P.node_buffer(f.t.st, f.t.descs, e) == f.t.lo[1]


def test_off_everything_goes_to_python() -> None:
    f = Fake(1)
    f.t.st[P.S_ON] = 0
    t = f.write(0, wire=5, count=4)
    assert f.run() == 1 and f.queued() == [(0, 5, 0)] and f.word(0, t) == 0


def test_eject_hands_over_old_ops_and_keeps_young_ones() -> None:
    f = Fake(3)
    f.write(1, wire=1, count=2)
    f.run()
    f.write(0, wire=1, count=2)
    f.write(0, wire=2, count=2)
    f.run()
    f.t.born[:] = 0
    f.write(2, wire=3, count=2)
    f.run()
    e3 = P._find(f.t.keys, f.t.bucket, f.t.next, 3, 0)
    f.t.born[e3] = 10**18
    assert f.eject(10**9) == 0
    got = f.queued()
    assert sorted(got) == sorted([(1, 1, 0), (0, 1, 0), (0, 2, 0)])
    assert got.index((1, 1, 0)) < got.index((0, 1, 0))
    assert f.t.st[P.S_LIVE] == 1
    f.write(1, wire=1, count=2)  # Python has wire 1 now: its last part goes there
    assert f.run() == 1 and f.queued() == [(1, 1, 0)]


def test_a_full_table_hands_the_rest_to_python() -> None:
    f = Fake(2)
    n = P.CAP + 10
    for i in range(n):
        f.write(0, wire=100 + i, count=1)
        if (i + 1) % 200 == 0:
            f.run()
    f.run()
    assert f.t.st[P.S_LIVE] == P.CAP
    for i in range(n):
        f.write(1, wire=100 + i, count=1)
        if (i + 1) % 50 == 0:
            f.run()
    f.run()
    assert f.t.st[P.S_LIVE] == 0


def test_sleepers_are_woken_once_per_pass() -> None:
    f = Fake(2)
    for k in range(2):
        f.mem[int(f.t.cw[k]) + A.C_SLEEPING] = 1
    for i in range(20):  # twenty ops end in one pass: each sleeper is listed once
        for k in range(2):
            f.write(k, wire=50 + i, count=1)
    f.run()
    assert sorted(f.t.sig[: int(f.t.st[P.S_NSIG])].tolist()) == [0, 1]


# ---------------------------------------------------------------- a node, in one process


def _count_python_takes(monkeypatch: Any) -> list[int]:
    seen = [0]
    take = ThinService._take

    def counting(self: ThinService, slot: int, d: np.ndarray) -> None:
        seen[0] += 1
        take(self, slot, d)

    monkeypatch.setattr(ThinService, "_take", counting)
    return seen


def _run(node: Node, name: str, x: list[np.ndarray], kind: OpKind, op: ReduceOp,
         root: int = 0) -> list[Any]:  # fmt: skip
    hs = [None] * len(x)

    def go(k: int) -> None:
        hs[k] = node.submit(k, kind, name, x[k], op=op, root=root)  # type: ignore[call-overload]

    threads = [threading.Thread(target=go, args=(k,)) for k in range(len(x))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return [h.wait(30) for h in hs]  # type: ignore[attr-defined]


def _inputs(rng: np.random.Generator, npdt: Any, L: int, n: int) -> list[np.ndarray]:
    if np.dtype(npdt).kind == "f":
        return [rng.standard_normal(n).astype(npdt) for _ in range(L)]
    return [rng.integers(-1000, 1000, n).astype(npdt) for _ in range(L)]


@pytest.mark.parametrize("L", [2, pytest.param(3, marks=pytest.mark.full)])
def test_the_pass_gives_the_python_paths_bits(monkeypatch: Any, L: int) -> None:
    """Each op of each type the pass takes, run by the pass and (the pass off) by Python:
    the same bits in every rank's result."""
    seen = _count_python_takes(monkeypatch)
    node = Node(L, meeting=False)
    rng = np.random.default_rng(L)
    cases = [
        (npdt, op)
        for npdt in (np.float16, np.float32, np.float64, np.int32, np.int64)
        for op in (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MAX, ReduceOp.MIN, ReduceOp.PRODUCT)
    ] + [(np.int64, ReduceOp.BXOR), (np.int32, ReduceOp.BAND)]
    try:
        for i, (npdt, op) in enumerate(cases):
            x = _inputs(rng, npdt, L, 97)
            fast = _run(node, f"c{i}", [a.copy() for a in x], OpKind.ALLREDUCE, op)
            assert seen[0] == 0, (npdt, op)
            node.service._fast.st[P.S_ON] = 0
            slow = _run(node, f"s{i}", [a.copy() for a in x], OpKind.ALLREDUCE, op)
            node.service._fast.st[P.S_ON] = 1
            assert seen[0] == L
            seen[0] = 0
            for k in range(L):
                assert fast[k].tobytes() == slow[k].tobytes(), (npdt, op, k)
        x = _inputs(rng, np.float32, L, 33)
        for r in range(L):
            got = _run(node, f"b{r}", [a.copy() for a in x], OpKind.BROADCAST, ReduceOp.SUM, r)
            assert all(g.tobytes() == x[r].tobytes() for g in got)
        assert seen[0] == 0
        assert node.service._fast.st[P.S_TAKEN] > 0
    finally:
        node.close()


def test_a_disagreement_on_the_algorithm_fails_every_rank(monkeypatch: Any) -> None:
    """Rank 0's op is the pass's, rank 1's names an algorithm (Python's): both raise, in
    either order, and the name goes on."""
    node = Node(2, meeting=False)
    try:
        for first in (0, 1):
            name = f"algo{first}"
            hs: list[ThinHandle] = []
            for k in (first, 1 - first):
                c = node.clients[k]
                x = np.ones(3, np.int64)
                at, staged = c.place(x, fill=x)
                h = ThinHandle(c, name, 0, OpKind.ALLREDUCE, np.empty_like(x), lambda: None)
                h.hold((staged,), np.empty_like(x), staged)
                algo = int(AlgorithmCode.RING) if k == 1 else 0
                hs.append(c.submit(h, wire=hash(name) & ((1 << 62) - 1), dtype=DType.INT64,
                                   count=3, op=ReduceOp.SUM, root=0, priority=0, at_in=at,
                                   at_out=at, unnamed=False, algorithm=algo))  # fmt: skip
            for h in hs:
                with pytest.raises(OpMismatchError, match="ranks disagree"):
                    h.wait(30)
            again = [node.submit(k, OpKind.ALLREDUCE, name, np.ones(3, np.int64), gen=1)
                     for k in range(2)]  # fmt: skip
            assert all(np.array_equal(h.wait(30), np.full(3, 2)) for h in again)
    finally:
        node.close()


def test_a_rank_that_submits_twice_is_told(monkeypatch: Any) -> None:
    node = Node(2, meeting=False)
    try:
        first = node.submit(0, OpKind.ALLREDUCE, "twice", np.ones(2, np.int64))
        second = node.submit(0, OpKind.ALLREDUCE, "twice", np.ones(2, np.int64))
        with pytest.raises(InvalidArgumentError, match="submitted twice"):
            second.wait(30)
        other = node.submit(1, OpKind.ALLREDUCE, "twice", np.ones(2, np.int64))
        assert np.array_equal(first.wait(30), np.full(2, 2))
        assert np.array_equal(other.wait(30), np.full(2, 2))
    finally:
        node.close()


def test_more_ops_in_flight_than_the_table_holds() -> None:
    node = Node(2, meeting=False)
    try:
        n = P.CAP + 200
        hs = [node.submit(0, OpKind.ALLREDUCE, f"m{i}", np.full(2, i, np.int64)) for i in range(n)]
        hs += [node.submit(1, OpKind.ALLREDUCE, f"m{i}", np.full(2, 1, np.int64)) for i in range(n)]
        for i, h in enumerate(hs):
            assert np.array_equal(h.wait(30), np.full(2, i % n + 1)), i
    finally:
        node.close()


# ---------------------------------------------------------------- two nodes, a fake engine


class FakeHandle:
    """An op among the services, ended by the test (from its own thread)."""

    def __init__(self, kind: str, name: int, generation: int, buf: Any) -> None:
        self.kind, self.name, self.generation, self.buf = kind, name, generation, buf
        self._error: BaseException | None = None
        self._done = False
        self._then: list[Any] = []
        self.lock = threading.Lock()

    def add_done_callback(self, fn: Any) -> None:
        with self.lock:
            if not self._done:
                self._then.append(fn)
                return
        fn(self)

    def end(self, error: BaseException | None = None) -> None:
        with self.lock:
            self._error, self._done = error, True
            then, self._then = self._then, []
        for fn in then:
            fn(self)

    def done(self) -> bool:
        return self._done

    def exception(self) -> BaseException | None:
        return self._error

    def drive(self, span: float, outer: bool = False) -> bool:
        time.sleep(min(span, 1e-4))
        return self._done


class FakeLoop:
    """The services' engine's loop: the node hooks its notices, and its lane's outer words."""

    def __init__(self) -> None:
        self.on_client_notice = None
        self.outer: tuple[int, int, int, int, int] | None = None
        self.told: list[tuple[str, int, int, int]] = []  # what the node told the others

    def tell_services(self, what: str, client: int, session: int = 0, agreed: int = 0) -> None:
        self.told.append((what, client, session, agreed))

    def watch_outer(self, at: int, stride: int, n: int, seen: int, flag: int) -> None:
        self.outer = (at, stride, n, seen, flag)


class FakeEngine:
    """The services' engine of node 0 of two: it records what the node starts."""

    def __init__(self) -> None:
        self.started: list[FakeHandle] = []
        self.aborted: list[tuple[Any, ...]] = []
        self.gens: dict[int, int] = {}
        self.fail_next = False
        #: its loop, where the node hooks what other services tell of their clients
        self.loop = FakeLoop()

    def _handle(self, kind: str, name: int, buf: Any) -> FakeHandle:
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("no engine today")
        gen = self.gens.get(name, 0)
        self.gens[name] = gen + 1
        h = FakeHandle(kind, name, gen, buf)
        self.started.append(h)
        return h

    def allreduce_async(self, buf: Any, name: int, **kw: Any) -> FakeHandle:
        assert kw["out"] is buf and kw["algorithm"] == "auto", kw
        return self._handle("allreduce", name, buf)

    def broadcast_async(self, buf: Any, root: int, name: int, **kw: Any) -> FakeHandle:
        return self._handle(f"broadcast from node {root}", name, buf)

    def barrier_async(self, name: int, **kw: Any) -> FakeHandle:
        return self._handle("barrier", name, None)

    def take_late_errors(self) -> list[BaseException]:
        return []

    def forget_name(self, name: Any, generation: Any = None) -> None:
        pass

    def abort(self, name: Any, generation: int, reason: str, mismatch: bool = False) -> None:
        self.aborted.append((name, generation, reason))
        for h in self.started:
            if h.name == name and h.generation == generation and not h.done():
                h.end(OpFailedError(f"op {name} generation {generation}: {reason}"))

    def abort_next(self, name: Any, reason: str, mismatch: bool = False) -> int:
        self.aborted.append((name, None, reason))
        return 0


def _two_nodes(monkeypatch: Any) -> tuple[Node, FakeEngine]:
    """Node 0 of two nodes of two slots, its services' engine a fake."""
    engine = FakeEngine()
    real = ThinService.__init__

    def init(self: ThinService, arena: Any, node: int, nodes: int, eng: Any, **kw: Any) -> None:
        real(self, arena, 0, 2, engine, **kw)

    monkeypatch.setattr(ThinService, "__init__", init)
    return Node(2, meeting=False), engine


def _wait_for(cond: Any) -> None:
    deadline = time.monotonic() + 10
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.001)


def test_on_two_nodes_the_pass_starts_the_op_and_hands_the_result_back(monkeypatch: Any) -> None:
    seen = _count_python_takes(monkeypatch)
    node, engine = _two_nodes(monkeypatch)
    try:
        for i in range(3):
            hs = [
                node.submit(k, OpKind.ALLREDUCE, "g", np.full(4, k + 1, np.int64),
                            op=ReduceOp.AVG, gen=i)
                for k in range(2)
            ]  # fmt: skip
            _wait_for(lambda n=i + 1: len(engine.started) == n)
            h = engine.started[i]
            assert h.kind == "allreduce" and h.generation == i
            assert h.buf.tolist() == [3] * 4  # this node's sum: 1 + 2
            h.buf += 10  # the other node's part
            threading.Thread(target=h.end).start()  # ends on another thread
            assert all(x.wait(30).tolist() == [3] * 4 for x in hs)  # 13 // 4
        assert seen[0] == 0  # Python took no descriptor
        bar = [node.submit(k, OpKind.BARRIER, "b", None) for k in range(2)]
        _wait_for(lambda: len(engine.started) == 4)
        engine.started[3].end()
        assert all(x.wait(30) is None for x in bar)
    finally:
        node.close()


def _word(addr: int) -> int:
    return ctypes.c_int64.from_address(addr).value


def test_on_two_nodes_the_rings_tails_and_the_kick_are_the_lanes_outer_words(
    monkeypatch: Any,
) -> None:
    """The arena thread's drive among the nodes ends when a client writes its ring or
    another thread leaves it work: the services' lane watches the sum of the rings'
    tails against the sum the last pass saw, and the kick flag (``Lane.watch_outer``)."""
    node, engine = _two_nodes(monkeypatch)
    try:
        assert engine.loop.outer is not None
        at, stride, n, seen, flag = engine.loop.outer
        svc, arena = node.service, node.arena
        assert n == 2 and stride == arena.slot_bytes
        for k in range(2):  # the words are the tails the clients write
            assert at + k * stride == arena.base + arena.slot_start(k) + 8 * A.C_TAIL
        tails = lambda: sum(_word(at + k * stride) for k in range(n))  # noqa: E731
        assert tails() == 0
        # Another thread's kick sets the flag (the arena thread, asleep on its eventfd,
        # is not woken here: it clears the flag when its sleep times out, within 0.5 s).
        _wait_for(lambda: svc.arena.header[A.H_SERVICE_SLEEPING] == 1)
        with monkeypatch.context() as quiet:
            quiet.setattr("totalreduce.daemon.thin.signal_eventfd", lambda fd: None)
            svc._kick()
            assert _word(flag) == 1
        _wait_for(lambda: _word(flag) == 0)
        hs = [node.submit(k, OpKind.ALLREDUCE, "w", np.ones(2, np.int64)) for k in range(2)]
        _wait_for(lambda: len(engine.started) == 1)
        assert tails() == 2
        _wait_for(lambda: _word(seen) == 2)  # the pass saw both
        engine.started[0].end()
        assert all(h.wait(30).tolist() == [2, 2] for h in hs)
    finally:
        node.close()


def test_on_two_nodes_a_failure_among_the_nodes_fails_every_local_rank(monkeypatch: Any) -> None:
    node, engine = _two_nodes(monkeypatch)
    try:
        hs = [node.submit(k, OpKind.ALLREDUCE, "f", np.ones(2, np.int64)) for k in range(2)]
        _wait_for(lambda: len(engine.started) == 1)
        engine.started[0].end(OpFailedError("op 1 generation 0: rank 1 died"))
        for h in hs:
            with pytest.raises(OpFailedError, match=r"node 1 \(ranks 2..3\) died"):
                h.wait(30)
        engine.fail_next = True  # the next cannot even start: every rank hears why
        hs = [node.submit(k, OpKind.ALLREDUCE, "f", np.ones(2, np.int64), gen=1) for k in range(2)]
        for h in hs:
            with pytest.raises(OpFailedError, match="could not start it: no engine today"):
                h.wait(30)
        assert engine.aborted and engine.aborted[-1][1] is None  # its next generation
    finally:
        node.close()


def test_on_two_nodes_a_death_on_the_node_fails_the_running_op(monkeypatch: Any) -> None:
    """A local client dies while the node's op runs among the nodes: Python takes the op
    over, the engine aborts it, and the other local client's handle fails naming it."""
    node, engine = _two_nodes(monkeypatch)
    try:
        hs = [node.submit(k, OpKind.ALLREDUCE, "d", np.ones(2, np.int64)) for k in range(2)]
        _wait_for(lambda: len(engine.started) == 1)
        node.service.detach(1, "died (killed)")
        with pytest.raises(OpFailedError, match="rank 1 died"):
            hs[0].wait(30)
        assert engine.aborted and engine.aborted[0][1] == 0
        assert node.service._fast.st[P.S_LIVE] == 0 and not node.service._fast_running
    finally:
        node.close()


def test_on_two_nodes_an_op_taken_over_still_ends_well(monkeypatch: Any) -> None:
    """A new session (an event) comes while the op runs: Python takes it over, and the
    engine's end hands the result back the Python way."""
    node, engine = _two_nodes(monkeypatch)
    try:
        hs = [node.submit(k, OpKind.ALLREDUCE, "s", np.full(3, 5, np.int64)) for k in range(2)]
        _wait_for(lambda: len(engine.started) == 1)
        node.service.new_session()
        _wait_for(lambda: any(o.handle is engine.started[0]
                              for o in list(node.service._running.values())))  # fmt: skip
        engine.started[0].buf += 1
        engine.started[0].end()
        assert all(h.wait(30).tolist() == [11] * 3 for h in hs)
        assert not node.service._running and not node.service._fast_running
    finally:
        node.close()

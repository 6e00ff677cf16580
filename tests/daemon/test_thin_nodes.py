"""The thin path across nodes without processes: ``N`` nodes' arena threads, each with ``L``
clients, and the engine among the services on an in-process world, for N, L = 1..4.

Client rank ``r`` is slot ``r % L`` of node ``r // L``.  Every kind the thin path runs
(allreduce, broadcast, barrier, reduce-scatter with balanced and given parts, all-gather
with uneven parts) over the world and over groups whose ranks are in any order across
the nodes, submitted in a different random order by every client, is exact in int64.
Two groups of one node that share a name run apart; ranks of a node that disagree on
an op's group or parts fail it, naming them.
"""

from __future__ import annotations

import os
import random
import socket
import threading
import time
from contextlib import ExitStack
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from conftest import local_services
from totalreduce.algorithms.codes import OpKind
from totalreduce.algorithms.schedule import balanced_parts
from totalreduce.daemon import arena_pass, thin_ops
from totalreduce.daemon.arena_pass import PIPE_MIN_BYTES
from totalreduce.daemon.thin import ThinService  # noqa: I001 (the node's side)
from totalreduce.dtypes import DType, ReduceOp
from totalreduce.errors import OpMismatchError
from totalreduce.group import Group
from totalreduce.protocol import AR_H_PASS_GROUP
from totalreduce.service.thin import ThinClient, ThinHandle
from totalreduce.transport import arena as A
from totalreduce.transport import meeting as M
from totalreduce.transport.arena import Arena
from totalreduce.transport.shm import new_eventfd


class Cluster:
    """``nodes`` nodes of ``slots`` clients; ``clients[r]`` is client rank ``r``."""

    def __init__(
        self, stack: ExitStack, nodes: int, slots: int, pipe_min_bytes: int = PIPE_MIN_BYTES
    ) -> None:
        engines = stack.enter_context(local_services(nodes)) if nodes > 1 else [None]
        self.engines = engines
        self.nodes, self.slots, self.size = nodes, slots, nodes * slots
        self.clients: list[ThinClient] = []
        self.services: list[ThinService] = []
        for n in range(nodes):
            arena = Arena.create(slots, 2 << 20)
            service = ThinService(arena, n, nodes, engines[n], pipe_min_bytes=pipe_min_bytes)
            self.services.append(service)
            stack.callback(arena.close)
            stack.callback(service.stop)
            for k in range(slots):
                efd = new_eventfd()
                service.attach(k, k + 1, os.dup(efd))
                mine, theirs = socket.socketpair()
                stack.callback(theirs.close)
                assert arena.fd is not None
                link = SimpleNamespace(
                    arena=Arena.attach(os.dup(arena.fd), arena.size),
                    welcome=SimpleNamespace(
                        local=k, rank=n * slots + k, size=self.size, pid=os.getpid()
                    ),
                    where="test",
                    eventfd=efd,
                    service_eventfd=os.dup(service.eventfd),
                    sock=mine,
                )
                client = ThinClient(link)
                stack.callback(client.close)
                self.clients.append(client)

    def submit(
        self, r: int, kind: OpKind, name: str, x: np.ndarray | None, *,
        op: ReduceOp = ReduceOp.SUM, root: int = 0, prio: int = 0, group: Group | None = None,
        parts: tuple[int, ...] | None = None, gen: int = 0, passive: bool = False,
    ) -> ThinHandle:  # fmt: skip
        """What ``_thin_op`` writes, for client rank ``r`` (generation ``gen`` of ``name``)."""
        c = self.clients[r]
        blocks: list[int] = []
        at_group, ctx, aux = -1, 0, -1
        if group is not None:
            at_group, own = c.const_block((group.size, *group.ranks))
            ctx = group.context
        if x is None:
            at_in = at_out = -1
            out, dt, count, back = None, DType.INT64, 0, -1
        else:
            dt, count = DType.of(x.dtype), x.size
            at_in, staged = c.place(x, fill=x)
            blocks.append(staged)
            if parts is None:
                out, at_out, back = np.empty_like(x), at_in, at_in
            else:
                aux, _ = c.const_block((len(parts), *parts))
                me = (group or Group.world(self.size)).rank_of(r)
                assert me is not None
                if kind is OpKind.REDUCE_SCATTER:
                    n_out = parts[me]
                elif kind is OpKind.ALLTOALL:
                    n_out = sum(parts[len(parts) // 2 :])
                else:
                    n_out = sum(parts)
                out = np.empty(n_out, dtype=x.dtype)
                at_out, staged = c.place(out, fill=None)
                blocks.append(staged)
                back = at_out
        h = ThinHandle(c, name, gen, kind, out, lambda: None)
        h.hold(tuple(blocks), out, back)
        wire = hash(name) & ((1 << 62) - 1)
        return c.submit(
            h, wire=wire, dtype=dt, count=count, op=op, root=root, priority=prio, at_in=at_in,
            at_out=at_out, unnamed=False, group=at_group, context=ctx, aux=aux, passive=passive,
        )  # fmt: skip


def data(r: int, i: int, n: int) -> np.ndarray:
    return (np.arange(n, dtype=np.int64) * (i + 3) + 1000 * r - 7 * i) % 101 - 50


def plan(size: int, seed: int) -> list[dict[str, Any]]:
    """The ops every rank runs: each kind over the world and over a shuffled group."""
    rng = random.Random(seed)
    world = list(range(size))
    ops: list[dict[str, Any]] = []
    for i in range(16):
        ranks = world if i % 2 == 0 else rng.sample(world, rng.randint(1, size))
        kind = ["ar", "bc", "bar", "rs", "rsc", "ag", "ar", "a2a"][i // 2]
        g = Group(ranks)
        n = rng.randint(0, 23)
        spec: dict[str, Any] = {"name": f"op{i}", "kind": kind, "ranks": ranks, "n": n, "i": i}
        if kind == "ar":
            spec["op"] = rng.choice([ReduceOp.SUM, ReduceOp.MAX, ReduceOp.AVG, ReduceOp.MIN])
        elif kind == "bc":
            spec["root"] = rng.randrange(g.size)
        elif kind == "rs":
            spec["parts"] = tuple(c for _, c in balanced_parts(n, g.size))
        elif kind == "rsc":  # given, uneven parts
            cuts = sorted(rng.randint(0, n) for _ in range(g.size - 1))
            spec["parts"] = tuple(b - a for a, b in zip([0, *cuts], [*cuts, n], strict=True))
        elif kind == "ag":
            spec["parts"] = tuple(rng.randint(0, 9) for _ in range(g.size))
        elif kind == "a2a":  # elements group rank a sends group rank b
            spec["M"] = [[rng.randint(0, 5) for _ in range(g.size)] for _ in range(g.size)]
        spec["group"] = None if ranks == world else g
        spec["prio"] = rng.randrange(4)
        ops.append(spec)
    return ops


def run(cl: Cluster, r: int, ops: list[dict[str, Any]]) -> dict[str, Any]:
    rng = random.Random(100 + r)
    mine = [s for s in ops if r in s["ranks"]]
    rng.shuffle(mine)
    hs = {}
    for s in mine:
        g = Group(s["ranks"])
        me = g.rank_of(r)
        kind, name, grp = s["kind"], s["name"], s["group"]
        kw = {"group": grp, "prio": s["prio"]}
        if kind == "ar":
            x = data(r, s["i"], s["n"])
            hs[name] = cl.submit(r, OpKind.ALLREDUCE, name, x, op=s["op"], **kw)
        elif kind == "bc":
            x = data(r, s["i"], s["n"])
            hs[name] = cl.submit(r, OpKind.BROADCAST, name, x, root=s["root"], **kw)
        elif kind == "bar":
            hs[name] = cl.submit(r, OpKind.BARRIER, name, None, **kw)
        elif kind in ("rs", "rsc"):
            x = data(r, s["i"], s["n"])
            hs[name] = cl.submit(
                r, OpKind.REDUCE_SCATTER, name, x, op=ReduceOp.SUM, parts=s["parts"], **kw
            )
        elif kind == "a2a":
            m = s["M"]
            x = data(r, s["i"], sum(m[me]))
            parts = (*m[me], *(row[me] for row in m))
            hs[name] = cl.submit(r, OpKind.ALLTOALL, name, x, parts=parts, **kw)
        else:
            x = data(r, s["i"], s["parts"][me])
            hs[name] = cl.submit(r, OpKind.ALLGATHER, name, x, parts=s["parts"], **kw)
    return {name: h.wait(60) for name, h in hs.items()}


def want(s: dict[str, Any], r: int) -> Any:
    ranks = s["ranks"]
    me = ranks.index(r)
    kind = s["kind"]
    if kind == "bar":
        return None
    if kind == "ag":
        return np.concatenate([data(q, s["i"], s["parts"][j]) for j, q in enumerate(ranks)])
    if kind == "a2a":
        m = s["M"]
        got = []
        for a, q in enumerate(ranks):
            at = sum(m[a][:me])
            got.append(data(q, s["i"], sum(m[a]))[at : at + m[a][me]])
        return np.concatenate(got)
    stack = np.stack([data(q, s["i"], s["n"]) for q in ranks])
    if kind == "bc":
        return stack[s["root"]]
    if kind in ("rs", "rsc"):
        at = sum(s["parts"][:me])
        return stack.sum(0)[at : at + s["parts"][me]]
    op = s["op"]
    if op is ReduceOp.AVG:
        return stack.sum(0) // len(ranks)
    return {ReduceOp.SUM: stack.sum(0), ReduceOp.MAX: stack.max(0), ReduceOp.MIN: stack.min(0)}[op]


@pytest.mark.parametrize("slots", [1, 2, 3, 4], ids=lambda n: f"L{n}")
@pytest.mark.parametrize("nodes", [1, 2, 3, 4], ids=lambda n: f"N{n}")
def test_every_kind_over_world_and_groups_is_exact(nodes: int, slots: int) -> None:
    check_every_kind(nodes, slots, PIPE_MIN_BYTES, seed=nodes * 10 + slots)


@pytest.mark.parametrize(("nodes", "slots"), [(2, 2), (3, 2), (2, 3), (4, 4)])
def test_every_kind_with_segmented_ops_is_exact(
    nodes: int, slots: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same, with every allreduce and broadcast of 8 bytes or more among the nodes run
    in segments (each node's part made, and its result handed back, segment by segment)."""
    started: list[int] = []
    add = thin_ops._Segments.add

    def counted(self: Any, h: Any) -> None:
        started.append(1)
        add(self, h)

    monkeypatch.setattr(thin_ops._Segments, "add", counted)
    local, back = arena_pass.arena_local, arena_pass.arena_back
    made: list[int] = []
    monkeypatch.setattr(arena_pass, "arena_local", lambda *a: (made.append(1), local(*a)))
    monkeypatch.setattr(arena_pass, "arena_back", lambda *a: (made.append(2), back(*a)))
    check_every_kind(nodes, slots, 8, seed=nodes * 100 + slots)
    assert started  # segments ran: the compiled pass's, made and handed back one by one
    # the node's parts made segment by segment (their results are handed back by the
    # compiled pass itself where it runs the op, by arena_back where Python does)
    assert made.count(1) >= arena_pass.SEGMENTS, (made.count(1), made.count(2))


def check_every_kind(nodes: int, slots: int, pipe_min_bytes: int, seed: int) -> None:
    with ExitStack() as stack:
        cl = Cluster(stack, nodes, slots, pipe_min_bytes)
        ops = plan(cl.size, seed=seed)
        got: list[Any] = [None] * cl.size
        errors: list[BaseException] = []

        def rank(r: int) -> None:
            try:
                got[r] = run(cl, r, ops)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(cl.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        for r in range(cl.size):
            for s in ops:
                if r in s["ranks"]:
                    w, g = want(s, r), got[r][s["name"]]
                    if w is None:
                        assert g is None
                    else:
                        assert np.array_equal(g, w), (r, s)
        # answered ops keep no buffers (the service remembers them a while, by name)
        deadline = time.monotonic() + 10
        while any(o.node_buf is not None or o.ins or o.plan is not None
                  for svc in cl.services for o in svc._collected.values()):  # fmt: skip
            assert time.monotonic() < deadline, "answered ops still hold their buffers"
            time.sleep(0.01)


def test_two_groups_of_one_node_share_a_name() -> None:
    """Ranks 0 and 1 (node 0) each run ``x`` with a rank of node 1, in different groups."""
    with ExitStack() as stack:
        cl = Cluster(stack, 2, 2)
        pairs = [Group([0, 2]), Group([3, 1])]
        hs = {}
        for g in pairs:
            for r in g.ranks:
                hs[r] = cl.submit(r, OpKind.ALLREDUCE, "x", data(r, 0, 5), group=g)
        for g in pairs:
            for r in g.ranks:
                assert np.array_equal(
                    hs[r].wait(30), data(g.ranks[0], 0, 5) + data(g.ranks[1], 0, 5)
                )


def test_ranks_of_a_node_that_disagree_on_the_group_both_fail() -> None:
    with ExitStack() as stack:
        cl = Cluster(stack, 2, 2)
        h0 = cl.submit(0, OpKind.ALLREDUCE, "g", data(0, 0, 4), group=Group([0, 1]))
        h1 = cl.submit(1, OpKind.ALLREDUCE, "g", data(1, 0, 4), group=Group([1, 0, 2]))
        for h in (h0, h1):
            with pytest.raises(OpMismatchError, match=r"disagree on the group.*rank 0.*rank 1"):
                h.wait(30)
        # the name goes on
        hs = [cl.submit(r, OpKind.ALLREDUCE, "g2", data(r, 1, 4)) for r in range(4)]
        total = sum(data(r, 1, 4) for r in range(4))
        for h in hs:
            assert np.array_equal(h.wait(30), total)


def test_ranks_of_a_node_that_disagree_on_the_parts_fail_naming_them() -> None:
    with ExitStack() as stack:
        cl = Cluster(stack, 1, 2)
        h0 = cl.submit(0, OpKind.REDUCE_SCATTER, "rs", data(0, 0, 6), parts=(3, 3))
        h1 = cl.submit(1, OpKind.REDUCE_SCATTER, "rs", data(1, 0, 6), parts=(2, 4))
        for h in (h0, h1):
            with pytest.raises(OpMismatchError, match=r"parts \[3, 3\].*parts \[2, 4\]"):
                h.wait(30)


def test_garbage_groups_and_parts_fail_alone_saying_what() -> None:
    """Descriptors past the client's checks: a group or parts block outside the client's part
    of the arena, a group whose context does not match its ranks or that leaves the client
    out, parts that do not add up; each fails with InvalidArgumentError; the next op works."""
    from totalreduce.errors import InvalidArgumentError
    from totalreduce.transport import arena as A

    with ExitStack() as stack:
        cl = Cluster(stack, 1, 2)
        c = cl.clients[0]
        g_other, _ = c.const_block((1, 1))  # a group of rank 1 alone
        g_mine, _ = c.const_block((2, 0, 1))
        parts, _ = c.const_block((2, 3, 4))
        buf, _ = c.place(np.zeros(16, np.int64), fill=None)
        cases = {
            "outside": ({A.D_CTX: 5, A.D_GROUP: 0}, "outside its part of the arena"),
            "context": ({A.D_CTX: 5, A.D_GROUP: g_mine}, "context does not match"),
            "member": (
                {A.D_CTX: A.signed(Group([1]).context), A.D_GROUP: g_other},
                "rank 0 is not a member",
            ),
            "algorithm": ({A.D_ALGO: 99}, "algorithm 99 is not one for allreduce"),
            "parts": (
                {A.D_KIND: int(OpKind.REDUCE_SCATTER), A.D_AUX: parts, A.D_COUNT: 8},
                "do not sum to its count 8",
            ),
        }
        for what, (fields, words) in cases.items():
            h = ThinHandle(c, what, 0, OpKind.ALLREDUCE, None, lambda: None)
            d = np.zeros(A.D_WORDS, np.int64)
            d[A.D_KIND], d[A.D_DTYPE], d[A.D_COUNT] = int(OpKind.ALLREDUCE), int(DType.INT64), 4
            d[A.D_OP], d[A.D_IN], d[A.D_OUT], d[A.D_WIRE] = 1, buf, buf, hash(what) & 0xFFFF
            d[A.D_AUX] = d[A.D_GROUP] = -1
            for k, v in fields.items():
                d[k] = v
            c._ring(h, d, 0, int(d[A.D_IN]), int(d[A.D_OUT]))  # (the client's way in)
            with pytest.raises(InvalidArgumentError, match=words):
                h.wait(10)
        hs = [cl.submit(r, OpKind.ALLREDUCE, "after", data(r, 2, 3)) for r in range(2)]
        for h in hs:
            assert np.array_equal(h.wait(10), data(0, 2, 3) + data(1, 2, 3))


@pytest.mark.parametrize("nodes", [1, 2], ids=lambda n: f"N{n}")
def test_an_alltoall_whose_pairs_disagree_fails_on_every_rank(nodes: int) -> None:
    """Ranks 0 and 1 send rank 2 two elements each; rank 2 expects three from rank 0 and
    one from rank 1 (so the totals between the nodes agree): every rank of the op fails,
    naming a pair; the name goes on."""
    with ExitStack() as stack:
        cl = Cluster(stack, nodes, 4 // nodes)
        sends = [[1, 1, 2, 1], [1, 1, 2, 1], [1, 1, 1, 1], [1, 1, 1, 1]]
        expects = [row[:] for row in sends]  # expects[s][r]: what r expects from s
        expects[0][2], expects[1][2] = 3, 1
        hs = []
        for r in range(4):
            parts = (*sends[r], *(expects[s][r] for s in range(4)))
            hs.append(cl.submit(r, OpKind.ALLTOALL, "a2a", data(r, 0, sum(sends[r])), parts=parts))
        for h in hs:
            with pytest.raises(OpMismatchError, match=r"rank [01] sends rank 2 2 elements"):
                h.wait(30)
        ones = (1, 1, 1, 1, 1, 1, 1, 1)
        hs = [cl.submit(r, OpKind.ALLTOALL, "a2a", data(r, 1, 4), parts=ones) for r in range(4)]
        for r, h in enumerate(hs):
            assert np.array_equal(h.wait(30), [data(q, 1, 4)[r] for q in range(4)])


def test_an_alltoall_between_nodes_whose_dtypes_differ_fails_naming_them() -> None:
    """Bytes travel between the nodes: int64 against float64 (the same size) is still caught."""
    with ExitStack() as stack:
        cl = Cluster(stack, 2, 1)
        h0 = cl.submit(0, OpKind.ALLTOALL, "t", np.zeros(2, np.int64), parts=(1, 1, 1, 1))
        h1 = cl.submit(1, OpKind.ALLTOALL, "t", np.zeros(2, np.float64), parts=(1, 1, 1, 1))
        for h in (h0, h1):
            with pytest.raises(OpMismatchError, match=r"int64.*float64|float64.*int64"):
                h.wait(30)


@pytest.mark.parametrize("nodes", [1, 2], ids=lambda n: f"N{n}")
def test_a_client_that_dies_fails_only_the_ops_of_its_groups(nodes: int) -> None:
    """Rank 1 dies: ops of the world and of groups with it fail, naming it, on every node
    (later ones too); a group without it goes on."""
    from totalreduce.errors import OpFailedError

    with ExitStack() as stack:
        cl = Cluster(stack, nodes, 4 // nodes)
        world = [cl.submit(r, OpKind.ALLREDUCE, "w", data(r, 0, 3)) for r in (0, 2, 3)]
        g = Group([3, 1, 0])
        with_it = [cl.submit(r, OpKind.ALLREDUCE, "g", data(r, 0, 3), group=g) for r in (0, 3)]
        node, slot = divmod(1, 4 // nodes)
        cl.services[node].detach(slot, "died (it was killed)")
        if nodes > 1:  # as the node's socket side does: the other node hears it (GONE)
            cl.engines[node].loop.tell_services("died", 1)
        for h in world + with_it:
            with pytest.raises(OpFailedError, match="rank 1 died"):
                h.wait(30)
        pair = Group([2, 0])
        hs = [cl.submit(r, OpKind.ALLREDUCE, "p", data(r, 1, 3), group=pair) for r in (0, 2)]
        for h in hs:
            assert np.array_equal(h.wait(30), data(0, 1, 3) + data(2, 1, 3))
        # a later op with it, from a node where no other member will ever submit it: only
        # the death notice (GONE, through the services' engine) tells that node
        late = cl.submit(2, OpKind.ALLREDUCE, "late", data(2, 2, 3), group=Group([1, 2]))
        with pytest.raises(OpFailedError, match="rank 1"):
            late.wait(10)


def test_a_rank_whose_group_differs_after_the_others_completed_fails_them_late() -> None:
    """Ranks 0 and 1 run ``g`` over [0, 1] and complete; rank 2 then runs ``g`` over [0, 1, 2]:
    it fails at once, and ranks 0 and 1 raise at their next call (as in embedded mode)."""
    with ExitStack() as stack:
        cl = Cluster(stack, 1, 3)
        pair = Group([0, 1])
        hs = [cl.submit(r, OpKind.ALLREDUCE, "g", data(r, 0, 3), group=pair) for r in (0, 1)]
        for h in hs:
            h.wait(30)
        late = cl.submit(2, OpKind.ALLREDUCE, "g", data(2, 0, 3), group=Group([0, 1, 2]))
        with pytest.raises(
            OpMismatchError, match=r"disagree on the group.*rank 2: group \[0, 1, 2\]"
        ):
            late.wait(30)
        for r in (0, 1):
            with pytest.raises(
                OpMismatchError,
                match=r"allreduce 'g' generation 0 completed here, but failed elsewhere: the ranks",
            ):
                cl.clients[r].raise_late()
            cl.clients[r].raise_late()  # once


@pytest.mark.parametrize(
    ("nodes", "slots", "done", "other"),
    [(1, 2, (1,), None), (1, 3, (0, 1), (0, 1, 2)), (2, 2, (0, 2), None)],
    ids=["N1L2", "N1L3", "N2L2"],
)
def test_a_group_the_compiled_path_completed_fails_a_rank_with_another_group_late(
    nodes: int, slots: int, done: tuple[int, ...], other: tuple[int, ...] | None
) -> None:
    """The same as above once the group's repeats are the compiled loop's between nodes
    (on one node the meeting's, in the arena): Python never had the op that completed, yet
    the rank whose group differs fails at once (not a stall) naming the op, both groups and
    the ranks, and the ranks that completed it raise at their next call.  ``other``: the
    late rank's group (None: the world)."""
    with ExitStack() as stack:
        cl = Cluster(stack, nodes, slots)
        g = Group(list(done))
        arena = cl.services[0].arena
        header = arena.header
        # among the nodes the loop's; on one node the group's clients meet in the arena
        at = A.H_LOOP_ENTERED * 8 if nodes > 1 else int(header[A.H_MEET]) + M.M_RAN

        def counter() -> int:
            return int(arena.view(at, 1, np.dtype(np.int64))[0])

        gen = 0
        for gen in range(8):  # the first occurrences are Python's, the repeats compiled
            before = counter()
            hs = [cl.submit(r, OpKind.ALLREDUCE, "g", data(r, gen, 3), group=g, gen=gen)
                  for r in done]  # fmt: skip
            for h in hs:
                assert np.array_equal(h.wait(30), sum(data(r, gen, 3) for r in done))
            if counter() > before and gen >= 3:
                break
        assert counter() > before, "the group's op never took the compiled path"
        late_rank = next(r for r in range(slots) if r not in done)
        grp = Group(list(other)) if other is not None else None
        shown = list(other) if other is not None else list(range(cl.size))
        lates = [late_rank] + ([late_rank + slots] if nodes > 1 else [])
        hs = [cl.submit(r, OpKind.ALLREDUCE, "g", data(r, gen, 3), group=grp, gen=gen)
              for r in lates]  # fmt: skip
        for h, r in zip(hs, lates, strict=True):
            with pytest.raises(OpMismatchError) as info:
                h.wait(30)
            text = str(info.value)
            assert f"'g' generation {gen}" in text, text
            assert "disagree on the group" in text, text
            assert f"group {list(done)}" in text and f"group {shown}" in text, text
            assert f"rank {r}: group {shown}" in text, text
        for r in done:
            with pytest.raises(
                OpMismatchError,
                match=rf"allreduce 'g' generation {gen} completed here, but failed elsewhere: "
                r"the ranks disagree on the group",
            ):
                cl.clients[r].raise_late()
            cl.clients[r].raise_late()  # once


def _parted_repeats(
    cl: Cluster, ranks: list[int], kind: OpKind, parts: tuple[int, ...], op: ReduceOp,
    dtype: Any, repeats: int,
) -> None:  # fmt: skip
    """``repeats`` generations of one reduce-scatter or all-gather over ``ranks`` (the world
    when they are all, in order), each exact against numpy."""
    world = ranks == list(range(cl.size))
    grp = None if world else Group(ranks)
    name = f"{kind.name.lower()}-{op.name.lower()}-{np.dtype(dtype).name}-{ranks}"
    n = sum(parts)
    for gen in range(repeats):
        hs = {}
        for me, r in enumerate(ranks):
            x = data(r, gen, n if kind is OpKind.REDUCE_SCATTER else parts[me]).astype(dtype)
            hs[r] = cl.submit(r, kind, name, x, op=op, group=grp, parts=parts, gen=gen)
        for me, r in enumerate(ranks):
            got = hs[r].wait(30)
            if kind is OpKind.ALLGATHER:
                want = np.concatenate([data(q, gen, parts[j]) for j, q in enumerate(ranks)])
            else:
                total = sum(data(q, gen, n) for q in ranks)
                if op is ReduceOp.AVG:
                    total = total // len(ranks)
                at = sum(parts[:me])
                want = total[at : at + parts[me]]
            assert got.dtype == np.dtype(dtype), (r, gen)
            assert np.array_equal(got, want.astype(dtype)), (name, r, gen, got, want)


@pytest.mark.parametrize(
    ("nodes", "slots", "ranks"),
    [(1, 3, [0, 1, 2]), (1, 3, [2, 0]), (2, 2, [1, 0]), (2, 2, [3, 0, 2, 1])],
    ids=["N1L3-world", "N1L3-group", "N2L2-one-node-group", "N2L2-interleaved"],
)
def test_reduce_scatters_and_all_gathers_of_one_node_or_interleaved_are_compiled(
    nodes: int, slots: int, ranks: list[int]
) -> None:
    """A reduce-scatter's and an all-gather's repeats (uneven parts; sum and avg; int64 and
    float32) over the world of a one-node service, a group that lies on one node, and a group
    whose order interleaves two nodes run in the compiled pass (the first two: Python never
    sees their repeats, a group's counted in ``AR_H_PASS_GROUP``) and loop (the last:
    ``H_LOOP_ENTERED``), exact against numpy."""
    with ExitStack() as stack:
        cl = Cluster(stack, nodes, slots)
        svc = cl.services[0]
        header = svc.arena.header
        among = len({r // slots for r in ranks}) > 1
        counter = A.H_LOOP_ENTERED if among else AR_H_PASS_GROUP
        before = int(header[counter])
        g = len(ranks)
        uneven = tuple(range(1, g + 1))  # (1, 2, ..)
        cases = [
            (OpKind.REDUCE_SCATTER, uneven, ReduceOp.SUM, np.int64),
            (OpKind.REDUCE_SCATTER, (3,) * g, ReduceOp.AVG, np.int64),
            (OpKind.ALLGATHER, uneven[::-1], ReduceOp.SUM, np.int64),
            (OpKind.REDUCE_SCATTER, uneven, ReduceOp.SUM, np.float32),
            (OpKind.ALLGATHER, (2, 0, 5, 1)[:g], ReduceOp.SUM, np.float32),
        ]
        repeats = 12 if among else 8
        each = []
        for kind, parts, op, dtype in cases:
            at = int(header[counter])
            _parted_repeats(cl, ranks, kind, parts, op, dtype, repeats)
            each.append(int(header[counter]) - at)
        ran = int(header[counter]) - before
        if ranks == list(range(cl.size)):  # the world's: the pass's from the first
            wires = {
                hash(f"{k.name.lower()}-{o.name.lower()}-{np.dtype(t).name}-{ranks}")
                & ((1 << 62) - 1) for k, _, o, t in cases
            }  # fmt: skip
            assert not [key for key in svc._collected if key[0] in wires], "Python ran some"
        elif among:  # Python starts the first few among the nodes (4-5 here, as for a
            # group whose ranks lie node after node; more on a loaded machine), the loop the
            # rest: every kind some
            assert min(each) >= 2 and ran >= len(cases) * (repeats - 8), each
        else:  # Python gives the group its row at its first op (a loaded machine: a few)
            assert ran >= len(cases) * (repeats - 1), ran


@pytest.mark.parametrize("ranks", [[1, 0, 3, 2], [3, 0, 2, 1]], ids=["ident", "interleaved"])
def test_a_groups_segmented_ops_are_the_passs_with_python_starting_the_segments(
    ranks: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A group's allreduce and broadcast of the segment threshold or more, on two nodes of two:
    after the group's first op (Python gives it its row) the pass takes them and Python only
    starts their segments among the nodes (``_fast_start``; its node's part made and handed
    back segment by segment in compiled code), never from their descriptors (``_start``);
    exact, avg divided once."""
    starts: list[int] = []
    whole: list[int] = []
    fast_start, start = ThinService._fast_start, ThinService._start

    def counted_fast(self: ThinService, e: int) -> None:
        starts.append(int(self._fast.descs[e, 0, A.D_CTX]))
        fast_start(self, e)

    def counted(self: ThinService, op: Any) -> None:
        whole.append(op.key[2])
        start(self, op)

    monkeypatch.setattr(ThinService, "_fast_start", counted_fast)
    monkeypatch.setattr(ThinService, "_start", counted)
    with ExitStack() as stack:
        cl = Cluster(stack, 2, 2, pipe_min_bytes=64)
        g = Group(ranks)
        n = 37  # 296 bytes: 8 segments
        for gen in range(5):
            hs = {r: cl.submit(r, OpKind.ALLREDUCE, "s", data(r, gen, n), op=ReduceOp.AVG,
                               group=g, gen=gen) for r in ranks}  # fmt: skip
            total = sum(data(r, gen, n) for r in ranks) // len(ranks)
            for r in ranks:
                assert np.array_equal(hs[r].wait(30), total), (r, gen)
            root = gen % len(ranks)
            hs = {r: cl.submit(r, OpKind.BROADCAST, "b", data(r, gen, n), root=root, group=g,
                               gen=gen) for r in ranks}  # fmt: skip
            for r in ranks:
                assert np.array_equal(hs[r].wait(30), data(ranks[root], gen, n)), (r, gen)
        ctx = A.signed(g.context)
        assert starts.count(ctx) >= 2 * (2 * 5 - 1), (starts, whole)  # both nodes', each
        assert whole.count(ctx) <= 2, whole  # (the first op of the group, on each node)


def message(cl: Cluster, r: int, src: int, dst: int, name: str, gen: int, n: int) -> ThinHandle:
    """Rank ``r``'s side of a message of ``n`` int64 from ``src`` to ``dst`` (a two-rank
    all-to-all, as ``_point`` writes it); the receiver's is a standing receive."""
    g = Group(sorted((src, dst)))
    me, s = g.rank_of(r), g.rank_of(src)
    if r == src:
        x = np.arange(n, dtype=np.int64) + 1000 * gen
        sends = tuple(n if j != s else 0 for j in range(2))
        parts = (*sends, 0, 0)
    else:
        x = np.zeros(0, np.int64)
        parts = (0, 0, *(n if j == s else 0 for j in range(2)))
    assert me is not None
    return cl.submit(
        r, OpKind.ALLTOALL, name, x, group=g, parts=parts, gen=gen, passive=r == dst
    )  # fmt: skip


@pytest.mark.parametrize("nodes", [1, 2], ids=lambda n: f"N{n}")
def test_a_standing_receive_outlives_a_whole_ring_of_other_ops(nodes: int, caplog: Any) -> None:
    """A window's standing receive (F_PASSIVE) keeps its completion word while more ops than
    the ring holds come and go; the message then lands in it, and no stall is reported."""
    from totalreduce.transport import arena as A

    with ExitStack() as stack:
        cl = Cluster(stack, nodes, 2 // nodes)
        for svc in cl.services:
            svc.stall_warning_s = 0.05
        waiting = message(cl, 1, 0, 1, "win x 0->1", 0, 5)
        for i in range(A.RING - 1):
            hs = [cl.submit(r, OpKind.ALLREDUCE, f"step{i}", data(r, i, 3)) for r in range(2)]
            for h in hs:
                assert np.array_equal(h.wait(30), data(0, i, 3) + data(1, i, 3)), i
            assert not waiting.done()
        time.sleep(1.2)  # a stall look passes
        # rank 1's next op would have the standing receive's word, were it not skipped:
        # the message lands, then that op ends, and only then rank 1 looks
        late = cl.submit(1, OpKind.ALLREDUCE, "late", data(1, 0, 2))
        message(cl, 0, 0, 1, "win x 0->1", 0, 5).wait(30)
        cl.submit(0, OpKind.ALLREDUCE, "late", data(0, 0, 2)).wait(30)
        assert np.array_equal(late.wait(30), data(0, 0, 2) + data(1, 0, 2))
        assert np.array_equal(waiting.wait(5), np.arange(5))
        assert "has waited" not in caplog.text, caplog.text


def test_a_client_whose_ops_are_all_standing_receives_is_told_not_hung() -> None:
    """Standing receives that fill every completion word: the next op raises, naming them."""
    from totalreduce.errors import InvalidArgumentError
    from totalreduce.transport import arena as A

    with ExitStack() as stack:
        cl = Cluster(stack, 1, 2)
        standing = [message(cl, 1, 0, 1, "win y 0->1", k, 1) for k in range(A.RING - 1)]
        with pytest.raises(InvalidArgumentError, match="standing receives"):
            message(cl, 1, 0, 1, "win y 0->1", A.RING, 1)
        message(cl, 0, 0, 1, "win y 0->1", 0, 1).wait(30)  # one of them ends: room again
        standing[0].wait(30)  # (its word may be set a moment after the sender's)
        message(cl, 1, 0, 1, "win y 0->1", A.RING - 1, 1)
        assert len(cl.clients[1].in_flight()) == A.RING - 1


@pytest.mark.parametrize("counts", [(64, 8), (64, 96)], ids=["whole-on-node-1", "both-segmented"])
def test_nodes_that_disagree_on_a_segmented_ops_count_fail_it_everywhere(
    counts: tuple[int, int],
) -> None:
    """Node 0's clients give 64 elements (segmented), node 1's another count (run whole, or
    segmented otherwise): every rank fails with a mismatch, none hangs, and the next ops
    of the name (and of the segments' names) run on every rank."""
    with ExitStack() as stack:
        cl = Cluster(stack, 2, 2, pipe_min_bytes=256)  # 32 int64 elements or more
        hs = [cl.submit(r, OpKind.ALLREDUCE, "x", data(r, 0, counts[r // 2])) for r in range(4)]
        for r, h in enumerate(hs):  # each names its own node's op, and the cut
            with pytest.raises(OpMismatchError, match="the nodes disagree about it") as e:
                h.wait(30)
            assert f"node {r // 2} " in str(e.value) and f"count {counts[r // 2]} " in str(e.value)
            assert "into 8 parts" in str(e.value) or "cut its op into parts" in str(e.value)
        for gen in (1, 2, 3):
            n = [64, 8, 40][gen - 1]
            hs = [cl.submit(r, OpKind.ALLREDUCE, "x", data(r, gen, n), gen=gen) for r in range(4)]
            want = sum(data(r, gen, n) for r in range(4))
            for h in hs:
                assert np.array_equal(h.wait(30), want), gen


def test_a_client_that_dies_fails_a_segmented_op_on_every_node() -> None:
    """Rank 1 dies with a segmented allreduce in flight (its node's part made, rank 3 not
    in yet): it fails on every rank, naming it, and a later one without it runs."""
    from totalreduce.errors import OpFailedError

    with ExitStack() as stack:
        cl = Cluster(stack, 2, 2, pipe_min_bytes=256)
        hs = [cl.submit(r, OpKind.ALLREDUCE, "w", data(r, 0, 100)) for r in (0, 1, 2)]
        time.sleep(0.2)  # node 0 started it among the nodes; node 1 waits for rank 3
        cl.services[0].detach(1, "died (it was killed)")
        cl.engines[0].loop.tell_services("died", 1)
        for h in hs[:1] + hs[2:]:
            with pytest.raises(OpFailedError, match="rank 1"):
                h.wait(30)
        pair = Group([0, 2, 3])
        hs = [cl.submit(r, OpKind.ALLREDUCE, "p", data(r, 1, 90), group=pair) for r in (0, 2, 3)]
        for h in hs:
            assert np.array_equal(h.wait(30), data(0, 1, 90) + data(2, 1, 90) + data(3, 1, 90))


def test_python_takes_over_a_segmented_avg_mid_way_and_divides_each_part_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An event comes (Python's tables take the pass's ops) after the first segment of an
    avg allreduce went back to the clients, divided: the rest is made, divided and handed
    back by Python, and no element is divided twice."""
    from totalreduce.daemon import thin_fast

    backed = thin_fast.PassOps._fast_segment
    events: list[int] = []

    def back_then_event(self: Any, token: int, i: int) -> None:
        backed(self, token, i)
        if not events:  # the first segment is back: an event now (a rank joined)
            events.append(i)
            self._events.append(("joined", 99))

    monkeypatch.setattr(thin_fast.PassOps, "_fast_segment", back_then_event)
    with ExitStack() as stack:
        cl = Cluster(stack, 2, 2, pipe_min_bytes=256)
        n = 200
        hs = [
            cl.submit(r, OpKind.ALLREDUCE, "avg", data(r, 0, n) * 100, op=ReduceOp.AVG)
            for r in range(4)
        ]
        want = sum(data(r, 0, n) * 100 for r in range(4)) // 4
        for r, h in enumerate(hs):
            assert np.array_equal(h.wait(30), want), r
        assert events  # it happened mid-way

"""Hierarchical collectives over clients and per-node relays, proven by the simulator.

Every layout of 1..4 nodes x 1..4 clients per node runs all of its
``C + nodes`` engine ranks in the simulator: allreduce (sum, avg, max, min,
exact int64, in place or not, ring or recursive doubling among the relays,
Gloo's counts, several segment sizes so the phases overlap per segment),
broadcast from every client root, and the barrier, whose ordering is checked
as a happens-before relation across all ranks.
"""

from __future__ import annotations

import doctest
import itertools
from collections import deque
from collections.abc import Callable

import numpy as np
import pytest

import totalreduce.algorithms.hierarchical as hierarchical
from totalreduce.algorithms.codes import AlgorithmCode, OpKind
from totalreduce.algorithms.hierarchical import (
    CROSS_BROADCAST,
    NodeLayout,
    allreduce_hierarchical,
    barrier_hierarchical,
    broadcast_hierarchical,
    hierarchical_schedule,
)
from totalreduce.algorithms.registry import BROADCAST
from totalreduce.algorithms.schedule import Buffer, Region, Schedule, SegmentPlan, plan_segments
from totalreduce.algorithms.simulator import ScheduleError, simulate

LAYOUTS = [NodeLayout(n, k) for n, k in itertools.product(range(1, 5), range(1, 5))]
LAYOUT_IDS = [f"{lay.nodes}x{lay.local}" for lay in LAYOUTS]
CROSS = ["ring", "recursive_doubling"]
#: A segment of a few elements (many segments per chunk), one that cuts
#: regions unevenly, and one whole-region segment.
SEGMENTS = [3, 97, 1 << 30]


def counts(lay: NodeLayout) -> list[int]:
    """Gloo's counts: empty, one, fewer than the ranks, primes, a large one."""
    return sorted({0, 1, lay.nodes - 1, lay.clients - 1, lay.world + 1, 13, 97, 1000})


def client_inputs(lay: NodeLayout, n: int) -> list[np.ndarray]:
    """Position-dependent int64 inputs for the clients, empty ones for the relays."""
    index = np.arange(n, dtype=np.int64)
    xs = [index * lay.clients + r for r in range(lay.clients)]
    return xs + [np.zeros(0, dtype=np.int64)] * lay.nodes


def stale(lay: NodeLayout, n: int) -> list[np.ndarray]:
    """Output arrays full of garbage: every element must be written, none read first."""
    return [np.full(n, 10**12 + r, dtype=np.int64) for r in range(lay.world)]


def all_schedules(
    make: Callable[..., Schedule], lay: NodeLayout, *args: object, **kwargs: object
) -> list[Schedule]:
    return [make(r, lay, *args, **kwargs) for r in range(lay.world)]


# ---------------------------------------------------------------------------
# Layout


def test_layout_ranks() -> None:
    lay = NodeLayout(nodes=3, local=4)
    assert (lay.clients, lay.world) == (12, 15)
    assert [lay.node_of(r) for r in range(12)] == [0] * 4 + [1] * 4 + [2] * 4
    assert [lay.relay_of(n) for n in range(3)] == [12, 13, 14]
    assert [lay.node_of(lay.relay_of(n)) for n in range(3)] == [0, 1, 2]
    assert [lay.is_relay(r) for r in range(15)] == [False] * 12 + [True] * 3
    assert list(lay.clients_of(1)) == [4, 5, 6, 7]
    assert lay.clients_of(2)[1] == 2 * 4 + 1  # slot k of node n is rank n * local + k


@pytest.mark.parametrize("nodes, local", [(0, 1), (1, 0), (-1, 2), (2, True), (1.5, 2)])
def test_layout_rejects_bad_shapes(nodes: object, local: object) -> None:
    with pytest.raises(ValueError, match="NodeLayout"):
        NodeLayout(nodes, local)  # type: ignore[arg-type]


def test_layout_rejects_bad_ranks_and_nodes() -> None:
    lay = NodeLayout(2, 2)
    for bad in (-1, 6):
        with pytest.raises(ValueError, match="rank"):
            lay.node_of(bad)
        with pytest.raises(ValueError, match="rank"):
            allreduce_hierarchical(bad, lay, 10)
    for bad in (-1, 2):
        with pytest.raises(ValueError, match="node"):
            lay.relay_of(bad)
        with pytest.raises(ValueError, match="node"):
            lay.clients_of(bad)


# ---------------------------------------------------------------------------
# Allreduce


def check_allreduce_sum(lay: NodeLayout, cross: str, in_place: bool) -> None:
    for n, seg in itertools.product(counts(lay), SEGMENTS):
        want = np.arange(n, dtype=np.int64) * lay.clients**2 + lay.clients * (lay.clients - 1) // 2
        schedules = all_schedules(allreduce_hierarchical, lay, n, cross=cross)
        outs = simulate(
            schedules,
            client_inputs(lay, n),
            segment_elems=seg,
            in_place=in_place,
            seed=n + seg,
            outputs=stale(lay, n),
        )
        for r, out in enumerate(outs):
            np.testing.assert_array_equal(
                out, want, err_msg=f"{lay} cross={cross} n={n} seg={seg} rank={r}"
            )


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("cross", CROSS)
@pytest.mark.parametrize("lay", LAYOUTS, ids=LAYOUT_IDS)
def test_allreduce_sum_exact(lay: NodeLayout, cross: str, in_place: bool) -> None:
    check_allreduce_sum(lay, cross, in_place)


@pytest.mark.parametrize("cross", ["halving_doubling", "ring_chunked", "bcube"])
@pytest.mark.parametrize("lay", [NodeLayout(3, 2), NodeLayout(4, 3)], ids=["3x2", "4x3"])
def test_allreduce_other_cross_algorithms(lay: NodeLayout, cross: str) -> None:
    check_allreduce_sum(lay, cross, in_place=True)


@pytest.mark.parametrize("op", ["max", "min", "avg"])
@pytest.mark.parametrize("cross", CROSS)
@pytest.mark.parametrize("lay", LAYOUTS, ids=LAYOUT_IDS)
def test_allreduce_other_ops(lay: NodeLayout, cross: str, op: str) -> None:
    n = 301
    rng = np.random.default_rng(lay.world * 10 + lay.local)
    xs = [rng.integers(-1000, 1000, n).astype(np.int64) for _ in range(lay.clients)]
    stack = np.stack(xs)
    total = {"max": stack.max(axis=0), "min": stack.min(axis=0), "avg": stack.sum(axis=0)}[op]
    schedules = all_schedules(allreduce_hierarchical, lay, n, average=op == "avg", cross=cross)
    inputs = xs + [np.zeros(0, dtype=np.int64)] * lay.nodes
    for in_place, seg in [(False, 7), (True, 64)]:
        outs = simulate(
            schedules,
            inputs,
            op=op,
            segment_elems=seg,
            in_place=in_place,
            seed=seg,
            outputs=stale(lay, n),
        )
        for r, out in enumerate(outs):
            # Clients divide by C (floor on integers); a relay keeps the plain sum.
            want = total // lay.clients if op == "avg" and r < lay.clients else total
            np.testing.assert_array_equal(out, want, err_msg=f"{lay} {op} rank={r}")


@pytest.mark.parametrize("cross", CROSS)
@pytest.mark.parametrize("lay", LAYOUTS, ids=LAYOUT_IDS)
def test_allreduce_steps_are_numbered_across_phases(lay: NodeLayout, cross: str) -> None:
    n = 100
    schedules = all_schedules(allreduce_hierarchical, lay, n, cross=cross)
    total = len(schedules[0].steps)
    for r, s in enumerate(schedules):
        s.validate()
        assert len(s.steps) == total
        assert len(s.unexpected) == total
        assert s.size == lay.world
        node = lay.node_of(r)
        relay = lay.relay_of(node)
        if lay.is_relay(r):
            assert (s.count, s.out_count) == (0, n)
            # Phase 1 (step 0): one COPY, then REDUCEs, all in one step.
            assert [x.peer for x in s.steps[0].recvs] == list(lay.clients_of(node))
            assert [x.action.name for x in s.steps[0].recvs] == ["COPY"] + ["REDUCE"] * (
                lay.local - 1
            )
            assert not s.steps[0].sends
            # Phase 2 talks to relays only; phase 3 (last step) sends to the clients.
            for st in s.steps[1:-1]:
                peers = [x.peer for x in st.sends] + [x.peer for x in st.recvs]
                assert all(lay.is_relay(p) for p in peers)
            assert [x.peer for x in s.steps[-1].sends] == list(lay.clients_of(node))
            assert not s.steps[-1].recvs
            assert not s.prologue and not s.epilogue
        else:
            assert (s.count, s.out_count) == (n, n)
            assert s.steps[0].sends[0].peer == relay
            assert s.steps[0].sends[0].region.buffer is Buffer.INPUT
            assert s.steps[-1].recvs[0].peer == relay
            assert all(not st.sends and not st.recvs for st in s.steps[1:-1])
            assert s.bytes_sent(8) == 8 * n
    # A send at step s on one rank is received at step s on its peer.
    for r, s in enumerate(schedules):
        for j, st in enumerate(s.steps):
            for x in st.sends:
                peer = schedules[x.peer].steps[j]
                assert [y.region.count for y in peer.recvs if y.peer == r] == [x.region.count]


def overlap(a: Region, b: Region) -> bool:
    return a.buffer is b.buffer and a.offset < b.end and b.offset < a.end


def predecessors(plan: SegmentPlan, send: int) -> set[int]:
    """Receive segments a send segment transitively waits for, on its own rank."""
    before: dict[int, list[int]] = {}
    for q, whom in enumerate(plan.after_recv):
        for is_send, idx in whom:
            before.setdefault(~idx if is_send else idx, []).append(q)
    found: set[int] = set()
    todo = list(before.get(~send, []))
    while todo:
        q = todo.pop()
        if q not in found:
            found.add(q)
            todo.extend(before.get(q, []))
    return found


@pytest.mark.parametrize("cross", CROSS)
@pytest.mark.parametrize("lay", [NodeLayout(2, 3), NodeLayout(4, 2), NodeLayout(3, 4)])
def test_allreduce_phases_overlap_per_segment(lay: NodeLayout, cross: str) -> None:
    # Phase 2 segment k waits for phase 1's segment k only, and phase 3's first
    # segment does not wait for the last segments of phase 1: no phase waits
    # for the whole buffer of the one before.
    n, seg = 1200, 50
    for node in range(lay.nodes):
        s = allreduce_hierarchical(lay.relay_of(node), lay, n, cross=cross)
        last = len(s.steps) - 1
        plan = plan_segments(s, seg)
        gathered = {q: x for q, x in enumerate(plan.recvs) if x.step == 0}
        assert len(gathered) == lay.local * n // seg
        tail = {q for q, g in gathered.items() if g.region.offset >= n - seg}
        checked = 0
        for i, x in enumerate(plan.sends):
            deps = predecessors(plan, i) & set(gathered)
            if x.step == 1:
                # The first cross-node sends go as soon as their own elements are in.
                assert deps == {q for q, g in gathered.items() if overlap(g.region, x.region)}, x
                checked += 1
            if x.step == last and x.region.offset == 0:
                # The result's first segment goes back before the last contributions land.
                assert deps and not deps & tail, x
                checked += 1
        assert checked >= lay.local  # the last step's first segments, one per client


# ---------------------------------------------------------------------------
# Broadcast


BROADCAST_CROSS = [("one_to_all", None), ("pipelined", None), ("pipelined", 3)]


@pytest.mark.parametrize("cross, chunks", BROADCAST_CROSS)
@pytest.mark.parametrize("lay", LAYOUTS, ids=LAYOUT_IDS)
def test_broadcast_from_every_root(lay: NodeLayout, cross: str, chunks: int | None) -> None:
    for root, n in itertools.product(range(lay.clients), [0, 1, 7, 97, 1000]):
        # Clients other than the root hold stale data that must be overwritten.
        xs = [
            np.arange(n, dtype=np.int64) * 3 + 1 if r == root else np.full(n, -r - 1)
            for r in range(lay.clients)
        ] + [np.zeros(0, dtype=np.int64)] * lay.nodes
        schedules = all_schedules(
            broadcast_hierarchical, lay, n, root=root, cross=cross, chunks=chunks
        )
        total = len(schedules[0].steps)
        assert all(len(s.steps) == len(s.unexpected) == total for s in schedules)
        for in_place, seg in [(False, 1 << 30), (True, 16)]:
            outs = simulate(
                schedules,
                xs,
                segment_elems=seg,
                in_place=in_place,
                seed=root * 13 + n,
                outputs=stale(lay, n),
            )
            for r, out in enumerate(outs):
                np.testing.assert_array_equal(
                    out, xs[root], err_msg=f"{lay} {cross} root={root} n={n} rank={r}"
                )


def test_broadcast_traffic() -> None:
    lay, n, root = NodeLayout(3, 2), 100, 3
    schedules = all_schedules(broadcast_hierarchical, lay, n, root=root)
    # Data only: the cross-node broadcast's confirmation tokens live in WORK.
    sent = [
        sum(x.region.count for st in s.steps for x in st.sends if x.region.buffer is Buffer.OUTPUT)
        for s in schedules
    ]
    # The root sends once to its relay, the other clients nothing; the root's
    # relay sends to the 2 other relays and to its 1 other client, the others
    # to their 2 clients.
    assert sent == [0, 0, 0, n, 0, 0, 2 * n, 3 * n, 2 * n]
    home = schedules[lay.relay_of(1)]
    assert [x.peer for x in home.steps[0].recvs] == [root]
    assert [x.peer for x in home.steps[-1].sends] == [2]


def test_broadcast_cross_names_are_the_registry_ones() -> None:
    assert tuple(CROSS_BROADCAST) == BROADCAST


def test_broadcast_rejects_bad_roots_and_cross() -> None:
    lay = NodeLayout(2, 2)
    for root in (-1, 4, 5):  # 4 and 5 are relays
        with pytest.raises(ValueError, match="client"):
            broadcast_hierarchical(0, lay, 10, root=root)
    with pytest.raises(ValueError, match="cross-node broadcast"):
        broadcast_hierarchical(0, lay, 10, root=0, cross="ring")


# ---------------------------------------------------------------------------
# Barrier


Node = tuple[int, bool, int]  # (rank, is a send, segment index)


def happens_before(schedules: list[Schedule]) -> tuple[list[SegmentPlan], dict[Node, list[Node]]]:
    """All ranks' plans and their happens-before edges, sends linked to the receives they fill."""
    plans = [plan_segments(s, 1) for s in schedules]
    edges: dict[Node, list[Node]] = {}
    for r, plan in enumerate(plans):
        for i, x in enumerate(plan.sends):
            out = [(r, is_send, idx) for is_send, idx in plan.after_send[i]]
            out.append((x.peer, False, plans[x.peer].recv_index[(x.step, r, x.segment)]))
            edges[(r, True, i)] = out
        for q in range(len(plan.recvs)):
            edges[(r, False, q)] = [(r, is_send, idx) for is_send, idx in plan.after_recv[q]]
    return plans, edges


def reachable(edges: dict[Node, list[Node]], start: Node) -> set[Node]:
    seen = {start}
    todo = deque([start])
    while todo:
        for nxt in edges[todo.popleft()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


@pytest.mark.parametrize("lay", LAYOUTS, ids=LAYOUT_IDS)
def test_barrier_releases_no_client_before_all_arrive(lay: NodeLayout) -> None:
    schedules = all_schedules(barrier_hierarchical, lay)
    for seed in range(3):
        outs = simulate(schedules, [np.zeros(0, dtype=np.uint8)] * lay.world, seed=seed)
        assert all(out.size == 0 for out in outs)
    for s in schedules:
        assert (s.count, s.out_count, len(s.steps), len(s.unexpected)) == (0, 0, 3, 3)
    plans, edges = happens_before(schedules)
    # A client leaves when its release (its only receive) is applied; it
    # arrives with its step-0 send.  Every arrival must precede every release.
    releases = set()
    for c in range(lay.clients):
        (q,) = [q for q, x in enumerate(plans[c].recvs) if x.step == 2]
        releases.add((c, False, q))
    for c in range(lay.clients):
        (i,) = [i for i, x in enumerate(plans[c].sends) if x.step == 0]
        missed = releases - reachable(edges, (c, True, i))
        assert not missed, f"{lay}: client {c}'s arrival does not precede releases {missed}"


# ---------------------------------------------------------------------------
# Dispatcher, codes, simulator extension, docs


def test_dispatcher_matches_the_algorithms() -> None:
    lay = NodeLayout(3, 2)
    for r in range(lay.world):
        assert hierarchical_schedule(
            OpKind.ALLREDUCE, r, lay, 50, op_average=True, cross="recursive_doubling"
        ) == allreduce_hierarchical(r, lay, 50, average=True, cross="recursive_doubling")
        assert hierarchical_schedule(int(OpKind.BROADCAST), r, lay, 50, root=4) == (  # type: ignore[arg-type]
            broadcast_hierarchical(r, lay, 50, root=4)
        )
        assert hierarchical_schedule(
            OpKind.BROADCAST, r, lay, 50, root=4, broadcast_cross="pipelined"
        ) == broadcast_hierarchical(r, lay, 50, root=4, cross="pipelined")
        assert hierarchical_schedule(OpKind.BARRIER, r, lay, 0) == barrier_hierarchical(r, lay)


def test_dispatcher_rejects_what_has_no_hierarchical_form() -> None:
    lay = NodeLayout(2, 2)
    for kind in (OpKind.REDUCE_SCATTER, OpKind.ALLGATHER, OpKind.NEIGHBOR_ALLREDUCE):
        with pytest.raises(ValueError, match=kind.name):
            hierarchical_schedule(kind, 0, lay, 10)
    with pytest.raises(ValueError, match="barrier"):
        hierarchical_schedule(OpKind.BARRIER, 0, lay, 10)
    with pytest.raises(ValueError, match="cross-node allreduce"):
        hierarchical_schedule(OpKind.ALLREDUCE, 0, lay, 10, cross="tree")
    with pytest.raises(ValueError, match="count"):
        allreduce_hierarchical(0, lay, -1)


def test_algorithm_code() -> None:
    assert AlgorithmCode.HIERARCHICAL == 13
    assert len({int(a) for a in AlgorithmCode}) == len(AlgorithmCode)


def test_simulator_checks_input_lengths() -> None:
    # A relay has no input: the simulator takes an empty one and refuses any other.
    lay, n = NodeLayout(2, 2), 10
    schedules = all_schedules(allreduce_hierarchical, lay, n)
    xs = client_inputs(lay, n)
    simulate(schedules, xs)
    with pytest.raises(ScheduleError, match="rank 4: input of 10 elements"):
        simulate(schedules, xs[:4] + [np.zeros(n, dtype=np.int64)] * 2)
    with pytest.raises(ScheduleError, match="rank 0: input of 9 elements"):
        simulate(schedules, [xs[0][:9]] + xs[1:])


def test_unexpected_hints_name_the_phase() -> None:
    s = allreduce_hierarchical(0, NodeLayout(2, 2), 10)
    assert "node-local frame" in s.unexpected[0].format(sender=1, me=0)
    assert "cross-node" in s.unexpected[1].format(sender=5, me=0)
    assert "node-local result" in s.unexpected[-1].format(sender=5, me=0)


def test_docstring_examples() -> None:
    result = doctest.testmod(hierarchical)
    assert result.attempted > 0 and result.failed == 0

"""Groups of one node's clients at its meeting place on services of several nodes, without
processes (test_thin_nodes.py's ``Cluster``: two nodes of two clients and the engine
among the services in-process; client rank ``r`` is slot ``r % 2`` of node ``r // 2``).

A group whose ranks all live on one node meets at that node's meeting place (its count of
ops run), exact in three element types, while the world's ops go among the nodes beside
it; a group whose ranks are not ascending meets too, reduced in the group's order (the
rings' bits); ``TOTALREDUCE_MEET_GROUPS=0`` sends it to the rings.  Ranks of a node that
give one name and generation two routes (the meeting and the rings, or two groups at the
meeting) fail as a mismatch naming both ranks and both groups (or shapes), every rank
involved, never a hang (so do a world's allreduce at a one-node meeting and a
reduce-scatter of its name); a member that dies fails its own group's survivors only.
"""

from __future__ import annotations

import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from totalreduce.algorithms.codes import OpKind
from totalreduce.dtypes import ReduceOp
from totalreduce.errors import OpFailedError, OpMismatchError
from totalreduce.group import Group
from totalreduce.service import thin as thin_client
from totalreduce.transport import arena as A
from totalreduce.transport import meeting as M

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from test_thin_nodes import Cluster, data  # noqa: E402


def met(cl: Cluster, node: int) -> int:
    """Ops run at node ``node``'s meeting place so far."""
    arena = cl.services[node].arena
    at = int(arena.header[A.H_MEET]) + M.M_RAN
    return int(arena.view(at, 1, np.dtype(np.int64))[0])


def values(rng: np.random.Generator, npdt: Any, n: int) -> np.ndarray:
    if np.dtype(npdt).kind == "f":
        return (rng.standard_normal(n) * 1e4).astype(npdt)
    return rng.integers(-1000, 1000, n).astype(npdt)


TYPES = [np.float32, np.float64, np.int64]


def test_each_nodes_pair_meets_exactly_beside_the_worlds_ops() -> None:
    """[0, 1] meets on node 0 and [3, 2] (not ascending) on node 1: allreduces (sum and
    avg), broadcasts from group rank 1 and barriers, while the world's allreduce of each
    step goes among the nodes; every result has the rings' bits (the same ops over the
    rings, ``TOTALREDUCE_MEET_GROUPS=0``), and the meetings ran exactly the groups' ops."""
    rng = np.random.default_rng(7)
    pairs = [[0, 1], [3, 2]]
    with ExitStack() as stack:
        cl = Cluster(stack, 2, 2)
        got: dict[tuple[Any, ...], np.ndarray] = {}

        def step(tag: str, j: int, npdt: Any, gen: int, xs: list[np.ndarray]) -> None:
            world = [cl.submit(r, OpKind.ALLREDUCE, f"{tag}w{j}", data(r, gen, 5), gen=gen)
                     for r in range(4)]  # fmt: skip
            for pair in pairs:
                g = Group(pair)
                for op in (ReduceOp.SUM, ReduceOp.AVG) if npdt is not np.int64 else (ReduceOp.SUM,):
                    hs = [cl.submit(r, OpKind.ALLREDUCE, f"{tag}ar{j}{op.name}", xs[r], group=g,
                                    op=op, gen=gen) for r in pair]  # fmt: skip
                    for r, h in zip(pair, hs, strict=True):
                        got[tag, "ar", op, j, gen, r] = h.wait(30)
                hs = [cl.submit(r, OpKind.BROADCAST, f"{tag}bc{j}", xs[r], group=g, root=1,
                                gen=gen) for r in pair]  # fmt: skip
                for r, h in zip(pair, hs, strict=True):
                    got[tag, "bc", j, gen, r] = h.wait(30)
                for h in [cl.submit(r, OpKind.BARRIER, f"{tag}bar", None, group=g, gen=3 * j + gen)
                          for r in pair]:  # fmt: skip
                    h.wait(30)
            want = sum(data(r, gen, 5) for r in range(4))
            for h in world:
                assert np.array_equal(h.wait(30), want)

        inputs = {(j, gen): [values(rng, npdt, 37) for _ in range(4)]
                  for j, npdt in enumerate(TYPES) for gen in range(2)}  # fmt: skip
        before = [met(cl, 0), met(cl, 1)]
        ops = 0
        for j, npdt in enumerate(TYPES):
            for gen in range(2):
                step("m", j, npdt, gen, inputs[j, gen])
                ops += (2 if npdt is not np.int64 else 1) + 2
        assert [met(cl, n) - before[n] for n in (0, 1)] == [ops, ops]  # all met, on each node
        old = thin_client.MEET_GROUPS
        thin_client.MEET_GROUPS = False  # as TOTALREDUCE_MEET_GROUPS=0 does: the rings
        try:
            before = [met(cl, 0), met(cl, 1)]
            for j, npdt in enumerate(TYPES):
                for gen in range(2):
                    step("r", j, npdt, gen, inputs[j, gen])
            assert [met(cl, n) for n in (0, 1)] == before  # none met
        finally:
            thin_client.MEET_GROUPS = old
        for key, x in got.items():
            if key[0] != "m":
                continue
            ring = got[("r", *key[1:])]
            assert x.dtype == ring.dtype and x.tobytes() == ring.tobytes(), key
            if key[1] == "bc":
                j, gen, r = key[2:]
                pair = pairs[0] if r < 2 else pairs[1]
                assert x.tobytes() == inputs[j, gen][pair[1]].tobytes()
            elif key[2] is ReduceOp.SUM:
                j, gen, r = key[3:]
                pair = pairs[0] if r < 2 else pairs[1]
                xs = inputs[j, gen]
                assert x.tobytes() == (xs[pair[0]] + xs[pair[1]]).tobytes()


def _raises(h: Any, *texts: str) -> str:
    with pytest.raises(OpMismatchError) as info:
        h.wait(10)
    text = str(info.value)
    for t in texts:
        assert t in text, text
    return text


def test_a_group_at_the_meeting_and_the_world_on_the_rings_fail_every_rank() -> None:
    """Rank 0 gives ``x`` over [0, 1] (the meeting), rank 1 over the world (the rings,
    with ranks 2 and 3): every rank raises, naming the op, the generation, both ranks and
    both groups (the other node's ranks hear it through the services' abort)."""
    with ExitStack() as stack:
        cl = Cluster(stack, 2, 2)
        h0 = cl.submit(0, OpKind.ALLREDUCE, "x", data(0, 0, 4), group=Group([0, 1]))
        hw = [cl.submit(r, OpKind.ALLREDUCE, "x", data(r, 0, 4)) for r in (1, 2, 3)]
        both = ("rank 0: group [0, 1]", "rank 1: group [0, 1, 2, 3]")
        _raises(h0, "rank 0: allreduce 'x' generation 0", "disagree on the group", *both)
        _raises(hw[0], "rank 1: allreduce 'x' generation 0", "disagree on the group", *both)
        for h in hw[1:]:
            _raises(h, "'x' generation 0", "disagree on the group")


def test_a_group_at_the_meeting_and_one_spanning_nodes_that_completed() -> None:
    """Rank 0 gives ``y`` over [0, 1], rank 1 over [1, 2] with rank 2 (which completes
    among the nodes): rank 0 raises naming both groups, rank 1 at its next call."""
    with ExitStack() as stack:
        cl = Cluster(stack, 2, 2)
        h0 = cl.submit(0, OpKind.ALLREDUCE, "y", data(0, 0, 4), group=Group([0, 1]))
        span = Group([1, 2])
        hs = [cl.submit(r, OpKind.ALLREDUCE, "y", data(r, 0, 4), group=span) for r in (1, 2)]
        for h in hs:
            assert np.array_equal(h.wait(30), data(1, 0, 4) + data(2, 0, 4))
        _raises(h0, "'y' generation 0", "rank 0: group [0, 1]", "rank 1: group [1, 2]")
        with pytest.raises(
            OpMismatchError, match=r"completed here, but failed elsewhere: .*group \[0, 1\]"
        ):
            cl.clients[1].raise_late()


def test_two_orders_of_one_pair_at_the_meeting_fail_both() -> None:
    """Rank 0 gives ``z`` over [0, 1], rank 1 over [1, 0] (two channels of the meeting):
    both raise, naming both groups; the name goes on over one group."""
    with ExitStack() as stack:
        cl = Cluster(stack, 2, 2)
        h0 = cl.submit(0, OpKind.ALLREDUCE, "z", data(0, 0, 4), group=Group([0, 1]))
        h1 = cl.submit(1, OpKind.ALLREDUCE, "z", data(1, 0, 4), group=Group([1, 0]))
        for h in (h0, h1):
            _raises(h, "'z' generation 0", "rank 0: group [0, 1]", "rank 1: group [1, 0]")
        g = Group([1, 0])
        hs = [cl.submit(r, OpKind.ALLREDUCE, "z", data(r, 1, 4), group=g, gen=1) for r in (0, 1)]
        for h in hs:
            assert np.array_equal(h.wait(30), data(0, 1, 4) + data(1, 1, 4))


def test_a_completed_group_of_one_and_the_world_waiting_on_the_rings() -> None:
    """Rank 0 gives ``v`` over [0] alone (it completes at the meeting), ranks 1-3 over the
    world (its op waits on node 0 for rank 0): the world's op fails on every rank of it,
    naming both groups, and rank 0 raises at its next call."""
    with ExitStack() as stack:
        cl = Cluster(stack, 2, 2)
        h0 = cl.submit(0, OpKind.ALLREDUCE, "v", data(0, 0, 4), group=Group([0]))
        assert np.array_equal(h0.wait(30), data(0, 0, 4))
        hw = [cl.submit(r, OpKind.ALLREDUCE, "v", data(r, 0, 4)) for r in (1, 2, 3)]
        _raises(hw[0], "'v' generation 0", "rank 0: group [0]", "rank 1: group [0, 1, 2, 3]")
        for h in hw[1:]:
            _raises(h, "'v' generation 0", "disagree on the group")
        with pytest.raises(OpMismatchError, match=r"failed elsewhere: .*rank 0: group \[0\]"):
            cl.clients[0].raise_late()


def test_one_group_two_routes_by_element_type_names_the_shapes() -> None:
    """Ranks 0 and 1 give ``u`` over [0, 1], rank 0 in int64 (it meets), rank 1 in uint8
    (no raw kernel: the rings): both raise, naming what each gave."""
    with ExitStack() as stack:
        cl = Cluster(stack, 2, 2)
        g = Group([0, 1])
        h0 = cl.submit(0, OpKind.ALLREDUCE, "u", np.ones(4, np.int64), group=g)
        h1 = cl.submit(1, OpKind.ALLREDUCE, "u", np.ones(4, np.uint8), group=g)
        for h in (h0, h1):
            _raises(h, "'u' generation 0", "rank 0: allreduce, count 4 int64",
                    "rank 1: allreduce, count 4 uint8")  # fmt: skip


def test_a_member_that_dies_fails_only_its_groups_survivors() -> None:
    """Rank 1 dies while rank 0 waits for it at node 0's meeting: rank 0 raises naming it;
    node 1's pair goes on meeting over [3, 2], exact."""
    with ExitStack() as stack:
        cl = Cluster(stack, 2, 2)
        h0 = cl.submit(0, OpKind.ALLREDUCE, "d", data(0, 0, 4), group=Group([0, 1]))
        cl.services[0].detach(1, "died (it was killed)")
        cl.engines[0].loop.tell_services("died", 1)  # (as the node's socket side does)
        with pytest.raises(OpFailedError, match="rank 1 died"):
            h0.wait(10)
        before = met(cl, 1)
        g = Group([3, 2])
        for gen in range(3):
            hs = [cl.submit(r, OpKind.ALLREDUCE, "e", data(r, gen, 4), group=g, gen=gen)
                  for r in (2, 3)]  # fmt: skip
            for h in hs:
                assert np.array_equal(h.wait(30), data(2, gen, 4) + data(3, gen, 4))
        assert met(cl, 1) - before == 3


def test_one_node_a_world_allreduce_and_a_reduce_scatter_of_one_name_fail_both() -> None:
    """On one node, rank 0 gives ``q`` as the world's allreduce (the meeting), rank 1 as a
    reduce-scatter (the rings): both raise, naming what each gave (they waited for each
    other with stall warnings before)."""
    with ExitStack() as stack:
        cl = Cluster(stack, 1, 2)
        h0 = cl.submit(0, OpKind.ALLREDUCE, "q", data(0, 0, 4))
        h1 = cl.submit(1, OpKind.REDUCE_SCATTER, "q", data(1, 0, 4), parts=(2, 2))
        for h in (h0, h1):
            _raises(h, "'q' generation 0", "rank 0: allreduce, count 4 int64",
                    "rank 1: reduce-scatter, count 4 int64")  # fmt: skip

"""Ranks on different nodes that give one name and generation over different groups, in
process (test_thin_nodes.py's ``Cluster``): among the services such ops have different
names and never meet, so the services' probes find them (thin_clash.py): every rank
raises an ``OpMismatchError`` naming both groups within seconds (a rank whose op completed
at its next call), and the name goes on."""

from __future__ import annotations

import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from totalreduce.algorithms.codes import OpKind
from totalreduce.errors import OpMismatchError
from totalreduce.group import Group

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from test_thin_nodes import Cluster, data  # noqa: E402

#: How long a clash may take to fail (the probes come every second).
WITHIN_S = 10.0


def _raises(h: Any, *texts: str) -> str:
    with pytest.raises(OpMismatchError) as info:
        h.wait(WITHIN_S)
    text = str(info.value)
    for t in texts:
        assert t in text, text
    return text


@pytest.mark.parametrize("bits", [False, True])
def test_a_group_of_both_nodes_and_the_world_fail_both(bits: bool, monkeypatch: Any) -> None:
    """Two nodes of one client: rank 0 gives ``c`` over the group [0, 1], rank 1 over the
    world (the same ranks, another context): both raise within seconds, naming both; the
    name's next generations work, over the world and over the group.  (``bits``: the
    probes' notes name the group's ranks in a bitmap, as for a group of more than 508.)"""
    if bits:
        from totalreduce.daemon import thin_clash

        monkeypatch.setattr(thin_clash, "_LISTED", 1)
    with ExitStack() as stack:
        cl = Cluster(stack, 2, 1)
        t0 = time.monotonic()
        h0 = cl.submit(0, OpKind.ALLREDUCE, "c", data(0, 0, 4), group=Group([0, 1]))
        h1 = cl.submit(1, OpKind.ALLREDUCE, "c", data(1, 0, 4))
        both = ("rank 0: group [0, 1]", "rank 1: group [0, 1] (the world)")
        for r, h in enumerate((h0, h1)):
            _raises(h, f"rank {r}: allreduce 'c' generation 0", "disagree on the group", *both)
        assert time.monotonic() - t0 < WITHIN_S
        hs = [cl.submit(r, OpKind.ALLREDUCE, "c", data(r, 1, 4), gen=1) for r in (0, 1)]
        for h in hs:
            assert np.array_equal(h.wait(30), data(0, 1, 4) + data(1, 1, 4))
        g = Group([0, 1])  # (each node counted the other's generation of its name)
        hs = [cl.submit(r, OpKind.ALLREDUCE, "c", data(r, 2, 4), group=g, gen=2) for r in (0, 1)]
        for h in hs:
            assert np.array_equal(h.wait(30), data(0, 2, 4) + data(1, 2, 4))


@pytest.mark.parametrize(
    "theirs", [[0, 1, 2, 3], pytest.param([1, 2, 3], marks=pytest.mark.full)]
)  # fmt: skip
def test_a_pair_at_the_meeting_and_a_group_of_both_nodes(theirs: list[int]) -> None:
    """Two nodes of two clients: node 0's pair gives ``n`` over [0, 1] (it completes at
    node 0's meeting), node 1's ranks over ``theirs`` (with ranks of node 0): node 1's
    ranks raise within seconds naming both groups, node 0's at their next call; the
    name's next generations work, over the world and over ``theirs``."""
    with ExitStack() as stack:
        cl = Cluster(stack, 2, 2)
        t0 = time.monotonic()
        pair = [cl.submit(r, OpKind.ALLREDUCE, "n", data(r, 0, 4), group=Group([0, 1]))
                for r in (0, 1)]  # fmt: skip
        for h in pair:
            assert np.array_equal(h.wait(30), data(0, 0, 4) + data(1, 0, 4))
        g = Group(theirs)
        hs = [cl.submit(r, OpKind.ALLREDUCE, "n", data(r, 0, 4), group=g) for r in (2, 3)]
        both = ("rank 0: group [0, 1]", "rank 1: group [0, 1]", f"rank 2: group {theirs}")
        for h in hs:
            _raises(h, "'n' generation 0", "disagree on the group", *both)
        assert time.monotonic() - t0 < WITHIN_S
        for r in (0, 1):
            with pytest.raises(OpMismatchError, match=r"failed elsewhere: .*group \[0, 1\]"):
                cl.clients[r].raise_late()
        hs = [cl.submit(r, OpKind.ALLREDUCE, "n", data(r, 1, 4), gen=1) for r in range(4)]
        for h in hs:
            assert np.array_equal(h.wait(30), sum(data(r, 1, 4) for r in range(4)))
        hs = [cl.submit(r, OpKind.ALLREDUCE, "n", data(r, 2, 4), group=g, gen=2) for r in theirs]
        for h in hs:
            assert np.array_equal(h.wait(30), sum(data(r, 2, 4) for r in theirs))


@pytest.mark.parametrize("nodes, slots", [(2, 1), (2, 2)])
def test_repeats_of_the_compiled_loop_that_disagree_on_the_group(nodes: int, slots: int) -> None:
    """Every rank runs ``r`` twelve times, alternating its node's group (of both nodes where a
    node has one client) and the world, so that both are repeats of the compiled loop (or
    of the node's meeting); then node 0's ranks give generation 12 over their group and
    node 1's over the world: the ranks that wait raise within seconds naming both groups,
    those whose op completed (at their node's meeting) at their next call, and the name
    goes on."""
    with ExitStack() as stack:
        cl = Cluster(stack, nodes, slots)
        size = cl.size
        mine = [Group(list(range(n * slots, n * slots + slots))) for n in range(nodes)]
        if slots == 1:
            mine = [Group(list(range(size)))] * nodes

        def group(r: int, g: int) -> Group | None:
            return mine[r // slots] if g % 2 == 0 else None

        for g in range(12):
            hs = [cl.submit(r, OpKind.ALLREDUCE, "r", data(r, g, 4), gen=g, group=group(r, g))
                  for r in range(size)]  # fmt: skip
            for r, h in enumerate(hs):
                ranks = (group(r, g) or Group(list(range(size)))).ranks
                assert np.array_equal(h.wait(30), sum(data(q, g, 4) for q in ranks))
        # the shapes the compiled loop repeats (a node's pair meets at its meeting instead)
        kept = 2 if slots == 1 else 1
        assert all(s._loop_shapes is not None and len(s._loop_shapes.kept) >= kept
                   for s in cl.services)  # fmt: skip
        t0 = time.monotonic()
        hs = [cl.submit(r, OpKind.ALLREDUCE, "r", data(r, 12, 4), gen=12,
                        group=mine[0] if r < slots else None) for r in range(size)]  # fmt: skip
        theirs = f"rank {size - 1}: group {list(range(size))} (the world)"
        met = range(slots) if slots > 1 else ()  # completed at node 0's meeting
        for r in met:
            assert np.array_equal(hs[r].wait(30), sum(data(q, 12, 4) for q in mine[0].ranks))
        for r in range(len(met), size):
            _raises(hs[r], "'r' generation 12", "disagree on the group", theirs,
                    f"rank 0: group {list(mine[0].ranks)}")  # fmt: skip
        assert time.monotonic() - t0 < WITHIN_S
        for r in met:  # (told once the others failed: they raise at their next call)
            with pytest.raises(OpMismatchError, match="failed elsewhere") as info:
                cl.clients[r].raise_late()
            assert theirs in str(info.value), info.value
        hs = [cl.submit(r, OpKind.ALLREDUCE, "r", data(r, 13, 4), gen=13) for r in range(size)]
        for h in hs:
            assert np.array_equal(h.wait(30), sum(data(q, 13, 4) for q in range(size)))


def test_a_probes_note_names_a_group_of_any_size_up_to_its_bound() -> None:
    """A note lists a group's ranks a word each, and a larger group's one bit each (then in
    ascending order), within a PROBE's body; a group beyond the bitmap's reach gets no
    note (the stall warning names such an op)."""
    from totalreduce import protocol
    from totalreduce.daemon import thin_clash as C

    rng = np.random.default_rng(5)
    for n in (0, 3, C._LISTED, C._LISTED + 1, 5000):
        ranks = tuple(int(r) for r in rng.permutation(2 * n + 1)[:n])
        body = C._note(-12345, 7, 99, C._ASK, ranks)
        assert 32 <= len(body) <= protocol.MAX_CONTROL_BODY and len(body) % 8 == 0
        w = np.frombuffer(body, dtype=np.int64)
        assert (int(w[0]), int(w[1]), int(w[2]), int(w[3]) & ~C._BITS) == (-12345, 7, 99, 0)
        got = C._note_ranks(body, int(w[3]))
        assert got == (ranks if n <= C._LISTED else tuple(sorted(ranks))), n
    top = (0, *range(C._MOST_RANKS - 600, C._MOST_RANKS))
    assert len(C._note(1, 2, 3, C._ASK, top)) == protocol.MAX_CONTROL_BODY
    assert C._note(1, 2, 3, C._ASK, (*top, C._MOST_RANKS)) == b""

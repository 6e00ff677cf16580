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


def test_a_group_of_both_nodes_and_the_world_fail_both() -> None:
    """Two nodes of one client: rank 0 gives ``c`` over the group [0, 1], rank 1 over the
    world (the same ranks, another context): both raise within seconds, naming both; the
    name's next generations work, over the world and over the group."""
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

"""The local transport keeps MPI's matching rules."""

from __future__ import annotations

import numpy as np
import pytest

from totalreduce.errors import TransportError
from totalreduce.transport.base import ANY_SOURCE
from totalreduce.transport.local import LocalWorld


def buf(values) -> np.ndarray:
    return np.array(values, dtype=np.uint8)


@pytest.mark.parametrize("jitter", [0.0, 0.7])
def test_non_overtaking_per_sender_and_tag(jitter: float) -> None:
    world = LocalWorld(3, jitter=jitter, seed=1)
    a, b, c = (world.transport(r) for r in range(3))
    sends = [a.isend(buf([i]), 2, tag=5) for i in range(50)]
    sends += [b.isend(buf([100 + i]), 2, tag=5) for i in range(50)]
    got = []
    for _ in range(100):
        out = np.zeros(1, dtype=np.uint8)
        req = c.irecv(out, ANY_SOURCE, 5)
        while True:
            done, source, n = c.test(req)
            if done:
                break
        got.append((source, int(out[0])))
    from_a = [v for s, v in got if s == 0]
    from_b = [v for s, v in got if s == 1]
    assert from_a == list(range(50)) and from_b == [100 + i for i in range(50)]
    assert a.testsome(sends[:50]) == list(range(50))


def test_tags_and_sources_are_matched() -> None:
    world = LocalWorld(2)
    a, b = world.transport(0), world.transport(1)
    x = np.zeros(2, dtype=np.uint8)
    y = np.zeros(2, dtype=np.uint8)
    rx = b.irecv(x, 0, tag=7)
    ry = b.irecv(y, 0, tag=8)
    a.isend(buf([8, 8]), 1, tag=8)
    assert b.test(ry)[0] and not b.test(rx)[0]
    a.isend(buf([7, 7]), 1, tag=7)
    assert b.test(rx) == (True, 0, 2)
    assert list(x) == [7, 7] and list(y) == [8, 8]


def test_send_reads_buffer_when_matched_like_rendezvous() -> None:
    world = LocalWorld(2)
    a, b = world.transport(0), world.transport(1)
    data = buf([1, 2, 3])
    s = a.isend(data, 1, tag=3)
    assert not a.test(s)[0]  # not complete until a receive matches
    data[0] = 9  # a write while in flight shows up at the receiver
    out = np.zeros(3, dtype=np.uint8)
    r = b.irecv(out, 0, tag=3)
    assert b.test(r)[0] and a.test(s)[0]
    assert list(out) == [9, 2, 3]


def test_truncation_is_an_error() -> None:
    world = LocalWorld(2)
    a, b = world.transport(0), world.transport(1)
    a.isend(buf([1, 2, 3, 4]), 1, tag=1)
    r = b.irecv(np.zeros(2, dtype=np.uint8), 0, tag=1)
    with pytest.raises(TransportError, match="truncated"):
        b.test(r)


def test_cancel_and_bad_arguments() -> None:
    world = LocalWorld(2)
    a = world.transport(0)
    r = a.irecv(np.zeros(1, dtype=np.uint8), ANY_SOURCE, 1)
    a.cancel(r)
    world.transport(1).isend(buf([1]), 0, tag=1)
    # A cancelled receive completes (as a cancelled MPI request does) with nothing in it,
    # and the message that came later waits for another receive.
    assert a.test(r) == (True, -1, 0)
    source, got = a.poll_message(1, 64)
    assert source == 1 and got.tolist() == [1]
    assert a.poll_message(1, 64) is None
    with pytest.raises(TransportError):
        a.isend(buf([1]), 5, tag=1)
    with pytest.raises(TransportError):
        a.isend(np.zeros(2, dtype=np.float32), 1, tag=1)
    with pytest.raises(ValueError):
        LocalWorld(0)


def test_node_layout_is_one_node() -> None:
    world = LocalWorld(3)
    assert [world.transport(r).node_layout() for r in range(3)] == [
        (0, 3, 0, 1),
        (1, 3, 0, 1),
        (2, 3, 0, 1),
    ]

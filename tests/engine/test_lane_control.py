"""The control frames (ERROR, PROBE, HAVE, BYE, GONE, JOIN) travel in the lane's messages.

Two services of a local world; each case makes one kind of control frame travel and
asserts its route: the receiver's lane handed it up (``LoopStats.lane_control``, counted
where the lane's ``EV_CONTROL`` event is handled), in a message of the lane's.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

import totalreduce as tr
from conftest import local_services, run_ranks
from totalreduce import protocol as L


def _wait_for(cond, timeout: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def _on_lane_only(svc) -> None:  # type: ignore[no-untyped-def]
    lane = svc.loop.lane
    assert lane is not None
    handed_up = sum(svc.loop.stats.lane_control.values())
    assert handed_up == svc.loop.stats.frames_received  # every control frame came that way
    if handed_up:
        assert lane.stats()["messages_received"] > 0


def test_an_error_travels_in_the_lane() -> None:
    with local_services(2) as svcs:

        def body(s):  # type: ignore[no-untyped-def]
            n = 4 if s.rank == 0 else 5  # the ranks disagree: both fail, and tell each other
            with pytest.raises(tr.OpMismatchError):
                s.allreduce(np.ones(n), name="disagree")

        run_ranks(svcs, body, timeout=30)
        _wait_for(lambda: all(s.loop.stats.lane_control.get(L.ERROR, 0) for s in svcs))
        for s in svcs:
            _on_lane_only(s)


def test_probe_and_have_travel_in_the_lane() -> None:
    """Ranks 0 and 1 submit an op of the three, rank 2 not yet: the stall inspector's
    PROBEs go out, and the rank that has the op answers HAVE."""
    with local_services(3, stall_warning_s=0.2) as svcs:
        hs = [s.allreduce_async(np.ones(4), name="late") for s in svcs[:2]]
        _wait_for(lambda: svcs[2].loop.stats.lane_control.get(L.PROBE, 0) > 0)
        _wait_for(lambda: all(s.loop.stats.lane_control.get(L.HAVE, 0) for s in svcs[:2]))
        hs.append(svcs[2].allreduce_async(np.ones(4), name="late"))
        for h in hs:
            np.testing.assert_array_equal(h.wait(timeout=10), 3 * np.ones(4))
        for s in svcs:
            _on_lane_only(s)


def test_gone_and_join_travel_in_the_lane() -> None:
    with local_services(2) as svcs:
        a, b = svcs
        seen: list[tuple[str, int, int, int]] = []
        b.loop.on_client_notice = lambda *args: seen.append(args)
        a.loop.tell_services("died", 3, session=7, agreed=-5)
        a.loop.tell_services("joined", 3, session=8)
        a.loop.tell_services("ended", 1, session=8)
        _wait_for(lambda: len(seen) == 3)
        assert seen == [("died", 3, 7, -5), ("joined", 3, 8, 0), ("ended", 1, 8, 0)]
        assert b.loop.stats.lane_control.get(L.GONE) == 1
        assert b.loop.stats.lane_control.get(L.JOIN) == 2
        for s in svcs:
            _on_lane_only(s)


def test_bye_travels_in_the_lane() -> None:
    with local_services(2) as svcs:
        a, b = svcs
        np.testing.assert_array_equal(
            run_ranks(svcs, lambda s: s.allreduce(np.ones(3), name="first"))[0], 2 * np.ones(3)
        )
        b.shutdown(timeout=1.0)
        _wait_for(lambda: a.loop.stats.lane_control.get(L.BYE, 0) == 1)
        assert 1 in a.loop.peers.bad  # left: its ops fail at once
        with pytest.raises(tr.OpFailedError, match="rank 1 stopped"):
            a.allreduce(np.ones(3), name="after")
        _on_lane_only(a)

"""The completion word (engine/completion.py): no event until a waiter sleeps, no lost wake-up."""

from __future__ import annotations

import threading
import time

from totalreduce.engine.completion import Completion


def test_set_before_wait_needs_no_event() -> None:
    c = Completion()
    assert not c.is_set()
    c.set()
    assert c.is_set() and c.wait(0) and c.wait()
    assert c._ev is None  # nobody slept: no event was made


def test_wait_times_out_then_sees_a_later_set() -> None:
    c = Completion()
    t0 = time.perf_counter()
    assert c.wait(0.05) is False
    assert time.perf_counter() - t0 >= 0.04
    threading.Timer(0.05, c.set).start()
    assert c.wait(10) is True


def _append_wait(c: Completion, got: list[bool]) -> None:
    got.append(c.wait(5))


def test_no_lost_wakeup_under_races() -> None:
    # Many rounds of a setter racing several sleepers: every sleeper returns True long
    # before its timeout (a lost wake-up would show as a False or a 5 s wait).
    for _ in range(300):
        c = Completion()
        got: list[bool] = []
        waiters = [threading.Thread(target=_append_wait, args=(c, got)) for _ in range(3)]
        for w in waiters:
            w.start()
        c.set()
        for w in waiters:
            w.join(10)
        assert got == [True, True, True]

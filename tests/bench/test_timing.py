"""The benchmark's timing loop: the collector is off while calls are timed, and comes back."""

from __future__ import annotations

import gc
from typing import Any

import pytest

from totalreduce.bench.timing import Timed, time_alternating

pytest.importorskip("mpi4py")


class OneRank:
    """A communicator of one rank (what ``time_alternating`` calls of it)."""

    def Barrier(self) -> None:
        pass

    def allreduce(self, value: float, op: Any = None) -> float:
        return value


@pytest.mark.parametrize("enabled", [True, False])
def test_calls_are_timed_with_the_collector_off_and_its_state_comes_back(enabled: bool) -> None:
    seen: list[bool] = []
    resets: list[bool] = []
    calls = {
        "a": Timed(lambda: seen.append(gc.isenabled()), lambda: resets.append(gc.isenabled())),
        "b": Timed(lambda: seen.append(gc.isenabled())),
    }
    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        stats = time_alternating(OneRank(), calls, iters=3, warmup=1)
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()
    assert seen == [False] * 8 and resets == [False] * 4
    assert set(stats) == {"a", "b"} and all(s.min >= 0 for s in stats.values())


def test_the_collector_comes_back_when_a_call_raises() -> None:
    def boom() -> None:
        raise RuntimeError("boom")

    assert gc.isenabled()
    with pytest.raises(RuntimeError, match="boom"):
        time_alternating(OneRank(), {"x": Timed(boom)}, iters=1, warmup=0)
    assert gc.isenabled()

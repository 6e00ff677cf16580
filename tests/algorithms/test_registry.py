"""The allreduce registry: names, uniform signature, options, and the crossover lookup."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from totalreduce.algorithms.bcube import allreduce_bcube
from totalreduce.algorithms.registry import ALLREDUCE, allreduce_schedule, auto_allreduce
from totalreduce.algorithms.simulator import simulate


def test_registry_names() -> None:
    assert set(ALLREDUCE) == {
        "ring",
        "ring_chunked",
        "halving_doubling",
        "recursive_doubling",
        "bcube",
    }


@pytest.mark.parametrize("name", sorted(ALLREDUCE))
@pytest.mark.parametrize("p", [1, 3, 4, 6])
def test_every_registered_algorithm_averages(name: str, p: int) -> None:
    n = 101
    xs = [np.arange(n, dtype=np.int64) * p + r for r in range(p)]
    schedules = [ALLREDUCE[name](r, p, n, average=True) for r in range(p)]
    want = (np.arange(n, dtype=np.int64) * p * p + p * (p - 1) // 2) // p
    for out in simulate(schedules, xs, op="avg", segment_elems=13, seed=p):
        np.testing.assert_array_equal(out, want)


def test_allreduce_schedule_passes_options() -> None:
    s = allreduce_schedule("bcube", 5, 16, 160, base=4)
    assert s == allreduce_bcube(5, 16, 160, base=4)
    assert len(s.steps) == 4
    partial = functools.partial(allreduce_bcube, base=4)
    assert partial(5, 16, 160) == s


def test_allreduce_schedule_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(
        ValueError, match="'tree'.*bcube, halving_doubling, recursive_doubling, ring"
    ):
        allreduce_schedule("tree", 0, 2, 10)


def test_auto_allreduce_lookup() -> None:
    table = {
        2: [(float("inf"), "ring")],
        8: [(1 << 16, "halving_doubling"), (1 << 22, "bcube"), (float("inf"), "ring_chunked")],
    }
    assert auto_allreduce(1, 10, table) == "ring"  # below every tabulated size
    assert auto_allreduce(7, 10, table) == "ring"
    assert auto_allreduce(8, 10, table) == "halving_doubling"
    assert auto_allreduce(64, 1 << 16, table) == "bcube"
    assert auto_allreduce(64, 1 << 30, table) == "ring_chunked"
    assert auto_allreduce(8, 1 << 30, {8: [(10, "ring"), (20, "bcube")]}) == "bcube"


def test_auto_allreduce_rejects_bad_tables() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        auto_allreduce(4, 10, {})
    with pytest.raises(ValueError, match="no rows"):
        auto_allreduce(4, 10, {2: []})
    with pytest.raises(ValueError, match="unknown algorithm 'magic'"):
        auto_allreduce(4, 10, {2: [(100, "magic")]})

"""The edge model: the edge rule, per-iteration validation and step lookup."""

from __future__ import annotations

import numpy as np
import pytest

from totalreduce.topology import Edge, Topology, get_topology, register


class Listed(Topology):
    """A topology whose iterations are given at construction, to test validation."""

    def __init__(self, world_size: int, schedule: list[list[Edge]]) -> None:
        self.schedule = schedule
        super().__init__(world_size)

    def _edges(self) -> list[list[Edge]]:
        return self.schedule


def test_edge_normalises_ranks_and_weight() -> None:
    e = Edge([np.int64(2), 0], 1)  # type: ignore[arg-type]
    assert e.ranks == (2, 0) and isinstance(e.ranks, tuple)
    assert all(type(r) is int for r in e.ranks)
    assert e.weight == 1.0 and isinstance(e.weight, float)
    with pytest.raises(TypeError, match="edge ranks must be ints"):
        Edge(("a", 1), 0.5)  # type: ignore[arg-type]


def test_edge_rule_weights() -> None:
    assert Edge((0, 1), 0.5).self_weight == 0.5
    assert Edge((0, 1), 0.5).peer_weight == 0.5
    triple = Edge((0, 1, 2), 0.4)
    assert triple.self_weight == 0.4
    assert triple.peer_weight == pytest.approx(0.3)
    # A rank alone keeps its value, whatever the weight says.
    assert Edge((3,), 0.2).self_weight == 1.0
    assert Edge((3,), 0.2).peer_weight == 0.0


def test_matrix_follows_edge_rule() -> None:
    topo = Listed(5, [[Edge((0, 2, 4), 0.4), Edge((1,), 0.0), Edge((3,), 1.0)]])
    w = topo.matrix(0)
    want = np.zeros((5, 5))
    for i in (0, 2, 4):
        for j in (0, 2, 4):
            want[i, j] = 0.4 if i == j else 0.3
    want[1, 1] = want[3, 3] = 1.0
    np.testing.assert_allclose(w, want)
    x = np.arange(5.0)
    np.testing.assert_allclose(
        w @ x, [0.4 * 0 + 0.3 * 6, 1, 0.4 * 2 + 0.3 * 4, 3, 0.4 * 4 + 0.3 * 2]
    )


def test_steps_wrap_around_the_period() -> None:
    first = [Edge((0, 1), 0.5), Edge((2, 3), 0.5)]
    second = [Edge((1, 2), 0.5), Edge((0, 3), 0.5)]
    topo = Listed(4, [first, second])
    assert topo.period == 2
    assert topo.edges(0) == first and topo.edges(3) == second and topo.edges(10) == first
    assert topo.edge_of(3, 0) == Edge((2, 3), 0.5)
    assert topo.edge_of(3, 5) == Edge((0, 3), 0.5)
    with pytest.raises(ValueError, match="step must be >= 0, got -1"):
        topo.edges(-1)
    with pytest.raises(ValueError, match=r"rank 4 is out of range .* \(ranks 0..3\)"):
        topo.edge_of(4, 0)


def test_refuses_rank_out_of_range() -> None:
    with pytest.raises(ValueError, match=r"iteration 1, edge \(2, 4\): rank 4 is out of range"):
        Listed(4, [[Edge((0, 1, 2, 3), 0.25)], [Edge((0, 1), 0.5), Edge((2, 4), 0.5)]])


def test_refuses_rank_in_two_edges() -> None:
    with pytest.raises(
        ValueError, match=r"iteration 0: rank 1 is in two edges, \(0, 1\) and \(1, 2\)"
    ):
        Listed(3, [[Edge((0, 1), 0.5), Edge((1, 2), 0.5)]])


def test_refuses_rank_twice_in_one_edge() -> None:
    with pytest.raises(ValueError, match=r"iteration 0, edge \(1, 1\): rank 1 appears twice"):
        Listed(2, [[Edge((0,), 1.0), Edge((1, 1), 0.5)]])


def test_refuses_missing_rank() -> None:
    with pytest.raises(ValueError, match=r"iteration 2: ranks \[1, 3\] are in no edge"):
        Listed(4, [[Edge((0, 1, 2, 3), 0.25)]] * 2 + [[Edge((0, 2), 0.5)]])


@pytest.mark.parametrize("weight", [-0.1, 1.5, float("nan")])
def test_refuses_weight_outside_unit_interval(weight: float) -> None:
    with pytest.raises(
        ValueError, match=rf"iteration 0, edge \(0, 1\): weight {weight} is outside \[0, 1\]"
    ):
        Listed(2, [[Edge((0, 1), weight)]])


def test_refuses_empty_edge_and_empty_schedule() -> None:
    with pytest.raises(ValueError, match="iteration 0, edge \\(\\): an edge needs at least one"):
        Listed(1, [[Edge((), 1.0), Edge((0,), 1.0)]])
    with pytest.raises(ValueError, match="returned no iterations"):
        Listed(3, [])


def test_refuses_bad_world_size() -> None:
    with pytest.raises(ValueError, match="world_size must be at least 1, got 0"):
        Listed(0, [[]])
    with pytest.raises(TypeError, match="world_size must be an int"):
        Listed(2.0, [[]])  # type: ignore[arg-type]


@register("test-pairs")
class Pairs(Topology):
    """Pairs (0, 1), (2, 3), ...; a last odd rank sits out."""

    def _edges(self) -> list[list[Edge]]:
        n = self.world_size
        edges = [Edge((i, i + 1), 0.5) for i in range(0, n - 1, 2)]
        if n % 2:
            edges.append(Edge((n - 1,), 1.0))
        return [edges]


def test_registered_subclass_is_built_by_name() -> None:
    topo = get_topology("test-pairs", 5)
    assert isinstance(topo, Pairs) and topo.name == "test-pairs"
    np.testing.assert_allclose(topo.matrix(0)[4], [0, 0, 0, 0, 1])

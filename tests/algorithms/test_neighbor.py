"""Neighbor schedules proven by the simulator: W x for topologies, exact one-peer averaging."""

from __future__ import annotations

import numpy as np
import pytest

from totalreduce.algorithms.neighbor import edge_average, neighbor_allgather, neighbor_allreduce
from totalreduce.algorithms.simulator import ScheduleError, simulate
from totalreduce.topology import Topology, get_topology, mixing_matrix, plan


def one_step(topo, step: int, X: np.ndarray, seg: int = 7) -> np.ndarray:
    p, n = X.shape
    if isinstance(topo, Topology):
        # every edge of the step is its own group; simulate each group separately
        out = np.empty_like(X)
        for edge in topo.edges(step):
            ranks = sorted(edge.ranks)
            scheds = [edge_average(i, len(ranks), n, weight=edge.weight) for i in range(len(ranks))]
            res = simulate(scheds, [X[r] for r in ranks], segment_elems=seg, seed=step)
            for i, r in enumerate(ranks):
                out[r] = res[i]
        return out
    scheds = []
    for r in range(p):
        pl = plan(topo, r, step)
        scheds.append(
            neighbor_allreduce(
                r,
                p,
                n,
                self_weight=pl.self_weight,
                src_weights=pl.src_weights,
                dst_weights={d: 1.0 for d in pl.dst_ranks},
            )
        )
    return np.stack(simulate(scheds, list(X), segment_elems=seg, seed=step))


@pytest.mark.parametrize("p", [1, 2, 3, 5, 8, 12, 16])
@pytest.mark.parametrize(
    "name", ["exponential-2", "ring-graph", "mesh-grid-2d", "star", "complete", "ring", "exp"]
)
def test_step_equals_w_x(p: int, name: str) -> None:
    topo = get_topology(name, p)
    X = np.random.default_rng(p).standard_normal((p, 29))
    for step in range(3):
        np.testing.assert_allclose(
            one_step(topo, step, X), mixing_matrix(topo, step) @ X, atol=1e-12
        )


@pytest.mark.parametrize("p", [2, 4, 8, 16])
def test_one_peer_exp_averages_exactly_after_log2_steps(p: int) -> None:
    topo = get_topology("exp", p)
    X = np.random.default_rng(0).integers(-50, 50, (p, 11)).astype(np.float64)
    for step in range(p.bit_length() - 1):
        X = one_step(topo, step, X)
    np.testing.assert_allclose(X, np.broadcast_to(X.mean(axis=0), X.shape), atol=1e-12)


def test_mismatched_pattern_does_not_execute() -> None:
    s0 = neighbor_allreduce(0, 2, 4, self_weight=0.5, src_weights={1: 0.5}, dst_weights={})
    s1 = neighbor_allreduce(1, 2, 4, self_weight=1.0, src_weights={}, dst_weights={})
    with pytest.raises(ScheduleError):
        simulate([s0, s1], [np.ones(4), np.ones(4)])


def test_neighbor_allgather_and_dst_weights() -> None:
    p = 4
    X = np.arange(p * 3, dtype=np.float64).reshape(p, 3)
    scheds = [
        neighbor_allgather(
            r, p, 3, src_ranks=[(r - 1) % p, (r + 1) % p], dst_ranks=[(r - 1) % p, (r + 1) % p]
        )
        for r in range(p)
    ]
    for r, out in enumerate(simulate(scheds, list(X))):
        srcs = sorted({(r - 1) % p, (r + 1) % p})
        np.testing.assert_array_equal(out.reshape(2, 3), X[srcs])
    scaled = [
        neighbor_allreduce(
            r,
            p,
            3,
            self_weight=0.5,
            src_weights={(r - 1) % p: 0.25},
            dst_weights={(r + 1) % p: 2.0},
        )
        for r in range(p)
    ]
    for r, out in enumerate(simulate(scaled, list(X), in_place=True)):
        np.testing.assert_allclose(out, 0.5 * X[r] + 0.5 * X[(r - 1) % p])

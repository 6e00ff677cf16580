"""plan() against mixing_matrix() for every topology, and the registry."""

from __future__ import annotations

import numpy as np
import pytest
from topology_cases import all_topologies

from totalreduce.topology import (
    NeighborPlan,
    get_topology,
    known_topologies,
    mixing_matrix,
    plan,
    topology_options,
)

NAMES = {
    "complete",
    "ring",
    "exp",
    "alternating-exp-ring",
    "exponential-2",
    "exponential",
    "symmetric-exponential",
    "mesh-grid-2d",
    "star",
    "ring-graph",
    "fully-connected",
}


@pytest.mark.parametrize("n", [*range(1, 14), 16, 24, 32, 33])
def test_plan_agrees_with_mixing_matrix(n: int) -> None:
    rng = np.random.default_rng(n)
    for topo in all_topologies(n):
        name = repr(topo)
        for step in sorted({0, 1, topo.period - 1, 2 * topo.period + 1}):
            w = mixing_matrix(topo, step)
            plans = [plan(topo, rank, step) for rank in range(n)]
            where = f"{name} step={step}"
            # The plans, written back as a matrix, are W; their sources are its non-zeros.
            rebuilt = np.zeros((n, n))
            for i, p in enumerate(plans):
                assert isinstance(p, NeighborPlan)
                rebuilt[i, i] = p.self_weight
                rebuilt[i, list(p.src_weights)] = list(p.src_weights.values())
                assert p.src_ranks == tuple(sorted(p.src_weights)), where
            np.testing.assert_allclose(rebuilt, w, rtol=0, atol=1e-15, err_msg=where)
            off = w != 0
            np.fill_diagonal(off, False)
            for i, p in enumerate(plans):
                assert set(p.src_weights) == set(np.flatnonzero(off[i])), where
                assert p.dst_ranks == tuple(np.flatnonzero(off[:, i])), where
            # Sends match receives across ranks: j sends to i iff i receives from j.
            sends = {(j, i) for j in range(n) for i in plans[j].dst_ranks}
            receives = {(j, i) for i in range(n) for j in plans[i].src_weights}
            assert sends == receives, where
            # Executing the plans is one step of x <- W x.
            x = rng.standard_normal((n, 3))
            y = np.array(
                [
                    p.self_weight * x[i] + sum(v * x[j] for j, v in p.src_weights.items())
                    for i, p in enumerate(plans)
                ]
            )
            np.testing.assert_allclose(y, w @ x, atol=1e-12, err_msg=where)


def test_plan_examples() -> None:
    assert plan(get_topology("ring", 4), 1, 0) == NeighborPlan(0.5, {0: 0.5}, (0,))
    assert plan(get_topology("exp", 8), 3, 0) == NeighborPlan(0.5, {2: 0.5}, (2,))
    p = plan(get_topology("exponential-2", 8), 0, 0)
    assert p == NeighborPlan(0.25, {4: 0.25, 6: 0.25, 7: 0.25}, (1, 2, 4))
    assert plan(get_topology("complete", 1), 0, 0) == NeighborPlan(1.0, {}, ())


def test_known_names() -> None:
    assert set(known_topologies()) >= NAMES
    for name in NAMES:
        assert get_topology(name, 4, **({"local_size": 2} if "alternating" in name else {}))
    assert topology_options("alternating-exp-ring") == ("local_size",)
    assert topology_options("exponential") == ("base",)
    assert topology_options("exponential-2") == ()


def test_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown topology 'torus'; known: ") as info:
        get_topology("torus", 4)
    for name in NAMES:
        assert name in str(info.value)


def test_names_are_case_and_underscore_insensitive() -> None:
    assert get_topology("Alternating_Exp_Ring", 4, local_size=2).name == "alternating-exp-ring"
    assert get_topology("FULLY_CONNECTED", 3).name == "fully-connected"


def test_unknown_option_is_refused_with_the_accepted_ones() -> None:
    with pytest.raises(ValueError, match=r"topology 'ring' does not take \['base'\]; it takes: no"):
        get_topology("ring", 4, base=2)
    with pytest.raises(ValueError, match=r"'star' does not take \['centre'\]; it takes: center"):
        get_topology("star", 4, centre=1)


def test_instances_pass_through() -> None:
    topo = get_topology("exp", 8)
    assert get_topology(topo, 8) is topo
    with pytest.raises(ValueError, match="world size 8 was given for world size 4"):
        get_topology(topo, 4)
    with pytest.raises(ValueError, match=r"options \['base'\] cannot apply"):
        get_topology(topo, 8, base=3)


def test_rank_and_step_are_checked() -> None:
    for name in ("exp", "exponential-2"):
        topo = get_topology(name, 4)
        with pytest.raises(ValueError, match="rank 4 is out of range"):
            plan(topo, 4, 0)
        with pytest.raises(ValueError, match="step must be >= 0, got -2"):
            plan(topo, 0, -2)
        with pytest.raises(ValueError, match="step must be >= 0, got -1"):
            mixing_matrix(topo, -1)
    with pytest.raises(TypeError, match="expected a topology"):
        mixing_matrix("exp", 0)  # type: ignore[arg-type]

"""Every built-in topology with the options worth sweeping, for the topology tests."""

from __future__ import annotations

from totalreduce.topology import (
    Graph,
    MixingTopology,
    OnePeerGraph,
    get_topology,
)

SIZES = range(1, 34)
POWERS_OF_TWO = [1, 2, 4, 8, 16, 32]


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def edge_cases(n: int) -> list[tuple[str, dict[str, object]]]:
    cases: list[tuple[str, dict[str, object]]] = [("complete", {}), ("ring", {}), ("exp", {})]
    cases.append(("one-peer-exp", {}))
    cases += [("alternating-exp-ring", {"local_size": d}) for d in divisors(n)]
    return cases


def graph_cases(n: int) -> list[tuple[str, dict[str, object]]]:
    cases: list[tuple[str, dict[str, object]]] = [
        ("exponential-2", {}),
        ("exponential", {}),
        ("exponential", {"base": 3}),
        ("exponential", {"base": 5}),
        ("symmetric-exponential", {}),
        ("symmetric-exponential", {"base": 2}),
        ("mesh-grid-2d", {}),
        ("mesh-grid-2d", {"shape": (1, n)}),
        ("star", {}),
        ("star", {"center": n - 1}),
        ("ring-graph", {}),
        ("ring-graph", {"style": "left"}),
        ("ring-graph", {"style": "right"}),
        ("fully-connected", {}),
    ]
    return cases


def all_topologies(n: int) -> list[MixingTopology]:
    """Every case for ``n`` ranks, the one-peer rotation of every graph included."""
    out: list[MixingTopology] = []
    for name, options in edge_cases(n) + graph_cases(n):
        topo = get_topology(name, n, **options)
        out.append(topo)
        if isinstance(topo, Graph):
            out.append(OnePeerGraph(topo))
    return out


def label(topo: MixingTopology) -> str:
    return repr(topo)

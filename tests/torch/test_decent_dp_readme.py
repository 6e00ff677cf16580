"""Decent-DP's README example, imports changed, at P=4 under mpiexec: it trains and converges
on each of Decent-DP's topologies (decent_dp_readme.py), and over MPI every rank's
parameters are those of Decent-DP's algorithm (decent_dp_parity.py).

All of it is one launch of run_scripts.py at 4 ranks, shared with other modules' checks at
that size (torch_launches.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from conftest import import_torch

import_torch()

from torch_launches import lines, plan  # noqa: E402

TIMEOUT = 180
TOPOLOGIES = {
    "complete": [],
    "ring": [],
    "one-peer-exp": [],
    "alternating-exp-ring": ["2"],  # two nodes of two ranks: Decent-DP's schedule proper
}

pytestmark = pytest.mark.skipif(
    not (Path(sys.executable).parent / "mpiexec").exists(),
    reason="no mpiexec beside this python (install the mpich wheel)",
)

for _topology, _extra in TOPOLOGIES.items():
    plan(4, f"decent_dp_readme.py:{_topology}", "decent_dp_readme.py", [_topology, *_extra], 60)
plan(4, "decent_dp_parity.py", "decent_dp_parity.py", [], 60)


@pytest.mark.parametrize("topology", sorted(TOPOLOGIES))
def test_decent_dp_readme_example_converges(topology: str) -> None:
    out, whole = lines(4, f"decent_dp_readme.py:{topology}")
    for r in range(4):
        assert f"README {topology} OK rank {r} " in out, whole


def test_decent_dp_over_mpi_gives_decent_dp_s_numbers() -> None:
    out, whole = lines(4, "decent_dp_parity.py")
    for topology in TOPOLOGIES:
        for r in range(4):
            assert f"PARITY {topology} OK rank {r} " in out, whole

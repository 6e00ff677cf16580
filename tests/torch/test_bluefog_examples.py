"""BlueFog's examples and calls, ported by changing their imports, at P=4 as two machines.

bluefog_examples.py reproduces ``pytorch_average_consensus.py`` for every topology and flag
and ``pytorch_optimization.py`` for every method and topology; bluefog_api.py checks the
other ``bluefog.torch`` calls (static defaults, machine topologies and
``hierarchical_neighbor_allreduce``, ``neighbor_allgather``, ``Infer*``, utilities) and
bluefog_optimizers.py one step of each of BlueFog's distributed optimizers.  All run in the
one launch of bluefog_launch.py, with BlueFog's seed snippets and window examples.
A default run takes the representative cases of the examples (one topology's consensus in
every mode, each optimization method once: ``bluefog_examples.REPRESENTATIVE``); ``--full``
takes every case.
"""

from __future__ import annotations

import pytest

from conftest import import_torch

import_torch()

from bluefog_examples import LABELS, representative  # noqa: E402
from bluefog_launch import lines, needs_mpiexec  # noqa: E402

pytestmark = needs_mpiexec

API_CHECKS = ("static-defaults", "networkx", "machines", "allgather-infer", "utilities")
OPTIMIZER_CHECKS = (
    "adapt-with-combine",
    "neighbor-allreduce",
    "allreduce",
    "hierarchical",
    "adapt-then-combine",
    "adapt-then-combine allreduce",
    "gradient-allreduce",
    "empty",
    "every second step",
    "dynamic knobs",
    "registered step",
    "adam adapt-then-combine",
    "guards",
)


@pytest.mark.parametrize(
    "label",
    [label if representative(label) else pytest.param(label, marks=pytest.mark.full)
     for label in LABELS],
)  # fmt: skip
def test_bluefog_example_case(label: str) -> None:
    out, whole = lines("bluefog_examples")
    ok = [ln for ln in out.splitlines() if ln.startswith(f"CASE {label} OK ")]
    failed = [ln for ln in out.splitlines() if ln.startswith(f"CASE {label} FAILED:")]
    assert not failed and len(ok) == 4, "\n".join(failed) + f"\n{whole}"
    assert out.count("EXAMPLES DONE") == 4 and "failed=0" in out, whole


@pytest.mark.parametrize("check", API_CHECKS)
def test_bluefog_torch_calls(check: str) -> None:
    out, whole = lines("bluefog_api")
    if f"API {check} SKIPPED" in out:
        pytest.skip(out.split(f"API {check} SKIPPED", 1)[1].splitlines()[0])
    for rank in range(4):
        assert f"API {check} OK rank {rank}" in out, whole


@pytest.mark.parametrize("check", OPTIMIZER_CHECKS)
def test_bluefog_optimizers(check: str) -> None:
    out, whole = lines("bluefog_optimizers")
    for rank in range(4):
        assert f"OPTIMIZER {check} OK rank {rank}" in out, whole

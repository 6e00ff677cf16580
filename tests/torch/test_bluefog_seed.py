"""BlueFog's snippets (set_topology, load_topology, neighbor ranks, the positional order,
the dynamic one-peer loop, ``allreduce(average=)``) and Decent-DP's registration run with
only their import lines changed, at P=4 under ``mpiexec`` (bluefog_seed.py, in the shared
launch of bluefog_launch.py)."""

from __future__ import annotations

from conftest import import_torch

import_torch()

from bluefog_launch import lines, needs_mpiexec  # noqa: E402


@needs_mpiexec
def test_the_seed_snippets_run_with_the_import_changed() -> None:
    out, whole = lines("bluefog_seed")
    for rank in range(4):
        assert f"SEED OK {rank}" in out, whole

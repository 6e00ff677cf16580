"""BlueFog's window examples (push-sum consensus, put/get/accumulate/update,
``DistributedWinPutOptimizer``) with the import changed, at P=4 under ``mpiexec``."""

from __future__ import annotations

from conftest import import_torch

import_torch()

from bluefog_launch import lines, needs_mpiexec, stderr  # noqa: E402


@needs_mpiexec
def test_window_examples_run_at_p4_with_a_rank_stalled() -> None:
    """All three examples at P=4 (bluefog_windows.py in the shared launch of
    bluefog_launch.py: each start of four torch processes on a small machine costs
    seconds).  Rank 3 sleeps 1.5 s before its asynchronous push-sum rounds (a descheduled
    process): the others run theirs without it, so x/p after them is off by up to ~0.9
    (the check that CI once failed at 2.1e-6 would fail); mass is still kept exactly, and
    the synchronous rounds bring x/p within the bound that their number gives."""
    out, whole = lines("bluefog_windows")
    for rank in range(4):
        assert f"PUSH-SUM OK {rank}" in out, whole
        assert f"WINDOWS OK {rank} of 4" in out, whole
        assert f"WIN PUT OPTIMIZER OK {rank}" in out, whole
    err = stderr()
    assert "Traceback" not in err and "ERROR" not in err, err

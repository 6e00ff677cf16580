"""The stall inspector names the rank that is behind; stall_shutdown_s ends the wait everywhere."""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest

import totalreduce as tr
from conftest import local_services, run_ranks


def test_stall_warning_names_the_rank_that_never_submitted(caplog) -> None:
    """A ring of 4 where rank 2 never submits: every other rank's warning names rank 2."""
    caplog.set_level(logging.WARNING, logger="totalreduce.engine")

    def rank_main(svc):
        if svc.rank == 2:
            time.sleep(2.5)
            return None
        h = svc.allreduce_async(np.ones(8), name="stuck", algorithm="ring")
        with pytest.raises(tr.OpTimeoutError):
            h.wait(timeout=2.0)
        return h

    with local_services(4, stall_warning_s=1.0) as svcs:
        run_ranks(svcs, rank_main, timeout=30)
        warnings = [r.getMessage() for r in caplog.records if "made no progress" in r.getMessage()]
        for s in svcs:  # let the ops end before shutdown
            s.abort("stuck", 0, "test over")
    for rank in (0, 1, 3):
        mine = [w for w in warnings if w.startswith(f"rank {rank}:")]
        assert mine, warnings
        assert "op 'stuck' generation 0" in mine[0]
        assert "ranks [2] have not submitted it" in mine[0], mine[0]


def test_stall_shutdown_fails_the_op_on_every_rank() -> None:
    def rank_main(svc):
        if svc.rank == 2:
            time.sleep(3.0)  # submits long after the others gave up: it fails too
        t0 = time.monotonic()
        with pytest.raises(tr.OpTimeoutError) as info:
            svc.allreduce(np.ones(8), name="late", algorithm="ring")
        return str(info.value), time.monotonic() - t0

    with local_services(4, stall_warning_s=60, stall_shutdown_s=1.0) as svcs:
        results = run_ranks(svcs, rank_main, timeout=30)
    for rank, (msg, took) in enumerate(results):
        assert "op 'late' generation 0" in msg
        if rank != 2:
            assert "ranks [2] have not submitted it" in msg, msg
            assert took < 5


def test_a_peer_that_shuts_down_fails_the_ops_it_was_part_of() -> None:
    with local_services(2) as svcs:
        h = svcs[0].allreduce_async(np.ones(4), name="orphan")
        svcs[1].shutdown(timeout=0)
        with pytest.raises(tr.OpFailedError, match="rank 1 stopped"):
            h.wait(timeout=10)
        with pytest.raises(tr.OpFailedError, match="rank 1 stopped"):
            svcs[0].allreduce(np.ones(4), name="after")

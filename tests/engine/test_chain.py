"""Chains of schedules: an op submitted to start when another op of its rank completes."""

from __future__ import annotations

import numpy as np
import pytest

import totalreduce as tr
from conftest import local_services, run_ranks


def test_a_chained_phase_waits_for_the_first_and_reads_its_output() -> None:
    X = np.arange(4 * 6, dtype=np.float64).reshape(4, 6)

    def rank_main(svc):
        out = svc.hierarchical_neighbor_allreduce(X[svc.rank], name="h", topology="ring",
                                                  local_size=2)  # fmt: skip
        assert not svc.loop.ops.held  # nothing left waiting
        return out

    with local_services(4) as svcs:
        results = run_ranks(svcs, rank_main)
    nodes = X.reshape(2, 2, -1).mean(axis=1)
    for r in range(4):  # two nodes on a ring: each averages itself and the other
        np.testing.assert_allclose(results[r], nodes.mean(axis=0), atol=1e-12)


def test_a_chained_phase_fails_when_the_first_fails() -> None:
    def rank_main(svc):
        h = svc.hierarchical_neighbor_allreduce_async(np.ones(5), name="h", local_size=2)
        if svc.rank == 0:
            svc.abort("h#node", 0, "rank 0 gives up")
        with pytest.raises(tr.OpFailedError) as info:
            h.wait(timeout=20)
        return str(info.value)

    with local_services(4) as svcs:
        texts = run_ranks(svcs, rank_main, timeout=60)
        assert all(not s.loop.ops.held for s in svcs)
    for text in texts:
        assert "rank 0 gives up" in text, text

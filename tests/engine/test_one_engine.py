"""One engine: the compiled lane runs every op, and nothing silently means another.

``TOTALREDUCE_LANE=0`` (which once chose the interpreted loop) is refused; an op the lane
has no plan for fails on every rank of its group, naming the op and why.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

import totalreduce as tr
from conftest import local_services, run_ranks
from totalreduce.service.config import Config


def test_turning_the_lane_off_is_refused() -> None:
    for off in ("0", "false", "off"):
        with pytest.raises(tr.InvalidArgumentError, match="TOTALREDUCE_LANE.*unset"):
            Config.load(env={"TOTALREDUCE_LANE": off})
    with pytest.raises(tr.InvalidArgumentError, match="unknown option"):
        Config.load(env={}, lane=False)


def test_turning_it_on_is_ignored_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="totalreduce"):
        Config.load(env={"TOTALREDUCE_LANE": "1", "TOTALREDUCE_MAX_INFLIGHT_SENDS": "2"})
    said = [r.getMessage() for r in caplog.records]
    assert any("TOTALREDUCE_LANE=1 is ignored" in m for m in said), said
    assert any("TOTALREDUCE_MAX_INFLIGHT_SENDS is ignored" in m for m in said), said
    with pytest.raises(tr.InvalidArgumentError, match="unknown option"):
        Config.load(env={}, inline_compute_bytes=0)


def test_an_op_without_a_plan_fails_on_every_rank_naming_why() -> None:
    """Bodies of large segments need tags of their own: on an MPI whose MPI_TAG_UB is too
    small for them (as set here), a large op fails on both ranks with the reason, and small
    ops (eager segments only) still run."""
    with local_services(2) as svcs:
        for s in svcs:
            lane = s.loop.lane
            assert lane is not None
            lane.body_tag, lane.tag_ub = -1, 32767

        def body(s):  # type: ignore[no-untyped-def]
            with pytest.raises(tr.OpFailedError) as info:
                s.allreduce(np.ones(1 << 17), name="large")  # 1 MiB: large segments
            small = s.allreduce(np.ones(8), name="small")
            return str(info.value), small

        results = run_ranks(svcs, body, timeout=60)
    for text, small in results:
        assert "op 'large' generation 0" in text and "MPI_TAG_UB is 32767" in text, text
        np.testing.assert_array_equal(small, 2 * np.ones(8))

"""An idle service must not spin: its loop sleeps with a growing backoff."""

from __future__ import annotations

import time

import numpy as np

from conftest import local_services


def test_idle_loop_backs_off() -> None:
    with local_services(2) as svcs:
        svcs[0].allreduce_async(np.ones(4), name="warm")
        svcs[1].allreduce(np.ones(4), name="warm")
        time.sleep(0.2)
        before = svcs[0].loop.stats.passes
        time.sleep(1.0)
        passes = svcs[0].loop.stats.passes - before
    # idle backoff tops out at 5 ms: about 200 passes a second; a spinning
    # loop would make hundreds of thousands
    assert passes < 1000, passes

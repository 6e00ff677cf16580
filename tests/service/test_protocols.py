"""The handle and service protocols: what the API and the torch layer rely on."""

from __future__ import annotations

import numpy as np

import totalreduce as tr
from conftest import local_services, run_ranks
from totalreduce.service.handle import Handle, HandleLike, ServiceLike, done_handle


def test_embedded_handle_and_service_satisfy_the_protocols() -> None:
    def rank_main(svc):
        assert isinstance(svc, ServiceLike)
        h = svc.allreduce_async(np.ones(4), name="proto")
        assert isinstance(h, Handle) and isinstance(h, HandleLike)
        return h.wait()

    with local_services(2) as svcs:
        results = run_ranks(svcs, rank_main)
    for r in results:
        np.testing.assert_array_equal(r, np.full(4, 2.0))


def test_a_complete_handle_satisfies_the_protocol() -> None:
    h = done_handle("x", 7)
    assert isinstance(h, HandleLike)
    assert tr.poll(h) and tr.synchronize(h) == 7


def test_what_is_not_a_handle_or_service() -> None:
    assert not isinstance(object(), HandleLike)
    assert not isinstance(np.ones(3), HandleLike)
    assert not isinstance(object(), ServiceLike)

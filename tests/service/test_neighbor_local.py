"""Neighbor averaging through the engine (local transport): W x for every topology,
dynamic weights, pattern mismatches, neighbor all-gather, hierarchical, consensus."""

from __future__ import annotations

import numpy as np
import pytest

import totalreduce as tr
from conftest import local_services, run_ranks
from totalreduce.topology import get_topology, mixing_matrix, one_peer_dynamic, rho

GRAPHS = [
    "exponential-2",
    "exponential",
    "symmetric-exponential",
    "mesh-grid-2d",
    "star",
    "ring-graph",
    "fully-connected",
]
EDGES = ["complete", "ring", "exp"]


def start_values(p: int, n: int) -> np.ndarray:
    return np.random.default_rng(p).standard_normal((p, n))


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("name", GRAPHS + EDGES)
def test_one_call_equals_w_times_x(p: int, name: str) -> None:
    X = start_values(p, 33)
    topo = get_topology(name, p)

    def rank_main(svc):
        out = []
        for _ in range(3):  # steps 0, 1, 2: step defaults to the generation
            out.append(svc.neighbor_allreduce(X[svc.rank], name="x", topology=name))
        return out

    with local_services(p) as svcs:
        results = run_ranks(svcs, rank_main)
    for step in range(3):
        want = mixing_matrix(topo, step) @ X
        got = np.stack([results[r][step] for r in range(p)])
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("p,local", [(4, 2), (8, 2), (6, 3)])
def test_alternating_exp_ring_object(p: int, local: int) -> None:
    topo = get_topology("alternating-exp-ring", p, local_size=local)
    X = start_values(p, 10)

    def rank_main(svc):
        return [svc.neighbor_allreduce(X[svc.rank], name="w", topology=topo) for _ in range(4)]

    with local_services(p) as svcs:
        results = run_ranks(svcs, rank_main)
    for step in range(4):
        want = mixing_matrix(topo, step) @ X
        np.testing.assert_allclose(np.stack([r[step] for r in results]), want, atol=1e-12)


def test_dynamic_one_peer_weights_and_dst_weights() -> None:
    p = 8
    graph = get_topology("exponential-2", p)
    X = start_values(p, 16)

    def rank_main(svc):
        it = one_peer_dynamic(graph, svc.rank)
        x = X[svc.rank].copy()
        for _ in range(3):  # log2(8) one-peer steps average exactly
            send_to, recv_from = next(it)
            w = 1.0 / (len(recv_from) + 1)
            x = svc.neighbor_allreduce(
                x,
                name="dyn",
                self_weight=w,
                src_weights={r: w for r in recv_from},
                dst_weights=send_to,
            )
        # dst_weights scale what is sent: receivers see 2 * x_j with weight 0.25
        y = svc.neighbor_allreduce(
            X[svc.rank],
            name="scaled",
            self_weight=0.5,
            src_weights={(svc.rank - 1) % p: 0.25},
            dst_weights={(svc.rank + 1) % p: 2.0},
        )
        return x, y

    with local_services(p) as svcs:
        results = run_ranks(svcs, rank_main)
    mean = X.mean(axis=0)
    for r in range(p):
        np.testing.assert_allclose(results[r][0], mean, atol=1e-12)
        np.testing.assert_allclose(results[r][1], 0.5 * X[r] + 0.5 * X[(r - 1) % p], atol=1e-12)


def test_mismatched_pattern_is_reported_not_hung() -> None:
    p = 3

    def rank_main(svc):
        # rank 0 expects data from rank 1, but rank 1 sends to nobody
        src = {1: 0.5} if svc.rank == 0 else {}
        h = svc.neighbor_allreduce_async(
            np.ones(4), name="bad", self_weight=0.5, src_weights=src, dst_weights=[]
        )
        try:
            h.wait(timeout=10)
            return ""
        except tr.OpMismatchError as exc:
            return str(exc)

    with local_services(p) as svcs:
        msgs = run_ranks(svcs, rank_main, timeout=30)
    # rank 0 always learns it; ranks 1 and 2 too unless their (empty) patterns finished first
    assert "rank 0 receives from rank 1" in msgs[0], msgs
    assert all(m == "" or "rank 0 receives from rank 1" in m for m in msgs[1:]), msgs


def test_neighbor_allgather() -> None:
    p = 5

    def rank_main(svc):
        x = np.full((2, 3), float(svc.rank))
        ring = svc.neighbor_allgather(x, name="ring", topology="ring-graph")
        given = svc.neighbor_allgather(
            x, name="given", src_ranks=[(svc.rank + 1) % p], dst_ranks=[(svc.rank - 1) % p]
        )
        return ring, given

    with local_services(p) as svcs:
        results = run_ranks(svcs, rank_main)
    for r in range(p):
        ring, given = results[r]
        srcs = sorted({(r - 1) % p, (r + 1) % p})
        assert ring.shape == (2, 2, 3)
        for k, s in enumerate(srcs):
            np.testing.assert_array_equal(ring[k], np.full((2, 3), float(s)))
        np.testing.assert_array_equal(given[0], np.full((2, 3), float((r + 1) % p)))


@pytest.mark.parametrize("machine", ["exponential-2", "ring"])
def test_hierarchical(machine: str) -> None:
    p, local = 8, 2
    X = start_values(p, 12)
    nodes = p // local
    topo = get_topology(machine, nodes)

    def rank_main(svc):
        return svc.hierarchical_neighbor_allreduce(
            X[svc.rank], name="h", topology=machine, local_size=local
        )

    with local_services(p) as svcs:
        results = run_ranks(svcs, rank_main)
    node_avg = X.reshape(nodes, local, -1).mean(axis=1)
    want = mixing_matrix(topo, 0) @ node_avg
    for r in range(p):
        np.testing.assert_allclose(results[r], want[r // local], atol=1e-12)


def test_consensus_rate_follows_rho() -> None:
    p = 8
    name = "ring-graph"
    W = mixing_matrix(get_topology(name, p), 0)
    bound = rho(W)
    X = start_values(p, 64)

    def rank_main(svc):
        x = X[svc.rank].copy()
        errs = []
        for _ in range(10):
            x = svc.neighbor_allreduce(x, name="c", topology=name)
            errs.append(x)
        return errs

    with local_services(p) as svcs:
        results = run_ranks(svcs, rank_main)
    mean = X.mean(axis=0)
    e0 = np.linalg.norm(X - mean)
    for k in range(10):
        ek = np.linalg.norm(np.stack([results[r][k] for r in range(p)]) - mean)
        assert ek <= bound ** (k + 1) * e0 * (1 + 1e-9)


def test_integer_arrays_refused() -> None:
    with local_services(2) as svcs:
        with pytest.raises(tr.InvalidArgumentError, match="floating-point"):
            svcs[0].neighbor_allreduce_async(np.ones(3, dtype=np.int64), topology="ring-graph")


@pytest.mark.parametrize("machine", ["exponential-2", "ring", "exp"])
def test_hierarchical_walks_the_machine_topology(machine: str) -> None:
    # Both phases are compiled at the call: every generation uses its own step.
    p, local, steps = 8, 2, 3
    X = start_values(p, 10)
    nodes = p // local
    topo = get_topology(machine, nodes)

    def rank_main(svc):
        handles = [
            svc.hierarchical_neighbor_allreduce_async(
                X[svc.rank], name="hw", topology=machine, local_size=local
            )
            for _ in range(steps)
        ]
        return [h.wait() for h in handles]

    with local_services(p) as svcs:
        results = run_ranks(svcs, rank_main)
    node_avg = X.reshape(nodes, local, -1).mean(axis=1)
    for t in range(steps):
        want = mixing_matrix(topo, t) @ node_avg
        for r in range(p):
            np.testing.assert_allclose(results[r][t], want[r // local], atol=1e-12)

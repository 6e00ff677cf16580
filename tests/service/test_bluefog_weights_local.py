"""BlueFog's weight forms through the engine (local transport): ``src_weights`` alone on a
topology, a rank paired with itself, and ``hierarchical_neighbor_allreduce``'s machine
weights (every rank of a node passing the same)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import totalreduce as tr
from conftest import local_services, run_ranks
from totalreduce import topology as topology_util


def start_values(p: int, n: int) -> np.ndarray:
    return np.random.default_rng(7 + p).standard_normal((p, n))


def test_src_weights_alone_send_to_the_topologys_out_neighbors() -> None:
    # exponential-2 over 4: rank r receives from r-1 and r-2 and sends to r+1 and r+2.
    # Each rank weighs only r-1 (r-2 still sends: its weight is 0).
    p = 4
    X = start_values(p, 6)

    def rank_main(svc):
        r = svc.rank
        return svc.neighbor_allreduce(
            X[r], name="a", topology="exponential-2", self_weight=0.25,
            src_weights={(r - 1) % p: 0.75},
        )  # fmt: skip

    with local_services(p) as svcs:
        got = run_ranks(svcs, rank_main)
    for r in range(p):
        np.testing.assert_allclose(got[r], 0.25 * X[r] + 0.75 * X[(r - 1) % p], atol=1e-12)


def test_src_weights_naming_a_stranger_is_refused() -> None:
    with local_services(4) as svcs:
        with pytest.raises(tr.InvalidArgumentError, match=r"src_weights name ranks \[1\] that are"):
            svcs[0].neighbor_allreduce_async(  # the right ring: rank 0 receives from 3 only
                np.ones(3), topology=topology_util.RingGraph(4, 2), self_weight=0.5,
                src_weights={1: 0.5},
            )  # fmt: skip


def test_a_rank_paired_with_itself_keeps_that_share() -> None:
    # BlueFog's inner-outer ring on one machine of 4: at each step the rank "talking
    # outside" sends to and receives from itself, the others form a ring of 3.
    p, steps = 4, 5
    X = start_values(p, 5)

    def rank_main(svc):
        gen = topology_util.GetInnerOuterRingDynamicSendRecvRanks(p, p, svc.rank)
        x, out = X[svc.rank].copy(), []
        for send, recv in itertools.islice(gen, steps):
            w = 1 / (len(recv) + 1)
            x = svc.neighbor_allreduce(
                x, name="io", self_weight=w, src_weights={r: w for r in recv}, dst_weights=send
            )
            out.append(x.copy())
        return out

    with local_services(p) as svcs:
        got = run_ranks(svcs, rank_main)
    x = X.copy()
    for t in range(steps):
        outside = t % p
        ring = [(outside + 1 + j) % p for j in range(p - 1)]
        new = x.copy()
        for k, r in enumerate(ring):  # r receives from the ring's previous member
            new[r] = 0.5 * x[r] + 0.5 * x[ring[k - 1]]
        x = new
        for r in range(p):
            np.testing.assert_allclose(got[r][t], x[r], atol=1e-12)


def test_a_rank_on_one_side_of_itself_only_is_refused() -> None:
    with local_services(2) as svcs:
        with pytest.raises(tr.InvalidArgumentError, match="rank 0 is in its own dst_weights but"):
            svcs[0].neighbor_allreduce_async(
                np.ones(3), self_weight=0.5, src_weights={1: 0.5}, dst_weights=[0, 1]
            )


@pytest.mark.parametrize("local", [1, 2])
def test_hierarchical_with_machine_weights(local: int) -> None:
    # BlueFog's dynamic machine schedule: every node sends to one node per step, scaled by
    # dst_machine_weights; the node's ranks all pass the same machine weights.
    p, steps = 8, 4
    nodes = p // local
    X = start_values(p, 7)

    def rank_main(svc):
        gen = topology_util.GetExp2DynamicSendRecvMachineRanks(p, local, svc.rank, svc.rank % local)
        x, out = X[svc.rank].copy(), []
        for _ in range(steps):
            (send,), (recv,) = next(gen)
            x = svc.hierarchical_neighbor_allreduce(
                x, name="hm", local_size=local, self_weight=0.5,
                src_machine_weights={recv: 0.25}, dst_machine_weights={send: 2.0},
            )  # fmt: skip
            out.append(x.copy())
        return out

    with local_services(p) as svcs:
        got = run_ranks(svcs, rank_main)
    hops = (nodes - 1).bit_length()  # the powers of two up to nodes - 1
    v = X.reshape(nodes, local, -1).mean(axis=1)
    for t in range(steps):
        d = 2 ** (t % hops)
        v = np.stack([0.5 * v[m] + 0.25 * 2.0 * v[(m - d) % nodes] for m in range(nodes)])
        for r in range(p):
            np.testing.assert_allclose(got[r][t], v[r // local], atol=1e-12)


def test_machine_weights_are_checked_at_the_call() -> None:
    with local_services(4) as svcs:
        svc = svcs[0]
        h = svc.hierarchical_neighbor_allreduce_async
        with pytest.raises(tr.InvalidArgumentError, match="give self_weight, src_machine_weights"):
            h(np.ones(2), local_size=2, self_weight=0.5, src_machine_weights={1: 0.5})
        with pytest.raises(tr.InvalidArgumentError, match="machine weights replace the topology"):
            h(np.ones(2), local_size=2, topology="ring", self_weight=0.5,
              src_machine_weights={1: 0.5}, dst_machine_weights=[1])  # fmt: skip
        with pytest.raises(tr.InvalidArgumentError, match="machine 2 is not one of the 2 machines"):
            h(np.ones(2), local_size=2, self_weight=0.5, src_machine_weights={1: 0.5},
              dst_machine_weights=[2])  # fmt: skip

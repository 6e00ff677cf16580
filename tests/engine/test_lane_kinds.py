"""Every op kind on the compiled lane, over the in-process transport: the route, then the
numbers.

Neighbor averaging (BlueFog's weighted neighbours, Decent-DP's edges), neighbor
all-gather, all-to-all (equal and uneven parts), reduce, gather, scatter, send/recv and
the pairwise exchange run in the lane, as allreduces do: each test asserts that the lane
ran every op it submitted (``ops_done``) and the main loop none, then checks the results
against numpy, for every element type an op of its kind takes, small (eager frames) and
large (bodies on tags of their own).
"""

from __future__ import annotations

import time

import numpy as np
import pytest

import totalreduce as tr
from conftest import local_services, run_ranks
from totalreduce.service.service import Service

#: Small (eager frames), one above micro_bytes (64 KiB of float64: bodies).
SIZES = [0, 5, 10_000]
ALL_TYPES = ["float32", "float64", "int32", "int64", "int16", "int8", "uint8", "bool", "float16"]
FLOATS = ["float32", "float64", "float16"]


def values(k: int, n: int, dtype: str, rank: int) -> np.ndarray:
    v = (np.arange(n, dtype=np.int64) * 7 + 3 * rank + k) % 11
    return (v % 2 == 1) if dtype == "bool" else v.astype(dtype)


class Route:
    """Counts of ops the lane completed on one rank, and of ops completed in all."""

    def __init__(self, svc: Service) -> None:
        self.svc = svc
        lane = svc.loop.lane
        assert lane is not None, "the lane is off"
        self.lane0 = lane.stats()["ops_done"]
        self.all0 = svc.loop.stats.ops_completed

    def lane_ran(self) -> tuple[int, int]:
        """(ops the lane ran, ops in all) since made (``check_route``: the same)."""
        lane = self.svc.loop.lane
        assert lane is not None
        return lane.stats()["ops_done"] - self.lane0, self.svc.loop.stats.ops_completed - self.all0


def check_route(results: list) -> None:
    for r, (_, (lane, total)) in enumerate(results):
        assert total > 0 and lane == total, f"rank {r}: the lane ran {lane} of {total} ops"


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_neighbor_ops_run_in_the_lane(p: int) -> None:
    """A ring with BlueFog's weights (each rank also sends to its left neighbour scaled),
    and the neighbor all-gather of the same ring."""

    def rank_main(s):
        route = Route(s)
        left, right = (s.rank - 1) % p, (s.rank + 1) % p
        srcs = sorted({left, right} - {s.rank})
        out = {}
        for dt in FLOATS:
            for n in SIZES:
                x = values(1, n, dt, s.rank)
                w = {j: 0.25 for j in srcs}
                out[("nar", dt, n)] = s.neighbor_allreduce_async(
                    x, name=f"nar.{dt}.{n}", self_weight=1.0 - 0.25 * len(srcs),
                    src_weights=w, dst_weights=srcs,
                )  # fmt: skip
        for dt in ALL_TYPES:
            for n in SIZES:
                x = values(2, n, dt, s.rank)
                out[("nag", dt, n)] = s.neighbor_allgather_async(
                    x, name=f"nag.{dt}.{n}", src_ranks=srcs, dst_ranks=srcs
                )
        got = {k: h.wait(timeout=60) for k, h in out.items()}
        return got, route.lane_ran()

    with local_services(p) as svcs:
        results = run_ranks(svcs, rank_main, timeout=240)
    check_route(results)
    for r, (got, _) in enumerate(results):
        srcs = sorted({(r - 1) % p, (r + 1) % p} - {r})
        for dt in FLOATS:
            for n in SIZES:
                want = (1.0 - 0.25 * len(srcs)) * values(1, n, "float64", r)
                for j in srcs:
                    want = want + 0.25 * values(1, n, "float64", j)
                tol = 1e-2 if dt == "float16" else 1e-5
                np.testing.assert_allclose(got[("nar", dt, n)].astype(np.float64), want,
                                           rtol=tol, atol=tol)  # fmt: skip
        for dt in ALL_TYPES:
            for n in SIZES:
                want = np.concatenate([values(2, n, dt, j) for j in srcs] or [values(2, 0, dt, 0)])
                np.testing.assert_array_equal(got[("nag", dt, n)].reshape(-1), want)


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_rooted_ops_alltoall_and_send_recv_run_in_the_lane(p: int) -> None:
    def rank_main(s):
        route = Route(s)
        hs = {}
        for dt in ALL_TYPES:
            for n in SIZES:
                x = values(3, n, dt, s.rank)
                root = n % p
                if dt != "bool" and dt != "uint8":
                    hs[("reduce", dt, n)] = s.reduce_async(x, root=root, name=f"red.{dt}.{n}")
                hs[("gather", dt, n)] = s.gather_async(x, root=root, name=f"ga.{dt}.{n}")
                big = values(4, n * p, dt, s.rank)
                mine = big if s.rank == root else np.empty_like(x)  # (elsewhere: the result)
                hs[("scatter", dt, n)] = s.scatter_async(mine, root=root, name=f"sc.{dt}.{n}")
                hs[("a2a", dt, n)] = s.alltoall_async(big, name=f"a2a.{dt}.{n}")
                splits = [(n + j + s.rank) % 7 * (n // 5 + 1) for j in range(p)]
                recv = [(n + s.rank + j) % 7 * (n // 5 + 1) for j in range(p)]
                xs = values(5, sum(splits), dt, s.rank)
                hs[("a2av", dt, n)] = s.alltoall_async(
                    xs, name=f"a2av.{dt}.{n}", splits=splits, recv_splits=recv
                )
                if p > 1:
                    right, left = (s.rank + 1) % p, (s.rank - 1) % p
                    hs[("send", dt, n)] = s.send_async(x, right, tag=n)
                    hs[("recv", dt, n)] = s.recv_async(np.empty_like(x), left, tag=n)
        got = {k: h.wait(timeout=60) for k, h in hs.items()}
        return got, route.lane_ran()

    with local_services(p) as svcs:
        results = run_ranks(svcs, rank_main, timeout=240)
    check_route(results)
    for r, (got, _) in enumerate(results):
        for dt in ALL_TYPES:
            for n in SIZES:
                root = n % p
                if ("reduce", dt, n) in got and r == root:
                    want = sum(values(3, n, dt, q).astype(np.int64) for q in range(p))
                    np.testing.assert_array_equal(got[("reduce", dt, n)], want.astype(dt))
                if r == root:
                    want = np.concatenate([values(3, n, dt, q) for q in range(p)])
                    np.testing.assert_array_equal(got[("gather", dt, n)].reshape(-1), want)
                part = values(4, n * p, dt, root)[r * n : (r + 1) * n]
                np.testing.assert_array_equal(got[("scatter", dt, n)], part)
                want = np.concatenate([values(4, n * p, dt, q)[r * n : (r + 1) * n]
                                       for q in range(p)])  # fmt: skip
                np.testing.assert_array_equal(got[("a2a", dt, n)], want)
                parts = []
                for q in range(p):
                    splits_q = [(n + j + q) % 7 * (n // 5 + 1) for j in range(p)]
                    start = sum(splits_q[:r])
                    parts.append(values(5, sum(splits_q), dt, q)[start : start + splits_q[r]])
                np.testing.assert_array_equal(got[("a2av", dt, n)], np.concatenate(parts))
                if p > 1:
                    np.testing.assert_array_equal(got[("recv", dt, n)],
                                                  values(3, n, dt, (r - 1) % p))  # fmt: skip


def test_the_pairwise_exchange_and_decent_dp_edges_run_in_the_lane() -> None:
    p = 4

    def rank_main(s):
        route = Route(s)
        hs = {}
        for n in SIZES:
            x = values(6, n, "float64", s.rank)
            hs[("pair", n)] = s.pairwise_exchange_async(x, 1, name=f"pe.{n}")
            hs[("edge", n)] = s.neighbor_allreduce_async(
                values(7, n, "float32", s.rank), name=f"edge.{n}", topology="ring"
            )
        got = {k: h.wait(timeout=60) for k, h in hs.items()}
        return got, route.lane_ran()

    with local_services(p) as svcs:
        results = run_ranks(svcs, rank_main, timeout=120)
    check_route(results)
    for r, (got, _) in enumerate(results):
        for n in SIZES:
            np.testing.assert_array_equal(got[("pair", n)], values(6, n, "float64", r ^ 1))
            assert got[("edge", n)].shape == (n,)


def test_a_mismatched_alltoall_split_raises_on_both_ranks_naming_the_counts() -> None:
    """Rank 1 says rank 0 sends it 9 elements; rank 0 sends 4.  Rank 1's wait raises naming
    both counts; rank 0, which may have finished its side first, raises at its next call."""

    def rank_main(s):
        splits = [3, 4] if s.rank == 0 else [5, 3]
        recv = [3, 5] if s.rank == 0 else [9, 3]
        texts = []
        h = s.alltoall_async(np.ones(sum(splits)), name="bad", splits=splits, recv_splits=recv)

        def later() -> None:  # a call of rank 0's alone, once rank 1's error has come
            time.sleep(0.3)
            s.allreduce(np.ones(1), group=tr.Group([s.rank]), name="after")

        for fn in (lambda: h.wait(timeout=20), later):
            try:
                fn()
            except tr.TotalReduceError as exc:
                texts.append(str(exc))
        return texts

    with local_services(2) as svcs:
        msgs = run_ranks(svcs, rank_main, timeout=60)
    for texts in msgs:
        assert any("'bad'" in t and "expects 9 elements from rank 0, which sends 4" in t
                   for t in texts), msgs  # fmt: skip


def test_hierarchical_averaging_runs_both_phases_in_the_lane() -> None:
    """The node phase, then the machine phase chained after it (``OpSpec.after``): both in
    the lane, the second started when the first ends."""
    x = np.arange(4 * 6, dtype=np.float64).reshape(4, 6)

    def rank_main(s):
        route = Route(s)
        out = [s.hierarchical_neighbor_allreduce(x[s.rank] + k, name="h", topology="ring",
                                                 local_size=2) for k in range(3)]  # fmt: skip
        assert not s.loop.ops.held
        return out, route.lane_ran()

    with local_services(4) as svcs:
        results = run_ranks(svcs, rank_main, timeout=120)
    check_route(results)
    nodes = x.reshape(2, 2, -1).mean(axis=1)
    for out, _ in results:
        for k in range(3):
            np.testing.assert_allclose(out[k], nodes.mean(axis=0) + k, atol=1e-12)


@pytest.mark.parametrize("micro", [0, 32])
def test_every_kind_runs_in_the_lane_below_64_bytes_of_micro_bytes(micro: int) -> None:
    """``micro_bytes`` under 64 (0: every body is a rendezvous) no longer sends ops to the
    main loop: allreduces of every algorithm, broadcasts, barriers, rooted ops, all-to-all,
    send/recv and neighbor averaging run in the lane, with exact results."""
    p = 3
    algorithms = ["ring", "ring_chunked", "halving_doubling", "recursive_doubling", "bcube"]

    def rank_main(s):
        route = Route(s)
        hs = {}
        for dt in ("float64", "int32"):
            for n in (0, 5, 1000):
                x = values(6, n, dt, s.rank)
                for alg in algorithms:
                    hs[("ar", alg, dt, n)] = s.allreduce_async(x, name=f"ar.{alg}.{dt}.{n}",
                                                               algorithm=alg)  # fmt: skip
                hs[("bc", dt, n)] = s.broadcast_async(x, root=n % p, name=f"bc.{dt}.{n}")
                hs[("red", dt, n)] = s.reduce_async(x, root=1, name=f"red.{dt}.{n}")
                hs[("ga", dt, n)] = s.gather_async(x, root=2, name=f"ga.{dt}.{n}")
                hs[("a2a", dt, n)] = s.alltoall_async(values(7, n * p, dt, s.rank),
                                                      name=f"a2a.{dt}.{n}")  # fmt: skip
                hs[("send", dt, n)] = s.send_async(x, (s.rank + 1) % p, tag=n)
                hs[("recv", dt, n)] = s.recv_async(np.empty_like(x), (s.rank - 1) % p, tag=n)
                if dt == "float64":
                    left, right = (s.rank - 1) % p, (s.rank + 1) % p
                    hs[("nar", dt, n)] = s.neighbor_allreduce_async(
                        x, name=f"nar.{n}", self_weight=0.5, src_weights={left: 0.5},
                        dst_weights=[right],
                    )  # fmt: skip
        hs[("barrier",)] = s.barrier_async()
        got = {k: h.wait(timeout=60) for k, h in hs.items()}
        return got, route.lane_ran()

    with local_services(p, micro_bytes=micro, segment_bytes=256) as svcs:
        results = run_ranks(svcs, rank_main, timeout=240)
    check_route(results)
    for r, (got, _) in enumerate(results):
        for dt in ("float64", "int32"):
            for n in (0, 5, 1000):
                total = sum(values(6, n, dt, q).astype(np.int64) for q in range(p)).astype(dt)
                for alg in algorithms:
                    np.testing.assert_array_equal(got[("ar", alg, dt, n)], total)
                np.testing.assert_array_equal(got[("bc", dt, n)], values(6, n, dt, n % p))
                if r == 1:
                    np.testing.assert_array_equal(got[("red", dt, n)], total)
                if r == 2:
                    want = np.concatenate([values(6, n, dt, q) for q in range(p)])
                    np.testing.assert_array_equal(got[("ga", dt, n)].reshape(-1), want)
                want = np.concatenate([values(7, n * p, dt, q)[r * n : (r + 1) * n]
                                       for q in range(p)])  # fmt: skip
                np.testing.assert_array_equal(got[("a2a", dt, n)], want)
                np.testing.assert_array_equal(got[("recv", dt, n)], values(6, n, dt, (r - 1) % p))
                if dt == "float64":
                    want = 0.5 * values(6, n, dt, r) + 0.5 * values(6, n, dt, (r - 1) % p)
                    np.testing.assert_array_equal(got[("nar", dt, n)], want)


def test_integer_neighbor_averaging_fails_on_every_rank_and_enters_no_engine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Weights on an integer buffer: the API refuses them; one that gets past it (its check
    switched off here) fails on every rank with words naming the op, the rank and the type,
    as the main loop's kernels failed it, and neither the lane nor the main loop runs it."""
    import totalreduce.service.checks as checks

    monkeypatch.setattr(checks, "floating", lambda dt: None)

    def rank_main(s):
        x = np.arange(5, dtype=np.int32) + s.rank
        other = 1 - s.rank
        h = s.neighbor_allreduce_async(
            x, name="ints", self_weight=0.5, src_weights={other: 0.5}, dst_weights=[other]
        )
        with pytest.raises(tr.OpFailedError) as info:
            h.wait(timeout=30)
        return str(info.value), s.loop.lane.stats()["ops_done"]  # it never ran

    with local_services(2) as svcs:
        results = run_ranks(svcs, rank_main, timeout=60)
    for text, main in results:
        assert main == 0
        assert "op 'ints' generation 0" in text and "rank " in text, text
        assert "neighbor averaging needs a floating dtype, got INT32" in text, text

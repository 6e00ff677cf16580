"""Every collective through the engine over the local transport: algorithms, groups,
reduce-scatter / all-gather on partitions, all mixed in flight in random orders."""

from __future__ import annotations

import random

import numpy as np
import pytest

import totalreduce as tr
from conftest import local_services, run_ranks

ALGOS = ["ring", "ring_chunked", "halving_doubling", "recursive_doubling", "bcube"]


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 6])
def test_every_allreduce_algorithm_small_segments(p: int) -> None:
    counts = [0, 1, p + 1, 1000, 3001]

    def rank_main(svc):
        out = {}
        for algo in ALGOS:
            for n in counts:
                x = np.arange(n, dtype=np.int64) * p + svc.rank
                out[algo, n] = svc.allreduce_async(x, name=f"{algo}.{n}", algorithm=algo)
        return {k: h.wait(timeout=60) for k, h in out.items()}

    with local_services(p, segment_bytes=1024, micro_bytes=256) as svcs:
        results = run_ranks(svcs, rank_main)
    for (algo, n), _ in results[0].items():
        want = np.arange(n, dtype=np.int64) * p * p + p * (p - 1) // 2
        for r in range(p):
            np.testing.assert_array_equal(results[r][algo, n], want, err_msg=f"{algo} n={n}")


@pytest.mark.parametrize("p", [2, 3, 5])
def test_broadcast_every_root_and_barriers(p: int) -> None:
    def rank_main(svc):
        got = []
        for root in range(p):
            for algo in ("one_to_all", "pipelined"):
                x = np.full(777, root * 10.0) if svc.rank == root else np.zeros(777)
                got.append(svc.broadcast(x, root=root, name=f"b.{root}.{algo}", algorithm=algo))
        svc.barrier(algorithm="all_to_one")
        svc.barrier(algorithm="all_to_all")
        return got

    with local_services(p, segment_bytes=512) as svcs:
        results = run_ranks(svcs, rank_main)
    for r in range(p):
        for i, arr in enumerate(results[r]):
            np.testing.assert_array_equal(arr, np.full(777, (i // 2) * 10.0))


def test_group_ops_leave_others_alone() -> None:
    p = 5
    grp = tr.Group([3, 1, 4])

    def rank_main(svc):
        if svc.rank in grp:
            s = svc.allreduce(np.full(10, svc.rank), group=grp, name="g")
            b = svc.broadcast(np.full(3, svc.rank), root=0, group=grp, name="gb")  # root = rank 3
            svc.barrier(group=grp)
            return s, b
        with pytest.raises(tr.InvalidArgumentError, match="not a member"):
            svc.allreduce(np.ones(3), group=grp)
        return svc.allreduce(np.ones(2), name="outside", group=tr.Group([0, 2])), None

    with local_services(p) as svcs:
        results = run_ranks(svcs, rank_main)
    for r in (1, 3, 4):
        np.testing.assert_array_equal(results[r][0], np.full(10, 8))
        np.testing.assert_array_equal(results[r][1], np.full(3, 3))
    for r in (0, 2):
        np.testing.assert_array_equal(results[r][0], np.full(2, 2.0))


def test_group_disagreement_is_reported() -> None:
    def rank_main(svc):
        grp = tr.Group([0, 1]) if svc.rank == 0 else tr.Group([0, 1, 2])
        if svc.rank == 2:
            grp = tr.Group([0, 1, 2])
        with pytest.raises(tr.OpMismatchError) as info:
            svc.allreduce(np.ones(4), group=grp, name="which")
        return str(info.value)

    with local_services(3) as svcs:
        msgs = run_ranks(svcs, rank_main, timeout=30)
    assert any("group" in m or "unexpected frame" in m for m in msgs), msgs


@pytest.mark.parametrize("p", [1, 2, 3, 4, 7])
def test_reduce_scatter_and_allgather_1d(p: int) -> None:
    def rank_main(svc):
        out = []
        for n in (0, 1, p - 1, p + 1, 1000):
            x = np.arange(n, dtype=np.int64) + 100 * svc.rank
            part = svc.reduce_scatter(x, name=f"rs.{n}")
            mine = np.arange(svc.rank * 3 + n % 5, dtype=np.float64) + svc.rank
            whole = svc.allgather(mine, name=f"ag.{n}")
            out.append((n, part, whole))
        return out

    with local_services(p, segment_bytes=256) as svcs:
        results = run_ranks(svcs, rank_main)
    for r in range(p):
        for n, part, whole in results[r]:
            total = np.arange(n, dtype=np.int64) * p + 100 * p * (p - 1) // 2
            np.testing.assert_array_equal(part, np.array_split(total, p)[r])
            want = np.concatenate(
                [np.arange(q * 3 + n % 5, dtype=np.float64) + q for q in range(p)]
            )
            np.testing.assert_array_equal(whole, want)


@pytest.mark.parametrize("p", [1, 2, 3, 5])
def test_allgather_with_counts_is_one_op(p: int) -> None:
    """Given every rank's part size (``counts``), an all-gather is one op (its sizes are not
    exchanged first): exact with uneven and empty parts; without counts it is two."""

    def rank_main(svc):
        out = []
        for n in (0, 1, 7, 1000):
            counts = [(q * 3 + n) % 11 for q in range(p)]
            mine = np.arange(counts[svc.rank], dtype=np.float32) + 10 * svc.rank
            before = svc.loop.stats.ops_completed
            given = svc.allgather(mine, name=f"agc.{n}", counts=counts)
            one = svc.loop.stats.ops_completed - before
            before = svc.loop.stats.ops_completed
            exchanged = svc.allgather(mine, name=f"agx.{n}")
            two = svc.loop.stats.ops_completed - before
            out.append((counts, given, exchanged, one, two))
        return out

    with local_services(p, segment_bytes=256) as svcs:
        results = run_ranks(svcs, rank_main)
    for r in range(p):
        for counts, given, exchanged, one, two in results[r]:
            want = np.concatenate(
                [np.arange(c, dtype=np.float32) + 10 * q for q, c in enumerate(counts)]
            )
            np.testing.assert_array_equal(given, want)
            np.testing.assert_array_equal(exchanged, want)
            assert (one, two) == (1, 2), (one, two)


def test_allgather_counts_checked_at_the_call_and_across_ranks() -> None:
    p = 3

    def rank_main(svc):
        x = np.ones(2 + svc.rank)
        counts = [2, 3, 4]
        errors = []
        for bad, match in (
            ([2, 3], "must be 3 integers"),
            ([2, 3, -4], "must be 3 integers >= 0"),
            ([9, 9, 9], f"rank {svc.rank}'s part 9 elements, but its x has {2 + svc.rank}"),
            ("abc", "must be 3 integers"),
        ):
            with pytest.raises(tr.InvalidArgumentError, match=match):
                svc.allgather(x, name="bad", counts=bad)
        with pytest.raises(tr.InvalidArgumentError, match="does not go with partition"):
            svc.allgather(x, name="bad", counts=counts, partition=tr.Partition((3,)), axes=(0,))
        # Ranks disagree on the sizes of the others' parts (the same total): every rank
        # raises, naming the op, and the name works afterwards.
        theirs = [2, 3, 4] if svc.rank != 2 else [3, 2, 4]
        mine = np.ones(theirs[svc.rank])
        try:
            svc.allgather(mine, name="disagree", counts=theirs)
        except tr.OpMismatchError as exc:
            errors.append(str(exc))
        after = svc.allgather(x, name="disagree", counts=counts)
        once = svc.allgather(x, name="iterator", counts=iter(counts))  # read once
        return errors, after, once

    with local_services(p) as svcs:
        results = run_ranks(svcs, rank_main)
    for r in range(p):
        errors, after, once = results[r]
        assert len(errors) == 1 and "'disagree'" in errors[0] and "counts=" in errors[0], errors
        np.testing.assert_array_equal(after, np.ones(9))
        np.testing.assert_array_equal(once, np.ones(9))


@pytest.mark.parametrize("p", [1, 2, 3, 5])
def test_reduce_scatter_with_given_counts(p: int) -> None:
    """``counts=`` (MPI_Reduce_scatter's recvcounts): uneven and empty parts, exact; bad
    counts refused at the call; ranks that disagree on them all raise, and the name
    works afterwards."""
    n = 4 * p + 1

    def rank_main(svc):
        counts = [n - 2 * (p - 1)] + [2] * (p - 1) if p > 1 else [n]
        counts = counts[::-1] if p > 2 else counts
        x = np.arange(n, dtype=np.int64) * (svc.rank + 1)
        got = svc.reduce_scatter(x, name="rsc", counts=counts)
        empty = svc.reduce_scatter(x, name="rsc0", counts=[0] * (p - 1) + [n])
        for bad, match in (
            (counts[:-1] + [counts[-1] + 1], f"sum to {n + 1} elements, but x has {n}"),
            ([n] * (p + 1), f"must be {p} integers"),
            ([-1] + counts[1:] if p > 1 else [-1], ">= 0"),
        ):
            with pytest.raises(tr.InvalidArgumentError, match=match):
                svc.reduce_scatter(x, name="bad", counts=bad)
        errors = []
        if p > 1:
            theirs = counts if svc.rank else counts[1:] + counts[:1]
            try:
                svc.reduce_scatter(x, name="disagree", counts=theirs)
            except tr.OpMismatchError as exc:
                errors.append(str(exc))
        after = svc.reduce_scatter(x, name="disagree", counts=counts)
        return counts, got, empty, errors, after

    with local_services(p) as svcs:
        results = run_ranks(svcs, rank_main)
    total = np.arange(n, dtype=np.int64) * (p * (p + 1) // 2)
    for r in range(p):
        counts, got, empty, errors, after = results[r]
        lo = sum(counts[:r])
        np.testing.assert_array_equal(got, total[lo : lo + counts[r]])
        np.testing.assert_array_equal(after, got)
        np.testing.assert_array_equal(empty, total if r == p - 1 else total[:0])
        if p > 1 and counts != counts[1:] + counts[:1]:
            assert len(errors) == 1 and "'disagree'" in errors[0], errors


def test_seed_003_example_3x7x12_on_2x2x3() -> None:
    part = tr.Partition((2, 2, 3))

    def rank_main(svc):
        rng = np.random.default_rng(svc.rank)
        x = rng.random((3, 7, 12))
        y = svc.reduce_scatter(x, name="rs", partition=part, axes=(2,))
        back = svc.allgather(y, name="ag", partition=part, axes=(2,))
        return x, y, back

    with local_services(12) as svcs:
        results = run_ranks(svcs, rank_main)
    for r in range(12):
        c = part.coords_of(r)
        peers = part.axis_group(r, 2).ranks
        total = sum(results[q][0] for q in peers)
        x, y, back = results[r]
        assert y.shape == (3, 7, 4)
        np.testing.assert_allclose(y, total[:, :, 4 * c[2] : 4 * c[2] + 4], rtol=1e-14)
        np.testing.assert_allclose(back, total, rtol=1e-14)


@pytest.mark.parametrize(
    "shape,axis,local",
    [((2, 3), 0, (5, 4)), ((2, 3), 1, (4, 7)), ((2, 2, 3), 2, (3, 7, 12)), ((4,), 0, (9, 2))],
)
def test_adjoint_on_partitions(shape, axis, local) -> None:
    part = tr.Partition(shape)
    p = part.size

    def rank_main(svc):
        rng = np.random.default_rng(10 + svc.rank)
        # DistDL's convention: a rank outside the partition passes a zero-volume tensor
        x = rng.standard_normal(local if part.is_active(svc.rank) else (0, *local[1:]))
        fx = svc.reduce_scatter(x, name="F", partition=part, axes=(axis,))
        y = rng.standard_normal(fx.shape)
        fty = svc.allgather(y, name="Ft", partition=part, axes=(axis,))
        return float(np.vdot(fx, y)), float(np.vdot(x, fty))

    with local_services(p + 1) as svcs:  # one rank outside the partition
        results = run_ranks(svcs, rank_main)
    lhs = sum(a for a, _ in results[:p])
    rhs = sum(b for _, b in results[:p])
    assert abs(lhs - rhs) <= 1e-12 * max(abs(lhs), 1.0)
    assert results[p] == (0.0, 0.0)  # the inactive rank took no part


def test_inactive_rank_gets_zero_volume() -> None:
    part = tr.Partition((2,))
    with local_services(3) as svcs:
        h = svcs[2].reduce_scatter_async(np.zeros((0, 5)), partition=part, axes=(0,))
        assert h.done() and h.wait().shape == (0, 5)


@pytest.mark.parametrize("axes", [(), None])
def test_no_partition_dimension_is_the_identity(axes) -> None:
    """Along no partition dimension each rank is a group of one: its part is a copy of x."""
    part = tr.Partition((2, 2))

    def rank_main(svc):
        x = np.arange(12.0).reshape(3, 4) + svc.rank
        rs = svc.reduce_scatter_async(x, name="rs", partition=part, axes=axes)
        ag = svc.allgather_async(x, name="ag", partition=part, axes=axes)
        assert rs.done() and ag.done()  # nothing to exchange
        return x, rs.wait(), ag.wait()

    with local_services(4) as svcs:
        results = run_ranks(svcs, rank_main)
    for x, rs, ag in results:
        for got in (rs, ag):
            np.testing.assert_array_equal(got, x)
            assert got.shape == x.shape and not np.shares_memory(got, x)


@pytest.mark.parametrize("p", [2, 3, 4])
def test_everything_mixed_in_flight_random_order(p: int) -> None:
    def rank_main(svc):
        rng = random.Random(svc.rank)
        jobs = []
        for k in range(12):
            jobs.append(("ar", k))
            jobs.append(("rs", k))
            jobs.append(("ag", k))
            jobs.append(("bc", k))
        rng.shuffle(jobs)
        hs = {}
        for kind, k in jobs:
            x = np.arange(50 + k, dtype=np.float64) + svc.rank
            if kind == "ar":
                hs[kind, k] = svc.allreduce_async(x, name=f"ar{k}", priority=rng.randrange(3))
            elif kind == "rs":
                hs[kind, k] = svc.reduce_scatter_async(x, name=f"rs{k}")
            elif kind == "ag":
                hs[kind, k] = svc.allgather_async(x[: svc.rank + k], name=f"ag{k}")
            else:
                hs[kind, k] = svc.broadcast_async(x, root=k % p, name=f"bc{k}")
        return {key: h.wait(timeout=60) for key, h in hs.items()}

    with local_services(p, segment_bytes=128, jitter=0.3, seed=p) as svcs:
        results = run_ranks(svcs, rank_main)
    for r in range(p):
        for k in range(12):
            base = np.arange(50 + k, dtype=np.float64)
            total = base * p + p * (p - 1) / 2
            np.testing.assert_array_equal(results[r]["ar", k], total)
            np.testing.assert_array_equal(results[r]["rs", k], np.array_split(total, p)[r])
            ag = np.concatenate([(base + q)[: q + k] for q in range(p)])
            np.testing.assert_array_equal(results[r]["ag", k], ag)
            np.testing.assert_array_equal(results[r]["bc", k], base + k % p)


def _bf16_bits(values: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns, round to nearest even (values here are exact)."""
    bits = values.astype(np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def test_float16_and_bfloat16() -> None:
    p = 3

    def rank_main(svc):
        base = np.arange(40, dtype=np.float32) + svc.rank
        h16 = svc.allreduce(base.astype(np.float16), name="h", op="avg")
        bf = _bf16_bits(base)
        b16 = svc.allreduce(bf, name="b", dtype="bfloat16", out=bf)
        return h16, b16

    with local_services(p, segment_bytes=64) as svcs:
        results = run_ranks(svcs, rank_main)
    want = np.arange(40, dtype=np.float32) * p + p * (p - 1) / 2
    for h16, b16 in results:
        np.testing.assert_array_equal(h16, (want / p).astype(np.float16))
        np.testing.assert_array_equal(b16, _bf16_bits(want))


def test_pairwise_exchange() -> None:
    p = 8

    def rank_main(svc):
        x = np.arange(90, dtype=np.int64) + 1000 * svc.rank
        with pytest.raises(tr.InvalidArgumentError, match="steps"):
            svc.pairwise_exchange_async(x, steps=4)
        return svc.pairwise_exchange_async(x, steps=3, name="pe").wait(timeout=30)

    with local_services(p, segment_bytes=64) as svcs:
        results = run_ranks(svcs, rank_main)
    for r in range(p):
        for k, part in enumerate(np.array_split(np.arange(90), 3)):
            partner = r ^ (1 << k)
            np.testing.assert_array_equal(results[r][part], part + 1000 * partner)

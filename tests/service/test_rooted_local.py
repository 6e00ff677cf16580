"""Reduce, gather, scatter, all-to-all and send/recv on the local transport (ranks as threads)."""

from __future__ import annotations

import numpy as np
import pytest

import totalreduce as tr
from conftest import local_services, run_ranks
from totalreduce.service.handle import ServiceLike

OPTIONS = {"segment_bytes": 64, "micro_bytes": 32}  # many segments, rendezvous bodies


def data(rank: int, n: int, dtype: type = np.int64) -> np.ndarray:
    return (np.arange(n) * 100 + rank * 7 + 1).astype(dtype)


@pytest.mark.parametrize("p", [1, 2, 3, 5])
def test_reduce_gather_scatter_every_root(p: int) -> None:
    n = 37

    def rank_main(svc):
        out = []
        for root in range(p):
            red = svc.reduce(data(svc.rank, n), root=root, name="r")
            avg = svc.reduce(data(svc.rank, n, np.float64), root=root, op="avg", name="ra")
            bxor = svc.reduce(data(svc.rank, n, np.uint8), root=root, op="bxor", name="rx")
            gat = svc.gather(data(svc.rank, n).reshape(1, n), root=root, name="g")
            x = data(root, p * n).reshape(p, n) if svc.rank == root else np.zeros(n, np.int64)
            sca = svc.scatter(x, root=root, name="s")
            out.append((red, avg, bxor, gat, sca))
        return out

    with local_services(p, **OPTIONS) as svcs:
        results = run_ranks(svcs, rank_main, timeout=120)
    xs = [data(r, n) for r in range(p)]
    for r in range(p):
        for root in range(p):
            red, avg, bxor, gat, sca = results[r][root]
            if r == root:
                np.testing.assert_array_equal(red, np.add.reduce(xs))
                np.testing.assert_array_equal(
                    avg, np.add.reduce([x.astype(np.float64) for x in xs]) / p
                )
                np.testing.assert_array_equal(
                    bxor, np.bitwise_xor.reduce([data(q, n, np.uint8) for q in range(p)])
                )
                assert gat.shape == (p, 1, n)
                np.testing.assert_array_equal(gat.reshape(p, n), np.stack(xs))
            else:
                assert red is None and avg is None and bxor is None and gat is None
            np.testing.assert_array_equal(sca, data(root, p * n)[r * n : (r + 1) * n])


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_alltoall_equal_and_uneven(p: int) -> None:
    rng = np.random.default_rng(p)
    sizes = rng.integers(0, 20, (p, p))  # sizes[i][j]: rank i sends rank j

    def rank_main(svc):
        r = svc.rank
        eq = svc.alltoall(data(r, 3 * p), name="a2a")
        x = data(r, int(sizes[r].sum()), np.int16)
        uneven = svc.alltoall(x, name="a2av", splits=list(sizes[r]), recv_splits=list(sizes[:, r]))
        inplace = data(r, 2 * p)
        svc.alltoall(inplace, name="a2a.inplace", out=inplace)
        return eq, uneven, inplace

    with local_services(p, **OPTIONS) as svcs:
        results = run_ranks(svcs, rank_main, timeout=120)
    for r, (eq, uneven, inplace) in enumerate(results):
        want = np.concatenate([data(j, 3 * p)[3 * r : 3 * r + 3] for j in range(p)])
        np.testing.assert_array_equal(eq, want)
        parts = []
        for j in range(p):
            start = int(sizes[j, :r].sum())
            parts.append(data(j, int(sizes[j].sum()), np.int16)[start : start + sizes[j, r]])
        np.testing.assert_array_equal(uneven, np.concatenate(parts))
        np.testing.assert_array_equal(
            inplace, np.concatenate([data(j, 2 * p)[2 * r : 2 * r + 2] for j in range(p)])
        )


def test_send_recv_match_by_source_tag_and_order() -> None:
    def rank_main(svc):
        if svc.rank == 0:
            hs = [svc.send_async(np.full(k + 1, k, np.float32), dst=2, tag=5) for k in range(4)]
            svc.send(np.arange(3, dtype=np.int8), dst=2, tag=9)
            svc.send(np.ones(2, dtype=np.bool_), dst=1)
            for h in hs:
                h.wait(timeout=30)
            return None
        if svc.rank == 1:
            return svc.recv(np.zeros(2, dtype=np.bool_), src=0)
        # Rank 2 takes tag 9 first: tags are separate streams; within one, order holds.
        first = svc.recv(np.zeros(3, dtype=np.int8), src=0, tag=9)
        got = [svc.recv(np.zeros(k + 1, np.float32), src=0, tag=5) for k in range(4)]
        return first, got

    with local_services(3, **OPTIONS) as svcs:
        results = run_ranks(svcs, rank_main, timeout=60)
    assert results[1].tolist() == [True, True]
    first, got = results[2]
    np.testing.assert_array_equal(first, np.arange(3, dtype=np.int8))
    for k, g in enumerate(got):
        np.testing.assert_array_equal(g, np.full(k + 1, k, np.float32))


def test_bad_input_is_named() -> None:
    def rank_main(svc):
        errors = []
        # Per-rank argument checks raise at the call.
        for call in (
            lambda: svc.reduce(np.ones(3), root=5),
            lambda: svc.gather(np.ones(3), root=-1),
            lambda: svc.alltoall(np.ones(5)),
            lambda: svc.alltoall(np.ones(4), splits=[1, 1]),
            lambda: svc.alltoall(np.ones(4), splits=[2, 2], recv_splits=[3, 3]),
            lambda: svc.send(np.ones(2), dst=svc.rank),
            lambda: svc.reduce(np.ones(3), op="band"),
        ):
            with pytest.raises(tr.InvalidArgumentError) as info:
                call()
            errors.append(str(info.value))
        # Across ranks: a dtype mismatch in a gather and a size mismatch in a send/recv.
        dt = np.float32 if svc.rank == 1 else np.float64
        with pytest.raises(tr.OpMismatchError) as info:
            svc.gather(np.ones(3, dtype=dt), root=0, name="gm")
        errors.append(str(info.value))
        if svc.rank == 0:
            with pytest.raises(tr.OpMismatchError) as info:
                svc.send(np.ones(3), dst=1, tag=1)
        else:
            with pytest.raises(tr.OpMismatchError) as info:
                svc.recv(np.ones(4), src=0, tag=1)
        errors.append(str(info.value))
        # Both work afterwards.
        after = svc.reduce(np.full(2, svc.rank + 1), root=1, name="after")
        return errors, after

    with local_services(2) as svcs:
        results = run_ranks(svcs, rank_main, timeout=60)
    for r, (errors, after) in enumerate(results):
        assert "reduce root 5 outside 0..1" in errors[0]
        assert "gather root -1" in errors[1]
        assert "not a multiple" in errors[2]
        assert "add up to 2, but x has 4" in errors[3]
        assert "sends itself" in errors[4]
        assert "itself" in errors[5]
        assert "'band' is bitwise" in errors[6] and "float64" in errors[6]
        assert "op 'gm' generation 0" in errors[7] and "float32" in errors[7], errors[7]
        assert "op 'send 0->1 tag 1' generation 0" in errors[8], errors[8]
        assert "count 3" in errors[8] and "count 4" in errors[8], errors[8]
        if r == 1:
            np.testing.assert_array_equal(after, [3, 3])
        else:
            assert after is None


@pytest.mark.parametrize("p", [2, 3])
def test_rooted_mismatch_fails_every_rank_at_the_call(p: int) -> None:
    """At P = 2 a reduce's or gather's root answers without waiting for the other's token:
    a disagreement on the root or the count still fails both ranks, neither finishing."""

    def rank_main(svc):
        root = 1 if svc.rank == p - 1 else 0
        n = 4 + svc.rank  # the ranks disagree on the count too
        errs = []
        for _name, call in (
            ("red", lambda: svc.reduce(np.ones(4), root=root, name="red")),
            ("gat", lambda: svc.gather(np.ones(4), root=root, name="gat")),
            ("sca", lambda: svc.scatter(np.ones(4 * p if svc.rank == root else 4), root=root,
                                        name="sca")),
            ("redn", lambda: svc.reduce(np.ones(n), root=0, name="redn")),
            ("gatn", lambda: svc.gather(np.ones(n), root=0, name="gatn")),
        ):  # fmt: skip
            try:
                call()
                errs.append(None)
            except tr.TotalReduceError as exc:
                errs.append(str(exc))
        # Nothing left to raise later, and the names go on working.
        svc.allreduce(np.zeros(1), group=tr.Group([svc.rank]))
        again = svc.reduce(np.ones(2), root=0, name="red")
        return errs, again

    with local_services(p) as svcs:
        results = run_ranks(svcs, rank_main, timeout=60)
    for r, (errs, again) in enumerate(results):
        assert all(e is not None for e in errs), (r, errs)
        for e, name in zip(errs[:3], ("red", "gat", "sca"), strict=True):
            assert f"op '{name}' generation 0" in e, e
            assert "the root" in e or "finished the op without" in e, e
        for e, name in zip(errs[3:], ("redn", "gatn"), strict=True):
            assert f"op '{name}' generation 0" in e, e
        if r == 0:
            np.testing.assert_array_equal(again, np.full(2, float(p)))


def test_the_service_satisfies_the_protocol_with_the_new_ops() -> None:
    with local_services(1) as (svc,):
        assert isinstance(svc, ServiceLike)
        np.testing.assert_array_equal(svc.alltoall(np.arange(3)), np.arange(3))
        np.testing.assert_array_equal(svc.scatter(np.arange(3), root=0), np.arange(3))

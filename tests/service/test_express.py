"""The express path of a repeated allreduce (service/express.py): it changes how fast a
repeat starts, never what it does.  Every case runs a first call (the whole way, which
leaves the record) and then repeats that take the record, on local services."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import totalreduce as tr
from conftest import local_services, run_ranks
from totalreduce.service import collectives, tuning


def count_whole_way(monkeypatch: pytest.MonkeyPatch, module: Any) -> list[int]:
    """Counts the whole way's argument checks (``as_array`` in ``module``'s op methods)."""
    calls = [0]
    real = module.as_array

    def counted(*a, **kw):  # type: ignore[no-untyped-def]
        calls[0] += 1
        return real(*a, **kw)

    monkeypatch.setattr(module, "as_array", counted)
    return calls


@pytest.fixture
def whole_way_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the whole way's argument checks (``as_array`` in ``allreduce_async``)."""
    return count_whole_way(monkeypatch, collectives)


def test_repeats_take_the_record_and_give_the_same_results(whole_way_calls: list[int]) -> None:
    """out=None, out=x, out=y, a 2-d shape, avg/max, int64: repeats are exact and skip the
    whole way's checks after the first call of each (name, op, in place, algorithm)."""
    with local_services(2) as svcs:

        def rank_main(svc):
            r = svc.rank
            got = []
            for k in range(4):
                x = np.arange(6.0) + r + k
                got.append(svc.allreduce(x, name="a"))
                y = np.empty(6)
                svc.allreduce(x, name="a", out=y)
                got.append(y)
                z = x.copy()
                svc.allreduce(z, name="a", out=z)
                got.append(z)
                m = (np.arange(12, dtype=np.int64) * (r + 1)).reshape(3, 4)
                got.append(svc.allreduce(m, name="m", op="max"))
                got.append(svc.allreduce(x, name="v", op="avg", algorithm="ring"))
            return got

        out = run_ranks(svcs, rank_main, timeout=60)
    for k in range(4):
        base = 2 * np.arange(6.0) + 1 + 2 * k
        for got in out:
            a, y, z, m, v = got[5 * k : 5 * k + 5]
            for arr in (a, y, z):
                np.testing.assert_array_equal(arr, base)
            assert m.shape == (3, 4) and m.dtype == np.int64
            np.testing.assert_array_equal(m, (np.arange(12) * 2).reshape(3, 4))
            np.testing.assert_array_equal(v, base / 2)
    # 2 ranks x (a: out None / out y share a record; a in place; m; v): 4 whole-way calls each
    assert whole_way_calls[0] == 2 * 4


def test_a_repeat_with_anything_different_goes_the_whole_way() -> None:
    """Another dtype, shape, op, algorithm or out form under a known name is a new shape
    (or the same error as the first time), never a silent reuse of the record."""
    with local_services(2) as svcs:

        def rank_main(svc):
            x = np.ones(4)
            svc.allreduce(x, name="w")
            svc.allreduce(x, name="w")
            f32 = svc.allreduce(np.ones(4, np.float32), name="w")
            longer = svc.allreduce(np.ones(5), name="w")
            mx = svc.allreduce(x * (svc.rank + 1), name="w", op="max")
            errors = []
            for bad in (
                lambda: svc.allreduce_async(np.ones(8)[::2], name="w"),  # not contiguous
                lambda: svc.allreduce_async(x, name="w", out=np.ones(4, np.float32)),
                lambda: svc.allreduce_async(x, name="w", out=np.ones(3)),
                lambda: svc.allreduce_async(x, name="w", out=np.ones(4)[::-1].copy()[:3]),
                lambda: svc.allreduce_async(x, name="w", priority=1.5),
                lambda: svc.allreduce_async(x, name="w", priority=True),
                lambda: svc.allreduce_async(x, name="w", priority=1 << 40),
                lambda: svc.allreduce_async(x, name=True),
                lambda: svc.allreduce_async(x, name=[1]),
                lambda: svc.allreduce_async(x, name="w", op="nope"),
            ):
                with pytest.raises(tr.InvalidArgumentError) as info:
                    bad()
                errors.append(str(info.value))
            ro = np.ones(4)
            ro.flags.writeable = False
            with pytest.raises(tr.InvalidArgumentError, match="read-only"):
                svc.allreduce_async(x, name="w", out=ro)
            big = np.arange(8.0)
            with pytest.raises(tr.InvalidArgumentError, match="overlaps"):
                svc.allreduce_async(big[:4], name="w", out=big[2:6])
            view = np.arange(4.0)
            svc.allreduce(view, name="w", out=view.reshape(2, 2))  # the same memory: in place
            last = svc.allreduce(x, name="w")
            return f32, longer, mx, errors, view, last

        for f32, longer, mx, errors, view, last in run_ranks(svcs, rank_main, timeout=60):
            assert f32.dtype == np.float32
            np.testing.assert_array_equal(f32, np.full(4, 2.0))
            np.testing.assert_array_equal(longer, np.full(5, 2.0))
            np.testing.assert_array_equal(mx, np.full(4, 2.0))
            assert "C-contiguous" in errors[0]
            assert "dtype float32" in errors[1] and "3 elements" in errors[2]
            assert all("priority" in e for e in errors[4:7])
            assert "str or int" in errors[7] and "str or int" in errors[8]
            assert "nope" in errors[9]
            np.testing.assert_array_equal(view, 2 * np.arange(4.0))
            np.testing.assert_array_equal(last, np.full(4, 2.0))


def test_a_name_in_flight_with_another_shape_is_refused_on_the_express_path() -> None:
    with local_services(2) as svcs:
        svc = svcs[0]
        x = np.ones(4)
        first = [s.allreduce_async(x, name="f") for s in svcs]
        for h in first:
            h.wait(30)
        held = svc.allreduce_async(x, name="f")  # a repeat, in flight: rank 1 has not come
        assert ("f", "sum", False, None) in svc._express
        with pytest.raises(tr.InvalidArgumentError, match="still in flight"):
            svc.allreduce_async(np.ones(5), name="f")
        again = svc.allreduce_async(x, name="f")  # the same shape may queue behind it
        other = [svcs[1].allreduce_async(x, name="f") for _ in range(2)]
        for h in (held, again, *other):
            np.testing.assert_array_equal(h.wait(30), np.full(4, 2.0))
        assert (held.generation, again.generation) == (1, 2)


def test_the_record_follows_the_tuning_table_and_the_service_state() -> None:
    """A new tuning table (``tuning.clear_cache``) re-chooses the route; a closed service
    refuses, as the whole way does."""
    with local_services(2) as svcs:
        x = np.ones(3)
        for _ in range(2):
            for h in [s.allreduce_async(x, name="t") for s in svcs]:
                h.wait(30)
        epoch = svcs[0]._express[("t", "sum", False, None)].epoch
        tuning.clear_cache()
        for h in [s.allreduce_async(x, name="t") for s in svcs]:
            np.testing.assert_array_equal(h.wait(30), np.full(3, 2.0))
        assert svcs[0]._express[("t", "sum", False, None)].epoch > epoch
    with pytest.raises(tr.NotInitializedError):
        svcs[0].allreduce_async(x, name="t")


def test_reduce_scatter_repeats_take_the_record(monkeypatch: pytest.MonkeyPatch) -> None:
    """A repeated reduce-scatter (no partition, group or dtype) skips the whole way after
    its first call; results stay exact, and another op, dtype or shape goes the whole way."""
    from totalreduce.service import partitions

    calls = count_whole_way(monkeypatch, partitions)
    with local_services(3) as svcs:

        def rank_main(svc):
            r = svc.rank
            got = []
            for k in range(5):
                x = np.arange(10.0) * (r + 1) + k
                got.append(svc.reduce_scatter(x, name="g"))
                got.append(svc.reduce_scatter(x.reshape(2, 5), name="g", op="max"))
            got.append(svc.reduce_scatter(np.ones(10, np.float32), name="g"))  # another dtype
            got.append(svc.reduce_scatter(np.ones(7), name="g"))  # another shape
            return got

        out = run_ranks(svcs, rank_main, timeout=60)
    parts = [(0, 4), (4, 3), (7, 3)]
    for r, got in enumerate(out):
        lo, n = parts[r]
        for k in range(5):
            full = np.arange(10.0) * 6 + 3 * k
            np.testing.assert_array_equal(got[2 * k], full[lo : lo + n])
            mx = (np.arange(10.0) * 3 + k)[lo : lo + n]
            np.testing.assert_array_equal(got[2 * k + 1], mx)
        assert got[10].dtype == np.float32 and np.all(got[10] == 3) and got[10].size == n
        assert got[11].size == [3, 2, 2][r] and np.all(got[11] == 3)
    # 3 ranks x (g sum, g max on 2-d, the float32 and the 7-element calls) whole-way calls
    assert calls[0] == 3 * 4


def test_broadcast_repeats_take_the_record(whole_way_calls: list[int]) -> None:
    """A repeated broadcast (same name, root, ``out`` form and algorithm; no group or dtype)
    skips the whole way after its first call; results stay exact, with the caller's shape,
    in place too, and another root, dtype or shape goes the whole way."""
    with local_services(3) as svcs:

        def rank_main(svc):
            r = svc.rank
            got = []
            for k in range(4):
                x = np.full((2, 3), 10.0 * r + k)
                got.append(svc.broadcast(x, root=1, name="b"))
                y = np.full(5, float(r), np.float32)
                svc.broadcast(y, root=2, name="b.in", out=y)  # in place
                got.append(y)
            got.append(svc.broadcast(np.full((2, 3), float(r)), root=0, name="b"))  # another root
            got.append(svc.broadcast(np.full(4, r, np.int64), root=1, name="b"))  # dtype, shape
            return got

        out = run_ranks(svcs, rank_main, timeout=60)
    for got in out:
        for k in range(4):
            assert got[2 * k].shape == (2, 3) and np.all(got[2 * k] == 10.0 + k)
            assert got[2 * k + 1].dtype == np.float32 and np.all(got[2 * k + 1] == 2.0)
        assert np.all(got[8] == 0.0) and got[9].dtype == np.int64 and np.all(got[9] == 1)
    # 3 ranks x (b root 1, b.in, b root 0, b int64) whole-way calls
    assert whole_way_calls[0] == 3 * 4


def test_allgather_repeats_with_counts_take_the_record(monkeypatch: pytest.MonkeyPatch) -> None:
    """A repeated all-gather given ``counts`` (no partition, group or dtype) skips the whole
    way after its first call; results stay exact (a flat array, whatever the part's shape),
    and other counts, a dtype or a shape go the whole way, as does one without counts."""
    from totalreduce.service import partitions

    calls = count_whole_way(monkeypatch, partitions)
    counts = [4, 2, 6]
    with local_services(3) as svcs:

        def rank_main(svc):
            r = svc.rank
            got = []
            for k in range(5):
                x = np.arange(float(counts[r])) + 10 * r + k
                got.append(svc.allgather(x, name="g", counts=counts))
                got.append(svc.allgather(x.reshape(2, -1), name="g2", counts=counts))
            got.append(svc.allgather(np.ones(counts[r], np.float32), name="g", counts=counts))
            got.append(svc.allgather(np.ones(2), name="g", counts=[2, 2, 2]))  # other counts
            got.append(svc.allgather(np.ones(counts[r]), name="g"))  # sizes exchanged
            return got

        out = run_ranks(svcs, rank_main, timeout=60)
    for got in out:
        for k in range(5):
            want = np.concatenate([np.arange(float(c)) + 10 * q + k for q, c in enumerate(counts)])
            np.testing.assert_array_equal(got[2 * k], want)
            np.testing.assert_array_equal(got[2 * k + 1], want)  # flat, as the whole way's
        assert got[10].dtype == np.float32 and got[10].size == 12 and np.all(got[10] == 1)
        np.testing.assert_array_equal(got[11], np.ones(6))
        np.testing.assert_array_equal(got[12], np.ones(12))
    # 3 ranks x (g, g2, the float32, the other counts and the exchanged calls)
    assert calls[0] == 3 * 5


def test_ops_in_flight_leave_no_closures_for_the_garbage_collector() -> None:
    """An express op in flight keeps one object the cyclic garbage collector tracks: its
    handle, which is also its spec, its lane op and its completion word (``ExpressOp``); no
    function, cell, spec, lane record, completion word or key of its own (six objects per
    op before).  Ops a training step keeps in flight are promoted to the
    old generation, so each tracked object per op brings the next full collection (tens of
    ms with torch loaded) closer."""
    import gc
    import threading

    n = 200
    ready = threading.Barrier(2)
    counted: list[dict[str, int]] = []

    with local_services(2) as svcs:

        def rank_main(svc):
            xs = [np.full(64, svc.rank + i, np.float32) for i in range(n)]
            names = [f"g{i}" for i in range(n)]
            for _ in range(2):  # the first round makes the records
                for h in [svc.allreduce_async(x, name=m) for x, m in zip(xs, names, strict=True)]:
                    h.wait(timeout=60)
            ready.wait(timeout=60)
            if svc.rank == 0:  # rank 1 submits only once this is counted: all stay in flight
                gc.collect()
                gc.disable()
                try:
                    before = {id(o) for o in gc.get_objects(generation=0)}
                    hs = [svc.allreduce_async(x, name=m) for x, m in zip(xs, names, strict=True)]
                    # the lane's dict of each name's ops in flight is kept between its ops;
                    # the collector tracks it again once it holds an op (not a new object)
                    kept = {id(d) for d in svc.loop.lane.by_key._by_wid.values()}
                    kinds: dict[str, int] = {}
                    for o in gc.get_objects(generation=0):
                        if id(o) not in before and id(o) not in kept:
                            t = type(o).__name__
                            kinds[t] = kinds.get(t, 0) + 1
                finally:
                    gc.enable()
                counted.append(kinds)
                ready.wait(timeout=60)
            else:
                ready.wait(timeout=60)
                hs = [svc.allreduce_async(x, name=m) for x, m in zip(xs, names, strict=True)]
            return [h.wait(timeout=60) for h in hs]

        out = run_ranks(svcs, rank_main, timeout=120)
    for got in out:
        for i, y in enumerate(got):
            np.testing.assert_array_equal(y, np.full(64, 2 * i + 1, np.float32))
    kinds = counted[0]
    assert kinds.get("function", 0) < n // 10 and kinds.get("cell", 0) < n // 10, kinds
    assert kinds.get("ExpressOp", 0) == n, kinds
    assert all(kinds.get(k, 0) == 0 for k in ("OpSpec", "LaneOp", "Handle", "Completion")), kinds
    # the services' own threads run while this is counted and may make a few objects of
    # their own (a tuple, a bound method); none makes one per op
    others = {k: c for k, c in kinds.items() if k != "ExpressOp"}
    assert all(c < n // 10 for c in others.values()), kinds
    assert sum(others.values()) < n // 5, kinds


# ------------------------------------------------------- the other kinds' records


def expressed(svc) -> int:
    return svc.loop.stats.lane_express


def test_neighbor_repeats_take_the_record(monkeypatch: pytest.MonkeyPatch) -> None:
    """Repeated neighbor averaging on a static graph (by name, by object, in place, a 2-d
    array) and with explicit weights, and the neighbor all-gather, skip the whole way after
    their first call, enter the lane from the calling thread, and stay exact."""
    from totalreduce.service import neighbors
    from totalreduce.topology import get_topology, mixing_matrix

    calls = count_whole_way(monkeypatch, neighbors)
    p = 3
    topo = get_topology("exponential-2", p)
    w = mixing_matrix(topo, 0)
    with local_services(p) as svcs:

        def rank_main(svc):
            r = svc.rank
            left, right = (r - 1) % p, (r + 1) % p
            got, e0 = [], expressed(svc)
            for k in range(5):
                x = np.arange(8.0) + 10 * r + k
                got.append(svc.neighbor_allreduce(x, name="n"))
                got.append(svc.neighbor_allreduce(x.reshape(2, 4), name="n2", topology=topo))
                y = x.astype(np.float32)
                svc.neighbor_allreduce(y, name="n.in", out=y)
                got.append(y)
                got.append(
                    svc.neighbor_allreduce(
                        x, name="nw", self_weight=0.5, src_weights={left: 0.5},
                        dst_weights={right: 1.0},
                    )
                )  # fmt: skip
                got.append(svc.neighbor_allgather(x, name="g"))
            return got, expressed(svc) - e0

        out = run_ranks(svcs, rank_main, timeout=60)
    xs = [[np.arange(8.0) + 10 * r + k for r in range(p)] for k in range(5)]
    for r, (got, n_express) in enumerate(out):
        src = [j for j in range(p) if j != r and w[r, j] != 0]
        for k in range(5):
            want = sum(w[r, j] * xs[k][j] for j in range(p))
            n, n2, y, nw, g = got[5 * k : 5 * k + 5]
            np.testing.assert_allclose(n, want)
            assert n2.shape == (2, 4)
            np.testing.assert_allclose(n2.reshape(-1), want)
            np.testing.assert_allclose(y, want.astype(np.float32), rtol=1e-6)
            np.testing.assert_allclose(nw, 0.5 * xs[k][r] + 0.5 * xs[k][(r - 1) % p])
            assert g.shape == (len(src), 8)
            np.testing.assert_array_equal(g, np.stack([xs[k][j] for j in src]))
        assert 0 < n_express <= 5 * 4  # the repeats enter from the calling thread
    assert calls[0] == p * 5  # each name's first call went the whole way, on every rank


def test_rooted_and_alltoall_repeats_take_the_record(monkeypatch: pytest.MonkeyPatch) -> None:
    """Repeated reduce (sum, and avg into another root), gather, scatter (into the
    receivers' own arrays) and equal all-to-all skip
    the whole way after their first call, in both forms (blocking: ``express.run``;
    ``_async(...).wait()``), enter the lane from the calling thread and stay exact: None
    off the root, the caller's shapes."""
    from totalreduce.service import rooted

    calls = count_whole_way(monkeypatch, rooted)
    p = 3
    with local_services(p) as svcs:

        def rank_main(svc):
            got, e0 = [], expressed(svc)
            for k in range(6):
                x = (np.arange(6.0) + 10 * svc.rank + k).reshape(2, 3)
                # scatter: the root's (P, 2) table, the others' receiving arrays
                table = np.arange(2.0 * p).reshape(p, 2) + k if svc.rank == 1 else np.zeros(2)
                if k % 2:
                    got += [
                        svc.reduce_async(x, root=0, name="r").wait(),
                        svc.reduce_async(x, root=2, name="r", op="avg").wait(),
                        svc.gather_async(x, root=1, name="g").wait(),
                        svc.alltoall_async(x, name="a").wait(),
                        svc.scatter_async(table, root=1, name="s").wait(),
                    ]
                else:
                    got += [
                        svc.reduce(x, root=0, name="r"),
                        svc.reduce(x, root=2, name="r", op="avg"),
                        svc.gather(x, root=1, name="g"),
                        svc.alltoall(x, name="a"),
                        svc.scatter(table, root=1, name="s"),
                    ]
                if svc.rank != 1:  # the part landed in the receiving array
                    assert np.shares_memory(got[-1], table)
            return got, expressed(svc) - e0

        out = run_ranks(svcs, rank_main, timeout=60)
    for r, (got, n_express) in enumerate(out):
        for k in range(6):
            xs = [(np.arange(6.0) + 10 * q + k).reshape(2, 3) for q in range(p)]
            red, avg, gat, a2a, sc = got[5 * k : 5 * k + 5]
            np.testing.assert_array_equal(sc, np.arange(2.0) + 2 * r + k)
            assert (red is None) == (r != 0) and (avg is None) == (r != 2)
            assert (gat is None) == (r != 1)
            if r == 0:
                assert red.shape == (2, 3)
                np.testing.assert_array_equal(red, sum(xs))
            if r == 2:
                np.testing.assert_allclose(avg, sum(xs) / p)
            if r == 1:
                assert gat.shape == (p, 2, 3)
                np.testing.assert_array_equal(gat, np.stack(xs))
            assert a2a.shape == (2, 3)
            np.testing.assert_array_equal(
                a2a.reshape(-1), np.concatenate([xq.reshape(-1)[2 * r : 2 * r + 2] for xq in xs])
            )
        assert 0 < n_express <= 5 * 5
    # each of the five records' first call on every rank (a scatter receiver's checks its
    # receiving array too)
    assert calls[0] == p * 5 + (p - 1)


def test_other_kinds_repeats_with_anything_different_go_the_whole_way() -> None:
    """A repeat under a known name with another root, op, dtype, size, weights or topology
    is another shape, or raises what the whole way raises; never a silent reuse."""
    from totalreduce.topology import OnePeerGraph, get_topology

    p = 2
    with local_services(p) as svcs:

        def rank_main(svc):
            r = svc.rank
            x = np.arange(4.0) + r
            for _ in range(3):
                svc.reduce(x, root=0, name="r")
                svc.alltoall(x, name="a")
                svc.neighbor_allreduce(x, name="n")
            errors = []
            for bad in (
                lambda: svc.reduce(x, root=5, name="r"),
                lambda: svc.reduce(x, root=0, name="r", op="nope"),
                lambda: svc.alltoall(np.arange(3.0), name="a2"),
                lambda: svc.neighbor_allreduce(np.arange(4), name="n"),
                lambda: svc.neighbor_allreduce(x, name="n", priority=1.5),
                lambda: svc.gather(x, root=7, name="g"),
            ):
                with pytest.raises(tr.InvalidArgumentError) as info:
                    bad()
                errors.append(str(info.value))
            ints = svc.reduce(np.arange(4) + r, root=1, name="r")
            weights = {1 - r: 0.25}
            w = [
                svc.neighbor_allreduce(
                    x, name="w", self_weight=1 - weights[1 - r], src_weights=weights,
                    dst_weights=[1 - r],
                )
                for weights[1 - r] in (0.25, 0.25, 0.5, 0.5)  # the same dict, changed
            ]  # fmt: skip
            # an unhashable weight (a 0-d array) works, and leaves no record
            odd = [
                svc.neighbor_allreduce(
                    x, name="u", self_weight=0.5, src_weights={1 - r: np.array(0.5)},
                    dst_weights=[1 - r],
                )
                for _ in range(2)
            ]  # fmt: skip
            np.testing.assert_allclose(odd[1], (x + np.arange(4.0) + 1 - r) / 2)
            one_peer = OnePeerGraph(get_topology("exponential-2", p))
            e0 = expressed(svc)
            dyn = [svc.neighbor_allreduce(x, name="d", topology=one_peer) for _ in range(3)]
            return errors, ints, w, dyn, expressed(svc) - e0, svc._express

        out = run_ranks(svcs, rank_main, timeout=60)
    for r, (errors, ints, w, dyn, n_dyn, records) in enumerate(out):
        assert "root 5" in errors[0] and "nope" in errors[1] and "multiple" in errors[2]
        assert "float" in errors[3] and "priority" in errors[4] and "root 7" in errors[5]
        if r == 1:
            np.testing.assert_array_equal(ints, 2 * np.arange(4) + 1)
        x, other = np.arange(4.0) + r, np.arange(4.0) + 1 - r
        for got, a in zip(w, (0.25, 0.25, 0.5, 0.5), strict=True):
            np.testing.assert_allclose(got, (1 - a) * x + a * other)
        for got in dyn:
            np.testing.assert_allclose(got, (x + other) / 2)
        assert n_dyn == 0  # a dynamic topology's schedule may change: no record
        assert not any(k[:2] == ("nar", "d") for k in records if isinstance(k, tuple))

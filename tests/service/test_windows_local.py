"""Windows (one-sided put, get, accumulate, update) on the local transport (ranks as threads)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from conftest import local_services, run_ranks
from totalreduce.errors import InvalidArgumentError
from totalreduce.topology import get_topology, plan

OPTIONS = {"segment_bytes": 64, "micro_bytes": 32}  # many segments, rendezvous bodies


def neighbours(p: int, rank: int, topo: str = "ring") -> tuple[list[int], list[int]]:
    step = plan(get_topology(topo, p), rank, 0)
    return sorted(step.src_weights), sorted(step.dst_ranks)


def wait_versions(svc, name: str, want: dict[int, int], timeout: float = 30) -> None:
    """Spin until each in-neighbour's slot has had ``want[r]`` messages (a put is one-sided:
    the target learns of it only by looking)."""
    t0 = time.monotonic()
    while True:
        got = svc.windows.version(name)
        if all(got[r] >= n for r, n in want.items()):
            return
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"rank {svc.rank}: versions {got}, want {want}")
        time.sleep(0.001)


@pytest.mark.parametrize("p", [2, 3, 4])
def test_put_then_update_averages_the_neighbours(p: int) -> None:
    n = 37

    def rank_main(svc):
        w = svc.windows
        x = np.full(n, float(svc.rank + 1))
        assert w.create(x, "x", zero_init=True, topology="ring")
        ins, outs = neighbours(p, svc.rank)
        w.put_async(x, "x").wait(30)
        wait_versions(svc, "x", dict.fromkeys(ins, 1))
        slots = {r: w.slot("x", r) for r in ins}
        svc.barrier(name="b")  # nobody puts again before every rank read its slots
        out = w.update("x")
        assert out is not None and np.shares_memory(out, x)  # in place: the registered array
        w.free("x")
        return slots, x.copy()

    with local_services(p, **OPTIONS) as svcs:
        results = run_ranks(svcs, rank_main, timeout=120)
    for r in range(p):
        ins, _ = neighbours(p, r)
        slots, x = results[r]
        for q in ins:
            np.testing.assert_array_equal(slots[q], np.full(n, float(q + 1)))
        want = (r + 1 + sum(q + 1 for q in ins)) / (len(ins) + 1)
        np.testing.assert_allclose(x, want, rtol=1e-15)


def test_get_accumulate_weights_reset_clone_and_versions() -> None:
    p, n = 4, 10

    def rank_main(svc):
        w = svc.windows
        me = svc.rank
        x = np.arange(n, dtype=np.float32) + 100 * me
        w.create(x, "w", topology="exponential-2")
        ins, outs = neighbours(p, me, "exponential-2")
        # not zero-initialised: every slot starts as this rank's own array
        for r in ins:
            np.testing.assert_array_equal(w.slot("w", r), x)
        svc.barrier(name="created")
        # get: each in-neighbour's array, scaled by 0.5, lands in its slot
        w.get_async("w", src_weights={r: 0.5 for r in ins}).wait(30)
        got = {r: w.slot("w", r) for r in ins}
        svc.barrier(name="got")
        # accumulate twice into every out-neighbour, weight 2: slot += 2*x, twice
        base = np.ones(n, np.float32)
        hs = [w.put_async(base, "w", dst_weights={r: 2.0 for r in outs}, accumulate=True)]
        hs.append(w.put_async(base, "w", dst_weights=outs, accumulate=True))  # a list: weight 1
        for h in hs:
            h.wait(30)
        wait_versions(svc, "w", dict.fromkeys(ins, 3))  # one reply, two accumulates
        svc.barrier(name="acc")
        versions = w.version("w")
        clone = w.update("w", 0.0, {r: 1.0 for r in ins}, clone=True)
        untouched = x.copy()
        collected = w.update_then_collect("w")
        after = {r: w.slot("w", r) for r in ins}
        svc.barrier(name="done")
        w.free()
        return got, versions, clone, untouched, collected.copy(), after

    with local_services(p, **OPTIONS) as svcs:
        results = run_ranks(svcs, rank_main, timeout=120)
    for r in range(p):
        got, versions, clone, untouched, collected, after = results[r]
        ins, _ = neighbours(p, r, "exponential-2")
        x = np.arange(n, dtype=np.float32) + 100 * r
        for q in ins:
            np.testing.assert_array_equal(got[q], 0.5 * (np.arange(n) + 100 * q))
            assert versions[q] == 3
            assert not after[q].any()  # reset
        want_slots = {q: got[q] + 3.0 for q in ins}
        np.testing.assert_allclose(clone, sum(want_slots.values()))
        np.testing.assert_array_equal(untouched, x)  # clone left the window alone
        np.testing.assert_allclose(collected, x + sum(want_slots.values()))


def test_bad_calls_raise_naming_what_is_wrong() -> None:
    p = 3

    def rank_main(svc):
        w = svc.windows
        x = np.zeros(5)
        w.create(x, "x", topology="ring")
        ins, outs = neighbours(p, svc.rank)
        errors = []
        bad = (svc.rank + 1) % p if (svc.rank + 1) % p not in outs else None
        for call in (
            lambda: w.put_async(x, "nope"),
            lambda: w.put_async(np.zeros(4), "x"),
            lambda: w.put_async(np.zeros(5, np.float32), "x"),
            lambda: w.update("x", self_weight=0.5),
            lambda: w.put_async(x, "x", dst_weights={99: 1.0}),
            lambda: w.get_async("x", src_weights={svc.rank: 1.0}),
            lambda: w.put_async(x, "x", dst_weights={outs[0]: float("nan")}),
            lambda: w.create(x, "x"),
            lambda: w.create(np.zeros(3, np.int64), "ints"),
        ):
            with pytest.raises(InvalidArgumentError) as info:
                call()
            errors.append(str(info.value))
        del bad
        svc.barrier(name="b")
        w.free("x")
        with pytest.raises(InvalidArgumentError):
            w.update("x")
        return errors

    with local_services(p, **OPTIONS) as svcs:
        results = run_ranks(svcs, rank_main, timeout=120)
    e = results[0]
    assert "no window 'nope'" in e[0]
    assert "holds 5 float64, got 4 float64" in e[1]
    assert "got 5 float32" in e[2]
    assert "both self_weight and neighbor_weights" in e[3]
    assert "ranks [99] are not out-neighbours of rank 0" in e[4]
    assert "ranks [0] are not in-neighbours of rank 0" in e[5]
    assert "must be finite" in e[6]
    assert "exists on rank 0" in e[7]
    assert "floating arrays" in e[8]


def test_create_refuses_ranks_that_disagree() -> None:
    def rank_main(svc):
        with pytest.raises(InvalidArgumentError) as info:
            svc.windows.create(np.zeros(4 + svc.rank), "x")
        return str(info.value)

    with local_services(2, **OPTIONS) as svcs:
        results = run_ranks(svcs, rank_main, timeout=60)
    for text in results:
        assert "ranks disagree on the window: sizes from 4 to 5" in text, text


def test_push_sum_consensus_is_exact_in_mass_and_converges() -> None:
    """Asynchronous push-sum over an exponential graph: each rank runs its own number of
    rounds, nobody waits for anybody, and mass is exact; synchronous rounds after them
    take the ratio x/p to the average whatever the threads' timing was."""
    p, n = 4, 6
    start = np.random.default_rng(1).normal(size=(p, n))

    def rank_main(svc):
        w = svc.windows
        w.associated_p = True
        x = start[svc.rank].copy()
        w.create(x, "ps", zero_init=True, topology="exponential-2")
        _, outs = neighbours(p, svc.rank, "exponential-2")
        share = 1.0 / (len(outs) + 1)
        for i in range(60 + 15 * svc.rank):
            w.put_async(x, "ps", self_weight=share, dst_weights=dict.fromkeys(outs, share),
                        accumulate=True).wait(30)  # fmt: skip
            w.update_then_collect("ps")
            if i % 7 == svc.rank:
                time.sleep(0.001)
        svc.barrier(name="end")  # every accumulate has been applied: collect the rest
        w.update_then_collect("ps")
        # How far the asynchronous rounds mixed depends on how the threads were scheduled;
        # synchronous rounds after them make convergence certain (each contracts the error).
        for _ in range(30):
            w.put_async(x, "ps", self_weight=share, dst_weights=dict.fromkeys(outs, share),
                        accumulate=True).wait(30)  # fmt: skip
            svc.barrier(name="sync")  # every rank's push has landed
            w.update_then_collect("ps")
            svc.barrier(name="sync")  # and was collected before the next
        out = x.copy(), w.p("ps")
        w.free("ps")
        return out

    with local_services(p, **OPTIONS) as svcs:
        results = run_ranks(svcs, rank_main, timeout=120)
    mass = sum(x for x, _ in results)
    np.testing.assert_allclose(mass, start.sum(axis=0), rtol=1e-12, atol=1e-12)
    assert sum(pp for _, pp in results) == pytest.approx(p, rel=1e-12)
    for x, pp in results:
        np.testing.assert_allclose(x / pp, start.mean(axis=0), rtol=1e-6, atol=1e-6)


def test_shutdown_frees_windows_and_leaves_no_op_in_flight(caplog) -> None:
    def rank_main(svc):
        svc.windows.create(np.zeros(3), "left", topology="ring")
        svc.windows.put_async(np.ones(3), "left").wait(30)
        return True

    with local_services(3, **OPTIONS) as svcs:
        run_ranks(svcs, rank_main, timeout=60)
        # Standing receives keep no loop busy.  What a wait left behind (an urgency note
        # for the comm thread, a completion) may still be in a queue for a moment: settle.
        deadline = time.monotonic() + 10
        while any(s.loop.busy for s in svcs) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not any(s.loop.busy for s in svcs)
        run_ranks(svcs, lambda s: s.shutdown(timeout=20), timeout=60)  # as processes do
        assert not any(s.loop.lane.by_key for s in svcs)
    assert "in flight" not in caplog.text
    assert "not freed" not in caplog.text


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_16_bit_windows(dtype: str) -> None:
    """float16 and bfloat16 windows (bfloat16 as uint16 patterns with dtype="bfloat16")."""
    import totalreduce.kernels as k
    from totalreduce.dtypes import DType

    p, n = 2, 5

    def as_bits(values: np.ndarray) -> np.ndarray:
        if dtype == "float16":
            return values.astype(np.float16)
        if dtype == "float32":
            return values.astype(np.float32)
        bits = np.empty(values.size, np.uint16)
        k.narrow_into(bits, values.astype(np.float32), DType.BFLOAT16)
        return bits

    def rank_main(svc):
        w = svc.windows
        x = as_bits(np.full(n, float(svc.rank + 1)))
        w.create(x, "h", topology="ring", dtype="bfloat16" if dtype == "bfloat16" else None)
        w.put_async(x, "h").wait(30)
        svc.barrier(name="b")
        w.update("h", 0.5, {1 - svc.rank: 0.5})
        svc.barrier(name="c")
        w.free("h")
        return x.copy()

    with local_services(p, **OPTIONS) as svcs:
        results = run_ranks(svcs, rank_main, timeout=60)
    for got in results:
        np.testing.assert_array_equal(got, as_bits(np.full(n, 1.5)))

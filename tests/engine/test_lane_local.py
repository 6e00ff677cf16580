"""The compiled lane over the in-process transport: ranks are threads, and the lane calls
the local world's compiled message layer (``transport/local_native.py``) through the same
binding record it calls MPI through.  The same cases run under ``mpiexec`` in
``tests/mpi/check_lane.py``; here they need no MPI and run in a second or so each."""

from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest

import totalreduce as tr
from conftest import local_services, run_ranks
from totalreduce.errors import OpFailedError, OpMismatchError


def lane_done(svc) -> int:
    assert svc.loop.lane is not None, "the lane is off"
    return svc.loop.lane.stats()["ops_done"]


@pytest.mark.parametrize("jitter", [0.0, 0.3])
@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_the_lane_runs_every_kind_it_takes_exactly(p: int, jitter: float) -> None:
    """``jitter``: messages held back at random, so they arrive out of order across senders."""
    algos = ["ring", "ring_chunked", "halving_doubling", "recursive_doubling", "bcube", "auto"]

    def rank_main(s):
        before = lane_done(s)
        out = {}
        hs = {}
        for a in algos:
            for n in (0, 1, 257, 5000):
                x = (np.arange(n, dtype=np.int64) * 3 + s.rank) % 17
                hs[(a, n)] = s.allreduce_async(x, algorithm=a, name=f"ar.{a}.{n}")
        x = np.arange(6 * p, dtype=np.float64) + s.rank
        hs["rs"] = s.reduce_scatter_async(x, name="rs")
        hs["ag"] = s.allgather_async(np.full(s.rank + 1, s.rank, np.int32), name="ag")
        counts = [r + 2 for r in range(p)]
        hs["agc"] = s.allgather_async(
            np.full(s.rank + 2, s.rank, np.float32), name="agc", counts=counts
        )
        hs["bc"] = s.broadcast_async(np.full(9, s.rank, np.float64), root=p - 1, name="bc")
        hs["bar"] = s.barrier_async(name="bar")
        for key, h in hs.items():
            out[key] = h.wait(timeout=60)
        return out, lane_done(s) - before

    with local_services(p, jitter=jitter, seed=p) as svcs:
        results = run_ranks(svcs, rank_main, timeout=120)
        holds = svcs[0].transport.world.native().holds
    assert (holds > 0) == (jitter > 0 and p > 1), holds
    for r, (out, ran) in enumerate(results):
        for a in algos:
            for n in (0, 1, 257, 5000):
                want = sum((np.arange(n, dtype=np.int64) * 3 + q) % 17 for q in range(p))
                np.testing.assert_array_equal(out[(a, n)], want)
        full = sum(np.arange(6 * p, dtype=np.float64) + q for q in range(p))
        np.testing.assert_array_equal(out["rs"], full[6 * r : 6 * r + 6])
        np.testing.assert_array_equal(out["ag"], np.repeat(np.arange(p), np.arange(1, p + 1)))
        np.testing.assert_array_equal(out["agc"], np.repeat(np.arange(p), np.arange(2, p + 2)))
        np.testing.assert_array_equal(out["bc"], np.full(9, p - 1.0))
        # every op above ran in the lane (an all-gather without counts is two ops there)
        assert ran >= len(algos) * 4 + 5, ran


@pytest.mark.parametrize("jitter", [0.0, 0.2])
def test_ten_thousand_small_ops_in_flight_in_random_orders(jitter: float) -> None:
    n_ops = 10_000

    def rank_main(s):
        rng = random.Random(1000 + s.rank)
        order = list(range(n_ops))
        rng.shuffle(order)
        hs = {}
        for k in order:
            x = np.full(4 + k % 5, k * 10 + s.rank, dtype=np.int64)
            hs[k] = s.allreduce_async(x, name=f"fl{k}", priority=rng.randint(-3, 3))
        bad = [
            k
            for k in range(n_ops)
            if not np.array_equal(hs[k].wait(timeout=120), np.full(4 + k % 5, 20 * k + 1))
        ]
        return bad, s.loop.lane.stats()

    with local_services(2, jitter=jitter, seed=1) as svcs:
        results = run_ranks(svcs, rank_main, timeout=300)
        assert (svcs[0].transport.world.native().holds > 0) == (jitter > 0)
    for bad, st in results:
        assert bad == []
        assert st["ops_done"] >= n_ops and st["ops_in_flight"] == 0
        assert st["pool_peak_slots"] <= st["pool_slots"]


def test_credit_a_pool_of_sixteen_slots_and_opposite_orders() -> None:
    """Rank 0 submits 300 ops at once, the others block on them one by one in the reverse
    order: frames beyond the credit are announced and wait for READY; no deadlock."""
    n_ops, p = 300, 3

    def rank_main(s):
        if s.rank == 0:
            hs = {
                k: s.allreduce_async(np.full(700, k, np.int64), name=f"c{k}") for k in range(n_ops)
            }
            got = {k: h.wait(timeout=120) for k, h in hs.items()}
        else:
            got = {
                k: s.allreduce(np.full(700, k + s.rank, np.int64), name=f"c{k}")
                for k in reversed(range(n_ops))
            }
        return got, s.loop.lane.stats()

    with local_services(p, floating_pool_bytes=16 * (16 << 10)) as svcs:
        assert svcs[0].loop.lane.stats()["pool_slots"] == 16
        results = run_ranks(svcs, rank_main, timeout=300)
    for got, st in results:
        for k in range(n_ops):
            np.testing.assert_array_equal(got[k], np.full(700, 3 * k + 3))
        assert st["ops_done"] >= n_ops


def _raises(fn) -> str:
    try:
        fn()
    except OpMismatchError as exc:
        return str(exc)
    return ""


def test_a_mismatch_reaches_python_and_every_rank_raises_then_the_name_works() -> None:
    """The lane cannot place a frame whose shape differs: an event to Python, whose answer
    (the error, to every rank of the op) comes back; the name's next op works."""

    def rank_main(s):
        texts = []
        n = 100 if s.rank == 0 else 101
        texts.append(_raises(lambda: s.allreduce(np.ones(n, np.float32), name="m.count")))
        dt = np.float32 if s.rank == 0 else np.int32
        texts.append(_raises(lambda: s.allreduce(np.ones(64, dt), name="m.dtype")))
        # dtype and count both differ (int16 runs in the lane too)
        dt, n = (np.float32, 64) if s.rank == 0 else (np.int16, 128)
        texts.append(_raises(lambda: s.allreduce(np.ones(n, dt), name="m.cross")))
        after = s.allreduce(np.ones(10, np.float32), name="m.count")
        return texts, after

    with local_services(3) as svcs:
        results = run_ranks(svcs, rank_main, timeout=120)
    for texts, after in results:
        for text, what in zip(texts, ("count", "dtype", "cross"), strict=True):
            assert f"op 'm.{what}'" in text, texts
        np.testing.assert_array_equal(after, np.full(10, 3.0))


def _raises_any(fn) -> str:
    try:
        fn()
    except tr.TotalReduceError as exc:
        return str(exc)
    return ""


def test_four_threads_wait_on_their_own_lane_ops() -> None:
    def rank_main(s):
        late = (
            s.allreduce_async(np.ones(8, np.int64) * (s.rank + 1), name="late")
            if s.rank == 0
            else None
        )
        sums: dict[int, int] = {}

        def work(t: int) -> None:
            acc = 0
            for k in range(100):
                acc += int(s.allreduce(np.full(16, t + k, np.int64), name=f"t{t}")[0])
            sums[t] = acc

        threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=120)
        if late is None:
            late = s.allreduce_async(np.ones(8, np.int64) * (s.rank + 1), name="late")
        return sums, late.wait(timeout=60)

    with local_services(2) as svcs:
        results = run_ranks(svcs, rank_main, timeout=180)
    for sums, late in results:
        assert sums == {t: sum((t + k) * 2 for k in range(100)) for t in range(4)}
        np.testing.assert_array_equal(late, np.full(8, 3))


def test_ops_submitted_from_a_thread_finish_while_nobody_waits() -> None:
    """A side thread submits while the comm threads run; the caller only polls ``done()``:
    the ops complete on the comm threads (no ``wait()`` drives them)."""
    n_ops = 200

    def rank_main(s):
        hs = []
        box: list = []

        def submit() -> None:
            for k in range(n_ops):
                hs.append(s.allreduce_async(np.full(32, k, np.float32), name=f"bg{k}"))
            box.append(True)

        th = threading.Thread(target=submit)
        th.start()
        th.join(60)
        deadline = time.monotonic() + 60
        while not all(h.done() for h in hs) and time.monotonic() < deadline:
            time.sleep(0.001)
        finished = all(h.done() for h in hs)
        return [h.wait(timeout=1) for h in hs], box, finished

    with local_services(2) as svcs:
        results = run_ranks(svcs, rank_main, timeout=120)
    for got, box, finished in results:
        assert box == [True] and finished
        for k in range(n_ops):
            np.testing.assert_array_equal(got[k], np.full(32, 2.0 * k))


@pytest.mark.parametrize("jitter", [0.0, 0.3])
def test_large_ops_send_bodies_in_any_order(jitter: float) -> None:
    """Segments above micro_bytes travel as bodies on their own tags, once the receiver has
    posted them; ranks submit in different orders, one late, and (``jitter``) messages are
    held back at random; nothing is left posted."""
    sizes = [70_000, 300_000, 1_000_000]

    def rank_main(s):
        order = list(range(len(sizes) * 2))
        random.Random(s.rank).shuffle(order)
        if s.rank == 2:
            time.sleep(0.05)
        hs = {}
        for k in order:
            n = sizes[k % len(sizes)]
            x = (np.arange(n, dtype=np.float64) + k) * (s.rank + 1)
            algo = "ring" if k < len(sizes) else "halving_doubling"
            hs[k] = s.allreduce_async(x, name=f"L{k}", algorithm=algo, priority=k % 3)
        out = {k: h.wait(timeout=120) for k, h in hs.items()}
        return out, s.loop.lane.stats()

    with local_services(3, jitter=jitter, seed=7) as svcs:
        results = run_ranks(svcs, rank_main, timeout=180)
        assert (svcs[0].transport.world.native().holds > 0) == (jitter > 0)
    for out, st in results:
        for k, got in out.items():
            n = sizes[k % len(sizes)]
            np.testing.assert_array_equal(got, (np.arange(n, dtype=np.float64) + k) * 6)
        assert st["bodies_sent"] > 0 and st["bodies_received"] > 0
        assert st["bodies_in_flight"] == 0 and st["receives_waiting"] == 0


@pytest.mark.parametrize("jitter", [0.0, 0.3])
@pytest.mark.parametrize("p", [2, 3])
def test_large_in_place_ops_land_in_place_in_any_order(p: int, jitter: float) -> None:
    """In place, a large op's gathered parts land straight in the array, their receives
    posted only once the op's own sends from those places are over: exact in every
    algorithm, with several in flight, ranks in different orders, messages held back."""
    algos = ["ring", "ring_chunked", "halving_doubling", "bcube"]
    n = 300_000

    def rank_main(s):
        order = list(range(len(algos) * 2))
        random.Random(s.rank + 10).shuffle(order)
        xs, hs = {}, {}
        for k in order:
            xs[k] = (np.arange(n, dtype=np.float64) + k) * (s.rank + 1)
            hs[k] = s.allreduce_async(
                xs[k], out=xs[k], name=f"ip{k}", algorithm=algos[k % len(algos)]
            )
        for h in hs.values():
            h.wait(timeout=120)
        return xs, s.loop.lane.stats()

    with local_services(p, jitter=jitter, seed=11) as svcs:
        results = run_ranks(svcs, rank_main, timeout=180)
    total = p * (p + 1) // 2
    for xs, st in results:
        for k, got in xs.items():
            np.testing.assert_array_equal(got, (np.arange(n, dtype=np.float64) + k) * total)
        assert st["bodies_in_flight"] == 0 and st["receives_waiting"] == 0


def test_an_op_a_peer_aborts_fails_everywhere_and_the_next_works() -> None:
    def rank_main(s):
        if s.rank == 2:
            s.abort("doomed", 0, reason="given up by the test")
        h = s.allreduce_async(np.ones(32, np.float32), name="doomed")
        try:
            h.wait(timeout=30)
            text = ""
        except (OpFailedError, OpMismatchError) as exc:
            text = str(exc)
        return text, s.allreduce(np.ones(4, np.float32), name="fine")

    with local_services(3) as svcs:
        results = run_ranks(svcs, rank_main, timeout=120)
    for text, after in results:
        assert "given up by the test" in text
        np.testing.assert_array_equal(after, np.full(4, 3.0))


def _busy(seconds: float, until=None) -> tuple[float, bool]:
    """Pure-Python work for ``seconds`` (or until ``until()``): increments per second."""
    n = 0
    t0 = time.perf_counter()
    end = t0 + seconds
    hit = False
    while time.perf_counter() < end:
        for _ in range(2000):
            n += 1
        if until is not None and until():
            hit = True
            break
    return n / (time.perf_counter() - t0), hit


def test_the_comm_threads_do_not_hold_the_interpreter_lock_while_ops_are_in_flight() -> None:
    """Both ranks' ops finish on their comm threads while this thread runs pure Python and
    never waits: the comm threads spin in compiled code without the interpreter lock, so this
    thread's Python keeps most of its speed (median of five rounds)."""
    with local_services(2) as svcs:
        x = np.ones(1024, np.float32)
        for _ in range(20):
            run_ranks(svcs, lambda s: s.allreduce(x, name="bg.warm"))
        spins0 = sum(s.loop.stats.lane_spins for s in svcs)
        ratios = []
        finished = True
        for _ in range(5):
            alone, _ = _busy(0.15)
            hs = [[s.allreduce_async(x, name=f"bg{k}") for k in range(300)] for s in svcs]
            lasts = [h[-1] for h in hs]
            # The completion words, read without driving progress (done() would drive it).
            loaded, hit = _busy(10.0, lambda lasts=lasts: all(h._event.is_set() for h in lasts))
            finished = finished and hit
            ratios.append(loaded / alone)
            for r in range(2):
                for h in hs[r]:
                    np.testing.assert_array_equal(h.wait(timeout=30), np.full(1024, 2.0))
        spins = sum(s.loop.stats.lane_spins for s in svcs) - spins0
    ratio = sorted(ratios)[len(ratios) // 2]
    assert finished and spins > 0, (finished, spins)
    assert ratio >= 0.5, ratios


def test_completion_callbacks_submit_repeats_in_a_chain() -> None:
    """A completion callback (which runs inside a pass, often the comm thread's) submits the
    next repeat of a name: the chain of 200 runs through, exact, without the callback's
    thread asking itself for the loop's lock."""
    n = 200

    def rank_main(s):
        done = threading.Event()
        got: list[float] = []

        def next_op(h) -> None:
            got.append(float(h.wait()[0]))
            if len(got) < n:
                s.allreduce_async(
                    np.full(16, len(got), np.float32), name="chain"
                ).add_done_callback(next_op)
            else:
                done.set()

        s.allreduce_async(np.zeros(16, np.float32), name="chain").add_done_callback(next_op)
        assert done.wait(60), len(got)
        return got

    with local_services(2) as svcs:
        results = run_ranks(svcs, rank_main, timeout=120)
    for got in results:
        assert got == [2.0 * k for k in range(n)]


def test_a_raising_completion_callback_is_logged_and_the_loop_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A callback that raises on a lane op (finished in a waiter's first try, or in a pass)
    is logged naming the op; its op's result stands and the ops after it run."""

    def rank_main(s):
        out, at_once = [], 0
        for k in range(20):
            h = s.allreduce_async(np.full(8, k + s.rank, np.float32), name="cb")
            try:
                h.add_done_callback(lambda _h: 1 / 0)
            except ZeroDivisionError:  # it had ended already: the callback ran here
                at_once += 1
            out.append(float(h.wait(30)[0]))
        out.append(float(s.allreduce(np.ones(8, np.float32), name="cb")[0]))
        return out, at_once

    with caplog.at_level("ERROR", logger="totalreduce.engine"):
        with local_services(2) as svcs:
            results = run_ranks(svcs, rank_main, timeout=60)
    for out, _ in results:
        assert out == [2.0 * k + 1 for k in range(20)] + [2.0]
    failed = [r for r in caplog.records if "completion callback of op 'cb'" in r.getMessage()]
    assert all(r.exc_info[0] is ZeroDivisionError for r in failed)
    assert len(failed) + sum(n for _, n in results) == 40 and failed


@pytest.mark.parametrize("repeat", [False, True], ids=["first_of_its_name", "express_repeat"])
def test_an_op_nobody_waits_for_after_an_idle_spell_completes_at_once(repeat: bool) -> None:
    """After an idle spell the comm thread sleeps long (up to ``idle_backoff_max_s``); an
    op entered into the lane from the submitting thread, which nobody waits for (its
    completion callback is what the caller, a torch future say, needs), wakes it: before,
    the op waited out the sleep (here up to about a second)."""
    sync = threading.Barrier(2)

    def rank_main(s):
        x = np.ones(256, np.float32)
        for _ in range(2):  # a name's second call leaves the express record's lane part
            s.allreduce_async(x, name="warm").wait()
        sync.wait(30)
        time.sleep(1.5)  # the comm thread's sleeps double up to a second
        ended = threading.Event()
        e0 = s.loop.stats.lane_express
        t0 = time.monotonic()
        h = s.allreduce_async(x, name="warm" if repeat else "fresh")
        h.add_done_callback(lambda _h: ended.set())
        took = time.monotonic() - t0 if ended.wait(10) else None
        h.wait(10)
        return took, s.loop.stats.lane_express - e0

    with local_services(2, idle_backoff_max_s=4.0) as svcs:
        results = run_ranks(svcs, rank_main, timeout=60)
    for took, express in results:
        assert took is not None and took < 0.25, f"the callback came {took} s after the submission"
        assert express == (1 if repeat else 0)  # each path is the one meant


def test_large_reduce_scatters_take_their_work_buffer_from_the_pool() -> None:
    """A reduce-scatter's WORK buffer is the whole count: one of 64 KiB or more comes from
    the lane's pool (lane/lane_pool.py), as its scratch does, and goes back when the op
    ends; the results stay exact, in every round and with three in flight."""
    n = 3 * 8192  # float64: 192 KiB of work per op

    def rank_main(s):
        outs = []
        for rnd in range(3):
            xs = [np.arange(n, dtype=np.float64) * (k + 1) + s.rank + rnd for k in range(3)]
            hs = [s.reduce_scatter_async(x, name=f"rs{k}") for k, x in enumerate(xs)]
            outs.append([h.wait(timeout=60) for h in hs])
        pool = s.loop.lane._pool
        return outs, pool.peak(n * 8), pool.in_use(n * 8), len(pool.free.get(n * 8, []))

    with local_services(3) as svcs:
        results = run_ranks(svcs, rank_main, timeout=120)
    for r, (outs, peak, in_use, kept) in enumerate(results):
        for rnd, row in enumerate(outs):
            for k, got in enumerate(row):
                full = sum(np.arange(n, dtype=np.float64) * (k + 1) + q + rnd for q in range(3))
                np.testing.assert_array_equal(got, full[r * n // 3 : (r + 1) * n // 3])
        assert peak == 3 and in_use == 0 and kept == 3, (peak, in_use, kept)


def test_ops_that_end_in_the_same_pass_are_reported_most_urgent_first() -> None:
    """When several lane ops leave the table between two looks (the same pass ended them),
    ``take_done`` hands them over in priority order, highest first, so that their
    completion callbacks run in that order.  (Under Open MPI an urgent op submitted just
    after a large one often ends in the very pass the large one ends in: its callback
    still runs first.)"""
    from types import SimpleNamespace

    from totalreduce import protocol as L
    from totalreduce.lane.lane import LaneOp

    with local_services(1) as svcs:
        svc = svcs[0]
        svc.allreduce(np.ones(4, np.float32), name="warm")  # the lane is made and used
        lane = svc.loop.lane
        with svc.loop.lock:  # the comm thread stays out of the lane meanwhile
            free = [s for s in range(8, 64) if s not in lane.ops][:4]
            prios = [0, 9, -3, 5]
            mem = lane.mem
            for slot, prio in zip(free, prios, strict=True):
                spec = SimpleNamespace(wire_id=1000 + slot, generation=0, priority=prio)
                lane.ops[slot] = LaneOp(spec, slot, 0, None)  # type: ignore[arg-type]
                o = int(mem[L.C_OPS]) + slot * L.O_N
                mem[o + L.O_STATE] = L.S_DONE
                mem[o + L.O_NREQ] = 0
            d = int(mem[L.C_DONEQ])
            mem[d : d + len(free)] = free
            mem[L.C_NDONE] = len(free)
            done = lane.take_done()
    assert [lop.spec.priority for lop, _ in done] == [9, 5, 0, -3]
    assert all(ok for _, ok in done)

"""Run under ``mpiexec -n P``: the compiled lane over real MPI (launched by test_lane.py).

Usage: ``check_lane.py MODE[,MODE...]``: several modes run one after another in one
launch, each on an engine of its own; the lines they print are tagged ``[mode]``.

Modes:
- ``exact``: every element type and reduce op, every allreduce algorithm the lane
  runs, sizes from 0 to the lane's limit, in place and not; the lane ran them all;
  results equal numpy's (bitwise for floats).
- ``flood``: 10,000 small ops in flight at once, each rank in its own random order
  with random priorities; exact results; the lane's pool stays within its slots.
- ``credit``: a pool of 16 slots and ranks submitting 300 ops in opposite orders,
  rank 0 all at once, the others blocking one by one: frames beyond the credit go as
  announcements and wait for READY; exact results, no deadlock.
- ``mismatch``: ranks disagree on an op's count, on its count and dtype both, and on its
  dtype alone:
  every rank raises ``OpMismatchError`` naming the op, and the next op works.
- ``express``: repeats of a name enter the lane from the submitting thread (the express
  path): exact with every ``out`` form, 600 in flight in random orders and priorities, and
  a repeat one rank changes (count, dtype) raises on every rank; the name works after.
- ``stall``: the last rank submits a small and a large op and a reduce-scatter 3 s late, past
  ``stall_shutdown_s=1``: every rank's waits raise ``OpTimeoutError`` naming the op (the
  others also the late rank); once the ranks are together again, the next ops work.
- ``threads``: four threads submit and wait on their own ops at once; a fifth waits
  on an op that only completes after the others.
- ``peer_error``: the last rank aborts an op before submitting it: every rank's wait
  raises with its reason, and the next op works.
- ``background``: 300 ops in flight finish on the comm thread while the main thread runs
  pure Python and never waits; the comm thread spun in compiled code, and the main
  thread's Python kept at least half its speed (median of five rounds).
- ``absent_peer``: an op waits 2 s for a peer that submits late; meanwhile rank 0's
  process uses under 15% of a core (its comm thread spins only just after progress);
  then rank 0 waits 1.5 s in ``allreduce`` of a large op for late peers, using under 30%
  of a core (its waiting thread sleeps between passes after ``wait_spin_s``).
- ``crowd``: 60 large ops in flight in random orders with the lane's body request table
  starting at 16: the bodies beyond it wait while it grows; exact, nothing left waiting.
- ``kinds``: reduce-scatters and all-gathers (uneven parts) of the lane's types, sums,
  max and avg, up to the lane's eager limit and one size above it (large segments), in
  per-rank random orders and priorities: exact, and the lane ran every small one (an
  all-gather's exchange of part sizes too; an all-gather given ``counts=`` is one op).  A
  reduce-scatter whose size one rank changes raises ``OpMismatchError`` naming it on every
  rank, as do a broadcast's root or count, a barrier's algorithm and an all-gather's
  ``counts=`` that one rank changes; the name works after.
  Blocking repeats of one name are exact (a wait on an all-gather goes from its sizes'
  op, in the lane, to its data op).
- ``large``: allreduces above the lane's eager limit, whose bodies travel on their own
  tags once the receiver has posted the receive: every algorithm, the lane's element
  types, sums, max and avg, in place and not, in per-rank random orders and priorities
  with the last rank submitting late (clears it had not asked for are dropped and asked
  again); exact, the lane ran them all and sent bodies.  Then a count that one rank
  changes raises ``OpMismatchError`` on every rank, an op one rank aborts while the
  others' receives are posted fails everywhere with its reason, and after both the next
  large op is exact; an urgent 1 MiB op submitted just after a 16 MiB one (the last rank
  0.2 s after the others) finishes first on every rank: its bodies overtake the queued
  ones.  No body request is left posted.
- ``early``, ``early_small``: rank 0 submits late what the other ranks submitted at once
  (96 allreduces of 2 MiB in eager bodies of 1 MiB; 4,000 of 32 KiB, frames coalesced):
  rank 0's lane holds at most its share of ``floating_pool_bytes`` for them meanwhile,
  and its resident memory grows by less than the pool; then every op is exact.
- ``hostile``: the last rank writes the lane's messages itself: 20,000 announcements of
  ops nobody submits (kept up to the table's size, charged), credited frames beyond the
  credit (refused: a ``FrameError`` naming it on rank 0, which frees what it held), then a
  flood after it was marked bad (dropped); rank 0's resident memory stays within the pool
  throughout, and the other ranks go on among themselves.
"""

from __future__ import annotations

import functools
import random
import statistics
import threading
import time
from collections.abc import Callable

import numpy as np
from launch_modes import run_modes

import totalreduce as tr
from totalreduce import protocol as L
from totalreduce.errors import OpFailedError, OpMismatchError

DTYPES = ["float32", "float64", "int32", "int64", "int16", "int8", "uint8", "bool", "float16"]
#: The types the lane reduces: every one.
LANE_TYPES = set(DTYPES)
OPS = ["sum", "max", "min", "product", "avg", "band", "bor", "bxor"]
ALGOS = ["ring", "ring_chunked", "halving_doubling", "recursive_doubling", "bcube", "auto"]


def value(k: int, n: int, dtype: str, rank: int) -> np.ndarray:
    idx = np.arange(n, dtype=np.int64)
    if dtype == "bool":
        return (idx + rank + k) % 3 == 0
    return ((idx * 7 + rank * 3 + k) % 11 + 1).astype(dtype)


def reference(k: int, n: int, dtype: str, op: str, p: int) -> np.ndarray:
    xs = [value(k, n, dtype, r) for r in range(p)]
    if dtype == "bool":
        f = {"sum": np.logical_or, "max": np.logical_or, "bor": np.logical_or,
             "product": np.logical_and, "min": np.logical_and, "band": np.logical_and,
             "bxor": np.logical_xor}[op]  # fmt: skip
    else:
        f = {"sum": np.add, "avg": np.add, "max": np.maximum, "min": np.minimum,
             "product": np.multiply, "band": np.bitwise_and, "bor": np.bitwise_or,
             "bxor": np.bitwise_xor}[op]  # fmt: skip
    out = xs[0].copy()
    for x in xs[1:]:
        out = f(out, x).astype(xs[0].dtype)
    if op == "avg":
        out = (out / p).astype(dtype) if dtype.startswith("float") else out // p
    return out


def valid(dtype: str, op: str) -> bool:
    if op in ("band", "bor", "bxor") and dtype.startswith("float"):
        return False
    return not (op == "avg" and dtype in ("bool", "int8", "uint8", "int16"))


def lane_done() -> int:
    lane = tr.default_service().loop.lane
    assert lane is not None, "the lane is off"
    return lane.stats()["ops_done"]


def mode_exact(p: int, rank: int) -> None:
    before = lane_done()
    bad = 0
    k = 0
    cases = []
    for algo in ALGOS:
        for n in (0, 1, p + 1, 257, 2048):
            for dtype in DTYPES:
                for op in OPS:
                    if valid(dtype, op) and (op in ("sum", "avg") or n == 257):
                        cases.append((algo, n, dtype, op))
    handles = []
    for algo, n, dtype, op in cases:
        k += 1
        x = value(k, n, dtype, rank)
        handles.append(
            (k, algo, n, dtype, op, x, tr.allreduce_async(x, op=op, algorithm=algo, name=f"e{k}"))
        )
    for k, algo, n, dtype, op, _x, h in handles:
        got = h.wait(timeout=60)
        want = reference(k, n, dtype, op, p)
        if dtype == "float16" and op == "avg":
            ok = np.allclose(got.astype(np.float32), want.astype(np.float32), rtol=1e-3)
        else:
            ok = np.array_equal(got, want) and got.dtype == want.dtype
        if not ok:
            bad += 1
            print(
                f"rank {rank}: WRONG {algo} n={n} {dtype} {op}: {got[:4]} vs {want[:4]}", flush=True
            )
    # in place
    for algo in ALGOS:
        x = value(1, 1000, "float64", rank)
        tr.allreduce(x, out=x, algorithm=algo, name=f"inplace.{algo}")
        if not np.array_equal(x, reference(1, 1000, "float64", "sum", p)):
            bad += 1
            print(f"rank {rank}: WRONG in place {algo}", flush=True)
    ran = lane_done() - before
    expect = sum(1 for c in cases if c[2] in LANE_TYPES) + len(ALGOS)
    ok = bad == 0 and ran == expect
    print(
        f"rank {rank}: EXACT {'OK' if ok else 'FAILED'} lane ran {ran} of {expect}",
        flush=True,
    )


def mode_flood(p: int, rank: int) -> None:
    n_ops = 10_000
    rng = random.Random(1000 + rank)
    order = list(range(n_ops))
    rng.shuffle(order)
    hs = {}
    for k in order:
        x = np.full(4 + k % 5, k * 10 + rank, dtype=np.int64)
        hs[k] = tr.allreduce_async(x, name=f"fl{k}", priority=rng.randint(-3, 3))
    bad = 0
    for k in range(n_ops):
        got = hs[k].wait(timeout=120)
        if not np.all(got == sum(k * 10 + r for r in range(p))) or got.size != 4 + k % 5:
            bad += 1
    lane = tr.default_service().loop.lane
    st = lane.stats()
    print(f"rank {rank}: FLOOD {'OK' if bad == 0 else 'FAILED'} {st}", flush=True)


def mode_credit(p: int, rank: int) -> None:
    n_ops = 300
    got = {}
    if rank == 0:
        hs = {
            k: tr.allreduce_async(np.full(700, k, dtype=np.int64), name=f"c{k}")
            for k in range(n_ops)
        }
        got = {k: h.wait(timeout=120) for k, h in hs.items()}
    else:
        for k in reversed(range(n_ops)):
            got[k] = tr.allreduce(np.full(700, k + rank, dtype=np.int64), name=f"c{k}")
    want = {k: np.full(700, k * p + p * (p - 1) // 2, dtype=np.int64) for k in range(n_ops)}
    ok = all(np.array_equal(got[k], want[k]) for k in range(n_ops))
    st = tr.default_service().loop.lane.stats()
    print(f"rank {rank}: CREDIT {'OK' if ok else 'FAILED'} {st}", flush=True)


def _raises(fn) -> str:
    try:
        fn()
    except OpMismatchError as exc:
        return str(exc)
    return ""


def mode_mismatch(p: int, rank: int) -> None:
    texts = []
    # inside the lane: counts differ
    n = 100 if rank == 0 else 101
    texts.append(_raises(lambda: tr.allreduce(np.ones(n, np.float32), name="m.count")))
    # dtype and count both differ
    dt, n = (np.float32, 64) if rank == 0 else (np.int16, 128)
    texts.append(_raises(lambda: tr.allreduce(np.ones(n, dt), name="m.cross")))
    # dtype differs (same byte count)
    dt = np.float32 if rank == 0 else np.int32
    texts.append(_raises(lambda: tr.allreduce(np.ones(64, dt), name="m.dtype")))
    after = tr.allreduce(np.ones(10, np.float32), name="m.count")
    named = zip(texts, ("count", "cross", "dtype"), strict=True)
    ok = all(f"op 'm.{w}'" in t for t, w in named) and np.all(after == p)
    print(f"rank {rank}: MISMATCH {'OK' if ok else 'FAILED'} {texts}", flush=True)


def mode_kinds(p: int, rank: int) -> None:
    from totalreduce.algorithms.schedule import balanced_parts

    micro = tr.default_service().config.micro_bytes
    before = lane_done()
    cases = []
    for dtype in sorted(LANE_TYPES):
        isz = np.dtype(dtype).itemsize
        top = 8 * micro // isz  # the lane's eager limit, in elements: above, bodies
        for total in (1, p + 1, 1000, top, top + 1):
            for op in ("sum", "max", "avg"):
                if valid(dtype, op):
                    cases.append(("rs", dtype, total, op))
            cases.append(("ag", dtype, total, "sum"))
            cases.append(("agc", dtype, total, "sum"))  # the parts' sizes given: one op
            cases.append(("bc", dtype, total, "one_to_all"))
        cases.append(("bc", dtype, 5 * top + 3, "pipelined"))
    cases += [("rs", "float32", 300_001, "sum"), ("ag", "float64", 200_003, "sum")]
    cases += [("br", "int64", 0, algo) for algo in ("all_to_all", "all_to_one") * 3]
    rng = random.Random(1000 + rank)
    order = list(enumerate(cases))
    rng.shuffle(order)
    handles = []
    for k, (kind, dtype, total, op) in order:
        prio = rng.randrange(-3, 4)
        if kind == "rs":
            x = value(k, total, dtype, rank)
            h = tr.reduce_scatter_async(x, op=op, name=f"k{k}", priority=prio)
        elif kind == "bc":  # op: the algorithm; the root: k % p, agreed by every rank
            x = value(k, total, dtype, rank)
            h = tr.broadcast_async(x, root=k % p, name=f"k{k}", priority=prio, algorithm=op)
        elif kind == "br":
            h = tr.barrier_async(name=f"k{k}", algorithm=op)
        else:
            parts = [total // p + (r < total % p) for r in range(p)]
            parts = parts[::-1] if k % 2 else parts  # uneven either way round
            x = value(k, parts[rank], dtype, rank)
            counts = parts if kind == "agc" else None
            h = tr.allgather_async(x, name=f"k{k}", priority=prio, counts=counts)
        handles.append((k, h))
    bad = 0
    for k, h in handles:
        kind, dtype, total, op = cases[k]
        got = h.wait(timeout=60)
        if kind == "rs":
            lo, n = balanced_parts(total, p)[rank]
            want = reference(k, total, dtype, op, p)[lo : lo + n]
            size_ok = got.size == n
        elif kind == "bc":
            want = value(k, total, dtype, k % p)
            size_ok = got.size == total
        elif kind == "br":
            want, size_ok = got, got is None
        else:
            parts = [total // p + (r < total % p) for r in range(p)]
            parts = parts[::-1] if k % 2 else parts
            want = np.concatenate([value(k, parts[r], dtype, r) for r in range(p)])
            size_ok = got.size == total
        if kind == "br":
            same = True
        elif dtype == "float16" and op == "avg":
            same = np.allclose(got.astype(np.float32), want.astype(np.float32), rtol=1e-3)
        else:
            same = np.array_equal(got, want) and got.dtype == want.dtype
        if not (same and size_ok):
            bad += 1
            print(f"rank {rank}: WRONG {kind} {dtype} {total} {op}: {got[:4]} vs {want[:4]}")
    ran = lane_done() - before
    # every op, of every size, and every all-gather's exchange of part sizes (none for
    # those given counts=)
    expect = len(cases) + sum(1 for c in cases if c[0] == "ag")
    # blocking repeats of one name (a waiter on an all-gather's sizes goes on to its data)
    for i in range(40):
        x = value(i, 64 * p, "float32", rank)
        got = tr.reduce_scatter(x, name="k.rs")
        want = reference(i, 64 * p, "float32", "sum", p)[64 * rank : 64 * rank + 64]
        got2 = tr.allgather(value(i, 3 + rank, "int64", rank), name="k.ag")
        want2 = np.concatenate([value(i, 3 + r, "int64", r) for r in range(p)])
        if not (np.array_equal(got, want) and np.array_equal(got2, want2)):
            bad += 1
            print(f"rank {rank}: WRONG blocking repeat {i}", flush=True)
    # a reduce-scatter whose size one rank changes
    n = 100 if rank < p - 1 else 104
    text = _raises(lambda: tr.reduce_scatter(np.ones(n, np.float32), name="k.count"))
    after = tr.reduce_scatter(np.ones(10 * p, np.float32), name="k.count")
    # broadcasts whose root, then count, one rank changes: every rank raises (the root too:
    # it finishes only once every rank confirmed), and the name works after
    texts = []
    for name, root, n in (("k.root", 1 if rank == p - 1 else 0, 50), ("k.bsize", 0, 50 + rank)):
        x = np.full(n, rank, np.float32)
        texts.append(_raises(lambda x=x, r=root, m=name: tr.broadcast(x, root=r, name=m)))
        texts.append(str(tr.broadcast(np.full(7, rank, np.float32), root=p - 1, name=name)[0]))
    # a barrier whose algorithm one rank changes
    algo = "all_to_one" if rank == p - 1 else "all_to_all"
    texts.append(_raises(lambda: tr.barrier(name="k.bar", algorithm=algo)))
    tr.barrier(name="k.bar")
    # an all-gather whose counts= the last rank gives otherwise (the same total): every
    # rank raises, and the name works after
    counts = [2 + (r == 0) - (r == 1) for r in range(p)] if rank == p - 1 else [2] * p
    part = np.full(counts[rank], rank, np.float32)
    texts.append(_raises(lambda: tr.allgather(part, name="k.agc", counts=counts)))
    gathered = tr.allgather(np.full(2, rank, np.float32), name="k.agc", counts=[2] * p)
    ok = (
        bad == 0
        and ran == expect
        and "op 'k.count'" in text  # raised as OpMismatchError (_raises)
        and np.all(after == p)
        and "op 'k.bar'" in texts[4]
        and "op 'k.root'" in texts[0]
        and "op 'k.bsize'" in texts[2]
        and texts[1] == texts[3] == str(float(p - 1))
        and "op 'k.agc'" in texts[5]
        and "counts=" in texts[5]
        and np.array_equal(gathered, np.repeat(np.arange(p, dtype=np.float32), 2))
    )
    print(
        f"rank {rank}: KINDS {'OK' if ok else 'FAILED'} lane ran {ran} of {expect}; {text!r} "
        f"{texts!r}",
        flush=True,
    )


def mode_express(p: int, rank: int) -> None:
    """Repeats of a name take the express path into the lane: exact results with every
    ``out`` form, many in flight in random orders and priorities, all-gathers given
    ``counts=``, and a repeat that one rank changes is a mismatch on every rank, after
    which the name works again."""
    loop = tr.default_service().loop
    before = loop.stats.lane_express
    bad = 0
    x = np.arange(1000, dtype=np.float32) + rank
    want = sum(np.arange(1000, dtype=np.float32) + r for r in range(p))
    y = np.empty_like(x)
    for k in range(60):
        if k % 3 == 0:
            got = tr.allreduce(x, name="x.a")
        elif k % 3 == 1:
            tr.allreduce(x, name="x.a", out=y)
            got = y.copy()
        else:
            got = x.copy()
            tr.allreduce(got, name="x.a", out=got)
        bad += not np.array_equal(got, want)
    rng = random.Random(rank)
    for rep in range(3):
        order = list(range(200))
        rng.shuffle(order)
        hs = {
            i: tr.allreduce_async(
                np.full(64, i * 10 + rank + rep, np.int64), name=f"x.f{i}",
                priority=rng.randrange(10),
            )
            for i in order
        }  # fmt: skip
        for i in sorted(hs):
            expect = sum(i * 10 + r + rep for r in range(p))
            bad += not np.all(hs[i].wait(timeout=60) == expect)
    entered = loop.stats.lane_express - before
    # all-gathers given counts= (uneven parts): repeats enter the lane from this thread too
    counts = [10 + 3 * r for r in range(p)]
    whole = np.concatenate([np.arange(c, dtype=np.float64) + r for r, c in enumerate(counts)])
    before_ag = loop.stats.lane_express
    for _ in range(30):
        part = np.arange(counts[rank], dtype=np.float64) + rank
        bad += not np.array_equal(tr.allgather(part, name="x.ag", counts=counts), whole)
    gathered = loop.stats.lane_express - before_ag
    for _ in range(3):
        tr.allreduce(np.ones(100, np.float32), name="x.m")
    n = 101 if rank == 1 else 100
    count = _raises(lambda: tr.allreduce(np.ones(n, np.float32), name="x.m"))
    dt = np.int32 if rank == 1 else np.float32
    dtype = _raises(lambda: tr.allreduce(np.ones(100, dt), name="x.m"))
    after = tr.allreduce(np.ones(100, np.float32), name="x.m")
    ok = (
        bad == 0
        and entered >= 100
        and gathered >= 20
        and "op 'x.m' generation 3" in count
        and "op 'x.m' generation 4" in dtype
        and np.all(after == p)
    )
    print(
        f"rank {rank}: EXPRESS {'OK' if ok else 'FAILED'} bad={bad} entered={entered} "
        f"gathered={gathered} "
        f"{count!r} {dtype!r}",
        flush=True,
    )


def mode_stall(p: int, rank: int) -> None:
    """The stall inspector on lane ops: the last rank submits 3 s late, past
    stall_shutdown_s=1; every rank's wait raises OpTimeoutError naming the op (the others'
    also name the late rank), and once the ranks are together again the next op works."""
    from totalreduce.errors import OpTimeoutError

    if rank == p - 1:
        time.sleep(3.0)
    t0 = time.monotonic()
    texts = []
    # a small op, a large one (its receives posted, then orphaned when it fails) and a
    # reduce-scatter
    hs = [
        tr.allreduce_async(np.ones(8, np.float32), name="s.late"),
        tr.allreduce_async(np.ones(200_000, np.float32), name="s.big"),
        tr.reduce_scatter_async(np.ones(8 * p, np.float32), name="s.rs"),
    ]
    for h in hs:
        try:
            h.wait()
            texts.append("")
        except OpTimeoutError as exc:
            texts.append(str(exc))
    took = time.monotonic() - t0
    from mpi4py import MPI

    MPI.COMM_WORLD.Barrier()  # the late rank is late for every op until it catches up
    after = tr.allreduce(np.ones(4, np.float32), name="s.after")
    big = tr.allreduce(np.ones(200_000, np.float32), name="s.big.after")
    ok = (
        "op 's.late' generation 0" in texts[0]
        and "op 's.big' generation 0" in texts[1]
        and "op 's.rs' generation 0" in texts[2]
        and np.all(after == p)
        and np.all(big == p)
    )
    if rank != p - 1:
        ok = ok and all(f"ranks [{p - 1}] have not submitted it" in t for t in texts) and took < 5
    print(f"rank {rank}: STALL {'OK' if ok else 'FAILED'} {took:.1f}s {texts!r}", flush=True)


def mode_threads(p: int, rank: int) -> None:
    results = {}
    late = tr.allreduce_async(np.ones(8, np.int64) * (rank + 1), name="late") if rank == 0 else None

    def work(t: int) -> None:
        acc = 0
        for k in range(200):
            acc += int(tr.allreduce(np.full(16, t + k, np.int64), name=f"t{t}")[0])
        results[t] = acc

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    if rank != 0:
        late = tr.allreduce_async(np.ones(8, np.int64) * (rank + 1), name="late")
    got = late.wait(timeout=60)
    ok = all(results[t] == sum((t + k) * p for k in range(200)) for t in range(4))
    ok = ok and np.all(got == p * (p + 1) // 2)
    print(f"rank {rank}: THREADS {'OK' if ok else 'FAILED'}", flush=True)


def _busy(seconds: float, until: Callable[[], bool] | None = None) -> tuple[float, bool]:
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


def mode_background(p: int, rank: int) -> None:
    """Ops progress on the comm thread while this thread runs pure Python and never waits
    or polls; the comm thread spins in compiled code then, not holding the interpreter
    lock, so this thread's Python keeps most of its speed."""
    from mpi4py import MPI

    svc = tr.default_service()
    x = np.ones(1024, np.float32)
    for _ in range(20):
        tr.allreduce(x, name="bg.warm")
    ratios = []
    finished = True
    spins0 = svc.loop.stats.lane_spins
    for _ in range(5):
        MPI.COMM_WORLD.Barrier()
        alone, _ = _busy(0.15)
        MPI.COMM_WORLD.Barrier()
        hs = [tr.allreduce_async(x, name=f"bg{k}") for k in range(300)]
        last = hs[-1]
        # The completion word, read without driving progress (done() would drive it).
        loaded, hit = _busy(10.0, last._event.is_set)
        finished = finished and hit and all(h._event.is_set() for h in hs)
        ratios.append(loaded / alone)
        for h in hs:
            assert np.all(h.wait(timeout=30) == p)
    spins = svc.loop.stats.lane_spins - spins0
    ratio = sorted(ratios)[len(ratios) // 2]
    ok = finished and spins > 0 and ratio >= 0.5
    print(
        f"rank {rank}: BACKGROUND {'OK' if ok else 'FAILED'} finished={finished} "
        f"compiled_spins={spins} busy_speed_ratio={ratio:.2f} {[round(r, 2) for r in ratios]}",
        flush=True,
    )


def mode_large(p: int, rank: int) -> None:
    lane = tr.default_service().loop.lane
    st0 = lane.stats()
    rng = random.Random(77 + rank)
    cases = []
    for algo in ALGOS:
        for n, dtype, op in (
            (40_000, "float32", "sum"),
            (300_001, "float32", "sum"),
            (70_000, "float64", "avg"),
            (90_001, "int64", "max"),
            (100_000, "float16", "sum"),
            (50_000, "int32", "sum"),
        ):
            cases.append((algo, n, dtype, op))
    order = list(range(len(cases)))
    rng.shuffle(order)
    handles = {}
    for i in order:
        if rank == p - 1 and i == order[len(order) // 2]:
            time.sleep(0.3)  # the others' clears for what follows come before its ops
        algo, n, dtype, op = cases[i]
        x = value(i, n, dtype, rank)
        form = i % 3  # out of place, in place, into a given out
        out = x if form == 1 else (np.empty_like(x) if form == 2 else None)
        handles[i] = (
            out,
            tr.allreduce_async(
                x, op=op, algorithm=algo, name=f"L{i}", out=out, priority=rng.randint(-2, 2)
            ),
        )
    bad = 0
    for i, (out, h) in sorted(handles.items()):
        algo, n, dtype, op = cases[i]
        got = h.wait(timeout=60)
        if out is not None and not np.shares_memory(got, out):
            bad += 1
        want = reference(i, n, dtype, op, p)
        if dtype == "float16":  # sums of small integers: exact in float16 too
            ok = np.array_equal(got.astype(np.float32), want.astype(np.float32))
        else:
            ok = np.array_equal(got, want)
        if not ok:
            bad += 1
            print(f"rank {rank}: WRONG {algo} n={n} {dtype} {op}: {got[:4]} vs {want[:4]}")
    st = lane.stats()
    ran = st["ops_done"] - st0["ops_done"]
    bodies = st["bodies_sent"] - st0["bodies_sent"]
    # a count one rank changes
    n = 50_000 if rank == 0 else 50_001
    text = _raises(lambda: tr.allreduce(np.ones(n, np.float32), name="L.count"))
    # an op one rank aborts while the others' receives are posted
    if rank == p - 1:
        time.sleep(0.2)
        tr.default_service().abort("L.doomed", 0, reason="given up by the test")
    h = tr.allreduce_async(np.ones(200_000, np.float32), name="L.doomed")
    try:
        h.wait(timeout=30)
        why = ""
    except (OpFailedError, OpMismatchError) as exc:
        why = str(exc)
    after = tr.allreduce(np.full(200_000, rank, np.float32), name="L.after")
    # preemption at segment boundaries: an urgent op submitted behind a large one overtakes it
    tr.allreduce(np.ones(8, np.float32), name="L.sync")
    if rank == p - 1:  # the others' ops wait for it with every receive posted
        time.sleep(0.2)
    ends: list[str] = []
    big = tr.allreduce_async(np.ones(4 << 20, np.float32), name="L.big", priority=0)
    big.add_done_callback(lambda _h: ends.append("big"))
    urgent = tr.allreduce_async(np.ones(1 << 18, np.float32), name="L.urgent", priority=9)
    urgent.add_done_callback(lambda _h: ends.append("urgent"))
    big.wait(timeout=60)
    urgent.wait(timeout=60)
    # Orphans (the failed ops' requests) leave: receives when their sender's body or empty
    # message comes, or cancelled after LANE_ORPHAN_S (2 s) if nothing will; ops of every
    # rank together, until no rank has a body posted (the same number of ops everywhere).
    for _ in range(100):
        left = int(tr.allreduce(np.array([lane.stats()["bodies_in_flight"]]), name="L.tick")[0])
        if left == 0:
            break
        time.sleep(0.05)
    ok = (
        bad == 0
        and ran == len(cases)
        and bodies > 0
        and "op 'L.count'" in text
        and "given up by the test" in why
        and np.all(after == p * (p - 1) // 2)
        and ends == ["urgent", "big"]
        and left == 0
    )
    print(
        f"rank {rank}: LARGE {'OK' if ok else 'FAILED'} bad={bad} ran={ran}/{len(cases)} "
        f"bodies={bodies} left={left} ends={ends} count={text[:80]!r} doomed={why[:80]!r}",
        flush=True,
    )


def mode_crowd(p: int, rank: int) -> None:
    """More large receives than the lane's body request table holds (16 at first, set by
    ``main``), in per-rank random orders: the rest wait in order while the table grows;
    nothing is lost or stuck (a table that stayed full of receives would deadlock)."""
    lane = tr.default_service().loop.lane
    # Above the lane's eager limit (eight micro_bytes segments): every op's bodies are large.
    base = 8 * tr.default_service().config.micro_bytes // 4 + 1000
    rng = random.Random(5 + rank)
    order = list(range(60))
    rng.shuffle(order)
    hs = {}
    for k in order:
        x = np.full(base + k, k + rank, dtype=np.float32)
        hs[k] = tr.allreduce_async(x, name=f"cr{k}", priority=rng.randint(-2, 2))
    waiting = lane.stats()["receives_waiting"]
    bad = 0
    for k in range(60):
        got = hs[k].wait(timeout=60)
        if got.size != base + k or not np.all(got == sum(k + r for r in range(p))):
            bad += 1
    st = lane.stats()
    ok = (
        bad == 0
        and st["body_request_slots"] > 16
        and st["receives_waiting"] == 0
        and st["bodies_in_flight"] == 0
    )
    print(f"rank {rank}: CROWD {'OK' if ok else 'FAILED'} bad={bad} waiting={waiting} {st}",
          flush=True)  # fmt: skip


def mode_absent_peer(p: int, rank: int) -> None:
    """An op in flight whose peer submits 2 s late costs this rank little CPU meanwhile:
    the comm thread spins only just after progress, then sleeps between passes; and so
    does a thread that waits on it (``wait_spin_s`` of polling, then sleeps)."""
    x = np.ones(256, np.float32)
    # A large op (above eight micro_bytes segments): its receives posted, nothing arrives.
    big = np.ones(8 * tr.default_service().config.micro_bytes // 4 + 1000, np.float32)
    tr.allreduce(x, name="ap.warm")
    if rank != 0:
        time.sleep(2.0)
        tr.allreduce(x, name="ap.late")
        time.sleep(1.5)
        tr.allreduce(big, name="ap.waited")
        print(f"rank {rank}: ABSENT_PEER OK", flush=True)
        return
    h = tr.allreduce_async(x, name="ap.late")
    c0, t0 = time.process_time(), time.perf_counter()
    while time.perf_counter() - t0 < 1.5:
        time.sleep(0.05)  # the training loop does something else
    share = (time.process_time() - c0) / (time.perf_counter() - t0)
    ok = not h._event.is_set() and np.all(h.wait(timeout=30) == p) and share < 0.15
    c0, t0 = time.process_time(), time.perf_counter()
    got = tr.allreduce(big, name="ap.waited")  # the others come 1.5 s later
    waited = time.perf_counter() - t0
    wshare = (time.process_time() - c0) / waited
    ok = ok and np.all(got == p) and waited > 1.0 and wshare < 0.3
    print(
        f"rank {rank}: ABSENT_PEER {'OK' if ok else 'FAILED'} cpu={share:.1%} "
        f"waiting={wshare:.1%} over {waited:.1f}s",
        flush=True,
    )


def mode_nap(p: int, rank: int) -> None:
    """With ``nap_s`` (a node service's engine), a thread waiting for a large op whose peer
    is late sleeps between its polls: little CPU of its own while it waits (where it
    would yield its core between polls, as fast as the core comes back), the same result.
    Three waits of about 15 ms each, within ``wait_spin_s`` (a waiter polls that long)."""
    lane = tr.default_service().loop.lane
    assert lane is not None, "the lane is off"
    big = np.ones((1 << 20) // 4, np.float32)  # 1 MiB: above lane_core._NAP_MIN_BYTES
    shares, ok = [], lane.mem[L.C_NAP_NS] == 20_000
    # Three waits, and three more where the first three's median is high: once in a CI run
    # on the busy 2-core machine a waiter measured 95% (not seen again in 14 runs since).
    for k in range(6):
        if k == 3:  # (every rank learns rank 0's median: they run the same ops)
            high = 1 if shares and statistics.median(shares) >= 0.8 else 0
            if not tr.allreduce(np.array([high], np.int64), name="nap.again")[0]:
                break
        tr.allreduce(np.ones(4, np.float32), name="nap.sync")
        if rank != 0:
            time.sleep(0.015)
        c0, t0 = time.thread_time(), time.perf_counter()
        got = tr.allreduce(big, name="nap.big")
        waited = time.perf_counter() - t0
        if rank == 0:
            shares.append((time.thread_time() - c0) / waited)
            ok = ok and waited > 0.01
        ok = ok and bool(np.all(got == p))
        big[:] = 1
    share = statistics.median(shares[-3:]) if shares else 0.0
    # measured: 36% quiet, up to 62% with the 2-core machine busy (96% with nap_s 0, yielding)
    ok = ok and share < 0.8
    print(f"rank {rank}: NAP {'OK' if ok else 'FAILED'} waiting cpu={share:.1%}", flush=True)


def mode_outer(p: int, rank: int) -> None:
    """A waiter that asks for the lane's outer words (a node service's arena thread,
    ``Handle.drive(span, outer=True)``) is back, its op not ended, as soon as their sum
    moves from the word it is compared with or the flag word is set; one that does not
    ask, or whose words did not move, drives for its whole span.  The op then ends,
    exact.  Rank 1 comes 0.4 s late, so the op is in flight all along on rank 0."""
    loop = tr.default_service().loop
    assert loop.lane is not None, "the lane is off"
    words = np.zeros(6, np.int64)  # "tails" at 0 and 2 (16 bytes apart); the sum seen at 4;
    at = words.ctypes.data  # the flag at 5
    loop.watch_outer(at, 16, 2, at + 32, at + 40)
    big = np.ones((1 << 20) // 4, np.float32)
    tr.allreduce(np.ones(4, np.float32), name="outer.sync")
    if rank != 0:
        time.sleep(0.4)
        ok = bool(np.all(tr.allreduce(big, name="outer.big") == p))
        print(f"rank {rank}: OUTER {'OK' if ok else 'FAILED'}", flush=True)
        return

    def later(i: int, value: int) -> None:
        time.sleep(0.01)
        words[i] = value

    def drive(span: float, outer: bool, move: tuple[int, int] | None = None) -> tuple[bool, float]:
        t = threading.Thread(target=later, args=move) if move else None
        t0 = time.perf_counter()
        if t is not None:
            t.start()
        ended = h.drive(span, outer=outer)
        took = time.perf_counter() - t0
        if t is not None:
            t.join()
        return ended, took

    h = tr.allreduce_async(big, name="outer.big")
    still = drive(0.03, True)  # nothing moved: the whole span
    words[4] = 5  # "seen" other than the tails' sum (0): moved at once
    at_once = drive(0.2, True)
    words[4] = 0
    tail = drive(0.2, True, (2, 3))  # a "tail" moves after 10 ms
    words[4] = 3  # the sum is seen again
    flag = drive(0.2, True, (5, 1))  # the flag after 10 ms
    words[5] = 0
    words[0] = 7  # moved, but this waiter does not ask: the whole span
    deaf = drive(0.03, False)
    loop.watch_outer(0, 0, 0, 0, 0)
    got = h.wait(timeout=30)
    ok = (
        not still[0] and still[1] >= 0.03
        and not at_once[0] and at_once[1] < 0.1
        and not tail[0] and 0.005 < tail[1] < 0.15
        and not flag[0] and 0.005 < flag[1] < 0.15
        and not deaf[0] and deaf[1] >= 0.03
        and bool(np.all(got == p))
    )  # fmt: skip
    print(
        f"rank {rank}: OUTER {'OK' if ok else 'FAILED'} still={still} at_once={at_once} "
        f"tail={tail} flag={flag} deaf={deaf}",
        flush=True,
    )


def mode_peer_error(p: int, rank: int) -> None:
    svc = tr.default_service()
    if rank == p - 1:
        svc.abort("doomed", 0, reason="given up by the test")
    h = tr.allreduce_async(np.ones(32, np.float32), name="doomed")
    try:
        h.wait(timeout=30)
        text = ""
    except (OpFailedError, OpMismatchError) as exc:
        text = str(exc)
    after = tr.allreduce(np.ones(4, np.float32), name="fine")
    ok = "given up by the test" in text and np.all(after == p)
    print(f"rank {rank}: PEER_ERROR {'OK' if ok else 'FAILED'} {text!r}", flush=True)


MIB = 1 << 20


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _early(p: int, rank: int, tag: str, n_ops: int, count: int) -> None:
    """Rank 0 submits (in reverse) 1.5 s after the others submitted everything."""
    from mpi4py import MPI

    pool = tr.default_service().config.floating_pool_bytes
    xs = [np.full(count, k + rank, np.float64) for k in range(n_ops)]
    lane = tr.default_service().loop.lane
    MPI.COMM_WORLD.Barrier()
    held = grew = 0
    if rank != 0:
        hs = [tr.allreduce_async(xs[k], name=f"{tag}{k}") for k in range(n_ops)]
        got = [h.wait(timeout=120) for h in hs]
    else:
        rss0 = _rss()
        time.sleep(1.5)
        grew = _rss() - rss0
        held = lane.floating_bytes
        order = {k: tr.allreduce_async(xs[k], name=f"{tag}{k}") for k in reversed(range(n_ops))}
        got = [order[k].wait(timeout=120) for k in range(n_ops)]
    base = p * (p - 1) / 2
    ok = all(np.array_equal(got[k], np.full(count, p * k + base)) for k in range(n_ops))
    if rank == 0:
        st = lane.stats()
        ok = ok and 0 < held <= lane.pool_bytes and lane.floating_peak_bytes <= lane.pool_bytes
        ok = ok and grew < pool
        print(
            f"rank 0: {tag} held {held / MIB:.1f} MiB (the lane's share "
            f"{lane.pool_bytes / MIB:.0f} MiB), RSS +{grew / MIB:.1f} MiB (pool "
            f"{pool / MIB:.0f} MiB) {st}",
            flush=True,
        )
    print(f"rank {rank}: {tag.upper()} {'OK' if ok else 'FAILED'}", flush=True)


def mode_early(p: int, rank: int) -> None:
    _early(p, rank, "early", 96, 256 << 10)  # 2 MiB each, in eager bodies of 1 MiB


def mode_early_small(p: int, rank: int) -> None:
    _early(p, rank, "early_small", 4000, 4 << 10)  # 32 KiB each, frames coalesced


def mode_hostile(p: int, rank: int) -> None:
    """The last rank sends rank 0's lane raw messages (see the module docstring)."""
    import struct

    from mpi4py import MPI

    from totalreduce.engine.wire import wire_id
    from totalreduce.transport import mpi_native

    svc = tr.default_service()
    lane = svc.loop.lane
    pool = svc.config.floating_pool_bytes
    rogue = p - 1
    msg = struct.Struct(L.MSG_FORMAT)
    frm = struct.Struct(L.FRAME_FORMAT)

    def frame(ftype: int, name: str, nbytes: int, credited: bool) -> bytes:
        flags = L.FLAG_CREDIT if credited else 0
        head = frm.pack(ftype, 11, 0, 1, 0, flags, 0, 0, 0, 0, 0, wire_id(name), 0, nbytes,
                        max(1, nbytes // 8), 0, 0)  # fmt: skip
        return head + (bytes(nbytes) if ftype == L.DATA else b"")

    b = svc.transport.native_binding()
    req = mpi_native.request_array(b, 1)

    def send(frames: list[bytes]) -> None:
        head = msg.pack(L.LANE_MAGIC, L.LANE_VERSION, 0, len(frames), rank, 0, 0)
        raw = np.frombuffer(head + b"".join(frames), dtype=np.uint8).copy()
        assert mpi_native.mpi_isend(b, raw.ctypes.data, raw.nbytes, 0, L.LANE_TAG,
                                    req.ctypes.data) == 0  # fmt: skip
        while mpi_native.mpi_test(b, req.ctypes.data, 0) == 0:
            time.sleep(0.0001)

    def announcements() -> None:
        for j in range(0, 20_000, 500):
            send([frame(L.RTS, f"ann.{k}", 0, False) for k in range(j, j + 500)])

    def credited() -> None:
        for k in range(lane.stats()["credit"] + 2000):
            send([frame(L.DATA, f"cr.{k}", 64 << 10, True)])

    def after_bad() -> None:
        for k in range(1000):
            send([frame(L.DATA, f"bad.{k}", 64 << 10, True),
                  frame(L.RTS, f"bad.ann.{k}", 0, False)])  # fmt: skip

    figures = []
    ok = True
    for what, act in (("announcements", announcements), ("credited", credited),
                      ("after bad", after_bad)):  # fmt: skip
        MPI.COMM_WORLD.Barrier()
        rss0 = _rss()
        if rank == rogue:
            act()
        MPI.COMM_WORLD.Barrier()
        time.sleep(0.3)  # rank 0's lane takes the last messages
        if rank == 0:
            grew = _rss() - rss0
            st = lane.stats()
            bad = rogue in svc.loop.peers.bad
            figures.append(
                f"{what}: RSS +{grew / MIB:.1f} MiB, held {lane.floating_bytes} B, peak "
                f"{lane.floating_peak_bytes} B, announcements {st['announcements']}, bad {bad}"
            )
            ok = ok and grew < pool and lane.floating_peak_bytes <= lane.pool_bytes
            if what == "announcements":
                ok = ok and not bad and st["announcements"] == int(lane.mem[L.C_ANNCAP])
            else:
                ok = ok and bad and lane.floating_bytes == 0
                ok = ok and isinstance(svc.loop.peers.bad[rogue], tr.FrameError)
    # The others go on among themselves.
    if rank != rogue:
        honest = tr.Group(list(range(p - 1)))
        got = tr.allreduce(np.full(5, 1.0 + rank), group=honest, name="honest")
        ok = ok and np.array_equal(got, np.full(5, sum(1.0 + r for r in range(p - 1))))
    if rank == 0:
        print("rank 0: hostile " + "; ".join(figures), flush=True)
    print(f"rank {rank}: HOSTILE {'OK' if ok else 'FAILED'}", flush=True)


def engine(mode: str) -> None:
    """Start an engine with the options ``mode`` needs, run it, shut the engine down."""
    import totalreduce.lane.lane as lane_module

    opts: dict[str, float] = {"stall_warning_s": 30}
    if mode == "credit":
        opts["floating_pool_bytes"] = 16 * (16 << 10)
    if mode in ("early", "early_small", "hostile"):
        opts["floating_pool_bytes"] = 32 << 20
    if mode == "early":
        opts["micro_bytes"] = 1 << 20
    if mode == "stall":
        opts["stall_shutdown_s"] = 1
    if mode == "nap":
        opts["nap_s"] = 20e-6
    requests = lane_module.LANE_BODY_REQUESTS
    if mode == "crowd":
        lane_module.LANE_BODY_REQUESTS = 16
    try:
        tr.init(**opts)
        MODES[mode](tr.size(), tr.rank())
        tr.shutdown()
    finally:
        lane_module.LANE_BODY_REQUESTS = requests


MODES = {
    "exact": mode_exact,
    "flood": mode_flood,
    "credit": mode_credit,
    "mismatch": mode_mismatch,
    "threads": mode_threads,
    "express": mode_express,
    "stall": mode_stall,
    "peer_error": mode_peer_error,
    "background": mode_background,
    "absent_peer": mode_absent_peer,
    "nap": mode_nap,
    "outer": mode_outer,
    "large": mode_large,
    "kinds": mode_kinds,
    "crowd": mode_crowd,
    "early": mode_early,
    "early_small": mode_early_small,
    "hostile": mode_hostile,
}


def main() -> None:
    """Run the modes ``sys.argv[1]`` names (comma-separated; launch_modes.py), each on an
    engine of its own."""
    run_modes({m: functools.partial(engine, m) for m in MODES})


if __name__ == "__main__":
    main()

"""A training process for the daemon tests, written against the embedded API only.

Run it under ``mpiexec -n P`` (embedded mode) or as a plain process with
``TOTALREDUCE_SERVICE=daemon TOTALREDUCE_SOCKET=... TOTALREDUCE_LOCAL_RANK=...``
(daemon mode): the code is the same.  Modes:

- ``random SEED``: named allreduces (every op, several dtypes and sizes, some
  in registered memory, some in place) submitted in a per-process random order
  with random priorities, then broadcasts from every root, unnamed ops and a
  barrier; exact results.  Prints ``RANDOM OK``.
- ``same OUT``: a fixed program whose results are saved to ``OUT`` (an .npz),
  to compare the two modes bit for bit.
- ``victim`` / ``survivor``: both run a few ops; then the victim prints
  ``VICTIM READY`` and sleeps (the test kills it) while every survivor submits
  ``x.final`` and prints how it failed.
"""

from __future__ import annotations

import random
import sys
import time

import numpy as np

import totalreduce as tr

DTYPES = ["float32", "float64", "int32", "int64", "float16"]
SIZES = [0, 1, 3, 7, 1000, 5000, 70_000]


def data(k: int, count: int, dtype: str, rank: int) -> np.ndarray:
    """Integer values, exact in every dtype and under any order of summation."""
    idx = np.arange(count, dtype=np.int64)
    return ((idx * 7 + rank * 13 + k) % 50).astype(dtype)


def expected(k: int, count: int, dtype: str, op: str, size: int) -> np.ndarray:
    stack = np.stack([data(k, count, dtype, r) for r in range(size)]).astype(np.float64)
    if op in ("sum", "avg"):
        total = stack.sum(axis=0)
        if op == "avg":
            total = total / size if dtype.startswith("float") else np.floor(total / size)
        return total.astype(dtype)
    return (stack.max(axis=0) if op == "max" else stack.min(axis=0)).astype(dtype)


def alloc(svc: object, count: int, dtype: str) -> np.ndarray:
    """Registered memory in daemon mode (zero copy), a plain array otherwise."""
    empty = getattr(svc, "empty", None)
    return empty(count, dtype) if empty is not None else np.empty(count, dtype)


def mode_random(seed: int) -> None:
    svc = tr.init()
    rank, size = tr.rank(), tr.size()
    rng = random.Random(seed)
    table = [
        (rng.choice(SIZES), rng.choice(DTYPES), rng.choice(["sum", "avg", "max", "min"]))
        for _ in range(40)
    ]
    mine = random.Random(seed * 1000 + rank)
    order = list(range(len(table)))
    mine.shuffle(order)
    handles = {}
    for k in order:
        count, dtype, op = table[k]
        how = k % 3  # 0: plain array, 1: registered in place, 2: registered input, plain out
        x = data(k, count, dtype, rank)
        if how:
            buf = alloc(svc, count, dtype)
            buf[:] = x
            x = buf
        out = x if how == 1 else None
        handles[k] = tr.allreduce_async(x, name=f"g{k}", op=op, out=out, priority=mine.randrange(5))
        if mine.random() < 0.2:
            time.sleep(mine.random() * 0.003)
    bad = 0
    for k, (count, dtype, op) in enumerate(table):
        got = handles[k].wait(timeout=60)
        want = expected(k, count, dtype, op, size)
        if not np.array_equal(got, want):
            bad += 1
            print(f"rank {rank}: WRONG g{k} {op} {dtype} n={count}", flush=True)
    # the same names again: generation 1 meets generation 1 everywhere
    again = [tr.allreduce_async(data(k, 5, "int64", rank), name=f"g{k}") for k in range(3)]
    for k, h in enumerate(again):
        bad += not np.array_equal(h.wait(timeout=60), expected(k, 5, "int64", "sum", size))
    for root in range(size):
        x = np.full(9, rank * 10 + root, dtype=np.float64)
        got = tr.broadcast(x, root=root, name=f"b{root}")
        bad += not np.array_equal(got, np.full(9, root * 10 + root, dtype=np.float64))
    unnamed = [tr.allreduce_async(np.full(4, rank + i, np.int32)) for i in range(3)]
    for i, h in enumerate(unnamed):
        bad += not np.array_equal(h.wait(60), np.full(4, sum(r + i for r in range(size)), np.int32))
    tr.barrier()
    print(f"rank {rank} of {size}: RANDOM {'OK' if bad == 0 else 'FAILED'}", flush=True)
    tr.shutdown()


def mode_same(out: str) -> None:
    svc = tr.init()
    rank, size = tr.rank(), tr.size()
    results: dict[str, np.ndarray] = {}
    order = list(range(12))
    random.Random(rank).shuffle(order)
    handles = {}
    for k in order:
        dtype = DTYPES[k % len(DTYPES)]
        count = [0, 1, 17, 1000, 33_000][k % 5]
        op = ["sum", "avg", "max", "min"][k % 4]
        x = data(k, count, dtype, rank)
        if op in ("max", "min") and dtype.startswith("float"):
            x = (x + np.float64(rank) / 7).astype(dtype)  # not integers: order-free ops only
        if k % 2:
            buf = alloc(svc, count, dtype)
            buf[:] = x
            x = buf
        handles[k] = (tr.allreduce_async(x, name=f"s{k}", op=op), f"allreduce.{k}")
    for k in sorted(handles):
        h, key = handles[k]
        results[key] = np.array(h.wait(timeout=60))
    for root in (0, size - 1):
        x = np.arange(11, dtype=np.float32) * (rank + 1)
        results[f"broadcast.{root}"] = tr.broadcast(x, root=root, name=f"bc{root}")
    tr.barrier(name="end")
    results["rank"] = np.array([rank, size])
    np.savez(out.format(rank=rank), **results)
    print(f"rank {rank}: SAME DONE", flush=True)
    tr.shutdown()


def mode_fault(role: str) -> None:
    tr.init()
    rank = tr.rank()
    for i in range(3):
        tr.allreduce(np.full(8, i, np.float32), name="warm")
    if role == "victim":
        print(f"rank {rank}: VICTIM READY", flush=True)
        time.sleep(600)
        return
    time.sleep(0.3)  # the victim is asleep by now
    t0 = time.monotonic()
    try:
        tr.allreduce_async(np.ones(8, np.float32), name="x.final").wait(timeout=30)
        print(f"rank {rank}: SURVIVOR NO ERROR", flush=True)
    except tr.OpTimeoutError:
        print(f"rank {rank}: SURVIVOR TIMED OUT", flush=True)
    except tr.TotalReduceError as exc:
        print(
            f"rank {rank}: SURVIVOR GOT ERROR after {time.monotonic() - t0:.2f}s: "
            f"{type(exc).__name__}: {exc}",
            flush=True,
        )
    tr.shutdown(timeout=5)


def main() -> None:
    mode = sys.argv[1]
    if mode == "random":
        mode_random(int(sys.argv[2]))
    elif mode == "same":
        mode_same(sys.argv[2])
    elif mode in ("victim", "survivor"):
        mode_fault(mode)
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main()

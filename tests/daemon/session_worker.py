"""A client process of test_sessions.py (started with the daemon's variables).

Modes (the test kills one client at a moment of its life, then runs a new job):

- ``init``: ``tr.init()`` only; with ``TOTALREDUCE_STALL_WARNING_S=1`` it logs that init()
  waits for the others every second (the test kills it then: its session op is in);
- ``mid``: prints READY, then 4 MiB allreduces (named ``w``) until one fails, printing
  FIRST DONE after the first; prints the error it ends with;
- ``between``: one allreduce ``w``, prints IDLE, waits for a line on stdin, then another
  allreduce ``w``, and prints the error it ends with (a client was killed meanwhile);
- ``leave``: one allreduce ``w``, then an allreduce nobody else submits, prints LEAVING
  and shuts down (it waits for that op: the test kills it while it leaves);
- ``job``: the next job, with the names the killed job used: allreduces of every dtype
  (small ones repeated: the compiled path), large ones, broadcast, all-gather,
  reduce-scatter and barrier, each result checked exactly; prints ``rank R: JOB OK``.
"""

from __future__ import annotations

import sys
import time

import numpy as np

import totalreduce as tr

DTYPES = ("float16", "float32", "float64", "int8", "int32", "int64", "uint8")


def values(rank: int, n: int, dtype: str) -> np.ndarray:
    """Small integers, so every sum is exact in every dtype (float16 too)."""
    return ((np.arange(n) * 7 + rank * 3) % 5).astype(dtype)


def mode_job(p: int, rank: int) -> None:
    bad: list[str] = []

    def check(what: str, got: np.ndarray | None, want: np.ndarray) -> None:
        if got is None or got.dtype != want.dtype or not np.array_equal(got, want):
            bad.append(what)

    for dtype in DTYPES:
        for n in (1, 1000, 70_000):  # under and over 64 KiB
            for step in range(3):  # the same name again: its repeats take the compiled path
                x = values(rank, n, dtype)
                got = tr.allreduce(x, name=f"w.{dtype}.{n}", op="sum")
                want = sum(values(r, n, dtype).astype(np.int64) for r in range(p)).astype(dtype)
                check(f"allreduce {dtype} {n} step {step}", got, want)
    x = tr.empty(1 << 20, np.float32)  # 4 MiB in the arena, in place
    for step in range(3):
        x[:] = rank + step
        got = tr.allreduce(x, name="w", out=x, op="sum")
        check(f"allreduce w step {step}", got, np.full(1 << 20, p * step + p * (p - 1) / 2, "f4"))
    got = tr.allreduce(values(rank, 333, "int64"), name="m", op="max")
    check("max", got, np.max([values(r, 333, "int64") for r in range(p)], axis=0))
    got = tr.broadcast(values(rank, 100, "int32"), root=p - 1, name="b")
    check("broadcast", got, values(p - 1, 100, "int32"))
    got = tr.allgather(np.full(3, rank, np.int64), name="g")
    check("allgather", got, np.repeat(np.arange(p, dtype=np.int64), 3))
    total = sum(values(r, 10 * p, "int64") for r in range(p))
    got = tr.reduce_scatter(values(rank, 10 * p, "int64"), name="rs")
    check("reduce_scatter", got, total[10 * rank : 10 * rank + 10])
    tr.barrier(name="bar")
    print(f"rank {rank}: JOB {'OK' if not bad else 'WRONG ' + ', '.join(bad)}", flush=True)


def mode_mid(p: int, rank: int) -> None:
    x = tr.empty(1 << 20, np.float32)
    print("READY", flush=True)
    k = 0
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < 120:
            x[:] = 1
            tr.allreduce(x, name="w", out=x, op="sum")
            k += 1
            if x[0] != p or x[-1] != p:
                print(f"rank {rank}: WRONG after {k} ops", flush=True)
                return
            if k == 1:
                print("FIRST DONE", flush=True)
        print("NO ERROR", flush=True)
    except tr.TotalReduceError as exc:
        print(f"rank {rank}: ERROR after {k} ops: {exc}", flush=True)


def mode_between(p: int, rank: int) -> None:
    x = np.ones(1000, np.float32)
    tr.allreduce(x, name="w")
    print("IDLE", flush=True)
    sys.stdin.readline()
    try:
        tr.allreduce(x, name="w")
        print("NO ERROR", flush=True)
    except tr.TotalReduceError as exc:
        print(f"rank {rank}: ERROR: {exc}", flush=True)


def mode_leave(p: int, rank: int) -> None:
    x = np.ones(1000, np.float32)
    tr.allreduce(x, name="w")
    tr.allreduce_async(np.ones(10, np.float32), name="lonely")  # nobody else submits it
    print("LEAVING", flush=True)
    tr.shutdown(timeout=60)  # waits for it: the test kills this process meanwhile
    print("LEFT", flush=True)


def main() -> None:
    mode = sys.argv[1]
    tr.init()
    if mode == "init":
        print("INIT DONE", flush=True)
        return
    {"job": mode_job, "mid": mode_mid, "between": mode_between, "leave": mode_leave}[mode](
        tr.size(), tr.rank()
    )
    tr.shutdown(timeout=10)


if __name__ == "__main__":
    main()

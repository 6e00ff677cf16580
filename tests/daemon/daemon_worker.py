"""A client process of the daemon tests (started by test_daemon.py with the daemon's variables).

Modes:
- ``every``: every collective and neighbor op, in a per-rank random order with random
  priorities, waited for in another random order; groups; exact results; then whether
  this process loaded MPI (it must not).
- ``windows``: window ops (put, update, free) between the clients, exact results.
- ``big``: prints READY, then 64 MiB float32 allreduces until one fails (a test kills a
  client in the middle of one); prints the error.
- ``stuck``: prints READY, then an allreduce that the other client never joins (it
  runs ``sleep``); prints the error it ends with.
"""

from __future__ import annotations

import random
import sys
import time

import numpy as np

import totalreduce as tr


def mode_every(p: int, rank: int) -> None:
    from totalreduce.topology import get_topology, mixing_matrix

    rng = random.Random(100 + rank)
    X = np.random.default_rng(0).integers(-1000, 1000, size=(p, 301)).astype(np.int64)
    F = X.astype(np.float64)
    checks = {}  # name -> (handle, expected)

    def add(name: str, start, want) -> None:
        checks[name] = (start, want)

    for op, fn in (("sum", np.sum), ("max", np.max), ("min", np.min)):
        for n in (0, 1, p + 1, 301):
            add(
                f"ar.{op}.{n}",
                lambda op=op, n=n: tr.allreduce_async(
                    X[rank, :n], name=f"ar.{op}.{n}", op=op, priority=rng.randrange(5)
                ),
                fn(X[:, :n], axis=0),
            )
    add("ar.avg", lambda: tr.allreduce_async(F[rank], name="ar.avg", op="avg"), F.mean(axis=0))
    add(
        "ar.ring",
        lambda: tr.allreduce_async(X[rank], name="ar.ring", algorithm="ring"),
        X.sum(axis=0),
    )
    for root in range(p):
        add(
            f"bc.{root}",
            lambda root=root: tr.broadcast_async(
                X[rank] if rank == root else np.zeros(301, np.int64),
                root=root,
                name=f"bc.{root}",
                priority=rng.randrange(5),
            ),
            X[root],
        )
    add("barrier", lambda: tr.barrier_async(name="barrier"), None)
    total = X.sum(axis=0)
    add("rs", lambda: tr.reduce_scatter_async(X[rank], name="rs"), np.array_split(total, p)[rank])
    add(
        "ag",
        lambda: tr.allgather_async(np.full(3, rank, np.int64), name="ag"),
        np.repeat(np.arange(p), 3),
    )
    topo = get_topology("exponential-2", p)
    add(
        "nar",
        lambda: tr.neighbor_allreduce_async(F[rank], name="nar", topology="exponential-2"),
        (mixing_matrix(topo, 0) @ F)[rank],
    )
    evens = tr.Group(range(0, p, 2))
    if rank % 2 == 0:
        add("grp", lambda: tr.allreduce_async(X[rank], name="grp", group=evens), X[::2].sum(axis=0))
    order = list(checks)
    rng.shuffle(order)
    handles = {}
    for name in order:
        handles[name] = checks[name][0]()
        if rng.random() < 0.2:
            time.sleep(rng.random() * 0.002)
    bad = 0
    rng.shuffle(order)
    for name in order:
        got = handles[name].wait(timeout=60)
        want = checks[name][1]
        if want is not None and not np.allclose(got, want, rtol=0, atol=1e-9):
            bad += 1
            print(f"rank {rank}: WRONG {name}", flush=True)
    print(f"rank {rank}: EVERY {'OK' if bad == 0 else 'FAILED'}", flush=True)
    # a daemon client needs no MPI: mpi4py's MPI module is not imported, no libmpi is mapped
    with open("/proc/self/maps") as maps:
        mapped = any("libmpi" in line for line in maps)
    print(f"rank {rank}: MPI {'LOADED' if mapped or 'mpi4py.MPI' in sys.modules else 'NONE'}")


def mode_windows(p: int, rank: int) -> None:
    """Window ops between daemon clients: put, barrier, update; push-sum's mass kept."""
    x = np.full(7, float(rank + 1))
    tr.win_create(x, "w", topology="ring")
    tr.win_put(x, "w")
    tr.barrier(name="put")
    tr.win_update("w")  # the average of x and the ring neighbours' puts
    from totalreduce.topology import get_topology, plan

    ins = sorted(plan(get_topology("ring", p), rank, 0).src_weights)
    want = (rank + 1 + sum(r + 1 for r in ins)) / (len(ins) + 1)
    ok = np.allclose(x, want)
    tr.barrier(name="read")
    tr.win_free("w")
    print(f"rank {rank}: WINDOWS {'OK' if ok else f'FAILED {x} != {want}'}", flush=True)


def mode_big(p: int, rank: int) -> None:
    x = np.ones(16 << 20, dtype=np.float32)  # 64 MiB
    print("READY", flush=True)
    t0 = time.monotonic()
    k = 0
    try:
        while time.monotonic() - t0 < 120:
            tr.allreduce(x, name="big", out=x, op="avg")
            k += 1
            if not (x[:: 1 << 12] == 1).all() or x[-1] != 1:  # the average of ones, sampled
                print(f"rank {rank}: WRONG after {k} ops", flush=True)
                return
            if k == 1:
                print("FIRST DONE", flush=True)
        print("NO ERROR", flush=True)
    except tr.TotalReduceError as exc:
        print(f"rank {rank}: ERROR after {k} ops: {exc}", flush=True)


def mode_stuck(p: int, rank: int) -> None:
    print("READY", flush=True)
    t0 = time.monotonic()
    try:
        tr.allreduce(np.ones(4), name="stuck")
        print("NO ERROR", flush=True)
    except tr.TotalReduceError as exc:
        print(f"rank {rank}: ERROR after {time.monotonic() - t0:.1f}s: {exc}", flush=True)


def mode_sleep(p: int, rank: int) -> None:
    print("READY", flush=True)
    time.sleep(60)


def main() -> None:
    mode = sys.argv[1]
    tr.init()
    modes = {
        "every": mode_every,
        "windows": mode_windows,
        "big": mode_big,
        "stuck": mode_stuck,
        "sleep": mode_sleep,
    }
    modes[mode](tr.size(), tr.rank())
    tr.shutdown(timeout=5)


if __name__ == "__main__":
    main()

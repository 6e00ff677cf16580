"""Benchmark: totalreduce's collectives against MPI's in the same run.

Run with ``mpiexec -n P python -m totalreduce.bench`` (or ``totalreduce bench``).
For each size it times blocking calls on float32 buffers, alternating the
implementations iteration by iteration so all see the same machine state; an
iteration's time is the slowest rank's, and the figure printed is the median
over iterations.  Bandwidths follow nccl-tests: ``algbw = S / t``, ``busbw =
algbw * factor`` (allreduce ``2(P-1)/P``).  ``ratio`` is the anchor's time
over the row's time (MPI's counterpart; above 1 is faster than MPI).

- default: totalreduce's ring allreduce against ``Comm.Allreduce``;
- ``--algorithm all``: every allreduce algorithm and ``auto`` (and which one
  ``auto`` chose), plus reduce-scatter, all-gather and broadcast against
  ``Reduce_scatter_block``, ``Allgather`` and ``Bcast``;
- ``--neighbor``: ``neighbor_allreduce`` on three topologies against an
  averaging allreduce of the same buffer.

It ends with the CPU an idle, initialised service burns over a few seconds.

Benchmarks are not tests: nothing here asserts a figure.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

import totalreduce as tr

SIZES = {"4KiB": 4 << 10, "256KiB": 256 << 10, "4MiB": 4 << 20, "64MiB": 64 << 20}


def _parse_size(text: str) -> int:
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "k": 1 << 10, "m": 1 << 20}
    low = text.lower()
    for u, f in sorted(units.items(), key=lambda kv: -len(kv[0])):
        if low.endswith(u):
            return int(float(low[: -len(u)]) * f)
    return int(low)


def _iterations(nbytes: int) -> int:
    if nbytes <= 64 << 10:
        return 200
    if nbytes <= 1 << 20:
        return 60
    if nbytes <= 8 << 20:
        return 20
    return 7


def time_pair(
    comm, fns: dict[str, Callable[[], object]], iters: int, warmup: int = 2
) -> dict[str, float]:
    """Median (over iterations) of the slowest rank's time, for each function."""
    from mpi4py import MPI

    samples: dict[str, list[float]] = {k: [] for k in fns}
    for i in range(warmup + iters):
        for key, fn in fns.items():
            comm.Barrier()
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
            worst = comm.allreduce(dt, op=MPI.MAX)
            if i >= warmup:
                samples[key].append(worst)
    return {k: statistics.median(v) for k, v in samples.items()}


def idle_cpu(seconds: float) -> float:
    """Percent of one core the process uses while the service idles."""
    c0, t0 = time.process_time(), time.perf_counter()
    time.sleep(seconds)
    return 100.0 * (time.process_time() - c0) / (time.perf_counter() - t0)


@dataclass
class Row:
    """One timed implementation: its name, what it is compared with, its busbw factor."""

    name: str
    fn: Callable[[], object]
    factor: float
    anchor: str


def _rows(comm, p: int, rank: int, nbytes: int, algorithms: list[str], others: bool) -> list[Row]:
    from mpi4py import MPI

    n = max(p, nbytes // 4)
    ar = 2 * (p - 1) / p if p > 1 else 1.0
    part = (p - 1) / p if p > 1 else 1.0
    x = np.random.default_rng(rank).random(n, dtype=np.float32)
    out = np.empty_like(x)
    out_mpi = np.empty_like(x)
    tag = f"{nbytes}"
    rows = [
        Row("mpi.Allreduce", lambda: comm.Allreduce(x, out_mpi, op=MPI.SUM), ar, "mpi.Allreduce")
    ]
    for algo in algorithms:
        rows.append(
            Row(
                f"tr.allreduce.{algo}",
                lambda a=algo: tr.allreduce(x, name=f"b.{a}.{tag}", out=out, algorithm=a),
                ar,
                "mpi.Allreduce",
            )
        )
    if not others:
        return rows
    m = n // p * p  # equal parts, as MPI Reduce_scatter_block needs
    xs = x[:m]
    piece = np.empty(m // p, dtype=np.float32)
    whole = np.empty(m, dtype=np.float32)
    rows += [
        Row(
            "mpi.Reduce_scatter",
            lambda: comm.Reduce_scatter_block(xs, piece, op=MPI.SUM),
            part,
            "mpi.Reduce_scatter",
        ),
        Row(
            "tr.reduce_scatter",
            lambda: tr.reduce_scatter(xs, name=f"rs.{tag}"),
            part,
            "mpi.Reduce_scatter",
        ),
        Row("mpi.Allgather", lambda: comm.Allgather(piece, whole), part, "mpi.Allgather"),
        Row("tr.allgather", lambda: tr.allgather(piece, name=f"ag.{tag}"), part, "mpi.Allgather"),
        Row("mpi.Bcast", lambda: comm.Bcast(x, root=0), 1.0, "mpi.Bcast"),
        Row(
            "tr.broadcast.one_to_all",
            lambda: tr.broadcast(x, name=f"bc.{tag}", out=x),
            1.0,
            "mpi.Bcast",
        ),
        Row(
            "tr.broadcast.pipelined",
            lambda: tr.broadcast(x, name=f"bp.{tag}", out=x, algorithm="pipelined"),
            1.0,
            "mpi.Bcast",
        ),
    ]
    return rows


def _neighbor_rows(p: int, rank: int, nbytes: int) -> list[Row]:
    n = max(1, nbytes // 4)
    x = np.random.default_rng(rank).random(n, dtype=np.float32)
    out = np.empty_like(x)
    tag = f"{nbytes}"
    rows = [
        Row(
            "tr.allreduce(avg)",
            lambda: tr.allreduce(x, name=f"nar.{tag}", op="avg", out=out),
            1.0,
            "tr.allreduce(avg)",
        )
    ]
    for topo in ("exp", "ring", "exponential-2"):
        rows.append(
            Row(
                f"tr.neighbor.{topo}",
                lambda t=topo: tr.neighbor_allreduce(x, name=f"nb.{t}.{tag}", topology=t, out=out),
                1.0,
                "tr.allreduce(avg)",
            )
        )
    return rows


def run(
    sizes: list[int], algorithms: list[str], idle_seconds: float, others: bool, neighbor: bool
) -> None:
    from mpi4py import MPI

    from .service.ops import choose_allreduce

    comm = MPI.COMM_WORLD
    tr.init()
    p, rank = tr.size(), tr.rank()
    if rank == 0:
        print(f"# totalreduce bench: P={p}, float32, median over iterations of the slowest rank")
        print(
            "# busbw = algbw * factor: allreduce 2(P-1)/P, reduce-scatter and all-gather (P-1)/P,"
        )
        print("#   broadcast 1; neighbor rows: time only, ratio = time of allreduce / time")
        print(f"# transport: {tr.default_service().transport.description}")
        print(
            f"{'size':>8} {'impl':>30} {'time_us':>10} {'algbw_GB/s':>11} {'busbw_GB/s':>11} "
            f"{'ratio':>7}"
        )
    for nbytes in sizes:
        rows = (
            _neighbor_rows(p, rank, nbytes)
            if neighbor
            else _rows(comm, p, rank, nbytes, algorithms, others)
        )
        times = time_pair(comm, {r.name: r.fn for r in rows}, _iterations(nbytes))
        if rank == 0:
            for r in rows:
                t = times[r.name]
                alg = nbytes / t / 1e9
                bus = alg * r.factor
                ratio = times[r.anchor] / t  # > 1: faster than the anchor
                print(
                    f"{_fmt(nbytes):>8} {r.name:>30} {t * 1e6:>10.1f} {alg:>11.3f} {bus:>11.3f} "
                    f"{ratio:>7.2f}"
                )
            if not neighbor:
                print(
                    f"{_fmt(nbytes):>8} {'auto chooses':>30} {choose_allreduce('auto', p, nbytes)}"
                )
        sys.stdout.flush()
    if idle_seconds > 0:
        comm.Barrier()
        cpu = idle_cpu(idle_seconds)
        cpus = comm.gather(cpu, root=0)
        if rank == 0:
            print(
                f"idle service CPU over {idle_seconds:.0f} s: "
                + ", ".join(f"rank {r} {c:.2f}%" for r, c in enumerate(cpus))
                + f" of one core (worst {max(cpus):.2f}%)"
            )
    tr.shutdown()


def _fmt(nbytes: int) -> str:
    for unit, f in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= f and nbytes % f == 0:
            return f"{nbytes // f}{unit}"
    return f"{nbytes}B"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="totalreduce bench", description=__doc__.splitlines()[0])
    ap.add_argument(
        "--sizes", default="4KiB,256KiB,4MiB,64MiB", help="comma-separated, e.g. 4KiB,64MiB"
    )
    ap.add_argument(
        "--algorithm", default="ring", help="allreduce algorithm(s), comma-separated, or 'all'"
    )
    ap.add_argument("--idle-seconds", type=float, default=5.0)
    ap.add_argument(
        "--neighbor", action="store_true", help="time neighbor_allreduce against allreduce"
    )
    args = ap.parse_args(argv)
    everything = args.algorithm == "all"
    if everything:
        from .algorithms import registry

        algorithms = sorted(registry.ALLREDUCE) + ["auto"]
    else:
        algorithms = args.algorithm.split(",")
    sizes = [_parse_size(s) for s in args.sizes.split(",")]
    run(sizes, algorithms, args.idle_seconds, everything, args.neighbor)
    return 0


if __name__ == "__main__":
    sys.exit(main())

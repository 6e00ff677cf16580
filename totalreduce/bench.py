"""Benchmark: totalreduce allreduce against MPI ``Allreduce`` in the same run.

Run with ``mpiexec -n P python -m totalreduce.bench`` (or ``totalreduce bench``).
For each size it times blocking allreduces of float32 buffers, alternating
totalreduce and ``mpi4py`` ``Comm.Allreduce`` iteration by iteration so both
see the same machine state; an iteration's time is the slowest rank's, and
the figure printed is the median over iterations.  Bandwidths follow
nccl-tests: ``algbw = S / t`` and ``busbw = algbw * 2(P-1)/P``.  It ends with
the CPU an idle, initialised service burns over a few seconds.

Benchmarks are not tests: nothing here asserts a figure.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

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


def run(sizes: list[int], algorithms: list[str], idle_seconds: float) -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    tr.init()
    p, rank = tr.size(), tr.rank()
    factor = 2 * (p - 1) / p if p > 1 else 1.0
    if rank == 0:
        print(f"# totalreduce bench: P={p}, float32, median of slowest rank, busbw=algbw*2(P-1)/P")
        print(f"# transport: {tr.default_service().transport.description}")
        head = f"{'size':>8} {'impl':>18} {'time_us':>10} {'algbw_GB/s':>11} {'busbw_GB/s':>11}"
        print(head + f" {'ratio_vs_mpi':>13}")
    for nbytes in sizes:
        n = max(1, nbytes // 4)
        x = np.random.default_rng(rank).random(n, dtype=np.float32)
        out_tr = np.empty_like(x)
        out_mpi = np.empty_like(x)
        fns: dict[str, Callable[[], object]] = {
            "mpi.Allreduce": lambda: comm.Allreduce(x, out_mpi, op=MPI.SUM),
        }
        for algo in algorithms:
            fns[f"tr.{algo}"] = lambda a=algo: tr.allreduce(
                x, name=f"bench.{a}.{nbytes}", out=out_tr, algorithm=a
            )
        times = time_pair(comm, fns, _iterations(nbytes))
        if rank == 0:
            mpi_bus = nbytes / times["mpi.Allreduce"] * factor / 1e9
            for key, t in times.items():
                alg = nbytes / t / 1e9
                bus = alg * factor
                print(
                    f"{_fmt(nbytes):>8} {key:>18} {t * 1e6:>10.1f} {alg:>11.3f} {bus:>11.3f} "
                    f"{bus / mpi_bus:>13.2f}"
                )
        sys.stdout.flush()
    comm.Barrier()
    cpu = idle_cpu(idle_seconds)
    cpus = comm.gather(cpu, root=0)
    if rank == 0:
        worst = max(cpus)
        print(
            f"idle service CPU over {idle_seconds:.0f} s: "
            + ", ".join(f"rank {r} {c:.2f}%" for r, c in enumerate(cpus))
            + f" of one core (worst {worst:.2f}%)"
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
    args = ap.parse_args(argv)
    if args.algorithm == "all":
        from .algorithms import registry

        algorithms = sorted(registry.ALLREDUCE) + ["auto"]
    else:
        algorithms = args.algorithm.split(",")
    run([_parse_size(s) for s in args.sizes.split(",")], algorithms, args.idle_seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main())

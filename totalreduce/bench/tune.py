"""``totalreduce tune``: measure the crossovers ``auto`` follows, on this machine at this P.

Run under ``mpiexec -n P``.  For each size (``--minbytes`` to ``--maxbytes``,
times ``--stepfactor``) it times every allreduce algorithm, and broadcast's
``one_to_all`` against ``pipelined``, alternating them as the benchmark does,
and prints the same table as ``totalreduce bench``.  The fastest at each size
(median of the slowest rank's time) becomes a crossover row, and rank 0 writes
the rows for this P into the tuning table (``--output``; default the configured
``tuning_file``, else ``totalreduce-tuning.json``), keeping the entries for
other P, so running it at several P builds one table.  Reduce-scatter and
all-gather have one algorithm each: nothing to choose.

Point ``auto`` at the table with ``TOTALREDUCE_TUNING_FILE=FILE`` on every
rank; ``totalreduce info`` shows the table in force.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import numpy as np

import totalreduce as tr

from ..service import tuning
from .cases import Case, allreduce_cases, collective_cases
from .run import DTYPES, _measure, parse_size, size_range
from .table import Result, header, row
from .timing import iterations_for

DEFAULT_OUTPUT = "totalreduce-tuning.json"


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="totalreduce tune",
        description="time every algorithm and write the crossovers auto follows (under mpiexec)",
    )
    ap.add_argument("-b", "--minbytes", type=parse_size, default=1 << 10)
    ap.add_argument("-e", "--maxbytes", type=parse_size, default=16 << 20)
    ap.add_argument("-f", "--stepfactor", type=int, default=4)
    ap.add_argument("-n", "--iters", type=int, default=None, help="default: by size")
    ap.add_argument("-w", "--warmup", type=int, default=2)
    ap.add_argument("-d", "--dtype", choices=DTYPES, default="float32")
    ap.add_argument(
        "--per-dtype",
        action="store_true",
        help="file the rows under this dtype instead of under any dtype ('*')",
    )
    ap.add_argument(
        "-o", "--output", default=None, help=f"default: tuning_file or {DEFAULT_OUTPUT}"
    )
    return ap


def _winners(results: list[Result], collective: str) -> tuple[list[tuple[int, str]], dict]:
    """The fastest totalreduce algorithm per size, and every time measured (µs)."""
    by_size: dict[int, dict[str, float]] = {}
    for r in results:
        if r.collective != collective or not r.impl.startswith("tr."):
            continue
        t = r.time_us if r.time_us is not None else r.ip_time_us
        name = r.impl.removeprefix("tr.").removeprefix("broadcast.")
        if t is not None:
            by_size.setdefault(r.size, {})[name] = round(t, 2)
    winners = [(size, min(times, key=times.__getitem__)) for size, times in sorted(by_size.items())]
    return winners, {str(s): t for s, t in sorted(by_size.items())}


def run(args: argparse.Namespace) -> dict[str, Any] | None:
    """Measure and write the table; rank 0 returns the written document."""
    from mpi4py import MPI

    from ..algorithms import registry
    from ..service.config import Config

    comm = MPI.COMM_WORLD
    tr.init()
    p, rank = tr.size(), tr.rank()
    dtype = np.dtype(args.dtype)
    output = args.output or Config.load().tuning_file or DEFAULT_OUTPUT
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"# totalreduce tune: P={p}, {dtype.name}, sum; writing {output}")
    say(f"# transport: {tr.default_service().transport.description}")
    for line in header(False):
        say(line)
    algorithms = sorted(registry.ALLREDUCE)
    results: list[Result] = []
    for nbytes in size_range(args.minbytes, args.maxbytes, args.stepfactor):
        n = max(1, nbytes // dtype.itemsize)
        cases: list[Case] = allreduce_cases(comm, n, dtype, "sum", algorithms)
        cases += [c for c in collective_cases(comm, n, dtype, "sum") if c.collective == "broadcast"]
        iters = args.iters or iterations_for(nbytes)
        rows = _measure(comm, cases, iters, args.warmup, True, "size", dtype.name)
        for r in rows:
            say(row(r, False))
        sys.stdout.flush()
        results += rows
    bad = [r for r in results if r.wrong or r.ip_wrong]
    if bad:
        raise SystemExit(f"totalreduce tune: wrong results from {sorted({r.impl for r in bad})}")
    doc = None
    if rank == 0:
        key = dtype.name if args.per_dtype else tuning.ANY_DTYPE
        about = f"measured by totalreduce tune ({tr.default_service().transport.description})"
        for kind in ("allreduce", "broadcast"):
            winners, measured = _winners(results, kind)
            rows_ = tuning.crossover_rows(winners)
            doc = tuning.write_entry(output, kind, p, rows_, key, about, measured)
            say(f"# {kind} at P={p} ({key}): {_describe(rows_)}")
        say(f"# wrote {output}; use it with TOTALREDUCE_TUNING_FILE={output}")
    comm.Barrier()
    tr.shutdown()
    return doc


def _describe(rows: list[list[Any]]) -> str:
    parts = []
    lo = 0
    for limit, name in rows:
        parts.append(f"{name} from {lo} B" + ("" if limit is None else f" below {limit} B"))
        lo = limit
    return "; ".join(parts)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``totalreduce tune``."""
    run(parser().parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())

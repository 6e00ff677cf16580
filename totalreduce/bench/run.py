"""``totalreduce bench``: the command line, the loop over sizes, the printed table and the files."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

import totalreduce as tr

from .cases import Case, allreduce_cases, burst_cases, collective_cases, inflight_cases
from .resnet18 import RESNET18_GRADIENTS
from .resnet50 import RESNET50_GRADIENTS
from .step import COMPUTE, Scenario, run_scenario
from .table import (
    Result,
    bandwidths,
    header,
    many_header,
    many_row,
    plot,
    row,
    step_header,
    step_row,
    write_csv,
    write_json,
)
from .timing import Timed, idle_cpu, iterations_for, time_alternating

DTYPES = ("float32", "float64", "int32", "int64")
OPS = ("sum", "avg", "max", "min")
NEIGHBOR_TOPOLOGIES = ("exp", "ring", "exponential-2")


def parse_size(text: str) -> int:
    """``4096``, ``4K``, ``4KiB``, ``1.5MiB``, ``1G``... in bytes.

    >>> parse_size("4KiB"), parse_size("1M"), parse_size("8")
    (4096, 1048576, 8)
    """
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    low = text.strip().lower().removesuffix("ib").removesuffix("b")
    if low and low[-1] in units:
        return int(float(low[:-1]) * units[low[-1]])
    return int(low)


def size_range(minbytes: int, maxbytes: int, stepfactor: int) -> list[int]:
    """``minbytes, minbytes·f, ...`` up to ``maxbytes`` (nccl-tests' ``-b -e -f``).

    >>> size_range(8, 64, 2)
    [8, 16, 32, 64]
    """
    if minbytes < 1 or maxbytes < minbytes or stepfactor < 2:
        raise ValueError(
            f"need 1 <= minbytes <= maxbytes and stepfactor >= 2, "
            f"got {minbytes}, {maxbytes}, {stepfactor}"
        )
    out = []
    n = minbytes
    while n <= maxbytes:
        out.append(n)
        n *= stepfactor
    return out


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="totalreduce bench",
        description="totalreduce's collectives against MPI's in the same run (under mpiexec).",
    )
    ap.add_argument("-b", "--minbytes", type=parse_size, default=None, help="default 4K (8)")
    ap.add_argument("-e", "--maxbytes", type=parse_size, default=None, help="default 64M (256K)")
    ap.add_argument("-f", "--stepfactor", type=int, default=2)
    ap.add_argument("-n", "--iters", type=int, default=None, help="default: by size")
    ap.add_argument("-w", "--warmup", type=int, default=2)
    ap.add_argument("-d", "--dtype", choices=DTYPES, default="float32")
    ap.add_argument("-o", "--op", choices=OPS, default="sum")
    ap.add_argument("-c", "--check", type=int, default=1, help="1: count wrong elements")
    ap.add_argument(
        "--algorithm", default="ring", help="allreduce algorithm(s), comma-separated, or 'all'"
    )
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--neighbor", action="store_true", help="neighbor_allreduce vs allreduce")
    mode.add_argument(
        "--latency",
        action="store_true",
        help="small sizes, every algorithm, the bare Python loop; burst and in-flight blocks",
    )
    mode.add_argument(
        "--step",
        action="store_true",
        help="training steps: gradients ready at different times and orders on each rank",
    )
    step = ap.add_argument_group("the step scenario (--step)")
    step.add_argument("--step-model", choices=("resnet18", "resnet50"), default="resnet18")
    step.add_argument(
        "--step-scale", type=float, default=1.0, help="tensor sizes times this (default 1)"
    )
    step.add_argument("--step-forward-ms", type=float, default=5.0)
    step.add_argument("--step-backward-ms", type=float, default=10.0)
    step.add_argument(
        "--step-speeds",
        default="1,4",
        help="compute times of a step as multiples of forward+backward, comma-separated",
    )
    step.add_argument("--step-compute", choices=COMPUTE, default="sleep")
    step.add_argument("--step-jitter", type=float, default=0.1, help="per-rank speed, +-")
    step.add_argument("--step-swap", type=float, default=0.3, help="chance of a swap in order")
    step.add_argument("--step-rounds", type=int, default=5)
    step.add_argument("--step-steps", type=int, default=4, help="steps per round")
    step.add_argument(
        "--step-bucket", type=parse_size, default=25 << 20, help="MPI bucket bytes (DDP's 25M)"
    )
    ap.add_argument("--inflight", default="1000,4000,16000", help="in-flight op counts (--latency)")
    ap.add_argument(
        "--ops",
        type=int,
        default=1,
        help="--latency: rows of neighbor_allreduce (exponential-2), alltoall, broadcast, "
        "reduce and gather beside MPI's (0: allreduce only)",
    )
    ap.add_argument(
        "--burst",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the ResNet-50 burst block (--latency)",
    )
    ap.add_argument(
        "--burst-iters", type=int, default=5, help="iterations of the burst and in-flight blocks"
    )
    ap.add_argument("--csv", metavar="FILE")
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("--plot", metavar="FILE", help="PNG of busbw and time against size")
    ap.add_argument("--idle-seconds", type=float, default=5.0)
    return ap


def _algorithms(spec: str, latency: bool) -> list[str]:
    from ..algorithms import registry

    if spec == "all" or latency:
        return sorted(registry.ALLREDUCE) + ["auto"]
    return spec.split(",")


def _measure(
    comm: Any,
    cases: Sequence[Case],
    iters: int,
    warmup: int,
    check: bool,
    mode: str,
    dtype: str,
    ops: int = 1,
) -> list[Result]:
    """Time every case's calls alternately, check them, and make their results."""
    from mpi4py import MPI

    p = comm.Get_size()
    calls: dict[str, Timed] = {}
    for c in cases:
        if c.oop is not None:
            calls[c.impl + "|oop"] = c.oop
        if c.ip is not None:
            calls[c.impl + "|ip"] = c.ip
    stats = time_alternating(comm, calls, iters, warmup)
    results = []
    for c in cases:
        r = Result(mode, c.collective, c.impl, c.nbytes, c.count, dtype, c.redop, c.root, ops)
        r.chosen = c.chosen
        for form, check_fn, prefix in ((c.oop, c.check_oop, ""), (c.ip, c.check_ip, "ip_")):
            if form is None:
                continue
            s = stats[c.impl + ("|oop" if prefix == "" else "|ip")]
            alg, bus = bandwidths(c.collective, p, c.nbytes, s.median)
            setattr(r, prefix + "time_us", s.median * 1e6)
            setattr(r, prefix + "algbw", alg)
            setattr(r, prefix + "busbw", bus)
            if prefix == "":
                r.time_avg_us, r.time_min_us, r.time_max_us = s.mean * 1e6, s.min * 1e6, s.max * 1e6
            if check and check_fn is not None:
                form.reset()
                comm.Barrier()
                form.run()
                setattr(r, prefix + "wrong", comm.allreduce(check_fn(), op=MPI.SUM))
        results.append(r)
    _ratios(results)
    return results


def _time_of(r: Result) -> float | None:
    return r.time_us if r.time_us is not None else r.ip_time_us


def _ratios(results: list[Result]) -> None:
    """vs_mpi: the MPI row of the same collective; vs_bare: the bare loop's row; vs_floor:
    the compiled floor's row."""
    for r in results:
        mine = _time_of(r)
        anchors = [x for x in results if x.collective == r.collective and x.impl.startswith("mpi")]
        if r.collective == "neighbor_allreduce":  # the neighbours by hand, else an allreduce
            anchors = [x for x in anchors if x.impl.startswith("mpi.neighbor")] or [
                x for x in results if x.impl == "mpi.Allreduce"
            ]
        if anchors and mine:
            r.vs_mpi = (_time_of(anchors[0]) or 0.0) / mine
        bare = [x for x in results if x.impl.startswith("bare")]
        if bare and mine:
            r.vs_bare = (_time_of(bare[0]) or 0.0) / mine
        floor = [x for x in results if x.impl.startswith("floor")]
        if floor and mine:
            r.vs_floor = (_time_of(floor[0]) or 0.0) / mine


def run(args: argparse.Namespace) -> list[Result]:
    """Run the benchmark the arguments describe; rank 0 prints and writes the files."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    tr.init()
    if args.step:
        return run_step(comm, args)
    p, rank = tr.size(), tr.rank()
    latency = args.latency
    minbytes = args.minbytes or (8 if latency else 4 << 10)
    maxbytes = args.maxbytes or (256 << 10 if latency else 64 << 20)
    sizes = size_range(minbytes, maxbytes, args.stepfactor)
    dtype = np.dtype(args.dtype)
    algorithms = _algorithms(args.algorithm, latency)
    everything = args.algorithm == "all" and not latency
    mode = "latency" if latency else "neighbor" if args.neighbor else "bandwidth"
    if args.neighbor and not np.issubdtype(dtype, np.floating):
        raise SystemExit("totalreduce bench --neighbor: averaging needs a floating-point --dtype")
    bare_comm = comm.Dup() if latency else None
    # The compiled floor (float32 sums only) on a communicator of its own.
    floor_comm = comm.Dup() if latency and dtype == np.float32 and args.op == "sum" else None
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"# totalreduce bench ({mode}): P={p}, {dtype.name}, op {args.op}")
    say(f"# transport: {tr.default_service().transport.description}")
    say(
        "# time: slowest rank per iteration, median over the iterations; implementations "
        "alternated iteration by iteration"
    )
    say(
        "# busbw = algbw * factor: allreduce 2(P-1)/P, reduce-scatter and all-gather (P-1)/P, "
        "broadcast 1; neighbor rows: time only"
    )
    say(
        "# vs_mpi = MPI's time / this time (above 1: faster than MPI)"
        + (
            "; vs_bare = the bare Python ring loop's time / this time; vs_floor = the compiled "
            "floor's (the same ring as one Numba function calling MPI) time / this time"
            if latency
            else ""
        )
    )
    for line in header(latency):
        say(line)
    results: list[Result] = []
    chose: list[str] = []
    for nbytes in sizes:
        n = max(1, nbytes // dtype.itemsize)
        if args.neighbor:
            from .cases import neighbor_cases

            cases = neighbor_cases(comm, n, dtype, NEIGHBOR_TOPOLOGIES)
        else:
            cases = allreduce_cases(comm, n, dtype, args.op, algorithms, bare_comm, floor_comm)
            if everything:
                cases += collective_cases(comm, n, dtype, args.op)
            if latency and args.ops:
                from .cases import op_cases

                cases += op_cases(comm, n, dtype)
        iters = args.iters or iterations_for(nbytes)
        rows = _measure(comm, cases, iters, args.warmup, args.check > 0, "size", dtype.name)
        for r in rows:
            say(row(r, latency))
            if r.chosen:
                chose.append(f"{r.size}:{r.chosen}")
        sys.stdout.flush()
        results += rows
    if chose:
        say("# auto chose (bytes:algorithm): " + " ".join(chose))
    if latency:
        results += _many(comm, args, dtype, say)
    meta: dict[str, Any] = {"P": p, "mode": mode, "dtype": dtype.name, "op": args.op}
    meta["transport"] = tr.default_service().transport.description
    if args.idle_seconds > 0:
        comm.Barrier()
        cpus = comm.gather(idle_cpu(args.idle_seconds), root=0)
        if rank == 0:
            meta["idle_cpu_percent"] = cpus
            say(
                f"# idle service CPU over {args.idle_seconds:g} s: "
                + ", ".join(f"rank {r} {c:.2f}%" for r, c in enumerate(cpus))
                + f" of one core (worst {max(cpus):.2f}%)"
            )
    if rank == 0:
        _write(args, results, meta, f"totalreduce bench ({mode}), P={p}, {dtype.name}")
    for extra in (bare_comm, floor_comm):
        if extra is not None:
            extra.Free()
    tr.shutdown()
    return results


def run_step(comm: Any, args: argparse.Namespace) -> list[Result]:
    """``--step``: the training-step scenario at every compute speed (:mod:`.step`)."""
    p, rank = tr.size(), tr.rank()
    say = print if rank == 0 else (lambda *a, **k: None)
    base = RESNET18_GRADIENTS if args.step_model == "resnet18" else RESNET50_GRADIENTS
    if args.step_scale <= 0:
        raise SystemExit(
            f"totalreduce bench --step: --step-scale must be > 0, got {args.step_scale}"
        )
    counts = tuple(max(1, round(c * args.step_scale)) for c in base)
    speeds = [float(s) for s in args.step_speeds.split(",") if s.strip()]
    if not speeds or min(speeds) <= 0:
        raise SystemExit(
            "totalreduce bench --step: --step-speeds needs positive numbers, "
            f"got {args.step_speeds!r}"
        )
    say(f"# totalreduce bench (step): P={p}, float32, op sum")
    say(f"# transport: {tr.default_service().transport.description}")
    say(
        f"# {args.step_model} x{args.step_scale:g}: {len(counts)} gradients, "
        f"{sum(counts)} elements; compute {args.step_compute}, jitter +-{args.step_jitter:g}, "
        f"swap {args.step_swap:g}; {args.step_rounds} rounds of {args.step_steps} steps, "
        f"implementations alternated; MPI buckets {args.step_bucket} B"
    )
    say(
        "# step: slowest rank's round over its steps, median over the rounds; "
        "vs_mpi = the best MPI implementation's step / this step (above 1: faster)"
    )
    results: list[Result] = []
    for speed in speeds:
        scenario = Scenario(
            counts,
            args.step_forward_ms * speed / 1e3,
            args.step_backward_ms * speed / 1e3,
            jitter=args.step_jitter,
            swap=args.step_swap,
            compute=args.step_compute,
        )
        rows = run_scenario(
            comm, scenario, args.step_rounds, args.step_steps, args.step_bucket, args.check > 0
        )
        title = (
            f"# forward {args.step_forward_ms * speed:g} ms + backward "
            f"{args.step_backward_ms * speed:g} ms per step"
        )
        _say_block(say, title, step_header(), rows, step_row)
        results += rows
    if rank == 0:
        meta = {"P": p, "mode": "step", "dtype": "float32", "op": "sum"}
        meta["transport"] = tr.default_service().transport.description
        _write(args, results, meta, f"totalreduce bench (step), P={p}")
    tr.shutdown()
    return results


def _many(comm: Any, args: argparse.Namespace, dtype: np.dtype, say: Any) -> list[Result]:
    """The burst (ResNet-50's gradients) and in-flight blocks of ``--latency``."""
    from .table import BUSBW_FACTOR

    results: list[Result] = []
    blocks: list[tuple[str, str, list[Case], int]] = []
    if args.burst:
        blocks.append(
            (
                "burst",
                f"# burst: ResNet-50's {len(RESNET50_GRADIENTS)} gradient tensors "
                f"({sum(RESNET50_GRADIENTS)} elements) submitted at once, then all waited",
                burst_cases(comm, RESNET50_GRADIENTS, dtype, args.op),
                len(RESNET50_GRADIENTS),
            )
        )
    for ops in (int(s) for s in args.inflight.split(",") if s.strip()):
        blocks.append(
            (
                "inflight",
                f"# in flight: {ops} allreduces of 1-16 KiB at once, then all waited",
                inflight_cases(comm, ops, dtype, args.op),
                ops,
            )
        )
    factor = BUSBW_FACTOR["allreduce"]
    assert factor is not None
    for mode, title, cases, ops in blocks:
        rows = _measure(comm, cases, args.burst_iters, 1, args.check > 0, mode, dtype.name, ops=ops)
        _say_block(say, title, many_header(), rows, many_row)
        results += rows
    return results


def _say_block(
    say: Any, title: str, head: list[str], rows: list[Result], fmt: Callable[[Result], str]
) -> None:
    """A block of rows after the per-size table: a blank ``#`` line, its title, its header."""
    say("#")
    say(title)
    for line in head:
        say(line)
    for r in rows:
        say(fmt(r))
    sys.stdout.flush()


def _write(args: argparse.Namespace, results: list[Result], meta: dict, title: str) -> None:
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            write_csv(results, f)
    if args.json:
        with open(args.json, "w") as f:
            write_json(results, meta, f)
    if args.plot:
        plot(results, args.plot, title)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``totalreduce bench`` and ``python -m totalreduce.bench``."""
    run(parser().parse_args(argv))
    return 0

"""Benchmark: daemon mode against embedded mode, same machine, same session.

``python -m totalreduce.daemon.bench`` runs, one after the other:

1. embedded: ``mpiexec -n P`` training processes, each with its own engine
   (``P = nodes * local clients``);
2. daemon: ``mpiexec -n NODES totalreduce serve --local-clients L`` and P plain
   training processes attached to it (``--local-clients`` per simulated node);

and in each the same worker (``--role worker``), written against the embedded
API only; then, as the anchor a user would otherwise pick, ``MPI_Allreduce``
(mpi4py, in place) among ``P`` MPI ranks with the same loops (``--role mpi``).
For every size (float32, in place) it measures:

- latency: submission (``allreduce_async``) to completion (``wait()``
  returned), ranks started together by a barrier; an iteration counts the
  slowest rank, the figure is the median over iterations;
- blocking latency: the same for the blocking ``allreduce`` (``MPI_Allreduce``
  for MPI), after the same barrier;
- busbw: back-to-back blocking allreduces, ``2(P-1)/P * bytes / time``
  (nccl-tests' definition);

  (each size starts with a full garbage collection, so that none falls in its
  timed loops: one alone takes longer than 300 small allreduces)
- an overlapped step: ``--layers`` gradients of ``--layer-bytes``, each
  submitted after ``--compute-ms`` of pure-Python work (which holds the
  interpreter lock, as a framework's Python does), all waited for at the end.
  In embedded mode the comm thread competes with that work for the lock; in
  daemon mode it runs in another process.

With ``--floor`` each round also runs, at every size, daemon mode's floor
(:mod:`totalreduce.daemon.floor`: services and clients that are compiled loops meeting
in shared-memory words, the compiled ring among the services) and the same ring among the
``P`` ranks directly (the embedded floor), with the same latency and back-to-back loops:
about the least an implementation of either mode can take on this machine.

With ``--example PATH`` (default: ``examples/train_distributed_optimizer.py``
if it exists and torch is installed) it also runs that example's
``--compare`` benchmark in both modes and reports its DistributedOptimizer's
median time per step.

Figures are printed, never asserted: benchmarks are not tests.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from ..launch import find_mpiexec

#: This Python's ``mpiexec`` (the mpich wheel's, beside it), else the one on PATH.
MPIEXEC = find_mpiexec() or "mpiexec"

SIZES = {"4KiB": 4 << 10, "4MiB": 4 << 20, "64MiB": 64 << 20}


def _iterations(nbytes: int) -> int:
    if nbytes <= 64 << 10:
        return 300
    if nbytes <= 8 << 20:
        return 30
    return 8


# ---------------------------------------------------------------------- the worker


def _slowest(times: list[float], tr: Any, name: str) -> list[float]:
    """Per iteration, the slowest rank's time."""
    return [float(v) for v in tr.allreduce(np.array(times), name=name, op="max")]


def _burn(ms: float) -> None:
    """Pure-Python work holding the interpreter lock for ``ms`` milliseconds."""
    end = time.perf_counter() + ms / 1000
    x = 0
    while time.perf_counter() < end:
        for i in range(200):
            x += i * i


def _array(tr: Any, args: argparse.Namespace, count: int) -> np.ndarray:
    """A float32 buffer: ``tr.empty`` (in a daemon's arena: no copies), or with
    ``--plain-arrays`` a numpy array (a daemon client copies it in and out)."""
    return np.zeros(count, np.float32) if args.plain_arrays else tr.empty(count, np.float32)


def worker(args: argparse.Namespace) -> None:
    import totalreduce as tr

    svc = tr.init()
    rank, size = tr.rank(), tr.size()
    report: dict[str, Any] = {"mode": type(svc).__name__, "size": size, "sizes": {}}
    for label, nbytes in SIZES.items():
        if label not in args.sizes.split(","):
            continue
        count = nbytes // 4
        x = _array(tr, args, count)
        x[:] = 1.0
        iters = _iterations(nbytes)
        name = f"bench.{label}"
        for _ in range(3):
            tr.allreduce(x, name=name, out=x)
        # A full collection now, not in the middle of a timed loop: one of a process that
        # loaded Numba's compiled code takes about 50 ms on the 2-core machine, more than
        # 300 allreduces of 4 KiB (timeit turns the collector off for the same reason).
        gc.collect()
        lat = []
        for _ in range(iters):
            tr.barrier(name="bench.sync")
            t0 = time.perf_counter()
            tr.allreduce_async(x, name=name, out=x).wait()
            lat.append(time.perf_counter() - t0)
        lat = _slowest(lat, tr, f"bench.lat.{label}")
        blocking = []
        for _ in range(iters):
            tr.barrier(name="bench.sync")
            t0 = time.perf_counter()
            tr.allreduce(x, name=name, out=x)
            blocking.append(time.perf_counter() - t0)
        blocking = _slowest(blocking, tr, f"bench.blat.{label}")
        tr.barrier(name="bench.sync")
        t0 = time.perf_counter()
        for _ in range(iters):
            tr.allreduce(x, name=name, out=x)
        elapsed = _slowest([time.perf_counter() - t0], tr, f"bench.bw.{label}")[0]
        per_op = elapsed / iters
        report["sizes"][label] = {
            "bytes": nbytes,
            "latency_s": statistics.median(lat),
            "blocking_latency_s": statistics.median(blocking),
            "per_op_s": per_op,
            "busbw_GBps": 2 * (size - 1) / size * nbytes / per_op / 1e9,
        }
        if args.group:
            report["sizes"][label].update(_group_loops(tr, args, x, label, iters))
    if args.layers:
        count = args.layer_bytes // 4
        grads = [_array(tr, args, count) for _ in range(args.layers)]
        steps = []
        for step in range(args.steps + 2):
            tr.barrier(name="bench.sync")
            t0 = time.perf_counter()
            handles = []
            for i, g in enumerate(grads):
                _burn(args.compute_ms)  # "backward" of layer i
                handles.append(tr.allreduce_async(g, name=f"bench.layer{i}", op="avg", out=g))
            for h in handles:
                h.wait()
            if step >= 2:
                steps.append(time.perf_counter() - t0)
        steps = _slowest(steps, tr, "bench.steps")
        report["step"] = {
            "layers": args.layers,
            "layer_bytes": args.layer_bytes,
            "compute_ms": args.compute_ms,
            "step_s": statistics.median(steps),
            "compute_only_s": args.layers * args.compute_ms / 1000,
        }
    if rank == 0:
        Path(args.out).write_text(json.dumps(report))
    tr.shutdown()


def _group_ranks(args: argparse.Namespace) -> list[int]:
    """``--group``'s ranks: one per node, each node's first (0, L, 2L, ...)."""
    return [int(r) for r in args.group.split(",")]


def _group_loops(
    tr: Any, args: argparse.Namespace, x: np.ndarray, label: str, iters: int
) -> dict[str, float]:
    """``--group``: the worker's blocking loops (after a barrier, and back to back) for an
    allreduce over the group of one rank per node; the other ranks only wait at the
    barriers (their times count as 0 in the slowest rank's)."""
    ranks = _group_ranks(args)
    g = tr.Group(ranks)
    mine = tr.rank() in ranks
    name = f"bench.group.{label}"
    if mine:
        for _ in range(3):
            tr.allreduce(x, name=name, out=x, group=g)
    blocking = []
    for _ in range(iters):
        tr.barrier(name="bench.sync")
        t0 = time.perf_counter()
        if mine:
            tr.allreduce(x, name=name, out=x, group=g)
        blocking.append(time.perf_counter() - t0)
    blocking = _slowest(blocking, tr, f"bench.gblat.{label}")
    tr.barrier(name="bench.sync")
    t0 = time.perf_counter()
    if mine:
        for _ in range(iters):
            tr.allreduce(x, name=name, out=x, group=g)
    per_op = _slowest([time.perf_counter() - t0], tr, f"bench.gbw.{label}")[0] / iters
    return {"group_blocking_latency_s": statistics.median(blocking), "group_per_op_s": per_op}


def mpi_worker(args: argparse.Namespace) -> None:
    """The anchor: ``MPI_Allreduce`` (mpi4py, in place, float32) among the ``P`` ranks of
    ``mpiexec``, in the worker's loops (a barrier before each timed op; back to back)."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    report: dict[str, Any] = {"mode": "MPI_Allreduce", "size": size, "sizes": {}}

    def slowest(times: list[float]) -> list[float]:
        got = np.array(times)
        comm.Allreduce(MPI.IN_PLACE, got, op=MPI.MAX)
        return [float(v) for v in got]

    for label, nbytes in SIZES.items():
        if label not in args.sizes.split(","):
            continue
        x = np.ones(nbytes // 4, np.float32)
        iters = _iterations(nbytes)
        for _ in range(3):
            comm.Allreduce(MPI.IN_PLACE, x)
        gc.collect()
        lat = []
        for _ in range(iters):
            comm.Barrier()
            t0 = time.perf_counter()
            comm.Allreduce(MPI.IN_PLACE, x)
            lat.append(time.perf_counter() - t0)
        lat = slowest(lat)
        comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            comm.Allreduce(MPI.IN_PLACE, x)
        per_op = slowest([time.perf_counter() - t0])[0] / iters
        report["sizes"][label] = {
            "bytes": nbytes,
            "latency_s": statistics.median(lat),
            "blocking_latency_s": statistics.median(lat),
            "per_op_s": per_op,
            "busbw_GBps": 2 * (size - 1) / size * nbytes / per_op / 1e9,
        }
        if args.group:  # the same loops over a communicator of the group's ranks
            ranks = _group_ranks(args)
            sub = comm.Split(
                0 if rank in ranks else MPI.UNDEFINED, ranks.index(rank) if rank in ranks else 0
            )
            if sub != MPI.COMM_NULL:
                for _ in range(3):
                    sub.Allreduce(MPI.IN_PLACE, x)
            glat = []
            for _ in range(iters):
                comm.Barrier()
                t0 = time.perf_counter()
                if sub != MPI.COMM_NULL:
                    sub.Allreduce(MPI.IN_PLACE, x)
                glat.append(time.perf_counter() - t0)
            glat = slowest(glat)
            comm.Barrier()
            t0 = time.perf_counter()
            if sub != MPI.COMM_NULL:
                for _ in range(iters):
                    sub.Allreduce(MPI.IN_PLACE, x)
            report["sizes"][label].update(
                group_blocking_latency_s=statistics.median(glat),
                group_per_op_s=slowest([time.perf_counter() - t0])[0] / iters,
            )
            if sub != MPI.COMM_NULL:
                sub.Free()
    if rank == 0:
        Path(args.out).write_text(json.dumps(report))


# ---------------------------------------------------------------------- the orchestrator


def _worker_cmd(args: argparse.Namespace, out: Path) -> list[str]:
    return [
        sys.executable, "-m", "totalreduce.daemon.bench", "--role", "worker",
        "--out", str(out), "--sizes", args.sizes, "--layers", str(args.layers),
        "--layer-bytes", str(args.layer_bytes), "--compute-ms", str(args.compute_ms),
        "--steps", str(args.steps), *(["--plain-arrays"] if args.plain_arrays else []),
        *(["--group", args.group] if args.group else []),
    ]  # fmt: skip


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TOTALREDUCE_SERVICE",)}
    env.update(MPIEXEC_TIMEOUT="1200", PYTHONUNBUFFERED="1", **extra)
    return env


class _Service:
    """``totalreduce serve`` for the daemon half of the run."""

    def __init__(self, nodes: int, local: int, directory: Path) -> None:
        self.directory = directory
        self.log = directory.parent / "serve.log"
        cmd = [
            MPIEXEC, "-n", str(nodes), sys.executable, "-m", "totalreduce.cli", "serve",
            "--local-clients", str(local), "--socket-dir", str(directory),
            "--log-level", "WARNING",
        ]  # fmt: skip
        with open(self.log, "w") as err:
            self.proc = subprocess.Popen(
                cmd, stdout=subprocess.DEVNULL, stderr=err, env=_env(), start_new_session=True
            )
        # a fresh installation's first start compiles the lane and the service's loop (a
        # minute or two; longer on a busy machine)
        deadline = time.monotonic() + 600
        while not all(self.socket(n).exists() for n in range(nodes)):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the service did not start:\n{self.log.read_text()}")
            time.sleep(0.05)

    def socket(self, node: int) -> Path:
        return self.directory / f"node{node}.sock"

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def _run_embedded(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    cmd = [MPIEXEC, "-n", str(args.nodes * args.local_clients), *_worker_cmd(args, out)]
    subprocess.run(cmd, check=True, env=_env(), timeout=1200)
    return json.loads(out.read_text())


def _run_mpi(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    cmd = [
        MPIEXEC, "-n", str(args.nodes * args.local_clients), sys.executable, "-m",
        "totalreduce.daemon.bench", "--role", "mpi", "--out", str(out), "--sizes", args.sizes,
        *(["--group", args.group] if args.group else []),
    ]  # fmt: skip
    subprocess.run(cmd, check=True, env=_env(), timeout=1200)
    return json.loads(out.read_text())


def _run_daemon(args: argparse.Namespace, service: _Service, out: Path) -> dict[str, Any]:
    procs = [
        subprocess.Popen(
            _worker_cmd(args, out),
            env=_env(
                TOTALREDUCE_SERVICE="daemon",
                TOTALREDUCE_SOCKET=str(service.socket(n)),
                TOTALREDUCE_LOCAL_RANK=str(k),
            ),
        )
        for n in range(args.nodes)
        for k in range(args.local_clients)
    ]
    for p in procs:
        if p.wait(1200) != 0:
            raise SystemExit(f"a daemon-mode worker failed:\n{service.log.read_text()}")
    return json.loads(out.read_text())


_STEP = re.compile(r"totalreduce DistributedOptimizer\s+([0-9.]+)")


def _example_step(args: argparse.Namespace, service: _Service | None) -> float | None:
    """The example's median s/step of its DistributedOptimizer (embedded, or on ``service``)."""
    example = Path(args.example)
    common = ["--epochs", "1", "--compare", "--compare-steps", str(args.example_steps),
              "--plot", os.devnull]  # fmt: skip
    P = args.nodes * args.local_clients
    if service is None:
        cmd = [MPIEXEC, "-n", str(P), sys.executable, example.name, *common]
    else:  # each rank attached to its node's service; MPI only for the example's timings
        cmd = [MPIEXEC]
        for r in range(P):
            if r:
                cmd.append(":")
            n, k = divmod(r, args.local_clients)
            cmd += ["-n", "1", "-env", "TOTALREDUCE_SERVICE", "daemon",
                    "-env", "TOTALREDUCE_SOCKET", str(service.socket(n)),
                    "-env", "TOTALREDUCE_LOCAL_RANK", str(k),
                    sys.executable, example.name, *common]  # fmt: skip
    res = subprocess.run(
        cmd, cwd=example.parent, capture_output=True, text=True, env=_env(), timeout=1200
    )
    m = _STEP.search(res.stdout)
    if res.returncode != 0 or m is None:
        print(f"(the example failed: {res.stdout[-2000:]}{res.stderr[-2000:]})", file=sys.stderr)
        return None
    return float(m.group(1))


def _default_example() -> str:
    path = Path("examples/train_distributed_optimizer.py")
    try:
        import torch  # noqa: F401
    except ImportError:
        return ""
    return str(path) if path.exists() else ""


def _run_floors(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from .floor import measure

    return {
        label: measure(
            args.nodes, args.local_clients, nbytes, _iterations(nbytes), _env(), work / label
        )
        for label, nbytes in SIZES.items()
        if label in args.sizes.split(",")
    }


def _print_floors(floors: dict[str, Any], emb: dict[str, Any]) -> None:
    print(
        "\nthe floors (compiled loops and nothing else: daemon/floor.py); the target column is "
        "the daemon floor against embedded mode above"
    )
    print(
        f"{'size':>6}  {'latency embedded':>17} {'daemon':>9} {'ratio':>6}   "
        f"{'per op embedded':>16} {'daemon':>9} {'ratio':>6}   {'daemon floor / embedded':>23}"
    )
    for label, f in floors.items():
        e, d = f["embedded"], f["daemon"]
        print(
            f"{label:>6}  {e['latency_s'] * 1e6:14.1f} us {d['latency_s'] * 1e6:6.1f} us "
            f"{d['latency_s'] / e['latency_s']:6.2f}   {e['per_op_s'] * 1e6:13.1f} us "
            f"{d['per_op_s'] * 1e6:6.1f} us {d['per_op_s'] / e['per_op_s']:6.2f}   "
            f"{d['latency_s'] / emb['sizes'][label]['latency_s']:23.2f}"
        )


def _print_mpi(emb: dict[str, Any], dmn: dict[str, Any], mpi: dict[str, Any]) -> None:
    print(
        f"\nthe anchor: MPI_Allreduce (mpi4py, in place) among the same {mpi['size']} "
        "processes; blocking latency after a barrier, and back to back"
    )
    print(
        f"{'size':>6}  {'blocking MPI':>13} {'embedded':>9} {'daemon':>9} {'daemon/MPI':>10}   "
        f"{'b2b MPI':>9} {'embedded':>9} {'daemon':>9} {'daemon/MPI':>10}"
    )
    for label in mpi["sizes"]:
        m, e, d = mpi["sizes"][label], emb["sizes"][label], dmn["sizes"][label]
        mb, eb, db = (r["blocking_latency_s"] * 1e6 for r in (m, e, d))
        mo, eo, do = (r["per_op_s"] * 1e6 for r in (m, e, d))
        print(
            f"{label:>6}  {mb:10.1f} us {eb:6.1f} us {db:6.1f} us {db / mb:10.2f}   "
            f"{mo:6.1f} us {eo:6.1f} us {do:6.1f} us {do / mo:10.2f}"
        )
    print("(daemon/MPI above 1 is slower)")


def _print_group(
    emb: dict[str, Any], dmn: dict[str, Any], mpi: dict[str, Any] | None, group: str
) -> None:
    print(
        f"\nblocking allreduce over the group [{group}] beside the world's (after a barrier; "
        "back to back), each mode's, and its ratio group / world"
    )
    print(
        f"{'size':>6}  {'mode':>9} {'world':>10} {'group':>10} {'g/w':>5}   "
        f"{'b2b world':>10} {'group':>10} {'g/w':>5}"
    )
    modes = [("embedded", emb), ("daemon", dmn)] + ([("MPI", mpi)] if mpi else [])
    for label in dmn["sizes"]:
        for mode, rep in modes:
            r = rep["sizes"][label]
            wb, gb = r["blocking_latency_s"] * 1e6, r["group_blocking_latency_s"] * 1e6
            wo, go = r["per_op_s"] * 1e6, r["group_per_op_s"] * 1e6
            print(
                f"{label:>6}  {mode:>9} {wb:7.1f} us {gb:7.1f} us {gb / wb:5.2f}   "
                f"{wo:7.1f} us {go:7.1f} us {go / wo:5.2f}"
            )
        key = "group_blocking_latency_s"
        d = dmn["sizes"][label][key]
        ratios = [f"embedded {d / emb['sizes'][label][key]:.2f}"]
        if mpi:
            ratios.append(f"MPI {d / mpi['sizes'][label][key]:.2f}")
        print(f"{label:>6}  the daemon's group op after a barrier / " + ", ".join(ratios))


def _print(
    emb: dict[str, Any], dmn: dict[str, Any], steps: tuple[Any, Any], nodes: int, local: int
) -> None:
    print(
        f"\nallreduce, float32 in place, P = {nodes * local} (daemon: {nodes} services x "
        f"{local} clients); medians over the rounds"
    )
    print(
        f"{'size':>6}  {'latency embedded':>17} {'daemon':>9} {'ratio':>6}   "
        f"{'busbw embedded':>15} {'daemon':>10} {'ratio':>6}"
    )
    for label in emb["sizes"]:
        e, d = emb["sizes"][label], dmn["sizes"][label]
        print(
            f"{label:>6}  {e['latency_s'] * 1e6:14.0f} us {d['latency_s'] * 1e6:6.0f} us "
            f"{d['latency_s'] / e['latency_s']:6.2f}   {e['busbw_GBps']:10.3f} GB/s "
            f"{d['busbw_GBps']:5.3f} GB/s {d['busbw_GBps'] / e['busbw_GBps']:6.2f}"
        )
    print("(latency ratio: daemon / embedded, above 1 is slower; busbw ratio: above 1 is faster)")
    if "step" in emb:
        e, d = emb["step"], dmn["step"]
        print(
            f"\noverlapped step: {e['layers']} gradients of {e['layer_bytes'] >> 10} KiB, each "
            f"after {e['compute_ms']:g} ms of Python work ({e['compute_only_s'] * 1e3:.0f} ms "
            "of work per step)"
        )
        print(
            f"  embedded {e['step_s'] * 1e3:.1f} ms/step, daemon {d['step_s'] * 1e3:.1f} ms/step "
            f"(daemon / embedded {d['step_s'] / e['step_s']:.2f})"
        )
    if steps[0] is not None and steps[1] is not None:
        print(
            f"\nDistributedOptimizer example (median time per step, slowest rank): embedded "
            f"{steps[0] * 1e3:.1f} ms, daemon {steps[1] * 1e3:.1f} ms "
            f"(daemon / embedded {steps[1] / steps[0]:.2f})"
        )


def _median(values: list[Any]) -> Any:
    got = [v for v in values if v is not None]
    return statistics.median(got) if got else None


def _median_floors(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Each floor figure's median over the rounds."""
    return {
        label: {
            mode: {
                key: _median([r[label][mode][key] for r in rounds])
                for key in rounds[0][label][mode]
            }
            for mode in rounds[0][label]
        }
        for label in rounds[0]
    }


def _median_report(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median over the rounds."""
    out = json.loads(json.dumps(reports[0]))
    for label, row in out["sizes"].items():
        for key in ("latency_s", "blocking_latency_s", "per_op_s", "busbw_GBps",
                    "group_blocking_latency_s", "group_per_op_s"):  # fmt: skip
            if key in row:
                row[key] = _median([r["sizes"][label][key] for r in reports])
    if "step" in out:
        out["step"]["step_s"] = _median([r["step"]["step_s"] for r in reports])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m totalreduce.daemon.bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--role", choices=("run", "worker", "mpi"), default="run", help=argparse.SUPPRESS
    )
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    p.add_argument("--nodes", type=int, default=2, help="services (default 2)")
    p.add_argument("--local-clients", type=int, default=1, help="clients per service (default 1)")
    p.add_argument("--sizes", default=",".join(SIZES), help="of " + ", ".join(SIZES))
    p.add_argument("--layers", type=int, default=8, help="overlapped step: gradients (0: skip)")
    p.add_argument("--layer-bytes", type=int, default=1 << 20)
    p.add_argument("--compute-ms", type=float, default=2.0)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--example", default=None, help="the DistributedOptimizer example ('': skip)")
    p.add_argument("--example-steps", type=int, default=100)
    p.add_argument(
        "--plain-arrays",
        action="store_true",
        help="numpy arrays for the buffers instead of tr.empty's (a daemon client then "
        "copies each op's buffer into the node's arena and the result out)",
    )
    p.add_argument(
        "--floor",
        action="store_true",
        help="also time both modes' floors (compiled loops with nothing else in them)",
    )
    p.add_argument("--repeat", type=int, default=3, help="rounds; figures are medians")
    p.add_argument(
        "--no-mpi", action="store_true", help="leave out the MPI_Allreduce anchor (mpi4py)"
    )
    p.add_argument(
        "--group",
        nargs="?",
        const="auto",
        default="",
        help="also time the blocking allreduce over a group of one rank per node (each "
        "node's first, or the ranks given: 0,3) beside the world's, in every mode",
    )
    p.add_argument("--json", default="", help="also write the figures to this file")
    args = p.parse_args(argv)
    if args.group == "auto":
        args.group = ",".join(str(n * args.local_clients) for n in range(args.nodes))
    if args.role == "worker":
        worker(args)
        return 0
    if args.role == "mpi":
        mpi_worker(args)
        return 0
    if find_mpiexec() is None:
        raise SystemExit(f"no mpiexec beside {sys.executable} or on PATH (the mpich wheel has one)")
    if args.example is None:
        args.example = _default_example()
    work = Path(tempfile.mkdtemp(prefix="totalreduce-bench-"))
    rounds: list[tuple[dict[str, Any], dict[str, Any], float | None, float | None]] = []
    floors: list[dict[str, Any]] = []
    mpis: list[dict[str, Any]] = []
    try:
        for r in range(args.repeat):
            # the modes alternate, and the service runs only during the daemon half,
            # so both see the same machine and neither pays for the other
            print(f"round {r + 1} of {args.repeat}: embedded ...", flush=True)
            emb = _run_embedded(args, work / "embedded.json")
            step_emb = _example_step(args, None) if args.example else None
            print(f"round {r + 1} of {args.repeat}: daemon ...", flush=True)
            service = _Service(args.nodes, args.local_clients, work / "sockets")
            try:
                dmn = _run_daemon(args, service, work / "daemon.json")
                step_dmn = _example_step(args, service) if args.example else None
            finally:
                service.stop()
            rounds.append((emb, dmn, step_emb, step_dmn))
            if not args.no_mpi:
                print(f"round {r + 1} of {args.repeat}: MPI_Allreduce ...", flush=True)
                mpis.append(_run_mpi(args, work / "mpi.json"))
            if args.floor:
                print(f"round {r + 1} of {args.repeat}: floors ...", flush=True)
                floors.append(_run_floors(args, work / f"floor{r}"))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    emb, dmn = _median_report([r[0] for r in rounds]), _median_report([r[1] for r in rounds])
    step_emb, step_dmn = (_median([r[i] for r in rounds]) for i in (2, 3))
    _print(emb, dmn, (step_emb, step_dmn), args.nodes, args.local_clients)
    mpi = _median_report(mpis) if mpis else None
    if mpi is not None:
        _print_mpi(emb, dmn, mpi)
    if args.group:
        _print_group(emb, dmn, mpi, args.group)
    floor = _median_floors(floors) if floors else None
    if floor is not None:
        _print_floors(floor, emb)
    if args.json:
        figures = {
            "embedded": emb,
            "daemon": dmn,
            "mpi": mpi,
            "example_step_s": [step_emb, step_dmn],
        }
        Path(args.json).write_text(json.dumps({**figures, "floors": floor}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

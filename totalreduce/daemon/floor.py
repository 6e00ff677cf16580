"""The floor of daemon mode: the least a node service built on shared-memory words and MPI
among the services can take on this machine, for the daemon benchmark to set beside it.

Daemon mode's shape, with nothing else in it: each node's service is one compiled loop,
its clients are compiled loops too, and they meet only in a memory file of the
service's on huge pages, as the arena is (one submission word, one completion word and
one buffer per client).  One op:

1. each client bumps its submission word (its buffer already holds its data: in place);
2. the service, spinning on the words, sees the node's last client, sums the other
   clients' buffers into the first's (``L - 1`` passes), runs the compiled floor ring
   (:mod:`totalreduce.bench.floor`) among the services on it in place, copies the result
   into the other clients' buffers and sets every completion word;
3. each client, spinning (or, with ``--futex-after N``, asleep on its word after ``N``
   polls; the service then wakes it), sees its word.  :func:`measure` lets clients
   sleep on ops above ``SPIN_ONLY_BYTES``, which measured fastest.

No interpreter, no descriptor beyond a count, no names, no checks, no flow control: an
engine that does more work per op can hardly be faster, so a target well below this floor
is out of reach of daemon mode on the machine it was measured on, and one above it is not.
Every spinning loop yields its core between polls after ``--polls`` of them (default 0:
with more busy processes than cores the process waited for needs that core; on the 2-core
machine, two nodes of one client, 1,000 polls before yielding made a 4 KiB op take 31-38
µs instead of 4).

The same ring among the ``P = NODES * L`` ranks directly (``run_ranks``) is the embedded
floor, its anchor.  float32 sums only: a yardstick, not a collective.

Run by ``python -m totalreduce.daemon.bench --floor`` (which launches the roles below);
figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from numba import njit

from ..bench.floor import floor_ring_allreduce, floor_workspace
from ..dtypes import DType, ReduceOp
from ..kernels.raw import copy_raw, reduce_raw
from ..native.intrinsics import (
    atomic_load_i32,
    atomic_load_i64,
    atomic_store_i32,
    atomic_store_i64,
    atomic_xchg_i32,
)
from ..native.libc import futex_wait, futex_wake, now_ns, yield_cpu
from ..transport.shm import SharedRegion

#: Bytes per client's words: its own cache lines, so a client's stores never share a line
#: with another's.
_SLOT = 128
_HEAD = 4096
#: Word offsets in a client's slot: the op's element count, the submission sequence
#: (int64), the completion sequence (int32, a futex word), the client's sleeping flag.
_W_COUNT = 0
_W_SUBMIT = 8
_W_DONE = 64
_W_SLEEPS = 72
#: The synchronising op before each timed one: one float.
_SYNC_COUNT = 1
#: How long a loop waits for its peer before it gives up (a process that died), by default.
GIVE_UP_S = 30.0
#: Ops up to this size: the clients only spin (yielding between polls); larger ones: they
#: sleep on their word after ``SLEEP_AFTER_POLLS`` polls.  Measured on the 2-core machine,
#: two nodes of one client: a 64 MiB op took 23 ms with spinning clients and 14 ms (the
#: embedded floor's time) with sleeping ones; a 4 KiB op was slower with sleeping ones.
SPIN_ONLY_BYTES = 256 << 10
SLEEP_AFTER_POLLS = 100
#: What a loop that gave up returns.
TIMED_OUT = -(1 << 40)
_F32, _SUM = int(DType.FLOAT32), int(ReduceOp.SUM)


def _per(count: int) -> int:
    """Bytes of one client's buffer of ``count`` float32 (4 KiB aligned)."""
    return -(-count * 4 // 4096) * 4096


def layout(local: int, count: int) -> tuple[int, int]:
    """(offset of client 0's buffer, the file's size) for ``local`` clients of ``count``
    float32 each."""
    data = _HEAD + -(-local * _SLOT // 4096) * 4096
    return data, data + local * _per(count)


def _buffer(data: int, count: int, k: int) -> int:
    """Offset of client ``k``'s buffer."""
    return data + k * _per(count)


@njit(nogil=True, cache=True)
def _spin_i64(addr, target, polls_before_yield, give_up_ns):  # type: ignore[no-untyped-def]
    """Wait for the word at ``addr`` to reach ``target``; False if it never did."""
    polls = 0
    t0 = now_ns()
    while atomic_load_i64(addr) < target:
        polls += 1
        if polls > polls_before_yield:
            yield_cpu()
            if now_ns() - t0 > give_up_ns:
                return False
    return True


@njit(nogil=True, cache=True)
def service_loop(b, ws, base, data, per, local, scratch_addr, ops, polls_before_yield, give_up_ns):  # type: ignore[no-untyped-def]
    """Serve ``ops`` ops of the node's ``local`` clients (the file mapped at ``base``):
    0; the MPI error of the ring (negative); ``TIMED_OUT`` if a client gave no sign."""
    first = base + data
    for op in range(1, ops + 1):
        for k in range(local):
            if not _spin_i64(base + k * _SLOT + _W_SUBMIT, op, polls_before_yield, give_up_ns):
                return np.int64(TIMED_OUT)
        n = atomic_load_i64(base + _W_COUNT)
        for k in range(1, local):
            reduce_raw(_F32, _SUM, first, first + k * per, n)
        rc = floor_ring_allreduce(b, ws, first, first, scratch_addr, n)
        if rc < 0:
            return rc
        for k in range(1, local):
            copy_raw(first + k * per, first, n * 4)
        for k in range(local):
            slot = base + k * _SLOT
            atomic_store_i32(slot + _W_DONE, np.int32(op))
            if atomic_xchg_i32(slot + _W_SLEEPS, np.int32(0)) != 0:
                futex_wake(slot + _W_DONE, 1)
    return np.int64(0)


@njit(nogil=True, cache=True)
def _client_op(slot, op, n, polls_before_yield, futex_after, give_up_ns):  # type: ignore[no-untyped-def]
    atomic_store_i64(slot + _W_COUNT, n)
    atomic_store_i64(slot + _W_SUBMIT, op)
    polls = 0
    t0 = now_ns()
    while atomic_load_i32(slot + _W_DONE) != np.int32(op):
        polls += 1
        if polls & 1023 == 0 and now_ns() - t0 > give_up_ns:
            return False
        if futex_after >= 0 and polls > futex_after:
            atomic_store_i32(slot + _W_SLEEPS, np.int32(1))
            if atomic_load_i32(slot + _W_DONE) != np.int32(op):
                futex_wait(slot + _W_DONE, np.int64(np.int32(op - 1)), 10_000_000)
        elif polls > polls_before_yield:
            yield_cpu()
    return True


@njit(nogil=True, cache=True)
def client_loop(slot, first, count, iters, polls_before_yield, futex_after, give_up_ns, lat, loop):  # type: ignore[no-untyped-def]
    """The client's side, its ops numbered from ``first``: ``iters`` (sync op, timed op)
    pairs into ``lat`` (ns), then ``iters`` timed ops back to back (their total into
    ``loop[0]``).  Returns the last op's number, or ``TIMED_OUT``."""
    op = first - 1
    for i in range(iters):
        op += 1
        if not _client_op(slot, op, _SYNC_COUNT, polls_before_yield, futex_after, give_up_ns):
            return np.int64(TIMED_OUT)
        t0 = now_ns()
        op += 1
        if not _client_op(slot, op, count, polls_before_yield, futex_after, give_up_ns):
            return np.int64(TIMED_OUT)
        lat[i] = now_ns() - t0
    op += 1
    if not _client_op(slot, op, _SYNC_COUNT, polls_before_yield, futex_after, give_up_ns):
        return np.int64(TIMED_OUT)
    t0 = now_ns()
    for _ in range(iters):
        op += 1
        if not _client_op(slot, op, count, polls_before_yield, futex_after, give_up_ns):
            return np.int64(TIMED_OUT)
    loop[0] = now_ns() - t0
    return np.int64(op)


@njit(nogil=True, cache=True)
def rank_loop(b, ws, x_addr, scratch_addr, count, iters, lat, loop):  # type: ignore[no-untyped-def]
    """The embedded floor: the same (sync op, timed op) pairs and back-to-back ops as the
    clients make, each the floor ring among the ranks directly; 0 or an MPI error."""
    for i in range(iters):
        rc = floor_ring_allreduce(b, ws, x_addr, x_addr, scratch_addr, _SYNC_COUNT)
        if rc < 0:
            return rc
        t0 = now_ns()
        rc = floor_ring_allreduce(b, ws, x_addr, x_addr, scratch_addr, count)
        if rc < 0:
            return rc
        lat[i] = now_ns() - t0
    rc = floor_ring_allreduce(b, ws, x_addr, x_addr, scratch_addr, _SYNC_COUNT)
    if rc < 0:
        return rc
    t0 = now_ns()
    for _ in range(iters):
        rc = floor_ring_allreduce(b, ws, x_addr, x_addr, scratch_addr, count)
        if rc < 0:
            return rc
    loop[0] = now_ns() - t0
    return np.int64(0)


def _ops(iters: int) -> int:
    """How many ops one call of :func:`client_loop` makes."""
    return 3 * iters + 1


def _node_file(directory: Path, node: int) -> Path:
    """Where node ``node``'s service says where its memory file is (pid, fd, size)."""
    return directory / f"floor-node{node}.json"


def _comm() -> Any:
    from mpi4py import MPI

    return MPI.COMM_WORLD.Dup()


def _check(rc: int, where: str) -> None:
    if rc == TIMED_OUT:
        raise SystemExit(f"daemon floor, {where}: its peers gave no sign in time")
    if rc < 0:
        from ..transport.mpi_native import error_text

        raise SystemExit(f"daemon floor, {where}: {error_text(-rc)}")


def run_service(args: argparse.Namespace) -> None:
    """One node's service (a rank of ``mpiexec -n NODES``)."""
    from ..transport.mpi_native import binding

    comm = _comm()
    node = comm.Get_rank()
    data, size = layout(args.local, args.count)
    # a memory file on huge pages, as the daemon's arena (MPI moves a buffer between
    # processes much faster on them); the clients open it through /proc
    region = SharedRegion.create(size, f"floor-node{node}", huge=True)
    region.make_huge(data, size - data)
    base = np.int64(region.address)
    path = _node_file(Path(args.dir), node)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"pid": os.getpid(), "fd": region.fd, "size": size}))
    scratch = np.zeros(-(-args.count // comm.Get_size()) + 1, np.float32)
    per = _per(args.count)
    ops = _ops(1) + _ops(args.iters)
    b, ws = binding(comm), floor_workspace()
    os.replace(tmp, path)
    comm.Barrier()
    rc = service_loop(
        b, ws, base, np.int64(data), np.int64(per), np.int64(args.local),
        np.int64(scratch.ctypes.data), np.int64(ops), np.int64(args.polls),
        np.int64(args.give_up_s * 1e9),
    )  # fmt: skip
    _check(rc, f"service of node {node}")
    comm.Barrier()
    region.close_fd()
    comm.Free()


def run_client(args: argparse.Namespace) -> None:
    """One client (a plain process), attached to its node's file."""
    path = _node_file(Path(args.dir), args.node)
    deadline = time.monotonic() + 120
    while not path.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"daemon floor: {path} never appeared")
        time.sleep(0.01)
    data, size = layout(args.local, args.count)
    where = json.loads(path.read_text())
    if where["size"] != size:
        raise SystemExit(f"daemon floor: {path} holds {where['size']} bytes, not {size}")
    fd = os.open(f"/proc/{where['pid']}/fd/{where['fd']}", os.O_RDWR)
    region = SharedRegion.attach(fd, size, huge=True)
    base = region.address
    x = region.array(_buffer(data, args.count, args.local_rank), args.count, np.float32)
    rank = args.node * args.local + args.local_rank
    x[:] = rank + 1
    lat = np.zeros(args.iters, np.int64)
    loop = np.zeros(1, np.int64)
    # one pair and one op back to back, checked (the sync ops sum element 0 too)
    slot = np.int64(base + args.local_rank * _SLOT)
    last = client_loop(
        slot, np.int64(1), np.int64(args.count), np.int64(1), np.int64(args.polls),
        np.int64(args.futex_after), np.int64(args.give_up_s * 1e9), lat[:1], loop,
    )  # fmt: skip
    _check(last, f"client {args.local_rank} of node {args.node}")
    p = args.nodes * args.local
    expected = p * p * (p + 1) / 2
    if x[1] != expected or x[-1] != expected:
        raise SystemExit(f"daemon floor: rank {rank} got {x[1]}, {x[-1]}, not {expected}")
    last = client_loop(
        slot, np.int64(last + 1), np.int64(args.count), np.int64(args.iters),
        np.int64(args.polls), np.int64(args.futex_after), np.int64(args.give_up_s * 1e9), lat, loop,
    )  # fmt: skip
    _check(last, f"client {args.local_rank} of node {args.node}")
    Path(args.out).write_text(json.dumps({"lat_ns": lat.tolist(), "loop_ns": int(loop[0])}))
    del x


def run_ranks(args: argparse.Namespace) -> None:
    """The embedded floor: the ranks of ``mpiexec -n P`` run the ring among themselves."""
    from ..transport.mpi_native import binding

    comm = _comm()
    rank, p = comm.Get_rank(), comm.Get_size()
    x = np.full(args.count, rank + 1, np.float32)
    scratch = np.zeros(-(-args.count // p) + 1, np.float32)
    b, ws = binding(comm), floor_workspace()
    lat = np.zeros(args.iters, np.int64)
    loop = np.zeros(1, np.int64)
    xa, sa = np.int64(x.ctypes.data), np.int64(scratch.ctypes.data)
    comm.Barrier()
    _check(rank_loop(b, ws, xa, sa, np.int64(args.count), np.int64(1), lat[:1], loop), "rank")
    if x[1] != p * p * (p + 1) / 2 or x[-1] != x[1]:
        raise SystemExit(f"embedded floor: rank {rank} got {x[1]}, {x[-1]}")
    _check(rank_loop(b, ws, xa, sa, np.int64(args.count), np.int64(args.iters), lat, loop), "rank")
    got = comm.gather({"lat_ns": lat.tolist(), "loop_ns": int(loop[0])})
    if rank == 0:
        Path(args.out).write_text(json.dumps(got))
    comm.Free()


def _cmd(role: str, args: dict[str, Any]) -> list[str]:
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in args.items()]
    return [sys.executable, "-m", "totalreduce.daemon.floor", role, *flags]


def measure(
    nodes: int, local: int, nbytes: int, iters: int, env: dict[str, str], work: Path
) -> dict[str, dict[str, float]]:
    """Both floors at one size: ``{"embedded": ..., "daemon": ...}``, each
    :func:`summarize`'s figures.  Raises ``subprocess.CalledProcessError`` (or
    ``SystemExit`` with the failure) when a process fails."""
    import subprocess

    from ..launch import find_mpiexec

    mpiexec = find_mpiexec() or "mpiexec"  # (this Python's: the mpich wheel's, beside it)
    count = max(nbytes // 4, 2)
    common = {"nodes": nodes, "local": local, "count": count, "iters": iters}
    # clients spin on a small op and sleep on a large one (their spinning would take the
    # cores the services copy with), as daemon mode's clients do: what measured fastest
    wait = {"futex_after": SLEEP_AFTER_POLLS if nbytes > SPIN_ONLY_BYTES else -1}
    work.mkdir(parents=True, exist_ok=True)
    out = work / "ranks.json"
    subprocess.run(
        [mpiexec, "-n", str(nodes * local), *_cmd("ranks", {**common, "out": out})],
        check=True, env=env, timeout=600,
    )  # fmt: skip
    embedded = summarize(json.loads(out.read_text()), iters)
    service = subprocess.Popen(
        [mpiexec, "-n", str(nodes), *_cmd("service", {**common, "dir": work})], env=env
    )
    places = [(n, k) for n in range(nodes) for k in range(local)]
    outs = [work / f"client{n}.{k}.json" for n, k in places]
    clients = [
        subprocess.Popen(
            _cmd("client", {**common, **wait, "dir": work, "node": n, "local_rank": k, "out": o}),
            env=env,
        )
        for (n, k), o in zip(places, outs, strict=True)
    ]
    failed = [c.args for c in clients if c.wait(600) != 0]
    if service.wait(600) != 0 or failed:
        raise SystemExit(f"the daemon floor failed: {failed or service.args}")
    daemon = summarize([json.loads(o.read_text()) for o in outs], iters)
    for f in work.glob("floor-node*.json"):
        f.unlink()
    return {"embedded": embedded, "daemon": daemon}


def summarize(reports: list[dict[str, Any]], iters: int) -> dict[str, float]:
    """The slowest rank's time per iteration, its median (s), and the back-to-back loop's
    time per op (s, slowest rank)."""
    slowest = [max(r["lat_ns"][i] for r in reports) for i in range(iters)]
    return {
        "latency_s": statistics.median(slowest) / 1e9,
        "per_op_s": max(r["loop_ns"] for r in reports) / iters / 1e9,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m totalreduce.daemon.floor")
    p.add_argument("role", choices=("service", "client", "ranks"))
    p.add_argument("--dir", default="")
    p.add_argument("--out", default="")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--local", type=int, default=1)
    p.add_argument("--node", type=int, default=0)
    p.add_argument("--local-rank", type=int, default=0)
    p.add_argument("--count", type=int, default=1024)
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--polls", type=int, default=0, help="polls before each spin yields")
    p.add_argument("--give-up-s", type=float, default=GIVE_UP_S, help="wait for peers at most")
    p.add_argument("--futex-after", type=int, default=-1, help="client polls before it sleeps")
    args = p.parse_args(argv)
    {"service": run_service, "client": run_client, "ranks": run_ranks}[args.role](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())

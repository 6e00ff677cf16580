"""Run under ``mpiexec -n P``: the engine over real MPI (launched by test_mpi.py).

Usage: ``check_engine.py MODE[,MODE...]``: several modes run one after another in one
launch, each on an engine of its own; the lines they print are tagged ``[mode]``.

Modes:
- ``random``: 50 ops per rank in a per-rank random order with random priorities,
  delays, sizes (0 to several segments) and dtypes; exact results.
- ``mismatch``: one rank submits a different count; every rank must report it.
- ``timeout``: an op no peer submits; ``wait(timeout)`` must raise in time.
- ``collectives``: broadcast from every root and barriers of both kinds.
- ``rs_ag``: reduce-scatters and all-gathers (the parts' sizes exchanged, and given with
  ``counts=``), flat and along a partition dimension; exact.
- ``flow``: rank 0 submits 24 multi-segment ops at once, the others run them one
  by one, blocking, in reverse order, with a pool smaller than one op (run with
  ``TOTALREDUCE_FLOATING_POOL_BYTES`` set); exact results, pool bound kept.
- ``disagree``: broadcast roots and group membership that differ between ranks:
  every rank raises (at the call, or at its next call) and works afterwards.
- ``dead``: (under ``-disable-auto-cleanup``) the last rank's process exits in the
  middle of an op; every other rank fails it with an error naming that rank.
- ``raise``: the last rank dies of an exception (its interpreter exits normally);
  every other rank's op with it fails at once, naming it.
- ``bcast_mismatch``: broadcasts whose ranks disagree on the root or the count:
  every rank raises at the call, and the next broadcast of the name works.
- ``rooted``: reduce, gather, scatter from every root, all-to-all with equal and
  uneven parts, send/recv on two tags, the new dtypes and ops; exact results.
- ``reinit``: engines one after another in one process, with the same names, shut down
  unevenly and with an op in flight; every op exact.
- ``garbage``: the last rank sends a malformed message into the engine's own
  communicator; rank 0 refuses it with a FrameError naming that rank.
"""

from __future__ import annotations

import functools
import os
import random
import sys
import time

import numpy as np
from launch_modes import run_modes

import totalreduce as tr

SEGMENT = 8192
#: The pool ``flow`` runs with when it shares a launch (smaller than one of its ops).
FLOW_POOL_BYTES = 16 << 10


def say(line: str) -> None:
    """One line in one write: under PYTHONUNBUFFERED, print() writes the text and its newline
    apart, and the lines of ranks reporting at once ran together (seen once)."""
    os.write(1, (line + "\n").encode())


def data(k: int, count: int, dtype: str, rank: int, p: int) -> np.ndarray:
    idx = np.arange(count, dtype=np.int64)
    return ((idx * p + rank + k) % 1000).astype(dtype)


def mode_random(p: int, rank: int) -> None:
    rng = random.Random(7)
    sizes = [0, 1, 3, p + 1, 1000, 3 * SEGMENT // 8 + 5, 4 * SEGMENT // 4 + 3]
    table = [
        (
            rng.choice(sizes),
            rng.choice(["int64", "int32", "float64"]),
            rng.choice(["sum", "max", "min"]),
        )
        for _ in range(50)
    ]
    mine = random.Random(100 + rank)
    order = list(range(len(table)))
    mine.shuffle(order)
    handles = {}
    for k in order:
        count, dtype, op = table[k]
        x = data(k, count, dtype, rank, p)
        handles[k] = tr.allreduce_async(x, name=f"g{k}", op=op, priority=mine.randrange(5))
        if mine.random() < 0.2:
            time.sleep(mine.random() * 0.003)
    bad = 0
    for k, (count, dtype, op) in enumerate(table):
        got = handles[k].wait(timeout=60)
        stack = np.stack([data(k, count, dtype, r, p) for r in range(p)])
        want = {
            "sum": stack.sum(axis=0, dtype=dtype),
            "max": stack.max(axis=0),
            "min": stack.min(axis=0),
        }[op]
        if not np.array_equal(got, want):
            bad += 1
            print(f"rank {rank}: WRONG g{k} {op} {dtype} n={count}", flush=True)
    # the same names again: generation 1 must match generation 1 everywhere
    again = [tr.allreduce_async(data(k, 5, "int64", rank, p), name=f"g{k}") for k in range(3)]
    for k, h in enumerate(again):
        want = np.stack([data(k, 5, "int64", r, p) for r in range(p)]).sum(axis=0)
        bad += not np.array_equal(h.wait(timeout=60), want)
    print(f"rank {rank}: RANDOM {'OK' if bad == 0 else 'FAILED'}", flush=True)


def mode_mismatch(p: int, rank: int) -> None:
    count = 13 if rank == 1 else 12
    t0 = time.monotonic()
    try:
        tr.allreduce(np.ones(count, dtype=np.float32), name="layer.mismatch")
        print(f"rank {rank}: NO ERROR", flush=True)
    except tr.OpMismatchError as exc:
        print(
            f"rank {rank}: MISMATCH-REPORTED after {time.monotonic() - t0:.2f}s: {exc}", flush=True
        )
    # the service keeps working
    out = tr.allreduce(np.full(4, rank, dtype=np.int64), name="after")
    ok = np.array_equal(out, np.full(4, p * (p - 1) // 2))
    print(f"rank {rank}: AFTER {'OK' if ok else 'FAILED'}", flush=True)


def mode_timeout(p: int, rank: int) -> None:
    if rank == 0:
        h = tr.allreduce_async(np.ones(8), name="nobody.else")
        t0 = time.monotonic()
        try:
            h.wait(timeout=0.5)
            print("rank 0: NO TIMEOUT", flush=True)
        except tr.OpTimeoutError as exc:
            print(f"rank 0: TIMEOUT-RAISED after {time.monotonic() - t0:.2f}s: {exc}", flush=True)
    tr.barrier()
    print(f"rank {rank}: TIMEOUT-DONE", flush=True)
    tr.shutdown(timeout=0.5)


def mode_collectives(p: int, rank: int) -> None:
    bad = 0
    for root in range(p):
        x = np.arange(5000, dtype=np.float64) * (root + 1) if rank == root else np.zeros(5000)
        for algo in ("one_to_all", "pipelined"):
            got = tr.broadcast(x, root=root, name=f"b{root}.{algo}", algorithm=algo)
            bad += not np.array_equal(got, np.arange(5000, dtype=np.float64) * (root + 1))
    tr.barrier(algorithm="all_to_all")
    tr.barrier(algorithm="all_to_one")
    y = np.full(7, float(rank))
    tr.allreduce(y, out=y, op="avg")
    bad += not np.allclose(y, (p - 1) / 2)
    print(f"rank {rank}: COLLECTIVES {'OK' if bad == 0 else 'FAILED'}", flush=True)


def mode_algorithms(p: int, rank: int) -> None:
    bad = 0
    hs = {}
    for algo in ("ring", "ring_chunked", "halving_doubling", "recursive_doubling", "bcube", "auto"):
        for n in (0, 1, p + 1, 1000, 20011):
            x = np.arange(n, dtype=np.int64) * p + rank
            hs[algo, n] = tr.allreduce_async(x, name=f"{algo}.{n}", algorithm=algo)
    for (algo, n), h in hs.items():
        want = np.arange(n, dtype=np.int64) * p * p + p * (p - 1) // 2
        if not np.array_equal(h.wait(timeout=60), want):
            bad += 1
            print(f"rank {rank}: WRONG {algo} n={n}", flush=True)
    print(f"rank {rank}: ALGORITHMS {'OK' if bad == 0 else 'FAILED'}", flush=True)


def mode_rs_ag(p: int, rank: int) -> None:
    bad = 0
    for n in (0, 1, p + 1, 5000):
        x = np.arange(n, dtype=np.float64) + rank
        part = tr.reduce_scatter(x, name=f"rs{n}")
        total = np.arange(n, dtype=np.float64) * p + p * (p - 1) / 2
        bad += not np.array_equal(part, np.array_split(total, p)[rank])
        back = tr.allgather(part, name=f"ag{n}")
        bad += not np.array_equal(back, total)
        # the parts' sizes given: one op, no exchange of them first
        counts = [len(q) for q in np.array_split(total, p)]
        back = tr.allgather(part, name=f"agc{n}", counts=counts)
        bad += not np.array_equal(back, total)
    shape = (2, p // 2) if p % 2 == 0 else (p,)
    partition = tr.Partition(shape)
    axis = len(shape) - 1
    rng = np.random.default_rng(rank)
    x = rng.standard_normal((4, 3 * shape[-1] + 1) if axis == 1 else (3 * shape[-1] + 1, 4))
    fx = tr.reduce_scatter(x, name="F", partition=partition, axes=(axis,))
    y = rng.standard_normal(fx.shape)
    fty = tr.allgather(y, name="Ft", partition=partition, axes=(axis,))
    sums = tr.allreduce(np.array([np.vdot(fx, y), np.vdot(x, fty)]), name="dots")
    bad += not abs(sums[0] - sums[1]) <= 1e-12 * max(1.0, abs(sums[0]))
    print(f"rank {rank}: RSAG {'OK' if bad == 0 else 'FAILED'}", flush=True)


def mode_neighbor(p: int, rank: int) -> None:
    from totalreduce.topology import get_topology, mixing_matrix

    bad = 0
    X = np.random.default_rng(0).standard_normal((p, 40))
    for name in ("exponential-2", "ring-graph", "exp", "ring", "complete"):
        topo = get_topology(name, p)
        for step in range(2):
            got = tr.neighbor_allreduce(X[rank], name=f"n.{name}", topology=name)
            want = (mixing_matrix(topo, step) @ X)[rank]
            if not np.allclose(got, want, atol=1e-12):
                bad += 1
                print(f"rank {rank}: WRONG {name} step {step}", flush=True)
    h = tr.hierarchical_neighbor_allreduce(
        X[rank], name="hier", topology="exponential-2", local_size=2
    )
    nodes = X.reshape(p // 2, 2, -1).mean(axis=1)
    want = (mixing_matrix(get_topology("exponential-2", p // 2), 0) @ nodes)[rank // 2]
    bad += not np.allclose(h, want, atol=1e-12)
    got = tr.neighbor_allgather(np.full(3, float(rank)), name="nag", topology="ring-graph")
    bad += not np.array_equal(got[:, 0], sorted({(rank - 1) % p, (rank + 1) % p}))
    print(f"rank {rank}: NEIGHBOR {'OK' if bad == 0 else 'FAILED'}", flush=True)


def mode_user_traffic(p: int, rank: int) -> None:
    """The user's own MPI messages on COMM_WORLD never mix with totalreduce's."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    hs = [tr.allreduce_async(np.full(100, rank), name=f"u{k}") for k in range(20)]
    peer = (rank + 1) % p
    for tag in (0, 1, 16, 17):  # totalreduce's own tag numbers, on the user's communicator
        req = comm.isend(f"hello {rank} {tag}", dest=peer, tag=tag)
        msg = comm.recv(source=(rank - 1) % p, tag=tag)
        req.wait()
        assert msg == f"hello {(rank - 1) % p} {tag}", msg
    ok = all(np.array_equal(h.wait(timeout=60), np.full(100, p * (p - 1) // 2)) for h in hs)
    print(f"rank {rank}: USER-TRAFFIC {'OK' if ok else 'FAILED'}", flush=True)


def mode_flow(p: int, rank: int) -> None:
    n_ops, count = 24, 3 * SEGMENT // 8 + 11  # four segments of int64 each
    if rank == 0:
        hs = [tr.allreduce_async(data(k, count, "int64", 0, p), name=f"f{k}") for k in range(n_ops)]
        got = {k: h.wait(timeout=60) for k, h in enumerate(hs)}
    else:
        got = {}
        for k in reversed(range(n_ops)):
            got[k] = tr.allreduce(data(k, count, "int64", rank, p), name=f"f{k}")
    ok = all(
        np.array_equal(got[k], sum(data(k, count, "int64", r, p) for r in range(p)))
        for k in range(n_ops)
    )
    svc = tr.default_service()
    peak = -1
    if svc._thin is None:  # embedded: this rank's engine held the early frames in its pool
        peak = svc.loop.floating_peak_bytes  # the lane's
        ok = ok and peak <= svc.config.floating_pool_bytes
    # (a daemon client runs no engine: the services' engines held them, in pools as small)
    print(f"rank {rank}: FLOW {'OK' if ok else 'FAILED'} peak {peak}", flush=True)


def _raises_now_or_next(fn) -> str:
    try:
        fn()
    except tr.TotalReduceError as exc:
        return str(exc)
    me = tr.Group([tr.rank()])
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            tr.allreduce(np.zeros(1), group=me)
        except tr.TotalReduceError as exc:
            return str(exc)
        time.sleep(0.01)
    return ""


def mode_disagree(p: int, rank: int) -> None:
    last = rank == p - 1
    root = _raises_now_or_next(
        lambda: tr.broadcast(np.full(4, float(rank)), root=1 if last else 0, name="b")
    )
    grp = tr.Group(range(p) if last else range(p - 1))
    group = _raises_now_or_next(
        lambda: tr.allreduce(np.ones(4), group=grp, algorithm="ring", name="g")
    )
    after = tr.allreduce(np.full(2, rank, dtype=np.int64), name="after")
    ok = bool(root) and bool(group) and np.array_equal(after, np.full(2, p * (p - 1) // 2))
    print(f"rank {rank}: DISAGREE {'OK' if ok else 'FAILED'} | {root} | {group}", flush=True)


def mode_bcast_mismatch(p: int, rank: int) -> None:
    last = rank == p - 1
    cases = {"root": (p - 1 if last else 0, 4), "count": (0, 5 if last else 4)}
    said = []
    for k, (case, (root, n)) in enumerate(cases.items()):
        for algorithm in ("one_to_all", "pipelined"):
            name = f"b.{case}.{algorithm}"
            try:
                tr.broadcast(np.full(n, float(rank)), root=root, name=name, algorithm=algorithm)
                said.append(f"{name}: NO ERROR")
            except tr.OpMismatchError as exc:
                said.append(f"{name}: raised ({exc})")
            again = tr.broadcast(
                np.full(3, float(rank + k)), root=0, name=name, algorithm=algorithm
            )
            if not np.array_equal(again, np.full(3, float(k))):
                said.append(f"{name}: next generation got {again}")
    ok = all(s.endswith(")") and "raised" in s for s in said)
    print(
        f"rank {rank}: BCAST-MISMATCH {'OK' if ok else 'FAILED'} | {' | '.join(said)}", flush=True
    )


def mode_rooted(p: int, rank: int) -> None:
    n = 3000  # several segments of SEGMENT bytes
    bad = []

    def expect(what: str, got, want) -> None:
        if got is None or want is None:
            if got is not want:
                bad.append(f"{what}: got {got!r}")
        elif not np.array_equal(got, want):
            bad.append(f"{what}: wrong")

    xs = [data(0, n, "int64", r, p) for r in range(p)]
    for root in range(p):
        x = xs[rank]
        expect(f"reduce {root}", tr.reduce(x, root=root, name="r"),
               np.add.reduce(xs) if rank == root else None)  # fmt: skip
        expect(f"gather {root}", tr.gather(x, root=root, name="g"),
               np.stack(xs) if rank == root else None)  # fmt: skip
        whole = np.concatenate(xs)
        part = tr.scatter(whole if rank == root else np.empty(n, np.int64), root=root, name="s")
        expect(f"scatter {root}", part, xs[rank])  # part r of the root's whole
        u8 = [np.arange(n, dtype=np.uint8) * (r + 3) for r in range(p)]
        expect(f"reduce band {root}", tr.reduce(u8[rank], root=root, op="band", name="rb"),
               np.bitwise_and.reduce(u8) if rank == root else None)  # fmt: skip
    a = tr.alltoall(np.arange(p * 5, dtype=np.float32) + 100 * rank, name="a")
    mine = np.arange(5 * rank, 5 * rank + 5, dtype=np.float32)
    expect("alltoall", a, np.concatenate([mine + 100 * j for j in range(p)]))
    sizes = [[(i + 2 * j) % 4 * 1000 for j in range(p)] for i in range(p)]
    x = np.full(sum(sizes[rank]), rank, dtype=np.int16)
    v = tr.alltoall(x, name="av", splits=sizes[rank], recv_splits=[s[rank] for s in sizes])
    expect("alltoallv", v, np.concatenate([np.full(sizes[j][rank], j, np.int16) for j in range(p)]))
    flags = tr.allreduce(np.array([rank == 0, rank == 1, False]), name="bools", op="sum")
    expect("bool sum", flags, np.array([True, p > 1, False]))
    nxt, prv = (rank + 1) % p, (rank - 1) % p
    if p > 1:
        hs = [tr.send_async(np.full(k + 1, rank, np.int8), dst=nxt, tag=k % 2) for k in range(4)]
        for k in (1, 3, 0, 2):  # tag 1 first: tags are separate streams
            got = tr.recv(np.zeros(k + 1, np.int8), src=prv, tag=k % 2)
            expect(f"recv {k}", got, np.full(k + 1, prv, np.int8))
        for h in hs:
            h.wait(timeout=30)
    print(f"rank {rank}: ROOTED {'OK' if not bad else 'FAILED ' + '; '.join(bad)}", flush=True)


def mode_garbage(p: int, rank: int) -> None:
    svc = tr.default_service()
    if rank == p - 1:
        from totalreduce.protocol import LANE_TAG

        comm = svc.transport.comm  # a test reaching in on purpose: a forged peer, on the lane's tag
        raw = np.frombuffer(b"\x00garbage" * 12, dtype=np.uint8).copy()
        comm.Send([raw, 0], dest=0, tag=LANE_TAG)
    verdict = "skip"
    if rank == 0:
        deadline = time.monotonic() + 10
        while p - 1 not in svc.loop.peers.bad and time.monotonic() < deadline:
            time.sleep(0.01)
        err = svc.loop.peers.bad.get(p - 1)
        alive = svc.loop.fatal is None
        me = tr.Group([0])
        works = np.array_equal(tr.allreduce(np.arange(3.0), group=me), np.arange(3.0))
        good = isinstance(err, tr.FrameError) and f"rank {p - 1}" in str(err) and alive and works
        verdict = "OK" if good else f"FAILED {err!r}"
    print(f"rank {rank}: GARBAGE {verdict}", flush=True)
    time.sleep(0.5)
    import os

    os._exit(0)  # the forged peer is banned: skip the shutdown handshake


def mode_dead(p: int, rank: int) -> None:
    import os

    tr.allreduce(np.ones(4), name="warm")
    if rank == p - 1:
        time.sleep(0.2)
        os._exit(3)
    t0 = time.monotonic()
    try:
        tr.allreduce(np.ones(1 << 16), name="x")
        print(f"rank {rank}: DEAD-PEER NOT REPORTED", flush=True)
    except tr.TotalReduceError as exc:
        say(f"rank {rank}: DEAD-PEER-REPORTED after {time.monotonic() - t0:.1f}s: {exc}")
    sys.stdout.flush()
    time.sleep(2.5)  # survivors stay, so none is taken for dead by the others
    os._exit(0)  # MPI cannot finalize with a dead peer


def mode_raise(p: int, rank: int) -> None:
    tr.allreduce(np.ones(4), name="warm")
    if rank == p - 1:
        raise RuntimeError(f"rank {rank} dies of an exception")
    t0 = time.monotonic()
    try:
        tr.allreduce(np.ones(4), name="x")
        print(f"rank {rank}: RAISE NOT REPORTED", flush=True)
    except tr.TotalReduceError as exc:
        say(f"rank {rank}: RAISE-REPORTED after {time.monotonic() - t0:.1f}s: {exc}")


#: The modes that end the job (a rank dies or is banned): each runs alone, last.
ALONE = frozenset({"dead", "raise", "garbage"})


def mode_reinit(p: int, rank: int) -> None:
    """Engines one after another in one process, each with the same op names (generation 0
    again): one shut down while the last rank is still busy for longer than a transport's
    close waits for its peers, one with an op in flight that no peer submits.  Every op of
    every engine is exact: nothing one engine sent reaches the next."""
    bad = 0
    for round_ in range(4):
        x = np.arange(1000, dtype=np.int64) * (round_ + 1) + rank
        got = tr.allreduce(x, name="again")
        want = np.arange(1000, dtype=np.int64) * (round_ + 1) * p + p * (p - 1) // 2
        bad += not np.array_equal(got, want)
        if round_ == 1 and rank == p - 1:
            time.sleep(1.5)  # the others' close stops waiting for this rank
        if round_ == 2 and rank == 0:
            tr.allreduce_async(np.ones(3), name="lonely")  # fails at the shutdown
        tr.shutdown(timeout=0.2)
        tr.init(segment_bytes=SEGMENT, micro_bytes=1024, stall_warning_s=5)
    got = tr.allreduce(np.full(5, rank, dtype=np.int64), name="again")
    bad += not np.array_equal(got, np.full(5, p * (p - 1) // 2))
    print(f"rank {rank}: REINIT {'OK' if bad == 0 else 'FAILED'}", flush=True)


def main() -> None:
    """Run the modes ``sys.argv[1]`` names (comma-separated; launch_modes.py), each on an engine
    of its own with the options it needs."""
    modes = {
        "random": mode_random,
        "mismatch": mode_mismatch,
        "timeout": mode_timeout,
        "collectives": mode_collectives,
        "algorithms": mode_algorithms,
        "rs_ag": mode_rs_ag,
        "neighbor": mode_neighbor,
        "user_traffic": mode_user_traffic,
        "flow": mode_flow,
        "disagree": mode_disagree,
        "bcast_mismatch": mode_bcast_mismatch,
        "rooted": mode_rooted,
        "garbage": mode_garbage,
        "dead": mode_dead,
        "raise": mode_raise,
        "reinit": mode_reinit,
    }
    alone = len(sys.argv[1].split(",")) == 1

    def engine(mode: str) -> None:
        options: dict[str, int] = {}
        if mode == "flow" and not alone:  # alone, it takes the pool from the environment
            options["floating_pool_bytes"] = FLOW_POOL_BYTES
        tr.init(segment_bytes=SEGMENT, micro_bytes=1024, stall_warning_s=5, **options)
        modes[mode](tr.size(), tr.rank())
        tr.shutdown()

    run_modes({m: functools.partial(engine, m) for m in modes}, ALONE)


if __name__ == "__main__":
    main()

"""A daemon client for tests/daemon/test_thin.py: the thin path of hierarchical ops.

``python thin_worker.py MODE`` with the daemon variables set (``cluster.client_env``);
prints ``rank R: NAME OK`` per check, or ``rank R: NAME FAILED ...``.

- ``arena``: arrays of ``tr.empty`` live in the arena and ops on them take no copy
  (nothing else of the client's part of the arena is in use while they run); plain
  arrays are staged and the staging goes back; every dtype and op of allreduce,
  broadcast from every root (arena and plain buffers mixed across ranks), barriers,
  ``avg`` on integers (floor); 2,000 small ops in flight in a per-rank random order with
  random priorities; a done callback runs without a wait; ``totalreduce.torch.empty``;
  a mismatch among the clients of one node fails on every rank, naming both, and the
  next op of the name works.
- ``kinds``: reduce-scatter (balanced, given parts, ``avg``, along a partition's axis),
  all-gather (uneven parts, gathered first or given), ops over groups (two pairs
  across the nodes that share names), all-to-all with uneven splits, and the neighbor
  ops (a topology's weights, dynamic weights, a neighbor all-gather, hierarchical
  averaging), an algorithm named (which the services run), reduce, gather,
  scatter and send/recv are exact and start no engine.
- ``garbage``: descriptors written past the client's checks (an unknown kind or dtype, a
  negative count, a root outside the world, buffers outside the client's part of the arena)
  each fail with ``InvalidArgumentError`` saying what was wrong; the next op works.
- ``meeting`` (one node): the world's allreduces, broadcasts and barriers meet in the
  arena without the service: every element type and op, from 0 elements to several
  slices, arrays of the arena in place (repeats: one compiled call each, no handle) and
  plain ones, all exact; the meeting's count of ops run grows by one per op.
- ``ring`` (several nodes): blocking repeats on arrays of the arena, in place and into
  another such array, are one compiled call each (submitted into the ring and waited for:
  counted in the client's state, no handle made), exact in float16, float32, float64,
  int32 and int64; first occurrences and async forms make handles as before; a repeat
  whose count another node changed raises what the Python path raises; a handle's
  ``wait(timeout=)`` is honoured by the compiled wait.
- ``ring-death`` (several nodes): the service of node 0 killed while its client waits in
  a compiled call: the call raises ``TransportError`` within seconds (``ring-death-rs``:
  in a reduce-scatter's).
- ``ring-groups``: blocking repeats over groups (allreduce, broadcast, barrier,
  reduce-scatter, all-gather), all-gathers without counts (two compiled calls) and, on one
  node, the world's broadcasts at the meeting place, with no handle, exact; a group
  repeat whose count another member changed raises the handle's error.
- ``dtypes``: every element type and op of allreduce, every size class, bit for bit.
- ``ring-kinds``: blocking repeats of reduce-scatters (balanced parts and given ones), of
  all-gathers given their counts and of broadcasts into a new array or another (on a
  service of several nodes) are one compiled call each, with no handle, exact in float32
  and int64; they wait for a late rank past the wait's looks at the socket; a repeat
  whose count another rank changed raises what the Python path raises.
- ``pressure``: with a small arena, ops larger than half a client's part run in pieces
  (an allreduce, a reduce-scatter, an all-gather with and without counts, and a blocking
  repeat of the latter: its sizes in one compiled call, its data in pieces; all-to-alls), a
  window larger than a client's whole part sends its messages in pieces, and many staged
  ops in flight wait for room (backpressure), all exact and with no engine.
"""

from __future__ import annotations

import gc
import os
import random
import re
import sys
import threading
import time
from typing import Any

import numpy as np

import totalreduce as tr
from totalreduce.algorithms.schedule import balanced_parts


def report(rank: int, name: str, ok: bool, why: str = "") -> None:
    print(f"rank {rank}: {name} {'OK' if ok else 'FAILED ' + why}", flush=True)


def mode_arena(p: int, rank: int) -> None:
    svc = tr.default_service()
    thin = svc._thin  # the client's side of the arena (service/thin.py)
    assert thin is not None, "daemon mode has a thin path"
    base = thin.space.used_bytes

    def engine_threads() -> list[str]:
        return [t.name for t in threading.enumerate() if t.name.startswith("totalreduce-")]

    # init's session agreement so far: no engine, no threads
    report(rank, "NO-ENGINE", svc._loop is None and not engine_threads(), str(engine_threads()))

    # tr.empty: in the arena, in place, no staging
    x = tr.empty(1000, np.float32)
    ok = thin.arena.offset_of(x) >= 0
    x[:] = rank + 1
    h = tr.allreduce_async(x, name="in.arena", out=x)
    ok &= thin.space.used_bytes == base + 4032  # x alone (1000 * 4 rounded to 64)
    ok &= h.wait() is not None and np.all(x == p * (p + 1) / 2)
    report(rank, "ZERO-COPY", bool(ok), f"{thin.space.used_bytes - base} bytes in use, {x[:3]}")
    del x, h

    # a repeat of an in-place allreduce: the express path (the descriptor of the first)
    from totalreduce.service import express

    x = tr.empty((4, 25), np.float32)
    bad = []
    taken: list[bool] = []  # whether each call took the express path
    real_start = express.thin_start

    def counting(*args: Any) -> Any:
        h = real_start(*args)
        taken.append(h is not None)
        return h

    real_now = express.thin_now

    def counting_now(*args: Any) -> Any:  # a blocking repeat in place, on one node
        try:
            got = real_now(*args)
        except Exception:
            taken.append(True)
            raise
        taken.append(got is not None)
        return got

    express.thin_start = counting
    express.thin_now = counting_now
    for i in range(5):
        x[:] = rank + i
        h = tr.allreduce_async(x, name="express", out=x, priority=i)
        h.wait()
        if h.generation != i or not np.all(x == sum(r + i for r in range(p))):
            bad.append(f"repeat {i}: generation {h.generation}, {x[0, :3]}")
    if (express.THIN, "express", "sum", None) not in svc._express:
        bad.append("no express record")
    ro = x.view()
    ro.flags.writeable = False
    try:
        tr.allreduce_async(ro, name="express", out=ro)
        bad.append("a read-only array was taken")
    except tr.InvalidArgumentError:
        pass
    # a repeat on one rank meets another op on the other: both raise; the name goes on
    try:
        tr.allreduce(x, name="express", out=x, op="max" if rank == 1 else "sum")
        bad.append("no mismatch")
    except tr.OpMismatchError as exc:
        if "max" not in str(exc) or "sum" not in str(exc):
            bad.append(str(exc))
    x[:] = 1
    tr.allreduce(x, name="express", out=x)
    if not np.all(x == p):
        bad.append(f"after the mismatch: {x[0, :3]}")
    # repeats of plain arrays: staged, in place or into a new array, all given back
    for i in range(4):
        v = np.arange(12, dtype=np.float64).reshape(3, 4) + rank + i
        got = tr.allreduce(v, name="express.new", op="max")
        if got.shape != (3, 4) or not np.array_equal(got, np.arange(12).reshape(3, 4) + p - 1 + i):
            bad.append(f"new array, repeat {i}: {got.ravel()[:3]}")
        w = np.full(7, rank + i, np.int32)
        back = tr.allreduce_async(w, name="express.in", out=w).wait()
        if not (np.all(w == sum(r + i for r in range(p))) and np.array_equal(back, w)):
            bad.append(f"in place, repeat {i}: {w[:3]}")
    express.thin_start = real_start
    express.thin_now = real_now
    if (express.THIN, "express.new", "max", None) not in svc._express:
        bad.append("no express record of a new array")
    # the first call of each name (and op) goes the whole way, its repeats the express
    # one (on one node a blocking one in place: thin_now); the read-only array goes the
    # whole way, and so does rank 1's "max"
    if taken.count(True) != 4 + (rank != 1) + 1 + 3 + 3:
        bad.append(f"the express path was taken {taken.count(True)} times: {taken}")
    # two arrays of the arena in turn under one name: the record remembers the last one's
    # place; each result lands in its own array, and a new array of the same shape in its own
    y = tr.empty((4, 25), np.float32)
    for i in range(4):
        arr = x if i % 2 else y
        other = y if i % 2 else x
        other[:] = -1
        arr[:] = rank * 10 + i
        tr.allreduce(arr, name="express", out=arr)
        if not (np.all(arr == sum(r * 10 + i for r in range(p))) and np.all(other == -1)):
            bad.append(f"two arrays in turn, call {i}: {arr[0, :2]}, the other {other[0, :2]}")
    del y, arr, other
    gc.collect()
    z = tr.empty((4, 25), np.float32)  # may take y's place, as a new object
    z[:] = rank
    tr.allreduce(z, name="express", out=z)
    if not np.all(z == sum(range(p))):
        bad.append(f"a new array in a freed place: {z[0, :2]}")
    report(rank, "EXPRESS", not bad, "; ".join(bad))
    del x, ro, h, z
    gc.collect()  # the failed op's handle and its error's traceback hold x in a cycle

    # plain arrays: staged, given back
    bad = []
    for dt in ("float32", "float64", "int32", "int64", "uint8", "float16"):
        for op in ("sum", "max", "min", "avg", "product"):
            if op == "avg" and dt == "uint8":
                continue
            v = (np.arange(7) % 3 + rank + 1).astype(dt)
            got = tr.allreduce(v, name=f"t.{dt}.{op}", op=op)
            vals = np.stack([(np.arange(7) % 3 + r + 1).astype(dt) for r in range(p)])
            want = {
                "sum": vals.sum(axis=0, dtype=dt),
                "max": vals.max(axis=0),
                "min": vals.min(axis=0),
                "product": vals.prod(axis=0, dtype=dt),
                "avg": (
                    vals.sum(axis=0, dtype=dt) // p
                    if np.dtype(dt).kind in "iu"
                    else vals.sum(axis=0, dtype=np.float64) / p
                ),
            }[op]
            close = np.allclose(got.astype(np.float64), want.astype(np.float64), rtol=1e-3)
            if got.dtype != np.dtype(dt) or not close:
                bad.append(f"{dt} {op}: {got} != {want}")
    bad += [f"{thin.space.used_bytes - base} bytes still in use"] * (thin.space.used_bytes != base)
    report(rank, "DTYPES", not bad, "; ".join(bad[:3]))

    # broadcast from every root, arena and plain buffers mixed
    bad = []
    for root in range(p):
        buf = tr.empty(333, np.int64) if (rank + root) % 2 else np.zeros(333, np.int64)
        buf[:] = np.arange(333) * (rank + 1)
        got = tr.broadcast(buf, root=root, name="bc", out=buf)
        want = np.arange(333) * (root + 1)
        if not (np.array_equal(buf, want) and np.array_equal(got, want)):
            bad.append(f"root {root}: {buf[:4]}")
        tr.barrier()
    report(rank, "BROADCAST", not bad, "; ".join(bad))

    # many small ops in flight, in a random order per rank, random priorities
    rng = random.Random(rank * 7919 + 1)
    order = list(range(2000))
    rng.shuffle(order)
    handles = {}
    for k in order:
        v = np.full(3, k + rank, dtype=np.int64)
        handles[k] = tr.allreduce_async(v, name=f"many.{k}", priority=rng.randrange(10))
    bad = [k for k, h in handles.items() if not np.all(h.wait() == p * k + p * (p - 1) // 2)]
    report(rank, "IN-FLIGHT", not bad, f"{len(bad)} wrong, first {bad[:3]}")

    # a done callback runs without anyone waiting
    fired = threading.Event()
    h = tr.allreduce_async(np.ones(5), name="cb")
    h.add_done_callback(lambda _h: fired.set())
    report(rank, "CALLBACK", fired.wait(30), "the callback did not run")

    # totalreduce.torch.empty
    try:
        import torch

        import totalreduce.torch as trt

        t = trt.empty(2, 3, dtype=torch.bfloat16)
        t.fill_(rank + 1)
        out = trt.allreduce(t, name="torch.empty", op="sum")
        ok = thin.arena.offset_of(t.view(torch.int16).numpy()) >= 0
        ok &= bool(torch.all(out == p * (p + 1) / 2))
        report(rank, "TORCH-EMPTY", ok, str(out))
    except ImportError:
        report(rank, "TORCH-EMPTY", True)

    # a mismatch among the clients of one node: every rank fails, naming both; then works
    count = 9 if rank == 1 else 8
    try:
        tr.allreduce(np.ones(count, np.float32), name="layer.mm")
        report(rank, "MISMATCH", False, "no error")
    except tr.OpMismatchError as exc:
        text = str(exc)
        ok = "'layer.mm'" in text and "count 9" in text and "count 8" in text
        report(rank, "MISMATCH", ok, text)
    after = tr.allreduce(np.full(4, rank, np.int64), name="layer.mm.after")
    report(rank, "AFTER", bool(np.all(after == p * (p - 1) // 2)), str(after))

    # Gloo's pairwise exchange: one all-to-all on the thin path, its parts in step order
    bad = []
    for steps in range(1, p.bit_length()):
        x = np.arange(10, dtype=np.int64) + 100 * rank
        got = tr.pairwise_exchange(x, steps, name=f"pairs.{steps}")
        for k, (off, n) in enumerate(balanced_parts(10, steps)):
            want = np.arange(off, off + n) + 100 * (rank ^ (1 << k))
            if not np.array_equal(got[off : off + n], want):
                bad.append(f"steps {steps}, part {k}: {got[off : off + n]} != {want}")
    try:
        tr.pairwise_exchange(np.ones(4), p, name="pairs.bad")
        bad.append("steps beyond lg P were taken")
    except tr.InvalidArgumentError:
        pass
    quiet = svc._loop is None and not any("comm" in n for n in engine_threads())
    report(rank, "PAIRWISE", not bad and quiet, "; ".join(bad) or str(engine_threads()))


def mode_meeting(p: int, rank: int) -> None:
    """One node: its clients meet in the arena (transport/meeting.py)."""
    from totalreduce.service import thin as thin_mod
    from totalreduce.transport import arena as A
    from totalreduce.transport import meeting as M

    svc = tr.default_service()
    thin = svc._thin
    assert thin is not None and thin.meet is not None, "a one-node service's clients meet"
    mem = thin.arena.view(int(thin.header[A.H_MEET]), 512, np.dtype(np.int64))

    def ran() -> int:
        return int(mem[M.M_RAN // 8])

    made = [0]
    real = thin_mod.ThinHandle.__init__

    def counting(self: Any, *args: Any, **kw: Any) -> None:
        made[0] += 1
        real(self, *args, **kw)

    bad: list[str] = []
    # every element type and op, in place on arrays of the arena: first calls, then repeats
    types = {
        "float16": "sum max", "float32": "sum avg max min product", "float64": "sum avg",
        "int32": "sum avg band bor bxor", "int64": "sum max min", "uint8": "sum max",
        "int8": "sum min", "int16": "sum bxor", "bool": "sum product",
    }  # fmt: skip

    def expect(vals: np.ndarray, op: str, dt: str) -> np.ndarray:
        if dt == "bool":
            return vals.any(axis=0) if op == "sum" else vals.all(axis=0)
        if op == "avg":
            if dt.startswith("int"):
                return vals.sum(axis=0, dtype=dt) // p  # type: ignore[no-any-return]
            return (vals.sum(axis=0, dtype=np.float64) / p).astype(dt)
        reduce = {
            "sum": np.add, "max": np.maximum, "min": np.minimum, "product": np.multiply,
            "band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor,
        }[op]  # fmt: skip
        return reduce.reduce(vals, axis=0, dtype=dt)  # type: ignore[no-any-return]

    sizes = [0, 1, 1024, (1 << 20) // 4 + 3]
    for dt, ops in types.items():
        for op in ops.split():
            for n in sizes if dt in ("float32", "int8") else sizes[:3]:
                x = tr.empty(n, dt)
                for i in range(3):  # the whole way, then two repeats
                    vals = np.stack([(np.arange(n) % 5 + r + i).astype(dt) for r in range(p)])
                    x[:] = vals[rank]
                    tr.allreduce(x, name=f"m.{dt}.{op}.{n}", op=op, out=x)
                    want = expect(vals, op, dt)
                    close = np.allclose(x.astype(np.float64), want.astype(np.float64), rtol=1e-3)
                    if not close:
                        bad.append(f"{dt} {op} {n} call {i}: {x[:3]} != {want[:3]}")
    report(rank, "MEET-DTYPES", not bad, "; ".join(bad[:3]))
    # repeats in place on arrays of the arena: one compiled call each, counted as run there
    x = tr.empty(1024, np.float32)
    x[:] = 1
    tr.allreduce(x, name="meet.repeat", out=x)
    tr.barrier(name="meet.sync")
    before = ran()
    thin_mod.ThinHandle.__init__ = counting  # type: ignore[method-assign]
    for i in range(200):
        x[:] = rank + i
        tr.allreduce(x, name="meet.repeat", out=x)
        if not np.all(x == sum(r + i for r in range(p))):
            bad.append(f"repeat {i}: {x[:2]}")
    thin_mod.ThinHandle.__init__ = real  # type: ignore[method-assign]
    # the name is in flight no more: another shape of it is an op like any
    v = tr.allreduce(np.full(7, rank, np.int64), name="meet.repeat")
    if not np.all(v == sum(range(p))):
        bad.append(f"another shape after the repeats: {v[:2]}")
    tr.barrier(name="meet.sync")
    # every client's 200 ops and one barrier were run at the meeting (the others' too)
    got = ran() - before
    if got < 201:
        bad.append(f"the meeting ran {got} ops of 201")
    if made[0] > 5:  # (a repeat whose peer came late past its compiled call's first try)
        bad.append(f"{made[0]} handles made for 200 blocking repeats")
    # plain arrays (staged) and broadcasts from every root, async and blocking
    for root in range(p):
        v = np.arange(300, dtype=np.int64) * (rank + 1)
        got_bc = tr.broadcast_async(v, root=root, name="meet.bc", out=v).wait()
        if not np.array_equal(got_bc, np.arange(300) * (root + 1)):
            bad.append(f"broadcast from {root}: {got_bc[:3]}")
        w = np.full(5, rank + root, np.float64)
        if not np.all(tr.allreduce(w, name="meet.plain") == sum(r + root for r in range(p))):
            bad.append("a plain array")
    report(rank, "MEET-ROUTE", not bad, "; ".join(bad[:3]))


def mode_kinds(p: int, rank: int) -> None:
    """Reduce-scatter, all-gather and ops over groups on the thin path (no engine)."""
    svc = tr.default_service()
    data = [np.arange(10, dtype=np.int64) * (r + 1) - r for r in range(p)]
    total = sum(data)

    # reduce-scatter: balanced parts of 10 over p, given parts, avg, a partition's axis
    bad = []
    got = tr.reduce_scatter(data[rank], name="rs")
    at = [0, *np.cumsum([len(a) for a in np.array_split(total, p)])]
    if not np.array_equal(got, total[at[rank] : at[rank + 1]]):
        bad.append(f"balanced {got}")
    parts = [4, 0, 5, 1][:p] if p == 4 else [10] + [0] * (p - 1)
    got = tr.reduce_scatter(data[rank], name="rs.counts", counts=parts)
    lo = sum(parts[:rank])
    if not np.array_equal(got, total[lo : lo + parts[rank]]):
        bad.append(f"counts {got}")
    got = tr.reduce_scatter(np.full(8, rank * 4.0), name="rs.avg", op="avg")
    if not np.allclose(got, np.full(8 // p, 2.0 * (p - 1))):
        bad.append(f"avg {got}")
    if p == 4:
        part = tr.Partition((2, 2))
        x = np.arange(2 * 6, dtype=np.float64).reshape(2, 6) + rank
        got = tr.reduce_scatter(x, name="rs.part", partition=part, axes=(1,))
        mates = part.axis_group(rank, 1).ranks
        col = part.coords_of(rank)[1]  # type: ignore[index]
        want = sum(np.arange(12.0).reshape(2, 6) + q for q in mates)[:, 3 * col : 3 * col + 3]
        if not np.array_equal(got, want):
            bad.append(f"partition {got.shape} {got}")
    report(rank, "REDUCE-SCATTER", not bad, "; ".join(bad))

    # all-gather: uneven parts, unknown (gathered first) and given
    bad = []
    sizes = [(r * 3) % 5 + 1 for r in range(p)]
    mine = np.full(sizes[rank], rank, dtype=np.int32)
    want = np.concatenate([np.full(sizes[r], r, dtype=np.int32) for r in range(p)])
    got = tr.allgather(mine, name="ag")
    if not np.array_equal(got, want):
        bad.append(f"unknown {got}")
    got = tr.allgather(mine, name="ag.counts", counts=sizes)
    if not np.array_equal(got, want):
        bad.append(f"counts {got}")
    hs = [tr.allgather_async(mine + k, name=f"ag.many.{k}") for k in range(50)]
    bad += [f"many {k}" for k, h in enumerate(hs) if not np.array_equal(h.wait(), want + k)]
    report(rank, "ALLGATHER", not bad, "; ".join(bad))

    # groups: two pairs that share a name, each across the nodes; broadcast and a barrier
    bad = []
    g = tr.Group([0, p - 1]) if rank in (0, p - 1) else tr.Group([1, 2])
    if p == 4 or rank in g.ranks:
        got = tr.allreduce(data[rank], name="pair", group=g)
        if not np.array_equal(got, data[g.ranks[0]] + data[g.ranks[1]]):
            bad.append(f"pair {got}")
        got = tr.broadcast(data[rank], root=1, name="pair.bc", group=g)
        if not np.array_equal(got, data[g.ranks[1]]):
            bad.append(f"broadcast {got}")
        tr.barrier(group=g)
        got = tr.allgather(np.array([rank]), name="pair.ag", group=g)
        if not np.array_equal(got, np.array(g.ranks)):
            bad.append(f"all-gather {got}")
    report(rank, "GROUPS", not bad, "; ".join(bad))

    # all-to-all with uneven splits; neighbor ops as all-to-alls
    bad = []
    m = [[(a * 3 + b) % 4 for b in range(p)] for a in range(p)]  # what a sends b
    x = np.arange(sum(m[rank]), dtype=np.int64) + 100 * rank
    got = tr.alltoall(x, name="a2a", splits=m[rank], recv_splits=[row[rank] for row in m])
    want = np.concatenate(
        [(np.arange(sum(m[a]), dtype=np.int64) + 100 * a)[sum(m[a][:rank]) :][: m[a][rank]]
         for a in range(p)]
    )  # fmt: skip
    if not np.array_equal(got, want):
        bad.append(f"alltoall {got} != {want}")
    v = np.full(6, float(rank + 1))
    for step in range(3):  # exponential-2 (the default): weights from the topology
        from totalreduce.service.weights import neighbor_weights

        sw, src, _ = neighbor_weights(rank, p, None, step, None, None, None)
        want_v = sw * v + sum(w * (s + 1) for s, w in src.items())
        got = tr.neighbor_allreduce(v, name="nar", step=step)
        if not np.allclose(got, want_v):
            bad.append(f"neighbor_allreduce step {step}: {got} != {want_v}")
    ring = {(rank - 1) % p: 0.25, (rank + 1) % p: 0.25} if p > 2 else {(rank + 1) % p: 0.5}
    dst = {r: 2.0 for r in ring}  # every sender doubles what it sends
    got = tr.neighbor_allreduce(v, name="dyn", self_weight=0.5, src_weights=ring, dst_weights=dst)
    want_v = 0.5 * v + sum(w * 2.0 * (s + 1) for s, w in ring.items())
    if not np.allclose(got, want_v):
        bad.append(f"dynamic weights {got} != {want_v}")
    got = tr.neighbor_allgather(np.full((2, 3), rank), name="nag", src_ranks=sorted(ring),
                                dst_ranks=sorted(ring))  # fmt: skip
    if got.shape != (len(ring), 2, 3) or not all(
        np.all(got[i] == s) for i, s in enumerate(sorted(ring))
    ):
        bad.append(f"neighbor_allgather {got}")  # fmt: skip
    from totalreduce.service.weights import resolve_topology

    topo = resolve_topology("exp", p)  # Decent-DP's: an edge per step
    for step in range(3):
        edge = topo.edge_of(rank, step)
        k, w = len(edge.ranks), float(edge.weight)
        others = sum(q + 1 for q in edge.ranks if q != rank)
        want_v = v if k == 1 else w * v + (1 - w) / (k - 1) * others
        got = tr.neighbor_allreduce(v, name="edge", topology="exp", step=step)
        if not np.allclose(got, want_v):
            bad.append(f"edge step {step}: {got} != {want_v}")
    if p % 2 == 0:  # node averages, then the machines' topology
        from totalreduce.service.weights import graph_weights

        L = 2
        node = rank // L
        node_avg = [np.mean([q + 1.0 for q in range(m * L, m * L + L)]) for m in range(p // L)]
        machines = resolve_topology("exponential-2", p // L)
        for step in range(2):
            sw, src, _ = graph_weights(machines, node, step)
            want_v = sw * node_avg[node] + sum(w * node_avg[m] for m, w in src.items())
            got = tr.hierarchical_neighbor_allreduce(v, name="hier", local_size=L, step=step)
            if not np.allclose(got, want_v):
                bad.append(f"hierarchical step {step}: {got} != {want_v}")
    report(rank, "NEIGHBORS", not bad, "; ".join(bad))

    # rooted ops and messages: reduce, gather, scatter, send/recv
    bad = []
    root = p - 1
    x = np.arange(5, dtype=np.float64) + rank
    got = tr.reduce(x, root=root, name="red", op="max")
    if (got is None) != (rank != root) or (
        rank == root and not np.array_equal(got, x + root - rank)
    ):
        bad.append(f"reduce {got}")
    got = tr.gather(x, root=0, name="gat")
    want = np.stack([np.arange(5.0) + r for r in range(p)])
    if (rank == 0 and not np.array_equal(got, want)) or (rank != 0 and got is not None):
        bad.append(f"gather {got}")
    part = np.empty(3, dtype=np.int32)
    src = np.arange(3 * p, dtype=np.int32).reshape(p, 3) * 10 if rank == 1 else part
    got = tr.scatter(src, root=1, name="sca")
    if not np.array_equal(got, np.arange(3, dtype=np.int32) * 10 + 30 * rank):
        bad.append(f"scatter {got}")
    peer = (rank + 1) % p if rank % 2 == 0 else (rank - 1) % p
    hs = tr.send_async(np.full(4, rank, np.int16), dst=peer, tag=7)
    buf = np.empty(4, np.int16)
    got = tr.recv(buf, src=peer, tag=7)
    hs.wait()
    if not np.all(got == peer):
        bad.append(f"send/recv {got}")
    report(rank, "ROOTED", not bad, "; ".join(bad))

    # an algorithm named: the services run it among the nodes (still no engine here)
    bad = []
    for algo in ("ring", "ring_chunked", "recursive_doubling"):
        got = tr.allreduce(np.full(7, rank + 1.0), name=f"named.{algo}", algorithm=algo)
        if not np.array_equal(got, np.full(7, p * (p + 1) / 2)):
            bad.append(f"{algo}: {got}")
    for algo in ("one_to_all", "pipelined"):
        got = tr.broadcast(np.full(3, rank), root=p - 1, name=f"named.{algo}", algorithm=algo)
        if not np.array_equal(got, np.full(3, p - 1)):
            bad.append(f"{algo}: {got}")
    tr.barrier(algorithm="all_to_one")
    try:
        tr.allreduce(np.ones(2), name="named.bad", algorithm="no_such")
        bad.append("an unknown algorithm was taken")
    except tr.InvalidArgumentError:
        pass
    report(rank, "NAMED-ALGORITHM", not bad, "; ".join(bad))
    # windows: their standing receives wait at the services, messages are thin ops
    from totalreduce.topology import get_topology, plan

    ins = [sorted(plan(get_topology("ring", p), r, 0).src_weights) for r in range(p)]
    vals = [float(r + 1) for r in range(p)]
    x = np.full(7, vals[rank])
    tr.win_create(x, "tw", topology="ring")
    bad = []
    for step in ("put", "get"):
        if step == "put":
            tr.win_put(x, "tw")
        else:
            tr.win_get("tw")  # the in-neighbours' arrays as they are now
        tr.barrier(name=f"tw.{step}")
        tr.win_update("tw")
        vals = [(vals[r] + sum(vals[q] for q in ins[r])) / (len(ins[r]) + 1) for r in range(p)]
        if not np.allclose(x, vals[rank]):
            bad.append(f"after {step}: {x} != {vals[rank]}")
        tr.barrier(name=f"tw.{step}.read")
    tr.win_free("tw")
    report(rank, "WINDOWS", not bad, "; ".join(bad))
    report(rank, "STILL-NO-ENGINE", svc._loop is None, "an engine started")


def mode_pressure(p: int, rank: int) -> None:
    thin = tr.default_service()._thin
    assert thin is not None
    half = thin.arena.data_bytes // 2
    # larger than half a client's part: in pieces on the thin path, same result
    n = half // 8 + 1000
    got = tr.allreduce(np.full(n, rank + 1, np.int64), name="big")
    ok = bool(np.all(got == p * (p + 1) // 2))
    x = np.arange(n, dtype=np.int64) * (rank + 1)  # every element its own value
    got = tr.allreduce(x, name="big.values", op="max")
    ok &= np.array_equal(got, np.arange(n, dtype=np.int64) * p)
    inside = tr.empty(n, np.float64)  # in the arena: its pieces are views, no staging
    inside[:] = rank + 1
    tr.allreduce(inside, name="big.avg", out=inside, op="avg")
    ok &= bool(np.all(inside == (p + 1) / 2))
    del inside  # its half of the part back: large sends and receives need room below
    got = tr.broadcast(np.arange(n, dtype=np.int32) + rank, root=p - 1, name="big.bc")
    ok &= np.array_equal(got, np.arange(n, dtype=np.int32) + p - 1)
    got = tr.reduce(np.full(n, rank + 1, np.int64), root=0, name="big.reduce")
    ok &= rank != 0 or bool(np.all(got == p * (p + 1) // 2))
    report(rank, "LARGE", ok, "a large op's result is wrong")
    # reduce-scatter and all-gather too large for the arena (the all-gather's sizes
    # gathered first), in pieces, exact
    part = half // 8 // p + 1000
    got = tr.reduce_scatter(np.full(part * p, rank + 1, np.int64), name="big.rs")
    ok = got.size == part and bool(np.all(got == p * (p + 1) // 2))
    counts = [part + 7 * r for r in range(p)]  # uneven: each part cut its own way
    x = np.concatenate([np.arange(c, dtype=np.int64) * (rank + 1) for c in counts])
    got = tr.reduce_scatter(x, name="big.rs.counts", counts=counts)
    ok &= np.array_equal(got, np.arange(counts[rank], dtype=np.int64) * p * (p + 1) // 2)
    from totalreduce.transport import meeting as M

    st = tr.default_service()._thin.st
    for i, given in enumerate((None, counts, None)):  # (the third: a repeat, data in pieces)
        mine = np.arange(counts[rank], dtype=np.int64) + 1000 * rank
        calls = int(st[M.ST_CALLS])
        got = tr.allgather(mine, name="big.ag", counts=given)
        want = np.concatenate([np.arange(c, dtype=np.int64) + 1000 * r
                               for r, c in enumerate(counts)])  # fmt: skip
        ok &= np.array_equal(got, want)
        if i == 2:  # too large for one op: no record, the whole way's pieces again
            ok &= int(st[M.ST_CALLS]) == calls
    report(rank, "LARGE-PARTS", ok, str(got[:3]))
    # all-to-alls that large, and what is built on them: in pieces too, exact
    bad = []
    each = half // 8 // p + 1000
    x = np.arange(each * p, dtype=np.int64) + 10**6 * rank
    got = tr.alltoall(x, name="big.a2a")
    want = np.concatenate([np.arange(each * rank, each * (rank + 1)) + 10**6 * q for q in range(p)])
    if not np.array_equal(got, want):
        bad.append("alltoall")
    got = tr.gather(np.full(each, rank, np.int64), root=0, name="big.gather")
    if rank == 0 and not np.array_equal(got.reshape(-1), np.repeat(np.arange(p), each)):
        bad.append("gather")
    src = (
        np.repeat(np.arange(p, dtype=np.int64), each) if rank == p - 1 else np.empty(each, np.int64)
    )
    got = tr.scatter(src, root=p - 1, name="big.scatter")
    if not np.all(got == rank):
        bad.append("scatter")
    n = half // 8 + 1000
    peer = rank ^ 1 if (rank ^ 1) < p else rank
    if peer != rank:
        hs = tr.send_async(np.arange(n, dtype=np.int64) + rank, dst=peer, tag=3)
        got = tr.recv(np.empty(n, np.int64), src=peer, tag=3)
        hs.wait()
        if not np.array_equal(got, np.arange(n, dtype=np.int64) + peer):
            bad.append("send/recv")
    got = tr.neighbor_allgather(np.full(n // p, rank, np.int64), name="big.nag")
    if got.size == 0:
        bad.append("neighbor_allgather")
    report(rank, "LARGE-ALLTOALL", not bad, "; ".join(bad))
    # staged ops that do not all fit at once: the later ones wait for room
    each = thin.arena.data_bytes // 6
    handles = [
        tr.allreduce_async(np.full(each // 8, k + rank, np.int64), name=f"room.{k}")
        for k in range(24)
    ]
    bad = [k for k, h in enumerate(handles) if not np.all(h.wait() == p * k + p * (p - 1) // 2)]
    report(rank, "BACKPRESSURE", not bad, str(bad))
    # a rank whose op is cut and one whose is not (their counts differ): the first piece
    # meets the other's op, and both fail naming their counts; the name goes on
    n = half // 8 + 1000 if rank == 0 else 1000
    try:
        tr.allreduce(np.ones(n, np.int64), name="big.mm")
        report(rank, "MISMATCH-PIECES", False, "no error")
    except tr.OpMismatchError as exc:
        report(rank, "MISMATCH-PIECES", "count 1000" in str(exc), str(exc))
    got = tr.allreduce(np.ones(5, np.int64), name="big.mm")
    report(rank, "AFTER-PIECES", bool(np.all(got == p)), str(got))
    # a window larger than a client's whole part of the arena: its data messages travel as
    # pieces (window_parts.THIN_MESSAGE_BYTES each) on the thin path, its standing receives stay
    # small and passive, and the result is exact
    from totalreduce.topology import get_topology, plan

    n = thin.arena.data_bytes // 8 + 1000
    x = np.full(n, float(rank + 1))
    x[::7] = -rank  # not one value: a piece out of place would show
    tr.win_create(x, "big.win", topology="ring")
    waiting = thin.in_flight()
    standing = bool(waiting) and all(h.passive for h in waiting)
    bad = []
    ins = sorted(plan(get_topology("ring", p), rank, 0).src_weights)
    windows = tr.default_service().windows
    if not windows.window("big.win", "check").pieced:
        bad.append("not pieced")

    def value(r: int) -> np.ndarray:
        v = np.full(n, float(r + 1))
        v[::7] = -r
        return v

    def landed(count: int) -> None:
        # (a put completes before the target's service has written it: see docs/daemon.md)
        deadline = time.monotonic() + 60
        while min(tr.get_win_version("big.win").values()) < count:
            if time.monotonic() > deadline:
                raise RuntimeError(f"versions {tr.get_win_version('big.win')} after 60 s")
            time.sleep(0.001)

    tr.win_put(x, "big.win")
    tr.barrier(name="big.win.put")
    landed(1)
    tr.win_update("big.win")
    want = (value(rank) + sum(value(r) for r in ins)) / (len(ins) + 1)
    if not np.array_equal(x, want):
        bad.append(f"put/update {x[:8]} != {want[:8]}")
    tr.barrier(name="big.win.read")
    x[:] = value(rank)
    tr.win_accumulate(x, "big.win")
    tr.win_accumulate(x, "big.win")
    tr.barrier(name="big.win.acc")
    landed(2)
    for r in ins:  # the put's value(r), then two accumulates of it
        if not np.array_equal(windows.slot("big.win", r), 3 * value(r)):
            bad.append(f"accumulate from {r}")
    tr.barrier(name="big.win.acc.read")
    tr.win_get("big.win")  # the in-neighbours' arrays, now value(r): the reply is pieced too
    for r in ins:
        if not np.array_equal(windows.slot("big.win", r), value(r)):
            bad.append(f"get from {r}")
    tr.barrier(name="big.win.get")
    tr.win_free("big.win")
    report(rank, "LARGE-WINDOW", standing and not bad, f"{bad}, standing receives {waiting}")
    report(rank, "LARGE-NO-ENGINE", tr.default_service()._loop is None, "an engine started")


def mode_garbage(p: int, rank: int) -> None:
    """Descriptors no honest client writes: each fails with InvalidArgumentError, alone."""
    from totalreduce.algorithms.codes import OpKind
    from totalreduce.dtypes import DType
    from totalreduce.service.thin import ThinHandle
    from totalreduce.transport import arena as A

    thin = tr.default_service()._thin
    assert thin is not None
    mine = thin.arena.data_start(thin.slot)

    def raw(fields: dict[int, int]) -> ThinHandle:
        h = ThinHandle(thin, "garbage", 0, OpKind.ALLREDUCE, None, lambda: None)
        d = np.zeros(A.D_WORDS, np.int64)
        d[A.D_KIND], d[A.D_DTYPE], d[A.D_COUNT] = int(OpKind.ALLREDUCE), int(DType.FLOAT32), 4
        d[A.D_OP], d[A.D_IN], d[A.D_OUT], d[A.D_WIRE] = 1, mine, mine, 1000 + rank
        for k, v in fields.items():
            d[k] = v
        # (the client's own way into the ring: the ticket, the position, the service woken)
        return thin._ring(h, d, int(d[A.D_PRIO]), int(d[A.D_IN]), int(d[A.D_OUT]))

    cases = {
        "kind": ({A.D_KIND: 99}, "kind 99"),
        "dtype": ({A.D_DTYPE: 77}, "dtype 77"),
        "count": ({A.D_COUNT: -5}, "count -5"),
        "root": ({A.D_KIND: int(OpKind.BROADCAST), A.D_ROOT: 1 << 40}, "root"),
        "place": ({A.D_IN: 0, A.D_OUT: 0, A.D_WIRE: 2000 + rank}, "outside its part"),
    }
    for what, (fields, words) in cases.items():
        try:
            raw(fields).wait(30)
            report(rank, f"GARBAGE-{what}", False, "no error")
        except tr.InvalidArgumentError as exc:
            report(rank, f"GARBAGE-{what}", words in str(exc), str(exc))
    got = tr.allreduce(np.full(3, rank + 1, np.int64), name="after.garbage")
    report(rank, "GARBAGE-AFTER", bool(np.all(got == p * (p + 1) // 2)), str(got))


def mode_loop(p: int, rank: int) -> None:
    """Repeats among the nodes in the service's compiled loop (daemon/service_loop.py):
    exact results of sum, max and avg in float16, float32, float64, int32 and int64 of
    sizes from one element to one the lane cuts into segments; each repeat counted by the
    node's service (``H_LOOP_ENTERED``)."""
    from totalreduce.transport import arena as A

    header = tr.default_service()._thin.header
    expect_on = os.environ.get("TOTALREDUCE_SERVICE_LOOP", "1") != "0"

    def ran() -> tuple[int, int]:
        return int(header[A.H_LOOP_ENTERED]), int(header[A.H_LOOP_RAN])

    bad: list[str] = []
    repeats = 40
    counted = [0, 0]
    kinds = (np.float16, np.float32, np.float64, np.int32, np.int64)
    for dt in kinds:
        for n in (1, 1000, 300_000):
            x = tr.empty(n, dt)
            ramp = (np.arange(n) % 7).astype(dt)
            name = f"loop.{np.dtype(dt).name}.{n}"
            for op in ("sum", "max", "avg"):
                for i in range(3 + repeats):  # the first occurrences go through Python
                    if i == 3:
                        tr.barrier(name="loop.sync")
                        before = ran()
                    x[:] = ramp + (rank + i) % 5
                    tr.allreduce(x, name=f"{name}.{op}", op=op, out=x)
                    parts = [(ramp + (r + i) % 5).astype(np.int64) for r in range(p)]
                    if op == "max":
                        want = np.maximum.reduce(parts)
                    elif op == "sum":
                        want = sum(parts)
                    elif np.dtype(dt).kind == "i":  # avg: floor division on integers
                        want = sum(parts) // p
                    else:  # (p is 2 or 4: exact in binary floating point)
                        want = sum(parts) / p
                    if not np.array_equal(x, want.astype(dt)):
                        bad.append(f"{name} {op} call {i}: {x[:3]} != {want[:3]}")
                tr.barrier(name="loop.sync")
                now = ran()
                got = now[0] - before[0]
                counted[0] += got
                counted[1] += now[1] - before[1]
                # (a repeat takes Python's way while the services' engine has work for its
                # Python at that moment: its stall look, an op of a peer)
                if expect_on and got < repeats - 2:
                    bad.append(f"{name} {op}: the compiled loop took {got} of {repeats} repeats")
                if not expect_on and got:
                    bad.append(f"{name} {op}: the loop is off, yet it took {got} repeats")
    cases = len(kinds) * 3 * 3
    print(f"rank {rank}: the compiled loop took {counted[0]} of {cases * repeats} repeats, and "
          f"ran {counted[1]} of them to their end", flush=True)  # fmt: skip
    report(rank, "LOOP-EXACT-ROUTE", not bad, "; ".join(bad[:3]))


def mode_ring(p: int, rank: int) -> None:
    """Several nodes: a blocking repeat is one compiled call (transport/ring_call.py)."""
    from totalreduce.service import express
    from totalreduce.service import thin as thin_mod
    from totalreduce.transport import meeting as M

    thin = tr.default_service()._thin
    assert thin is not None and not thin.meet_world, "several nodes: the world's ops never meet"
    made = [0]
    real_init = thin_mod.ThinHandle.__init__

    def counting(self: Any, *args: Any, **kw: Any) -> None:
        made[0] += 1
        real_init(self, *args, **kw)

    thin_mod.ThinHandle.__init__ = counting  # type: ignore[method-assign]
    bad: list[str] = []
    repeats = 8
    for dt in (np.float16, np.float32, np.float64, np.int32, np.int64):
        for n in (1, 1000, 70_000) if dt is np.float64 else (1, 1000):  # (70,000: > 256 KiB)
            x, y = tr.empty(n, dt), tr.empty(n, dt)
            ramp = (np.arange(n) % 7).astype(dt)
            for form in ("in", "out", "new"):  # (new: out None, the result staged)
                name = f"ring.{np.dtype(dt).name}.{n}.{form}"
                for i in range(2 + repeats):
                    if i == 2:
                        ran, handles = int(thin.st[M.ST_CALLS]), made[0]
                    x[:] = ramp + (rank + i) % 5
                    y[:] = -1
                    into = {"in": x, "out": y, "new": None}[form]
                    got = tr.allreduce(x, name=name, out=into)
                    want = sum((ramp + (r + i) % 5).astype(np.int64) for r in range(p))
                    res = got if into is None else into
                    want = want.astype(dt)
                    if not (np.array_equal(res, want) and np.array_equal(got, want)):
                        bad.append(f"{name} call {i}: {res[:3]} != {want[:3]}")
                    if form == "new" and (got.dtype != dt or got.shape != x.shape):
                        bad.append(f"{name} call {i}: {got.dtype} {got.shape}")
                    if form != "in" and not np.array_equal(x, ramp + (rank + i) % 5):
                        bad.append(f"{name} call {i}: the input changed")
                took = int(thin.st[M.ST_CALLS]) - ran
                # (a repeat whose peer was late past 50 ms waits on in compiled calls
                # between Python's looks at the socket: still no handle)
                if made[0] != handles or took != repeats:
                    bad.append(f"{name}: {took} of {repeats} repeats in a compiled call, "
                               f"{made[0] - handles} handles made")  # fmt: skip
    # a named barrier's repeats: a compiled call each, and none returns before every
    # rank entered it (the last rank comes late)
    for i in range(2 + repeats):
        if i == 2:
            ran, handles = int(thin.st[M.ST_CALLS]), made[0]
        late = i in (3, 2 + repeats - 1)
        if late and rank == p - 1:
            time.sleep(0.3)
        t0 = time.monotonic()
        tr.barrier(name="ring.barrier")
        if late and rank != p - 1 and time.monotonic() - t0 < 0.25:
            bad.append(f"barrier call {i}: back after {time.monotonic() - t0:.3f} s")
    took = int(thin.st[M.ST_CALLS]) - ran
    if made[0] != handles or took != repeats:
        bad.append(f"barrier: {took} of {repeats} repeats in a compiled call, "
                   f"{made[0] - handles} handles made")  # fmt: skip
    # a broadcast's repeats in place on an array of the arena, from the first rank and the
    # last: a compiled call each
    for dt in (np.float32, np.float64, np.int32, np.int64):
        ramp = (np.arange(1000) % 7).astype(dt)
        x = tr.empty(1000, dt)
        for root in sorted({0, p - 1}):
            name = f"ring.bc.{np.dtype(dt).name}.{root}"
            for i in range(2 + repeats):
                if i == 2:
                    ran, handles = int(thin.st[M.ST_CALLS]), made[0]
                x[:] = ramp + rank + i
                got = tr.broadcast(x, root=root, name=name, out=x)
                if not (np.array_equal(x, ramp + root + i) and np.array_equal(got, x)):
                    bad.append(f"{name} call {i}: {x[:3]} != {(ramp + root + i)[:3]}")
            took = int(thin.st[M.ST_CALLS]) - ran
            if made[0] != handles or took != repeats:
                bad.append(f"{name}: {took} of {repeats} repeats in a compiled call, "
                           f"{made[0] - handles} handles made")  # fmt: skip
    thin_mod.ThinHandle.__init__ = real_init  # type: ignore[method-assign]
    # the names are in flight no more: another shape of one is an op like any
    v = tr.allreduce(np.full(7, rank, np.int64), name="ring.float32.1000.in")
    if not np.all(v == sum(range(p))):
        bad.append(f"another shape after the repeats: {v[:2]}")
    report(rank, "RING-EXACT-ROUTE", not bad, "; ".join(bad[:3]))

    # async forms and first occurrences keep their handles
    bad = []
    x = tr.empty(100, np.float32)
    for i in range(3):
        x[:] = rank + i
        h = tr.allreduce_async(x, name="ring.async", out=x)
        if h.__class__ is not thin_mod.ThinHandle or h.generation != i:
            bad.append(f"async {i}: {h!r}")
        h.wait()
        if not np.all(x == sum(r + i for r in range(p))):
            bad.append(f"async {i}: {x[:2]}")
    # a handle's wait(timeout=) in the compiled wait: rank 0 waits for a late rank 1
    tr.barrier(name="ring.sync")
    x[:] = 1
    if rank == 0:
        h = tr.allreduce_async(x, name="ring.async", out=x)
        t0 = time.monotonic()
        try:
            h.wait(timeout=0.3)
            bad.append("no timeout")
        except tr.OpTimeoutError as exc:
            took_s = time.monotonic() - t0
            if not 0.25 <= took_s < 5 or "did not complete within 0.3 s" not in str(exc):
                bad.append(f"timeout after {took_s:.2f} s: {exc}")
        h.wait()
    else:
        time.sleep(0.6)
        tr.allreduce_async(x, name="ring.async", out=x).wait()
    if not np.all(x == p):
        bad.append(f"after the timeout: {x[:2]}")
    report(rank, "RING-ASYNC-TIMEOUT", not bad, "; ".join(bad[:3]))

    # a repeat whose count another node changed: the error of the Python path
    texts = {}
    real_now = express.thin_now
    routes = [f"{r}-{form}" for form in ("in", "new", "bc") for r in ("compiled", "python")]
    for route in routes:
        express.thin_now = real_now if route.startswith("compiled") else lambda *a: None
        form = route.split("-")[1]  # (new: out None, the result staged; bc: a broadcast)

        def call(a: np.ndarray, form: str = form, name: str = f"ring.bad.{route}") -> None:
            if form == "bc":
                tr.broadcast(a, root=0, name=name, out=a)
            else:
                tr.allreduce(a, name=name, out=None if form == "new" else a)

        name = f"ring.bad.{route}"
        x = tr.empty(16, np.float32)
        call(x)
        call(x)
        v = x if rank < p - 1 else tr.empty(12, np.float32)  # the last rank's count differs
        try:
            call(v)
            texts[route] = "no error"
        except tr.TotalReduceError as exc:  # (the nodes in the order a service heard them)
            head, _, why = str(exc).replace(name, "NAME").partition(": node ")
            texts[route] = f"{type(exc).__name__}: {head}: {sorted(why.split(', node '))}"
        tr.barrier(name="ring.sync")
    express.thin_now = real_now
    ok = all(
        texts[f"compiled-{form}"] == texts[f"python-{form}"]
        and "OpMismatchError" in texts[f"compiled-{form}"]
        for form in ("in", "new", "bc")
    )
    report(rank, "RING-MISMATCH", ok, repr(texts))


def mode_ring_kinds(p: int, rank: int) -> None:
    """Blocking repeats of reduce-scatters, all-gathers and broadcasts into another array:
    one compiled call each (service/express.py: ``thin_parted_now``)."""
    from totalreduce.service import express
    from totalreduce.service import thin as thin_mod
    from totalreduce.transport import meeting as M

    thin = tr.default_service()._thin
    made = [0]
    real_init = thin_mod.ThinHandle.__init__

    def counting(self: Any, *args: Any, **kw: Any) -> None:
        made[0] += 1
        real_init(self, *args, **kw)

    thin_mod.ThinHandle.__init__ = counting  # type: ignore[method-assign]
    bad: list[str] = []
    repeats = 6
    n = 1000
    ag_counts = tuple(r + 2 for r in range(p))  # every rank's part its own size
    rs_counts = (*(1 for _ in range(p - 1)), n - (p - 1))  # uneven parts, given
    # a broadcast into another array goes into the ring only where the node's clients do
    # not meet in the arena (on one node they meet there, in one compiled call of theirs)
    bco_ring = not thin.meet_world

    def call(form: str, dt: Any, i: int, name: str) -> tuple[np.ndarray, np.ndarray]:
        ramp = (np.arange(n) % 7).astype(dt)
        if form in ("rs", "rs-counts"):
            x = ramp + (rank + i) % 5
            counts = rs_counts if form == "rs-counts" else None
            total = sum(ramp + (r + i) % 5 for r in range(p)).astype(dt)
            parts = counts or tuple(c for _, c in balanced_parts(n, p))
            at = sum(parts[:rank])
            got = tr.reduce_scatter(x, name=name, counts=counts)
            return got, total[at : at + parts[rank]]
        if form == "ag":
            x = (np.arange(ag_counts[rank]) + 10 * rank + i).astype(dt)
            got = tr.allgather(x, name=name, counts=list(ag_counts))
            want = np.concatenate([np.arange(c) + 10 * r + i for r, c in enumerate(ag_counts)])
            return got, want.astype(dt)
        root = p - 1 if form == "bco-last" else 0
        x = ramp + rank + i
        if form == "bco-out":
            y = np.full(n, -1, dt)
            got = tr.broadcast(x, root=root, name=name, out=y)
            if not (np.shares_memory(got, y) and np.array_equal(got, y)):
                bad.append(f"{name} call {i}: the result is not out's")
        else:
            got = tr.broadcast(x, root=root, name=name)
        if not np.array_equal(x, ramp + rank + i):
            bad.append(f"{name} call {i}: the input changed")
        return got, (ramp + root + i).astype(dt)

    forms = ("rs", "rs-counts", "ag", "bco", "bco-last", "bco-out")
    for dt in (np.float32, np.int64):
        for form in forms:
            name = f"kinds.{form}.{np.dtype(dt).name}"
            for i in range(2 + repeats):
                if i == 2:
                    ran, handles = int(thin.st[M.ST_CALLS]), made[0]
                got, want = call(form, dt, i, name)
                if got.dtype != dt or not np.array_equal(got, want):
                    bad.append(f"{name} call {i}: {got[:3]} != {want[:3]}")
            took, handles = int(thin.st[M.ST_CALLS]) - ran, made[0] - handles
            expect = repeats if bco_ring or not form.startswith("bco") else 0
            # (at the meeting place a peer late past the call's first wait makes a handle)
            if took != expect or handles > (0 if expect else repeats // 2):
                bad.append(f"{name}: {took} of {repeats} repeats in a compiled call "
                           f"({expect} expected), {handles} handles made")  # fmt: skip
    thin_mod.ThinHandle.__init__ = real_init  # type: ignore[method-assign]
    report(rank, "KINDS-EXACT-ROUTE", not bad, "; ".join(bad[:3]))

    # a late rank: the others' one call waits for it past the looks at the socket
    bad = []
    for form in ("rs", "ag", "bco"):
        name = f"kinds.{form}.float32"
        tr.barrier(name="kinds.sync")
        ran = int(thin.st[M.ST_CALLS])
        late = rank == p - 1
        if late:
            time.sleep(0.3)
        t0 = time.monotonic()
        got, want = call(form, np.float32, 2 + repeats, name)
        took_s = time.monotonic() - t0
        if not np.array_equal(got, want):
            bad.append(f"{name} late: {got[:3]} != {want[:3]}")
        if not late and took_s < 0.25:
            bad.append(f"{name}: back after {took_s:.3f} s, before the late rank came")
        if (form != "bco" or bco_ring) and int(thin.st[M.ST_CALLS]) != ran + 1:
            bad.append(f"{name}: the late repeat was not one compiled call")
    report(rank, "KINDS-LATE", not bad, "; ".join(bad[:3]))

    # a repeat whose count another rank changed: the error of the Python path
    texts = {}
    real_now = express.thin_parted_now
    for route in [f"{r}-{form}" for form in ("rs", "ag") for r in ("compiled", "python")]:
        express.thin_parted_now = real_now if route.startswith("compiled") else lambda *a: None
        form = route.split("-")[1]
        name = f"kinds.bad.{route}"
        for i in range(2):
            call(form, np.float32, i, name)
        try:
            if rank < p - 1:
                call(form, np.float32, 2, name)
            elif form == "rs":
                tr.reduce_scatter(np.ones(12, np.float32), name=name)
            else:
                tr.allgather(np.ones(5, np.float32), name=name, counts=[*ag_counts[:-1], 5])
            texts[route] = "no error"
        except tr.TotalReduceError as exc:
            # The ranks come in the order a service heard them, and the service that saw
            # the disagreement first tells its own group in full, the other's by its
            # context: the same facts, whichever it was.
            text = re.sub(
                r"group \[[^\]]*\] \(context (0x[0-9a-f]+)\)", r"group context \1",
                str(exc).replace(name, "NAME"),
            )  # fmt: skip
            parts = sorted(re.split(r"; (?:node )?|, node |: node ", text))
            texts[route] = f"{type(exc).__name__}: {parts}"
        tr.barrier(name="kinds.sync")
    express.thin_parted_now = real_now
    ok = all(
        texts[f"compiled-{form}"] == texts[f"python-{form}"]
        and "OpMismatchError" in texts[f"compiled-{form}"]
        for form in ("rs", "ag")
    )
    report(rank, "KINDS-MISMATCH", ok, repr(texts))


def mode_ring_groups(p: int, rank: int) -> None:
    """Blocking repeats over groups (allreduce, broadcast, barrier, reduce-scatter,
    all-gather), all-gathers without counts (world and groups) and, on one node, the
    world's broadcasts at the meeting place: one compiled call each (an all-gather without
    counts two: its sizes, then its data), with no handle, exact.  A group whose ranks all
    live on this node meets at its meeting place instead of the ring (on any number of
    nodes): no ring call; an allreduce of it into another array or a new one takes the
    whole way there, as the world's does on one node."""
    from totalreduce.service import express
    from totalreduce.service import thin as thin_mod
    from totalreduce.transport import meeting as M

    thin = tr.default_service()._thin
    assert thin is not None
    one_node = thin.meet_world
    slots = thin.arena.slots

    def meets(g: tr.Group | None) -> bool:
        """Whether the group's ops meet at this node's meeting place (all its ranks here)."""
        here = rank // slots
        return thin.meet is not None and g is not None and all(r // slots == here for r in g.ranks)

    made = [0]
    real_init = thin_mod.ThinHandle.__init__

    def counting(self: Any, *args: Any, **kw: Any) -> None:
        made[0] += 1
        real_init(self, *args, **kw)

    groups: list[tuple[str, tr.Group | None]] = [("rev", tr.Group(list(reversed(range(p)))))]
    if p >= 4:  # a pair across the nodes (on two nodes) and one of neighbours
        groups.append(("across", tr.Group(sorted({rank, (rank + p // 2) % p}))))
        groups.append(("pair", tr.Group([rank - rank % 2, rank - rank % 2 + 1])))
    n = 1000

    def call(form: str, g: tr.Group | None, dt: Any, i: int, name: str) -> tuple[Any, Any]:
        members = list(range(p)) if g is None else list(g.ranks)
        me = members.index(rank)
        ramp = (np.arange(n) % 7).astype(dt)

        def val(r: int) -> np.ndarray:
            return (ramp + (r + i) % 5).astype(dt)

        total = sum(val(r).astype(np.int64) for r in members).astype(dt)
        if form in ("ar-in", "ar-out", "ar-new"):
            x = tr.empty(n, dt) if form != "ar-new" else np.empty(n, dt)
            x[:] = val(rank)
            out = {"ar-in": x, "ar-out": tr.empty(n, dt), "ar-new": None}[form]
            got = tr.allreduce(x, name=name, out=out, group=g)
            return (got if out is None else out), total
        if form in ("bc-in", "bc-new"):
            root = len(members) - 1 if form == "bc-in" else 0
            x = tr.empty(n, dt) if form == "bc-in" else np.empty(n, dt)
            x[:] = val(rank)
            got = tr.broadcast(x, root=root, name=name, out=x if form == "bc-in" else None,
                               group=g)  # fmt: skip
            return (x if form == "bc-in" else got), val(members[root])
        if form == "rs":
            parts = [c for _, c in balanced_parts(n, len(members))]
            at = sum(parts[:me])
            got = tr.reduce_scatter(val(rank), name=name, group=g)
            return got, total[at : at + parts[me]]
        if form in ("ag", "agv"):
            sizes = [2 + (r + (i if form == "agv" else 0)) % 3 for r in members]
            x = (np.arange(sizes[me]) + 10 * rank + i).astype(dt)
            counts = sizes if form == "ag" else None
            got = tr.allgather(x, name=name, counts=counts, group=g)
            want = np.concatenate(
                [np.arange(c) + 10 * r + i for r, c in zip(members, sizes, strict=True)]
            )
            return got, want.astype(dt)
        assert form == "bar"
        tr.barrier(name=name, group=g)
        return np.zeros(1), np.zeros(1)

    bad: list[str] = []
    repeats = 5
    cases: list[tuple[str, str, tr.Group | None, int]] = []  # (form, label, group, calls)
    for label, g in groups:
        for form in ("ar-in", "ar-out", "ar-new", "bc-in", "bc-new", "rs", "ag", "bar"):
            calls = 1
            if meets(g) and form not in ("rs", "ag"):  # at the meeting place: no ring call
                # (into another array or a new one: the whole way, as the world's on one node)
                calls = -1 if form in ("ar-out", "ar-new") else 0
            cases.append((form, label, g, calls))
        cases.append(("agv", label, g, 2))
    cases.append(("agv", "world", None, 2))
    if one_node:  # the world's broadcasts meet in the arena: no ring call, no handle
        cases += [("bc-in", "world", None, 0), ("bc-new", "world", None, 0)]
    thin_mod.ThinHandle.__init__ = counting  # type: ignore[method-assign]
    for dt in (np.float32, np.int64):
        for form, label, g, calls in cases:
            name = f"groups.{form}.{label}.{np.dtype(dt).name}"
            for i in range(2 + repeats):
                if i == 2:
                    ran, handles = int(thin.st[M.ST_CALLS]), made[0]
                got, want = call(form, g, dt, i, name)
                if got.dtype != want.dtype or not np.array_equal(got, want):
                    bad.append(f"{name} call {i}: {got[:3]} != {want[:3]}")
            took, handles = int(thin.st[M.ST_CALLS]) - ran, made[0] - handles
            if calls < 0 and took:
                bad.append(f"{name}: {took} ring calls for {repeats} repeats (0 expected)")
            if calls > 0 and (took != calls * repeats or handles):
                bad.append(f"{name}: {took} compiled calls for {repeats} repeats "
                           f"({calls * repeats} expected), {handles} handles made")  # fmt: skip
            if calls == 0 and (took or handles > repeats // 2):  # (a late peer: a handle)
                bad.append(f"{name}: {took} ring calls, {handles} handles for {repeats} repeats")
    thin_mod.ThinHandle.__init__ = real_init  # type: ignore[method-assign]
    # async repeats over a group start from the record (express.thin_start): a handle each
    started = [0]
    real_start = express.thin_start

    def counted(*args: Any) -> Any:
        h = real_start(*args)
        started[0] += h is not None
        return h

    express.thin_start = counted
    for label, g in groups:
        for form in ("in", "new"):
            name = f"groups.async.{form}.{label}"
            before = started[0]
            for i in range(2 + repeats):
                x = tr.empty(n, np.float32) if form == "in" else np.empty(n, np.float32)
                x[:] = np.arange(n) % 7 + rank + i
                h = tr.allreduce_async(x, name=name, out=x if form == "in" else None, group=g)
                got = h.wait()
                want = sum(np.arange(n) % 7 + r + i for r in g.ranks).astype(np.float32)
                if not (np.array_equal(got, want) and (form == "new" or np.shares_memory(got, x))):
                    bad.append(f"{name} call {i}: {got[:3]} != {want[:3]}")
            if started[0] - before != 1 + repeats:  # (the second call has the record too)
                bad.append(f"{name}: {started[0] - before} of {1 + repeats} from the record")
    express.thin_start = real_start
    report(rank, "GROUPS-EXACT-ROUTE", not bad, "; ".join(bad[:3]))

    # a repeat over a group whose count another member changed: the handle's error
    texts = {}
    g = groups[0][1]
    real_now = express.thin_now
    for route in ("compiled", "python"):
        express.thin_now = real_now if route == "compiled" else lambda *a: None
        name = f"groups.bad.{route}"
        x = tr.empty(16, np.float32)
        for _ in range(2):
            tr.allreduce(x, name=name, out=x, group=g)
        v = x if rank < p - 1 else tr.empty(12, np.float32)  # the last rank's count differs
        try:
            tr.allreduce(v, name=name, out=v, group=g)
            texts[route] = "no error"
        except tr.TotalReduceError as exc:
            text = re.sub(
                r"group \[[^\]]*\] \(context (0x[0-9a-f]+)\)", r"group context \1",
                str(exc).replace(name, "NAME"),
            )  # fmt: skip
            parts = sorted(re.split(r"; (?:node )?|, node |: node ", text))
            texts[route] = f"{type(exc).__name__}: {parts}"
        tr.barrier(name="groups.sync")
    express.thin_now = real_now
    ok = texts["compiled"] == texts["python"] and "OpMismatchError" in texts["compiled"]
    report(rank, "GROUPS-MISMATCH", ok, repr(texts))


def mode_dtypes(p: int, rank: int) -> None:
    """Every element type and op of allreduce, on any layout: arrays of the arena in place,
    of 0 elements to past 1 MiB (float32's sum and max, int8's sum), a first call then
    repeats (the compiled route among the nodes, the meeting's on one node), and bfloat16
    bit patterns; every result compared bit for bit (the inputs are small integers: exact
    in every type)."""
    types = {
        "float16": "sum max min", "float32": "sum avg max min product", "float64": "sum avg",
        "int32": "sum avg band bor bxor", "int64": "sum max min product", "uint8": "sum max",
        "int8": "sum min", "int16": "sum bxor", "bool": "sum product max min",
    }  # fmt: skip
    reduce = {
        "sum": np.add, "max": np.maximum, "min": np.minimum, "product": np.multiply,
        "band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor,
    }  # fmt: skip
    bad: list[str] = []
    sizes = [0, 1, 1024, (1 << 20) // 4 + 3]
    for dt, ops in types.items():
        for op in ops.split():
            large = (dt, op) in (("float32", "sum"), ("float32", "max"), ("int8", "sum"))
            for n in sizes if large else sizes[:3]:
                x = tr.empty(n, dt)
                for i in range(3):  # the whole way, then repeats
                    vals = np.stack([(np.arange(n) % 3 + (r + i) % 3).astype(dt) for r in range(p)])
                    if dt == "bool":
                        want = vals.any(axis=0) if op in ("sum", "max") else vals.all(axis=0)
                    elif op == "avg":
                        total = vals.astype(np.int64).sum(axis=0)
                        want = (total // p if dt.startswith("int") else total / p).astype(dt)
                    else:
                        want = reduce[op].reduce(vals.astype(np.int64), axis=0).astype(dt)
                    x[:] = vals[rank]
                    tr.allreduce(x, name=f"dt.{dt}.{op}.{n}", op=op, out=x)
                    if x.tobytes() != want.tobytes():
                        bad.append(f"{dt} {op} {n} call {i}: {x[:3]} != {want[:3]}")
    for n in sizes[:3]:  # bfloat16: float32's upper halves
        name = f"dt.bfloat16.{n}"
        for i in range(3):
            vals = np.stack([(np.arange(n) % 3 + r + i).astype(np.float32) for r in range(p)])
            x = tr.empty(n, np.uint16)
            x[:] = (vals[rank].view(np.uint32) >> 16).astype(np.uint16)
            tr.allreduce(x, name=name, out=x, dtype="bfloat16")
            want = (vals.sum(axis=0).view(np.uint32) >> 16).astype(np.uint16)
            if not np.array_equal(x, want):
                bad.append(f"bfloat16 {n} call {i}: {x[:3]} != {want[:3]}")
    report(rank, "EVERY-DTYPE", not bad, "; ".join(bad[:3]))


def mode_ring_death(p: int, rank: int, kind: str = "allreduce") -> None:
    """Node 0's service killed while its client waits in a compiled call (an allreduce's,
    or with ``kind`` "rs" a reduce-scatter's)."""
    import signal

    from totalreduce.transport import meeting as M

    thin = tr.default_service()._thin
    x = tr.empty(1000, np.float32)

    def op(name: str) -> None:
        if kind == "rs":
            tr.reduce_scatter(x, name=name)
        else:
            tr.allreduce(x, name=name, out=x)

    for _ in range(3):
        op("death")
    if rank == 0:
        threading.Timer(1.0, os.kill, (thin.service_pid, signal.SIGKILL)).start()
    t0 = time.monotonic()
    calls = int(thin.st[M.ST_CALLS])
    try:
        if rank == 0:
            op("death")  # its peers never come
        else:
            op("other")
        report(rank, "RING-DEATH", rank != 0, "no error")
    except tr.TotalReduceError as exc:
        took = time.monotonic() - t0
        one_call = int(thin.st[M.ST_CALLS]) == calls + 1  # (submitted in a compiled call)
        ok = rank != 0 or (isinstance(exc, tr.TransportError) and took < 10 and one_call)
        report(rank, "RING-DEATH", ok, f"after {took:.1f} s: {type(exc).__name__}: {exc}")
    os._exit(0)  # the service is gone: no shutdown to say goodbye to


def main() -> None:
    tr.init()
    modes = {
        "arena": mode_arena,
        "meeting": mode_meeting,
        "kinds": mode_kinds,
        "pressure": mode_pressure,
        "garbage": mode_garbage,
        "loop": mode_loop,
        "ring": mode_ring,
        "ring-death": mode_ring_death,
        "ring-death-rs": lambda p, rank: mode_ring_death(p, rank, "rs"),
        "ring-kinds": mode_ring_kinds,
        "ring-groups": mode_ring_groups,
        "dtypes": mode_dtypes,
    }
    modes[sys.argv[1]](tr.size(), tr.rank())
    tr.shutdown()


if __name__ == "__main__":
    main()

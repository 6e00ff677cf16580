"""A daemon client for tests/daemon/test_loop_kinds.py: the kinds of op among the nodes
whose repeats the node's service runs in its compiled loop (daemon/service_loop.py).

``python loop_kinds_worker.py MODE[,MODE...]`` with the daemon variables set
(``cluster.client_env``); prints ``rank R: NAME OK`` per check, or ``rank R: NAME
FAILED ...``.  With ``TOTALREDUCE_SERVICE_LOOP=0`` in its environment it checks that
the loop ran nothing.

- ``kinds``: repeats of broadcasts from every root (a name per root, and one name whose
  root changes every call), of barriers, of
  reduce-scatters and all-gathers (even and uneven parts; an averaged reduce-scatter),
  exact in float16, float32, float64, int32 and int64 (and a bfloat16 broadcast), and
  counted by the node's service as run in its loop; allreduces over
  a group, exact (Python starts those among the nodes).
- ``segmented`` (several clients a node, a small ``--segment-bytes``): allreduces and
  broadcasts cut into segments among the nodes, exact; Python starts them (the loop
  takes none).
- ``groups``: repeats of allreduces (sum, max, avg), broadcasts and barriers over
  groups: one spanning the nodes with a client on each, one spanning them with several
  clients of a node (their inputs added in group order on the node, then the nodes'), one
  whose members all live on node 0 (node 1 has none); exact in float32, float64 and
  int32 (against that order), counted as run in the loop (a group of one node: by the
  compiled pass or its meeting place), loop on or off; reduce-scatters and all-gathers
  with uneven parts over groups whose ranks lie node after node (in the loop) and one
  that interleaves the nodes (Python's); then the nodes disagree on a group op's count,
  and two clients of a node on another's: every member fails naming the op, its generation and
  the ranks.  Prints a digest of every result (``GROUP-DIGEST``): the same bits with the
  loop on and off.
- ``mismatch``: after repeats of a shape (its row in the loop), the nodes disagree
  about the count of an allreduce, the root of a broadcast and the parts of a
  reduce-scatter: every rank fails with an error naming the op, its generation and the
  ranks; the next op works.
"""

from __future__ import annotations

import hashlib
import os
import sys
from typing import Any

import numpy as np

import totalreduce as tr
from totalreduce import protocol as P
from totalreduce.transport import arena as A
from totalreduce.transport import meeting as M

REPEATS = 20
DTYPES = (np.float16, np.float32, np.float64, np.int32, np.int64)


def report(rank: int, name: str, ok: bool, why: str = "") -> None:
    print(f"rank {rank}: {name} {'OK' if ok else 'FAILED ' + why}", flush=True)


def loop_on() -> bool:
    return os.environ.get("TOTALREDUCE_SERVICE_LOOP", "1") != "0"


def entered() -> int:
    """Ops the node's service entered in its compiled loop so far."""
    return int(tr.default_service()._thin.header[A.H_LOOP_ENTERED])


def routed(bad: list[str], what: str, got: int, repeats: int, expect: bool) -> None:
    """``got`` of ``repeats`` repeats ran in the loop: most of them, or (off, or a kind it
    does not take) none.  (A repeat takes Python's way while the services' engine has work
    for its Python at that moment: its stall look, an op of a peer; the closing barrier
    may count one.)"""
    if expect and got < repeats - 3:
        bad.append(f"{what}: the compiled loop took {got} of {repeats} repeats")
    if not expect and got > 1:
        bad.append(f"{what}: the compiled loop took {got} repeats, expected none")


def value(r: int, i: int, n: int, dt: type) -> np.ndarray:
    return ((np.arange(n) + 3 * r + i) % 11).astype(dt)


def mode_kinds(p: int, rank: int) -> None:
    on = loop_on()
    # broadcasts from every root (a name per root, several sizes), every dtype
    bad: list[str] = []
    for dt in DTYPES:
        for n in (1, 1000):
            x = tr.empty(n, dt)
            for root in range(p):
                name = f"kb.{np.dtype(dt).name}.{n}.{root}"
                before = 0
                for i in range(3 + REPEATS):
                    if i == 3:
                        tr.barrier(name="kinds.sync")
                        before = entered()
                    x[:] = value(rank, i, n, dt)
                    tr.broadcast(x, root=root, name=name, out=x)
                    if not np.array_equal(x, value(root, i, n, dt)):
                        bad.append(f"{name} call {i}: {x[:3]} != {value(root, i, n, dt)[:3]}")
                tr.barrier(name="kinds.sync")
                routed(bad, name, entered() - before, REPEATS, on)
    # one name whose root changes every call: each of its shapes keeps its row, and the
    # name's generations are its shapes' together
    x = tr.empty(256, np.float32)
    warm = 3 * p
    before = 0
    for i in range(warm + 2 * REPEATS):
        if i == warm:
            tr.barrier(name="kinds.sync")
            before = entered()
        x[:] = value(rank, i, 256, np.float32)
        tr.broadcast(x, root=i % p, name="kb.alternating", out=x)
        if not np.array_equal(x, value(i % p, i, 256, np.float32)):
            bad.append(
                f"kb.alternating call {i}: {x[:3]} != {value(i % p, i, 256, np.float32)[:3]}"
            )
    tr.barrier(name="kinds.sync")
    routed(bad, "kb.alternating", entered() - before, 2 * REPEATS, on)
    # bfloat16 (as raw 16-bit words): exact, its repeats in the loop too
    x = tr.empty(64, np.uint16)
    before = 0
    for i in range(3 + REPEATS):
        if i == 3:
            tr.barrier(name="kinds.sync")
            before = entered()
        x[:] = 0x3F80 + rank + i
        tr.broadcast(x, root=p - 1, name="kb.bf16", out=x, dtype="bfloat16")
        if not np.all(x == 0x3F80 + p - 1 + i):
            bad.append(f"kb.bf16 call {i}: {x[:3]}")
    tr.barrier(name="kinds.sync")
    routed(bad, "kb.bf16", entered() - before, REPEATS, on)
    report(rank, "LOOP-BROADCAST", not bad, "; ".join(bad[:3]))

    # barriers: a named one, repeated (every rank leaves after every rank entered)
    bad = []
    tr.barrier(name="kinds.sync")
    before = entered()
    for _ in range(REPEATS):
        tr.barrier(name="kb.barrier")
    routed(bad, "barrier", entered() - before, REPEATS, on)
    report(rank, "LOOP-BARRIER", not bad, "; ".join(bad[:3]))

    # reduce-scatters and all-gathers over the world: their repeats in the loop, exact
    bad = []
    for dt in DTYPES:
        dn = np.dtype(dt).name
        for what, counts in (("even", None), ("uneven", tuple(range(1, p + 1)))):
            n = 4 * p if counts is None else sum(counts)
            tr.barrier(name="kinds.sync")
            before = 0
            for i in range(3 + REPEATS):
                if i == 3:
                    tr.barrier(name="kinds.sync")
                    before = entered()
                got = tr.reduce_scatter(value(rank, i, n, dt), name=f"krs.{dn}.{what}",
                                        counts=counts)  # fmt: skip
                want = sum(value(r, i, n, dt).astype(np.int64) for r in range(p))
                lo = 4 * rank if counts is None else sum(counts[:rank])
                hi = lo + (4 if counts is None else counts[rank])
                if not np.array_equal(got, want[lo:hi].astype(dt)):
                    bad.append(f"reduce_scatter {dn} {what} call {i}: {got} != {want[lo:hi]}")
            tr.barrier(name="kinds.sync")
            routed(bad, f"reduce_scatter {dn} {what}", entered() - before, REPEATS, on)
        for what, sizes in (("even", [5] * p), ("uneven", [r + 1 for r in range(p)])):
            tr.barrier(name="kinds.sync")
            before = 0
            for i in range(3 + REPEATS):
                if i == 3:
                    tr.barrier(name="kinds.sync")
                    before = entered()
                got = tr.allgather(value(rank, i, sizes[rank], dt), name=f"kag.{dn}.{what}")
                want_ag = np.concatenate([value(r, i, sizes[r], dt) for r in range(p)])
                if not np.array_equal(got, want_ag):
                    bad.append(f"allgather {dn} {what} call {i}: {got} != {want_ag}")
            tr.barrier(name="kinds.sync")
            routed(bad, f"allgather {dn} {what}", entered() - before, REPEATS, on)
    x = tr.empty(8 * p, np.float32)
    for i in range(3 + REPEATS):  # averaged, from the arena
        x[:] = value(rank, i, 8 * p, np.float32)
        got = tr.reduce_scatter(x, name="krs.avg", op="avg")
        want = sum(value(r, i, 8 * p, np.float32) for r in range(p)) / p
        if not np.allclose(got, want[8 * rank : 8 * rank + 8], rtol=0, atol=1e-6):
            bad.append(f"reduce_scatter avg call {i}: {got} != {want[8 * rank : 8 * rank + 8]}")
    report(rank, "LOOP-PARTED", not bad, "; ".join(bad[:3]))

    # an allreduce over a group: exact
    bad = []
    tr.barrier(name="kinds.sync")
    before = entered()
    g = tr.Group([0, p - 1]) if rank in (0, p - 1) else tr.Group(list(range(1, p - 1)))
    for dt in DTYPES:
        for i in range(6):
            got = tr.allreduce(value(rank, i, 7, dt), name=f"kg.{np.dtype(dt).name}", group=g)
            want_g = sum(value(r, i, 7, dt).astype(np.int64) for r in g.ranks)
            if not np.array_equal(got, want_g.astype(dt)):
                bad.append(f"group allreduce {dt}: {got} != {want_g}")
    tr.barrier(name="kinds.sync")
    print(f"rank {rank}: of a group's allreduces, the loop took {entered() - before}",
          flush=True)  # fmt: skip
    report(rank, "KINDS-EXACT", not bad, "; ".join(bad[:3]))


GROUP_DTYPES = (np.float32, np.float64, np.int32)


def passed() -> int:
    """Ops over a group of one node that took no Python so far: the node's service's
    compiled pass's (``TOTALREDUCE_MEET_GROUPS=0``) and its meeting place's (where such a
    group meets, on a service of any number of nodes; any op run there counts)."""
    thin = tr.default_service()._thin
    at = int(thin.header[P.AR_H_MEET]) + M.M_RAN
    meeting = int(thin.arena.view(at, 1, np.dtype(np.int64))[0]) if thin.meet is not None else 0
    return int(thin.header[P.AR_H_PASS_GROUP]) + meeting


def group_value(r: int, i: int, n: int, dt: type) -> np.ndarray:
    rng = np.random.default_rng(7919 * r + i)
    if np.dtype(dt).kind == "f":
        return (rng.standard_normal(n) * 1000).astype(dt)
    return rng.integers(-(1 << 20), 1 << 20, n).astype(dt)


def group_sum(ranks: list[int], local: int, i: int, n: int, dt: type) -> np.ndarray:
    """A group's allreduce (sum) as the docs promise it: each node's members' inputs added
    in group order, then the nodes' sums in node order."""
    by_node: dict[int, list[np.ndarray]] = {}
    for r in ranks:
        by_node.setdefault(r // local, []).append(group_value(r, i, n, dt))
    total: np.ndarray | None = None
    for node in sorted(by_node):
        acc = by_node[node][0].copy()
        for x in by_node[node][1:]:
            acc = acc + x
        total = acc if total is None else total + acc
    assert total is not None
    return total


def groups_of(p: int, local: int) -> dict[str, tuple[list[int], bool]]:
    """The groups of ``mode_groups``: name -> (ranks, spans the nodes)."""
    last = p - 1
    gs = {"span": ([last, 0], True), "one": ([local - 1, 0] if local > 1 else [0], False)}
    if local > 1:
        gs["span3"] = ([1, last, 0], True)  # node 0's members: rank 1, then rank 0
    if local > 2:
        gs["order"] = ([2, last, 0, 1, local + 1], True)  # node 0's: 2, 0, 1
    return gs


def mode_groups(p: int, rank: int) -> None:
    on = loop_on()
    local = int(os.environ.get("LOOP_KINDS_LOCAL", "1"))
    digest = hashlib.sha256()
    for gname, (ranks, spans) in groups_of(p, local).items():
        bad: list[str] = []
        g = tr.Group(ranks)
        member = rank in ranks

        for dt in GROUP_DTYPES:
            dn = np.dtype(dt).name
            for n, arena in ((7, False), (1024 if dt is np.float32 else 300, True)):
                tr.barrier(name="groups.sync")
                before = (0, 0)
                x = tr.empty(n, dt) if arena else None
                for i in range(3 + REPEATS):
                    if i == 3:
                        tr.barrier(name="groups.sync")
                        before = (entered(), passed())
                    if not member:
                        continue
                    v = group_value(rank, i, n, dt)
                    if x is not None:
                        x[:] = v
                        got = tr.allreduce(x, name=f"g.{gname}.{dn}.{n}", out=x, group=g)
                    else:
                        got = tr.allreduce(v, name=f"g.{gname}.{dn}.{n}", group=g)
                    want = group_sum(ranks, local, i, n, dt)
                    digest.update(np.ascontiguousarray(got).tobytes())
                    if not np.array_equal(got, want):
                        bad.append(f"{gname} sum {dn} {n} call {i}: {got[:3]} != {want[:3]}")
                tr.barrier(name="groups.sync")
                if member:
                    got_n = entered() - before[0] if spans else passed() - before[1]
                    routed(bad, f"{gname} sum {dn} {n}", got_n, REPEATS, on or not spans)
        tr.barrier(name="groups.sync")
        before = (0, 0)
        # A name's first calls are Python's (a broadcast's roots alternate: a name each),
        # and so are its next ones until one meets no frame of it from a faster node (the
        # engine's express path then gives its lane fields): counted after a warm-up.
        warm = 15
        for i in range(warm + REPEATS):
            if not member:
                continue
            if i == warm:
                before = (entered(), passed())
            got = tr.allreduce(group_value(rank, i, 64, np.float64), name=f"g.{gname}.max",
                               op="max", group=g)  # fmt: skip
            want = np.maximum.reduce([group_value(r, i, 64, np.float64) for r in ranks])
            if not np.array_equal(got, want):
                bad.append(f"{gname} max call {i}")
            got = tr.allreduce(group_value(rank, i, 64, np.float32), name=f"g.{gname}.avg",
                               op="avg", group=g)  # fmt: skip
            want = group_sum(ranks, local, i, 64, np.float32) / len(ranks)
            digest.update(got.tobytes())
            if not np.allclose(got, want, rtol=1e-6, atol=1e-3):
                bad.append(f"{gname} avg call {i}: {got[:3]} != {want[:3]}")
            x = tr.empty(32, np.float32)
            x[:] = group_value(rank, i, 32, np.float32)
            root = i % len(ranks)
            tr.broadcast(x, root=root, name=f"g.{gname}.bc.{root}", out=x, group=g)
            if not np.array_equal(x, group_value(ranks[root], i, 32, np.float32)):
                bad.append(f"{gname} broadcast from {root} call {i}")
            tr.barrier(name=f"g.{gname}.barrier", group=g)
        tr.barrier(name="groups.sync")
        if member:
            got = entered() - before[0] if spans else passed() - before[1]
            # max, avg, the broadcasts and the barrier: in the loop (the pass)
            if (on or not spans) and got < 4 * REPEATS - 6:
                bad.append(f"{gname}: the loop took {got} of {4 * REPEATS} repeats")
            if not (on or not spans) and got > 1:
                bad.append(f"{gname}: the loop took {got} repeats, expected none")
            report(rank, f"GROUP-{gname.upper()}", not bad, "; ".join(bad[:3]))
    mode_group_parts(p, rank, local, on, digest)
    print(f"rank {rank}: GROUP-DIGEST {digest.hexdigest()}", flush=True)

    # mismatches: the nodes disagree on a spanning group's count after repeats
    ranks = [p - 1, 0]
    g = tr.Group(ranks)
    if rank in ranks:
        x = tr.empty(16, np.float32)
        for _ in range(4):
            x[:] = 1
            tr.allreduce(x, name="gm.count", out=x, group=g)
        y = tr.empty(16 if rank == 0 else 12, np.float32)
        y[:] = 1
        try:
            tr.allreduce(y, name="gm.count", out=y, group=g)
            report(rank, "GROUP-MISMATCH-COUNT", False, "no error")
        except tr.TotalReduceError as exc:
            text = str(exc)
            ok = "'gm.count' generation 4" in text and "node 1 (rank" in text and "count 12" in text
            print(f"rank {rank}: the group count's error: {text}", flush=True)
            report(rank, "GROUP-MISMATCH-COUNT", ok, f"{type(exc).__name__}: {text}")
    # two clients of node 0 disagree on a group op's dtype after repeats
    if local > 1 and rank in (0, 1, p - 1):
        g = tr.Group([1, p - 1, 0])
        for _ in range(4):
            tr.allreduce(np.ones(8, np.float32), name="gm.local", group=g)
        dt = np.float64 if rank == 1 else np.float32
        try:
            tr.allreduce(np.ones(8, dt), name="gm.local", group=g)
            report(rank, "GROUP-MISMATCH-LOCAL", False, "no error")
        except tr.TotalReduceError as exc:
            text = str(exc)
            ok = "'gm.local' generation 4" in text and (
                rank == p - 1 or ("rank 1: allreduce, count 8 float64" in text)
            )
            print(f"rank {rank}: the local dtype's error: {text}", flush=True)
            report(rank, "GROUP-MISMATCH-LOCAL", ok, f"{type(exc).__name__}: {text}")
    tr.barrier(name="groups.sync")
    bad = []
    pair = tr.Group([0, p - 1])
    for i in range(5 if rank in pair.ranks else 0):  # the services go on
        got = tr.allreduce(np.full(4, rank + i, np.int64), name="gm.after", group=pair)
        if not np.all(got == (p - 1) + 2 * i):
            bad.append(str(got))
    if rank in pair.ranks:
        report(rank, "GROUP-MISMATCH-AFTER", not bad, "; ".join(bad[:3]))


def mode_group_parts(p: int, rank: int, local: int, on: bool, digest: Any) -> None:
    """Reduce-scatters and all-gathers over groups spanning the nodes, in the loop: where
    the group's ranks lie node after node (``rs2``; ``rs3``, whose node 0 members come in
    the other order than their slots) and where the group's order interleaves the nodes
    (``rsx``: the node's part in node order, an all-gather's result back in group order);
    exact, uneven parts."""
    gs = {"rs2": ([0, p - 1], True), "rsx": ([p - 1, 0], True)}
    if local > 1:
        gs["rs3"] = ([1, 0, p - 1], True)
    for gname, (ranks, looped) in gs.items():
        bad: list[str] = []
        g = tr.Group(ranks)
        member = rank in ranks
        me = ranks.index(rank) if member else -1
        parts = tuple(2 * j + 3 for j in range(len(ranks)))
        n = sum(parts)
        for dt in (np.float32, np.int32):
            dn = np.dtype(dt).name
            for what in ("rs", "ag"):
                tr.barrier(name="groups.sync")
                before = 0
                for i in range(6 + REPEATS):
                    if i == 6:
                        tr.barrier(name="groups.sync")
                        before = entered()
                    if not member:
                        continue
                    if what == "rs":
                        x = group_value(rank, i, n, dt)
                        got = tr.reduce_scatter(x, name=f"gp.{gname}.{dn}", counts=parts, group=g)
                        lo = sum(parts[:me])
                        want = group_sum(ranks, local, i, n, dt)[lo : lo + parts[me]]
                    else:
                        x = group_value(rank, i, parts[me], dt)
                        got = tr.allgather(x, name=f"gpa.{gname}.{dn}", counts=parts, group=g)
                        want = np.concatenate(
                            [group_value(r, i, parts[j], dt) for j, r in enumerate(ranks)]
                        )
                    digest.update(np.ascontiguousarray(got).tobytes())
                    if not np.array_equal(got, want):
                        bad.append(f"{gname} {what} {dn} call {i}: {got[:3]} != {want[:3]}")
                tr.barrier(name="groups.sync")
                if member:
                    routed(bad, f"{gname} {what} {dn}", entered() - before, REPEATS,
                           on and looped)  # fmt: skip
        if member:
            report(rank, f"GROUP-{gname.upper()}", not bad, "; ".join(bad[:3]))


def mode_segmented(p: int, rank: int) -> None:
    bad: list[str] = []
    tr.barrier(name="seg.sync")
    before = entered()
    n = 1 << 17  # the service's --segment-bytes is smaller: every op here is cut
    for dt in DTYPES:
        x = tr.empty(n, dt)
        for i in range(4):
            x[:] = value(rank, i, n, dt)
            tr.allreduce(x, name=f"seg.ar.{np.dtype(dt).name}", op="max", out=x)
            want = np.maximum.reduce([value(r, i, n, dt) for r in range(p)])
            if not np.array_equal(x, want):
                bad.append(f"segmented allreduce {dt} call {i}")
            x[:] = value(rank, i, n, dt)
            tr.broadcast(x, root=i % p, name=f"seg.bc.{np.dtype(dt).name}.{i % p}", out=x)
            if not np.array_equal(x, value(i % p, i, n, dt)):
                bad.append(f"segmented broadcast {dt} call {i}")
    tr.barrier(name="seg.sync")
    routed(bad, "segmented ops", entered() - before, 0, False)
    report(rank, "SEGMENTED", not bad, "; ".join(bad[:3]))


def mode_mismatch(p: int, rank: int) -> None:
    node = int(os.environ["TOTALREDUCE_SOCKET"].rsplit("node", 1)[1].split(".")[0])
    # the count: the nodes disagree on a repeat of a shape the loop has a row of
    x = tr.empty(16, np.float32)
    for _ in range(4):
        x[:] = 1
        tr.allreduce(x, name="mm.count", out=x)
    count = 16 if node == 0 else 12
    y = tr.empty(count, np.float32)
    y[:] = 1
    try:
        tr.allreduce(y, name="mm.count", out=y)
        report(rank, "MISMATCH-COUNT", False, "no error")
    except tr.TotalReduceError as exc:
        text = str(exc)
        ok = "'mm.count' generation 4" in text and "node 1 (rank" in text and "count 12" in text
        print(f"rank {rank}: the count's error: {text}", flush=True)
        report(rank, "MISMATCH-COUNT", ok, f"{type(exc).__name__}: {text}")
    # the root of a broadcast
    z = tr.empty(8, np.int64)
    for _ in range(4):
        z[:] = rank
        tr.broadcast(z, root=0, name="mm.root", out=z)
    try:
        tr.broadcast(z, root=0 if node == 0 else p - 1, name="mm.root", out=z)
        report(rank, "MISMATCH-ROOT", False, "no error")
    except tr.TotalReduceError as exc:
        text = str(exc)
        ok = "'mm.root' generation 4" in text and "node 1 (rank" in text and "the root" in text
        print(f"rank {rank}: the root's error: {text}", flush=True)
        report(rank, "MISMATCH-ROOT", ok, f"{type(exc).__name__}: {text}")
    # the parts of a reduce-scatter (the same count)
    n = 4 * p
    for _ in range(4):
        tr.reduce_scatter(np.ones(n, np.float32), name="mm.parts")
    # node 1's ranks all give the same other parts, 5, 4, ..., 4, 3 (node 0's: 4 each)
    counts = None if node == 0 else [4 + (r == 0) - (r == p - 1) for r in range(p)]
    try:
        tr.reduce_scatter(np.ones(n, np.float32), name="mm.parts", counts=counts)
        report(rank, "MISMATCH-PARTS", False, "no error")
    except tr.TotalReduceError as exc:
        text = str(exc)
        ok = "'mm.parts' generation 4" in text and "node 1 (rank" in text
        print(f"rank {rank}: the parts' error: {text}", flush=True)
        report(rank, "MISMATCH-PARTS", ok, f"{type(exc).__name__}: {text}")
    # the parts of a reduce-scatter, with the same sums per node (several clients a node):
    # the nodes compare the parts themselves (the loop on: node 0 runs its row)
    local = p // 2
    if local > 1:
        mine = [3, 5] + [4] * (p - 2)
        theirs = [5, 3] + [4] * (p - 2)
        for _ in range(4):
            tr.reduce_scatter(np.ones(n, np.float32), name="mm.sums", counts=mine)
        try:
            got = tr.reduce_scatter(
                np.ones(n, np.float32), name="mm.sums", counts=mine if node == 0 else theirs
            )
            report(rank, "MISMATCH-SAME-SUMS", False, f"no error: {got}")
        except tr.TotalReduceError as exc:
            text = str(exc)
            ok = "'mm.sums' generation 4" in text and "node 1 (rank" in text and "parts" in text
            print(f"rank {rank}: the same sums' error: {text}", flush=True)
            report(rank, "MISMATCH-SAME-SUMS", ok, f"{type(exc).__name__}: {text}")
    # the service goes on: a new name, and repeats of it
    bad = []
    for i in range(5):
        got = tr.allreduce(np.full(4, rank + i, np.int64), name="mm.after")
        if not np.all(got == sum(r + i for r in range(p))):
            bad.append(str(got))
    report(rank, "MISMATCH-AFTER", not bad, "; ".join(bad[:3]))


def mode_compaction(p: int, rank: int) -> None:
    """The services' lane keeps few plans (``TOTALREDUCE_LANE_PLAN_BYTES`` small): rounds of
    many new shapes among the nodes compact its plans, moving the offsets the loop's rows
    hold; after each round a repeated shape takes the loop again, exact."""
    bad: list[str] = []
    for rnd in range(3):
        for k in range(24):  # new counts: each a plan the services' lane compiles
            n = 64 + 24 * rnd + k
            got = tr.allreduce(np.full(n, rank + k, np.int64), name=f"cmp.new.{rnd}.{k}")
            if not np.all(got == sum(r + k for r in range(p))):
                bad.append(f"round {rnd} new shape {k}: {got[:3]}")
        x = np.zeros(256, np.float64)
        before = entered()
        for i in range(40):
            x[:] = rank + i
            got = tr.allreduce(x, name="cmp.repeat")
            if not np.all(got == sum(r + i for r in range(p))):
                bad.append(f"round {rnd} repeat {i}: {got[:3]}")
        # the first repeats of a round make the shape anew (its offsets moved) and its row
        routed(bad, f"round {rnd} repeats", entered() - before, 40 - 5, loop_on())
    report(rank, "COMPACTION", not bad, "; ".join(bad[:3]))


def main() -> None:
    tr.init()
    modes = {"kinds": mode_kinds, "segmented": mode_segmented, "mismatch": mode_mismatch,
             "groups": mode_groups, "compaction": mode_compaction}  # fmt: skip
    for mode in sys.argv[1].split(","):  # (several in one job: one service start for all)
        modes[mode](tr.size(), tr.rank())
    tr.shutdown()


if __name__ == "__main__":
    main()

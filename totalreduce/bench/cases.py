"""What the benchmark times: each implementation of a collective as a :class:`Case`.

A case holds its timed calls (out-of-place and in-place, either may be
missing) and, for each, a check that counts this rank's wrong elements after
one call.  Inputs follow a fixed integer pattern per rank, so every expected
result is exact in every dtype, and ``#wrong`` must be 0.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

import totalreduce as tr

from .bare import bare_ring_allreduce
from .timing import Timed

_UFUNCS = {"sum": np.add, "avg": np.add, "max": np.maximum, "min": np.minimum}


def pattern(n: int, rank: int, dtype: Any) -> np.ndarray:
    """Rank ``rank``'s input: small integers, different on every rank and element."""
    idx = np.arange(n, dtype=np.int64)
    return ((idx * 7 + rank * 3) % 11 + rank).astype(dtype)


def expected(n: int, p: int, dtype: Any, op: str) -> np.ndarray:
    """The exact result of reducing every rank's :func:`pattern` with ``op``."""
    want = pattern(n, 0, dtype)
    for r in range(1, p):
        _UFUNCS[op](want, pattern(n, r, dtype), out=want)
    return average(want, p) if op == "avg" else want


def average(x: np.ndarray, p: int) -> np.ndarray:
    """``x / p`` in place, floor division on integers (as totalreduce's ``avg``)."""
    if np.issubdtype(x.dtype, np.integer):
        x //= p
    else:
        x /= p
    return x


def wrong(got: Any, want: np.ndarray) -> int:
    """Elements of ``got`` that differ from ``want`` (all of them if the shape is wrong)."""
    got = np.asarray(got).reshape(-1)
    if got.shape != want.shape:
        return int(max(got.size, want.size))
    if np.issubdtype(want.dtype, np.floating) and not np.array_equal(want, np.round(want)):
        return int(np.count_nonzero(~np.isclose(got, want, rtol=1e-5, atol=1e-6)))
    return int(np.count_nonzero(got != want))


@dataclass
class Case:
    """One implementation at one size: its timed calls and their checks.

    ``anchor`` is the impl this one is compared with (MPI's counterpart);
    ``chosen`` says what ``auto`` ran.
    """

    collective: str
    impl: str
    nbytes: int
    count: int
    root: int
    oop: Timed | None
    ip: Timed | None
    check_oop: Callable[[], int] | None = None
    check_ip: Callable[[], int] | None = None
    chosen: str | None = None
    redop: str = "none"


def _mpi_op(op: str) -> Any:
    from mpi4py import MPI

    return {"sum": MPI.SUM, "avg": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}[op]


def allreduce_cases(
    comm: Any,
    n: int,
    dtype: Any,
    op: str,
    algorithms: Sequence[str],
    bare_comm: Any = None,
    floor_comm: Any = None,
) -> list[Case]:
    """MPI ``Allreduce``, totalreduce's ``algorithms``; with ``bare_comm``, the bare loop;
    with ``floor_comm``, the compiled floor (float32 sums only)."""
    from mpi4py import MPI

    from ..service.ops import choose_allreduce

    p, rank = comm.Get_size(), comm.Get_rank()
    x = pattern(n, rank, dtype)
    want = expected(n, p, dtype, op)
    nbytes = x.nbytes
    mpi_op = _mpi_op(op)
    out = np.empty_like(x)
    buf = np.empty_like(x)

    def restore() -> None:
        buf[...] = x

    def mpi_oop() -> None:
        comm.Allreduce(x, out, op=mpi_op)
        if op == "avg":
            average(out, p)

    def mpi_ip() -> None:
        comm.Allreduce(MPI.IN_PLACE, buf, op=mpi_op)
        if op == "avg":
            average(buf, p)

    cases = [
        Case(
            "allreduce",
            "mpi.Allreduce",
            nbytes,
            n,
            -1,
            Timed(mpi_oop),
            Timed(mpi_ip, restore),
            lambda: wrong(out, want),
            lambda: wrong(buf, want),
            redop=op,
        )
    ]
    if bare_comm is not None:
        scratch = np.empty(-(-n // p) if p else n, dtype=x.dtype)
        cases.append(
            Case(
                "allreduce",
                "bare.ring",
                nbytes,
                n,
                -1,
                Timed(lambda: bare_ring_allreduce(bare_comm, x, out, scratch, op)),
                Timed(lambda: bare_ring_allreduce(bare_comm, buf, buf, scratch, op), restore),
                lambda: wrong(out, want),
                lambda: wrong(buf, want),
                redop=op,
            )
        )
    if floor_comm is not None and x.dtype == np.float32 and op == "sum":
        from .floor import floor_ring

        fscratch = np.empty(-(-n // p), dtype=x.dtype)
        cases.append(
            Case(
                "allreduce",
                "floor.ring",
                nbytes,
                n,
                -1,
                Timed(floor_ring(floor_comm, x, out, fscratch)),
                Timed(floor_ring(floor_comm, buf, buf, fscratch), restore),
                lambda: wrong(out, want),
                lambda: wrong(buf, want),
                redop=op,
            )
        )
    for algo in algorithms:
        tag = f"bench.ar.{algo}.{nbytes}"
        cases.append(
            Case(
                "allreduce",
                f"tr.{algo}",
                nbytes,
                n,
                -1,
                Timed(lambda a=algo, t=tag: tr.allreduce(x, name=t, op=op, out=out, algorithm=a)),
                Timed(
                    lambda a=algo, t=tag: tr.allreduce(
                        buf, name=t + ".ip", op=op, out=buf, algorithm=a
                    ),
                    restore,
                ),
                lambda: wrong(out, want),
                lambda: wrong(buf, want),
                chosen=choose_allreduce("auto", p, nbytes) if algo == "auto" else None,
                redop=op,
            )
        )
    return cases


def collective_cases(comm: Any, n: int, dtype: Any, op: str) -> list[Case]:
    """Reduce-scatter, all-gather and broadcast (both algorithms) against MPI's."""
    p, rank = comm.Get_size(), comm.Get_rank()
    m = n // p * p  # equal parts, as MPI's Reduce_scatter_block needs
    cases: list[Case] = []
    mpi_op = _mpi_op(op)
    itemsize = np.dtype(dtype).itemsize
    if m:
        xs = pattern(m, rank, dtype)
        total = expected(m, p, dtype, op)
        piece_want = total[rank * (m // p) : (rank + 1) * (m // p)]
        piece = np.empty(m // p, dtype=dtype)
        box: dict[str, Any] = {}

        def mpi_rs() -> None:
            comm.Reduce_scatter_block(xs, piece, op=mpi_op)
            if op == "avg":
                average(piece, p)

        def tr_rs() -> None:
            box["rs"] = tr.reduce_scatter(xs, name=f"bench.rs.{m}", op=op)

        mine = pattern(m // p, rank, dtype)
        whole = np.empty(m, dtype=dtype)
        gathered = np.concatenate([pattern(m // p, r, dtype) for r in range(p)])

        def tr_ag() -> None:
            box["ag"] = tr.allgather(mine, name=f"bench.ag.{m}")

        nb = m * itemsize
        cases += [
            Case(
                "reduce_scatter",
                "mpi.Reduce_scatter_block",
                nb,
                m,
                -1,
                Timed(mpi_rs),
                None,
                lambda: wrong(piece, piece_want),
                redop=op,
            ),
            Case(
                "reduce_scatter",
                "tr.reduce_scatter",
                nb,
                m,
                -1,
                Timed(tr_rs),
                None,
                lambda: wrong(box["rs"], piece_want),
                redop=op,
            ),
            Case(
                "allgather",
                "mpi.Allgather",
                nb,
                m,
                -1,
                Timed(lambda: comm.Allgather(mine, whole)),
                None,
                lambda: wrong(whole, gathered),
            ),
            Case(
                "allgather",
                "tr.allgather",
                nb,
                m,
                -1,
                Timed(tr_ag),
                None,
                lambda: wrong(box["ag"], gathered),
            ),
        ]
    x = pattern(n, rank, dtype)
    root_data = pattern(n, 0, dtype)
    buf = np.empty_like(x)
    res: dict[str, Any] = {}

    def restore() -> None:
        buf[...] = x

    cases.append(
        Case(
            "broadcast",
            "mpi.Bcast",
            x.nbytes,
            n,
            0,
            None,
            Timed(lambda: comm.Bcast(buf, root=0), restore),
            None,
            lambda: wrong(buf, root_data),
        )
    )
    for algo in ("one_to_all", "pipelined"):
        tag = f"bench.bc.{algo}.{n}"

        def oop(a: str = algo, t: str = tag) -> None:
            res[a] = tr.broadcast(x, root=0, name=t, algorithm=a)

        cases.append(
            Case(
                "broadcast",
                f"tr.broadcast.{algo}",
                x.nbytes,
                n,
                0,
                Timed(oop),
                Timed(
                    lambda a=algo, t=tag: tr.broadcast(
                        buf, root=0, name=t + ".ip", out=buf, algorithm=a
                    ),
                    restore,
                ),
                lambda a=algo: wrong(res[a], root_data),
                lambda: wrong(buf, root_data),
            )
        )
    return cases


def neighbor_cases(comm: Any, n: int, dtype: Any, topologies: Sequence[str]) -> list[Case]:
    """``neighbor_allreduce`` on ``topologies`` beside an averaging allreduce (MPI's and ours)."""
    from ..topology import get_topology, mixing_matrix

    p, rank = comm.Get_size(), comm.Get_rank()
    cases = allreduce_cases(comm, n, dtype, "avg", ["ring"])
    x = pattern(n, rank, dtype)
    stack = np.stack([pattern(n, r, np.float64) for r in range(p)])
    out = np.empty_like(x)
    buf = np.empty_like(x)

    def restore() -> None:
        buf[...] = x

    for topo in topologies:
        want = (mixing_matrix(get_topology(topo, p), 0) @ stack)[rank].astype(dtype)
        tag = f"bench.nb.{topo}.{n}"

        def check_oop(t: str = topo, w: np.ndarray = want, g: str = tag) -> int:
            # A name of its own, at step 0: the step the expected result is for.
            got = tr.neighbor_allreduce(x, name=g + ".check", topology=t, step=0)
            return wrong(got, w)

        def check_ip(t: str = topo, w: np.ndarray = want, g: str = tag) -> int:
            restore()
            tr.neighbor_allreduce(buf, name=g + ".ipcheck", topology=t, step=0, out=buf)
            return wrong(buf, w)

        cases.append(
            Case(
                "neighbor_allreduce",
                f"tr.neighbor.{topo}",
                x.nbytes,
                n,
                -1,
                Timed(lambda t=topo, g=tag: tr.neighbor_allreduce(x, name=g, topology=t, out=out)),
                Timed(
                    lambda t=topo, g=tag: tr.neighbor_allreduce(
                        buf, name=g + ".ip", topology=t, out=buf
                    ),
                    restore,
                ),
                check_oop,
                check_ip,
                redop="avg",
            )
        )
    return cases


def op_cases(comm: Any, n: int, dtype: Any) -> list[Case]:
    """``--latency``'s rows of the other ops, each beside what a user would write with MPI:
    ``neighbor_allreduce`` on the exponential-2 graph against ``Isend``/``Irecv`` to the
    same neighbours and the same weighted sum; ``alltoall``, ``broadcast``, ``reduce`` and
    ``gather`` against ``MPI_Alltoall``, ``MPI_Bcast``, ``MPI_Reduce``, ``MPI_Gather``."""
    from mpi4py import MPI

    from ..topology import get_topology, mixing_matrix

    p, rank = comm.Get_size(), comm.Get_rank()
    x = pattern(n, rank, dtype)
    cases: list[Case] = []
    box: dict[str, Any] = {}
    if np.issubdtype(np.dtype(dtype), np.floating):
        topo = get_topology("exponential-2", p)
        w = mixing_matrix(topo, 0)
        stack = np.stack([pattern(n, r, np.float64) for r in range(p)])
        want_nb = (w @ stack)[rank].astype(dtype)
        srcs = [j for j in range(p) if j != rank and w[rank, j] != 0]
        dsts = [j for j in range(p) if j != rank and w[j, rank] != 0]
        got = {j: np.empty_like(x) for j in srcs}
        mine = np.empty_like(x)
        weights = {j: np.dtype(dtype).type(w[rank, j]) for j in srcs}
        self_w = np.dtype(dtype).type(w[rank, rank])

        def mpi_nb() -> None:
            reqs = [comm.Irecv(got[j], source=j, tag=7) for j in srcs]
            reqs += [comm.Isend(x, dest=d, tag=7) for d in dsts]
            MPI.Request.Waitall(reqs)
            np.multiply(x, self_w, out=mine)
            for j in srcs:
                np.add(mine, weights[j] * got[j], out=mine)

        def tr_nb() -> None:
            box["nb"] = tr.neighbor_allreduce(x, name=f"bench.ops.nb.{n}", topology=topo)

        cases += [
            Case("neighbor_allreduce", "mpi.neighbor.Isend+Irecv", x.nbytes, n, -1,
                 Timed(mpi_nb), None, lambda: wrong(mine, want_nb), redop="avg"),
            Case("neighbor_allreduce", "tr.neighbor.exponential-2", x.nbytes, n, -1,
                 Timed(tr_nb), None, lambda: wrong(box["nb"], want_nb), redop="avg"),
        ]  # fmt: skip
    m = n // p * p
    if m:
        xa = pattern(m, rank, dtype)
        part = m // p
        want_a2a = np.concatenate(
            [pattern(m, r, dtype)[rank * part : (rank + 1) * part] for r in range(p)]
        )
        out_a2a = np.empty_like(xa)

        def tr_a2a() -> None:
            box["a2a"] = tr.alltoall(xa, name=f"bench.ops.a2a.{m}")

        cases += [
            Case("alltoall", "mpi.Alltoall", xa.nbytes, m, -1,
                 Timed(lambda: comm.Alltoall(xa, out_a2a)), None,
                 lambda: wrong(out_a2a, want_a2a)),
            Case("alltoall", "tr.alltoall", xa.nbytes, m, -1, Timed(tr_a2a), None,
                 lambda: wrong(box["a2a"], want_a2a)),
        ]  # fmt: skip
    root_data = pattern(n, 0, dtype)
    bc = np.empty_like(x)

    def mpi_bc() -> None:
        if rank == 0:
            bc[...] = x
        comm.Bcast(bc, root=0)

    def tr_bc() -> None:
        box["bc"] = tr.broadcast(x, root=0, name=f"bench.ops.bc.{n}")

    total = expected(n, p, dtype, "sum")
    red = np.empty_like(x)
    gathered = np.empty(n * p, dtype=dtype)
    want_ga = np.concatenate([pattern(n, r, dtype) for r in range(p)])

    def tr_red() -> None:
        box["red"] = tr.reduce(x, root=0, name=f"bench.ops.red.{n}")

    def tr_ga() -> None:
        box["ga"] = tr.gather(x, root=0, name=f"bench.ops.ga.{n}")

    def at_root(key: str, want: np.ndarray) -> Callable[[], int]:
        return lambda: wrong(np.asarray(box[key]).reshape(-1), want) if rank == 0 else 0

    cases += [
        Case("broadcast", "mpi.Bcast", x.nbytes, n, 0, Timed(mpi_bc), None,
             lambda: wrong(bc, root_data)),
        Case("broadcast", "tr.broadcast", x.nbytes, n, 0, Timed(tr_bc), None,
             lambda: wrong(box["bc"], root_data)),
        Case("reduce", "mpi.Reduce", x.nbytes, n, 0,
             Timed(lambda: comm.Reduce(x, red, op=MPI.SUM, root=0)), None,
             lambda: wrong(red, total) if rank == 0 else 0, redop="sum"),
        Case("reduce", "tr.reduce", x.nbytes, n, 0, Timed(tr_red), None,
             at_root("red", total), redop="sum"),
        Case("gather", "mpi.Gather", x.nbytes, n, 0,
             Timed(lambda: comm.Gather(x, gathered, root=0)), None,
             lambda: wrong(gathered, want_ga) if rank == 0 else 0),
        Case("gather", "tr.gather", x.nbytes, n, 0, Timed(tr_ga), None, at_root("ga", want_ga)),
    ]  # fmt: skip
    return cases


def burst_cases(
    comm: Any, counts: Sequence[int], dtype: Any, op: str, label: str = "burst"
) -> list[Case]:
    """``len(counts)`` tensors submitted at once (as a training step's gradients), then waited.

    Against one MPI ``Allreduce`` of their concatenation, and MPI ``Iallreduce``
    of each tensor followed by ``Waitall``.
    """
    from mpi4py import MPI

    p, rank = comm.Get_size(), comm.Get_rank()
    mpi_op = _mpi_op(op)
    total = int(sum(counts))
    flat = pattern(total, rank, dtype)
    want = expected(total, p, dtype, op)
    bounds = np.cumsum([0, *counts])
    tensors = [flat[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    flat_out = np.empty_like(flat)
    outs = [flat_out[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    nbytes = flat.nbytes
    k = len(counts)

    def mpi_concat() -> None:
        comm.Allreduce(flat, flat_out, op=mpi_op)
        if op == "avg":
            average(flat_out, p)

    def mpi_many() -> None:
        reqs = [comm.Iallreduce(t, o, op=mpi_op) for t, o in zip(tensors, outs, strict=True)]
        MPI.Request.Waitall(reqs)
        if op == "avg":
            average(flat_out, p)

    def tr_many() -> None:
        hs = [
            tr.allreduce_async(t, name=f"bench.{label}.{i}", op=op, out=o)
            for i, (t, o) in enumerate(zip(tensors, outs, strict=True))
        ]
        for h in hs:
            h.wait()

    def check() -> int:
        return wrong(flat_out, want)

    return [
        Case(
            "allreduce",
            "mpi.Allreduce(concat)",
            nbytes,
            total,
            -1,
            Timed(mpi_concat),
            None,
            check,
            redop=op,
        ),
        Case(
            "allreduce",
            f"mpi.Iallreduce x{k}",
            nbytes,
            total,
            -1,
            Timed(mpi_many),
            None,
            check,
            redop=op,
        ),
        Case(
            "allreduce",
            f"tr.allreduce_async x{k}",
            nbytes,
            total,
            -1,
            Timed(tr_many),
            None,
            check,
            redop=op,
        ),
    ]


#: Sizes of the in-flight ops, cycled: 1 KiB to 16 KiB.
INFLIGHT_BYTES = (1 << 10, 2 << 10, 4 << 10, 8 << 10, 16 << 10)


def inflight_counts(ops: int, itemsize: int) -> list[int]:
    """Element counts of ``ops`` small ops cycling through :data:`INFLIGHT_BYTES`."""
    return [INFLIGHT_BYTES[i % len(INFLIGHT_BYTES)] // itemsize for i in range(ops)]


def inflight_cases(comm: Any, ops: int, dtype: Any, op: str) -> list[Case]:
    """``ops`` small allreduces in flight at once against MPI ``Iallreduce`` + ``Waitall``."""
    counts = inflight_counts(ops, np.dtype(dtype).itemsize)
    cases = burst_cases(comm, counts, dtype, op, label=f"inflight{ops}")
    return [c for c in cases if "concat" not in c.impl]

"""Benchmark results in the form nccl-tests and OSU users read: text table, CSV, JSON, plot.

One :class:`Result` per implementation and size.  The text table has one row
per size and implementation, with nccl-tests' columns for the out-of-place and
the in-place call (time in µs, algbw and busbw in GB/s, ``#wrong``), then the
ratios to the anchors measured in the same run; header and summary lines start
with ``#`` so that the rows can be read by any whitespace-splitting tool.

Bandwidths follow nccl-tests: ``algbw = size / time`` and ``busbw = algbw ·
factor``, the factor depending on the collective (:data:`BUSBW_FACTOR`);
neighbor averaging claims no bandwidth (time only).
"""

from __future__ import annotations

import csv
import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any, TextIO

#: busbw = algbw · factor(P), per collective (nccl-tests' PERFORMANCE.md).
BUSBW_FACTOR: dict[str, Callable[[int], float] | None] = {
    "allreduce": lambda p: 2 * (p - 1) / p,
    "reduce_scatter": lambda p: (p - 1) / p,
    "allgather": lambda p: (p - 1) / p,
    "broadcast": lambda p: 1.0,
    "alltoall": lambda p: (p - 1) / p,
    "reduce": lambda p: 1.0,
    "gather": lambda p: (p - 1) / p,
    "neighbor_allreduce": None,
}


@dataclass
class Result:
    """One implementation at one size; times in µs, bandwidths in GB/s, None where it has none.

    ``mode`` is ``size`` for the per-size rows, ``burst`` and ``inflight`` for
    many ops submitted at once (then ``ops`` counts them and ``size`` / ``count``
    are their totals).  ``vs_mpi`` / ``vs_bare`` / ``vs_floor`` are the anchor's
    out-of-place time over this row's (above 1: faster than the anchor); the anchors
    are MPI, the bare mpi4py loop and the compiled floor (:mod:`.floor`).
    """

    mode: str
    collective: str
    impl: str
    size: int
    count: int
    type: str
    redop: str
    root: int
    ops: int = 1
    time_us: float | None = None
    algbw: float | None = None
    busbw: float | None = None
    wrong: int | None = None
    ip_time_us: float | None = None
    ip_algbw: float | None = None
    ip_busbw: float | None = None
    ip_wrong: int | None = None
    vs_mpi: float | None = None
    vs_bare: float | None = None
    vs_floor: float | None = None
    time_avg_us: float | None = None
    time_min_us: float | None = None
    time_max_us: float | None = None
    chosen: str | None = None  # what ``auto`` ran
    compute_ms: float | None = None  # the step scenario: simulated compute per step

    @property
    def us_per_op(self) -> float | None:
        return None if self.time_us is None else self.time_us / max(1, self.ops)


def bandwidths(collective: str, p: int, nbytes: int, seconds: float) -> tuple[float | None, ...]:
    """``(algbw, busbw)`` in GB/s of a call of ``nbytes`` taking ``seconds``."""
    factor = BUSBW_FACTOR[collective]
    if factor is None or seconds <= 0:
        return None, None
    alg = nbytes / seconds / 1e9
    return alg, alg * factor(p)


def _num(v: float | int | None, width: int, fmt: str) -> str:
    if v is None:
        return f"{'N/A' if fmt == 'd' else '-':>{width}}"
    return f"{v:>{width}{fmt}}"


_PART = 8 + 8 + 8 + 7  # time, algbw, busbw, #wrong


def header(latency: bool) -> list[str]:
    """The column header lines of the per-size table (``#``-prefixed)."""
    lead = f"{'':>12} {'':>11} {'':>8} {'':>5} {'':>5} {'':<26}"
    ratio = f" {'vs_mpi':>7}" + (f" {'vs_bare':>7} {'vs_floor':>8}" if latency else "")
    return [
        f"#{lead} {'out-of-place':^{_PART + 3}} {'in-place':^{_PART + 3}}",
        f"#{'size':>11} {'count':>11} {'type':>8} {'redop':>5} {'root':>5} {'impl':<26}"
        f" {'time':>8} {'algbw':>8} {'busbw':>8} {'#wrong':>6}"
        f" {'time':>8} {'algbw':>8} {'busbw':>8} {'#wrong':>6}{ratio}",
        f"#{'(B)':>11} {'(elements)':>11} {'':>8} {'':>5} {'':>5} {'':<26}"
        f" {'(us)':>8} {'(GB/s)':>8} {'(GB/s)':>8} {'':>6}"
        f" {'(us)':>8} {'(GB/s)':>8} {'(GB/s)':>8} {'':>6}",
    ]


def row(r: Result, latency: bool) -> str:
    """One per-size row."""
    text = (
        f"{r.size:>12} {r.count:>11} {r.type:>8} {r.redop:>5} {r.root:>5} {r.impl:<26}"
        f" {_num(r.time_us, 8, '.1f')} {_num(r.algbw, 8, '.3f')} {_num(r.busbw, 8, '.3f')}"
        f" {_num(r.wrong, 6, 'd')}"
        f" {_num(r.ip_time_us, 8, '.1f')} {_num(r.ip_algbw, 8, '.3f')}"
        f" {_num(r.ip_busbw, 8, '.3f')} {_num(r.ip_wrong, 6, 'd')}"
        f" {_num(r.vs_mpi, 7, '.2f')}"
    )
    if latency:
        text += f" {_num(r.vs_bare, 7, '.2f')} {_num(r.vs_floor, 8, '.2f')}"
    return text


def many_header() -> list[str]:
    """Header of the burst / in-flight block: totals, and the time per op."""
    return [
        f"#{'size':>11} {'count':>11} {'type':>8} {'redop':>5} {'ops':>6} {'impl':<26}"
        f" {'time':>10} {'per op':>8} {'algbw':>8} {'busbw':>8} {'#wrong':>6} {'vs_mpi':>7}",
        f"#{'(B)':>11} {'(elements)':>11} {'':>8} {'':>5} {'':>6} {'':<26}"
        f" {'(us)':>10} {'(us)':>8} {'(GB/s)':>8} {'(GB/s)':>8}",
    ]


def many_row(r: Result) -> str:
    """One burst / in-flight row."""
    return (
        f"{r.size:>12} {r.count:>11} {r.type:>8} {r.redop:>5} {r.ops:>6} {r.impl:<26}"
        f" {_num(r.time_us, 10, '.1f')} {_num(r.us_per_op, 8, '.2f')}"
        f" {_num(r.algbw, 8, '.3f')} {_num(r.busbw, 8, '.3f')} {_num(r.wrong, 6, 'd')}"
        f" {_num(r.vs_mpi, 7, '.2f')}"
    )


def step_header() -> list[str]:
    """Header of the step scenario's block: the model's totals, the time per step."""
    return [
        f"#{'size':>11} {'count':>11} {'ops':>5} {'compute':>8} {'impl':<26}"
        f" {'step':>9} {'min':>9} {'max':>9} {'#wrong':>6} {'vs_mpi':>7}",
        f"#{'(B)':>11} {'(elements)':>11} {'':>5} {'(ms)':>8} {'':<26}"
        f" {'(ms)':>9} {'(ms)':>9} {'(ms)':>9}",
    ]


def step_row(r: Result) -> str:
    """One row of the step scenario: an implementation's time per step at one compute speed."""

    def ms(us: float | None) -> float | None:
        return None if us is None else us / 1e3

    return (
        f"{r.size:>12} {r.count:>11} {r.ops:>5} {_num(r.compute_ms, 8, '.1f')} {r.impl:<26}"
        f" {_num(ms(r.time_us), 9, '.2f')} {_num(ms(r.time_min_us), 9, '.2f')}"
        f" {_num(ms(r.time_max_us), 9, '.2f')} {_num(r.wrong, 6, 'd')} {_num(r.vs_mpi, 7, '.2f')}"
    )


FIELDS = [f.name for f in fields(Result)]


def write_csv(results: Sequence[Result], out: TextIO) -> None:
    """One CSV line per result, every field of :class:`Result` as a column (empty: none)."""
    w = csv.DictWriter(out, fieldnames=FIELDS)
    w.writeheader()
    for r in results:
        w.writerow({k: ("" if v is None else v) for k, v in asdict(r).items()})


def read_csv(text: str) -> list[dict[str, str]]:
    """The rows of a CSV written by :func:`write_csv`."""
    return list(csv.DictReader(text.splitlines()))


def write_json(results: Sequence[Result], meta: dict[str, Any], out: TextIO) -> None:
    """``meta`` (P, dtype, op, transport, idle CPU...) and the results as a list of objects."""
    json.dump({**meta, "results": [asdict(r) for r in results]}, out, indent=1)
    out.write("\n")


def plot(results: Sequence[Result], path: str, title: str) -> None:
    """Draw busbw and latency (out-of-place) against size for every implementation: a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results if r.mode == "size" and r.time_us is not None]
    impls = list(dict.fromkeys(r.impl for r in rows))
    fig, (bw_ax, lat_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    for impl in impls:
        mine = sorted((r for r in rows if r.impl == impl), key=lambda r: r.size)
        style = "--" if impl.startswith(("mpi", "bare", "floor")) else "-"
        sizes = [r.size for r in mine]
        lat_ax.plot(sizes, [r.time_us for r in mine], style, marker="o", ms=3, label=impl)
        if all(r.busbw is not None for r in mine):
            bw_ax.plot(sizes, [r.busbw for r in mine], style, marker="o", ms=3, label=impl)
    for ax, label in ((bw_ax, "busbw (GB/s)"), (lat_ax, "time (µs)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("size (bytes)")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
    lat_ax.set_yscale("log")
    lat_ax.legend(fontsize=7)
    if bw_ax.lines:
        bw_ax.legend(fontsize=7)
    else:
        bw_ax.set_title("no bandwidth claimed (time only)")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

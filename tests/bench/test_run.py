"""``totalreduce bench`` under ``mpiexec``: each mode's table, CSV, JSON and plot; nothing wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bench_run import bench

from totalreduce.algorithms.registry import ALLREDUCE
from totalreduce.bench.run import parse_size, size_range
from totalreduce.bench.table import read_csv
from totalreduce.launch import find_mpiexec

MPIEXEC = find_mpiexec()  # this Python's (the mpich wheel's, beside it), else PATH's

pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec beside python or on PATH")


def rows_of(out: str) -> list[list[str]]:
    return [ln.split() for ln in out.splitlines() if ln.strip() and not ln.startswith("#")]


def test_latency_mode_table_csv_json_plot(tmp_path: Path) -> None:
    out = bench(
        2,
        "--latency",
        "-b", "8",
        "-e", "64",
        "-n", "3",
        "--inflight", "20,40",
        "--ops", "0",
        "--burst-iters", "1",
        "--idle-seconds", "0.2",
        "--csv", "r.csv",
        "--json", "r.json",
        "--plot", "r.png",
        cwd=tmp_path,
    )  # fmt: skip
    lines = out.splitlines()
    assert lines[0].startswith("# totalreduce bench (latency): P=2, float32")
    assert lines[-1].startswith("# idle service CPU over 0.2 s")
    # 4 sizes x (MPI, bare loop, compiled floor, every algorithm, auto), then the burst and
    # in-flight rows.
    per_size = 3 + len(ALLREDUCE) + 1
    csv_rows = read_csv((tmp_path / "r.csv").read_text())
    sized = [r for r in csv_rows if r["mode"] == "size"]
    assert len(sized) == 4 * per_size
    assert [int(r["size"]) for r in sized[::per_size]] == [8, 16, 32, 64]
    assert {r["impl"] for r in sized} >= {
        "mpi.Allreduce",
        "bare.ring",
        "floor.ring",
        "tr.recursive_doubling",
    }
    for r in csv_rows:
        assert r["wrong"] == "0", r
        assert r["ip_wrong"] in ("0", ""), r
        assert float(r["time_us"]) > 0
    for r in sized:
        assert float(r["vs_mpi"]) > 0 and float(r["vs_bare"]) > 0 and float(r["vs_floor"]) > 0
        assert r["type"] == "float32" and r["redop"] == "sum" and r["root"] == "-1"
    assert {r["chosen"] for r in sized if r["impl"] == "tr.auto"} <= set(ALLREDUCE)
    burst = [r for r in csv_rows if r["mode"] == "burst"]
    assert [r["ops"] for r in burst] == ["161"] * 3 and burst[0]["count"] == "25557032"
    inflight = [r for r in csv_rows if r["mode"] == "inflight"]
    assert sorted({r["ops"] for r in inflight}) == ["20", "40"] and len(inflight) == 4
    # The text rows: one per result, the same columns on every per-size row.
    text = rows_of(out)
    assert len(text) == len(csv_rows)
    assert len({len(r) for r in text[: 4 * per_size]}) == 1
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["P"] == 2 and len(doc["results"]) == len(csv_rows)
    assert len(doc["idle_cpu_percent"]) == 2
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_latency_mode_without_burst_or_in_flight_with_the_other_ops(tmp_path: Path) -> None:
    """The other ops' rows (``--ops``, on by default) beside what a user writes with MPI:
    exact, each with its vs_mpi against its own anchor."""
    bench(2, "--latency", "-b", "4K", "-e", "4K", "-n", "2", "--no-burst", "--inflight", "",
          "--idle-seconds", "0", "--csv", "r.csv", cwd=tmp_path)  # fmt: skip
    rows = read_csv((tmp_path / "r.csv").read_text())
    ops = {
        "neighbor_allreduce": ("mpi.neighbor.Isend+Irecv", "tr.neighbor.exponential-2"),
        "alltoall": ("mpi.Alltoall", "tr.alltoall"),
        "broadcast": ("mpi.Bcast", "tr.broadcast"),
        "reduce": ("mpi.Reduce", "tr.reduce"),
        "gather": ("mpi.Gather", "tr.gather"),
    }
    assert {r["mode"] for r in rows} == {"size"}
    assert len(rows) == 3 + len(ALLREDUCE) + 1 + 2 * len(ops)
    for collective, impls in ops.items():
        mine = [r for r in rows if r["collective"] == collective]
        assert tuple(r["impl"] for r in mine) == impls, mine
        for r in mine:
            assert r["wrong"] == "0" and float(r["time_us"]) > 0, r
        assert float(mine[0]["vs_mpi"]) == pytest.approx(1.0) and float(mine[1]["vs_mpi"]) > 0


@pytest.mark.parametrize("n", [2, 3])
def test_latency_mode_sets_the_compiled_floor_beside_mpi(n: int, tmp_path: Path) -> None:
    """The compiled floor's row: exact sums (out of place and in place), a vs_floor column."""
    out = bench(
        n,
        "--latency",
        "-b", "4",
        "-e", "16K",
        "-f", "64",
        "-n", "2",
        "--no-burst",
        "--inflight", "",
        "--idle-seconds", "0",
        "--csv", "r.csv",
        cwd=tmp_path,
    )  # fmt: skip
    header = next(ln for ln in out.splitlines() if "#wrong" in ln).split()
    assert header[-3:] == ["vs_mpi", "vs_bare", "vs_floor"], header
    rows = read_csv((tmp_path / "r.csv").read_text())
    floor = [r for r in rows if r["impl"] == "floor.ring"]
    # 4 B (one float: fewer than P chunks hold data), 256 B, 16 KiB.
    assert [int(r["size"]) for r in floor] == [4, 256, 16384], out
    for r in floor:
        assert r["wrong"] == "0" and r["ip_wrong"] == "0", r
        assert float(r["vs_floor"]) == pytest.approx(1.0)
    for r in rows:
        assert float(r["vs_floor"]) > 0, r
    text = [ln for ln in rows_of(out) if ln[5] == "floor.ring"]
    assert len(text) == 3 and all(ln[9] == "0" and ln[13] == "0" for ln in text), out


def test_every_collective_int64_max(tmp_path: Path) -> None:
    out = bench(
        3,
        "--algorithm", "all",
        "-b", "48",
        "-e", "192",
        "-n", "2",
        "--dtype", "int64",
        "--op", "max",
        "--idle-seconds", "0",
        "--csv", "r.csv",
        cwd=tmp_path,
    )  # fmt: skip
    rows = read_csv((tmp_path / "r.csv").read_text())
    collectives = {r["collective"] for r in rows}
    assert collectives == {"allreduce", "reduce_scatter", "allgather", "broadcast"}, out
    for r in rows:
        assert "0" in (r["wrong"], r["ip_wrong"]) and "N/A" not in r.values(), r
        assert r["wrong"] in ("0", "") and r["ip_wrong"] in ("0", ""), r
    bcast = [r for r in rows if r["collective"] == "broadcast"]
    assert {r["root"] for r in bcast} == {"0"}
    ar = [r for r in rows if r["collective"] == "allreduce" and r["size"] == "48"]
    # busbw follows nccl-tests: allreduce 2(P-1)/P.
    for r in ar:
        assert float(r["busbw"]) == pytest.approx(float(r["algbw"]) * 4 / 3, rel=1e-9)


def test_neighbor_mode_claims_no_bandwidth(tmp_path: Path) -> None:
    bench(
        4,
        "--neighbor",
        "-b", "1K",
        "-e", "2K",
        "-n", "2",
        "--idle-seconds", "0",
        "--csv", "r.csv",
        cwd=tmp_path,
    )  # fmt: skip
    rows = read_csv((tmp_path / "r.csv").read_text())
    nb = [r for r in rows if r["collective"] == "neighbor_allreduce"]
    assert len(nb) == 2 * 3
    for r in rows:
        assert r["wrong"] == "0" and r["ip_wrong"] == "0", r
    for r in nb:
        assert r["algbw"] == r["busbw"] == "" and float(r["vs_mpi"]) > 0


def test_size_arguments() -> None:
    assert parse_size("4KiB") == parse_size("4K") == parse_size("4096") == 4096
    assert parse_size("64MiB") == 64 << 20
    assert size_range(8, 256 << 10, 2)[-1] == 256 << 10 and len(size_range(8, 256 << 10, 2)) == 16
    assert size_range(4096, 65536, 4) == [4096, 16384, 65536]
    with pytest.raises(ValueError):
        size_range(16, 8, 2)

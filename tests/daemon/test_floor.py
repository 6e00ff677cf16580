"""Daemon mode's floor (daemon/floor.py): compiled services and clients meeting in
shared-memory words, the compiled ring among the services; and the embedded floor beside
it.  Figures are never asserted: these check that both floors compute exact sums (every
process checks its first ops' result and fails otherwise) and that the benchmark reports
them."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from cluster import have_mpiexec  # noqa: E402

from totalreduce.daemon import bench, floor  # noqa: E402
from totalreduce.transport.shm import SharedRegion  # noqa: E402

pytestmark = pytest.mark.skipif(not have_mpiexec(), reason="mpiexec not found (mpich wheel)")


def _env() -> dict[str, str]:
    return {**os.environ, "MPIEXEC_TIMEOUT": "120", "PYTHONUNBUFFERED": "1"}


@pytest.mark.parametrize(
    "local",
    [pytest.param(1, marks=pytest.mark.full), pytest.param(2, marks=pytest.mark.full)],
    ids=lambda n: f"2x{n}",
)
def test_both_floors_sum_exactly_over_two_nodes(tmp_path: Path, local: int) -> None:
    got = floor.measure(2, local, 4096 + 12, 5, _env(), tmp_path)
    for mode in ("embedded", "daemon"):
        assert got[mode]["latency_s"] > 0 and got[mode]["per_op_s"] > 0, got
    assert not list(tmp_path.glob("floor-node*"))  # the services' notes are gone


def test_a_client_whose_service_never_comes_gives_up(tmp_path: Path) -> None:
    # the node's memory file is there, but no service serves it: the client's wait is bounded
    _, size = floor.layout(1, 1024)
    region = SharedRegion.create(size, "test")
    note = {"pid": os.getpid(), "fd": region.fd, "size": size}
    (tmp_path / "floor-node0.json").write_text(json.dumps(note))
    argv = ["client", f"--dir={tmp_path}", "--nodes=1", "--local=1", "--count=1024",
            "--iters=1", "--give-up-s=0.2", f"--out={tmp_path / 'c.json'}"]  # fmt: skip
    try:
        with pytest.raises(SystemExit, match="client 0 of node 0: its peers gave no sign"):
            floor.main(argv)
    finally:
        region.close_fd()
    assert not (tmp_path / "c.json").exists()


def test_the_floors_median_over_rounds_and_print_against_embedded_mode(
    capsys: pytest.CaptureFixture[str],
) -> None:
    rounds = [
        {"4KiB": {"embedded": {"latency_s": v, "per_op_s": 2 * v}, "daemon": {"latency_s": 3 * v,
                                                                              "per_op_s": v}}}
        for v in (1.0, 5.0, 2.0)
    ]  # fmt: skip
    med = bench._median_floors(rounds)
    assert med["4KiB"]["embedded"] == {"latency_s": 2.0, "per_op_s": 4.0}
    assert med["4KiB"]["daemon"] == {"latency_s": 6.0, "per_op_s": 2.0}
    bench._print_floors(med, {"sizes": {"4KiB": {"latency_s": 12.0}}})
    row = next(line for line in capsys.readouterr().out.splitlines() if "4KiB" in line).split()
    # latency embedded, daemon, their ratio; per op, likewise; the daemon floor / embedded mode
    assert row[1:] == ["2000000.0", "us", "6000000.0", "us", "3.00", "4000000.0", "us",
                       "2000000.0", "us", "0.50", "0.50"]  # fmt: skip


def test_the_mpi_anchor_runs_mpi_allreduce_and_prints_beside_both_modes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import argparse

    args = argparse.Namespace(nodes=1, local_clients=2, sizes="4KiB", group="")
    got = bench._run_mpi(args, tmp_path / "mpi.json")
    assert got["mode"] == "MPI_Allreduce" and got["size"] == 2, got
    row = got["sizes"]["4KiB"]
    assert row["bytes"] == 4096 and 0 < row["blocking_latency_s"] < 1 and row["per_op_s"] > 0
    mode = {"sizes": {"4KiB": {"blocking_latency_s": 4e-6, "per_op_s": 2e-6}}}
    twice = {"sizes": {"4KiB": {"blocking_latency_s": 8e-6, "per_op_s": 6e-6}}}
    bench._print_mpi(
        mode, twice, {"size": 2, "sizes": {"4KiB": {"blocking_latency_s": 2e-6, "per_op_s": 3e-6}}}
    )
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.strip().startswith("4KiB"))
    # blocking: MPI 2, embedded 4, daemon 8 (4x); back to back: 3, 2, 6 (2x)
    assert line.split()[1:] == ["2.0", "us", "4.0", "us", "8.0", "us", "4.00", "3.0", "us",
                                "2.0", "us", "6.0", "us", "2.00"]  # fmt: skip

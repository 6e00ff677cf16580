"""``totalreduce tune`` under ``mpiexec``: the table it writes is what ``auto`` then follows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from bench_run import bench

from totalreduce.algorithms.registry import ALLREDUCE
from totalreduce.launch import find_mpiexec
from totalreduce.service import tuning
from totalreduce.service.ops import choose_allreduce

MPIEXEC = find_mpiexec()  # this Python's (the mpich wheel's, beside it), else PATH's

pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec beside python or on PATH")


def test_tune_writes_a_table_auto_follows(tmp_path: Path) -> None:
    out = bench(2, "-b", "8", "-e", "512", "-f", "4", "-n", "3", "-o", "t.json",
                cwd=tmp_path, command="tune")  # fmt: skip
    assert "# allreduce at P=2 (*):" in out, out
    path = str(tmp_path / "t.json")
    tuning.clear_cache()
    table = tuning.load_table(path)
    assert table.sizes("allreduce") == [2] and table.sizes("broadcast") == [2]
    doc = json.loads((tmp_path / "t.json").read_text())
    measured = doc["measured"]["allreduce"]["*"]["2"]
    assert sorted(map(int, measured)) == [8, 32, 128, 512]
    for size, times in measured.items():
        assert set(times) == set(ALLREDUCE)
        fastest = min(times, key=times.__getitem__)
        assert choose_allreduce("auto", 2, int(size), tuning_file=path) == fastest
    bc = doc["measured"]["broadcast"]["*"]["2"]
    assert all(set(t) == {"one_to_all", "pipelined"} for t in bc.values())

    # A second P joins the same table; P=2's entry stays.
    bench(3, "-b", "8", "-e", "32", "-f", "4", "-n", "2", "-o", "t.json",
          cwd=tmp_path, command="tune")  # fmt: skip
    tuning.clear_cache()
    assert tuning.load_table(path).sizes("allreduce") == [2, 3]
    assert (
        json.loads((tmp_path / "t.json").read_text())["allreduce"]["*"]["2"]
        == (doc["allreduce"]["*"]["2"])
    )

    # `info` names the table in force.
    env = dict(os.environ, TOTALREDUCE_TUNING_FILE=path)
    info = subprocess.run(
        [sys.executable, "-m", "totalreduce.cli", "info"],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert f"tuning table in force: {path} for allreduce P=2,3" in info.stdout, info.stdout

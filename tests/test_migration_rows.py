"""docs/migration.md's rows run: every call of its totalreduce column, at P=2 under mpiexec
(tests/migration_rows.py fills the keywords a row shows without values with samples)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import import_torch
from totalreduce.launch import find_mpiexec

MPIEXEC = find_mpiexec()  # this Python's (the mpich wheel's, beside it), else PATH's

import_torch()

HERE = Path(__file__).parent
DOC = HERE.parent / "docs" / "migration.md"
TIMEOUT = 240


def table_rows() -> list[int]:
    """Line numbers of the tables' rows that have a totalreduce counterpart."""
    out = []
    for n, line in enumerate(DOC.read_text().splitlines(), 1):
        if not line.startswith("| ") or line.startswith("| ---"):
            continue
        cells = line.split(" | ")
        if cells[0] in ("| Horovod", "| torch.distributed", "| BlueFog", "| Decent-DP"):
            continue
        if cells[1].strip() != "none":
            out.append(n)
    return out


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec beside python or on PATH (mpich wheel)")
def test_every_row_of_the_migration_tables_runs() -> None:
    rows = table_rows()
    assert len(rows) > 50
    env = dict(os.environ, MPIEXEC_TIMEOUT=str(TIMEOUT - 20))
    r = subprocess.run(
        [str(MPIEXEC), "-n", "2", sys.executable, str(HERE / "migration_rows.py")],
        env=env, capture_output=True, text=True, timeout=TIMEOUT,
    )  # fmt: skip
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert out.count("ROWS DONE rank failed=0") == 2, out
    ran = {int(m) for m in re.findall(r"ROW (\d+) OK", r.stdout)}
    missing = [n for n in rows if n not in ran]
    assert not missing, f"docs/migration.md lines {missing} did not run:\n{out}"

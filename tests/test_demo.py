"""The README's main command, ``mpiexec -n 4 python -m totalreduce.demo``, at two ranks and
one step: a line at once (before ``init()``, which may compile), then exact sums.

Its ranks load the compiled lane from the cache that the suite's start compiled
(tests/conftest.py), so they must say nothing about compiling: the loading side of
totalreduce/lane/compile_once.py on the real lane (its compiling side is tested with a
small function, tests/engine/test_compile_once.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 120


def _mpiexec() -> str | None:
    beside = Path(sys.executable).parent / "mpiexec"
    return str(beside) if beside.exists() else shutil.which("mpiexec")


@pytest.mark.skipif(_mpiexec() is None, reason="no mpiexec (install the mpich wheel)")
def test_the_demo_says_what_it_does_at_once_and_sums_exactly(tmp_path: Path) -> None:
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, MPIEXEC_TIMEOUT=str(TIMEOUT - 10), PYTHONPATH=path)
    cmd = [str(_mpiexec()), "-n", "2", sys.executable, "-m", "totalreduce.demo", "--steps", "1"]
    proc = subprocess.run(
        cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT
    )
    out, err = proc.stdout, proc.stderr
    assert proc.returncode == 0, out + err
    lines = out.splitlines()
    assert lines[0].startswith("demo: 2 ranks, 1 steps of 8 allreduces"), out
    assert "the first run of an installation compiles the engine once" in lines[0]
    assert sum(line.startswith("demo: ") for line in lines) == 2, out  # rank 0's alone
    assert lines[-1] == "demo: 1 steps x 8 allreduces on 2 ranks: exact on every rank", out
    assert "compiling" not in err, err  # (another session compiling would make them wait)

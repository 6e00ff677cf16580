"""Run ``totalreduce bench`` under ``mpiexec`` from a test, with a timeout, into a folder."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from totalreduce.launch import find_mpiexec

MPIEXEC = find_mpiexec() or "mpiexec"  # this Python's (the mpich wheel's, beside it), else PATH's

TIMEOUT = 150


def bench(n: int, *args: str, cwd: Path, command: str = "bench", timeout: int = TIMEOUT) -> str:
    """``mpiexec -n n totalreduce COMMAND ARGS`` in ``cwd``; its output (it must exit 0)."""
    env = dict(os.environ, MPIEXEC_TIMEOUT=str(timeout - 20), PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        [str(MPIEXEC), "-n", str(n), sys.executable, "-m", "totalreduce.cli", command, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=cwd,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"mpiexec -n {n} {command} {' '.join(args)}: {out}"
    # a fresh installation's first run says on stderr that it compiles (or waits for
    # another process's compile): a line of its own, not the command's output
    err = "".join(ln for ln in proc.stderr.splitlines(keepends=True) if not _compile_notice(ln))
    return proc.stdout + err


def _compile_notice(line: str) -> bool:
    return line.startswith("totalreduce: compiling ") or (
        line.startswith("totalreduce: waiting for ") and "is compiling" in line
    )

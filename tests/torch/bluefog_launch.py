"""One ``mpiexec -n 4`` for every BlueFog check script of this folder, as two machines.

Starting four ranks that import torch costs seconds, so bluefog_api.py, bluefog_optimizers.py,
bluefog_examples.py, bluefog_seed.py and bluefog_windows.py run one after another in one launch of
run_scripts.py (each as if started alone, its lines tagged with its part's name), the first
time a test asks for one of them.  Hydra's ``-hosts localhost:2,127.0.0.1:2`` places ranks
0-1 and 2-3 on two "hosts" that are both this machine: MPI's node split, and so
``local_size()``, ``machine_size()`` and ``machine_rank()``, then see two machines of two
consecutive ranks, BlueFog's layout, and ``hierarchical_neighbor_allreduce`` runs between
machines.  ``mpiexec`` is the one beside this Python (the mpich wheel's), else PATH's.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
_BESIDE = Path(sys.executable).parent / "mpiexec"
MPIEXEC = str(_BESIDE) if _BESIDE.exists() else shutil.which("mpiexec")
HOSTS = "localhost:2,127.0.0.1:2"
TIMEOUT = 480

#: (part, script, arguments), in the order they run.
PARTS = [
    ("bluefog_api", "bluefog_api.py", []),
    ("bluefog_optimizers", "bluefog_optimizers.py", []),
    ("bluefog_seed", "bluefog_seed.py", []),
    # rank 3 sleeps 1.5 s before its asynchronous push-sum rounds (see the script)
    ("bluefog_windows", "bluefog_windows.py", ["--stall", "3:1.5"]),
    # the representative cases (bluefog_examples.REPRESENTATIVE); every case with --full
    ("bluefog_examples", "bluefog_examples.py",
     [] if os.environ.get("TOTALREDUCE_TEST_FULL", "") not in ("", "0") else ["--representative"]),
]  # fmt: skip

needs_mpiexec = pytest.mark.skipif(
    MPIEXEC is None, reason=f"no mpiexec beside {sys.executable} or on PATH (the mpich wheel)"
)


@functools.cache
def launch() -> tuple[bool, str, str]:
    """Run the launch once: (it exited 0, its standard output, its standard error)."""
    assert MPIEXEC is not None
    cmd = [MPIEXEC, "-hosts", HOSTS, "-n", "4", sys.executable,
           str(HERE / "run_scripts.py"), json.dumps(PARTS)]  # fmt: skip
    env = dict(os.environ, MPIEXEC_TIMEOUT=str(TIMEOUT - 20), PYTHONUNBUFFERED="1")
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else str(exc.stdout or "")
        err = exc.stderr.decode() if isinstance(exc.stderr, bytes) else str(exc.stderr or "")
        return False, out, f"{' '.join(cmd)} ran past {TIMEOUT} s\n{err}"
    return proc.returncode == 0, proc.stdout, proc.stderr


def lines(part: str) -> tuple[str, str]:
    """Part ``part``'s lines (the tag taken off) and the launch's whole output; the test
    fails, showing the output, when the launch did not exit 0."""
    ok, out, err = launch()
    whole = f"{out}\n--- stderr ---\n{err}"
    if not ok:
        pytest.fail(f"the BlueFog launch failed:\n{whole}")
    tag = f"[{part}] "
    return "\n".join(ln[len(tag) :] for ln in out.splitlines() if ln.startswith(tag)), whole


def stderr() -> str:
    """The launch's standard error (shared by every part)."""
    return launch()[2]

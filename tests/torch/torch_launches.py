"""One ``mpiexec`` per size for the torch check scripts of several test modules.

Importing torch is the slow part of a launch, so the scripts the tests of
test_torch_mpi.py, test_backend_ops.py and test_optimizer_ddp.py plan at one size run one
after another in one launch of run_scripts.py (each as if started alone, its lines tagged
with its part's name); the launch runs when a test first asks for its part.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "mpi"))
from launch_modes import Launches, mpiexec  # noqa: E402


def _start(n: Any, parts: list[tuple[str, str, list[str], int]], where: str) -> str:
    spec = json.dumps([part[:3] for part in parts])
    return mpiexec(n, [str(HERE / "run_scripts.py"), spec], sum(part[3] for part in parts))


LAUNCHES = Launches(_start)


def plan(n: int, name: str, script: str, args: list[str], timeout: int) -> None:
    """Plan part ``name`` (``script`` with ``args``, given ``timeout`` s) into the launch at
    ``n`` ranks."""
    LAUNCHES.plan(n, (name, script, args, timeout))


def lines(n: int, name: str) -> tuple[str, str]:
    """Part ``name``'s lines from the launch at ``n`` ranks, and the launch's whole output."""
    return LAUNCHES.lines(n, name)

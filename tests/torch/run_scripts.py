"""Run under ``mpiexec -n P``: several check scripts of this folder one after another in one
process (importing torch is the slow part of a launch), each as if started alone
(``__main__``, its own ``sys.argv``), the lines each prints tagged with its part's name.

Usage: ``run_scripts.py PARTS`` with ``PARTS`` a JSON list of ``[name, script, [args...]]``.
"""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "mpi"))
from launch_modes import Tagged  # noqa: E402


def main() -> None:
    parts = json.loads(sys.argv[1])
    tagged = Tagged()
    for name, script, args in parts:
        sys.stdout = tagged.mode(name)
        sys.argv = [str(HERE / script), *args]
        runpy.run_path(str(HERE / script), run_name="__main__")
    tagged.flush()


if __name__ == "__main__":
    main()

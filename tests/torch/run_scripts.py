"""Run under ``mpiexec -n P``: several check scripts of this folder one after another in one
process (importing torch is the slow part of a launch), each as if started alone
(``__main__``, its own ``sys.argv``), the lines each prints tagged with its part's name.

Usage: ``run_scripts.py PARTS`` with ``PARTS`` a JSON list of ``[name, script, [args...]]``
or ``[name, script, [args...], directory]`` (the part runs there); a script path is relative
to this folder unless absolute.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "mpi"))
from launch_modes import Tagged  # noqa: E402


def main() -> None:
    parts = json.loads(sys.argv[1])
    tagged = Tagged()
    home = os.getcwd()
    for name, script, args, *where in parts:
        path = str(HERE / script)  # an absolute script stays itself
        sys.stdout = tagged.mode(name)
        sys.argv = [path, *args]
        sys.path.insert(0, os.path.dirname(path))  # as python puts a script's folder
        os.chdir(where[0] if where else home)
        try:
            runpy.run_path(path, run_name="__main__")
        finally:
            sys.path.remove(os.path.dirname(path))
    os.chdir(home)
    tagged.flush()


if __name__ == "__main__":
    main()

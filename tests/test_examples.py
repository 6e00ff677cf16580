"""The examples that draw a PNG take ``--plot ''`` to draw nothing (run under ``mpiexec -n 2``)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "mpi"))
from launch_modes import Launches, mpiexec  # noqa: E402

from totalreduce.launch import find_mpiexec

MPIEXEC = find_mpiexec()  # this Python's (the mpich wheel's, beside it), else PATH's

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
TIMEOUT = 180

pytestmark = pytest.mark.skipif(
    MPIEXEC is None, reason="no mpiexec beside python or on PATH (install the mpich wheel)"
)


def mpirun(cwd: Path, script: str, *args: str) -> str:
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    return mpiexec(2, [str(EXAMPLES / script), *args], TIMEOUT, cwd=str(cwd), PYTHONPATH=path)


def test_timeline_example_plots_or_not(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the picture needs matplotlib")
    drawn, bare = tmp_path / "drawn", tmp_path / "bare"
    drawn.mkdir()
    bare.mkdir()
    mpirun(drawn, "timeline_step.py", "--steps", "1", "--plot", "step.png")
    assert (drawn / "step.png").read_bytes()[:4] == b"\x89PNG"
    out = mpirun(bare, "timeline_step.py", "--steps", "1", "--plot", "")
    assert list(bare.glob("*.png")) == [], out
    # the traces are still written and merged: every layer's op on both ranks
    merged = json.loads((bare / "timeline_step.json").read_text())
    ops = [e for e in merged if e.get("cat") == "op"]
    assert sorted({e["pid"] for e in ops}) == [0, 1]
    assert len(ops) == 2 * 8
    assert all(e["args"]["status"] == "done" for e in ops)


TORCH_EXAMPLES = [
    ("train_distributed_optimizer.py", ["--epochs", "1", "--points", "50"]),
    ("train_decentralized.py", ["--epochs", "1", "--points", "50"]),
    ("train_ddp_comm_hook.py", ["--epochs", "1", "--points", "50"]),
]


def _start(n: Any, parts: list[list[Any]], where: str) -> str:
    """One ``mpiexec`` runs every torch example planned, one after another in each process,
    each in a directory of its own under ``where`` (tests/torch/run_scripts.py: importing
    torch is the slow part of a launch)."""
    _ROOM.append(Path(where))
    for part in parts:
        (Path(where) / part[0]).mkdir()
    spec = json.dumps([[*part, str(Path(where) / part[0])] for part in parts])
    return mpirun(Path(where), str(RUN_SCRIPTS), spec)


RUN_SCRIPTS = ROOT / "tests" / "torch" / "run_scripts.py"
LAUNCHES = Launches(_start)
_ROOM: list[Path] = []  # where the launch ran (the first test's directory)
for _script, _args in TORCH_EXAMPLES:
    LAUNCHES.plan(2, [_script, str(EXAMPLES / _script), [*_args, "--plot", ""]])


@pytest.mark.parametrize("script, args", TORCH_EXAMPLES)
def test_torch_examples_draw_nothing_with_an_empty_plot(
    tmp_path: Path, script: str, args: list[str]
) -> None:
    pytest.importorskip("torch", reason="the training examples need torch")
    out, whole = LAUNCHES.lines(2, script, str(tmp_path))
    assert "epoch   1" in out, whole
    assert list((_ROOM[0] / script).glob("*.png")) == [], whole

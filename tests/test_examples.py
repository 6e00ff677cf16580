"""The examples that draw a PNG take ``--plot ''`` to draw nothing (run under ``mpiexec -n 2``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
TIMEOUT = 180

pytestmark = pytest.mark.skipif(
    shutil.which("mpiexec") is None, reason="mpiexec not on PATH (install the mpich wheel)"
)


def mpirun(cwd: Path, script: str, *args: str) -> str:
    env = dict(
        os.environ,
        MPIEXEC_TIMEOUT=str(TIMEOUT - 20),
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    )
    cmd = ["mpiexec", "-n", "2", sys.executable, str(EXAMPLES / script), *args]
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}:\n{out}"
    return out


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


@pytest.mark.parametrize(
    "script, args",
    [
        ("train_distributed_optimizer.py", ["--epochs", "1", "--points", "50"]),
        ("train_decentralized.py", ["--epochs", "1", "--points", "50"]),
        ("train_ddp_comm_hook.py", ["--epochs", "1", "--points", "50"]),
    ],
)
def test_torch_examples_draw_nothing_with_an_empty_plot(
    tmp_path: Path, script: str, args: list[str]
) -> None:
    pytest.importorskip("torch", reason="the training examples need torch")
    out = mpirun(tmp_path, script, *args, "--plot", "")
    assert "epoch   1" in out
    assert list(tmp_path.glob("*.png")) == [], out

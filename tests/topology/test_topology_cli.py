"""The ``totalreduce topology`` command (totalreduce/topology/cli.py) and its drawing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from totalreduce.topology import get_topology
from totalreduce.topology.cli import format_matrix, main
from totalreduce.topology.plot import INSTALL_HINT, plot_topology

ROOT = Path(__file__).resolve().parents[2]


def test_prints_matrix_checks_and_rho(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["exp", "-n", "8", "--step", "1"]) == 0
    out = capsys.readouterr().out
    assert "topology 'exp' with world size 8: period 3, step 1 (phase 1)" in out
    assert "row stochastic: yes, column stochastic: yes" in out
    assert "rho(W(1)) = 1.000000" in out
    assert "rho(product over the period of 3) = 0.000000" in out
    assert "0.500" in out


@pytest.mark.parametrize(
    "argv, expect",
    [
        (["alternating-exp-ring", "-n", "8", "--local-size", "2"], "period 4"),
        (["exponential", "-n", "9", "--base", "3"], "rho(W(0)) = "),
        (["ring-graph", "-n", "5", "--style", "left"], "column stochastic: yes"),
        (["mesh-grid-2d", "-n", "8", "--shape", "2x4"], "period 1"),
        (["star", "-n", "4", "--center", "2", "--precision", "2"], "0.75"),
        (["exponential-2", "-n", "8", "--one-peer"], "of 3) = 0.000000"),
        (["star", "-n", "5", "--one-peer"], "column stochastic: no"),
    ],
)
def test_options_reach_the_topology(
    argv: list[str], expect: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 0
    assert expect in capsys.readouterr().out


def test_usage_errors_return_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["torus", "-n", "4"]) == 2
    err = capsys.readouterr().err
    assert "unknown topology 'torus'" in err and "exponential-2" in err
    assert main(["alternating-exp-ring", "-n", "10", "--local-size", "4"]) == 2
    assert "not a multiple of local_size 4" in capsys.readouterr().err
    assert main(["ring", "-n", "4", "--base", "2"]) == 2
    assert main(["mesh-grid-2d", "-n", "4", "--shape", "two"]) == 2
    assert "ROWSxCOLS" in capsys.readouterr().err
    assert main(["ring", "-n", "4", "--one-peer"]) == 2
    assert "--one-peer needs a static graph" in capsys.readouterr().err
    assert main(["ring", "-n", "4", "--step", "-1"]) == 2
    assert "step must be >= 0, got -1" in capsys.readouterr().err


def test_format_matrix_is_compact_and_fixed() -> None:
    text = format_matrix(np.array([[0.5, 0.5, 0.0], [0.5, 0.5, 0.0], [0.0, 0.0, 1.0]]), 2)
    lines = text.splitlines()
    assert len(lines) == 4
    assert lines[1].split() == ["0", "0.50", "0.50", "."]
    assert lines[3].split() == ["2", ".", ".", "1.00"]


def test_plot_writes_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib (totalreduce[plot])")
    target = tmp_path / "exp2.png"
    assert main(["exponential-2", "-n", "8", "--plot", str(target)]) == 0
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"drew {target}" in capsys.readouterr().out
    single = tmp_path / "one.png"
    plot_topology(get_topology("complete", 1), single)
    assert single.stat().st_size > 0


def test_plot_without_matplotlib_says_how_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for module in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(ImportError, match=r"pip install totalreduce\[plot\]"):
        plot_topology(get_topology("ring", 4), tmp_path / "x.png")
    assert main(["ring", "-n", "4", "--plot", str(tmp_path / "x.png")]) == 2
    assert INSTALL_HINT in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_runs_as_a_module() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "totalreduce.topology.cli", "ring", "-n", "5"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "rho(product over the period of 2) = 0.027778" in result.stdout

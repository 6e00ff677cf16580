"""The ``totalreduce`` command: ``--version``, ``info``, ``timeline``."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

import totalreduce
from totalreduce.cli import main
from totalreduce.timeline import Timeline, load

ROOT = Path(__file__).resolve().parents[1]


def test_version_matches_the_package_metadata(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    out = capsys.readouterr().out
    declared = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M)
    assert declared is not None
    assert out == f"totalreduce {declared.group(1)}\n"
    assert totalreduce.__version__ == declared.group(1)


def test_info_reports_torch(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    (line,) = [ln for ln in out.splitlines() if ln.startswith("torch")]
    try:
        import torch
    except ImportError:
        assert line.startswith("torch: not installed")
    else:
        assert line.startswith(f"torch {torch.__version__} (")
        assert line.endswith("totalreduce.torch imports")
    assert "timeline = " in out  # the configuration is listed
    assert re.search(r"; thread level (SINGLE|FUNNELED|SERIALIZED|MULTIPLE)$", out, re.M)


def test_info_says_why_totalreduce_torch_does_not_import(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("torch", reason="the failure is reported only when torch imports")
    monkeypatch.setitem(sys.modules, "totalreduce.torch", None)  # makes its import fail
    assert main(["info"]) == 0
    (line,) = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("torch")]
    assert "totalreduce.torch does not import (" in line
    assert "totalreduce.torch" in line.split("(", 1)[1]  # the import error's own message


def test_timeline_merge_then_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib", reason="plotting needs matplotlib")
    for rank in (0, 1):
        with Timeline(str(tmp_path / "t"), rank=rank) as tl:
            tl.op("g", 0, "submitted", 0)
            tl.op("g", 0, "done", 0)
    merged = tmp_path / "merged.json"
    files = [str(tmp_path / "t.0.json"), str(tmp_path / "t.1.json")]
    assert main(["timeline", "merge", str(merged), *files]) == 0
    assert {e["pid"] for e in load(merged) if e.get("cat") == "op"} == {0, 1}
    png = tmp_path / "step.png"
    assert main(["timeline", "plot", str(merged), "-o", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert "wrote" in capsys.readouterr().out


def test_timeline_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["timeline"]) == 2
    (tmp_path / "x.json").write_text("[]")
    assert main(["timeline", "merge", str(tmp_path / "m.json"), str(tmp_path / "x.json")]) == 1
    assert "no totalreduce_clock" in capsys.readouterr().err
    assert main(["timeline", "plot", str(tmp_path / "missing.json"), "-o", "x.png"]) == 1

"""The API reference builds from the docstrings, with Sphinx's warnings as errors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_api_reference_builds_without_warnings(tmp_path: Path) -> None:
    pytest.importorskip("sphinx", reason='the docs build needs Sphinx: pip install ".[docs]"')
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    cmd = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html"]
    cmd += [str(ROOT / "docs"), str(tmp_path / "html")]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    api = (tmp_path / "html" / "api.html").read_text(encoding="utf-8")
    # autodoc found the code: the functions are documented from their docstrings
    assert 'id="totalreduce.allreduce_async"' in api
    assert "Start an allreduce of" in api
    more = (tmp_path / "html" / "api_more.html").read_text(encoding="utf-8")
    assert 'id="totalreduce.timeline.Timeline.segment"' in more

"""The local world's C functions (``transport/local_calls.py``) compile in the functions and
constants of ``transport/local_tables.py``; Numba checks a cached function against its own
file only, so a change to any of ``local_calls.SOURCES`` must drop their cached code."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from totalreduce.transport import local_calls

PACKAGE = Path(local_calls.__file__).resolve().parents[1]


def _package_imports(rel: str) -> set[str]:
    """The package files ``rel`` imports from (relative imports, as paths under the package)."""
    here = Path(rel).parent
    found = set()
    for node in ast.walk(ast.parse((PACKAGE / rel).read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = here
            for _ in range(node.level - 1):
                base = base.parent
            names = [node.module] if node.module else [a.name for a in node.names]
            for name in names:
                path = base / (name.replace(".", "/") + ".py")
                if (PACKAGE / path).is_file():
                    found.add(path.as_posix())
    return found


def test_the_sources_cover_what_the_c_functions_compile_in() -> None:
    for rel in local_calls.SOURCES:
        assert (PACKAGE / rel).is_file(), rel
    sources = set(local_calls.SOURCES)
    for rel in ("transport/local_calls.py", "transport/local_tables.py"):
        assert rel in sources
        # mpi_native (the record's slots) is no part of the compiled code
        assert _package_imports(rel) - {"transport/mpi_native.py"} <= sources, rel


_REPORT = (
    "import totalreduce.transport.local_native as n, totalreduce.transport.local_calls as c; "
    "print(n.isend._cache_hits, n.testsome._cache_hits, c._STAMP)"
)


def _import(cache: Path) -> tuple[int, int, Path]:
    """Import the local world's compiled layer in a new process caching in ``cache``."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache)}
    out = subprocess.run(
        [sys.executable, "-c", _REPORT], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    a, b, stamp = out.stdout.split()
    return int(a), int(b), Path(stamp)


@pytest.mark.full  # (two fresh compiles of the C functions: 18 s of the suite)
def test_a_changed_source_drops_the_cached_c_functions(tmp_path: Path) -> None:
    assert _import(tmp_path)[:2] == (0, 0)  # compiled, and cached
    hits_a, hits_b, stamp = _import(tmp_path)
    assert (hits_a, hits_b) == (1, 1)  # loaded from the cache
    assert stamp.read_text() == local_calls.sources_digest()
    stamp.write_text("the digest of an older local_tables.py")
    assert _import(tmp_path)[:2] == (0, 0)  # compiled again
    assert stamp.read_text() == local_calls.sources_digest()

"""Several check modes in one launch: a process start costs more than most checks.

The scripts run under ``mpiexec`` (check_engine.py, check_lane.py) take ``MODE[,MODE...]``
and run each mode on an engine of its own, their lines tagged ``[mode]`` (:func:`run_modes`;
tests/torch/run_scripts.py runs whole scripts so); the tests ask :class:`Launches` for one
mode's lines, and each launch runs once, with every mode its tests planned, the first time
one of them asks.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
from collections.abc import Callable, Hashable
from typing import Any


class Tagged(io.TextIOBase):
    """Standard output while modes run: each line goes out whole (one write) as
    ``[mode] line``, so the test can tell the modes' reports apart."""

    def __init__(self) -> None:
        self.tag = ""
        self.pending = ""

    def mode(self, mode: str) -> Tagged:
        self.flush()
        self.tag = f"[{mode}] "
        return self

    def write(self, text: str) -> int:
        *lines, self.pending = (self.pending + text).split("\n")
        if lines:
            os.write(1, "".join(f"{self.tag}{line}\n" for line in lines).encode())
        return len(text)

    def flush(self) -> None:
        if self.pending:
            self.write("\n")


def run_modes(table: dict[str, Callable[[], None]], alone: frozenset[str] = frozenset()) -> None:
    """Run the modes ``sys.argv[1]`` names (comma-separated) in order; each entry of
    ``table`` starts its engine, runs its check and shuts the engine down.  The modes in
    ``alone`` end the job (a rank dies): they run only by themselves."""
    wanted = sys.argv[1].split(",")
    unknown = [m for m in wanted if m not in table]
    if unknown:
        raise SystemExit(f"unknown modes {unknown}; known: {sorted(table)}")
    if len(wanted) > 1 and alone & set(wanted):
        raise SystemExit(f"modes {sorted(alone & set(wanted))} end the job: run them alone")
    tagged = Tagged()
    for mode in wanted:
        sys.stdout = tagged.mode(mode)
        table[mode]()
    tagged.flush()


def mpiexec(
    n: int, argv: list[str], timeout: int, cwd: str | None = None, unset: tuple[str, ...] = (),
    **env_vars: str,
) -> str:  # fmt: skip
    """``mpiexec -n n python argv...`` with ``timeout`` (``MPIEXEC_TIMEOUT`` 10 s less, so
    MPI's own limit ends a hung job first), ``env_vars`` set and ``unset`` removed from the
    environment: its output, or AssertionError with it."""
    env = dict(os.environ, MPIEXEC_TIMEOUT=str(timeout - 10), PYTHONUNBUFFERED="1", **env_vars)
    for name in unset:
        env.pop(name, None)
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")  # this python's MPI
    cmd = [beside if os.path.exists(beside) else "mpiexec", "-n", str(n), sys.executable, *argv]
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}:\n{out}"
    return out


class Launches:
    """The launches tests share: ``plan(key, entry)`` at import (a decorator's time),
    ``lines(key, tag, where)`` in a test; ``start(key, entries, where)`` runs one launch of
    every entry planned at ``key`` (``where``: what the first test that asks gives, a
    directory say) and returns its output, raising AssertionError or TimeoutExpired when it
    failed.  An entry is a mode, or what a launcher needs to run one tagged part."""

    def __init__(self, start: Callable[[Hashable, list[Any], str], str]) -> None:
        self.start = start
        self.planned: dict[Hashable, list[Any]] = {}
        self.runs: dict[Hashable, tuple[bool, str]] = {}

    def plan(self, key: Hashable, entry: Any) -> None:
        self.planned.setdefault(key, []).append(entry)

    def lines(self, key: Hashable, mode: str, where: str = "") -> tuple[str, str]:
        """The lines tagged ``mode`` (the tag taken off) and the launch's whole output."""
        if key not in self.runs:
            modes = self.planned[key]
            try:
                self.runs[key] = (True, self.start(key, modes, where))
            except (AssertionError, subprocess.TimeoutExpired) as exc:
                self.runs[key] = (False, f"the launch of {modes} at {key} failed: {exc}")
        ok, out = self.runs[key]
        if not ok:
            import pytest  # not in the launched scripts, which import this module too

            pytest.fail(out)
        tag = f"[{mode}] "
        mine = [ln[len(tag) :] for ln in out.splitlines() if ln.startswith(tag)]
        return "\n".join(mine), out

"""Compiling once per installation (totalreduce/lane/compile_once.py): processes started
together on an empty cache compile once, the others wait and load; a compiler that dies
holds nobody up; stale code is dropped only under the exclusive lock.

A small Numba function stands in for the lane (its compile takes a fraction of a second,
held longer by a sleep inside the compiling call), so these tests cost seconds, not a
lane compile; tests/test_demo.py checks the lane itself, loading from the cache that the
suite's start compiled."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from totalreduce.lane import compile_once as co

KERNEL = """
from numba import njit


@njit(cache=True)
def kernel(x):
    return x + 1


@njit(cache=True)
def kernel2(x):
    return x + 2
"""

#: One process: waits for the file ``go``, then compiles the two kernels once per
#: installation, and prints how many of their specializations it compiled itself (not
#: loaded from the cache) and whether they work.  The compiling call holds the lock
#: ``HOLD`` s longer: at its end (``hold``), or between the kernels (``die``: the parent
#: kills it there, with the first kernel in the cache and the second not).
CHILD = """
import os, sys, time
from pathlib import Path
from numba import types
from totalreduce.lane import compile_once as co

here, hold, how = Path(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
sys.path.insert(0, str(here))
from kernel_mod import kernel, kernel2

co.WAIT_NOTICE_S = 0.2


def compile():
    kernel.compile((types.int64,))  # (loading, not compiling: raises when missing)
    if how == "die":
        (here / "holding").write_text(str(os.getpid()))
        time.sleep(hold)
    kernel2.compile((types.int64,))
    if how == "hold":
        time.sleep(hold)


(here / f"ready.{sys.argv[4]}").touch()
while not (here / "go").exists():
    time.sleep(0.01)
co.compile_once(compile, kernel, name="kernel", what="the test kernel", takes="a moment")
n = len(kernel.overloads) + len(kernel2.overloads)
loaded = sum(kernel.stats.cache_hits.values()) + sum(kernel2.stats.cache_hits.values())
print(f"compiled={n - loaded} result={kernel(41) + kernel2(40)}", flush=True)
"""


def _kernel_dir(tmp_path: Path) -> Path:
    (tmp_path / "kernel_mod.py").write_text(KERNEL)
    (tmp_path / "cache").mkdir()
    return tmp_path


#: Runs its arguments as a child: a process whose parent is not the test's (a compiler that
#: is no sibling of the processes waiting for it, which then say that they wait).
VIA = "import subprocess, sys; sys.exit(subprocess.call(sys.argv[1:]))"


def _start(
    here: Path, tag: str, hold: float, how: str = "hold", via: bool = False, **kw: Any
) -> Any:
    env = dict(os.environ, NUMBA_CACHE_DIR=str(here / "cache"), PYTHONUNBUFFERED="1")
    first = [sys.executable, "-c", VIA] if via else []
    return subprocess.Popen(
        [*first, sys.executable, "-c", CHILD, str(here), str(hold), how, tag],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )


def _wait_for(path: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        time.sleep(0.02)


def test_processes_started_together_compile_once_and_all_run(tmp_path: Path) -> None:
    here = _kernel_dir(tmp_path)
    procs = [_start(here, str(i), hold=1.0) for i in range(3)]
    for i in range(3):
        _wait_for(here / f"ready.{i}")
    (here / "go").touch()
    outs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outs
    assert all("result=84" in out for out, _ in outs), outs
    compiled = sorted(out.split()[0] for out, _ in outs)
    assert compiled == ["compiled=0", "compiled=0", "compiled=2"], outs
    said = [err for _, err in outs if "compiling the test kernel" in err]
    assert len(said) == 1, outs
    assert "(Numba), once for this installation: a moment; later runs load it from" in said[0]
    # the others are its siblings (the ranks of one mpiexec, say): its line was theirs too
    assert not any("waiting for" in err for _, err in outs), outs
    lock = here / "cache"
    assert list(lock.rglob("kernel.lock")), list(lock.rglob("*"))


def test_a_compiler_killed_holding_the_lock_blocks_nobody(tmp_path: Path) -> None:
    here = _kernel_dir(tmp_path)
    dying = _start(here, "dying", hold=120, how="die", via=True, start_new_session=True)
    _wait_for(here / "ready.dying")
    (here / "go").touch()
    _wait_for(here / "holding")  # it holds the exclusive lock, one kernel compiled
    waiting = _start(here, "waiting", hold=0)
    _wait_for(here / "ready.waiting")
    time.sleep(1.0)  # long enough to say it waits (WAIT_NOTICE_S is 0.2 s in the children)
    assert waiting.poll() is None, waiting.communicate()
    holder = int((here / "holding").read_text())
    os.killpg(dying.pid, signal.SIGKILL)
    dying.communicate(timeout=30)
    out, err = waiting.communicate(timeout=60)
    assert waiting.returncode == 0, (out, err)
    # the first kernel loaded from what it left, the second compiled here
    assert out.split()[:2] == ["compiled=1", "result=84"], (out, err)
    # one line while it waited, naming the holder (no sibling), one when compiling
    assert err.count(f"waiting for process {holder}, which is compiling the test kernel") == 1
    assert err.count("compiling the test kernel (Numba)") == 1, err


def _kernel(tmp_path: Path) -> Any:
    (tmp_path / "kernel_here.py").write_text(KERNEL)
    sys.path.insert(0, str(tmp_path))
    try:
        import kernel_here
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("kernel_here", None)
    return kernel_here.kernel


def test_stale_code_is_dropped_only_under_the_exclusive_lock(tmp_path: Path) -> None:
    from numba import types

    kernel = _kernel(tmp_path)
    where = co.cache_dir(kernel)
    assert where is not None
    seen: list[str] = []

    def forget() -> None:
        other = os.open(where / "kernel.lock", os.O_RDONLY)
        try:
            fcntl.flock(other, fcntl.LOCK_SH | fcntl.LOCK_NB)
            seen.append("a loader could have held the lock")
        except BlockingIOError:
            seen.append("exclusive")
        finally:
            os.close(other)

    co.compile_once(
        lambda: kernel.compile((types.int64,)),
        kernel,
        name="kernel",
        what="the test kernel",
        takes="a moment",
        current=lambda: False,
        forget=forget,
    )
    assert seen == ["exclusive"]
    assert kernel(1) == 2
    # current, and everything loaded: no lock taken exclusively, nothing dropped
    seen.clear()
    co.compile_once(
        lambda: kernel.compile((types.int64,)),
        kernel,
        name="kernel",
        what="the test kernel",
        takes="a moment",
        forget=forget,
    )
    assert seen == []


def test_without_a_lock_file_each_process_compiles_for_itself(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from numba import types

    kernel = _kernel(tmp_path)

    class Probe:  # a cache directory where no lock file can be made
        class _cache:
            cache_path = str(tmp_path / "no such directory")

    forgot: list[bool] = []
    with caplog.at_level("WARNING", logger="totalreduce.compile"):
        co.compile_once(
            lambda: kernel.compile((types.int64,)),
            Probe(),
            name="kernel",
            what="the test kernel",
            takes="a moment",
            forget=lambda: forgot.append(True),
        )
    assert forgot == [True]
    assert kernel(1) == 2
    assert [r.getMessage().split(" (Numba)")[0] for r in caplog.records] == [
        "totalreduce: compiling the test kernel"
    ]

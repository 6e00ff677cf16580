"""A peer that dies makes the survivor raise, then exit normally: ``mpiexec -n 2`` runs.

Rank 1 dies at step 2 (an exception, ``os._exit``, SIGKILL) under plain DDP on the
``"totalreduce"`` backend, DDP with ``allreduce_hook`` and ``DistributedOptimizer``
(check_dead_peer.py).  Rank 0 must raise a ``RuntimeError`` naming the op and rank 1
from the training step and from a plain collective after it, and its process must
end with status 0 (no signal, no hang) within 30 s of rank 1's death.

Each rank runs under a small supervisor (its own exit status is otherwise hidden
behind ``mpiexec``'s) that reports a death by signal N as exit status 128 + N, as a
shell does.  MPICH's Hydra SIGKILLs every other process when a process it launched
itself dies of a signal, whatever ``-disable-auto-cleanup`` says (the waitpid loop
of hydra's ``pmip.c``): that is the launcher's policy, which no library can answer,
so the SIGKILL cases kill the supervisor's child.  Without ``-disable-auto-cleanup``
Hydra ends every rank once one exits abnormally; only a peer dying of an exception
(its interpreter finalizes MPI) leaves the survivor to raise: the last case.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import import_torch
from totalreduce.launch import find_mpiexec

MPIEXEC = find_mpiexec()  # this Python's (the mpich wheel's, beside it), else PATH's

import_torch()

HERE = Path(__file__).parent
TIMEOUT = 75
EXIT_WITHIN_S = 30

pytestmark = pytest.mark.skipif(
    MPIEXEC is None, reason="no mpiexec beside python or on PATH (install the mpich wheel)"
)

#: The op each path's step names when its peer is gone, and the plain collective's.
OPS = {
    "ddp": (
        r"torch\.distributed\.0\.allreduce\.",
        r"torch\.distributed\.0\.allreduce\.float32\.3\.",
    ),
    "hook": (r"ddp\.bucket\d", r"'after'"),
    "optimizer": (r"grad\.bucket\.\d", r"'after'"),
}

KEEP = ["-disable-auto-cleanup"]
#: (path, death, mpiexec flags, extra argument, the survivor's exit status)
#: DDP (where a dead peer once meant a segfault) meets every death; each other path a
#: SIGKILL and one more, so every (path, death) pair's code is crossed by some case.
CASES = [
    *((path, death, KEEP, "", 0) for path, death in (
        ("ddp", "raise"), ("ddp", "exit"), ("ddp", "kill"),
        ("hook", "kill"), ("hook", "exit"), ("optimizer", "kill"), ("optimizer", "raise"),
    )),
    ("ddp", "raise", [], "", 0),  # Hydra's default cleanup
    ("optimizer", "exit", KEEP, "uncaught", 1),  # the error ends the program
]  # fmt: skip


#: By default one case per path and per death runs (every path and every death is met);
#: the rest with ``pytest --full``.
FULL = {("ddp", "raise", "KEEP"), ("ddp", "exit", "KEEP"), ("ddp", "kill", "KEEP"),
        ("hook", "exit", "KEEP"), ("optimizer", "kill", "KEEP"),
        ("optimizer", "raise", "KEEP")}  # fmt: skip


def _case(c: tuple[Any, ...]) -> Any:
    full = (c[0], c[1], "KEEP" if c[2] == KEEP else "") in FULL
    return pytest.param(*c, marks=pytest.mark.full) if full else c


@pytest.mark.parametrize(
    ("path", "death", "flags", "extra", "status"),
    [_case(c) for c in CASES],
    ids=[
        f"{c[0]}-{c[1]}{'-cleanup' if not c[2] else ''}{'-' + c[3] if c[3] else ''}" for c in CASES
    ],
)
def test_survivor_raises_and_exits(
    path: str, death: str, flags: list[str], extra: str, status: int
) -> None:
    env = dict(os.environ, MPIEXEC_TIMEOUT=str(TIMEOUT - 10), PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        [
            str(MPIEXEC),
            *flags,
            "-n",
            "2",
            sys.executable,
            str(HERE / "check_dead_peer.py"),
            path,
            death,
            *([extra] if extra else []),
        ],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=env,
    )
    out = proc.stdout + proc.stderr
    step_op, plain_op = OPS[path]
    exit_line = re.search(r"RANK 0 EXIT STATUS (-?\d+) AT ([\d.]+)", out)
    assert exit_line is not None, f"the survivor did not end:\n{out}"
    assert int(exit_line.group(1)) == status, (
        f"the survivor ended with {exit_line.group(1)}:\n{out}"
    )
    raised = re.search(r"SURVIVOR RAISED (\w+): (.*)", out)
    assert raised is not None, out
    assert re.search(step_op, raised.group(2)) and "rank 1" in raised.group(2), raised.group(0)
    again = re.search(r"SURVIVOR WORK RAISED (\w+): (.*)", out)
    assert again is not None, out
    assert re.search(plain_op, again.group(2)) and "rank 1" in again.group(2), again.group(0)
    died = re.search(r"DYING AT ([\d.]+)", out)
    assert died is not None, out
    assert float(exit_line.group(2)) - float(died.group(1)) < EXIT_WITHIN_S, out

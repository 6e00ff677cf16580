"""Start ``totalreduce serve`` under ``mpiexec`` and client processes beside it, for tests.

Every process started here has a timeout (``MPIEXEC_TIMEOUT`` for the
services, ``timeout=`` for the clients), and :meth:`Served.stop` always ends
the services (SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from totalreduce.launch import find_mpiexec

#: This Python's mpiexec: the one beside it (the mpich wheel's, also in a virtual environment
#: that is not activated), else the one on PATH.
MPIEXEC = find_mpiexec() or str(Path(sys.executable).parent / "mpiexec")


def have_mpiexec() -> bool:
    return os.path.exists(MPIEXEC)


def layout_for(n: int) -> tuple[int, int]:
    """(nodes, local clients) of a daemon world of ``n`` clients: two nodes when even."""
    return (2, n // 2) if n % 2 == 0 and n > 1 else (1, n)


@dataclass
class Served:
    nodes: int
    local_clients: int
    directory: Path
    proc: subprocess.Popen[str]
    lines: list[str] = field(default_factory=list)
    log: Path | None = None

    def socket(self, node: int) -> Path:
        return self.directory / f"node{node}.sock"

    def client_env(self, rank: int, **extra: str) -> dict[str, str]:
        node, local = divmod(rank, self.local_clients)
        env = dict(os.environ, PYTHONUNBUFFERED="1", **extra)
        env.update(
            TOTALREDUCE_SERVICE="daemon",
            TOTALREDUCE_SOCKET=str(self.socket(node)),
            TOTALREDUCE_LOCAL_RANK=str(local),
        )
        return env

    def stderr(self) -> str:
        return self.log.read_text() if self.log is not None and self.log.exists() else ""

    def stop(self, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode


def serve(
    nodes: int,
    local_clients: int,
    directory: Path,
    *,
    timeout: float = 600,
    start_timeout: float = 180,
    extra: tuple[str, ...] = (),
    **env_vars: str,
) -> Served:
    """Start the services and wait until every node printed its socket line."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    log = directory / "serve.log"
    env = dict(os.environ, MPIEXEC_TIMEOUT=str(int(timeout)), PYTHONUNBUFFERED="1", **env_vars)
    cmd = [
        MPIEXEC, "-n", str(nodes), sys.executable, "-m", "totalreduce.cli", "serve",
        "--local-clients", str(local_clients), "--socket-dir", str(directory), *extra,
    ]  # fmt: skip
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
    served = Served(nodes, local_clients, directory, proc, log=log)
    assert proc.stdout is not None
    lines: queue.Queue[str] = queue.Queue()

    def read(out: Any) -> None:  # a thread: buffered reads never hide a line from select
        for line in out:
            lines.put(line)

    threading.Thread(target=read, args=(proc.stdout,), daemon=True).start()
    deadline = time.monotonic() + start_timeout
    while len(served.lines) < nodes:
        left = deadline - time.monotonic()
        if left <= 0 or proc.poll() is not None:
            served.stop()
            raise AssertionError(
                f"totalreduce serve did not start ({served.lines}):\n{served.stderr()}"
            )
        try:
            line = lines.get(timeout=min(left, 1.0))
        except queue.Empty:
            continue
        # mpiexec may run two nodes' lines together: split them again
        for part in re.findall(r"totalreduce serve: node \d+ of .*?of \d+\)", line):
            served.lines.append(part)
    return served


def run_clients(
    served: Served,
    args: list[str],
    *,
    timeout: float = 120,
    check: bool = True,
    **env_vars: str,
) -> list[subprocess.CompletedProcess[str]]:
    """Run ``python ARGS`` once per client rank, all at once; their results by rank."""
    size = served.nodes * served.local_clients
    procs = [
        subprocess.Popen(
            [sys.executable, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=served.client_env(r, **env_vars),
        )
        for r in range(size)
    ]
    deadline = time.monotonic() + timeout
    results = []
    for r, p in enumerate(procs):
        try:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            outs = [q.communicate()[0] for q in procs]
            text = "\n".join(f"--- client {k}:\n{o[-3000:]}" for k, o in enumerate(outs))
            raise AssertionError(
                f"client {r} did not finish within {timeout} s:\n{text}\n--- service log:\n"
                f"{served.stderr()[-20000:]}"
            ) from None
        results.append(subprocess.CompletedProcess(p.args, p.returncode, out, ""))
    if check:
        bad = [(r, c) for r, c in enumerate(results) if c.returncode != 0]
        if bad:
            text = "\n".join(f"--- client {r} exited {c.returncode}:\n{c.stdout}" for r, c in bad)
            raise AssertionError(f"{text}\n--- service log:\n{served.stderr()}")
    return results

"""torchrun against a node service: training processes launched as PyTorch users launch them
take the slots torchrun's ``LOCAL_RANK`` names, and unchanged DDP on the ``"totalreduce"``
backend matches gloo: under torchrun on one node and on two (one torchrun per node, as on a
cluster), and as plain ``python`` processes (``env://`` answered by the node services).
Embedded mode under torchrun says how to run daemon mode, naming the service it found."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from cluster import have_mpiexec, serve

from conftest import import_torch

pytestmark = pytest.mark.skipif(
    not have_mpiexec(), reason="mpiexec not found (install the mpich wheel)"
)

HERE = Path(__file__).parent
TIMEOUT = 150


def _env(**extra: str) -> dict[str, str]:
    drop = ("TOTALREDUCE_", "MASTER_", "TORCHELASTIC_", "PMI_", "MPI_LOCAL", "HYDRA_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
        env.pop(k, None)
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **extra)
    return env


def _torchrun(
    args: list[str], env: dict[str, str], tmp: Path, how: tuple[str, ...] = ()
) -> subprocess.Popen[str]:
    how = how or ("--standalone", "--nproc-per-node", "2")
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", *how, "--log-dir", str(tmp), *args],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _gloo_reference(tmp_path: Path) -> subprocess.Popen[str]:
    """The same script on gloo under torchrun (two ranks on one node; needs no service)."""
    script = str(HERE / "torchrun_ddp.py")
    return _torchrun([script, "gloo", str(tmp_path / "gl")], _env(), tmp_path / "l-gloo")


def _same_as_gloo(torch: Any, tmp_path: Path) -> None:
    for r in (0, 1):
        ours = torch.load(tmp_path / f"tr.{r}.pt")
        gloo = torch.load(tmp_path / f"gl.{r}.pt")
        for a, b in zip(ours, gloo, strict=True):
            assert a.dtype == torch.float64
            assert float((a - b).abs().max()) <= 1e-12


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc: torch's agent starts its workers in their
    own sessions, so killing the agent leaves them, holding its output open)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _finish(proc: subprocess.Popen[str]) -> str:
    try:
        out, _ = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        for pid in [*_descendants(proc.pid), proc.pid]:  # the workers too: no orphan
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        out, _ = proc.communicate()
        raise AssertionError(f"torchrun did not finish within {TIMEOUT} s:\n{out}") from None
    assert proc.returncode == 0, out
    return out


def _finish_reference(proc: subprocess.Popen[str], backend: str) -> str:
    """The reference job (gloo): it must have finished its work.  torch's gloo process group
    sometimes aborts at interpreter exit, after ``destroy_process_group()`` and the job's last
    line ("terminate called without an active exception", a C++ thread left joinable): that
    exit, and only that one, is torch's and not the comparison's."""
    try:
        return _finish(proc)
    except AssertionError as exc:
        out = str(exc)
        done = all(f"DONE {backend} {r} " in out for r in (0, 1))
        if not (done and "terminate called without an active exception" in out):
            raise
        return out


@pytest.mark.parametrize(
    "hook", ["", pytest.param("hook", marks=pytest.mark.full)], ids=["backend", "comm-hook"]
)
def test_unchanged_ddp_under_torchrun_against_a_service_matches_gloo(
    tmp_path: Path, hook: str
) -> None:
    """DDP on the "totalreduce" backend, or with totalreduce's comm hook (whose buckets
    are reduced in the node's arena, and handed to DDP from there), matches gloo's DDP."""
    torch = import_torch()
    served = serve(1, 2, tmp_path / "s", timeout=TIMEOUT + 60)
    try:
        daemon = _env(TOTALREDUCE_SERVICE="daemon", TOTALREDUCE_SOCKET=str(served.socket(0)))
        script = str(HERE / "torchrun_ddp.py")
        # the two jobs at once: gloo's needs no service
        args = [script, "totalreduce", str(tmp_path / "tr"), *([hook] if hook else [])]
        ours = _torchrun(args, daemon, tmp_path / "l1")
        gloo = _gloo_reference(tmp_path)
        try:
            out = _finish(ours)
            _finish_reference(gloo, "gloo")
        finally:
            for proc in (ours, gloo):
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        assert "DONE totalreduce 0" in out and "DONE totalreduce 1" in out, out
        if hook:
            assert "ARENA OK 0" in out and "ARENA OK 1" in out, out
        _same_as_gloo(torch, tmp_path)
        # each process took the slot of its LOCAL_RANK (the service logs which pid took which)
        pids = dict(re.findall(r"DONE totalreduce (\d) pid (\d+)", out))
        took = {
            pid: rank for pid, rank in re.findall(r"client pid (\d+) is rank (\d)", served.stderr())
        }
        assert {took[pids[r]] for r in "01"} == {"0", "1"} and all(took[pids[r]] == r for r in "01")
    finally:
        served.stop()


def test_a_rank_torchrun_did_not_give_is_refused_naming_both(tmp_path: Path) -> None:
    """A process torchrun calls rank 1 that takes slot 0 (TOTALREDUCE_LOCAL_RANK=0) raises
    at init, before it waits for any other process, naming both ranks."""
    served = serve(1, 2, tmp_path / "s", timeout=TIMEOUT)
    try:
        env = _env(
            TOTALREDUCE_SERVICE="daemon",
            TOTALREDUCE_SOCKET=str(served.socket(0)),
            TOTALREDUCE_LOCAL_RANK="0",
            TORCHELASTIC_RUN_ID="test",
            RANK="1",
            LOCAL_RANK="1",
            WORLD_SIZE="2",
            LOCAL_WORLD_SIZE="2",
        )
        r = subprocess.run(
            [sys.executable, "-c", "import totalreduce as tr; tr.init(); print('NOT REFUSED')"],
            env=env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        out = r.stdout + r.stderr
        assert r.returncode != 0 and "NOT REFUSED" not in out, out
        assert "LaunchError" in out and "RANK=1" in out and "LOCAL_RANK=1" in out, out
        assert "made it rank 0 of 2" in out, out
    finally:
        served.stop()


@pytest.mark.full  # the same DDP script as the one-service cases, two nodes' services
def test_unchanged_ddp_under_one_torchrun_per_node_against_two_services_matches_gloo(
    tmp_path: Path,
) -> None:
    """Two nodes as on a cluster: the services under one ``mpiexec -n 2``, and one torchrun
    per node (``--nnodes 2 --node-rank K``, a static rendezvous at the first), each pointed
    at its node's socket; torchrun's ranks are the services' (init() checks them)."""
    torch = import_torch()
    served = serve(2, 1, tmp_path / "s", timeout=TIMEOUT + 60)
    try:
        port = str(_free_port())
        script = str(HERE / "torchrun_ddp.py")
        runs = []
        for node in (0, 1):
            env = _env(TOTALREDUCE_SERVICE="daemon", TOTALREDUCE_SOCKET=str(served.socket(node)))
            how = ("--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1",
                   "--master-addr", "127.0.0.1", "--master-port", port)  # fmt: skip
            runs.append(
                _torchrun(
                    [script, "totalreduce", str(tmp_path / "tr")], env, tmp_path / f"l{node}", how
                )  # fmt: skip
            )
        gloo = _gloo_reference(tmp_path)
        try:
            outs = [_finish(p) for p in runs]
            _finish_reference(gloo, "gloo")
        finally:
            for proc in (*runs, gloo):
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        for r, out in enumerate(outs):
            assert f"DONE totalreduce {r}" in out, out
        _same_as_gloo(torch, tmp_path)
    finally:
        status = served.stop()
    assert status == 0, served.stderr()


def test_unchanged_ddp_as_plain_python_daemon_clients_matches_gloo(tmp_path: Path) -> None:
    """No launcher at all: ``python torchrun_ddp.py`` once per node with
    ``TOTALREDUCE_SERVICE=daemon`` and no RANK, WORLD_SIZE or MASTER_ADDR.  Its unchanged
    ``dist.init_process_group("totalreduce")`` (``env://``) takes rank, world size and a
    store from the node services, and RANK and WORLD_SIZE are set once it returns (the
    script checks them)."""
    torch = import_torch()
    served = serve(2, 1, tmp_path / "s", timeout=TIMEOUT + 60)
    try:
        script = str(HERE / "torchrun_ddp.py")
        clients = [
            subprocess.Popen(
                [sys.executable, script, "totalreduce", str(tmp_path / "tr")],
                env=_env(TOTALREDUCE_SERVICE="daemon", TOTALREDUCE_SOCKET=str(served.socket(n))),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )  # fmt: skip
            for n in (0, 1)
        ]
        gloo = _gloo_reference(tmp_path)
        try:
            outs = [_finish(p) for p in clients]
            _finish_reference(gloo, "gloo")
        finally:
            for proc in (*clients, gloo):
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        for r, out in enumerate(outs):
            assert f"DONE totalreduce {r}" in out, out
        _same_as_gloo(torch, tmp_path)
    finally:
        status = served.stop()
    assert status == 0, served.stderr()


def test_embedded_mode_under_torchrun_says_how_to_use_the_service_it_found(
    tmp_path: Path,
) -> None:
    """torchrun without TOTALREDUCE_SERVICE: each process would be alone in its MPI world,
    and the LaunchError says how to run daemon mode, naming the node's service (found where
    a daemon client looks: $XDG_RUNTIME_DIR/totalreduce)."""
    import_torch()
    runtime = tmp_path / "run"
    served = serve(1, 2, runtime / "totalreduce", timeout=TIMEOUT)
    try:
        code = "import totalreduce.torch as t; t.init(); print('NOT', 'REFUSED')"
        script = tmp_path / "embedded.py"
        script.write_text(code + "\n")
        r = _torchrun([str(script)], _env(XDG_RUNTIME_DIR=str(runtime)), tmp_path / "l")
        out, _ = r.communicate(timeout=TIMEOUT)
        assert r.returncode != 0 and "NOT REFUSED" not in out, out
        assert "alone in its MPI world" in out and "TOTALREDUCE_SERVICE=daemon" in out, out
        assert f"{served.socket(0)} (a service listens there)" in out, out
    finally:
        served.stop()

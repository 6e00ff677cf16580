"""totalreduce.launch: launchers' variables read, torchrun's provided, lonely worlds refused."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from totalreduce.launch import (
    LaunchError,
    MPILaunch,
    check_daemon_rank,
    check_world,
    daemon_requested,
    expected_processes,
    find_mpiexec,
    launcher_slot,
    mpi_launch,
    provide_torchrun_env,
)

HYDRA = {"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}
OMPI = {
    "OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "6",
    "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "3",
}  # fmt: skip
TORCHRUN = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "TORCHELASTIC_RUN_ID": "none"}


def test_mpi_launchers_are_read() -> None:
    assert mpi_launch(HYDRA) == MPILaunch("MPICH's mpiexec (Hydra)", 3, 4, 1, 2)
    assert mpi_launch(OMPI) == MPILaunch("Open MPI's mpiexec", 2, 6, 0, 3)
    assert mpi_launch(TORCHRUN) is None
    assert mpi_launch({}) is None
    assert mpi_launch({"PMI_RANK": "x", "PMI_SIZE": "2"}) is None


def test_torchrun_variables_are_provided_and_never_overwritten() -> None:
    env = dict(HYDRA, LOCAL_RANK="7")
    set_now = provide_torchrun_env(env)
    assert env["RANK"] == "3" and env["WORLD_SIZE"] == "4"
    assert env["LOCAL_RANK"] == "7"  # the user's
    assert "LOCAL_RANK" not in set_now
    assert env["LOCAL_WORLD_SIZE"] == "2"
    assert env["GROUP_RANK"] == "1" and env["GROUP_WORLD_SIZE"] == "2"
    assert env["ROLE_RANK"] == "3" and env["ROLE_WORLD_SIZE"] == "4"
    assert "MASTER_ADDR" not in env  # MPI answers env:// instead (totalreduce.torch)
    assert provide_torchrun_env(dict(TORCHRUN)) == {}  # not an MPI launch: nothing set


def test_expected_processes() -> None:
    assert expected_processes(TORCHRUN) == (2, "torchrun")
    assert expected_processes({"WORLD_SIZE": "3"}) == (3, "WORLD_SIZE")
    assert expected_processes(HYDRA) == (4, "MPICH's mpiexec (Hydra)")
    assert expected_processes({"WORLD_SIZE": "1"}) is None
    assert expected_processes({"SLURM_NTASKS": "4", "SLURM_STEP_ID": "0"}) == (
        4,
        "srun (SLURM_NTASKS)",
    )
    assert expected_processes({"SLURM_NTASKS": "4"}) is None  # an allocation, not a step


def test_a_lonely_world_under_torchrun_is_refused() -> None:
    with pytest.raises(LaunchError) as e:
        check_world(1, env=TORCHRUN)
    text = str(e.value)
    assert "torchrun" in text and "mpiexec -n 2" in text and "alone" in text
    with pytest.raises(LaunchError, match="has 3 ranks, but WORLD_SIZE says the job has 2"):
        check_world(3, env={"WORLD_SIZE": "2"})
    check_world(2, env=TORCHRUN)  # consistent
    check_world(1, env={})  # a plain single process
    assert isinstance(LaunchError("x"), RuntimeError)


def test_a_socket_alone_means_daemon_mode_and_embedded_with_one_is_refused() -> None:
    """TOTALREDUCE_SOCKET alone makes init() a client of that service (here: none answers,
    and the error names the path); with TOTALREDUCE_SERVICE=embedded it is a contradiction."""
    code = "import totalreduce as tr; tr.init()"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOTALREDUCE_")}
    env["TOTALREDUCE_SOCKET"] = "/tmp/nowhere.sock"

    def run(**more: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-c", code], env=dict(env, **more), capture_output=True, text=True,
            timeout=120,
        )  # fmt: skip

    alone = run()
    assert alone.returncode != 0
    assert "no totalreduce service answers on /tmp/nowhere.sock" in alone.stderr, alone.stderr
    both = run(TOTALREDUCE_SERVICE="embedded")
    assert both.returncode != 0
    assert "TOTALREDUCE_SOCKET" in both.stderr and "service='embedded'" in both.stderr, both.stderr


def test_daemon_clients_take_the_slot_torchrun_or_srun_names() -> None:
    torchrun = {"TORCHELASTIC_RUN_ID": "x", "LOCAL_RANK": "1", "RANK": "3", "WORLD_SIZE": "4"}
    assert launcher_slot(torchrun) == (1, "torchrun")
    assert launcher_slot({"SLURM_LOCALID": "2", "SLURM_STEP_ID": "0"}) == (
        2,
        "srun (SLURM_LOCALID)",
    )
    # an MPI launcher's local rank and a LOCAL_RANK nobody launched say nothing: clients
    # started by mpiexec may stand for several nodes on one host
    assert launcher_slot({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1",
                          "MPI_LOCALNRANKS": "2"}) is None  # fmt: skip
    assert launcher_slot({"LOCAL_RANK": "1"}) is None
    assert launcher_slot({}) is None


def test_a_daemon_rank_torchrun_did_not_give_is_refused() -> None:
    torchrun = {"TORCHELASTIC_RUN_ID": "x", "RANK": "3", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    check_daemon_rank(3, 4, 1, 2, 1, "node1.sock", torchrun)  # node 1, slot 1: rank 3
    with pytest.raises(LaunchError) as info:
        check_daemon_rank(1, 4, 1, 2, 0, "node0.sock", torchrun)  # the wrong node's service
    text = str(info.value)
    assert "RANK=3" in text and "made it rank 1 of 4" in text and "node0.sock" in text
    assert "--node-rank 0" in text
    with pytest.raises(LaunchError, match="LOCAL_WORLD_SIZE=2"):
        check_daemon_rank(3, 6, 1, 3, 1, "node1.sock", {**torchrun, "RANK": "4"})
    # without torchrun nothing is checked (totalreduce sets these variables itself)
    check_daemon_rank(0, 4, 0, 2, 0, "node0.sock", {"RANK": "3"})


def _refusal(env: dict[str, str]) -> str:
    with pytest.raises(LaunchError) as info:
        check_world(1, env=env)
    return str(info.value)


def test_a_lonely_world_under_torchrun_says_how_to_use_daemon_mode(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The refusal names daemon mode's variables and what it found where a daemon client
    looks for its service ($XDG_RUNTIME_DIR/totalreduce): nothing, a service listening,
    a socket nobody answers on, several sockets."""
    import socket as sk

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    env = {**TORCHRUN, "LOCAL_WORLD_SIZE": "2"}
    text = _refusal(env)
    assert "TOTALREDUCE_SERVICE=daemon" in text and "--local-clients 2" in text, text
    assert "gloo or nccl" in text and "mpiexec -n 2" in text, text
    assert f"No service runs on this node (no socket in {tmp_path / 'totalreduce'})" in text
    d = tmp_path / "totalreduce"
    d.mkdir()
    listening = sk.socket(sk.AF_UNIX, sk.SOCK_STREAM)
    try:
        listening.bind(str(d / "node0.sock"))
        listening.listen(4)
        text = _refusal(env)
        assert f"Found on this node: {d / 'node0.sock'} (a service listens there)" in text, text
        stale = sk.socket(sk.AF_UNIX, sk.SOCK_STREAM)
        stale.bind(str(d / "node1.sock"))
        stale.close()  # its file stays: nobody answers on it
        text = _refusal(env)
        assert "set TOTALREDUCE_SOCKET to this node's" in text, text
        assert f"{d / 'node1.sock'} (no service answers)" in text, text
    finally:
        listening.close()
    # a world the services gave (daemon mode) is not told to use them
    with pytest.raises(LaunchError) as info:
        check_world(1, "the node services' job", env=env)
    assert "TOTALREDUCE_SERVICE" not in str(info.value)


def test_daemon_requested_and_mpiexec_found() -> None:
    assert daemon_requested({"TOTALREDUCE_SERVICE": "daemon"})
    assert daemon_requested({"TOTALREDUCE_SOCKET": "/x.sock"})
    embedded = {"TOTALREDUCE_SOCKET": "/x.sock", "TOTALREDUCE_SERVICE": "embedded"}
    assert not daemon_requested(embedded)
    assert not daemon_requested({})
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.is_file():  # the mpich wheel's, whatever PATH says
        assert find_mpiexec() == str(beside)


def test_every_mpiexec_the_sources_start_is_found_beside_python_first() -> None:
    """No test or module starts ``mpiexec`` from ``PATH`` alone: a command list that begins
    with the bare name fails here, and a file that falls back to the name (``or
    "mpiexec"``, ``which("mpiexec")``) must look beside ``sys.executable`` first (the mpich
    wheel's, also in a virtual environment that is not activated)."""
    import re

    root = Path(__file__).resolve().parents[1]
    bare = re.compile(r"""\[\s*["']mpiexec["']\s*,""")
    fallback = re.compile(r"""(?:\bor|\belse|which\()\s*["']mpiexec["']""")
    beside = re.compile(r"find_mpiexec|sys\.executable")
    bad = []
    for folder in ("tests", "totalreduce", "examples"):
        for path in sorted((root / folder).rglob("*.py")):
            text = path.read_text(encoding="utf-8")
            if bare.search(text):
                bad.append(f"{path.relative_to(root)}: a command of the bare name")
            elif fallback.search(text) and not beside.search(text):
                bad.append(f"{path.relative_to(root)}: PATH's mpiexec, not this Python's first")
    assert not bad, bad

"""Daemon mode: ``mpiexec totalreduce serve`` and client processes, what an operator relies on.

The collectives themselves run against daemons in tests/mpi/test_mpi.py (the
embedded suite, with a ``service`` parameter); here: eight clients on two nodes
doing everything at once, faults, the socket, memory and shutdown.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cluster import MPIEXEC, have_mpiexec, run_clients, serve

from totalreduce.transport import hello

HERE = Path(__file__).parent
WORKER = str(HERE / "daemon_worker.py")
ROOT = HERE.parents[1]

pytestmark = pytest.mark.skipif(not have_mpiexec(), reason="mpiexec missing (install mpich)")


def client_fds(pid: int) -> int:
    """What a service holds open for its clients: memory files and eventfds."""
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        n += "memfd:totalreduce" in link or "[eventfd]" in link
    return n


def service_pids(served) -> list[int]:
    """The pids of the ``totalreduce serve`` processes (children of mpiexec's proxies)."""
    out = subprocess.run(
        [
            "pgrep",
            "-f",
            f"serve --local-clients {served.local_clients} --socket-dir {served.directory}",
        ],
        capture_output=True,
        text=True,
    )
    return [int(x) for x in out.stdout.split() if int(x) != served.proc.pid]


@pytest.mark.parametrize(
    ("local", "segments"),
    [
        pytest.param(4, "auto", marks=pytest.mark.full),
        pytest.param(4, "64", marks=pytest.mark.full),
        (2, "64"),
    ],
    ids=["2x4-segments-auto", "2x4-segments-64B", "2x2-segments-64B"],
)
def test_clients_on_two_nodes_every_op_random_orders(
    tmp_path: Path, local: int, segments: str
) -> None:
    """Every kind, in random orders and priorities, exact; with ``--segment-bytes 64``
    every allreduce and broadcast of 8 int64 or more among the nodes runs in segments (the
    compiled pass's, a group's, an algorithm named).  Eight clients (2x4) with ``--full``."""
    served = serve(2, local, tmp_path / "s", extra=("--segment-bytes", segments))
    try:
        for line in served.lines:
            assert "listening on" in line, line
        directory = served.directory
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700
        for node in range(2):
            assert stat.S_IMODE(served.socket(node).stat().st_mode) == 0o600
        results = run_clients(served, [WORKER, "every"], timeout=240)
        for r, res in enumerate(results):
            assert f"rank {r}: EVERY OK" in res.stdout, res.stdout
            assert f"rank {r}: MPI NONE" in res.stdout, res.stdout  # clients load no MPI
    finally:
        status = served.stop()
    log = served.stderr()
    assert status == 0, log
    assert "ERROR" not in log and "Traceback" not in log, log
    if segments != "auto":
        assert "of 64 bytes or more run among the nodes in 8 segments" in log, log


def test_window_ops_between_daemon_clients(tmp_path: Path) -> None:
    """One-sided window ops work between the clients of two nodes' services."""
    served = serve(2, 2, tmp_path / "s")
    try:
        results = run_clients(served, [WORKER, "windows"], timeout=120)
        for r, res in enumerate(results):
            assert f"rank {r}: WINDOWS OK" in res.stdout, res.stdout + res.stderr
    finally:
        status = served.stop()
    assert status == 0, served.stderr()


@pytest.mark.parametrize("slots", [1, pytest.param(2, marks=pytest.mark.full)], ids=["2x1", "2x2"])
def test_killed_client_fails_only_its_ops_and_a_new_job_runs(tmp_path: Path, slots: int) -> None:
    """SIGKILL one client in the middle of a 64 MiB allreduce (on two nodes of two clients,
    an op run among the nodes in segments): every other client's op fails naming it, the
    service lets go of what it held for it and serves a new job in the slots."""
    extra = ("--segment-bytes", str(4 << 20)) if slots > 1 else ()  # (auto: off on 2 cores)
    served = serve(2, slots, tmp_path / "s", extra=extra)
    try:
        pids = service_pids(served)
        assert len(pids) == 2, pids
        base = {pid: client_fds(pid) for pid in pids}
        procs = [
            subprocess.Popen(
                [sys.executable, WORKER, "big"],
                env=served.client_env(r),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for r in range(2 * slots)
        ]
        for p in procs:
            assert p.stdout is not None
            assert p.stdout.readline().strip() == "READY"
        assert procs[1].stdout is not None
        assert procs[1].stdout.readline().strip() == "FIRST DONE"
        time.sleep(0.05)  # in the middle of one of the next ops
        procs[1].kill()
        procs[1].wait(10)
        for r, p in enumerate(procs):
            if r != 1:
                out, _ = p.communicate(timeout=60)
                assert f"rank {r}: ERROR" in out and "rank 1" in out, out
                assert "'big'" in out and "WRONG" not in out, out
        deadline = time.monotonic() + 10  # the clients' eventfds go once the slots are free
        while any(client_fds(pid) > base[pid] for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(client_fds(pid) == base[pid] for pid in pids), (base, served.stderr())
        # a new job: fresh clients in both slots, the same names, generation 0 again
        results = run_clients(served, [WORKER, "every"], timeout=120)
        for r, res in enumerate(results):
            assert f"rank {r}: EVERY OK" in res.stdout, res.stdout
    finally:
        status = served.stop()
    log = served.stderr()
    assert status == 0, log
    assert "rank 1 (pid" in log and "died" in log, log
    assert "Traceback" not in log, log
    if slots > 1:
        assert "of 4194304 bytes or more run among the nodes in 8 segments" in log, log


def test_segment_bytes_option() -> None:
    """``--segment-bytes``: a number, off, or auto (on only with cores to spare); the
    nodes' largest wins (serve), so all cut the same ops."""
    from totalreduce.daemon.arena_pass import PIPE_MIN_BYTES
    from totalreduce.daemon.serve import OFF, parse_args, segment_bytes

    assert segment_bytes("1048576", 2) == 1 << 20
    assert segment_bytes("off", 1) == OFF
    assert segment_bytes("auto", 2, cores=4) == PIPE_MIN_BYTES
    assert segment_bytes("auto", 2, cores=3) == OFF
    assert parse_args(["--segment-bytes", "off"]).segment_bytes == OFF
    for bad in ("0", "-5", "4MiB", ""):
        with pytest.raises(ValueError, match="--segment-bytes"):
            segment_bytes(bad, 1)
    with pytest.raises(SystemExit):
        parse_args(["--segment-bytes", "lots"])


def raw_reply(path: Path, data: bytes) -> dict | None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    try:
        s.connect(str(path))
        s.sendall(data)
        reader = hello.MessageReader()
        return hello.read_message(s, reader)
    except (ConnectionError, OSError):
        return None
    finally:
        s.close()


def test_garbage_on_the_socket_is_refused_and_the_service_goes_on(tmp_path: Path) -> None:
    served = serve(1, 2, tmp_path / "s")
    try:
        path = served.socket(0)
        for junk in [
            b"\xff\xff\xff\xffGARBAGE",
            b"\x10\x00\x00\x00" + bytes(range(200, 216)),
            b"\x04\x00\x00\x00null",
            hello.encode({"t": "hello", "version": hello.VERSION, "pid": "x"}),
            hello.encode({"t": "hello", "version": 1, "pid": 5}),
            hello.encode({"t": "bye"}),
            hello.encode({"t": "hello", "version": hello.VERSION, "pid": 5, "local_rank": 7}),
        ]:
            reply = raw_reply(path, junk)
            assert reply is not None and reply["t"] == "error", (junk, reply)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # half a message, then gone
        s.connect(str(path))
        s.sendall(b"\x10\x00")
        s.close()
        results = run_clients(served, [WORKER, "every"], timeout=120)
        assert all("EVERY OK" in r.stdout for r in results), [r.stdout for r in results]
    finally:
        status = served.stop()
    log = served.stderr()
    assert status == 0, log
    assert "protocol version 1" in log, log


def test_a_taken_slot_and_a_full_node_are_refused_clearly(tmp_path: Path) -> None:
    served = serve(1, 1, tmp_path / "s")
    try:
        code = (
            "import totalreduce as tr, sys\n"
            "tr.init()\n"
            "print('IN', flush=True)\n"
            "sys.stdin.readline()\n"
            "tr.shutdown()\n"
        )
        first = subprocess.Popen(
            [sys.executable, "-c", code],
            env=served.client_env(0),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert first.stdout is not None and first.stdout.readline().strip() == "IN"
        second = subprocess.run(
            [sys.executable, "-c", "import totalreduce as tr; tr.init()"],
            env=served.client_env(0),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert second.returncode != 0
        assert "refused" in second.stderr and "taken by pid" in second.stderr, second.stderr
        first.communicate("\n", timeout=60)
        assert first.returncode == 0
    finally:
        status = served.stop()
    assert status == 0, served.stderr()


def test_engine_options_must_agree_with_the_service(tmp_path: Path) -> None:
    served = serve(1, 1, tmp_path / "s", TOTALREDUCE_SEGMENT_BYTES="65536")
    try:
        code = "import totalreduce as tr; tr.init(segment_bytes=4096)"
        out = subprocess.run(
            [sys.executable, "-c", code],
            env=served.client_env(0),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode != 0
        assert "segment_bytes=65536" in out.stderr and "segment_bytes=4096" in out.stderr
        code = "import totalreduce as tr; s = tr.init(); print(s.config.segment_bytes)"
        out = subprocess.run(
            [sys.executable, "-c", code],
            env=served.client_env(0),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0 and out.stdout.strip() == "65536", out.stderr
    finally:
        served.stop()


def test_second_service_on_the_same_socket_refuses_to_start(tmp_path: Path) -> None:
    served = serve(1, 1, tmp_path / "s")
    try:
        env = dict(os.environ, MPIEXEC_TIMEOUT="60")
        proc = subprocess.run(
            [
                MPIEXEC,
                "-n",
                "1",
                sys.executable,
                "-m",
                "totalreduce.cli",
                "serve",
                "--socket-dir",
                str(served.directory),
            ],
            capture_output=True,
            text=True,
            timeout=90,
            env=env,
        )
        assert proc.returncode != 0
        assert "already served" in proc.stderr, proc.stderr
        assert served.socket(0).exists()
        assert served.proc.poll() is None
    finally:
        served.stop()


def test_sigterm_fails_in_flight_ops_and_exits_cleanly(tmp_path: Path) -> None:
    served = serve(2, 1, tmp_path / "s")
    clients = [
        subprocess.Popen(
            [sys.executable, WORKER, mode],
            env=served.client_env(r),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r, mode in enumerate(["stuck", "sleep"])
    ]
    try:
        for c in clients:
            assert c.stdout is not None and c.stdout.readline().strip() == "READY"
        time.sleep(0.5)
        status = served.stop()
        out, _ = clients[0].communicate(timeout=60)
    finally:
        for c in clients:
            if c.poll() is None:
                c.kill()
                c.wait(10)
        served.stop()
    log = served.stderr()
    assert status == 0, log
    assert "ERROR after" in out and "'stuck'" in out, out + log
    assert not any(served.socket(n).exists() for n in range(2))


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a client as another user")
def test_another_user_cannot_connect(tmp_path: Path) -> None:
    served = serve(1, 1, tmp_path / "s")
    try:
        path = served.socket(0)
        assert "REFUSED" in _connect_as_nobody(str(path))  # 0700 directory, 0600 socket
        opened = [d for d in path.parents if str(d).startswith("/tmp/") or d == path.parent]
        modes = [d.stat().st_mode & 0o777 for d in opened] + [path.stat().st_mode & 0o777]
        for d in opened:
            os.chmod(d, 0o711)
        os.chmod(path, 0o666)
        try:
            out = _connect_as_nobody(str(path))
        finally:
            for d, mode in zip([*opened, path], modes, strict=True):
                os.chmod(d, mode)
        # the service checks the peer's uid whatever the permissions say: it hangs up
        assert "REFUSED" in out or out == "REPLY ", out
    finally:
        served.stop()
    assert "refused a connection" in served.stderr()


def _connect_as_nobody(path: str) -> str:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no exec, so it needs no access to the interpreter's files
        try:
            os.setgid(65534)
            os.setuid(65534)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(10)
            try:
                s.connect(path)
                data = b"REPLY " + s.recv(300)
            except OSError as exc:
                data = f"REFUSED {exc}".encode()
            os.write(w, data)
        finally:
            os._exit(0)
    os.close(w)
    chunks = []
    while chunk := os.read(r, 4096):
        chunks.append(chunk)
    os.close(r)
    os.waitpid(pid, 0)
    return b"".join(chunks).decode(errors="replace")


def _mpmd(served, script: list[str]) -> list[str]:
    """``mpiexec`` with one rank per client, each given its node's socket (MPMD)."""
    cmd = [MPIEXEC]
    for r in range(served.nodes * served.local_clients):
        env = served.client_env(r)
        cmd += ["-n", "1"]
        for k in ("TOTALREDUCE_SERVICE", "TOTALREDUCE_SOCKET", "TOTALREDUCE_LOCAL_RANK"):
            cmd += ["-env", k, env[k]]
        cmd += [sys.executable, *script, ":"]
    return cmd[:-1]


@pytest.mark.parametrize(
    "script",
    [
        "train_distributed_optimizer.py",
        pytest.param("train_ddp_comm_hook.py", marks=pytest.mark.full),
    ],
)
def test_torch_examples_run_unchanged_on_a_daemon(tmp_path: Path, script: str) -> None:
    pytest.importorskip("torch", reason="the training examples need torch")
    served = serve(2, 1, tmp_path / "s")
    try:
        args = [str(ROOT / "examples" / script), "--epochs", "1", "--points", "50", "--plot", ""]
        env = dict(
            os.environ,
            MPIEXEC_TIMEOUT="150",
            PYTHONUNBUFFERED="1",
            PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        )
        proc = subprocess.run(
            _mpmd(served, args), capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path
        )
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, out + served.stderr()
        assert "epoch   1" in out, out
    finally:
        status = served.stop()
    assert status == 0, served.stderr()
    assert "rank 0 (pid" in served.stderr()  # the clients really were the daemon's


def test_info_reports_daemon_mode(tmp_path: Path) -> None:
    """A client says it is one, and runs no engine; an old script's ``--channel-bytes``
    (the byte rings' size before the arena) still starts the service, with a warning."""
    served = serve(1, 1, tmp_path / "s", extra=("--channel-bytes", str(1 << 20)))
    try:
        code = (
            "import totalreduce as tr; s = tr.init(); print(s.transport.description)\n"
            "try:\n    s.loop\nexcept tr.TotalReduceError as e:\n    print('NO ENGINE:', e)\n"
            "import importlib.util\n"
            "if importlib.util.find_spec('torch'):\n"
            "    from totalreduce.torch import horovod as hvd\n"
            "    print('MPI ENABLED:', hvd.mpi_enabled())"
        )
        out = subprocess.run(
            [sys.executable, "-c", code],
            env=served.client_env(0),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        assert "shared memory" in out.stdout, out.stdout
        assert "NO ENGINE: rank 0 is a daemon client: it runs no engine" in out.stdout, out.stdout
        # Horovod's question: a daemon client's world does not run over MPI
        if importlib.util.find_spec("torch") is not None:
            assert "MPI ENABLED: False" in out.stdout, out.stdout
    finally:
        served.stop()
    assert "--channel-bytes has no effect" in served.stderr(), served.stderr()


@pytest.mark.full  # (four jobs in turn: 9 s; test_sessions.py starts later jobs by default)
def test_later_jobs_with_staggered_starts_reuse_names(tmp_path: Path) -> None:
    """Second and third jobs whose clients start seconds apart, one node's client alone
    first: init waits for the whole job, then the same names work again."""
    served = serve(2, 1, tmp_path / "s")
    try:
        run_clients(served, [WORKER, "every"], timeout=120)
        for _ in range(2):
            first = subprocess.Popen(
                [sys.executable, WORKER, "every"],
                env=served.client_env(0),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            time.sleep(2)
            second = subprocess.run(
                [sys.executable, WORKER, "every"],
                env=served.client_env(1),
                capture_output=True,
                text=True,
                timeout=120,
            )
            out, _ = first.communicate(timeout=120)
            assert "rank 0: EVERY OK" in out, out + served.stderr()
            assert "rank 1: EVERY OK" in second.stdout, second.stdout + second.stderr
    finally:
        status = served.stop()
    assert status == 0, served.stderr()


def test_torch_backend_runs_unchanged_on_a_daemon(tmp_path: Path) -> None:
    """The "totalreduce" torch.distributed backend (init_method totalreduce://) over daemon
    clients: collectives and an unchanged DDP, as under mpiexec."""
    pytest.importorskip("torch", reason="the backend needs torch")
    served = serve(2, 1, tmp_path / "s")
    try:
        script = str(ROOT / "tests" / "torch" / "check_process_group.py")
        results = run_clients(served, [script, "collectives,ddp", "totalreduce://"], timeout=150)
        for r, res in enumerate(results):
            assert f"COLLECTIVES OK rank {r}" in res.stdout, res.stdout
            assert f"DDP OK rank {r}" in res.stdout, res.stdout
    finally:
        status = served.stop()
    assert status == 0, served.stderr()

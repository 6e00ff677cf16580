"""The service as users run it: ``mpiexec -n 2 totalreduce serve --local-clients 2``.

One service pair (two simulated nodes, two clients each) serves the whole
module; clients are separate processes running ``daemon_worker.py``.  The tests
run in order: random-order exact results, the same program against the
embedded mode bit for bit, a client killed mid-op, garbage on the socket,
another user, a second service on the same socket, and last the clean
shutdown on SIGTERM with an op in flight.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from totalreduce.daemon import protocol

HERE = Path(__file__).parent
WORKER = str(HERE / "daemon_worker.py")
TIMEOUT = 60
LOCAL = 2
NODES = 2

pytestmark = pytest.mark.skipif(
    shutil.which("mpiexec") is None, reason="mpiexec not on PATH (install the mpich wheel)"
)


@dataclass
class Served:
    directory: Path
    proc: subprocess.Popen[str]
    log: Path

    def socket(self, node: int) -> Path:
        return self.directory / f"node{node}.sock"

    def client_env(self, rank: int) -> dict[str, str]:
        node, local = divmod(rank, LOCAL)
        return dict(
            os.environ,
            TOTALREDUCE_SERVICE="daemon",
            TOTALREDUCE_SOCKET=str(self.socket(node)),
            TOTALREDUCE_LOCAL_RANK=str(local),
            PYTHONUNBUFFERED="1",
        )

    def start(self, rank: int, *args: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, WORKER, *args],
            env=self.client_env(rank),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def run_all(self, *args: str) -> list[str]:
        """Run ``daemon_worker.py ARGS`` as every one of the 4 training processes."""
        procs = [self.start(r, *args) for r in range(NODES * LOCAL)]
        outs = []
        for p in procs:
            try:
                out, _ = p.communicate(timeout=TIMEOUT)
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                raise AssertionError(
                    f"a client hung; service log:\n{self.log.read_text()}"
                ) from None
            outs.append(out)
        return outs

    def log_text(self) -> str:
        return self.log.read_text()


def _serve(directory: Path, log: Path, nodes: int = NODES) -> subprocess.Popen[str]:
    env = dict(os.environ, MPIEXEC_TIMEOUT="600", PYTHONUNBUFFERED="1")
    cmd = [
        "mpiexec", "-n", str(nodes), sys.executable, "-m", "totalreduce.cli", "serve",
        "--local-clients", str(LOCAL), "--socket-dir", str(directory),
        "--abort-timeout", "3", "--drain-timeout", "2",
    ]  # fmt: skip
    with open(log, "w") as err:
        return subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env, start_new_session=True
        )


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    # under /tmp itself (not pytest's private base), so another user can reach it when a
    # test opens the permissions up
    base = Path(tempfile.mkdtemp(prefix="totalreduce-test-", dir="/tmp"))
    directory = base / "sockets"
    log = base / "serve.log"
    proc = _serve(directory, log)
    s = Served(directory, proc, log)
    try:
        deadline = time.monotonic() + TIMEOUT
        while not all(s.socket(n).exists() for n in range(NODES)):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"the service did not start:\n{log.read_text()}")
            time.sleep(0.05)
        yield s
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        shutil.rmtree(base, ignore_errors=True)


def test_serve_prints_private_socket_paths(served: Served) -> None:
    assert oct(served.directory.stat().st_mode & 0o777) == "0o700"
    lines = []
    assert served.proc.stdout is not None
    for _ in range(NODES):
        lines.append(served.proc.stdout.readline())
    for n in range(NODES):
        path = served.socket(n)
        assert oct(path.stat().st_mode & 0o777) == "0o600"
        assert any(str(path) in ln for ln in lines), lines


def test_four_clients_random_orders_exact(served: Served) -> None:
    outs = served.run_all("random", "11")
    for r, out in enumerate(outs):
        assert f"rank {r} of 4: RANDOM OK" in out, out


def test_same_client_code_embedded_and_daemon_bit_for_bit(served: Served, tmp_path: Path) -> None:
    env = dict(os.environ, MPIEXEC_TIMEOUT=str(TIMEOUT - 10), PYTHONUNBUFFERED="1")
    env.pop("TOTALREDUCE_SERVICE", None)
    emb = subprocess.run(
        ["mpiexec", "-n", str(NODES * LOCAL), sys.executable, WORKER, "same",
         str(tmp_path / "embedded_{rank}.npz")],
        capture_output=True, text=True, timeout=TIMEOUT, env=env,
    )  # fmt: skip
    assert emb.returncode == 0, emb.stdout + emb.stderr
    outs = served.run_all("same", str(tmp_path / "daemon_{rank}.npz"))
    assert all("SAME DONE" in o for o in outs), outs
    for r in range(NODES * LOCAL):
        a = np.load(tmp_path / f"embedded_{r}.npz")
        b = np.load(tmp_path / f"daemon_{r}.npz")
        assert sorted(a.files) == sorted(b.files)
        for key in a.files:
            x, y = a[key], b[key]
            assert (x.dtype, x.shape) == (y.dtype, y.shape), key
            assert x.tobytes() == y.tobytes(), (r, key)


def test_killed_client_fails_the_others_and_a_new_job_works(served: Served) -> None:
    victim = served.start(0, "victim")
    survivors = [served.start(r, "survivor") for r in range(1, NODES * LOCAL)]
    try:
        assert victim.stdout is not None
        line = victim.stdout.readline()
        assert "VICTIM READY" in line, line + served.log_text()
        time.sleep(0.5)  # the survivors are waiting for x.final by now
        victim.send_signal(signal.SIGKILL)
        outs = [p.communicate(timeout=TIMEOUT)[0] for p in survivors]
    finally:
        victim.kill()
        victim.wait()
        for p in survivors:
            p.kill()
    for out in outs:
        assert "SURVIVOR GOT ERROR" in out, out + served.log_text()
        secs = float(out.split("after ")[1].split("s:")[0])
        assert secs < 5, out
        assert "'x.final'" in out and f"pid {victim.pid}" in out, out
    assert "disconnected without saying goodbye" in served.log_text()
    outs = served.run_all("random", "12")
    assert all("RANDOM OK" in o for o in outs), outs


def _service_pid(path: Path) -> int:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(str(path))
    try:
        pid, _, _ = struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    finally:
        s.close()
    return pid


def test_departed_clients_memory_is_released(served: Served) -> None:
    # after the killed client and every finished one: no client memory stays mapped
    for node in range(NODES):
        maps = Path(f"/proc/{_service_pid(served.socket(node))}/maps")
        deadline = time.monotonic() + 10
        while True:
            left = [ln for ln in maps.read_text().splitlines() if "memfd:totalreduce-" in ln]
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert not left, left[:5]


def _raw_reply(path: Path, junk: bytes) -> dict | None:
    """Send ``junk`` on a new connection; the service's reply, or None if it just closed."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(str(path))
    try:
        s.sendall(junk)
        return protocol.read_message(s, protocol.MessageReader())
    except ConnectionError:
        return None
    finally:
        s.close()


def test_garbage_on_the_socket_gets_an_error_reply(served: Served) -> None:
    for node in range(NODES):
        for junk in [
            b"\xff\xff\xff\xffGARBAGE",
            b"\x10\x00\x00\x00" + bytes(range(200, 216)),
            b"\x04\x00\x00\x00null",
            protocol.encode({"t": "hello", "v": 1, "pid": "x", "slots": 1}),
        ]:
            reply = _raw_reply(served.socket(node), junk)
            assert reply is not None and reply["t"] == "error", (junk, reply)
        # a connection that sends half a message and hangs up is forgotten
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(str(served.socket(node)))
        s.sendall(b"\x10\x00")
        s.close()
    assert "sent a bad message" in served.log_text()
    outs = served.run_all("random", "13")
    assert all("RANDOM OK" in o for o in outs), outs


def _connect_as_nobody(path: str) -> str:
    """Connect to ``path`` from a forked child running as uid/gid 65534; what it saw."""
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


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a client as another user")
def test_another_user_cannot_connect(served: Served) -> None:
    path = str(served.socket(0))
    assert "REFUSED" in _connect_as_nobody(path)  # the directory is 0700, the socket 0600
    # even with the permissions opened up, the service checks the peer's uid
    opened = [served.directory.parent, served.directory]
    modes = [d.stat().st_mode & 0o777 for d in opened] + [os.stat(path).st_mode & 0o777]
    for d in opened:
        os.chmod(d, 0o711)
    os.chmod(path, 0o666)
    try:
        out = _connect_as_nobody(path)
    finally:
        for d, mode in zip(opened + [Path(path)], modes, strict=True):
            os.chmod(d, mode)
    assert "REPLY" in out and "uid 65534" in out, out
    assert "refused a connection" in served.log_text()


def test_second_service_on_the_same_socket_refuses_to_start(served: Served, tmp_path: Path) -> None:
    log = tmp_path / "second.log"
    proc = _serve(served.directory, log, nodes=1)
    try:
        proc.wait(TIMEOUT)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode != 0
    assert "already served" in log.read_text(), log.read_text()
    assert served.socket(0).exists()


def test_sigterm_fails_in_flight_ops_and_exits_cleanly(served: Served) -> None:
    # two clients of node 0 start an op node 1 never joins: it runs until the shutdown
    code = (
        "import numpy as np, totalreduce as tr, time\n"
        "tr.init()\n"
        "print('READY', flush=True)\n"
        "t0 = time.monotonic()\n"
        "try:\n"
        "    tr.allreduce(np.ones(4), name='stuck')\n"
        "    print('NO ERROR')\n"
        "except tr.TotalReduceError as e:\n"
        "    print(f'ERROR after {time.monotonic() - t0:.1f}s: {e}')\n"
    )
    clients = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            env=served.client_env(r),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for r in range(LOCAL)
    ]
    for c in clients:
        assert c.stdout is not None
        assert "READY" in c.stdout.readline()
    time.sleep(0.5)
    os.killpg(served.proc.pid, signal.SIGTERM)
    rc = served.proc.wait(30)
    outs = [c.communicate(timeout=TIMEOUT)[0] for c in clients]
    log = served.log_text()
    assert rc == 0, log
    for out in outs:
        assert "ERROR after" in out and "'stuck'" in out, out + log
        assert "shutting down" in out or "stopped" in out, out + log
    assert not any(served.socket(n).exists() for n in range(NODES))
    assert log.count("stopped") >= NODES, log

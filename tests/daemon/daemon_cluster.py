"""In-process services for the daemon tests: P nodes' services as threads of the test process.

Each node gets an embedded :class:`~totalreduce.Service` over a local world, a
notice channel over a second local world, a socket in a private directory and
a :class:`~totalreduce.daemon.server.Daemon` running in its own thread, so the
service's logic can be tested (and profiled) without ``mpiexec``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from totalreduce.daemon import sockets
from totalreduce.daemon.peers import PeerChannel
from totalreduce.daemon.server import Daemon
from totalreduce.service.config import Config
from totalreduce.service.service import Service
from totalreduce.transport.local import LocalWorld


class LocalCluster:
    """``nodes`` services with ``local_clients`` each, listening in ``directory``."""

    def __init__(self, nodes: int, local_clients: int, directory: Path, **kw: Any) -> None:
        self.nodes = nodes
        self.directory = sockets.private_dir(directory)
        engines = LocalWorld(nodes)
        notices = LocalWorld(nodes)
        config = Config.load(env={}, **kw.pop("engine", {}))
        self.daemons: list[Daemon] = []
        self.threads: list[threading.Thread] = []
        self.status: list[int | None] = [None] * nodes
        for n in range(nodes):
            svc = Service(engines.transport(n), config)
            path = sockets.node_socket(self.directory, n)
            sockets.check_free(path)
            d = Daemon(
                svc,
                PeerChannel(notices.transport(n)),
                sockets.listen(path),
                path,
                local_clients=local_clients,
                **kw,
            )
            self.daemons.append(d)
        for n, d in enumerate(self.daemons):
            t = threading.Thread(target=self._run, args=(n, d), daemon=True, name=f"daemon-{n}")
            t.start()
            self.threads.append(t)

    def _run(self, n: int, d: Daemon) -> None:
        self.status[n] = d.run()

    def socket(self, node: int) -> Path:
        return sockets.node_socket(self.directory, node)

    def stop(self, timeout: float = 20.0) -> None:
        for d in self.daemons:
            d.on_signal("SIGTERM")
        for t in self.threads:
            t.join(timeout)
        for d in self.daemons:
            d.peers.close(timeout=1)
            d.svc.shutdown(timeout=2)


@contextmanager
def local_cluster(
    nodes: int, local_clients: int, directory: Path, **kw: Any
) -> Iterator[LocalCluster]:
    cluster = LocalCluster(nodes, local_clients, directory, **kw)
    try:
        yield cluster
    finally:
        cluster.stop()


def run_clients(
    cluster: LocalCluster,
    fn: Any,
    local_clients: int,
    timeout: float = 60.0,
    **client_kw: Any,
) -> list[Any]:
    """Attach ``nodes * local_clients`` clients (threads); return ``fn(client)`` of each by rank.

    Errors are re-raised (the first by rank); every client is shut down at the end.
    """
    from totalreduce.daemon.client import DaemonClient

    size = cluster.nodes * local_clients
    results: list[Any] = [None] * size
    errors: list[BaseException | None] = [None] * size

    def body(rank: int) -> None:
        node, local = divmod(rank, local_clients)
        try:
            c = DaemonClient(cluster.socket(node), local_rank=local, **client_kw)
        except BaseException as exc:  # reported below
            errors[rank] = exc
            return
        try:
            results[rank] = fn(c)
        except BaseException as exc:  # reported below
            errors[rank] = exc
        finally:
            c.shutdown(timeout=5)

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        if t.is_alive():
            raise AssertionError(f"a client did not finish within {timeout} s")
    for r, e in enumerate(errors):
        if e is not None:
            raise AssertionError(f"client of rank {r} failed: {e!r}") from e
    return results

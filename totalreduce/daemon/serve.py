"""The ``totalreduce serve`` command: start one node's service under ``mpiexec``.

``mpiexec -n NODES totalreduce serve --local-clients N`` starts one service per
MPI rank (one rank per node; on one machine ``-n 2`` simulates two nodes).
Each starts the engine, checks its socket path is free, agrees with the other
nodes that all could start and that all serve ``N`` local clients, then prints
one line with its socket path on stdout and serves until SIGTERM or SIGINT.
Logs go to stderr.  The exit status is 0 after a clean shutdown, 1 if a node
could not start (its socket is already served, its directory is not private),
2 for bad arguments.

Engine options come from the ``TOTALREDUCE_*`` environment variables, as for
``totalreduce.init()``.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path

import numpy as np

from ..errors import TotalReduceError

log = logging.getLogger("totalreduce.daemon.serve")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="totalreduce serve",
        description="Run this node's totalreduce service (one per node, under mpiexec).",
    )
    p.add_argument(
        "--local-clients",
        type=int,
        default=1,
        metavar="N",
        help="training processes per node that take part in every op (default 1)",
    )
    p.add_argument(
        "--socket-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="directory of the sockets, created 0700 (default $XDG_RUNTIME_DIR/totalreduce "
        "or /tmp/totalreduce-$UID); node n listens on DIR/node{n}.sock",
    )
    p.add_argument(
        "--abort-timeout",
        type=float,
        default=10.0,
        metavar="S",
        help="after a client or a node failed, ops of that job still running after S seconds "
        "are aborted on every node (default 10)",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=10.0,
        metavar="S",
        help="on SIGTERM/SIGINT, how long running ops may finish before they are aborted "
        "(default 10)",
    )
    p.add_argument("--log-level", default="INFO", metavar="L", help="DEBUG, INFO, WARNING or ERROR")
    args = p.parse_args(argv)
    if not 1 <= args.local_clients <= 1024:
        p.error("--local-clients must be in 1..1024")
    if args.abort_timeout < 0 or args.drain_timeout < 0:
        p.error("timeouts must be >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from ..kernels import warm_up
    from ..service.config import Config
    from ..service.service import Service
    from ..transport.mpi import MPITransport
    from . import sockets
    from .peers import PeerChannel
    from .server import Daemon

    config = Config.load()
    peer_transport = MPITransport(None, allow_serialized=config.allow_serialized)
    node, nodes = peer_transport.rank, peer_transport.size
    logging.basicConfig(
        stream=sys.stderr,
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format=f"%(asctime)s totalreduce serve [node {node}] %(levelname)s: %(message)s",
    )
    svc = Service(MPITransport(None, allow_serialized=config.allow_serialized), config)
    peers = PeerChannel(peer_transport)
    directory = args.socket_dir or sockets.default_dir()
    path = sockets.node_socket(directory, node)
    problem = ""
    try:
        sockets.private_dir(directory)
        sockets.check_free(path)
    except (TotalReduceError, OSError) as exc:
        problem = str(exc)
    # Every node must be able to serve, and all must agree on the number of local clients.
    votes = np.array([1 if problem else 0, args.local_clients, -args.local_clients], np.int64)
    try:
        agreed = svc.allreduce(votes, name="__totalreduce.daemon.startup__", op="max")
    except TotalReduceError as exc:
        problem = problem or f"the nodes could not agree at start-up: {exc}"
        agreed = np.array([1, 0, 0])
    status = 0
    if agreed[0]:
        log.error("not starting: %s", problem or "another node could not start (see its log)")
        status = 1
    elif agreed[1] != -agreed[2]:
        log.error(
            "not starting: the nodes were given different --local-clients (%d to %d)",
            -agreed[2],
            agreed[1],
        )
        status = 2
    if status:
        peers.close()
        svc.shutdown(timeout=2)
        return status
    warm_up()
    listener = sockets.listen(path)
    daemon = Daemon(
        svc,
        peers,
        listener,
        path,
        local_clients=args.local_clients,
        abort_timeout=args.abort_timeout,
        drain_timeout=args.drain_timeout,
    )
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda num, _frame: daemon.on_signal(signal.Signals(num).name))
    n = args.local_clients
    print(
        f"totalreduce serve: node {node} of {nodes} listening on {path} "
        f"(local clients {n}: ranks {node * n}..{node * n + n - 1} of {nodes * n})",
        flush=True,
    )
    try:
        status = daemon.run()
    finally:
        peers.close()
        svc.shutdown(timeout=2)
    log.info("stopped")
    return status


if __name__ == "__main__":
    sys.exit(main())

"""The ``totalreduce serve`` command: start one node's service under ``mpiexec``.

``mpiexec -n NODES totalreduce serve --local-clients N`` starts one service per
MPI rank (one rank per node; on one machine ``-n 2`` simulates two nodes).
Each checks its socket path is free, agrees with the other nodes that all could
start and that all serve ``N`` local clients with arenas of one size, creates
its arena (the shared memory of its ``N`` client slots), starts the engine
among the nodes' services (MPI, on a communicator of its own; none on a single
node) and the arena thread, then prints one line with its socket path on stdout
and serves until SIGTERM or SIGINT.  Logs go to stderr.  The exit status is 0
after a clean shutdown, 1 if a node could not start (its socket is already
served, its directory is not private), 2 for bad arguments.

Engine options come from the ``TOTALREDUCE_*`` environment variables, as for
``totalreduce.init()``; the service hands ``segment_bytes``, ``micro_bytes``
and ``floating_pool_bytes`` to its clients, which refuse other settings of
their own.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import logging
import os
import signal
import socket
import sys
from collections.abc import Mapping
from pathlib import Path

from ..config import ENV_PREFIX, Config
from ..errors import TotalReduceError
from .arena_pass import PIPE_MIN_BYTES, SEGMENTS

#: ``--segment-bytes off``: more bytes than any op has.
OFF = 1 << 62
#: The services' engine's ``Config.nap_s`` (``TOTALREDUCE_NAP_S`` sets another; 0: off).
#: On the 2-core machine a 20 µs sleep lasts about 55 µs.
SERVICE_NAP_S = 20e-6

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
    # Before the thin path every client had a channel of this size; scripts may still pass it.
    p.add_argument("--channel-bytes", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument(
        "--arena-bytes",
        type=int,
        default=1 << 30,
        metavar="B",
        help="bytes of the node's arena, shared among its local clients, where their "
        "hierarchical ops' buffers live (default 1 GiB; memory is taken as it is used)",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=10.0,
        metavar="S",
        help="on SIGTERM/SIGINT, how long running ops may finish before they are failed "
        "(default 10)",
    )
    p.add_argument(
        "--segment-bytes",
        default="auto",
        metavar="B",
        help="an allreduce or broadcast among the nodes of at least B bytes runs in "
        f"{SEGMENTS} segments, so the node's reduction, the step among the nodes and the "
        "copy back overlap; 'off', or 'auto' (the default): "
        f"{PIPE_MIN_BYTES >> 20} MiB where the service may run on at least --local-clients "
        "+ 2 cores, else off (the phases overlap only on cores left free); the nodes take the "
        "largest they were given",
    )
    p.add_argument(
        "--fault-tolerant",
        action="store_true",
        help="also serve fault-tolerant members on DIR/ft{n}.sock: training processes that "
        "come and go between steps, in quorums the services keep (docs/fault_tolerance.md)",
    )
    p.add_argument(
        "--join-timeout",
        type=float,
        default=1.0,
        metavar="S",
        help="fault-tolerant mode: with no member of the last quorum alive (the first "
        "quorum), how long the first ask waits for others to join (default 1)",
    )
    p.add_argument(
        "--first-quorum",
        type=int,
        default=0,
        metavar="N",
        help="fault-tolerant mode: the first quorum (no member of an earlier one alive) "
        "forms as soon as N members asked, without waiting for --join-timeout (node 0's "
        "value counts; default 0: wait)",
    )
    p.add_argument("--log-level", default="INFO", metavar="L", help="DEBUG, INFO, WARNING or ERROR")
    args = p.parse_args(argv)
    try:
        args.segment_bytes = segment_bytes(args.segment_bytes, args.local_clients)
    except ValueError as exc:
        p.error(str(exc))
    if not 1 <= args.local_clients <= 1024:
        p.error("--local-clients must be in 1..1024")
    if not 1 << 20 <= args.arena_bytes <= 1 << 40:
        p.error("--arena-bytes must be in 1 MiB..1 TiB")
    if args.drain_timeout < 0:
        p.error("--drain-timeout must be >= 0")
    return args


def host_id() -> int:
    """A positive number that names this machine's running kernel (its boot id, else its
    host name): the services of a job that share it share its cores."""
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            name = f.read().strip()
    except OSError:
        name = b""
    name = name or socket.gethostname().encode()
    return int.from_bytes(hashlib.blake2b(name, digest_size=8).digest(), "little") >> 2 | 1


def segment_bytes(value: str, local_clients: int, cores: int | None = None) -> int:
    """``--segment-bytes``: the least bytes of a segmented op among the nodes (``OFF``:
    none is)."""
    if value == "off":
        return OFF
    if value == "auto":
        if cores is None:
            cores = len(os.sched_getaffinity(0))
        return PIPE_MIN_BYTES if cores >= local_clients + 2 else OFF
    try:
        n = int(value)
    except ValueError:
        raise ValueError(
            f"--segment-bytes must be a number of bytes, off or auto, not {value!r}"
        ) from None
    if not 1 <= n < OFF:
        raise ValueError(f"--segment-bytes must be at least 1, not {n}")
    return n


def engine_config(config: Config, env: Mapping[str, str] | None = None) -> Config:
    """The options of the engine among the services, from the service's own.

    - The arena thread drives the ops it has; the comm thread meets frames that come
      before this node's part of an op: idle, it may sleep longer than a rank's (with
      windows' standing receives waiting there, no longer than a rank's:
      ``engine.driving.STANDING_BACKOFF_S``).
    - A thread waiting for a large op among the services whose other nodes are late
      sleeps between its polls (``nap_s``, :data:`SERVICE_NAP_S` unless
      ``TOTALREDUCE_NAP_S`` says otherwise) instead of yielding the core, which the
      node's training processes want for their computing (docs/daemon.md)."""
    env = os.environ if env is None else env
    nap = config.nap_s if ENV_PREFIX + "NAP_S" in env else SERVICE_NAP_S
    return dataclasses.replace(
        config, idle_backoff_max_s=max(config.idle_backoff_max_s, 0.25), nap_s=nap
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from ..kernels import warm_up
    from ..service.service import Service
    from ..transport import arena as A
    from ..transport import hello
    from ..transport.arena import Arena
    from ..transport.mpi import MPITransport, world, world_max
    from . import sockets
    from .node import Node
    from .thin import ThinService

    config = Config.load()
    node, nodes = world()
    logging.basicConfig(
        stream=sys.stderr,
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format=f"%(asctime)s totalreduce serve [node {node}] %(levelname)s: %(message)s",
    )
    if args.channel_bytes is not None:
        log.warning("--channel-bytes has no effect: clients hand their buffers over in the arena")
    directory = args.socket_dir or hello.default_dir()
    path = hello.node_socket(directory, node)
    problem = ""
    try:
        sockets.private_dir(directory)
        sockets.check_free(path)
    except (TotalReduceError, OSError) as exc:
        problem = str(exc)
    # Every node must be able to serve, and all must agree on the number of local clients.
    # (and which host each node is on: each puts its host's number at its own place)
    here = host_id()
    agreed = world_max(
        [1 if problem else 0, args.local_clients, -args.local_clients, args.arena_bytes,
         -args.arena_bytes, args.segment_bytes, *(here if k == node else 0 for k in range(nodes))],
    )  # fmt: skip
    failed, most, least, arena_most, arena_least, segments = agreed[:6]
    services_here = sum(1 for h in agreed[6:] if h == here)
    if failed:
        log.error("not starting: %s", problem or "another node could not start (see its log)")
        return 1
    if most != -least:
        log.error(
            "not starting: the nodes were given different --local-clients (%d to %d)",
            -least,
            most,
        )
        return 2
    if arena_most != -arena_least:
        log.error(
            "not starting: the nodes were given different --arena-bytes (%d to %d)",
            -arena_least,
            arena_most,
        )
        return 2
    # The clients' ops: the arena, and an engine among the nodes' services (MPI on a
    # communicator of its own; the compiled lane runs it), which also carries what each
    # service sees of its own clients (a death, a new process) to the others.
    engine = Service(MPITransport(), engine_config(config)) if nodes > 1 else None
    arena = Arena.create(args.local_clients, args.arena_bytes // args.local_clients)
    # what the clients' waits weigh against the cores: every service of the job on this
    # host, and their clients, poll while an op is on its way
    arena.header[A.H_HOST_PROCS] = services_here * (args.local_clients + 1)
    thin = ThinService(
        arena, node, nodes, engine, stall_warning_s=config.stall_warning_s,
        pipe_min_bytes=segments,
    )  # fmt: skip
    if nodes > 1 and args.local_clients > 1:
        if segments < OFF:
            log.info("allreduces and broadcasts of %d bytes or more run among the nodes in "
                     "%d segments", segments, SEGMENTS)  # fmt: skip
        else:
            log.info("no op among the nodes runs in segments (--segment-bytes)")
    warm_up()
    listener = sockets.listen(path)
    options = {k: int(getattr(config, k)) for k in hello.SHARED_OPTIONS}
    server = Node(
        listener,
        path,
        node=node,
        nodes=nodes,
        local_clients=args.local_clients,
        options=options,
        thin=thin,
        drain_timeout=args.drain_timeout,
    )
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda num, _frame: server.stop(signal.Signals(num).name))
    ft = None
    if args.fault_tolerant:
        from ..transport.ft_frames import ft_socket
        from .ft import FtService

        ft_path = ft_socket(directory, node)
        sockets.check_free(ft_path)
        ft = FtService(
            ft_path,
            node,
            nodes,
            engine,
            join_timeout_s=args.join_timeout,
            first_quorum=args.first_quorum,
        )
        ft.start()
        log.info("fault-tolerant members attach on %s", ft_path)
    n = args.local_clients
    print(
        f"totalreduce serve: node {node} of {nodes} listening on {path} "
        f"(local clients {n}: ranks {node * n}..{node * n + n - 1} of {nodes * n})",
        flush=True,
    )
    try:
        status = server.run()
    finally:
        listener.close()
        try:
            path.unlink()
        except OSError:
            pass
        if ft is not None:
            ft.stop()
        thin.stop()
        if engine is not None:
            engine.shutdown(timeout=2)
        if ft is not None:
            ft.join(2)
        arena.close()
    log.info("stopped")
    return status


if __name__ == "__main__":
    sys.exit(main())

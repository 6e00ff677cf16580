"""torch.distributed over gloo on the ranks that ``mpiexec`` started.

MPI already knows every rank and the world size; rank 0 picks a free local TCP
port and broadcasts it with mpi4py, so no environment variable needs setting.
"""

from __future__ import annotations

import socket

import torch.distributed as dist
from mpi4py import MPI


def init_gloo() -> None:
    """``dist.init_process_group("gloo")`` with MPI's rank and size (127.0.0.1: one machine)."""
    comm = MPI.COMM_WORLD
    port = 0
    if comm.rank == 0:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
    port = comm.bcast(port, root=0)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=comm.rank,
        world_size=comm.size,
    )

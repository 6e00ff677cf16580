"""What launched this process, and torchrun's variables under ``mpiexec``.

This module owns the reading of launchers' environments (no MPI call, no torch):

- :func:`mpi_launch`: the rank, size, local rank and local size an MPI launcher
  (MPICH's Hydra, Open MPI, Slurm with PMI) gave this process, or None;
- :func:`provide_torchrun_env`: under such a launcher, set torchrun's variables
  (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``,
  ``ROLE_RANK``, ...) where they are unset, so torchrun-style scripts run under
  ``mpiexec`` unchanged; what the user set is never overwritten;
- :func:`expected_processes` and :func:`check_world`: a launcher that says the job
  has N > 1 processes (torchrun, or any setting ``WORLD_SIZE``) while the world
  totalreduce found has another size is an error, never N silent one-rank worlds;
- daemon mode: :func:`launcher_slot` (the node service's slot a launcher asks for:
  torchrun's ``LOCAL_RANK``, srun's ``SLURM_LOCALID``), :func:`check_daemon_rank`
  (under torchrun, the rank the node services gave must be the one torchrun said),
  :func:`daemon_requested` (this process will be a node service's client) and, in
  :func:`check_world`'s error under torchrun, how to run daemon mode instead and the
  service found on this node;
- :func:`find_mpiexec`: the ``mpiexec`` of this Python's MPI.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

from .errors import TotalReduceError


class LaunchError(TotalReduceError, RuntimeError):
    """The way this process was launched cannot give the world it expects."""


@dataclass(frozen=True)
class MPILaunch:
    """Where an MPI launcher put this process."""

    launcher: str
    rank: int
    size: int
    local_rank: int
    local_size: int


def _int(env: Mapping[str, str], name: str) -> int | None:
    v = env.get(name)
    if v is None or not v.strip().lstrip("-").isdigit():
        return None
    return int(v)


def mpi_launch(env: Mapping[str, str] | None = None) -> MPILaunch | None:
    """The placement an MPI launcher gave this process (from its variables), or None."""
    env = os.environ if env is None else env
    # (launcher, rank, size, local rank, local size)
    for launcher, r, s, lr, ls in (
        ("Open MPI's mpiexec", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
         "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
        ("MPICH's mpiexec (Hydra)", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
        ("PMIx", "PMIX_RANK", "PMIX_SIZE", "PMIX_LOCAL_RANK", "PMIX_LOCAL_SIZE"),
    ):  # fmt: skip
        rank, size = _int(env, r), _int(env, s)
        if rank is None or size is None:
            continue
        local_rank, local_size = _int(env, lr), _int(env, ls)
        if local_rank is None or local_size is None:
            local_rank, local_size = (rank, size) if size == 1 else (-1, -1)
        return MPILaunch(launcher, rank, size, local_rank, local_size)
    return None


def provide_torchrun_env(
    env: MutableMapping[str, str] | None = None, launch: MPILaunch | None = None
) -> dict[str, str]:
    """Under an MPI launcher, set torchrun's variables that are unset; returns what was set.

    ``launch`` (default: :func:`mpi_launch`) may come from MPI itself once it runs.
    ``MASTER_ADDR``/``MASTER_PORT`` are not guessed here: ``env://`` without them is
    answered by MPI (see ``totalreduce.torch``), which needs no address.
    """
    env = os.environ if env is None else env
    launch = mpi_launch(env) if launch is None else launch
    if launch is None:
        return {}
    values = {
        "RANK": launch.rank,
        "WORLD_SIZE": launch.size,
        "GROUP_RANK": 0,
        "ROLE_RANK": launch.rank,
        "ROLE_WORLD_SIZE": launch.size,
        "ROLE_NAME": "default",
        "GROUP_WORLD_SIZE": 1,
    }
    if launch.local_rank >= 0:
        values["LOCAL_RANK"] = launch.local_rank
        values["LOCAL_WORLD_SIZE"] = launch.local_size
        if launch.local_size > 0 and launch.size % launch.local_size == 0:
            # torchrun's "group" is a node: nodes of equal size are numbered in rank order.
            values["GROUP_RANK"] = launch.rank // launch.local_size
            values["GROUP_WORLD_SIZE"] = launch.size // launch.local_size
    set_now: dict[str, str] = {}
    for k, v in values.items():
        if k not in env:
            env[k] = set_now[k] = str(v)
    return set_now


def expected_processes(env: Mapping[str, str] | None = None) -> tuple[int, str] | None:
    """How many processes the launcher's variables say the job has, and who said so
    (None: no launcher says more than one)."""
    env = os.environ if env is None else env
    launch = mpi_launch(env)
    if launch is not None and launch.size > 1:
        return launch.size, launch.launcher
    world = _int(env, "WORLD_SIZE")
    if world is not None and world > 1:
        if "TORCHELASTIC_RUN_ID" in env or "TORCHELASTIC_RESTART_COUNT" in env:
            return world, "torchrun"
        return world, "WORLD_SIZE"
    tasks = _int(env, "SLURM_NTASKS")
    if tasks is not None and tasks > 1 and "SLURM_STEP_ID" in env:
        return tasks, "srun (SLURM_NTASKS)"
    return None


def check_world(
    size: int, what: str = "its MPI world", env: Mapping[str, str] | None = None
) -> None:
    """Raise :class:`LaunchError` if the launcher says the job has N > 1 processes but this
    process found a world of ``size`` (``what`` names that world)."""
    expected = expected_processes(env)
    if expected is None or expected[0] == size:
        return
    n, who = expected
    if size == 1:
        raise LaunchError(
            f"this process is alone in {what} (1 rank), but {who} says the job has {n} "
            f"processes: each would train its own model. totalreduce's ranks come from MPI: "
            f"launch the same script with `mpiexec -n {n} python ...` (torchrun-style scripts "
            "run unchanged there: totalreduce sets RANK, LOCAL_RANK and WORLD_SIZE); under "
            f"{who if who != 'WORLD_SIZE' else 'its launcher'} use the gloo or nccl backend"
            + (_daemon_hint(n, env) if what == "its MPI world" else "")
        )
    raise LaunchError(
        f"{what} has {size} ranks, but {who} says the job has {n} processes; launch with "
        f"`mpiexec -n {n}` and leave WORLD_SIZE unset or equal to it"
    )


def launcher_slot(env: Mapping[str, str] | None = None) -> tuple[int, str] | None:
    """Daemon mode: the node service's slot a launcher asks this process to take, and which
    launcher (None: none says; the service gives the lowest free slot).

    torchrun's ``LOCAL_RANK`` (under ``TORCHELASTIC_RUN_ID``) and srun's ``SLURM_LOCALID``
    (within a step) start one process per slot on a node.  An MPI launcher's local rank is
    not used: daemon clients started by ``mpiexec`` may stand for several nodes on one host,
    and name their slots with ``TOTALREDUCE_LOCAL_RANK``."""
    env = os.environ if env is None else env
    local = _int(env, "LOCAL_RANK")
    if local is not None and local >= 0 and "TORCHELASTIC_RUN_ID" in env:
        return local, "torchrun"
    local = _int(env, "SLURM_LOCALID")
    if local is not None and local >= 0 and "SLURM_STEP_ID" in env:
        return local, "srun (SLURM_LOCALID)"
    return None


def check_daemon_rank(
    rank: int,
    size: int,
    local_rank: int,
    local_size: int,
    node: int,
    where: str,
    env: Mapping[str, str] | None = None,
) -> None:
    """Under torchrun, raise :class:`LaunchError` if the rank the node services gave this
    process (``rank`` of ``size``: slot ``local_rank`` of ``local_size`` on node ``node``,
    at ``where``) is not the one torchrun's variables say (``RANK``, ``LOCAL_RANK``,
    ``LOCAL_WORLD_SIZE``): torch and the data loaders would then disagree with the
    collectives about who is who."""
    env = os.environ if env is None else env
    if "TORCHELASTIC_RUN_ID" not in env:
        return  # only torchrun's own variables are checked (others may be totalreduce's)
    said = {k: _int(env, k) for k in ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    who = "torchrun"
    wrong = []
    if said["RANK"] is not None and said["RANK"] != rank:
        wrong.append(f"RANK={said['RANK']}")
    if said["LOCAL_RANK"] is not None and said["LOCAL_RANK"] != local_rank:
        wrong.append(f"LOCAL_RANK={said['LOCAL_RANK']}")
    if said["LOCAL_WORLD_SIZE"] is not None and said["LOCAL_WORLD_SIZE"] != local_size:
        wrong.append(f"LOCAL_WORLD_SIZE={said['LOCAL_WORLD_SIZE']}")
    if not wrong:
        return
    hint = ""
    if said["RANK"] is not None and said["RANK"] != rank and local_size > 0:
        hint = (
            f"; each node's processes take the ranks of its service (node {node} has ranks "
            f"{node * local_size}..{node * local_size + local_size - 1}): start them beside "
            f"that service (torchrun --node-rank {node} --nproc-per-node {local_size})"
        )
    raise LaunchError(
        f"{who} says this process is {', '.join(wrong)}, but the node service at {where} "
        f"made it rank {rank} of {size} (slot {local_rank} of {local_size} on node {node})"
        f"{hint}"
    )


def daemon_requested(env: Mapping[str, str] | None = None) -> bool:
    """Whether ``init()`` (without arguments) makes this process a node service's client:
    ``TOTALREDUCE_SERVICE=daemon``, or a socket named without a service."""
    env = os.environ if env is None else env
    service = env.get("TOTALREDUCE_SERVICE", "").strip().lower()
    return service == "daemon" or (not service and bool(env.get("TOTALREDUCE_SOCKET")))


def _daemon_hint(n: int, env: Mapping[str, str] | None) -> str:
    """How to keep this launcher and run daemon mode: the variables, and the service (or
    sockets) found on this node where a daemon client would look for it."""
    env = os.environ if env is None else env
    per_node = _int(env, "LOCAL_WORLD_SIZE") or n
    text = (
        ", or keep it and totalreduce in daemon mode: start one node service per node "
        f"(`mpiexec -n NODES totalreduce serve --local-clients {per_node}`, one rank per node) "
        "and set TOTALREDUCE_SERVICE=daemon in the training processes' environment "
        "(TOTALREDUCE_SOCKET=PATH as well where a node has several service sockets); "
        "docs/daemon.md"
    )
    from .transport.hello import default_dir  # (no MPI: the socket's paths only)

    directory = default_dir()
    try:
        found = sorted(directory.glob("node*.sock")) if directory.is_dir() else []
    except OSError:
        found = []
    if not found:
        return text + f". No service runs on this node (no socket in {directory})"
    live = [p for p in found if _answers(p)]
    if len(found) == 1:
        state = "a service listens there" if live else "no service answers on it (stale?)"
        return text + f". Found on this node: {found[0]} ({state})"
    names = ", ".join(f"{p}{'' if p in live else ' (no service answers)'}" for p in found)
    return text + f". Found on this node: {names}: set TOTALREDUCE_SOCKET to this node's"


def _answers(path: os.PathLike[str]) -> bool:
    """Whether a service accepts connections on the socket ``path`` (it says nothing to
    it: the service drops a connection that never says hello)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(0.5)
    try:
        s.connect(os.fspath(path))
        return True
    except OSError:
        return False
    finally:
        s.close()


def find_mpiexec() -> str | None:
    """The ``mpiexec`` of this Python's MPI: the one beside ``sys.executable`` (the
    ``mpich`` wheel installs it there, also in a virtual environment that is not
    activated), else the first on ``PATH``; None if there is none."""
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if os.path.isfile(beside) and os.access(beside, os.X_OK):
        return beside
    return shutil.which("mpiexec")

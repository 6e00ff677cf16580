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
  totalreduce found has another size is an error, never N silent one-rank worlds.
"""

from __future__ import annotations

import os
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
            "torchrun use the gloo or nccl backend"
        )
    raise LaunchError(
        f"{what} has {size} ranks, but {who} says the job has {n} processes; launch with "
        f"`mpiexec -n {n}` and leave WORLD_SIZE unset or equal to it"
    )

"""Run under ``mpiexec -n 2``: rank 1 dies at step 2; rank 0 must raise, not crash or hang.

Usage: ``check_dead_peer.py PATH DEATH [uncaught]`` with ``PATH`` one of ``ddp`` (unchanged DDP
on the ``"totalreduce"`` backend), ``hook`` (DDP over gloo with
``trt.allreduce_hook``) or ``optimizer`` (``trt.DistributedOptimizer``), and
``DEATH`` one of ``raise``, ``exit`` (``os._exit(3)``) or ``kill`` (SIGKILL);
with ``uncaught`` the survivor lets the error end the program (status 1).

Each rank runs the training as a child process of itself (the supervisor, the
process ``mpiexec`` started), so that the survivor's own exit status can be seen:
``mpiexec`` reports only the job's.  The supervisor forwards the signals the
launcher sends (SIGUSR1 is how MPICH's ``-disable-auto-cleanup`` tells the
survivors), prints ``RANK r EXIT STATUS s AT t`` (``s`` negative: the signal that
ended the child) and exits with the child's status (128 + N for signal N, as a
shell reports it).  The child prints:

- rank 1: ``DYING AT t`` just before it dies;
- rank 0: ``SURVIVOR RAISED <type>: <message>`` when the training step raised a
  ``RuntimeError``, then ``SURVIVOR WORK RAISED ...`` when a plain collective
  (``dist.all_reduce``/``trt.allreduce``) also raised, then leaves through the normal
  shutdown path; ``SURVIVOR DID NOT RAISE`` (exit 1) when training went on.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import subprocess
import sys
import time

CHILD = "TOTALREDUCE_DEAD_PEER_CHILD"
STEPS = 6
DIES_AT = 2
#: A survivor still running this long after it raised is hung: dump where, and fail.
EXIT_WITHIN_S = 25


def supervise() -> None:
    rank = os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "?"))
    child = subprocess.Popen(
        [sys.executable, *sys.argv], env=dict(os.environ, **{CHILD: "1"}), close_fds=False
    )

    def forward(signum: int, _frame: object) -> None:
        child.send_signal(signum)

    for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    status = child.wait()
    print(f"RANK {rank} EXIT STATUS {status} AT {time.time():.3f}", flush=True)
    # A signal's death is reported as 128 + N, as a shell does: Hydra's proxy SIGKILLs
    # every other process when one it launched dies of a signal, -disable-auto-cleanup
    # or not (the waitpid loop of hydra's pmip.c), which no library could answer.
    sys.exit(128 - status if status < 0 else status)


def train(path: str, death: str, rank: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import totalreduce.torch as trt

    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    if path == "optimizer":
        trt.init()
        opt = trt.DistributedOptimizer(
            torch.optim.SGD(net.parameters(), lr=0.1), named_parameters=net.named_parameters()
        )
        model = net
    else:
        backend = "totalreduce" if path == "ddp" else "gloo"
        dist.init_process_group(backend=backend, init_method="totalreduce://")
        model = DDP(net, bucket_cap_mb=0.0001)  # several buckets
        if path == "hook":
            model.register_comm_hook(None, trt.allreduce_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    for step in range(STEPS):
        if rank == 1 and step == DIES_AT:
            print(f"DYING AT {time.time():.3f}", flush=True)
            if death == "raise":
                raise RuntimeError("rank 1 fails on purpose")
            if death == "exit":
                os._exit(3)
            os.kill(os.getpid(), signal.SIGKILL)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def plain_collective(path: str) -> None:
    """After the failure, a plain collective with the dead rank raises too."""
    import torch
    import torch.distributed as dist

    import totalreduce.torch as trt

    if path == "ddp":
        dist.all_reduce(torch.ones(3))  # Work.wait() on the backend
    else:
        trt.allreduce(torch.ones(3), name="after")


def main() -> None:
    if not os.environ.get(CHILD):
        supervise()
    path, death = sys.argv[1], sys.argv[2]
    from mpi4py import MPI

    rank = MPI.COMM_WORLD.rank
    try:
        train(path, death, rank)
    except RuntimeError as exc:
        if rank == 1:
            raise
        print(f"SURVIVOR RAISED {type(exc).__name__}: {exc}", flush=True)
        # A survivor that hangs on its way out shows where, and fails the test.
        faulthandler.dump_traceback_later(EXIT_WITHIN_S, exit=True)
        try:
            plain_collective(path)
        except RuntimeError as again:
            print(f"SURVIVOR WORK RAISED {type(again).__name__}: {again}", flush=True)
        else:
            print("SURVIVOR WORK DID NOT RAISE", flush=True)
        if sys.argv[3:] == ["uncaught"]:
            raise  # the interpreter ends with status 1 through the usual shutdown path
    else:
        if rank == 0:
            print("SURVIVOR DID NOT RAISE", flush=True)
            sys.exit(1)


if __name__ == "__main__":
    main()

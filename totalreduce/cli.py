"""The ``totalreduce`` command: ``demo``, ``bench``, ``tune``, ``topology``, ``timeline``,
``info``, ``serve``.

``demo``, ``bench`` and ``tune`` run under ``mpiexec`` (``mpiexec -n 4 totalreduce demo``);
``topology``, ``timeline`` and ``info`` run anywhere.  ``totalreduce --version`` prints the
version.
"""

from __future__ import annotations

import sys

USAGE = """usage: totalreduce COMMAND [ARGS]
       totalreduce --version

commands:
  demo       per-layer gradients in different orders with priorities (under mpiexec)
  bench      collectives against MPI's in nccl-tests' columns (under mpiexec);
             --algorithm all, --neighbor, --latency; --csv/--json/--plot FILE
  tune       time every algorithm at this P and write the crossovers auto follows
             (under mpiexec; TOTALREDUCE_TUNING_FILE=FILE makes auto use them)
  topology   print a topology's mixing matrix and rho, optionally draw it
  timeline   merge the ranks' traces (TOTALREDUCE_TIMELINE), or plot one as a PNG
  info       versions, MPI library and thread level, torch, configuration, tuning table
  serve      this node's service for daemon mode (under mpiexec, one rank per node)
"""


def _info(argv: list[str]) -> int:
    import numba
    import numpy

    import totalreduce
    from totalreduce.service.config import Config

    print(f"totalreduce {totalreduce.__version__}")
    print(f"python {sys.version.split()[0]}, numpy {numpy.__version__}, numba {numba.__version__}")
    try:
        import mpi4py
        from mpi4py import MPI

        lib = MPI.Get_library_version().splitlines()[0].strip()
        levels = {
            MPI.THREAD_SINGLE: "SINGLE",
            MPI.THREAD_FUNNELED: "FUNNELED",
            MPI.THREAD_SERIALIZED: "SERIALIZED",
            MPI.THREAD_MULTIPLE: "MULTIPLE",
        }
        level = MPI.Query_thread()
        print(f"mpi4py {mpi4py.__version__}: {lib}; thread level {levels.get(level, level)}")
    except Exception as exc:  # info must print what it can
        print(f"mpi4py: unavailable ({exc})")
    print(_torch_line())
    for k, v in Config.load().__dict__.items():
        print(f"  {k} = {v}")
    from totalreduce.service.tuning import describe

    print(f"tuning table in force: {describe()}")
    return 0


def _torch_line() -> str:
    """torch's version and whether ``totalreduce.torch`` imports, with the reason if not."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        return "torch: not installed (totalreduce.torch needs it; the rest does not)"
    try:
        import torch
    except Exception as exc:  # a broken install: say why
        return f"torch: installed but does not import ({type(exc).__name__}: {exc})"
    try:
        import totalreduce.torch  # noqa: F401
    except Exception as exc:
        return f"torch {torch.__version__}; totalreduce.torch does not import ({exc})"
    cuda = "CUDA available" if torch.cuda.is_available() else "no CUDA"
    return f"torch {torch.__version__} ({cuda}); totalreduce.torch imports"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if args else 2
    if args[0] == "--version":
        from . import __version__

        print(f"totalreduce {__version__}")
        return 0
    cmd, rest = args[0], args[1:]
    if cmd == "demo":
        from .demo import main as run
    elif cmd == "bench":
        from .bench import main as run
    elif cmd == "tune":
        from .bench.tune import main as run
    elif cmd == "topology":
        from .topology.cli import main as run
    elif cmd == "timeline":
        from .timeline.cli import main as run
    elif cmd == "info":
        run = _info
    elif cmd == "serve":
        from .daemon.serve import main as run
    else:
        print(f"totalreduce: unknown command {cmd!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    return int(run(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())

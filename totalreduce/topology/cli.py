"""The ``totalreduce topology`` command: print (and optionally draw) a topology's matrix.

Usage::

    totalreduce topology NAME -n N [--step T] [--local-size L] [--base B]
                         [--style S] [--shape RxC] [--center C] [--one-peer]
                         [--precision P] [--plot FILE.png]
    python -m totalreduce.topology.cli exp -n 8 --step 1

It prints ``W(step)`` with fixed precision (zeros as ``.``), whether it is row and column
stochastic, rho of that step's matrix and rho of the product over one period.  This
module owns only the argument parsing and the printing; :func:`main` returns the exit
status (0, or 2 for a usage error such as an unknown topology).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TextIO

import numpy as np

from . import analysis
from .graph_model import Graph
from .mixing import MixingTopology
from .one_peer import OnePeerGraph
from .plot import plot_topology
from .registry import get_topology, known_topologies, topology_class


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="totalreduce topology",
        description="Print a topology's mixing matrix W (row i = the weights rank i gives to "
        "what it receives), its stochasticity and its consensus rate rho.",
    )
    p.add_argument("name", metavar="NAME", help=f"one of: {', '.join(known_topologies())}")
    p.add_argument("-n", "--world-size", type=int, required=True, help="number of ranks")
    p.add_argument("--step", type=int, default=0, help="which step's matrix (default 0)")
    p.add_argument("--local-size", type=int, help="ranks per node (alternating-exp-ring)")
    p.add_argument("--base", type=int, help="base of the exponential graphs")
    p.add_argument("--style", help="ring-graph style: bidirectional, left or right")
    p.add_argument("--shape", help="mesh-grid-2d shape as ROWSxCOLS, e.g. 3x4")
    p.add_argument("--center", type=int, help="center rank of the star graph")
    p.add_argument(
        "--one-peer",
        action="store_true",
        help="use the one-peer dynamic rotation of the graph NAME (static graphs only)",
    )
    p.add_argument("--precision", type=int, default=3, help="decimals printed (default 3)")
    p.add_argument("--plot", metavar="FILE.png", help="also draw the graph to this file")
    return p


def _options(args: argparse.Namespace) -> dict[str, object]:
    options: dict[str, object] = {}
    if args.local_size is not None:
        options["local_size"] = args.local_size
    if args.base is not None:
        options["base"] = args.base
    if args.style is not None:
        options["style"] = args.style
    if args.center is not None:
        options["center"] = args.center
    if args.shape is not None:
        try:
            rows, cols = (int(v) for v in args.shape.lower().split("x"))
        except ValueError:
            raise ValueError(f"--shape must look like ROWSxCOLS, got {args.shape!r}") from None
        options["shape"] = (rows, cols)
    return options


def _is_graph(name: str) -> bool:
    return issubclass(topology_class(name), Graph)


def format_matrix(w: np.ndarray, precision: int = 3) -> str:
    """``w`` as aligned text with ``precision`` decimals; exact zeros print as ``.``."""
    n = w.shape[0]
    width = max(precision + 2, len(str(n - 1)))
    label = len(str(n - 1))
    lines = [" " * (label + 1) + " ".join(f"{j:>{width}}" for j in range(n))]
    for i in range(n):
        cells = [f"{v:>{width}.{precision}f}" if v != 0.0 else f"{'.':>{width}}" for v in w[i]]
        lines.append(f"{i:>{label}} " + " ".join(cells))
    return "\n".join(lines)


def report(topology: MixingTopology, step: int, precision: int = 3) -> str:
    """The text the command prints for ``topology`` at ``step``."""
    w = topology.matrix(step)
    label = topology.describe()
    phase = step % topology.period
    yes = {True: "yes", False: "no"}
    return "\n".join(
        [
            f"{label}: period {topology.period}, step {step} (phase {phase})",
            f"W({step}), row i = the weights rank i gives to the values it receives:",
            format_matrix(w, precision),
            f"row stochastic: {yes[analysis.is_row_stochastic(w)]}, "
            f"column stochastic: {yes[analysis.is_column_stochastic(w)]}",
            f"rho(W({step})) = {analysis.rho(w):.6f}",
            f"rho(product over the period of {topology.period}) = "
            f"{analysis.rho_period(topology):.6f}",
        ]
    )


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    """Run ``totalreduce topology`` with ``argv`` (default: ``sys.argv[1:]``)."""
    out = out if out is not None else sys.stdout
    parser = _parser()
    args = parser.parse_args(None if argv is None else list(argv))
    try:
        topology = get_topology(args.name, args.world_size, **_options(args))
        if args.one_peer:
            if not isinstance(topology, Graph):
                raise ValueError(
                    f"--one-peer needs a static graph, and {args.name!r} is not one; "
                    f"graphs: {', '.join(n for n in known_topologies() if _is_graph(n))}"
                )
            topology = OnePeerGraph(topology)
        text = report(topology, args.step, args.precision)
    except (ValueError, TypeError) as exc:
        print(f"totalreduce topology: error: {exc}", file=sys.stderr)
        return 2
    print(text, file=out)
    if args.plot:
        try:
            plot_topology(topology, args.plot, step=args.step)
        except ImportError as exc:
            print(f"totalreduce topology: error: {exc}", file=sys.stderr)
            return 2
        print(f"drew {args.plot}", file=out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

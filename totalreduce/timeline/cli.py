"""The ``totalreduce timeline`` command: ``merge`` the ranks' traces, ``plot`` one as a PNG.

Usage::

    totalreduce timeline merge OUT.json trace.0.json trace.1.json ...
    totalreduce timeline plot TRACE.json -o step.png [--title TEXT] [--last-ms MS]

:func:`main` returns the exit status: 0, 1 for a file that is not a trace, 2 for a usage error.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Sequence

from .trace import TraceError, load, merge, write


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="totalreduce timeline",
        description="Work with the Chrome traces that TOTALREDUCE_TIMELINE=PATH writes per rank.",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    m = sub.add_parser("merge", help="join the ranks' traces into one, clocks aligned")
    m.add_argument("out", metavar="OUT", help="the merged trace to write (JSON)")
    m.add_argument("files", metavar="FILE", nargs="+", help="one trace per rank")
    d = sub.add_parser("plot", help="draw a trace: one row per rank, ops colored by priority")
    d.add_argument("trace", metavar="TRACE", help="a merged trace or one rank's trace")
    d.add_argument("-o", "--output", required=True, metavar="PNG", help="the image to write")
    d.add_argument("--title", default="", help="the figure's title")
    d.add_argument(
        "--last-ms", type=float, default=0.0, help="draw only the trace's last MS milliseconds"
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:  # argparse exits on --help and on usage errors
        return int(exc.code or 0)
    try:
        if args.command == "merge":
            events = merge(args.files)
            write(args.out, events)
            ranks = sorted({e["pid"] for e in events if "pid" in e})
            print(f"wrote {args.out}: {len(events)} events of ranks {ranks}")
        else:
            if importlib.util.find_spec("matplotlib") is None:
                print("totalreduce timeline plot needs matplotlib: pip install totalreduce[plot]")
                return 1
            from .plot import plot

            plot(load(args.trace), args.output, args.title, args.last_ms)
            print(f"wrote {args.output}")
    except (TraceError, OSError) as exc:
        print(f"totalreduce timeline: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

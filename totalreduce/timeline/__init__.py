"""Timelines: a Chrome trace of each rank's ops, segments, reductions and waits.

``TOTALREDUCE_TIMELINE=PATH`` (or ``init(timeline=PATH)``) makes each rank's engine record
into a :class:`Timeline` and write ``PATH.<rank>.json`` (or ``PATH`` with ``{rank}``
replaced). ``totalreduce timeline merge OUT FILES...`` joins the ranks' files into one trace
with their clocks aligned, for Perfetto or chrome://tracing; ``totalreduce timeline plot
TRACE -o PNG`` draws one row per rank. See docs/timeline.md.
"""

from __future__ import annotations

from .recorder import OP_EVENTS, Timeline, timeline_path
from .trace import TraceError, load, merge, write

__all__ = ["OP_EVENTS", "Timeline", "TraceError", "load", "merge", "timeline_path", "write"]

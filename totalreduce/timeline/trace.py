"""Reading the recorder's Chrome traces and merging the ranks' files into one.

A rank's file gives its timestamps in microseconds since its recorder started, and says when
that was in its metadata: ``start_perf_ns + wall_minus_perf_ns`` is the start on the rank's
wall clock, plus the last offset given to ``Timeline.sync`` when the engine measured one. The
merge shifts every rank onto the earliest start, so that one moment has one abscissa on every
rank, up to how well the ranks' clocks agree (NTP keeps a cluster's within about a
millisecond; a sync offset does better).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from .recorder import CLOCK_EVENT, SYNC_EVENT


class TraceError(ValueError):
    """A file that is not a trace the recorder wrote, with the file and the reason."""


def load(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The events of a trace file, also of one whose writer stopped before its closing bracket,
    or in the middle of its last event (that event is left out)."""
    with open(path, encoding="utf-8") as f:
        text = f.read().strip()
    if not text.endswith("]"):
        text = text.rstrip().rstrip(",") + "\n]"
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        cut = text.rfind(",\n")  # the recorder writes one event per line
        try:
            data = json.loads(text[:cut] + "\n]") if cut > 0 else None
        except json.JSONDecodeError:
            data = None
        if data is None:
            raise TraceError(f"{path}: not a JSON trace ({exc})") from None
    if isinstance(data, dict):  # Chrome's object form
        data = data.get("traceEvents")
    if not isinstance(data, list) or not all(isinstance(e, dict) for e in data):
        raise TraceError(f"{path}: expected a JSON array of events")
    return data


def clock(events: Sequence[dict[str, Any]], path: str = "trace") -> tuple[int, int]:
    """``(rank, start_ns)``: the rank of a recorder's file and its start on the common clock."""
    meta = next((e for e in events if e.get("ph") == "M" and e.get("name") == CLOCK_EVENT), None)
    if meta is None:
        raise TraceError(f"{path}: no {CLOCK_EVENT} metadata (not written by a Timeline)")
    args = meta["args"]
    offset = 0
    for e in events:
        if e.get("ph") == "M" and e.get("name") == SYNC_EVENT:
            offset = int(e["args"]["offset_ns"])  # the last one wins
    return int(args["rank"]), int(args["start_perf_ns"]) + int(args["wall_minus_perf_ns"]) + offset


def merge(paths: Sequence[str | os.PathLike[str]]) -> list[dict[str, Any]]:
    """One trace of the ranks' files: one process per rank, timestamps on the earliest start.

    Raises :class:`TraceError` when two files are of the same rank or a file has no clock.
    """
    if not paths:
        raise TraceError("no trace files to merge")
    loaded = []
    seen: dict[int, str] = {}
    for path in paths:
        events = load(path)
        rank, start = clock(events, str(path))
        if rank in seen:
            raise TraceError(f"{path} and {seen[rank]} are both traces of rank {rank}")
        seen[rank] = str(path)
        loaded.append((rank, start, events))
    origin = min(start for _, start, _ in loaded)
    merged: list[dict[str, Any]] = []
    for rank, start, events in sorted(loaded, key=lambda item: item[0]):
        shift_us = (start - origin) / 1000.0
        for e in events:
            e = dict(e, pid=rank)
            if "ts" in e:
                e["ts"] = round(e["ts"] + shift_us, 3)
            elif e.get("name") == CLOCK_EVENT:
                e["args"] = dict(e["args"], merged_shift_us=shift_us)
            merged.append(e)
    return merged


def write(path: str | os.PathLike[str], events: Sequence[dict[str, Any]]) -> None:
    """Write ``events`` as a complete Chrome trace (a JSON array)."""
    with open(path, "w", encoding="utf-8") as f:
        f.write("[\n")
        f.write(",\n".join(json.dumps(e, separators=(",", ":")) for e in events))
        f.write("\n]\n")

"""The timeline recorder: what the engine calls to trace one rank, written as a Chrome trace.

The rules the engine relies on:

- Every recording method appends one tuple to a list and returns (well under a microsecond);
  nothing is formatted and no file is touched on the caller's thread, and no lock is taken
  except to wake the writer when ``flush_every`` records are waiting. The recorder's writer
  thread formats and writes the records every ``flush_interval_s`` seconds, and sooner when
  woken. :meth:`Timeline.close` writes the rest and stops that thread: call it once per
  recorder (the service, at shutdown).
- Any thread may record: ``list.append`` is atomic under the interpreter lock, and the writer
  takes its records off the front of the list, so records appended meanwhile stay for the
  next write.
- Timestamps are ``time.perf_counter_ns()`` values of this process.
- The file is a JSON array that Perfetto (ui.perfetto.dev) and chrome://tracing open. It is
  written as records come in, without its closing bracket until :meth:`Timeline.close`, which
  both viewers accept: a job that crashes leaves a readable trace of what it recorded up to the
  last flush.

What the trace shows, one track per line in the viewer, in one process named ``rank R``:

- ``ops, priority P``: each op's life as one slice from submission to completion, cut into the
  phases ``queued`` (submitted, until its first frame goes out), ``on the wire`` (until its last
  frame is in), ``reducing`` (until reduced, when recorded) and ``finishing`` (until done).
  The slice's arguments carry the generation, the priority, the status and the threads that
  waited on it. Ops that overlap in time go to further lanes (``ops, priority P (2)``...).
- ``send to rank K`` / ``recv from rank K``: each segment on the wire, with its op and bytes.
- one track per thread (the reducer's, the comm thread's, the training thread's): reductions
  and waits, named by the op they serve.

>>> tl = Timeline("/tmp/trace.json", rank=0)                        # doctest: +SKIP
>>> tl.op("fc1.grad", 0, "submitted", priority=10)                  # doctest: +SKIP
>>> t0 = time.perf_counter_ns(); ...; t1 = time.perf_counter_ns()   # doctest: +SKIP
>>> tl.segment("fc1.grad", 0, "send", peer=1, nbytes=1 << 20, t0_ns=t0, t1_ns=t1)  # doctest: +SKIP
>>> tl.op("fc1.grad", 0, "done", priority=10)                       # doctest: +SKIP
>>> tl.close()  # writes /tmp/trace.json.0.json                    # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any, TextIO

OP_EVENTS = ("submitted", "first_send", "last_recv", "reduced", "done", "failed")
"""The events of an op's life, in the order they happen; ``done`` or ``failed`` ends it."""
_OP_EVENT_SET = frozenset(OP_EVENTS)

CLOCK_EVENT = "totalreduce_clock"
"""Name of the metadata event carrying a file's clock: ``start_perf_ns`` (the perf_counter
value that ``ts`` 0 stands for), ``wall_minus_perf_ns`` (``time.time_ns() -
time.perf_counter_ns()`` at start) and ``rank``."""

SYNC_EVENT = "totalreduce_sync"
"""Name of the metadata event carrying a clock offset given to :meth:`Timeline.sync`."""

# Phases of an op's slice: (name, event that starts it, events that may end it, first found).
_PHASES = (
    ("queued", "submitted", ("first_send", "last_recv", "reduced", "end")),
    ("on the wire", "first_send", ("last_recv", "reduced", "end")),
    ("reducing", "last_recv", ("reduced", "end")),
    ("finishing", "reduced", ("end",)),
)

MAX_LANES = 64
"""Most lanes of one track; past that, slices of a lane may overlap (drawn less clearly)."""

# Where each kind of track sorts in the viewer.
_SORT_OPS, _SORT_WIRE, _SORT_THREADS = 0, 1000, 2000


def timeline_path(path: str, rank: int) -> str:
    """The file of ``rank`` for the option value ``path``.

    ``{rank}`` in ``path`` is replaced by the rank; otherwise ``.<rank>.json`` is appended.

    >>> timeline_path("trace-{rank}.json", 3)
    'trace-3.json'
    >>> timeline_path("/tmp/step", 3)
    '/tmp/step.3.json'
    """
    if "{rank}" in path:
        return path.replace("{rank}", str(rank))
    return f"{path}.{rank}.json"


class _Tracks:
    """Track ids of one process: a lane per track name, so no two slices of a lane overlap.

    Chrome and Perfetto draw slices of one track properly only if they nest; ops and segments
    overlap freely, so each one goes to the first lane of its track whose last slice ended
    before it starts, and a new lane is opened otherwise.
    """

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}
        self.lanes: dict[str, list[tuple[int, int]]] = {}  # track -> [(tid, last end ns)]
        self.new: list[tuple[str, int, int]] = []  # (lane name, tid, sort index) not yet written

    def lane(self, track: str, sort: int, t0: int, t1: int) -> int:
        lanes = self.lanes.setdefault(track, [])
        for k, (tid, end) in enumerate(lanes):
            if end <= t0:
                lanes[k] = (tid, max(end, t1))
                return tid
        if len(lanes) >= MAX_LANES:  # bounded: share the lane that frees first, overlapping
            k = min(range(len(lanes)), key=lambda i: lanes[i][1])
            tid, end = lanes[k]
            lanes[k] = (tid, max(end, t1))
            return tid
        tid = len(self.ids) + 1
        name = track if not lanes else f"{track} ({len(lanes) + 1})"
        self.ids[name] = tid
        lanes.append((tid, t1))
        self.new.append((name, tid, sort + len(lanes)))
        return tid


class Timeline:
    """Records one rank's ops, segments, reductions and waits; writes them as a Chrome trace.

    ``path`` is the option value (``TOTALREDUCE_TIMELINE``): the file written is
    :func:`timeline_path` of it.  The recorder's writer thread writes what is recorded every
    ``flush_interval_s`` seconds, or as soon as ``flush_every`` records wait.  Methods taking
    ``name`` accept the op's name (str or int) and ``generation``.
    """

    def __init__(
        self, path: str, rank: int, *, flush_every: int = 4096, flush_interval_s: float = 1.0
    ) -> None:
        if flush_every < 1:
            raise ValueError(f"flush_every must be >= 1, got {flush_every}")
        if not flush_interval_s > 0:
            raise ValueError(f"flush_interval_s must be > 0, got {flush_interval_s}")
        self.path = timeline_path(path, rank)
        self.rank = rank
        self.flush_every = flush_every
        self.flush_interval_s = flush_interval_s
        self.start_perf_ns = time.perf_counter_ns()
        self.wall_minus_perf_ns = time.time_ns() - time.perf_counter_ns()
        self._records: list[tuple[Any, ...]] = []
        self._lock = threading.Lock()
        self._closed = False
        self._file: TextIO | None = None
        self._first = True
        self._tracks = _Tracks()
        # (name, generation) -> {"priority": p, event: t_ns, "waiters": [...]}, until it ends.
        self._open: dict[tuple[Any, int], dict[str, Any]] = {}
        # Ops that ended but are not written yet, so that waits recorded later still name them.
        self._ended: dict[tuple[Any, int], dict[str, Any]] = {}
        self._quoted: dict[Any, str] = {}  # op name -> its JSON string
        self._wake = threading.Event()
        self._stop = False
        self._writer = threading.Thread(
            target=self._write_loop, name=f"totalreduce-timeline-{rank}", daemon=True
        )
        self._writer.start()

    # ------------------------------------------------------------------ recording (cheap)

    def op(
        self, name: Any, generation: int, event: str, priority: int, t_ns: int | None = None
    ) -> None:
        """A moment of an op's life: one of :data:`OP_EVENTS` (``t_ns`` defaults to now).

        Raises ValueError for another event, at the call, so a typo does not go unseen.
        """
        if event not in _OP_EVENT_SET:
            raise ValueError(f"op {name!r} generation {generation}: unknown event {event!r}")
        if t_ns is None:
            t_ns = time.perf_counter_ns()
        self._add(("op", name, generation, event, priority, t_ns))

    def segment(
        self,
        name: Any,
        generation: int,
        direction: str,
        peer: int,
        nbytes: int,
        t0_ns: int,
        t1_ns: int,
    ) -> None:
        """A segment of ``nbytes`` sent to or received from ``peer`` (``direction`` "send"
        or "recv") between ``t0_ns`` (posted) and ``t1_ns`` (completed)."""
        if direction != "send" and direction != "recv":
            raise ValueError(f"segment direction must be 'send' or 'recv', got {direction!r}")
        self._add(("segment", name, generation, direction, peer, nbytes, t0_ns, t1_ns))

    def compute(
        self, name: Any, generation: int, what: str, nbytes: int, t0_ns: int, t1_ns: int
    ) -> None:
        """Arithmetic for an op (``what``: e.g. "reduce", "copy", "epilogue") over ``nbytes``,
        on the calling thread's track."""
        thread = threading.current_thread().name
        self._add(("compute", name, generation, what, nbytes, t0_ns, t1_ns, thread))

    def wait(self, name: Any, generation: int, t0_ns: int, t1_ns: int) -> None:
        """The calling thread waited for the op from ``t0_ns`` to ``t1_ns``."""
        thread = threading.current_thread().name
        self._add(("wait", name, generation, t0_ns, t1_ns, thread))

    def sync(self, offset_ns: int) -> None:
        """This rank's clock is ``offset_ns`` behind the job's reference clock (add it to align).

        ``totalreduce timeline merge`` adds the last offset recorded to every timestamp of this
        rank, after aligning the ranks' wall clocks.
        """
        self._add(("sync", int(offset_ns)))

    def _add(self, record: tuple[Any, ...]) -> None:
        records = self._records
        records.append(record)
        if len(records) >= self.flush_every:
            self._wake.set()

    # ------------------------------------------------------------------ writing

    def flush(self) -> None:
        """Write what is recorded so far now (ops still in flight wait for their end)."""
        with self._lock:
            self._flush_locked(final=False)

    def _write_loop(self) -> None:
        while not self._stop:
            self._wake.wait(self.flush_interval_s)
            self._wake.clear()
            if self._stop:
                return
            with self._lock:
                self._flush_locked(final=False)

    def close(self) -> None:
        """Write everything, ops still in flight included (status ``unfinished``), and the
        closing bracket.  Later calls do nothing; records made after it are dropped."""
        self._stop = True
        self._wake.set()
        if self._writer is not threading.current_thread():
            self._writer.join()
        with self._lock:
            if self._closed:
                return
            self._flush_locked(final=True)
            assert self._file is not None
            self._file.write("\n]\n")
            self._file.close()
            self._file = None
            self._closed = True

    def __enter__(self) -> Timeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _flush_locked(self, final: bool) -> None:
        records = self._records
        n = len(records)
        batch = records[:n]
        del records[:n]  # records appended since the slice stay in the list
        if self._closed:
            return
        events: list[str] = []
        if self._file is None:
            directory = os.path.dirname(self.path)
            if directory:
                os.makedirs(directory, exist_ok=True)
            self._file = open(self.path, "w", encoding="utf-8")
            self._file.write("[\n")
            events.extend(_json(e) for e in self._header())
        for rec in batch:
            kind = rec[0]
            if kind == "op":
                self._op_record(rec)
            elif kind == "segment":
                events.append(self._segment_event(rec))
            elif kind == "compute":
                events.append(self._compute_event(rec))
            elif kind == "wait":
                events.append(self._wait_event(rec))
            else:  # sync
                sync = {"name": SYNC_EVENT, "ph": "M", "pid": self.rank}
                events.append(_json(dict(sync, args={"offset_ns": rec[1]})))
        if final:
            for key, life in self._open.items():
                life["status"] = "unfinished"
                self._ended[key] = life
            self._open = {}
        # An op is written one flush after the one that saw it end, so that the waits ending
        # after it (a wait returns after its op is done) are listed among its waiters.
        for key, life in list(self._ended.items()):
            if final or life.get("seen"):
                events.extend(self._op_events(key, life))
                del self._ended[key]
            else:
                life["seen"] = True
        tracks = self._tracks
        meta = [
            _json(m) for lane, tid, sort in tracks.new for m in self._thread_meta(lane, tid, sort)
        ]
        tracks.new = []
        self._write(meta + events)

    def _write(self, events: list[str]) -> None:
        assert self._file is not None
        if not events:
            return
        text = ",\n".join(events)
        self._file.write(text if self._first else ",\n" + text)
        self._first = False
        self._file.flush()

    # ------------------------------------------------------------------ formatting

    def _header(self) -> list[dict[str, Any]]:
        return [
            {
                "name": "process_name",
                "ph": "M",
                "pid": self.rank,
                "args": {"name": f"rank {self.rank}"},
            },
            {
                "name": "process_sort_index",
                "ph": "M",
                "pid": self.rank,
                "args": {"sort_index": self.rank},
            },
            {
                "name": CLOCK_EVENT,
                "ph": "M",
                "pid": self.rank,
                "args": {
                    "rank": self.rank,
                    "start_perf_ns": self.start_perf_ns,
                    "wall_minus_perf_ns": self.wall_minus_perf_ns,
                },
            },
        ]

    def _thread_meta(self, lane: str, tid: int, sort: int) -> list[dict[str, Any]]:
        return [
            {
                "name": "thread_name",
                "ph": "M",
                "pid": self.rank,
                "tid": tid,
                "args": {"name": lane},
            },
            {
                "name": "thread_sort_index",
                "ph": "M",
                "pid": self.rank,
                "tid": tid,
                "args": {"sort_index": sort},
            },
        ]

    def _op_record(self, rec: tuple[Any, ...]) -> None:
        _, name, generation, event, priority, t_ns = rec
        key = (name, generation)
        life = self._open.get(key)
        if life is None:
            life = self._open[key] = {"priority": priority, "waiters": []}
        life["priority"] = priority
        if event in ("done", "failed"):
            life["end"] = t_ns
            life["status"] = event
            del self._open[key]
            self._ended[key] = life
        else:
            life[event] = t_ns

    def _op_events(self, key: tuple[Any, int], life: dict[str, Any]) -> list[str]:
        name, generation = key
        times = [life[e] for e in (*OP_EVENTS[:4], "end") if e in life]
        if not times:  # an op with no moment recorded: nothing to draw
            return []
        t0 = life.get("submitted", min(times))
        t1 = life.get("end", max(times))
        priority = int(life["priority"])
        tid = self._tracks.lane(f"ops, priority {priority}", _SORT_OPS - priority, t0, t1)
        start = self.start_perf_ns
        args = [f'"generation":{int(generation)},"priority":{priority},"status":"{life["status"]}"']
        for e in OP_EVENTS[:4]:
            if e in life:
                args.append(f'"{e}_us":{(life[e] - start) / 1000.0:.3f}')
        if life["waiters"]:
            args.append(f'"waited_on_by":{json.dumps(sorted(set(life["waiters"])))}')
        us0, dur = (t0 - start) / 1000.0, max(t1 - t0, 0) / 1000.0
        out = [_OP % (self._quote(name), us0, dur, self.rank, tid, ",".join(args))]
        for phase, begin, stops in _PHASES:
            if begin not in life:
                continue
            stop = next((life[s] for s in stops if s in life), None)
            if stop is not None:
                us0, dur = (life[begin] - start) / 1000.0, max(stop - life[begin], 0) / 1000.0
                out.append(_PHASE % (phase, us0, dur, self.rank, tid))
        return out

    # Ops, segments, reductions and waits are the frequent events: formatted from templates.

    def _quote(self, name: Any) -> str:
        q = self._quoted.get(name)
        if q is None:
            if len(self._quoted) > 100_000:  # unnamed ops make new names forever
                self._quoted.clear()
            q = self._quoted[name] = json.dumps(str(name))
        return q

    def _segment_event(self, rec: tuple[Any, ...]) -> str:
        _, name, generation, direction, peer, nbytes, t0, t1 = rec
        track = f"send to rank {peer}" if direction == "send" else f"recv from rank {peer}"
        tid = self._tracks.lane(track, _SORT_WIRE + 2 * peer + (direction != "send"), t0, t1)
        return _SEGMENT % (
            self._quote(name),
            (t0 - self.start_perf_ns) / 1000.0,
            max(t1 - t0, 0) / 1000.0,
            self.rank,
            tid,
            int(generation),
            int(peer),
            int(nbytes),
        )

    def _compute_event(self, rec: tuple[Any, ...]) -> str:
        _, name, generation, what, nbytes, t0, t1, thread = rec
        tid = self._tracks.lane(thread, _SORT_THREADS, t0, t1)
        return _COMPUTE % (
            json.dumps(str(what)),
            (t0 - self.start_perf_ns) / 1000.0,
            max(t1 - t0, 0) / 1000.0,
            self.rank,
            tid,
            self._quote(name),
            int(generation),
            int(nbytes),
        )

    def _wait_event(self, rec: tuple[Any, ...]) -> str:
        _, name, generation, t0, t1, thread = rec
        key = (name, generation)
        life = self._open.get(key) or self._ended.get(key)
        if life is not None:
            life["waiters"].append(thread)
        tid = self._tracks.lane(thread, _SORT_THREADS, t0, t1)
        return _WAIT % (
            json.dumps(f"wait {name}"),
            (t0 - self.start_perf_ns) / 1000.0,
            max(t1 - t0, 0) / 1000.0,
            self.rank,
            tid,
            self._quote(name),
            int(generation),
        )


def _json(event: dict[str, Any]) -> str:
    return json.dumps(event, separators=(",", ":"))


# name, ts (µs), dur (µs), pid, tid, then the arguments
_OP = '{"name":%s,"cat":"op","ph":"X","ts":%.3f,"dur":%.3f,"pid":%d,"tid":%d,"args":{%s}}'
_PHASE = '{"name":"%s","cat":"op.phase","ph":"X","ts":%.3f,"dur":%.3f,"pid":%d,"tid":%d}'
_SEGMENT = (
    '{"name":%s,"cat":"segment","ph":"X","ts":%.3f,"dur":%.3f,"pid":%d,"tid":%d,'
    '"args":{"generation":%d,"peer":%d,"bytes":%d}}'
)
_COMPUTE = (
    '{"name":%s,"cat":"compute","ph":"X","ts":%.3f,"dur":%.3f,"pid":%d,"tid":%d,'
    '"args":{"op":%s,"generation":%d,"bytes":%d}}'
)
_WAIT = (
    '{"name":%s,"cat":"wait","ph":"X","ts":%.3f,"dur":%.3f,"pid":%d,"tid":%d,'
    '"args":{"op":%s,"generation":%d}}'
)

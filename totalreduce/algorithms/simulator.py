"""A pure, in-memory simulator that runs every rank's schedule of one op.

It executes the segment plans of all ranks with a random interleaving that
respects only the waits :func:`plan_segments` derived, delivers each frame
after a random delay, and checks what the engine relies on: every send meets a
receive with the same element count on its peer, no region is overwritten
while a send of it is still in flight, and every rank finishes (a schedule that
cannot finish raises :class:`ScheduleError` naming the stuck segments).

It is the oracle of the schedule tests; it does no I/O, no threads and no MPI.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import numpy as np

from .schedule import (
    Action,
    Buffer,
    LocalKind,
    LocalOp,
    Region,
    Schedule,
    alias_input,
    plan_segments,
)


class ScheduleError(AssertionError):
    """A set of schedules that does not execute correctly."""


_REDUCERS: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "sum": np.add,
    "avg": np.add,
    "max": np.maximum,
    "min": np.minimum,
    "product": np.multiply,
    "band": np.bitwise_and,
    "bor": np.bitwise_or,
    "bxor": np.bitwise_xor,
}


def _local(op: LocalOp, bufs: dict[Buffer, np.ndarray]) -> None:
    dst = bufs[op.dst.buffer][op.dst.offset : op.dst.end]
    if op.kind is LocalKind.COPY:
        assert op.src is not None
        src = bufs[op.src.buffer][op.src.offset : op.src.end]
        if not (src is dst or (np.shares_memory(src, dst) and src.ctypes.data == dst.ctypes.data)):
            dst[...] = src
    elif op.kind is LocalKind.SCALE:
        src = dst if op.src is None else bufs[op.src.buffer][op.src.offset : op.src.end]
        dst[...] = src * op.weight
    elif op.kind is LocalKind.ACCUMULATE:
        assert op.src is not None
        dst[...] = dst + op.weight * bufs[op.src.buffer][op.src.offset : op.src.end]
    elif op.kind is LocalKind.AVERAGE:
        if np.issubdtype(dst.dtype, np.integer):
            dst //= op.divisor
        else:
            dst /= op.divisor


def simulate(
    schedules: Sequence[Schedule],
    inputs: Sequence[np.ndarray],
    *,
    op: str = "sum",
    segment_elems: int = 1 << 30,
    in_place: bool = False,
    seed: int = 0,
    outputs: Sequence[np.ndarray] | None = None,
) -> list[np.ndarray]:
    """Run all ranks' ``schedules`` on ``inputs`` and return each rank's output.

    ``in_place`` makes ``OUTPUT`` the input array itself (when the counts
    agree), as ``allreduce(x, out=x)`` does.  Each input must have the
    schedule's ``count`` elements: a rank without input (``count == 0``, a
    relay of :mod:`.hierarchical`) gets an empty array, whose dtype is that of
    its ``OUTPUT`` and ``WORK``.
    """
    size = len(schedules)
    rng = random.Random(seed)
    reduce = _REDUCERS[op]
    for r, s in enumerate(schedules):
        if s.rank != r or s.size != size:
            raise ScheduleError(
                f"schedule {r} is for rank {s.rank} of {s.size}, expected {r}/{size}"
            )
        s.validate()
        if len(inputs[r]) != s.count:
            # A rank without input (a relay of the hierarchical schedules) gets an empty one.
            raise ScheduleError(
                f"rank {r}: input of {len(inputs[r])} elements for a schedule of count {s.count}"
            )
    bufs: list[dict[Buffer, np.ndarray]] = []
    for r, s in enumerate(schedules):
        x = np.array(inputs[r], copy=True)
        if in_place and s.out_count == s.count:
            out = x
            if s.reads_input:
                x = x.copy()
        elif outputs is not None:
            out = outputs[r]
        else:
            out = np.zeros(s.out_count, dtype=x.dtype)
        work = np.zeros(s.work_count, dtype=x.dtype)
        bufs.append({Buffer.INPUT: x, Buffer.OUTPUT: out, Buffer.WORK: work})

    if in_place:
        aliased = [alias_input(s) if s.out_count == s.count else None for s in schedules]
        for r, a in enumerate(aliased):
            if a is not None:
                bufs[r][Buffer.INPUT] = bufs[r][Buffer.OUTPUT]
        schedules = [a if a is not None else s for a, s in zip(aliased, schedules, strict=True)]
    plans = [plan_segments(s, segment_elems) for s in schedules]
    send_waits = [list(p.send_waits) for p in plans]
    recv_waits = [list(p.recv_waits) for p in plans]

    def view(r: int, reg: Region) -> np.ndarray:
        return bufs[r][reg.buffer][reg.offset : reg.end]

    for r, s in enumerate(schedules):
        for lop in s.prologue:
            _local(lop, bufs[r])

    # Events: a ready send may be issued; an issued send may complete (frame
    # delivered to the peer); a delivered frame may be applied once its
    # receive is ready.
    ready_sends = [(r, i) for r in range(size) for i, w in enumerate(send_waits[r]) if w == 0]
    in_flight: list[tuple[int, int, np.ndarray]] = []
    arrived: dict[tuple[int, int], np.ndarray] = {}  # (rank, recv id) -> data
    applicable: list[tuple[int, int]] = []
    applied = [[False] * len(p.recvs) for p in plans]
    sent = [[False] * len(p.sends) for p in plans]

    def release(r: int, whom: list[tuple[bool, int]]) -> None:
        for is_send, idx in whom:
            if is_send:
                send_waits[r][idx] -= 1
                if send_waits[r][idx] == 0:
                    ready_sends.append((r, idx))
            else:
                recv_waits[r][idx] -= 1
                if recv_waits[r][idx] == 0 and (r, idx) in arrived:
                    applicable.append((r, idx))

    while ready_sends or in_flight or applicable:
        choice = rng.randrange(len(ready_sends) + len(in_flight) + len(applicable))
        if choice < len(ready_sends):
            r, i = ready_sends.pop(choice)
            seg = plans[r].sends[i]
            in_flight.append((r, i, view(r, seg.region).copy()))
            continue
        choice -= len(ready_sends)
        if choice < len(in_flight):
            r, i, data = in_flight.pop(choice)
            seg = plans[r].sends[i]
            if not np.array_equal(view(r, seg.region), data):
                raise ScheduleError(
                    f"rank {r} step {seg.step} segment {seg.segment}: region {seg.region} "
                    "changed while its send was in flight"
                )
            peer = seg.peer
            key = (seg.step, r, seg.segment)
            q = plans[peer].recv_index.get(key)
            if q is None:
                raise ScheduleError(
                    f"rank {r} sends step {seg.step} segment {seg.segment} to rank {peer}, "
                    "which has no matching receive"
                )
            want = plans[peer].recvs[q].region.count
            if want != seg.region.count:
                raise ScheduleError(
                    f"rank {r} sends {seg.region.count} elements at step {seg.step} segment "
                    f"{seg.segment} to rank {peer}, which expects {want}"
                )
            if (peer, q) in arrived:
                raise ScheduleError(f"rank {peer} receives step {seg.step} from {r} twice")
            arrived[(peer, q)] = data
            sent[r][i] = True
            release(r, plans[r].after_send[i])
            if recv_waits[peer][q] == 0:
                applicable.append((peer, q))
            continue
        choice -= len(in_flight)
        r, q = applicable.pop(choice)
        seg_r = plans[r].recvs[q]
        dst = view(r, seg_r.region)
        data = arrived[(r, q)]
        if seg_r.action is Action.COPY:
            dst[...] = data
        elif seg_r.action is Action.REDUCE:
            base = dst if seg_r.src is None else view(r, seg_r.src)
            dst[...] = reduce(base, data)
        else:
            dst[...] = dst + seg_r.weight * data
        applied[r][q] = True
        release(r, plans[r].after_recv[q])

    for r in range(size):
        stuck_s = [plans[r].sends[i] for i, ok in enumerate(sent[r]) if not ok]
        stuck_r = [plans[r].recvs[q] for q, ok in enumerate(applied[r]) if not ok]
        if stuck_s or stuck_r:
            raise ScheduleError(
                f"rank {r} cannot finish: {len(stuck_s)} sends and {len(stuck_r)} receives "
                f"left, first {stuck_s[:1]} {stuck_r[:1]}"
            )
    for r, s in enumerate(schedules):
        for lop in s.epilogue:
            _local(lop, bufs[r])
    return [b[Buffer.OUTPUT] for b in bufs]

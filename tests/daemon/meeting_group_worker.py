"""A client process of test_thin_meeting_kill.py (started with the daemon's variables),
one of three clients of a one-node service.

Ranks 0 and 1 run allreduces over the group [0, 1] (checked exactly) and print READY;
rank 1 then waits on stdin (the test kills it there), rank 0 prints WAITING and runs one
more, which waits at the meeting for rank 1: it prints ``RAISED <seconds> <error>``.
Rank 2 runs allreduces over its own group of one meanwhile, and waits on stdin.  Each
prints ``MET <n>``: how many ops met at the node's meeting place meanwhile.

With the argument ``nodes`` (two nodes of two clients): each node's pair runs allreduces
over its own group ([0, 1], and [3, 2], its ranks not ascending) and every rank an
allreduce of the world, checked exactly; each prints ``MET <n>`` and READY.  Then as
above for ranks 0 and 1 (rank 1 is killed while rank 0 waits for it); ranks 2 and 3 wait
for a line on stdin, run five more ops over their pair, print ``PAIR OK`` and ``MET <n>``.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

import totalreduce as tr
from totalreduce.transport import arena as A
from totalreduce.transport import meeting as M


def met() -> int:
    """Ops run at the node's meeting place so far (all of its clients')."""
    thin = tr.api._default._thin  # type: ignore[attr-defined,union-attr]
    at = int(thin.arena.header[A.H_MEET])
    return int(thin.arena.view(at, M.M_RAN // 8 + 1, np.dtype(np.int64))[M.M_RAN // 8])


def nodes() -> None:
    tr.init()
    rank = tr.rank()
    pair = [0, 1] if rank < 2 else [3, 2]
    group = tr.Group(pair)
    x = tr.empty(1024, np.float64)
    before = met()
    for step in range(5):
        x[:] = rank + step
        tr.allreduce(x, name="pair", out=x, group=group)
        if not np.array_equal(x, np.full(1024, sum(pair) + 2 * step, np.float64)):
            print(f"WRONG pair step {step}: {x[:4]}", flush=True)
        y = np.arange(10, dtype=np.int64) * (rank + 1)
        got = tr.allreduce(y, name="world")
        if not np.array_equal(got, np.arange(10, dtype=np.int64) * 10):
            print(f"WRONG world step {step}: {got}", flush=True)
    print(f"MET {met() - before}", flush=True)
    print("READY", flush=True)
    if rank == 0:
        print("WAITING", flush=True)
        t0 = time.monotonic()
        try:
            tr.allreduce(x, name="pair", out=x, group=group)
            print("NO ERROR", flush=True)
        except tr.TotalReduceError as e:
            print(f"RAISED {time.monotonic() - t0:.2f} {e}", flush=True)
        os._exit(0)
    sys.stdin.readline()
    if rank == 1:
        os._exit(0)
    before = met()
    for step in range(5, 10):
        x[:] = rank + step
        tr.allreduce(x, name="pair", out=x, group=group)
        if not np.array_equal(x, np.full(1024, sum(pair) + 2 * step, np.float64)):
            print(f"WRONG pair step {step}: {x[:4]}", flush=True)
    print("PAIR OK", flush=True)
    print(f"MET {met() - before}", flush=True)
    os._exit(0)


def main() -> None:
    if sys.argv[1:] == ["nodes"]:
        nodes()
        return
    tr.init()
    rank = tr.rank()
    group = tr.Group([0, 1] if rank < 2 else [2])
    x = tr.empty(1024, np.float32)
    before = met()
    for step in range(5):
        x[:] = rank + 1 + step
        tr.allreduce(x, name="g", out=x, group=group)
        want = (3 + 2 * step) if rank < 2 else 3 + step
        if not np.array_equal(x, np.full(1024, want, np.float32)):
            print(f"WRONG step {step}: {x[:4]}", flush=True)
    print(f"MET {met() - before}", flush=True)
    print("READY", flush=True)
    if rank == 0:
        print("WAITING", flush=True)
        t0 = time.monotonic()
        try:
            tr.allreduce(x, name="g", out=x, group=group)
            print("NO ERROR", flush=True)
        except tr.TotalReduceError as e:
            print(f"RAISED {time.monotonic() - t0:.2f} {e}", flush=True)
        os._exit(0)
    sys.stdin.readline()
    os._exit(0)


if __name__ == "__main__":
    main()

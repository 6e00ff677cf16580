"""A client process of test_thin_meeting_kill.py (started with the daemon's variables),
one of three clients of a one-node service.

Ranks 0 and 1 run allreduces over the group [0, 1] (checked exactly) and print READY;
rank 1 then waits on stdin (the test kills it there), rank 0 prints WAITING and runs one
more, which waits at the meeting for rank 1: it prints ``RAISED <seconds> <error>``.
Rank 2 runs allreduces over its own group of one meanwhile, and waits on stdin.  Each
prints ``MET <n>``: how many ops met at the node's meeting place meanwhile.
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


def main() -> None:
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

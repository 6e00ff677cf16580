"""A fault-tolerant member for tests/daemon/test_ft.py: a toy model trained with plain numpy.

``python ft_worker.py REPLICA_ID STEPS [--pause-at STEP] [--pause-where before|after]
[--sleep S] [--start-after PATH]``

Each step: ask for a quorum, receive (or send) the state where the quorum says so, average
a gradient made from the parameters and the replica's own data over the quorum, vote,
apply it if the step commits.  One line per event on stdout:

- ``QUORUM qid size rank step``;
- ``COMMIT step qid sha`` (step: the committed step's number, from 1; sha: the parameters'
  bytes after it);
- ``ROLLBACK step qid`` (a vote that did not commit), ``FAIL step qid error`` (an op raised);
- ``PAUSE step`` where ``--pause-at`` stops the member (before its allreduce or after it,
  before the vote) for 60 s, so that the test can kill it there; ``--pause-where send``
  stops it the first time it must send the state to a member behind.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import struct
import sys
import time

import numpy as np

from totalreduce.service.ft_member import Member, StepFailedError

N = 4099


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("replica_id")
    p.add_argument("steps", type=int)
    p.add_argument("--pause-at", type=int, default=-1)
    p.add_argument("--pause-where", default="before")
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--start-after", default="")
    a = p.parse_args()
    while a.start_after and not os.path.exists(a.start_after):
        time.sleep(0.01)  # a replacement started early (its imports take seconds)
    m = Member(a.replica_id, timeout=60)
    params = np.linspace(-1.0, 1.0, N, dtype=np.float32)
    step = 0
    seed = int(hashlib.blake2b(a.replica_id.encode(), digest_size=4).hexdigest(), 16)
    data = np.random.default_rng(seed).standard_normal(N).astype(np.float32)
    while step < a.steps:
        q = m.start_quorum(step, min_replica_size=1, timeout=30)
        print(f"QUORUM {q.qid} {q.size} {q.rank} {q.step}", flush=True)
        try:
            if q.heal_from >= 0:
                raw = m.recv_state()
                (step,) = struct.unpack("<q", raw[:8])
                params = np.frombuffer(raw[8:], np.float32).copy()
                print(f"HEALED {step}", flush=True)
            if q.heal_to:
                if a.pause_where == "send":  # the first time it must send the state
                    print(f"PAUSE {step + 1}", flush=True)
                    time.sleep(60)
                m.send_state(struct.pack("<q", step) + params.tobytes())
            if step + 1 == a.pause_at and a.pause_where == "before":
                print(f"PAUSE {step + 1}", flush=True)
                time.sleep(60)
            grad = params * np.float32(0.5) + data
            avg = m.allreduce(grad)
            if step + 1 == a.pause_at and a.pause_where == "after":
                print(f"PAUSE {step + 1}", flush=True)
                time.sleep(60)
            ok = True
        except StepFailedError as exc:
            print(f"FAIL {step + 1} {q.qid} {str(exc)[:200]!r}", flush=True)
            ok = False
        if a.sleep:
            time.sleep(a.sleep)
        if m.should_commit(ok):
            params = params - np.float32(0.1) * avg
            step += 1
            sha = hashlib.sha1(params.tobytes()).hexdigest()[:16]
            print(f"COMMIT {step} {q.qid} {sha}", flush=True)
        else:
            print(f"ROLLBACK {step + 1} {q.qid}", flush=True)
    m.close()
    print("DONE", flush=True)


if __name__ == "__main__":
    sys.exit(main())

"""A fault-tolerant member for tests/daemon/test_ft.py: a toy model trained with plain numpy.

``python ft_worker.py REPLICA_ID STEPS [--pause-at STEP] [--pause-where before|after|send]
[--die-at STEP --die-where WHERE] [--hold-at STEP --hold-file PATH] [--sleep S]
[--start-after PATH]``

Each step: ask for a quorum, receive (or send) the state where the quorum says so, average
a gradient made from the parameters and the replica's own data over the quorum, vote,
apply it if the step commits.  One line per event on stdout:

- ``QUORUM qid size rank step``;
- ``COMMIT step qid sha`` (step: the committed step's number, from 1; sha: the parameters'
  bytes after it);
- ``ROLLBACK step qid why`` (a vote that did not commit, and why), ``FAIL step qid error``
  (an op raised); ``DROPPED step error`` (its service dropped it as hung: ``--timeout`` is
  its timeout; ``--rejoin`` attaches again as a new member, else it exits with the error);
- ``PAUSE step`` where ``--pause-at`` stops the member (before its allreduce or after it,
  before the vote) for 60 s, so that the test can kill it there; ``--pause-where send``
  stops it the first time it must send the state to a member behind;
- ``DIE step where`` just before the member SIGKILLs itself at a moment of step ``--die-at``
  that no timing decides (``--die-where``): ``quorum`` (its ask sent, the answer not
  awaited), ``answered`` (its ask sent and the quorum's answer arrived, unread),
  ``allreduce`` (its part of the allreduce sent, the average not awaited), ``commit``
  (``should_commit`` returned, the parameters not updated, the next quorum not asked);
  ``send`` (the first time it must send the state: half of the state's message sent) and
  ``recv`` (the first time it receives the state: its request sent and the state's first
  byte read) ignore ``--die-at``;
- ``--leave-at K``: once step K committed (its vote asked for the next quorum, which then
  holds it), the member leaves cleanly (``Member.close()``), prints ``LEFT K`` and exits;
  a member whose quorum was re-formed without a leaver prints ``REFORMED step old new size``;
- ``--hold-at`` makes the member wait before it asks for the quorum of that step until
  ``--hold-file`` exists.

The vote asks for the next quorum too (``ask_next``: one round a step), except the last
step's and where the next ask is one of the moments above.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import select
import signal
import struct
import sys
import time

import numpy as np

from totalreduce.service.ft_member import Member, MemberDroppedError, StepFailedError
from totalreduce.transport import ft_frames as F

N = 4099


def die(step: int, where: str) -> None:
    print(f"DIE {step} {where}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def raw_frame(header: dict[str, object], payload: bytes = b"") -> bytes:
    """The bytes :func:`ft_frames.send` writes (the worker sends pieces of them)."""
    head = json.dumps(header, separators=(",", ":")).encode()
    return struct.pack("<IQ", len(head), len(payload)) + head + payload


def wait_readable(m: Member) -> None:
    select.select([m._sock], [], [], 60)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("replica_id")
    p.add_argument("steps", type=int)
    p.add_argument("--pause-at", type=int, default=-1)
    p.add_argument("--pause-where", default="before")
    p.add_argument("--die-at", type=int, default=-1)
    p.add_argument("--die-where", default="")
    p.add_argument("--hold-at", type=int, default=-1)
    p.add_argument("--hold-file", default="")
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--start-after", default="")
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--rejoin", action="store_true")
    p.add_argument("--leave-at", type=int, default=-1)
    p.add_argument("--first-min", type=int, default=1)
    a = p.parse_args()
    while a.start_after and not os.path.exists(a.start_after):
        time.sleep(0.01)  # a replacement started early (its imports take seconds)
    m = Member(a.replica_id, timeout=a.timeout)

    def rejoin(exc: Exception) -> Member:
        """Dropped as hung: ``--rejoin`` attaches again (a new member), else it fails."""
        print(f"DROPPED {step + 1} {str(exc)[:300]!r}", flush=True)
        if not a.rejoin:
            raise exc
        m.close()
        return Member(a.replica_id, timeout=a.timeout)

    params = np.linspace(-1.0, 1.0, N, dtype=np.float32)
    step = 0
    seed = int(hashlib.blake2b(a.replica_id.encode(), digest_size=4).hexdigest(), 16)
    data = np.random.default_rng(seed).standard_normal(N).astype(np.float32)
    while step < a.steps:
        if step + 1 == a.hold_at:
            while not os.path.exists(a.hold_file):
                time.sleep(0.01)
        if step + 1 == a.die_at and a.die_where in ("quorum", "answered"):
            ask = {"kind": "quorum", "step": step, "min_size": 1, "timeout_ms": 30000}
            with m._send_lock:  # (never beside a heartbeat)
                F.send(m._sock, ask)
            if a.die_where == "answered":
                wait_readable(m)
            die(step + 1, a.die_where)
        try:
            least = a.first_min if step == 0 else 1  # (--first-min: all start together)
            q = m.start_quorum(step, min_replica_size=least, timeout=30)
        except MemberDroppedError as exc:
            m = rejoin(exc)
            continue
        print(f"QUORUM {q.qid} {q.size} {q.rank} {q.step}", flush=True)
        try:
            if q.heal_from >= 0:
                if a.die_where == "recv":
                    key = f"state {q.heal_from}"
                    with m._send_lock:
                        F.send(m._sock, {"kind": "op", "q": q.qid, "op": "xfer",
                                         "src": q.heal_from, "key": key})  # fmt: skip
                    wait_readable(m)
                    m._sock.recv(1)
                    die(step + 1, "recv")
                raw = m.recv_state()
                (step,) = struct.unpack("<q", raw[:8])
                params = np.frombuffer(raw[8:], np.float32).copy()
                print(f"HEALED {step}", flush=True)
            if q.heal_to:
                if a.pause_where == "send":  # the first time it must send the state
                    print(f"PAUSE {step + 1}", flush=True)
                    time.sleep(60)
                state = struct.pack("<q", step) + params.tobytes()
                if a.die_where == "send":
                    head = {"kind": "op", "q": q.qid, "op": "xfer", "src": q.rank,
                            "key": f"state {q.rank}"}  # fmt: skip
                    frame = raw_frame(head, state)
                    m._send_lock.acquire()  # (held until it dies: no heartbeat after it)
                    m._sock.sendall(frame[: len(frame) - len(state) // 2])
                    die(step + 1, "send")
                m.send_state(state)
            if step + 1 == a.pause_at and a.pause_where == "before":
                print(f"PAUSE {step + 1}", flush=True)
                time.sleep(60)
            grad = params * np.float32(0.5) + data
            if step + 1 == a.die_at and a.die_where == "allreduce":
                head = {"kind": "op", "q": q.qid, "key": "1", "op": "allreduce",
                        "dtype": grad.dtype.str, "count": grad.size}  # fmt: skip
                with m._send_lock:
                    F.send(m._sock, head, grad.view(np.uint8))
                die(step + 1, "allreduce")
            avg = m.allreduce(grad)
            if step + 1 == a.pause_at and a.pause_where == "after":
                print(f"PAUSE {step + 1}", flush=True)
                time.sleep(60)
            ok = True
        except StepFailedError as exc:
            print(f"FAIL {step + 1} {q.qid} {str(exc)[:200]!r}", flush=True)
            ok = False
        except MemberDroppedError:
            ok = False  # the vote raises it again
        if a.sleep:
            time.sleep(a.sleep)
        # the vote asks for the next quorum too (one round a step), except where the next
        # ask is the test's moment (a hold, a death at the quorum, a death after the vote)
        moments = {a.hold_at} | ({a.die_at} if a.die_where in ("quorum", "answered") else set())
        plain = (
            step + 1 >= a.steps
            or bool(moments & {step + 1, step + 2})
            or (step + 1 == a.die_at and a.die_where == "commit")
        )
        try:
            commit = m.should_commit(ok, ask_next=None if plain else step, quorum_timeout=30)
        except MemberDroppedError as exc:
            m = rejoin(exc)
            continue
        if step + 1 == a.die_at and a.die_where == "commit":
            die(step + 1, "commit")
        now = m.quorum or q  # (re-formed without a member that left before the step)
        if now.qid != q.qid:
            print(f"REFORMED {step + 1} {q.qid} {now.qid} {now.size}", flush=True)
        if commit:
            params = params - np.float32(0.1) * avg
            step += 1
            sha = hashlib.sha1(params.tobytes()).hexdigest()[:16]
            print(f"COMMIT {step} {now.qid} {sha}", flush=True)
            if step == a.leave_at:
                m.close()
                print(f"LEFT {step}", flush=True)
                return
        else:
            print(f"ROLLBACK {step + 1} {now.qid} {m.failure!r}", flush=True)
    m.close()
    print("DONE", flush=True)


if __name__ == "__main__":
    sys.exit(main())

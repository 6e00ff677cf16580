"""The arena thread's side of the node's meeting place (:mod:`~totalreduce.transport.meeting`).

On a service of one node its clients run the world's allreduces, broadcasts and
barriers among themselves, in the arena, without this service, and those over a group
of its clients (a group's channel names its members: its rounds wait, and
fail, for them only; a group's op never escapes, and its mismatches fail at the meeting).
What is left here is what is rare, each an event of the arena thread:

- **the session**: the meeting place is zeroed when a session starts (no client is
  attached then), so no channel, round or flag of an old job meets a new one;
- **escapes**: an op whose clients disagree, or that the meeting cannot run (an element
  type of no raw kernel, a buffer outside its client's part), is handed over through the
  meeting's queue: its ``L`` entries become descriptors that the arena thread's Python
  takes as if it had read them from the rings, in slot order, and it checks, names the
  ranks that disagree, runs or fails the op and answers as it always did;
- **membership**: a client that dies or leaves fails every round that waits for it (a
  compare-and-swap of the round's state to ``FAILED``, won against the completer's
  ``DONE``), with the error written to each arrived client as for any op; ``M_GONE`` stays
  set while a client is gone, and a client that arrives meanwhile has the arena thread
  look again (``M_RESCAN``);
- **stalls**: a round some clients arrived at and others not, for ``stall_warning_s``, is
  logged as the rings' ops are, naming both.

:class:`MeetingOps` is a base of :class:`~.thin.ThinService`.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from ..transport import arena as A
from ..transport import meeting as M
from ..transport.shm import fence
from .thin_ops import _shape_text

log = logging.getLogger("totalreduce.daemon")

_W = 8  # bytes per word


class MeetingOps:
    """The meeting's rare events (a base of :class:`~.thin.ThinService`)."""

    arena: Any
    node: int
    slots: int
    stall_warning_s: float
    _inc: list[int]
    _gone: dict[int, str]
    _take: Any
    _ctl: list[np.ndarray]
    _ctl_at: list[int]
    _answering: Any
    size: int
    _collected: Any
    _pass_done: Any
    _late: Any

    def _init_meeting(self, on: bool) -> None:
        """Have the node's clients meet in the arena (``on``: a one-node service)."""
        arena = self.arena
        self._meet_on = on
        arena.header[A.H_MEET_ON] = 1 if on else 0
        c, chb, osb, nbytes = A.meeting_layout(self.slots)
        self._meet_cf = M.config(arena, -1)
        at = int(arena.header[A.H_MEET])
        self._meet_mem = arena.view(at, nbytes // _W, np.dtype(np.int64))
        ch0 = int(self._meet_cf[M.CF_CH0])
        #: the channels as rows of words: a channel's wire id is its first
        self._meet_chans = self._meet_mem[ch0 // _W : (ch0 + c * chb) // _W].reshape(c, chb // _W)
        self._meet_osw = osb // _W  # words per op slot
        self._meet_head = 0  # escape queue entries taken
        self._meet_serial = 0  # sessions the meeting place was zeroed for
        self._meet_died = False  # a client of this session died: every round fails
        #: rounds some clients arrived at: (channel, slot, round) -> (since, warned)
        self._meet_waiting: dict[tuple[int, int, int], list[float]] = {}

    def _meet_reset(self) -> None:
        """A session starts (no client attached): nothing of the last one counts."""
        if self._meet_on:
            self._meet_mem[:] = 0
            self._meet_head = 0
            self._meet_serial += 1
            self._meet_died = False
            self._meet_waiting.clear()

    # ------------------------------------------------------------------ the arena thread

    def _meet_busy(self) -> bool:
        """Whether the meeting has something for the arena thread (a cheap look)."""
        if not self._meet_on:
            return False
        mem = self._meet_mem
        return bool(mem[M.M_QTAIL // _W] != self._meet_head or mem[M.M_RESCAN // _W] != 0)

    def _meet_work(self) -> bool:
        """Take escaped ops, and look again at the rounds when a client asked; whether
        there was anything."""
        if not self._meet_busy():
            return False
        mem = self._meet_mem
        if mem[M.M_RESCAN // _W]:
            mem[M.M_RESCAN // _W] = 0
            self._meet_fail_waiting()
        cf = self._meet_cf
        while True:
            payload = int(M.queue_take(cf, self._meet_head))
            if payload < 0:
                break
            self._meet_head += 1
            mem[M.M_QHEAD // _W] = self._meet_head
            c, i = divmod(payload >> 24, M.DEPTH)
            rows = [self._meet_row(c, i, k) for k in range(self.slots)]
            for k, d in enumerate(rows):  # as the rings would have had them
                self._take(k, d)
        return True

    def _meet_wire(self, c: int) -> int:
        """Channel ``c``'s wire id (a group's channel is keyed by it and the context)."""
        row = self._meet_chans[c]
        return int(row[M.K_WIRE // _W]) if row[M.K_MASK // _W] else int(row[0])

    def _meet_members(self, c: int) -> list[int]:
        """The slots of channel ``c``'s clients (every slot: the world's ops)."""
        mask = int(self._meet_chans[c, M.K_MASK // _W])
        if not mask:
            return list(range(self.slots))
        return [k for k in range(min(self.slots, M.GROUP_SLOTS)) if mask >> k & 1]

    def _meet_entry(self, c: int, i: int, k: int) -> np.ndarray:
        at = (M.LINE + i * self._meet_osw * _W + M.O_ENTRY + k * M.LINE) // _W
        return self._meet_chans[c, at : at + M.LINE // _W]

    def _meet_state(self, c: int, i: int) -> int:
        return int(self._meet_chans[c, (M.LINE + i * self._meet_osw * _W) // _W])

    def _meet_row(self, c: int, i: int, k: int) -> np.ndarray:
        """Client ``k``'s entry in op slot (``c``, ``i``) as a descriptor of the rings."""
        e = self._meet_entry(c, i, k)
        kind, dtype, op, flags, algo = M.unpack_shape(int(e[M.E_SHAPE // _W]))
        d = np.zeros(A.D_WORDS, np.int64)
        d[A.D_TICKET], d[A.D_KIND], d[A.D_WIRE] = e[M.E_TICKET // _W], kind, self._meet_wire(c)
        d[A.D_GEN], d[A.D_DTYPE], d[A.D_COUNT] = e[M.E_GEN // _W], dtype, e[M.E_COUNT // _W]
        d[A.D_OP], d[A.D_ROOT], d[A.D_PRIO] = op, e[M.E_ROOT // _W], e[M.E_PRIO // _W]
        d[A.D_IN], d[A.D_OUT], d[A.D_FLAGS] = e[M.E_IN // _W], e[M.E_OUT // _W], flags
        d[A.D_GROUP], d[A.D_CTX], d[A.D_AUX], d[A.D_ALGO] = -1, 0, -1, algo
        return d

    def _meet_arrived(self, c: int, i: int, s: int) -> list[int]:
        """The clients whose entries are of op slot (``c``, ``i``)'s round of state ``s``
        (those arrived, and perhaps one that wrote its entry and found the round failed)."""
        gen = (((s >> M.RSHIFT) & M.RMASK) - 1) * M.DEPTH + i
        got = []
        for k in self._meet_members(c):
            e = self._meet_entry(c, i, k)
            if int(e[M.E_GEN // _W]) == gen and int(e[M.E_TICKET // _W]) != 0:
                got.append(k)
        return got

    # ------------------------------------------------------------------ membership

    def _meet_gone(self, died: bool = False, serial: int = -1) -> None:
        """``_gone`` changed (``died``: a client died, or the service stops): tell the
        clients (``M_GONE``), and fail the rounds that wait for a client gone.  ``serial``:
        the session the change is of (-1: this one); an earlier session's is none of this
        one's business."""
        if not self._meet_on or (serial >= 0 and serial != self._meet_serial):
            return
        self._meet_died = self._meet_died or died
        mem = self._meet_mem
        if not self._gone:
            mem[M.M_GONE // _W] = 0
            return
        rank = next(iter(self._gone))
        why = self._gone[rank]
        text = f"rank {rank} {why}" if rank >= 0 else why
        raw = text.encode("utf-8", "replace")[: M.WHY_BYTES - 1] + b"\0"
        self._meet_mem.view(np.uint8)[M.M_WHY : M.M_WHY + len(raw)] = np.frombuffer(raw, np.uint8)
        mem[M.M_GONE // _W] = 1
        self._meet_fail_waiting()

    def _meet_fail_waiting(self) -> None:
        """Fail every round not over while a client is gone (a round every client
        arrived at ends on its own, unless one of them died: then it fails too)."""
        if not self._gone:
            return
        died = self._meet_died
        base = self.node * self.slots
        wires = self._meet_chans[:, 0].copy()  # (clients claim channels meanwhile)
        for c in np.nonzero(wires)[0].tolist():
            members = self._meet_members(c)
            # a group's rounds wait only for its members (the service stopping: for all)
            gone = [r for r in self._gone if r < 0 or r - base in members]
            if not gone:
                continue
            rank = gone[0]
            why = self._gone[rank]
            text = f"rank {rank} {why}" if rank >= 0 else why
            for i in range(M.DEPTH):
                s = self._meet_state(c, i)
                if s == 0 or s & M.OVER:
                    continue
                if not died and (s & M.CMASK) == len(members):
                    continue
                if int(M.fail_round(self._meet_cf, c, i, 0)) < 0:
                    continue
                for k in self._meet_arrived(c, i, s):
                    self._meet_failed(k, int(self._meet_entry(c, i, k)[M.E_TICKET // _W]), text)

    def _meet_clash(self, c: int, i: int, s: int, have: list[int]) -> bool:
        """Whether the round of op slot (``c``, ``i``) (state ``s``, clients ``have``
        arrived) waits for ranks that ran its name and generation over another group: at
        the meeting (another channel of the name holds their entries of that generation)
        or, for the world's op, the compiled pass's or Python's.  Then it fails as a
        mismatch on the ranks that arrived, naming both groups; so does the other round if
        it waits too, and those that completed it hear it late."""
        gen = int(self._meet_entry(c, i, have[0])[M.E_GEN // _W])
        if self._meet_clash_here(c, i, gen, have):
            return True
        if self._meet_chans[c, M.K_MASK // _W]:
            return False
        wire = int(self._meet_chans[c, 0])
        done = self._collected.get((wire, gen)) or self._pass_done(wire, gen)
        if done is None or done.key[2] == 0 or not any(x is not None for x in done.descs):
            return False
        if int(M.fail_round(self._meet_cf, c, i, 0)) < 0:
            return True  # over meanwhile
        base = self.node * self.slots
        world = list(range(self.size))
        texts = sorted(
            [(base + k, f"group {world}") for k in have]
            + [(base + k, f"group {list(done.grp.ranks)}") for k, x in enumerate(done.descs)
               if x is not None]
        )  # fmt: skip
        why = "the ranks disagree on the group: " + "; ".join(f"rank {r}: {t}" for r, t in texts)
        self._late(done, A.E_MISMATCH, why)  # (first: the failed may look for them at once)
        for k in have:
            ticket = int(self._meet_entry(c, i, k)[M.E_TICKET // _W])
            self._meet_failed(k, ticket, why, A.E_MISMATCH)
        return True

    def _meet_group_ranks(self, c: int) -> list[int]:
        """The ranks of channel ``c``'s group (the world's, for a channel of the world)."""
        if not self._meet_chans[c, M.K_MASK // _W]:
            return list(range(self.size))
        base = self.node * self.slots
        return [base + k for k in self._meet_members(c)]

    def _meet_clash_here(self, c: int, i: int, gen: int, have: list[int]) -> bool:
        """The round of (``c``, ``i``) of generation ``gen`` waits for a client whose
        entry of that generation is in another channel of the same name (its group
        differs): both rounds fail as a mismatch (one over already: its clients hear it
        late); whether they did."""
        wire = self._meet_wire(c)
        missing = [k for k in self._meet_members(c) if k not in have]
        for c2 in np.nonzero(self._meet_chans[:, 0].copy())[0].tolist():
            if c2 == c or self._meet_wire(c2) != wire:
                continue
            there = [
                k for k in self._meet_members(c2)
                if int(self._meet_entry(c2, i, k)[M.E_TICKET // _W]) != 0
                and int(self._meet_entry(c2, i, k)[M.E_GEN // _W]) == gen
            ]  # fmt: skip
            if not any(k in there for k in missing):
                continue
            base = self.node * self.slots
            g1, g2 = self._meet_group_ranks(c), self._meet_group_ranks(c2)
            texts = sorted([(base + k, f"group {g1}") for k in have]
                           + [(base + k, f"group {g2}") for k in there])  # fmt: skip
            why = "the ranks disagree on the group: " + "; ".join(
                f"rank {r}: {t}" for r, t in texts
            )
            s2 = self._meet_state(c2, i)
            if int(M.fail_round(self._meet_cf, c2, i, 0)) >= 0:
                for k in there:
                    ticket = int(self._meet_entry(c2, i, k)[M.E_TICKET // _W])
                    self._meet_failed(k, ticket, why, A.E_MISMATCH)
            elif s2 & M.DONE:  # completed there: its clients raise at their next call
                for k in there:
                    ticket = int(self._meet_entry(c2, i, k)[M.E_TICKET // _W])
                    self._meet_late(k, ticket, A.E_MISMATCH, why)
            if int(M.fail_round(self._meet_cf, c, i, 0)) >= 0:
                for k in have:
                    ticket = int(self._meet_entry(c, i, k)[M.E_TICKET // _W])
                    self._meet_failed(k, ticket, why, A.E_MISMATCH)
            return True
        return False

    def _meet_late(self, slot: int, ticket: int, kind: int, why: str) -> None:
        """Op ``ticket`` of ``slot``'s client completed at the meeting, but it fails: the
        client raises at its next call (a late error, as :meth:`_late` posts)."""
        if not self._inc[slot]:
            return
        ctl = self._ctl[slot]
        with self._answering:
            n = int(ctl[A.C_LATE]) + 1
            A.write_error(ctl, -n, kind, f"{ticket}\x1e{why}")
            fence()
            ctl[A.C_LATE] = n

    def _meet_failed(self, slot: int, ticket: int, why: str, kind: int = A.E_FAILED) -> None:
        """Op ``ticket`` of ``slot``'s client failed at the meeting: its error, its word
        (unless the word holds a later op's ticket already: a client that found the round
        failed before arriving gave its ticket back), the client woken."""
        if not self._inc[slot]:
            return
        ctl = self._ctl[slot]
        with self._answering:
            A.write_error(ctl, ticket, kind, why)
        M.fail_word(self._ctl_at[slot], ticket)
        M.wake_client(self._ctl_at[slot])

    # ------------------------------------------------------------------ stalls

    def _meet_stalls(self) -> None:
        """Warn about rounds some clients arrived at long ago and others never did (once
        per ``stall_warning_s``), naming both, as for the rings' ops."""
        if not self._meet_on:
            return
        now = time.monotonic()
        seen: set[tuple[int, int, int]] = set()
        wires = self._meet_chans[:, 0].copy()  # (clients claim channels meanwhile)
        base = self.node * self.slots
        for c in np.nonzero(wires)[0].tolist():
            members = self._meet_members(c)
            for i in range(M.DEPTH):
                s = self._meet_state(c, i)
                cnt = s & M.CMASK
                if s == 0 or s & M.OVER or cnt >= len(members):
                    continue
                key = (c, i, (s >> M.RSHIFT) & M.RMASK)
                have = self._meet_arrived(c, i, s)
                if have and self._meet_clash(c, i, s, have):
                    continue
                seen.add(key)
                since = self._meet_waiting.setdefault(key, [now, 0.0])
                if now - max(since[0], since[1]) < self.stall_warning_s:
                    continue
                since[1] = now
                if not have:
                    continue
                d = self._meet_row(c, i, have[0])
                missing = [base + k for k in members if k not in have]
                log.warning(
                    "%s #%016x generation %d has waited %.0f s on node %d: ranks %s submitted "
                    "it, ranks %s have not", _shape_text(d), int(d[A.D_WIRE]) & ((1 << 64) - 1),
                    int(d[A.D_GEN]), now - since[0], self.node, [base + k for k in have], missing,
                )  # fmt: skip
        for key in [k for k in self._meet_waiting if k not in seen]:
            del self._meet_waiting[key]

"""The arena thread's side of the node's meeting place (:mod:`~totalreduce.transport.meeting`).

On a service of one node its clients run the world's allreduces, broadcasts and
barriers among themselves, in the arena, without this service, and on any service those
over a group whose ranks all live on the node (a group's channel names its members: its
rounds wait, and fail, for them only; a group's op never escapes, and its mismatches fail
at the meeting).  What is left here is what is rare, each an event of the arena thread:

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
  logged as the rings' ops are, naming both;
- **routes that differ**: once a second, a round that waits for a client whose op of its
  name and generation is the service's (another group's, on the rings, or one the
  meeting could not run), an op of the rings that waits for a client whose op of its name
  and generation is at the meeting, and two channels of one name that wait for each
  other's clients fail as a mismatch naming both ranks, their groups (or shapes); where
  one side completed, its clients raise at their next call (a late error).

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
    _pending: dict[tuple[int, int], list[Any]]
    _pass_done: Any
    _late: Any
    _fail_clash: Any
    _fail: Any

    def _init_meeting(self, on: bool, world: bool) -> None:
        """Have the node's clients meet in the arena (``on``): the world's ops and groups'
        (``world``: a one-node service), or only groups' (a service of several nodes)."""
        arena = self.arena
        self._meet_on = on
        arena.header[A.H_MEET_ON] = (A.MEET_WORLD if world else A.MEET_GROUPS) if on else 0
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

    def _meet_order(self, c: int) -> list[int]:
        """The slots of channel ``c``'s clients in group order (every slot: the world's)."""
        row = self._meet_chans[c]
        at = M.K_ORDER // _W
        words = [int(row[at + w]) for w in range(M.ORDER_WORDS)]
        if not words[0]:
            return self._meet_members(c)
        n = int(row[M.K_N // _W])
        return [
            ((words[j // M.ORDER_PER_WORD] >> (6 * (j % M.ORDER_PER_WORD))) & 63) - 1
            for j in range(n)
        ]

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
        arrived) waits for clients that gave its name and generation another route: at
        the meeting over another group (another channel of the name holds their entries
        of that generation), or the service's (an op of the rings has their descriptors:
        another group's, or a shape the meeting cannot run; for the world's op, one
        completed over a group).  Then it fails as a mismatch on the clients that arrived,
        naming both sides, and so does the other side (those that completed it hear it
        late)."""
        gen = int(self._meet_entry(c, i, have[0])[M.E_GEN // _W])
        if self._meet_clash_here(c, i, gen, have):
            return True
        wire = self._meet_wire(c)
        missing = [k for k in self._meet_members(c) if k not in have]
        ops = [o for o in self._pending.get((wire, gen), ()) if not o.over]
        done = self._collected.get((wire, gen)) or self._pass_done(wire, gen)
        if done is not None and done not in ops:
            if self._meet_chans[c, M.K_MASK // _W] or done.key[2] != 0:
                ops.append(done)  # (the world's op: only one completed over a group)
        ops = [o for o in ops if any(o.descs[k] is not None for k in missing)]
        if not ops:
            return False
        self._route_clash(c, i, gen, have, ops)
        return True

    def _meet_group_ranks(self, c: int) -> list[int]:
        """The ranks of channel ``c``'s group, in group order (the world's, for a channel
        of the world)."""
        if not self._meet_chans[c, M.K_MASK // _W]:
            return list(range(self.size))
        base = self.node * self.slots
        return [base + k for k in self._meet_order(c)]

    def _clash_text(self, said: list[tuple[int, list[int], np.ndarray | None, bool]]) -> str:
        """Why ops of one name and generation that took two routes fail: ``said`` holds
        (rank, its group's ranks, its descriptor or None where unknown, whether it went to
        the meeting) of each rank; their groups if those differ, else their shapes, else
        the routes themselves."""
        said = sorted(said, key=lambda t: t[0])
        if len({tuple(g) for _, g, _, _ in said}) > 1:
            return "the ranks disagree on the group: " + "; ".join(
                f"rank {r}: group {g}" for r, g, _, _ in said
            )
        shapes = [(r, _shape_text(d)) for r, _, d, _ in said if d is not None]
        if len({t for _, t in shapes}) > 1:
            return "the ranks disagree: " + "; ".join(f"rank {r}: {t}" for r, t in shapes)
        return (
            "the ranks took different routes: "
            + "; ".join(
                f"rank {r}: " + ("at the node's meeting" if m else "through the node's service")
                for r, _, _, m in said
            )
            + " (is TOTALREDUCE_MEET_GROUPS set alike in every client's environment?)"
        )

    def _route_clash(
        self, c: int, i: int, gen: int, there: list[int], ops: list[Any]
    ) -> None:  # fmt: skip
        """Generation ``gen`` of channel ``c``'s name, whose clients ``there`` have their
        entries in op slot ``i``, was given by other clients of the node to the service
        (``ops``, ops of the rings): every side fails as a mismatch naming both; a side
        that completed already has its clients raise at their next call."""
        base = self.node * self.slots
        g1 = self._meet_group_ranks(c)
        said = [(base + k, g1, self._meet_row(c, i, k), True) for k in there]
        for o in ops:
            for k, x in enumerate(o.descs):
                if x is not None:
                    d = None if not int(x[A.D_KIND]) else x  # (the pass keeps no shape)
                    said.append((base + k, list(o.grp.ranks), d, False))
        self._fail_clash(ops, self._clash_text(said), [(c, i, gen, there)])

    def _meet_fail_rounds(self, rounds: list[tuple[int, int, int, list[int]]], why: str) -> None:
        """Fail the meeting's ``rounds`` (channel, op slot, generation, the clients there) as
        a mismatch, those that completed first (their clients hear it late: told before the
        others raise)."""
        done = [r for r in rounds if self._meet_state(r[0], r[1]) & M.DONE]
        for c, i, gen, there in done + [r for r in rounds if r not in done]:
            self._meet_fail_round(c, i, gen, there, why)

    def _meet_fail_round(self, c: int, i: int, gen: int, there: list[int], why: str) -> None:
        """Fail the round of generation ``gen`` in op slot (``c``, ``i``) as a mismatch
        (``why``) on its clients ``there``; one that completed: they hear it late."""
        rf = gen // M.DEPTH + 1
        s = self._meet_state(c, i)
        if (s >> M.RSHIFT) & M.RMASK != rf:
            return  # (over, and a later round under way: nothing waits for it)
        if int(M.fail_round(self._meet_cf, c, i, 0)) >= 0:
            for k in there:
                ticket = int(self._meet_entry(c, i, k)[M.E_TICKET // _W])
                self._meet_failed(k, ticket, why, A.E_MISMATCH)
        elif self._meet_state(c, i) & M.DONE:  # completed there: raised at the next call
            for k in there:
                ticket = int(self._meet_entry(c, i, k)[M.E_TICKET // _W])
                self._meet_late(k, ticket, A.E_MISMATCH, why)

    def _meet_there(self, c: int, i: int, gen: int) -> list[int]:
        """The clients of channel ``c`` whose entries in op slot ``i`` are of ``gen``."""
        return [
            k for k in self._meet_members(c)
            if int(self._meet_entry(c, i, k)[M.E_TICKET // _W]) != 0
            and int(self._meet_entry(c, i, k)[M.E_GEN // _W]) == gen
        ]  # fmt: skip

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
            there = self._meet_there(c2, i, gen)
            if not any(k in there for k in missing):
                continue
            base = self.node * self.slots
            g1, g2 = self._meet_group_ranks(c), self._meet_group_ranks(c2)
            said = [(base + k, g1, self._meet_row(c, i, k), True) for k in have]
            said += [(base + k, g2, self._meet_row(c2, i, k), True) for k in there]
            why = self._clash_text(said)
            self._meet_fail_round(c2, i, gen, there, why)
            self._meet_fail_round(c, i, gen, have, why)
            return True
        return False

    def _meet_ring_clashes(self) -> None:
        """Ops of the rings that wait for clients of the node whose op of their name and
        generation is at the meeting (over another group, or a shape the
        other ranks' op could not take there): both sides fail as a mismatch naming them
        (:meth:`_route_clash`; a round that completed: its clients hear it late)."""
        if not self._meet_on or not self._pending:
            return
        waiting = [o for ops in self._pending.values() for o in ops if not (o.over or o.passive)]
        if not waiting:
            return
        chans: dict[int, list[int]] = {}
        for c in np.nonzero(self._meet_chans[:, 0].copy())[0].tolist():
            chans.setdefault(self._meet_wire(c), []).append(c)
        for op in waiting:
            wire, gen = op.key[0], op.key[1]
            missing = [k for _, k in op.grp.local if op.descs[k] is None]
            i = gen % M.DEPTH
            for c in chans.get(wire, ()):
                there = self._meet_there(c, i, gen)
                if any(k in there for k in missing):
                    self._route_clash(c, i, gen, there, [op])
                    break

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

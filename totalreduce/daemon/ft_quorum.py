"""The quorum of a fault-tolerant job: a state machine every node's service runs alike.

In fault-tolerant mode (``totalreduce serve --fault-tolerant``, docs/fault_tolerance.md)
the training processes are *members* that come and go between steps.  Each service
keeps a *row* of what its own members said (who is attached, the step each has
committed, how many quorums each asked for, its vote on the current quorum's step).
At every *round* the services sum their rows into one table among themselves (each
node writes only its own row, so the sum is every node's row), and each feeds the same
table to :meth:`Quorums.advance`.  That function depends only on the table and on what
earlier tables made of it, so every service reaches the same decisions in the same
round: who is in the next quorum, what step it resumes, who receives state from whom,
and whether a step commits.  This is one decider, replicated: no service must be
asked, and none is special (node 0's clock in the table times the waits).

A member is *alive* in a round when its node's row holds it; a member whose
connection ended is gone from the next round's row, dead or departed alike.

- **A quorum** forms once every member of the last quorum still alive has asked for
  the next one (and any newcomer that asked by then joins it), or, with no such
  member (the first quorum, or all died), ``join_timeout`` after the first ask, or
  as soon as ``--first-quorum`` members asked (node 0's option, carried in the table).  It
  needs ``min_replica_size`` members (the largest any asker gave); fewer wait up to
  the askers' timeout, then every asker gets an error naming both sizes.  A member of
  the last quorum that is alive and has not asked is waited for (its peers' own
  ``quorum_timeout`` ends their wait).  Its members
  are ordered by replica id (then by token), their rank is their place.  Its step is
  the largest step any member had: the members behind it receive the state of a
  member at it (spread over them in rank order).
- **A commit**: the quorum's step commits only when every member voted ok while
  alive.  A member gone before voting, a vote not ok, or a member that asks for the next
  quorum without voting makes it fail, in the round that shows it, on every member
  alike, and breaks the quorum (its ops still running fail, so no member waits for one
  that gave up); a member that dies after the round that decided does not change the
  answer.
- **A broken quorum**: once a member of the current quorum is gone, or a newer quorum
  forms, its data ops fail on every service (:mod:`.ft`).
- **One round a step**: a member may ask for the next quorum with its vote (``F_NEXT``:
  its step then counts the voted step once that commits).  When every member of a
  quorum does, the round that decides the commit also forms the next quorum.
- **A clean leave** (``F_LEFT``: a member of the current quorum said bye before it took
  any part in the quorum's step, no op and no vote): while no op of the step can have
  ended (every average needs every member's part, and the quorum sends no state), no
  other member voted or asked again, and the others are at least the ``min_replica_size``
  they asked with, the quorum is *re-formed* without the leaver in the
  round that shows the leave: a new quorum of the others at the same step, and the old
  one's ops are answered "re-formed" (:mod:`.ft` has the members send them again in the
  new one).  Otherwise the leave is a death: the step fails.
- **A silent member** (no message, heartbeats included, within its timeout: hung or
  stopped) is dropped by its service, which shows it one last round flagged ``F_HUNG``:
  it is gone from then on, and the error of a quorum it breaks names it and its timeout.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .. import protocol as P

MAX_MEMBERS, RID_BYTES, HEADER, FIELDS, ROW = (
    P.FT_MAX_MEMBERS, P.FT_RID_BYTES, P.FT_HEADER, P.FT_FIELDS, P.FT_ROW
)  # fmt: skip
CLOCK, ACTIVE, FIRST = P.FT_CLOCK, P.FT_ACTIVE, P.FT_FIRST
TOKEN, STEP, ASK, MIN, TIMEOUT_MS, VOTE_Q, VOTE_OK, RID_LEN, FLAGS = (
    P.FT_TOKEN, P.FT_STEP, P.FT_ASK, P.FT_MIN, P.FT_TIMEOUT_MS, P.FT_VOTE_Q, P.FT_VOTE_OK,
    P.FT_RID_LEN, P.FT_FLAGS,
)  # fmt: skip
F_NEXT, F_HUNG, F_LEFT = P.FT_F_NEXT, P.FT_F_HUNG, P.FT_F_LEFT
_RID_AT = FLAGS + 1
#: Decisions remembered (votes on older quorums are answered "no").
KEEP = 64


def token_node(token: int) -> int:
    """The node of a member's token."""
    return token >> P.FT_TOKEN_NODE_SHIFT


@dataclass
class Member:
    """What one member said, as one row slot carries it."""

    token: int
    step: int
    ask: int
    min_size: int
    timeout_ms: int
    vote_q: int
    vote_ok: int
    replica_id: str
    flags: int = 0  # F_NEXT: the ask came with the vote; F_HUNG: dropped for silence


@dataclass
class Quorum:
    """A formed quorum, the same on every service."""

    qid: int
    members: list[int]  # tokens in rank order
    replica_ids: list[str]
    step: int  # the largest step of its members: every member resumes there
    heal: dict[int, int]  # token behind -> token of the member that sends it the state

    def rank(self, token: int) -> int:
        return self.members.index(token)

    def nodes(self) -> list[int]:
        return sorted({token_node(t) for t in self.members})


@dataclass
class Events:
    """What one round decided."""

    formed: Quorum | None = None
    #: token -> error, for askers refused
    refused: dict[int, str] = field(default_factory=dict)
    #: quorum ids whose data ops must now fail, and why
    broken: dict[int, str] = field(default_factory=dict)
    #: quorum id -> commit or not, decided this round
    decided: dict[int, bool] = field(default_factory=dict)
    #: quorum id -> the quorum that replaced it without a member that left cleanly
    reformed: dict[int, int] = field(default_factory=dict)


def write_member(row: np.ndarray, slot: int, m: Member) -> None:
    """Put ``m`` into slot ``slot`` of this node's ``row``."""
    base = HEADER + slot * FIELDS
    raw = m.replica_id.encode()
    if len(raw) > RID_BYTES:
        raise ValueError(f"replica id {m.replica_id!r} is longer than {RID_BYTES} bytes")
    words = np.zeros(RID_BYTES // 8, np.int64)
    words.view(np.uint8)[: len(raw)] = np.frombuffer(raw, np.uint8)
    row[base : base + _RID_AT] = (
        m.token, m.step, m.ask, m.min_size, m.timeout_ms, m.vote_q, m.vote_ok, len(raw), m.flags
    )  # fmt: skip
    row[base + _RID_AT : base + FIELDS] = words


def read_members(table: np.ndarray) -> dict[int, Member]:
    """Every member the summed ``table`` (one row per node) holds, by token."""
    out: dict[int, Member] = {}
    for row in table:
        for slot in range(MAX_MEMBERS):
            base = HEADER + slot * FIELDS
            w = row[base : base + FIELDS]
            if w[TOKEN] == 0:
                continue
            n = int(w[RID_LEN])
            raw = np.ascontiguousarray(w[_RID_AT:]).view(np.uint8)[:n].tobytes()
            out[int(w[TOKEN])] = Member(
                int(w[TOKEN]), int(w[STEP]), int(w[ASK]), int(w[MIN]), int(w[TIMEOUT_MS]),
                int(w[VOTE_Q]), int(w[VOTE_OK]), raw.decode(errors="replace"), int(w[FLAGS]),
            )  # fmt: skip
    return out


class Quorums:
    """The replicated decider (see the module docstring)."""

    def __init__(self, join_timeout_ms: int) -> None:
        self.join_timeout_ms = int(join_timeout_ms)
        self.current: Quorum | None = None
        self.answered: dict[int, int] = {}  # token -> the last ask answered
        self.first_ask: int | None = None  # clock of the first ask not answered
        self.decided: dict[int, bool] = {}
        self.broken: dict[int, str] = {}  # quorum id -> why its ops fail
        self.reformed: dict[int, int] = {}  # quorum id -> the one that replaced it (a leave)
        self.rounds = 0
        self._first = 0

    def decision(self, qid: int) -> bool | None:
        """The commit decision of quorum ``qid``: None while undecided; False for one
        forgotten or never formed."""
        if qid in self.decided:
            return self.decided[qid]
        if self.current is not None and qid == self.current.qid:
            return None
        return False

    def _decide(self, ev: Events, qid: int, ok: bool) -> None:
        if qid in self.decided:
            return
        self.decided[qid] = ok
        ev.decided[qid] = ok
        while len(self.decided) > KEEP:
            del self.decided[next(iter(self.decided))]

    def _break(self, ev: Events, qid: int, why: str) -> None:
        if qid not in self.broken:
            self.broken[qid] = why
            ev.broken[qid] = why
            if len(self.broken) > KEEP:
                del self.broken[min(self.broken)]

    def advance(self, table: np.ndarray) -> Events:
        """One round: the summed ``table`` of every node's row."""
        self.rounds += 1
        ev = Events()
        clock = int(table[0, CLOCK])
        self._first = int(table[0, FIRST])
        members = read_members(table)
        hung = {t: m for t, m in members.items() if m.flags & F_HUNG}
        left = {t for t, m in members.items() if m.flags & F_LEFT}
        for t in [*hung, *left]:
            del members[t]
        for t in [t for t in self.answered if t not in members]:
            del self.answered[t]
        q = self.current
        if q is not None:
            gone = [t for t in q.members if t not in members]
            if gone and self._reform(ev, q, members, set(gone) <= left):
                pass
            elif gone:
                names = ", ".join(q.replica_ids[q.members.index(t)] for t in gone)
                why = f"quorum {q.qid}: member {names} is gone (died or left)"
                late = [hung[t] for t in gone if t in hung]
                if late:
                    why = f"quorum {q.qid}: " + "; ".join(
                        f"member {m.replica_id} stopped answering (no message within its "
                        f"timeout of {m.timeout_ms / 1000:g} s: hung or stopped), dropped"
                        for m in late
                    )
                self._break(ev, q.qid, why)
                self._decide(ev, q.qid, False)
            elif q.qid not in self.decided:
                votes = [members[t] for t in q.members]
                # a vote "no", or a member asking again without voting, fails the step at
                # once: its ops still running fail too, so no member waits for one that
                # gave up on the step
                quit = [
                    m for m in votes
                    if (m.vote_q == q.qid and not m.vote_ok)
                    or (m.vote_q != q.qid and m.ask > self.answered.get(m.token, 0))
                ]  # fmt: skip
                if quit:
                    names = ", ".join(m.replica_id for m in quit)
                    self._break(ev, q.qid, f"quorum {q.qid}: member {names} gave up the step")
                    self._decide(ev, q.qid, False)
                elif all(m.vote_q == q.qid for m in votes):
                    self._decide(ev, q.qid, True)
        self._form(ev, members, clock)
        return ev

    def _reform(self, ev: Events, q: Quorum, members: dict[int, Member], clean: bool) -> bool:
        """Replace quorum ``q`` by one without the members that left it cleanly, if its
        step can still start over: no op of it can have ended (it sends no state, and an
        average needs the leaver's part), no other member voted on it or asked again."""
        if not clean or q.heal or q.qid in self.decided:
            return False
        rest = [t for t in q.members if t in members]
        if (
            not rest
            or len(rest) < max(members[t].min_size for t in rest)
            or any(
                members[t].vote_q == q.qid or members[t].ask > self.answered.get(t, 0) for t in rest
            )
        ):
            return False
        new = Quorum(q.qid + 1, rest, [members[t].replica_id for t in rest], q.step, {})
        names = ", ".join(q.replica_ids[i] for i, t in enumerate(q.members) if t not in members)
        self._break(ev, q.qid, f"quorum {q.qid}: member {names} left; re-formed as {new.qid}")
        self._decide(ev, q.qid, False)
        self.reformed[q.qid] = new.qid
        ev.reformed[q.qid] = new.qid
        while len(self.reformed) > KEEP:
            del self.reformed[min(self.reformed)]
        self.current = ev.formed = new
        return True

    def now(self, qid: int) -> int:
        """The quorum that ``qid`` became through re-formings (``qid`` if none)."""
        while qid in self.reformed:
            qid = self.reformed[qid]
        return qid

    def step_of(self, m: Member) -> int:
        """The step ``m`` asks with: an ask that came with a vote (``F_NEXT``) counts the
        voted step once the vote's quorum committed."""
        return m.step + (1 if m.flags & F_NEXT and self.decided.get(m.vote_q) else 0)

    def _form(self, ev: Events, members: dict[int, Member], clock: int) -> None:
        asking = [t for t, m in members.items() if m.ask > self.answered.get(t, 0)]
        if not asking:
            self.first_ask = None
            return
        if self.first_ask is None:
            self.first_ask = clock
        waited = clock - self.first_ask
        need = max(members[t].min_size for t in asking)
        limit = min(members[t].timeout_ms for t in asking)
        q = self.current
        prev = [t for t in q.members if t in members] if q is not None else []
        if prev:
            ready = set(prev) <= set(asking)  # (a live member still busy is waited for)
        else:
            first = int(self._first)
            ready = waited >= self.join_timeout_ms or 0 < first <= len(asking)
        if ready and len(asking) >= need:
            self._make(ev, members, asking)
        elif waited >= limit and len(asking) < need:
            why = (
                f"quorum: {len(asking)} member(s) asked within {limit / 1000:g} s, "
                f"fewer than min_replica_size {need}"
            )
            for t in asking:
                ev.refused[t] = why
                self.answered[t] = members[t].ask
            self.first_ask = None

    def _make(self, ev: Events, members: dict[int, Member], asking: list[int]) -> None:
        old = self.current
        if old is not None:
            why = f"quorum {old.qid} was replaced by quorum {old.qid + 1}"
            self._break(ev, old.qid, why)
            self._decide(ev, old.qid, False)
        order = sorted(asking, key=lambda t: (members[t].replica_id, t))
        steps = {t: self.step_of(members[t]) for t in order}
        step = max(steps.values())
        sources = [t for t in order if steps[t] == step]
        behind = [t for t in order if steps[t] < step]
        heal = {t: sources[i % len(sources)] for i, t in enumerate(behind)}
        qid = (old.qid if old is not None else 0) + 1
        self.current = Quorum(qid, order, [members[t].replica_id for t in order], step, heal)
        for t in asking:
            self.answered[t] = members[t].ask
        self.first_ask = None
        ev.formed = self.current

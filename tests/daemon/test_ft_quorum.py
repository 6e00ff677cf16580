"""The fault-tolerant decider (``daemon/ft_quorum.py``) on tables made by hand: every service
runs it on the same table, so these are its decisions everywhere."""

from __future__ import annotations

import numpy as np

from totalreduce.daemon import ft_quorum as Q


def table(clock: int, *nodes: list[Q.Member]) -> np.ndarray:
    t = np.zeros((len(nodes), Q.ROW), np.int64)
    t[0, Q.CLOCK] = clock
    for n, members in enumerate(nodes):
        for slot, m in enumerate(members):
            Q.write_member(t[n], slot, m)
    return t


def member(token: int, rid: str, ask: int = 1, step: int = 0, vote: int = 0, ok: int = 1,
           min_size: int = 1) -> Q.Member:  # fmt: skip
    return Q.Member(token, step, ask, min_size, 5000, vote, ok, rid)


B = 1 << 32  # node 1's first token


def test_first_quorum_waits_for_join_timeout_then_orders_by_replica_id() -> None:
    qs = Q.Quorums(join_timeout_ms=1000)
    ms = [member(1, "b"), member(B | 1, "a")]
    assert qs.advance(table(0, ms[:1], ms[1:])).formed is None
    ev = qs.advance(table(1000, ms[:1], ms[1:]))
    assert ev.formed is not None and ev.formed.replica_ids == ["a", "b"]
    assert ev.formed.nodes() == [0, 1] and ev.formed.heal == {}


def test_death_breaks_quorum_fails_commit_next_quorum_without_it_and_heals_joiner() -> None:
    qs = Q.Quorums(join_timeout_ms=0)
    a, b, c = member(1, "a"), member(2, "b"), member(B | 1, "c")
    q1 = qs.advance(table(0, [a, b], [c])).formed
    assert q1 is not None and len(q1.members) == 3
    # a and c voted ok, b dies before voting: broken, not committed
    a.vote, c.vote = 0, 0
    a2, c2 = member(1, "a", vote=q1.qid), member(B | 1, "c", vote=q1.qid)
    ev = qs.advance(table(10, [a2], [c2]))
    assert (
        ev.decided == {q1.qid: False} and q1.qid in ev.broken and "b is gone" in ev.broken[q1.qid]
    )
    # the survivors ask again (step 0 still) and a replacement joins: quorum of 3, no one behind
    a3, c3 = member(1, "a", ask=2, vote=q1.qid), member(B | 1, "c", ask=2, vote=q1.qid)
    ev = qs.advance(table(20, [a3], [c3]))
    assert ev.formed is not None and ev.formed.replica_ids == ["a", "c"]
    q2 = ev.formed
    a4, c4 = member(1, "a", ask=2, vote=q2.qid), member(B | 1, "c", ask=2, vote=q2.qid)
    assert qs.advance(table(30, [a4], [c4])).decided == {q2.qid: True}
    # a joiner (step 0) asks while the others are at step 1: it is healed from a member
    a5 = member(1, "a", ask=3, step=1, vote=q2.qid)
    c5 = member(B | 1, "c", ask=3, step=1, vote=q2.qid)
    d = member(3, "d")
    q3 = qs.advance(table(40, [a5, d], [c5])).formed
    assert q3 is not None and q3.step == 1 and q3.heal == {3: 1}


def test_commit_needs_every_vote_ok_and_a_late_death_changes_nothing() -> None:
    qs = Q.Quorums(join_timeout_ms=0)
    a, b = member(1, "a"), member(B | 1, "b")
    q = qs.advance(table(0, [a], [b])).formed
    assert q is not None
    a.vote_q = q.qid
    assert qs.advance(table(1, [a], [b])).decided == {}  # b has not voted
    b.vote_q, b.vote_ok = q.qid, 0
    assert qs.advance(table(2, [a], [b])).decided == {q.qid: False}
    assert qs.advance(table(3, [a], [])).decided == {}  # decided already: stays
    assert qs.decision(q.qid) is False


def test_min_replica_size_refuses_after_timeout_naming_sizes() -> None:
    qs = Q.Quorums(join_timeout_ms=0)
    a = member(1, "a", min_size=2)
    assert not qs.advance(table(0, [a])).refused
    ev = qs.advance(table(5000, [a]))
    assert "fewer than min_replica_size 2" in ev.refused[1] and "1 member(s)" in ev.refused[1]


def test_a_no_vote_or_an_ask_without_vote_fails_the_step_at_once() -> None:
    qs = Q.Quorums(join_timeout_ms=0)
    a, b = member(1, "a"), member(B | 1, "b")
    q = qs.advance(table(0, [a], [b])).formed
    assert q is not None
    a.vote_q, a.vote_ok = q.qid, 0  # b still computing: the step fails now anyway
    ev = qs.advance(table(1, [a], [b]))
    assert ev.decided == {q.qid: False} and "a gave up" in ev.broken[q.qid]
    q2 = qs.advance(table(2, [member(1, "a", ask=2)], [member(B | 1, "b", ask=2)])).formed
    assert q2 is not None
    ev = qs.advance(table(3, [member(1, "a", ask=3)], [member(B | 1, "b", ask=2)]))
    assert ev.decided == {q2.qid: False} and q2.qid in ev.broken


def test_vote_with_the_next_ask_forms_the_next_quorum_in_the_same_round() -> None:
    """Every member votes and asks for the next quorum in one message (``F_NEXT``): the
    round that commits the step forms the next quorum at the step after it; a vote "no"
    fails the step and the next quorum resumes the step before it."""
    qs = Q.Quorums(join_timeout_ms=0)
    a, c = member(1, "a"), member(B | 1, "c")
    q1 = qs.advance(table(0, [a], [c])).formed
    assert q1 is not None

    def voted(token: int, rid: str, ok: int, ask: int, step: int) -> Q.Member:
        m = member(token, rid, ask=ask, step=step, vote=q1.qid if ask == 2 else q2.qid, ok=ok)
        m.flags = Q.F_NEXT
        return m

    q2 = q1
    ev = qs.advance(table(10, [voted(1, "a", 1, 2, 0)], [voted(B | 1, "c", 1, 2, 0)]))
    assert ev.decided == {q1.qid: True}
    assert ev.formed is not None and ev.formed.step == 1 and ev.formed.heal == {}
    q2 = ev.formed
    ev = qs.advance(table(20, [voted(1, "a", 1, 3, 1)], [voted(B | 1, "c", 0, 3, 1)]))
    assert ev.decided == {q2.qid: False} and "c gave up" in ev.broken[q2.qid]
    assert ev.formed is not None and ev.formed.step == 1 and ev.formed.qid == q2.qid + 1


def test_a_silent_member_breaks_its_quorum_naming_it_and_its_timeout() -> None:
    """A member its service dropped for silence (``F_HUNG``, its timeout in the slot) is
    gone: the step fails with an error that names it and the timeout; the next quorum
    forms without it."""
    qs = Q.Quorums(join_timeout_ms=0)
    a, b = member(1, "a"), member(B | 1, "b")
    q1 = qs.advance(table(0, [a], [b])).formed
    assert q1 is not None
    hung = Q.Member(B | 1, 0, 1, 1, 2500, 0, 0, "b", Q.F_HUNG)
    ev = qs.advance(table(10, [member(1, "a", ask=2)], [hung]))
    assert ev.decided == {q1.qid: False}
    why = ev.broken[q1.qid]
    assert "member b stopped answering" in why and "2.5 s" in why, why
    assert ev.formed is not None and ev.formed.replica_ids == ["a"]


def test_a_clean_leave_before_the_step_re_forms_the_quorum_else_fails_it() -> None:
    """A member of the current quorum that left cleanly before taking part in its step
    (``F_LEFT``) re-forms the quorum without it at the same step, in the round that shows
    it (its step commits among the others); once another member voted, or with a death,
    the leave fails the step as a death does."""
    qs = Q.Quorums(join_timeout_ms=0)
    a, b, c = member(1, "a"), member(2, "b"), member(B | 1, "c")
    q1 = qs.advance(table(0, [a, b], [c])).formed
    assert q1 is not None and len(q1.members) == 3
    left = Q.Member(2, 0, 1, 1, 5000, 0, 0, "b", Q.F_LEFT)
    ev = qs.advance(table(10, [a, left], [c]))
    q2 = ev.formed
    assert q2 is not None and q2.replica_ids == ["a", "c"] and q2.step == q1.step
    assert ev.reformed == {q1.qid: q2.qid} and ev.decided == {q1.qid: False}
    assert "b left; re-formed as" in ev.broken[q1.qid] and qs.now(q1.qid) == q2.qid
    # the others vote in the re-formed quorum: it commits
    a2, c2 = member(1, "a", vote=q2.qid), member(B | 1, "c", vote=q2.qid)
    assert qs.advance(table(20, [a2], [c2])).decided == {q2.qid: True}
    # a voted already when c leaves: the step fails (as a death), no re-forming
    a3, c3 = member(1, "a", ask=2, step=1, vote=q2.qid), member(B | 1, "c", ask=2, step=1)
    q3 = qs.advance(table(30, [a3], [c3])).formed
    assert q3 is not None and q3.replica_ids == ["a", "c"]
    a4 = member(1, "a", ask=2, step=1, vote=q3.qid)
    c4 = Q.Member(B | 1, 1, 2, 1, 5000, q2.qid, 1, "c", Q.F_LEFT)
    ev = qs.advance(table(40, [a4], [c4]))
    assert ev.decided == {q3.qid: False} and not ev.reformed and ev.formed is None
    assert "c is gone" in ev.broken[q3.qid]

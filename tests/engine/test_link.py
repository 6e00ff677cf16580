"""One peer's link (engine/link.py): the per-peer flow-control rules, driven through methods."""

from __future__ import annotations

from totalreduce.engine.link import Link
from totalreduce.engine.wire import MSG_SIZE


def test_messages_leave_within_credit_and_in_order() -> None:
    link = Link(msg_cap=MSG_SIZE + 100, window=2 * (MSG_SIZE + 100), eager_share=64)
    assert link.room(2 * (MSG_SIZE + 100)) and not link.room(2 * (MSG_SIZE + 100) + 1)
    first = link.outbox(60)
    first += bytes(60)
    link.out_frames += 1
    second = link.outbox(60)  # 60 more do not fit under msg_cap: a new message
    assert second is not first and list(link.backlog) == [(first, 1)]
    second += bytes(60)
    link.out_frames += 1
    link.close()
    assert link.out is None and [m for m, _ in link.backlog] == [first, second]
    assert link.queued == 120
    sent = []
    while (ready := link.next_message()) is not None:
        sent.append(ready)
        link.charge(len(ready[0]), ready[1])
    assert [m for m, _ in sent] == [first, second]
    assert link.ctl_credit == 2 * (MSG_SIZE + 100) - 2 * (MSG_SIZE + 60)
    assert link.queued == 0
    third = link.outbox(60)
    third += bytes(60)
    link.out_frames += 1
    link.close()
    assert link.next_message() is None  # 40 bytes of credit left, the message is 96
    assert link.credit(MSG_SIZE + 60, 0) == []
    assert link.next_message() == (third, 1)


def test_owed_credit_rides_along_or_goes_alone() -> None:
    link = Link(msg_cap=1000, window=4000, eager_share=64)
    assert not link.owes(2000, 32, waiting=True)  # nothing owed: nothing to send
    link.owe(100, 10)
    assert not link.owes(2000, 32, waiting=False)  # a little: it waits for a message
    assert link.owes(2000, 32, waiting=True)  # ours wait for credit: it must go now
    link.owe(1900, 0)
    assert link.owes(2000, 32, waiting=False)  # half the window: it goes alone
    assert link.take_owed() == (2000, 10) and link.take_owed() == (0, 0)
    link.owe(0, 40)
    assert link.owes(2000, 32, waiting=False)


def test_credit_hands_back_the_sends_that_waited_and_reset_forgets_everything() -> None:
    link = Link(msg_cap=1000, window=4000, eager_share=64)
    link.blocked.extend([("a",), ("b",)])
    link.eager_credit -= 64
    assert link.credit(0, 64) == [("a",), ("b",)] and link.blocked == []
    assert link.eager_credit == 64
    assert link.body_tag() == 0
    for _ in range(5):
        link.tag_used(3)
    assert link.body_tag() == 2  # a cycle of 3 tags
    link.outbox(10)
    link.owe(5, 5)
    link.ctl_credit = 7
    link.reset()
    assert (link.out, link.queued, link.ctl_credit, link.eager_credit) == (None, 0, 4000, 64)
    assert link.take_owed() == (0, 0) and link.body_tag() == 0 and not link.backlog

"""The one table of ops' errors (``engine/failures.py:OpErrors``, ``loop.failures.errors``)."""

from __future__ import annotations

from totalreduce.engine.failures import ERROR_MISMATCH, OpErrors
from totalreduce.engine.wire import SESSION_ID
from totalreduce.lane.payload import REMEMBERED


def test_an_op_failed_here_and_one_failed_elsewhere_first_share_one_entry() -> None:
    t = OpErrors()
    t.note_early((1, 0), "failed on rank 2", ERROR_MISMATCH)
    assert t.knows((1, 0)) and t.is_early((1, 0)) and t.failed((1, 0)) is None and t.early == 1
    t.note_failed((1, 0), "failed here")  # the same op, aborted here too: both kept
    assert t.failed((1, 0)) == "failed here" and len(t) == 1
    assert t.take_early((1, 0)) == ("failed on rank 2", ERROR_MISMATCH)
    assert t.early == 0 and not t.is_early((1, 0)) and t.failed((1, 0)) == "failed here"
    assert t.take_early((1, 0)) is None
    t.note_early((2, 0), "again", 1)
    t.note_early((2, 0), "the last word", 1)  # a second error for it: counted once, the last
    assert t.early == 1 and t.take_early((2, 0)) == ("the last word", 1)
    assert not t.knows((2, 0)) and len(t) == 1  # nothing left of it


def test_the_session_op_is_not_remembered_as_failed_and_forget_clears_an_op() -> None:
    t = OpErrors()
    t.note_failed((SESSION_ID, 3), "ended")
    assert not t.knows((SESSION_ID, 3))
    t.note_early((5, 1), "x", 1)
    t.forget((5, 1))
    assert not t.knows((5, 1)) and t.early == 0


def test_the_table_keeps_the_last_ops_and_its_early_count_with_them() -> None:
    t = OpErrors()
    for gen in range(2 * REMEMBERED + 10):
        if gen % 2:
            t.note_early((7, gen), "e", 1)
        else:
            t.note_failed((7, gen), "f")
    assert len(t) == 2 * REMEMBERED
    assert not t.knows((7, 0)) and t.knows((7, 2 * REMEMBERED + 9))
    assert t.early == sum(t.is_early((7, g)) for g in range(2 * REMEMBERED + 10))

"""Constants passed between jitted functions typed as int64 and bool while compiling the lane
(totalreduce/lane/plain_constants.py): one specialization per argument types."""

from __future__ import annotations

import threading

import numba
from numba import njit, types

from totalreduce.lane.plain_constants import plain_constants


def _functions():  # type: ignore[no-untyped-def]
    """A callee called with three constants, and one that needs its constant's value."""

    @njit
    def callee(x, k):  # type: ignore[no-untyped-def]
        return x + k

    @njit
    def caller(x):  # type: ignore[no-untyped-def]
        return callee(x, 1) + callee(x, 2) + callee(x, True)

    @njit
    def needs_value(x, k):  # type: ignore[no-untyped-def]
        numba.literally(k)
        return x * k

    @njit
    def caller_of_literal(x):  # type: ignore[no-untyped-def]
        return needs_value(x, 3)

    return callee, caller, needs_value, caller_of_literal


def _literal(sig: tuple) -> bool:
    return any(isinstance(t, types.Literal) for t in sig)


def test_constants_are_typed_by_type_not_value_inside_the_block() -> None:
    callee, caller, needs_value, caller_of_literal = _functions()
    with plain_constants():
        caller.compile((types.int64,))
        caller_of_literal.compile((types.int64,))
    assert caller(10) == 11 + 12 + 11
    assert sorted(str(s) for s in callee.signatures) == ["(int64, bool)", "(int64, int64)"]
    # numba.literally: typed with the constant, as Numba does without the block
    assert caller_of_literal(2) == 6
    assert [_literal(s) for s in needs_value.signatures] == [True]


def test_outside_the_block_and_in_other_threads_numba_types_as_usual() -> None:
    callee, caller, _, _ = _functions()
    other, other_caller, _, _ = _functions()
    compiled = threading.Event()

    def elsewhere() -> None:
        other_caller.compile((types.int64,))
        compiled.set()

    with plain_constants():
        t = threading.Thread(target=elsewhere)
        t.start()
        t.join(60)
    assert compiled.is_set()
    caller.compile((types.int64,))
    assert len(callee.signatures) == 3 and all(_literal(s) for s in callee.signatures)
    assert len(other.signatures) == 3 and all(_literal(s) for s in other.signatures)

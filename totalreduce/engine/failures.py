"""The codes an ERROR frame carries, the error each becomes on the rank that hears it, and
the one table of ops' errors (:class:`OpErrors`, ``loop.failures.errors``)."""

from __future__ import annotations

from collections import OrderedDict

from ..errors import (
    FrameError,
    OpFailedError,
    OpMismatchError,
    OpTimeoutError,
    TotalReduceError,
)
from ..lane.payload import REMEMBERED, OpKey
from ..protocol import ErrorCode
from .wire import SESSION_ID

ERROR_MISMATCH = int(ErrorCode.MISMATCH)
ERROR_FAILED = int(ErrorCode.FAILED)
ERROR_FRAME = int(ErrorCode.FRAME)
ERROR_TIMEOUT = int(ErrorCode.TIMEOUT)


def _error_from_peer(message: str, code: int) -> TotalReduceError:
    if code == ERROR_MISMATCH:
        return OpMismatchError(message)
    if code == ERROR_FRAME:
        return FrameError(message)
    if code == ERROR_TIMEOUT:
        return OpTimeoutError(message)
    return OpFailedError(message)


class _Entry:
    """One op's errors: what failed here, what failed elsewhere before it was submitted."""

    __slots__ = ("failed", "early")

    def __init__(self) -> None:
        #: The text of its error here (it failed here, or completed here and failed elsewhere).
        self.failed: str | None = None
        #: (text, code) of an error from a peer for an op not submitted here yet.
        self.early: tuple[str, int] | None = None


class OpErrors:
    """The one table of ops' errors a rank knows, by op key (the last ``2 * REMEMBERED``).

    An op's entry says that it failed here (``failed``: a frame or an error for it is
    answered, not kept; ops chained after it fail), or that it failed elsewhere before it
    was submitted here (``early``: it fails when it is, with that error).  ``early`` counts
    the ops with an early error (a repeat's express entry looks for them only then)."""

    __slots__ = ("_table", "early")

    def __init__(self) -> None:
        self._table: OrderedDict[OpKey, _Entry] = OrderedDict()
        self.early = 0

    def __len__(self) -> int:
        return len(self._table)

    def knows(self, key: OpKey) -> bool:
        """Op ``key`` failed, here or elsewhere."""
        return key in self._table

    def failed(self, key: OpKey) -> str | None:
        """The text of op ``key``'s error here (None: it did not fail here)."""
        entry = self._table.get(key)
        return None if entry is None else entry.failed

    def is_early(self, key: OpKey) -> bool:
        """Op ``key`` failed elsewhere before it was submitted here."""
        entry = self._table.get(key)
        return entry is not None and entry.early is not None

    def note_failed(self, key: OpKey, text: str) -> None:
        """Op ``key`` failed here (not kept for the session op, which every job starts with)."""
        if key[0] == SESSION_ID:
            return
        self._entry(key).failed = text

    def note_early(self, key: OpKey, text: str, code: int) -> None:
        """Op ``key`` failed elsewhere (``code``: what to raise) and is not submitted here."""
        entry = self._entry(key)
        if entry.early is None:
            self.early += 1
        entry.early = (text, code)

    def take_early(self, key: OpKey) -> tuple[str, int] | None:
        """The early error of op ``key``, taken out of the table (None: none)."""
        entry = self._table.get(key)
        if entry is None or entry.early is None:
            return None
        early, entry.early = entry.early, None
        self.early -= 1
        if entry.failed is None:
            del self._table[key]
        return early

    def forget(self, key: OpKey) -> None:
        """Op ``key`` comes again (a node's session op): nothing of it is kept."""
        entry = self._table.pop(key, None)
        if entry is not None and entry.early is not None:
            self.early -= 1

    def _entry(self, key: OpKey) -> _Entry:
        table = self._table
        entry = table.get(key)
        if entry is None:
            entry = table[key] = _Entry()
            if len(table) > 2 * REMEMBERED:
                _, old = table.popitem(last=False)
                if old.early is not None:
                    self.early -= 1
        return entry

"""The ops that ended here, the last :data:`~totalreduce.lane.payload.REMEMBERED` of them,
in a ring of arrays: what a rank needs to answer a late error or a late frame about one.

Each entry is three int64 words (the op's wire id, its generation and its *row*); a row
names what an error text and a relay need (the op's name, its group, its schedule's hints
for a frame that should not have come) and is shared by every op of that name and shape,
so a repeated op writes three words and makes nothing.  Whoever repeats a shape keeps its
row (:meth:`EndedOps.row`, :attr:`EndedOps.epoch`); the rows are compacted to those the
ring still names when the table is full, and the epoch moves then.

Lookups (:meth:`EndedOps.get`) are rare (an error or a frame about an ended op) and scan
the ring with numpy.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..lane.payload import REMEMBERED, OpKey

#: How many rows the table holds before it is compacted to the rows the ring names (twice
#: the ring's entries: a compaction frees at least half, so its cost is spread thin even
#: when every op has a name of its own).
ROWS = 2 * REMEMBERED
#: A record's fourth item (kept for the record's shape: see :meth:`EndedOps.get`).
_NONE: tuple[Any, ...] = ()
_MASK64 = (1 << 64) - 1


def _signed(v: int) -> int:
    """A wire id (up to 64 bits) as the int64 the ring keeps."""
    v &= _MASK64
    return v - (1 << 64) if v >> 63 else v


class EndedOps:
    """The last ``n`` ops that ended here (``n`` a power of two), in arrays."""

    def __init__(self, n: int = REMEMBERED) -> None:
        if n <= 0 or n & (n - 1):
            raise ValueError(f"the ring of ended ops holds a power of two, got {n}")
        self._mask = n - 1
        self.wid = np.zeros(n, dtype=np.int64)
        self.gen = np.full(n, -1, dtype=np.int64)  # -1: an empty entry
        self.rows = np.zeros(n, dtype=np.int64)
        # Python writes an entry through memoryviews (a list's speed; numpy's item
        # assignment costs three times as much), lookups scan the arrays
        self._wid, self._gen, self._rows = self.wid.data, self.gen.data, self.rows.data
        self.at = 0  # the next entry written
        #: Row -> (name, group, hints); key (name, group, hints) -> row.
        self._named: list[tuple[Any, ...]] = []
        self._row_of: dict[tuple[Any, ...], int] = {}
        #: Moves when the rows were compacted: a row kept from before is stale.
        self.epoch = 0

    def __len__(self) -> int:
        return int(np.count_nonzero(self.gen >= 0))

    def row(self, name: str | int, group: tuple[int, ...], hints: tuple[str, ...]) -> int:
        """The row of ops named ``name`` over ``group`` with ``hints`` (made if new)."""
        key = (name, group, hints)
        r = self._row_of.get(key)
        if r is None:
            if len(self._named) >= ROWS:
                self._compact()
            r = self._row_of[key] = len(self._named)
            self._named.append(key)
        return r

    def note(self, wid: int, gen: int, row: int) -> None:
        """Op ``(wid, gen)`` of row ``row`` ended here (the oldest entry gives way)."""
        i = self.at
        self._wid[i] = _signed(wid) if wid >> 63 else wid
        self._gen[i] = gen
        self._rows[i] = row
        self.at = (i + 1) & self._mask

    def note_span(self, wid: int, first: int, k: int, row: int) -> None:
        """Generations ``first`` to ``first + k - 1`` of ``wid`` ended here, in order."""
        if k <= 0:
            return
        n = self._mask + 1
        if k > n:  # only the last n are kept
            first, k = first + k - n, n
        idx = (self.at + np.arange(k)) & self._mask
        self.wid[idx] = _signed(wid)
        self.gen[idx] = np.arange(first, first + k, dtype=np.int64)
        self.rows[idx] = row
        self.at = (self.at + k) & self._mask

    def _find(self, key: OpKey) -> int:
        """The ring's newest entry of ``key``, or -1."""
        hits = np.flatnonzero((self.gen == key[1]) & (self.wid == _signed(key[0])))
        if hits.size == 0:
            return -1
        if hits.size == 1:
            return int(hits[0])
        return int(hits[np.argmax((hits - self.at) & self._mask)])  # the last written

    def __contains__(self, key: OpKey) -> bool:
        return self._find(key) >= 0

    def get(self, key: OpKey) -> tuple[Any, ...] | None:
        """``((name, generation), group, hints, ())`` of ended op ``key``, or None."""
        i = self._find(key)
        if i < 0:
            return None
        name, group, hints = self._named[int(self.rows[i])]
        return ((name, key[1]), group, hints, _NONE)

    def forget(self, key: OpKey) -> None:
        """Op ``key`` will come again: forget that it ended."""
        self.gen[(self.gen == key[1]) & (self.wid == _signed(key[0]))] = -1

    def _compact(self) -> None:
        """Keep only the rows the ring names (renumbered); the epoch moves."""
        live = self.gen >= 0
        used = np.unique(self.rows[live])
        new_of = {int(old): new for new, old in enumerate(used.tolist())}
        named = [self._named[old] for old in used.tolist()]
        if live.any():
            self.rows[live] = np.array([new_of[int(r)] for r in self.rows[live]], dtype=np.int64)
        self._named = named
        self._row_of = {k: i for i, k in enumerate(named)}
        self.epoch += 1

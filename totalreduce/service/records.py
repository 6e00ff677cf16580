"""The table of a service's express records, kept within a bound of bytes.

A service keeps one record per repeated op (service/express.py): a training step's
names, each with its shape, its schedule and the lane's fields of it.  A job that makes a
new name or count every step (a step counter in the name, sequence lengths) would keep
adding records.  :class:`Records` charges each record when it is put
(:func:`charge`: :data:`RECORD_BYTES` for the record and what it keeps alive, its
schedule's segments, and the bytes of the arrays it holds) against
``Config.express_bytes``, and past the bound drops the least recently used ones
(second chance: a record a repeat found since the last sweep (``used``) is kept once more
and goes to the back), down to seven eighths of the bound, so one sweep serves many puts.
A record dropped costs its name one whole-way call (which makes it again); nothing else.

Lookups are the dict's own (``get``): a repeat pays nothing for the bound but setting its
record's ``used`` flag (:func:`.express.lookup`).  Records without that flag (the daemon
client's) go oldest first.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

#: What a record is charged beyond the arrays it holds: the record, its key, its name's
#: signature, and the schedule and segment plan it keeps alive (measured: some 4 KiB
#: each for small ops, with 20,000 new names of new counts).
RECORD_BYTES = 4096
#: ... and per segment of its segment plan (a large op's schedule has more of them).
SEGMENT_BYTES = 256
#: The fewest bytes ``Config.express_bytes`` may be (a few records).
MIN_BYTES = 1 << 16
#: Most records whatever their charge (the daemon client's callers clear their table at
#: ``express.MAX_RECORDS``: the table never gets there).
MAX_COUNT = (1 << 15) - 1


def charge(rec: Any) -> int:
    """What record ``rec`` is charged (bytes)."""
    total = RECORD_BYTES
    for name in getattr(rec.__class__, "__slots__", ()):
        v = getattr(rec, name, None)
        if v.__class__ is np.ndarray:
            total += v.nbytes
    plan = getattr(rec, "plan", None)
    if plan is not None:
        total += SEGMENT_BYTES * (len(getattr(plan, "sends", ())) + len(getattr(plan, "recvs", ())))
    return total


class Records(dict):  # type: ignore[type-arg]
    """A service's express records (a dict: ``get`` is the dict's), charged by size within
    ``bound`` bytes (see the module docstring)."""

    __slots__ = ("bound", "charged", "charges", "evicted", "_lock")

    def __init__(self, bound: int) -> None:
        super().__init__()
        self.bound = max(bound, MIN_BYTES)
        #: bytes the records kept are charged, and each key's charge
        self.charged = 0
        self.charges: dict[Any, int] = {}
        #: records dropped so far to keep the bound
        self.evicted = 0
        #: held while records are put or dropped (threads of one rank may make records at
        #: once; a repeat's ``get`` takes nothing)
        self._lock = threading.Lock()

    def __setitem__(self, key: Any, rec: Any) -> None:
        c = charge(rec)
        with self._lock:
            old = self.charges.pop(key, None)
            if old is not None:
                self.charged -= old
                dict.pop(self, key, None)
            if self.charged + c > self.bound or len(self) >= MAX_COUNT:
                self._sweep(self.bound - self.bound // 8 - c)
            dict.__setitem__(self, key, rec)
            self.charges[key] = c
            self.charged += c

    def __delitem__(self, key: Any) -> None:
        with self._lock:
            dict.__delitem__(self, key)
            self.charged -= self.charges.pop(key, 0)

    def pop(self, key: Any, *default: Any) -> Any:
        with self._lock:
            self.charged -= self.charges.pop(key, 0)
            return dict.pop(self, key, *default)

    def clear(self) -> None:
        with self._lock:
            dict.clear(self)
            self.charges.clear()
            self.charged = 0

    def _sweep(self, target: int) -> None:
        """Drop the least recently used records until the charges are within ``target``
        bytes and the count below :data:`MAX_COUNT` (a record used since the last sweep is
        kept once more, at the back)."""
        charges = self.charges
        count = MAX_COUNT - max(1, MAX_COUNT // 8)
        for key in list(dict.keys(self)):  # each key is met once: kept ones go behind
            if self.charged <= target and len(self) <= count:
                return
            rec = dict.__getitem__(self, key)
            if getattr(rec, "used", False):
                rec.used = False
                dict.__delitem__(self, key)
                dict.__setitem__(self, key, rec)
                continue
            dict.__delitem__(self, key)
            self.charged -= charges.pop(key, 0)
            self.evicted += 1
        # every record was used since the last sweep: the oldest go now, used or not
        for key in list(dict.keys(self)):
            if self.charged <= target and len(self) <= count:
                return
            dict.__delitem__(self, key)
            self.charged -= charges.pop(key, 0)
            self.evicted += 1

"""The completion word of one op: what a waiter reads, and what it sleeps on if it must.

A ``threading.Event`` per op costs more than the rest of a small op's submission (it
builds a condition variable and its lock).  Most waits never sleep: the waiter drives
progress itself and sees the word set.  So the word is a plain attribute, and the event
a waiter sleeps on is made only by the first waiter that has to sleep.

Ordering (the interpreter runs one bytecode at a time, so reads and writes are
sequentially consistent): ``set`` writes the flag, then reads ``_ev``; ``wait`` publishes
``_ev``, then reads the flag.  Whichever runs second sees the other's write, so a waiter
never sleeps on an event nobody will set.

:func:`finish` runs an op's completion callback (``OpSpec.on_done``), which sets its word.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..lane.payload import OpSpec

log = logging.getLogger("totalreduce.engine")

_MAKE = threading.Lock()  # two first waiters must share one event


class Completion:
    """``is_set``/``set``/``wait`` as ``threading.Event``, without one until a waiter sleeps."""

    __slots__ = ("_flag", "_ev")

    def __init__(self) -> None:
        self._flag = False
        self._ev: threading.Event | None = None

    def is_set(self) -> bool:
        return self._flag

    def set(self) -> None:
        self._flag = True
        ev = self._ev
        if ev is not None:
            ev.set()

    def wait(self, timeout: float | None = None) -> bool:
        """True once set; False if ``timeout`` seconds passed first."""
        if self._flag:
            return True
        ev = self._ev
        if ev is None:
            with _MAKE:
                ev = self._ev
                if ev is None:
                    ev = threading.Event()
                    self._ev = ev
            if self._flag:  # set() ran before it could see the event
                return True
        return ev.wait(timeout)

    #: What ``Driver.sleep`` calls (an op that is its own completion word has a ``wait`` of
    #: its own: ``service/handle.ExpressOp``).
    sleep = wait


#: What the loop's waits take: an op's completion word, or a plain event.
Waitable = threading.Event | Completion


def finish(spec: OpSpec, error: BaseException | None) -> None:
    """Run op ``spec``'s completion callback with its error (None: it completed)."""
    if spec.on_done is not None:
        try:
            spec.on_done(error)
        except Exception:  # a user callback must not kill the loop
            log.exception("completion callback of %s failed", spec.describe())

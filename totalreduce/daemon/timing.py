"""Precise short sleeps: the timer slack of the threads that poll with a backoff.

Linux lets a sleep end up to the thread's *timer slack* late (50 us by
default), so a backoff meant to start at 1 us really starts at ~60 us and a
client notices a finished op tens of microseconds late.  A client thread that
waits asks for 1 us of slack instead (the service's threads keep the default:
the engine's backoff is tuned for it).  Elsewhere this does nothing.
"""

from __future__ import annotations

import ctypes
import sys
import threading

_PR_SET_TIMERSLACK = 29
_local = threading.local()


def precise_sleeps() -> None:
    """Give the calling thread 1 us of timer slack (once per thread)."""
    if getattr(_local, "done", False):
        return
    _local.done = True
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_TIMERSLACK, 1000, 0, 0, 0)
    except (OSError, AttributeError):
        pass

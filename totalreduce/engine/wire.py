"""Op names on the wire: the 64-bit id every frame carries for its op.

The frames themselves (their header, types and fields) are declared in
:mod:`totalreduce.protocol` and written and read by the compiled lane; the control
frames Python sends go through :meth:`~.control.ControlFrames.send`.
"""

from __future__ import annotations

import functools
import hashlib

from ..protocol import F_PRIO

__all__ = ["SESSION_ID", "priority_of", "wire_id"]


@functools.lru_cache(maxsize=65536, typed=True)
def wire_id(name: str | int) -> int:
    """Stable 64-bit id of an op name: the same on every rank, no coordination.

    >>> wire_id("fc1.grad") == wire_id("fc1.grad")
    True
    """
    if isinstance(name, bool) or not isinstance(name, (str, int)):
        raise TypeError(f"op names are str or int, got {type(name).__name__} {name!r}")
    raw = (b"s:" + name.encode()) if isinstance(name, str) else b"i:%d" % name
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little")


#: Daemon mode: the op by which a job's clients agree on their session at start.  Every
#: job starts with it, so no rank keeps a memory of it (see Failures.done).
SESSION_ID = wire_id("\0totalreduce session")


def priority_of(f: tuple[int, ...]) -> int:
    """The op priority an unpacked frame carries (a signed 32-bit value)."""
    v = f[F_PRIO]
    return v - (1 << 32) if v >= 1 << 31 else v

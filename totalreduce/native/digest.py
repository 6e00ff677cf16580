"""The digest of source files that tells when compiled code cached on disk is stale.

Numba checks a cached function against its own file only; code that compiles in
functions of other files (``lane/lane_cache.py``, ``transport/local_calls.py``) keeps a
digest of all of them beside its cache and drops the cache when it changes.  Plain
Python: nothing here compiles.
"""

from __future__ import annotations

import hashlib
from pathlib import Path


def sources_digest(sources: tuple[str, ...]) -> str:
    """A digest of ``sources`` (paths under the package) as they are now."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for rel in sources:
        h.update(rel.encode() + b"\0")
        h.update((root / rel).read_bytes())
    return h.hexdigest()

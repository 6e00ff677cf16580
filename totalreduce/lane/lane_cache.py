"""The compiled lane's Numba cache, kept consistent with every source the lane inlines.

Numba checks a cached function against its own file only; the lane's code inlines the
kernels, the MPI binding and libc calls from other modules.  :func:`forget_stale_cache`
keeps a digest of all of them beside the cache and drops the cached code of every module
involved when any changed (an edited checkout, a partial upgrade).
"""

from __future__ import annotations

from typing import Any

from ..native import digest

#: The sources the lane's machine code is made of (paths under the package).  Numba
#: checks a cached function against its own file only, and the lane inlines functions
#: of all of these: :func:`forget_stale_cache` covers the rest.
SOURCES = (
    "lane/lane_cache.py",  # these rules: a change to them flushes too
    "lane/lane_core.py",
    "lane/lane_receive.py",
    "lane/lane_bodies.py",
    "lane/lane_progress.py",
    "lane/lane_tables.py",
    "protocol.py",
    "kernels/raw.py",
    "kernels/numba_kernels.py",
    "transport/mpi_native.py",
    "native/intrinsics.py",
    "native/libc.py",
)
#: The modules whose cached functions are flushed together: every one of :data:`SOURCES`.
#: A module left out keeps machine code that inlined an old version of the others (a
#: cached ``lane_bodies`` function with an old outbox layout wrote its answers where the
#: outboxes no longer were, and peers refused the messages).
_CACHED = tuple(rel[: -len(".py")].replace("/", ".") for rel in SOURCES)


def sources_digest(sources: tuple[str, ...] = SOURCES) -> str:
    """A digest of ``sources`` (paths under the package) as they are now."""
    return digest.sources_digest(sources)


def cache_is_current(
    probe: Any, sources: tuple[str, ...] = SOURCES, stamp_name: str = "lane_core.sources"
) -> bool:
    """Whether the lane's cached code (``probe``'s cache directory) was made from
    ``sources`` as they are now: read only, so any process may ask, while only the holder
    of the compile lock (:mod:`.compile_once`) calls :func:`forget_stale_cache`.  False
    where no digest was written yet (a fresh cache) or Numba gave no cache directory."""
    from pathlib import Path

    path = getattr(getattr(probe, "_cache", None), "cache_path", None)
    if not path:
        return False
    try:
        return (Path(path) / stamp_name).read_text() == sources_digest(sources)
    except OSError:
        return False


def forget_stale_cache(
    probe: Any,
    sources: tuple[str, ...] = SOURCES,
    modules: tuple[str, ...] = _CACHED,
    stamp_name: str = "lane_core.sources",
) -> bool:
    """Drop Numba's cached code of the lane when any of its sources changed since it was
    cached (an edited or partly upgraded installation): otherwise a function whose own file
    is unchanged would be loaded with the old code of what it inlines.  ``probe`` is one of
    the lane's functions (its cache directory is the lane's).  True if dropped.  The lane
    calls it only under the exclusive compile lock (:func:`.lane_core.compile_all`), so no
    other process is loading the files it drops.

    Other compiled code that inlines functions of other modules (the daemon's arena pass)
    passes its own ``sources``, the ``modules`` (dotted, under the package) to flush, and
    the name of its digest file."""
    import importlib
    from pathlib import Path

    from numba.core.registry import CPUDispatcher

    cache = getattr(probe, "_cache", None)  # a lane function: where its cache lives
    path = getattr(cache, "cache_path", None)
    if not path:
        return False
    stamp = Path(path) / stamp_name
    digest = sources_digest(sources)
    try:
        if stamp.read_text() == digest:
            return False
    except OSError:
        pass
    package = __name__.rsplit(".", 2)[0]  # totalreduce
    for name in modules:
        mod = importlib.import_module(f"{package}.{name}")
        for obj in vars(mod).values():
            cached = getattr(obj, "_cache", None) if isinstance(obj, CPUDispatcher) else None
            if cached is not None:
                cached.flush()
    try:
        stamp.parent.mkdir(parents=True, exist_ok=True)
        stamp.write_text(digest)
    except OSError:  # an unwritable cache: Numba compiles in memory each time anyway
        pass
    return True

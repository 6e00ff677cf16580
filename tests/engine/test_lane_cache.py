"""The lane's Numba cache is dropped when any source its code inlines changed (Numba itself
checks a cached function against its own file only)."""

from __future__ import annotations

from pathlib import Path

import pytest
from numba.core import caching

from totalreduce.lane import lane_cache, lane_core


def test_a_changed_source_drops_every_cached_lane_function(monkeypatch) -> None:
    flushed: list[str] = []
    monkeypatch.setattr(
        caching.FunctionCache, "flush", lambda self: flushed.append(self._name), raising=True
    )
    path = getattr(getattr(lane_core.lane_pass, "_cache", None), "cache_path", None)
    if not path:
        pytest.skip("Numba gave the lane no cache directory here")
    stamp = Path(path) / "lane_core.sources"
    stamp.parent.mkdir(parents=True, exist_ok=True)
    stamp.write_text("the digest of an older kernels/raw.py")
    assert lane_cache.forget_stale_cache(lane_core.lane_pass) is True
    names = " ".join(flushed)
    for fn in (
        "lane_pass", "lane_submit", "lane_drive", "reduce_raw", "mpi_isend",
        "_send_readies",  # lane_bodies: its cached code inlines lane_tables' outboxes
        "_consume",  # lane_receive
    ):  # fmt: skip
        assert fn in names, names
    assert stamp.read_text() == lane_cache.sources_digest()
    flushed.clear()
    # now current: nothing dropped
    assert lane_cache.forget_stale_cache(lane_core.lane_pass) is False
    assert not flushed


def test_the_digest_covers_every_source_the_lane_inlines() -> None:
    root = Path(lane_core.__file__).resolve().parents[1]
    for rel in lane_cache.SOURCES:
        assert (root / rel).is_file(), rel
    imported = {"kernels/raw.py", "native/intrinsics.py", "native/libc.py"}
    imported.add("transport/mpi_native.py")
    assert imported <= set(lane_cache.SOURCES)
    assert len(lane_cache.sources_digest()) == 64


def test_every_module_with_cached_lane_code_is_flushed() -> None:
    """Each module under lane/, kernels/, native/ and transport/ whose compiled
    functions the lane calls is both digested and flushed."""
    import importlib

    from numba.core.registry import CPUDispatcher

    root = Path(lane_core.__file__).resolve().parents[1]
    for path in sorted((root / "lane").glob("*.py")):
        if path.name == "__init__.py":
            continue
        rel = f"lane/{path.name}"
        mod = importlib.import_module(f"totalreduce.lane.{path.stem}")
        cached = [
            o for o in vars(mod).values()
            if isinstance(o, CPUDispatcher) and getattr(o, "_cache", None) is not None
            and o.__module__ == mod.__name__
        ]  # fmt: skip
        if cached and path.name == "lane_service.py":  # the node service's loop's code
            from totalreduce.daemon import service_loop

            assert rel in service_loop.SOURCES and "lane.lane_service" in service_loop._MODULES
        elif cached:
            assert rel in lane_cache.SOURCES, rel
            assert rel[:-3].replace("/", ".") in lane_cache._CACHED, rel

"""Window ops on numpy arrays: one-sided put, get and accumulate (BlueFog's names).

::

    x = np.zeros(1000)
    tr.win_create(x, "x", topology="ring")          # collective: every rank, same size
    h = tr.win_put_nonblocking(x, "x")              # into each out-neighbour's slot for me
    tr.win_wait(h)
    y = tr.win_update("x")                          # x = average of x and the slots, in place
    tr.win_free("x")                                # collective among neighbours

The neighbours call nothing for a put, get or accumulate to land: their engine
receives it on its own (:mod:`totalreduce.service.windows` says how).  A put
that completed has landed: after a barrier, the target's ``win_update`` sees it.
Arrivals apply atomically with respect to this rank's ``win_update``, so
``require_mutex`` (accepted everywhere BlueFog has it) always holds.  The torch
forms are in :mod:`totalreduce.torch.windows` (``import totalreduce.torch as bf``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np

from .api import default_service
from .service.windows import WinHandle

__all__ = [
    "WinHandle",
    "get_win_version",
    "turn_off_win_ops_with_associated_p",
    "turn_on_win_ops_with_associated_p",
    "win_accumulate",
    "win_accumulate_nonblocking",
    "win_associated_p",
    "win_create",
    "win_free",
    "win_get",
    "win_get_nonblocking",
    "win_mutex",
    "win_poll",
    "win_put",
    "win_put_nonblocking",
    "win_update",
    "win_update_then_collect",
    "win_wait",
]


def _windows() -> Any:
    return default_service().windows


def win_create(
    x: Any, name: str, zero_init: bool = False, *, topology: Any = None, dtype: str | None = None
) -> bool:
    """Make ``x`` this rank's array of window ``name`` (collective: every rank, same size
    and dtype, floating).  Each in-neighbour of ``topology`` (default ``exponential-2``)
    gets a slot here, zero with ``zero_init``, else a copy of ``x``.  Returns True."""
    return bool(_windows().create(x, name, zero_init, topology, dtype))


def win_free(name: str | None = None, timeout: float | None = None) -> bool:
    """Free window ``name`` (every window if None); collective among neighbours."""
    return bool(_windows().free(name, timeout))


def win_put_nonblocking(
    x: Any,
    name: str,
    self_weight: float | None = None,
    dst_weights: Any = None,
    require_mutex: bool = False,
) -> WinHandle:
    """Start writing ``x`` (times each weight; ``dst_weights`` maps out-neighbours to
    weights, default all with 1.0) into the out-neighbours' slots for this rank; with
    ``self_weight``, ``x`` is then scaled in place.  ``require_mutex``: always holds."""
    del require_mutex
    return _windows().put_async(x, name, self_weight, dst_weights)  # type: ignore[no-any-return]


def win_put(
    x: Any,
    name: str,
    self_weight: float | None = None,
    dst_weights: Any = None,
    require_mutex: bool = False,
) -> bool:
    """Blocking :func:`win_put_nonblocking`: True once every put landed."""
    return win_put_nonblocking(x, name, self_weight, dst_weights, require_mutex).wait()


def win_accumulate_nonblocking(
    x: Any,
    name: str,
    self_weight: float | None = None,
    dst_weights: Any = None,
    require_mutex: bool = False,
) -> WinHandle:
    """As :func:`win_put_nonblocking`, but adds into the slots instead of overwriting."""
    del require_mutex
    return _windows().put_async(  # type: ignore[no-any-return]
        x, name, self_weight, dst_weights, accumulate=True
    )


def win_accumulate(
    x: Any,
    name: str,
    self_weight: float | None = None,
    dst_weights: Any = None,
    require_mutex: bool = False,
) -> bool:
    """Blocking :func:`win_accumulate_nonblocking`."""
    return win_accumulate_nonblocking(x, name, self_weight, dst_weights, require_mutex).wait()


def win_get_nonblocking(
    name: str, src_weights: Any = None, require_mutex: bool = False
) -> WinHandle:
    """Start reading the in-neighbours' arrays (times each weight in ``src_weights``,
    default all in-neighbours with 1.0) into this rank's slots for them."""
    del require_mutex
    return _windows().get_async(name, src_weights)  # type: ignore[no-any-return]


def win_get(name: str, src_weights: Any = None, require_mutex: bool = False) -> bool:
    """Blocking :func:`win_get_nonblocking`."""
    return win_get_nonblocking(name, src_weights, require_mutex).wait()


def win_update(
    name: str,
    self_weight: float | None = None,
    neighbor_weights: Any = None,
    reset: bool = False,
    clone: bool = False,
    require_mutex: bool = False,
) -> np.ndarray:
    """``self_weight * x + sum(w * slot)`` over ``neighbor_weights`` (default: the plain
    average of ``x`` and every slot), written into ``x`` (a new array with ``clone``);
    ``reset`` zeroes the slots read.  Returns the result in ``x``'s shape."""
    del require_mutex
    return _windows().update(  # type: ignore[no-any-return]
        name, self_weight, neighbor_weights, reset, clone
    )


def win_update_then_collect(name: str, require_mutex: bool = True) -> np.ndarray:
    """Push-sum's collect: ``x += sum(slots)``, slots reset to zero."""
    del require_mutex
    return _windows().update_then_collect(name)  # type: ignore[no-any-return]


def win_poll(handle: WinHandle) -> bool:
    """True once the window transfer ``handle`` is done (never blocks)."""
    return handle.done()


def win_wait(handle: WinHandle, timeout: float | None = None) -> bool:
    """Block until the window transfer ``handle`` is done; True."""
    return handle.wait(timeout)


@contextlib.contextmanager
def win_mutex(name: str, for_self: bool = False, ranks: Any = None) -> Iterator[None]:
    """Hold window ``name``.  ``for_self``: this rank's, so no arrival applies to it until
    the block ends.  Other ranks' windows need no holding: puts and accumulates apply
    there atomically, one at a time (what BlueFog takes their mutex for)."""
    del ranks
    if for_self:
        with _windows().mutex(name):
            yield
    else:
        _windows().window(name, f"win_mutex({name!r})")  # it must exist
        yield


def get_win_version(name: str) -> dict[int, int]:
    """Per in-neighbour: puts, accumulates and replies applied since the last update."""
    return _windows().version(name)  # type: ignore[no-any-return]


def win_associated_p(name: str) -> float:
    """The scalar that travels with window ``name``'s puts and accumulates (push-sum)."""
    return float(_windows().p(name))


def turn_on_win_ops_with_associated_p() -> None:
    """Scale and combine each window's associated ``p`` with its array (push-sum)."""
    _windows().associated_p = True


def turn_off_win_ops_with_associated_p() -> None:
    """Leave the associated ``p`` alone (the default)."""
    _windows().associated_p = False

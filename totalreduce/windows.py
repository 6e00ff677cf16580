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
``require_mutex`` (accepted everywhere BlueFog has it) always holds.

Each op is declared once, in ``WINDOW_OPS`` of :mod:`totalreduce.window_table`; the
functions here and the torch ones (:mod:`totalreduce.torch.windows`) are built
from those records.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .api import default_service
from .declare import WinDecl, build_function, signature
from .service.windows import WinHandle
from .window_table import WINDOW_OPS, window_op

#: Every window op's functions (from WINDOW_OPS), the handle and the handle utilities.
__all__ = ["WinHandle", "win_poll", "win_wait"] + [
    f"{d.name}{suffix}"
    for d in WINDOW_OPS
    for suffix in (("", "_nonblocking") if d.nonblocking else ("",))
]


def _windows() -> Any:
    return default_service().windows


def _build(d: WinDecl, name: str, body: str, returns: str, doc: str, form: str) -> Any:
    return build_function(
        name, signature(d.numpy_params(), returns=returns), body, {"_windows": _windows},
        doc=doc, module=__name__, declared=(d.name, form),
    )  # fmt: skip


def _plain(op: str) -> Callable[..., Any]:
    """The one function of window op ``op`` (see ``WINDOW_OPS``)."""
    d = window_op(op)
    return _build(d, d.name, f"return _windows().{d.call}", d.returns, d.doc, "window")  # type: ignore[no-any-return]


def _nonblocking(op: str) -> tuple[Callable[..., WinHandle], Callable[..., bool]]:
    """``{op}_nonblocking`` (the transfer's handle) and ``{op}`` (waits for it: True)."""
    d = window_op(op)
    call = f"_windows().{d.call}"
    start = _build(d, f"{d.name}_nonblocking", f"return {call}", "WinHandle",
                   f"Start: {d.doc}\n\n        Returns the transfer's handle (``win_wait``).",
                   "window nonblocking")  # fmt: skip
    done = f"{d.doc}\n\n        Blocks until done (a put: landed); True."
    wait = _build(d, d.name, f"return {call}.wait()", d.returns, done, "window")
    return start, wait


win_create = _plain("win_create")
win_free = _plain("win_free")
win_put_nonblocking, win_put = _nonblocking("win_put")
win_accumulate_nonblocking, win_accumulate = _nonblocking("win_accumulate")
win_get_nonblocking, win_get = _nonblocking("win_get")
win_update = _plain("win_update")
win_update_then_collect = _plain("win_update_then_collect")
win_mutex = _plain("win_mutex")
get_win_version = _plain("get_win_version")
win_associated_p = _plain("win_associated_p")
turn_on_win_ops_with_associated_p = _plain("turn_on_win_ops_with_associated_p")
turn_off_win_ops_with_associated_p = _plain("turn_off_win_ops_with_associated_p")


def win_poll(handle: WinHandle) -> bool:
    """True once the window transfer ``handle`` is done (never blocks)."""
    return handle.done()


def win_wait(handle: WinHandle, timeout: float | None = None) -> bool:
    """Block until the window transfer ``handle`` is done; True."""
    handle.wait(timeout)
    return True

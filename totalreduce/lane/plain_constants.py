"""Compiling a jitted function once per argument types, not once per constant it is called with.

Numba compiles a jitted function for the types of its arguments, and a constant passed from
other jitted code has a type of its own (``Literal[int](4)``): every distinct constant is one
more specialization, typed, optimized, turned into machine code and cached on its own.  The
lane calls its helpers with constants everywhere (``_event(mem, arena, EV_MPI, -1, ...)``),
so its first compile made 170 specializations, 48 of them for constants: 28 of ``_event``,
and a second whole ``lane_pass`` for the constant budget ``_drive`` passes it.  LLVM folds
the constants into the inlined calls anyway, so the extra specializations buy nothing.

:func:`plain_constants` types integer and boolean constants as ``int64`` and ``bool`` in the
calls between jitted functions that the calling thread compiles while it holds it
(``lane_core.compile_all``): 122 specializations instead of 170.  Measured on the 2-core
machine with an empty cache, the lane's compile took 64.1-64.5 s of CPU as Numba types it,
45.4-51.8 s so; a 4 KiB allreduce took the same time either way (``bench --latency``).
A call that does not type so (a callee that needs its argument's value while compiling, as
``numba.literally`` asks) is typed with the constants, as Numba alone would.  Other threads,
and this one outside the block, are not affected.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from numba.core import errors, types
from numba.core.types import functions

_state = threading.local()
_install_lock = threading.Lock()


def _plain(t: Any) -> Any:
    if isinstance(t, (types.IntegerLiteral, types.BooleanLiteral)):
        return types.unliteral(t)
    return t


def _install() -> None:
    """Wrap the typing of calls to jitted functions, once per process (it does nothing
    unless the calling thread is inside :func:`plain_constants`)."""
    with _install_lock:
        original = functions.Dispatcher.get_call_type
        if getattr(original, "plain_constants", False):
            return

        def get_call_type(self: Any, context: Any, args: Any, kws: Any) -> Any:
            if getattr(_state, "depth", 0):
                plain = tuple(_plain(a) for a in args)
                plain_kws = {k: _plain(v) for k, v in kws.items()}
                if plain != tuple(args) or plain_kws != kws:
                    try:
                        return original(self, context, plain, plain_kws)
                    except (errors.TypingError, errors.ForceLiteralArg):
                        pass  # it needs the constants (numba.literally): as Numba types it
            return original(self, context, args, kws)

        get_call_type.plain_constants = True  # type: ignore[attr-defined]
        functions.Dispatcher.get_call_type = get_call_type  # type: ignore[method-assign]


@contextmanager
def plain_constants() -> Iterator[None]:
    """While in this block, calls between jitted functions that this thread compiles pass
    integer and boolean constants as ``int64`` and ``bool``: one specialization per
    argument types, not one per constant.

    >>> with plain_constants():
    ...     lane_pass.compile(signature)  # doctest: +SKIP
    """
    _install()
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1

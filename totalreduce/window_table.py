"""The window ops (BlueFog's one-sided ``win_*`` ops), each declared once: the table
:mod:`totalreduce.windows` and :mod:`totalreduce.torch.windows` build their functions from.

One :class:`~totalreduce.declare.WinDecl` per op says its parameters, the call of the
service's windows it makes, what it returns and whether it has a ``_nonblocking`` form
(``tests/test_window_declarations.py`` checks both modules against the table).  The
collectives' table is :mod:`totalreduce.ops_table`, which re-exports this one's names.

Pure: no torch, no numpy, no MPI (``import totalreduce`` never imports torch).
"""

from __future__ import annotations

from .declare import Form, Kind, Param, WinDecl

__all__ = ["WINDOW_OPS", "window_op"]

WIN_NAME = Param("name", Kind.NAME, annotation="str")
WIN_X = Param("x", Kind.INPUT)
SELF_WEIGHT = Param("self_weight", Kind.WEIGHTS, None, annotation="float")
DST_WEIGHTS = Param("dst_weights", Kind.SEND_WEIGHTS, None)
SRC_WEIGHTS = Param("src_weights", Kind.WEIGHTS, None)
# BlueFog's: arrivals apply atomically, one at a time, so the mutex always holds.
REQUIRE_MUTEX = Param("require_mutex", Kind.UNUSED, False, annotation="bool")
NUMPY_ONLY: frozenset[Form] = frozenset()

_PUT_DOC = """Write ``{x}`` times each weight of ``dst_weights`` (out-neighbour -> weight,
default every out-neighbour with 1.0) into the out-neighbours' slots for this rank;
with ``self_weight``, ``{x}`` is then scaled in place (and the associated ``p``).
``require_mutex`` is accepted and always holds."""

WINDOW_OPS: tuple[WinDecl, ...] = (
    WinDecl(
        "win_create",
        (
            WIN_X,
            WIN_NAME,
            Param("zero_init", Kind.FLAT, False, annotation="bool"),
            Param("topology", Kind.TOPOLOGY, None, keyword_only=True, forms=NUMPY_ONLY),
            Param("dtype", Kind.DTYPE, None, keyword_only=True, forms=NUMPY_ONLY),
        ),
        "create(x, name, zero_init, topology, dtype)",
        "bool",
        """Make ``x`` this rank's array of window ``name`` (collective: every rank, the same
        size and floating dtype).  Each in-neighbour of the topology (numpy: ``topology=``,
        default ``exponential-2``; torch: ``set_topology``'s) gets a slot here: zero with
        ``zero_init``, else a copy of ``x``.  The torch form's tensor must be a contiguous
        CPU tensor: the window is its memory.  Returns True.""",
        torch_body="return _create(tensor, name, zero_init)",
    ),
    WinDecl(
        "win_free",
        (
            Param("name", Kind.NAME, None, annotation="str"),
            Param("timeout", Kind.COUNT, None, annotation="float", forms=NUMPY_ONLY),
        ),
        "free(name, timeout)",
        "bool",
        "Free window ``name`` (every window if None); collective among neighbours.",
        torch_body="return _free(name)",
    ),
    WinDecl(
        "win_put",
        (WIN_X, WIN_NAME, SELF_WEIGHT, DST_WEIGHTS, REQUIRE_MUTEX),
        "put_async(x, name, self_weight, dst_weights)",
        "bool",
        _PUT_DOC.format(x="x"),
        nonblocking=True,
    ),
    WinDecl(
        "win_accumulate",
        (WIN_X, WIN_NAME, SELF_WEIGHT, DST_WEIGHTS, REQUIRE_MUTEX),
        "put_async(x, name, self_weight, dst_weights, accumulate=True)",
        "bool",
        "As ``win_put``, but adds into the slots instead of overwriting them.",
        nonblocking=True,
    ),
    WinDecl(
        "win_get",
        (WIN_NAME, SRC_WEIGHTS, REQUIRE_MUTEX),
        "get_async(name, src_weights)",
        "bool",
        """Read the in-neighbours' arrays (times each weight of ``src_weights``, default
        every in-neighbour with 1.0) into this rank's slots for them.""",
        nonblocking=True,
    ),
    WinDecl(
        "win_update",
        (
            WIN_NAME,
            SELF_WEIGHT,
            Param("neighbor_weights", Kind.WEIGHTS, None),
            Param("reset", Kind.FLAT, False, annotation="bool"),
            Param("clone", Kind.FLAT, False, annotation="bool"),
            REQUIRE_MUTEX,
        ),
        "update(name, self_weight, neighbor_weights, reset, clone)",
        "np.ndarray",
        """``self_weight * x + sum(w * slot)`` over ``neighbor_weights`` (default: the plain
        average of ``x`` and every slot; torch: the topology's weights after
        ``set_topology(..., is_weighted=True)``), written into the window's array (a new
        one with ``clone``), which is returned; ``reset`` zeroes the slots read.""",
        torch_body="return _update(name, self_weight, neighbor_weights, reset, clone)",
        torch_returns="torch.Tensor",
    ),
    WinDecl(
        "win_update_then_collect",
        (WIN_NAME, REQUIRE_MUTEX.but(default=True)),
        "update_then_collect(name)",
        "np.ndarray",
        "Push-sum's collect: ``x += sum(slots)``, the slots reset to zero; returns ``x``.",
        torch_body="return _collect(name)",
        torch_returns="torch.Tensor",
    ),
    WinDecl(
        "win_mutex",
        (
            WIN_NAME,
            Param("for_self", Kind.FLAT, False, annotation="bool"),
            Param("ranks", Kind.RANKS, None),
        ),
        "hold(name, for_self)",
        "ContextManager[None]",
        """Hold window ``name`` for a ``with`` block.  ``for_self``: this rank's, so no
        arrival applies to it until the block ends.  Other ranks' windows need no holding:
        puts and accumulates apply there atomically, one at a time (what BlueFog takes
        their mutex for), so ``ranks`` changes nothing.""",
    ),
    WinDecl(
        "get_win_version",
        (WIN_NAME,),
        "version(name)",
        "dict[int, int]",
        "Per in-neighbour: the puts, accumulates and replies applied since the last update.",
    ),
    WinDecl(
        "win_associated_p",
        (WIN_NAME,),
        "p(name)",
        "float",
        "The scalar that travels with window ``name``'s puts and accumulates (push-sum).",
    ),
    WinDecl(
        "turn_on_win_ops_with_associated_p",
        (),
        "set_associated_p(True)",
        "None",
        "Scale and combine each window's associated ``p`` with its array (push-sum).",
    ),
    WinDecl(
        "turn_off_win_ops_with_associated_p",
        (),
        "set_associated_p(False)",
        "None",
        "Leave the associated ``p`` alone (the default).",
    ),
)

_WIN_BY_NAME = {d.name: d for d in WINDOW_OPS}


def window_op(name: str) -> WinDecl:
    """The record of window op ``name``."""
    return _WIN_BY_NAME[name]

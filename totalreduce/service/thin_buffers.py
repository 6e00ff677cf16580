"""A daemon client's buffers in its part of the node's arena.

:class:`ThinBuffers` is the base of :class:`~.thin.ThinClient` that places an op's
buffers (:mod:`.thin` says how the thin path works): arrays made in the arena
(``empty``: an op on one takes no copy; ``empty_if_room``, for a cache of buffers such
as the DDP comm hook's, only while the part stays half free), staging blocks for the
others (``place``, ``stage``), the int64 blocks of a group's ranks or an op's parts,
kept for the next op that has them (``const_block``), and the backpressure of a full
part: a block that does not fit waits for the oldest op in flight to end and give its
blocks back.
What it uses of :class:`~.thin.ThinClient` is declared below as annotations; it does
not import :mod:`.thin`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import InvalidArgumentError
from ..transport import arena as A

log = logging.getLogger("totalreduce.thin")

#: How many groups' ranks and ops' parts a client keeps in the arena for its next ops.
CONSTS = 1024


class ThinBuffers:
    """Where a client's ops' buffers go in the arena (see the module docstring)."""

    # the state, made by ThinClient.__init__
    arena: Any  # transport.arena.Arena
    space: A.Allocator
    rank: int
    _consts: dict[tuple[int, ...], int]

    # provided by ThinClient
    _oldest: Callable[[], Any]  # the oldest op in flight that is sure to end, or None
    block: Callable[[Any, float | None], None]  # until that op is done

    def takes(self, nbytes: int) -> bool:
        """Whether an op of ``nbytes`` can be staged here (else, unless it is one that is
        cut into pieces, it goes the engine's way)."""
        return nbytes <= self.arena.data_bytes // 2

    def pieces(self, nbytes: int) -> int:
        """How many thin ops an op of ``nbytes`` (a size all its ranks know) runs as: one
        that half a client's part takes, else pieces of at most an eighth part."""
        if self.takes(nbytes):
            return 1
        return -(-nbytes // max(self.arena.data_bytes // 8, 1))

    def empty(self, shape: Any, dtype: Any) -> np.ndarray:
        """A new array in this client's part of the arena (its ops then take no copy)."""
        dt = np.dtype(dtype)
        shp = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(shape)
        n = int(np.prod(shp, dtype=np.int64)) * dt.itemsize
        return self._array_at(self._alloc(max(n, dt.itemsize), None), n, dt).reshape(shp)

    def empty_if_room(self, count: int, dtype: Any) -> np.ndarray | None:
        """A new flat array of ``count`` elements in this client's part of the arena if
        that part stays at most half used (staging keeps the other half); None if not.
        Never waits: a cache of buffers (the DDP comm hook's) asks, and copies otherwise."""
        dt = np.dtype(dtype)
        n = count * dt.itemsize
        if self.space.used_bytes + max(n, dt.itemsize) > self.arena.data_bytes // 2:
            return None
        at = self.space.alloc(max(n, dt.itemsize))
        if at >= 0 and n >= A.HUGE_BYTES:
            self.arena.make_huge(at, n)
        return None if at < 0 else self._array_at(at, n, dt)

    def _array_at(self, at: int, nbytes: int, dt: np.dtype) -> np.ndarray:
        """The flat array of ``nbytes`` at arena offset ``at`` (its block, freed when the
        last array over it goes)."""
        raw = self.arena.view(at, max(nbytes, dt.itemsize), np.uint8)
        whole = np.asarray(_Owner(raw, _Block(self.space, at))).view(dt)
        return whole[: nbytes // dt.itemsize]

    def _alloc(self, nbytes: int, what: str | None) -> int:
        """A block of ``nbytes`` (waiting for room); a large one on huge pages."""
        at = self._alloc_block(nbytes, what)
        if nbytes >= A.HUGE_BYTES:
            self.arena.make_huge(at, nbytes)
        return at

    def _alloc_block(self, nbytes: int, what: str | None) -> int:
        at = self.space.alloc(nbytes)
        if at >= 0:
            return at
        if nbytes > self.arena.data_bytes:
            raise InvalidArgumentError(
                f"{nbytes} bytes do not fit this client's {self.arena.data_bytes} bytes of the "
                "node's arena (start the service with a larger --arena-bytes)"
            )
        t0 = time.monotonic()
        warned = False
        while (at := self.space.alloc(nbytes)) < 0:  # backpressure: ops in flight give back
            oldest = self._oldest()
            if oldest is None:
                time.sleep(0.001)  # arrays of tr.empty() hold it: wait for the collector
            else:
                self.block(oldest, None)
            if not warned and time.monotonic() - t0 > 10:
                warned = True
                log.warning(
                    "rank %d: %s waits for %d bytes of the arena (%d of %d in use) for 10 s",
                    self.rank, what or "an array", nbytes, self.space.used_bytes,
                    self.arena.data_bytes,
                )  # fmt: skip
        return at

    def const_block(self, values: tuple[int, ...]) -> tuple[int, int]:
        """(arena offset, block to free or -1) of ``values`` as int64 words (a group's ranks,
        an op's parts): kept for the next op that has them, up to :data:`CONSTS` of them."""
        at = self._consts.get(values)
        if at is not None:
            return at, -1
        at = self._alloc(8 * max(len(values), 1), "a group or parts block")
        self.arena.view(at, len(values), np.dtype(np.int64))[:] = values
        if len(self._consts) < CONSTS:
            self._consts[values] = at
            return at, -1
        return at, at

    def kept_at(self, values: tuple[int, ...]) -> int:
        """The arena offset of the block :meth:`const_block` keeps of ``values``, -1 if it
        keeps none (it did not have room for it)."""
        return self._consts.get(values, -1)

    def kept_block(self, at: int) -> tuple[int, ...] | None:
        """The values of the block :meth:`const_block` keeps at arena offset ``at`` (an
        op's parts: ``(n, part, ...)``, the parts returned), None if it keeps none there
        (a look through the kept blocks: once per record that asks)."""
        for values, where in self._consts.items():
            if where == at:
                return values[1:]
        return None

    def stage(self, nbytes: int, fill: np.ndarray | None) -> int:
        """A staging block of ``nbytes``, filled from ``fill`` (an array of as many bytes)
        unless that is None: its offset."""
        at = self._alloc(nbytes, "a staging copy")
        if fill is not None and fill.nbytes:
            self.arena.view(at, fill.nbytes, np.uint8)[:] = fill.reshape(-1).view(np.uint8)
        return at

    def place(self, arr: np.ndarray, fill: np.ndarray | None) -> tuple[int, int]:
        """(arena offset of ``arr``'s bytes, staging offset or -1): ``arr`` itself if it
        lives in the arena, else a staging block of its size, filled from ``fill`` (an
        array of as many bytes) unless that is None."""
        if arr.flags.c_contiguous:
            at = self.arena.offset_of(arr)
            if at >= 0:
                return at, -1
        at = self.stage(arr.nbytes, fill)
        return at, at


class _Block:
    """Gives an arena block back when the last array over it goes."""

    __slots__ = ("space", "at", "__weakref__")

    def __init__(self, space: A.Allocator, at: int) -> None:
        self.space, self.at = space, at

    def __del__(self) -> None:
        try:
            self.space.free(self.at)
        except Exception:  # interpreter teardown
            pass


class _Owner:
    """The buffer of an arena array; it holds its block (numpy keeps it as the base)."""

    __slots__ = ("raw", "keeper", "__array_interface__")

    def __init__(self, raw: np.ndarray, keeper: _Block) -> None:
        self.raw, self.keeper = raw, keeper
        self.__array_interface__ = raw.__array_interface__

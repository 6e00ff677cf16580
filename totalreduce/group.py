"""Groups of ranks and Cartesian partitions: the subsets of ranks an op can run over.

A :class:`Group` is an ordered tuple of world ranks; an op over a group uses
group ranks ``0 .. len-1`` in its schedule (and for a broadcast root), and
ranks outside the group are not involved.  Its ``context`` (a stable hash of
the ranks) travels in every frame, so two ranks that disagree on the group of
an op get an error naming both groups.

A :class:`Partition` lays a Cartesian grid over a group (row-major: the last
coordinate varies fastest), as DistDL's partitions do; ``axis_group`` is the
set of ranks that differ only along one dimension, the ranks a
reduce-scatter or all-gather along that dimension runs over.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterable, Sequence

from .errors import InvalidArgumentError, NotInitializedError


def _no_service() -> int:
    raise NotInitializedError("call totalreduce.init() first")


#: This process's rank in the default service, for ``Partition.active`` and ``.coords``.
#: The API module (which sits above this one) installs it with :func:`set_rank_source`.
_rank_source: Callable[[], int] = _no_service


def set_rank_source(source: Callable[[], int]) -> None:
    """Where ``Partition.active`` and ``Partition.coords`` read this process's rank."""
    global _rank_source
    _rank_source = source


class Group:
    """An ordered set of world ranks.

    >>> g = Group([4, 2, 7])
    >>> g.size, g.rank_of(2), g.rank_of(5)
    (3, 1, None)
    """

    __slots__ = ("ranks", "_index", "context")

    def __init__(self, ranks: Iterable[int]) -> None:
        rs = tuple(int(r) for r in ranks)
        if not rs:
            raise InvalidArgumentError("a group needs at least one rank")
        if any(r < 0 for r in rs):
            raise InvalidArgumentError(f"group ranks must be >= 0, got {list(rs)}")
        if len(set(rs)) != len(rs):
            raise InvalidArgumentError(f"group ranks repeat: {list(rs)}")
        self.ranks = rs
        self._index = {r: i for i, r in enumerate(rs)}
        raw = b"group:" + ",".join(map(str, rs)).encode()
        self.context = int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little")

    @classmethod
    def world(cls, size: int) -> Group:
        return cls(range(size))

    @property
    def size(self) -> int:
        return len(self.ranks)

    def rank_of(self, world_rank: int) -> int | None:
        """This world rank's rank in the group, or None if it is not a member."""
        return self._index.get(world_rank)

    def __contains__(self, world_rank: object) -> bool:
        return world_rank in self._index

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Group) and other.ranks == self.ranks

    def __hash__(self) -> int:
        return hash(self.ranks)

    def __repr__(self) -> str:
        return f"Group({list(self.ranks)})"


class Partition:
    """A Cartesian grid of ``shape`` over the first ``prod(shape)`` ranks of a group.

    ``group`` defaults to the world's first ``prod(shape)`` ranks.  Ranks of
    the world outside it are inactive: collectives over the partition return
    them a zero-volume array without involving them.

    >>> p = Partition((2, 3))
    >>> p.coords_of(4), p.axis_group(4, 0).ranks, p.axis_group(4, 1).ranks
    ((1, 1), (1, 4), (3, 4, 5))
    """

    __slots__ = ("shape", "ranks", "_index")

    def __init__(self, shape: Sequence[int], group: Group | None = None) -> None:
        dims = tuple(int(d) for d in shape)
        if not dims or any(d < 1 for d in dims):
            raise InvalidArgumentError(f"partition shape must be positive integers, got {shape}")
        need = math.prod(dims)
        ranks = tuple(range(need)) if group is None else group.ranks
        if len(ranks) < need:
            raise InvalidArgumentError(
                f"partition {dims} needs {need} ranks, the group has {len(ranks)}"
            )
        self.shape = dims
        self.ranks = ranks[:need]
        self._index = {r: i for i, r in enumerate(self.ranks)}

    @property
    def size(self) -> int:
        return len(self.ranks)

    def is_active(self, world_rank: int) -> bool:
        return world_rank in self._index

    def coords_of(self, world_rank: int) -> tuple[int, ...] | None:
        """Grid coordinates of a world rank (row-major), None if inactive."""
        i = self._index.get(world_rank)
        if i is None:
            return None
        out = []
        for d in reversed(self.shape):
            out.append(i % d)
            i //= d
        return tuple(reversed(out))

    def rank_at(self, coords: Sequence[int]) -> int:
        i = 0
        for c, d in zip(coords, self.shape, strict=True):
            i = i * d + c
        return self.ranks[i]

    def axis_group(self, world_rank: int, axis: int) -> Group:
        """Ranks sharing every coordinate of ``world_rank`` but ``axis``, in ``axis`` order."""
        if not 0 <= axis < len(self.shape):
            raise InvalidArgumentError(
                f"axis {axis} outside the partition's {len(self.shape)} dimensions"
            )
        c = self.coords_of(world_rank)
        if c is None:
            raise InvalidArgumentError(f"rank {world_rank} is not in partition {self.shape}")
        members = []
        for k in range(self.shape[axis]):
            cc = list(c)
            cc[axis] = k
            members.append(self.rank_at(cc))
        return Group(members)

    # Conveniences that use the default service's rank (after totalreduce.init()).
    @property
    def active(self) -> bool:
        return self.is_active(_rank_source())

    @property
    def coords(self) -> tuple[int, ...] | None:
        return self.coords_of(_rank_source())

    def __repr__(self) -> str:
        return f"Partition({self.shape}, ranks={list(self.ranks)})"

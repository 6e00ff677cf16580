"""The one name and generation table of a service: which generation of which name an op is.

The k-th submission of name N on a rank matches the k-th submission of N on
every other rank.  An unnamed op is named from the count of unnamed calls on
this rank, so unnamed calls match by call order, as in MPI.  A name reused
while an earlier generation is in flight must keep its signature (kind, dtype,
count, op, parameter).
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from ..errors import InvalidArgumentError


class NameTable:
    """Per name: the next generation, the generations in flight and their signature.

    A name has a row of three arrays (``next_gen``, ``in_flight`` and the ``unnamed``
    flags, int64 and uint8: compiled code may read them) and of a list of signatures; the
    dict maps a name to its row.  Python reads and writes the words through memoryviews of
    the arrays (as fast as a list's items, and nothing made per op).  An unnamed op's row
    is freed once none of its generations is in flight, and so is a row :meth:`forget`
    drops: rows are reused, and the arrays grow by doubling when none is free.
    """

    def __init__(self, rows: int = 64) -> None:
        self._lock = threading.Lock()
        self._rows: dict[str | int, int] = {}
        self._unnamed = 0
        #: Bumped by every change of a name's next generation but :meth:`advance`'s (a
        #: generation taken, a name started at a generation or forgotten): whoever keeps a
        #: copy of a name's next generation (a node service's compiled loop) knows from it
        #: that the copy may be stale.
        self.version = 0
        rows = max(1, rows)
        self.next_gen = np.zeros(rows, dtype=np.int64)
        self.in_flight = np.zeros(rows, dtype=np.int64)
        self.unnamed = np.zeros(rows, dtype=np.uint8)
        self._sigs: list[tuple[Any, ...]] = [()] * rows
        self._free: list[int] = list(range(rows - 1, -1, -1))
        self._views()

    def _views(self) -> None:
        self._next = self.next_gen.data
        self._flight = self.in_flight.data
        self._unnamed_of = self.unnamed.data

    def _grow(self) -> None:
        """Twice the rows, the current ones copied in (the lock held)."""
        have = self.next_gen.size
        for attr in ("next_gen", "in_flight", "unnamed"):
            old = getattr(self, attr)
            new = np.zeros(2 * have, dtype=old.dtype)
            new[:have] = old
            setattr(self, attr, new)
        self._sigs.extend([()] * have)
        self._free.extend(range(2 * have - 1, have - 1, -1))
        self._views()

    def _row(self, name: str | int, unnamed: bool = False) -> int:
        """``name``'s row, made if new (the lock held)."""
        r = self._rows.get(name)
        if r is None:
            if not self._free:
                self._grow()
            r = self._rows[name] = self._free.pop()
            self._next[r] = 0
            self._flight[r] = 0
            self._unnamed_of[r] = 1 if unnamed else 0
            self._sigs[r] = ()
        return r

    def _drop(self, name: str | int, r: int) -> None:
        """Free ``name``'s row (the lock held; nothing of it in flight)."""
        del self._rows[name]
        self._sigs[r] = ()
        self._free.append(r)
        self.version += 1

    def __len__(self) -> int:
        return len(self._rows)

    def name(self, name: str | int | None, signature: tuple[Any, ...]) -> tuple[str | int, int]:
        """Name and generation of a new op; checks a reused name keeps its shape."""
        lock = self._lock  # (acquire/release: half the cost of a with block, once per op)
        lock.acquire()
        try:
            unnamed = name is None
            key: str | int
            if name is None:
                key = f"__unnamed__.{self._unnamed}"
                self._unnamed += 1
            elif name.__class__ is str or (
                isinstance(name, (str, int)) and not isinstance(name, bool)
            ):
                key = name
            else:
                raise InvalidArgumentError(f"op names are str or int, got {name!r}")
            r = self._row(key, unnamed)
            gen = self._take(key, r, signature)
            self._flight[r] += 1
            return key, gen
        finally:
            lock.release()

    def _take(self, name: str | int, r: int, signature: tuple[Any, ...]) -> int:
        """The next generation of row ``r`` (the lock held), its signature checked."""
        if self._flight[r] and self._sigs[r] != signature:
            gen = self._next[r] - 1
            raise InvalidArgumentError(
                f"op {name!r}: generation {gen} is still in flight as "
                f"{_sig_text(self._sigs[r])}; this call is {_sig_text(signature)}"
            )
        self._sigs[r] = signature
        gen = self._next[r]
        self._next[r] = gen + 1
        self.version += 1
        return gen

    def take(self, name: str | int, signature: tuple[Any, ...]) -> int:
        """The next generation of ``name``, for an op that ends before its caller returns
        (a blocking call): checked as :meth:`name` checks, but not counted in flight, so
        the call takes the lock once; :meth:`hold` counts it if it does not end there."""
        lock = self._lock
        lock.acquire()
        try:
            r = self._rows.get(name)
            if r is None:
                r = self._row(name)
            return self._take(name, r, signature)
        finally:
            lock.release()

    def next_generation(self, name: str | int) -> int:
        """The generation :meth:`name` would give ``name`` next."""
        r = self._rows.get(name)
        return 0 if r is None else self._next[r]

    def advance(self, name: str | int, first: int, k: int, held: int = 0) -> bool:
        """``k`` generations of ``name`` from ``first`` were taken outside (a node service's
        compiled loop, from its copy of :meth:`next_generation`), ``held`` of them still in
        flight; False, nothing changed, when ``first`` is not the next generation (the
        copy was stale).  Named ops only; :attr:`version` does not move."""
        with self._lock:
            r = self._row(name)
            if self._next[r] != first:
                return False
            self._next[r] = first + k
            self._flight[r] += held
            return True

    def hold(self, name: str | int) -> None:
        """A generation :meth:`take` gave is in flight after all (:meth:`ended` ends it)."""
        with self._lock:
            r = self._row(name)
            self._flight[r] += 1

    def signature(self, name: str | int) -> tuple[Any, ...]:
        """The signature ``name`` was last given (KeyError if it has none)."""
        return self._sigs[self._rows[name]]

    def ended(self, name: str | int) -> None:
        """One generation of ``name`` is no longer in flight."""
        lock = self._lock  # (acquire/release: half the cost of a with block, once per op)
        lock.acquire()
        try:
            r = self._rows.get(name)
            if r is not None:
                left = self._flight[r] - 1
                self._flight[r] = left
                if not left and self._unnamed_of[r]:
                    self._drop(name, r)
        finally:
            lock.release()

    def skip(self, name: str | int) -> int:
        """Take the next generation of ``name`` for an op this rank will never submit."""
        with self._lock:
            r = self._row(name)
            gen = self._next[r]
            self._next[r] = gen + 1
            self.version += 1
            return gen

    def start_at(self, name: str | int, generation: int) -> None:
        """The next generation of ``name`` is ``generation``, if it is not past it yet."""
        with self._lock:
            r = self._row(name)
            self._next[r] = max(self._next[r], generation)
            self.version += 1

    def forget(self, name: str | int) -> None:
        """Drop ``name`` once none of its generations is in flight (a name used once)."""
        with self._lock:
            r = self._rows.get(name)
            if r is not None and not self._flight[r]:
                self._drop(name, r)


def _sig_text(sig: tuple[Any, ...]) -> str:
    if not sig:
        return "?"
    kind, dtype, count, op, param = sig
    return f"{kind} of {count} {dtype} (op {op}, param {param})"

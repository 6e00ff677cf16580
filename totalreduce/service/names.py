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

from ..errors import InvalidArgumentError


class _NameState:
    __slots__ = ("next_generation", "in_flight", "signature", "unnamed")

    def __init__(self, unnamed: bool) -> None:
        self.next_generation = 0
        self.in_flight = 0
        self.signature: tuple[Any, ...] = ()
        self.unnamed = unnamed  # forgotten once no generation is in flight


class NameTable:
    """Per name: the next generation, the generations in flight and their signature."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._names: dict[str | int, _NameState] = {}
        self._unnamed = 0
        #: Bumped by every change of a name's next generation but :meth:`advance`'s (a
        #: generation taken, a name started at a generation or forgotten): whoever keeps a
        #: copy of a name's next generation (a node service's compiled loop) knows from it
        #: that the copy may be stale.
        self.version = 0

    def name(self, name: str | int | None, signature: tuple[Any, ...]) -> tuple[str | int, int]:
        """Name and generation of a new op; checks a reused name keeps its shape."""
        lock = self._lock  # (acquire/release: half the cost of a with block, once per op)
        lock.acquire()
        try:
            unnamed = name is None
            if unnamed:
                name = f"__unnamed__.{self._unnamed}"
                self._unnamed += 1
            elif name.__class__ is not str and (
                isinstance(name, bool) or not isinstance(name, (str, int))
            ):
                raise InvalidArgumentError(f"op names are str or int, got {name!r}")
            st = self._names.get(name)
            if st is None:
                st = self._names[name] = _NameState(unnamed)
            if st.in_flight and st.signature != signature:
                raise InvalidArgumentError(
                    f"op {name!r}: generation {st.next_generation - 1} is still in flight as "
                    f"{_sig_text(st.signature)}; this call is {_sig_text(signature)}"
                )
            st.signature = signature
            st.in_flight += 1
            gen = st.next_generation
            st.next_generation += 1
            self.version += 1
            return name, gen
        finally:
            lock.release()

    def take(self, name: str | int, signature: tuple[Any, ...]) -> int:
        """The next generation of ``name``, for an op that ends before its caller returns
        (a blocking call): checked as :meth:`name` checks, but not counted in flight, so
        the call takes the lock once; :meth:`hold` counts it if it does not end there."""
        lock = self._lock
        lock.acquire()
        try:
            st = self._names.get(name)
            if st is None:
                st = self._names[name] = _NameState(False)
            if st.in_flight and st.signature != signature:
                raise InvalidArgumentError(
                    f"op {name!r}: generation {st.next_generation - 1} is still in flight as "
                    f"{_sig_text(st.signature)}; this call is {_sig_text(signature)}"
                )
            st.signature = signature
            gen = st.next_generation
            st.next_generation += 1
            self.version += 1
            return gen
        finally:
            lock.release()

    def next_generation(self, name: str | int) -> int:
        """The generation :meth:`name` would give ``name`` next."""
        st = self._names.get(name)
        return 0 if st is None else st.next_generation

    def advance(self, name: str | int, first: int, k: int, held: int = 0) -> bool:
        """``k`` generations of ``name`` from ``first`` were taken outside (a node service's
        compiled loop, from its copy of :meth:`next_generation`), ``held`` of them still in
        flight; False, nothing changed, when ``first`` is not the next generation (the
        copy was stale).  Named ops only; :attr:`version` does not move."""
        with self._lock:
            st = self._names.get(name)
            if st is None:
                st = self._names[name] = _NameState(False)
            if st.next_generation != first:
                return False
            st.next_generation += k
            st.in_flight += held
            return True

    def hold(self, name: str | int) -> None:
        """A generation :meth:`take` gave is in flight after all (:meth:`ended` ends it)."""
        with self._lock:
            st = self._names.get(name)
            if st is None:
                st = self._names[name] = _NameState(False)
            st.in_flight += 1

    def signature(self, name: str | int) -> tuple[Any, ...]:
        """The signature ``name`` was last given (KeyError if it has none)."""
        return self._names[name].signature

    def ended(self, name: str | int) -> None:
        """One generation of ``name`` is no longer in flight."""
        lock = self._lock  # (acquire/release: half the cost of a with block, once per op)
        lock.acquire()
        try:
            st = self._names.get(name)
            if st is not None:
                st.in_flight -= 1
                if st.unnamed and not st.in_flight:
                    del self._names[name]
                    self.version += 1
        finally:
            lock.release()

    def skip(self, name: str | int) -> int:
        """Take the next generation of ``name`` for an op this rank will never submit."""
        with self._lock:
            st = self._names.get(name)
            if st is None:
                st = self._names[name] = _NameState(False)
            gen = st.next_generation
            st.next_generation += 1
            self.version += 1
            return gen

    def start_at(self, name: str | int, generation: int) -> None:
        """The next generation of ``name`` is ``generation``, if it is not past it yet."""
        with self._lock:
            st = self._names.get(name)
            if st is None:
                st = self._names[name] = _NameState(False)
            st.next_generation = max(st.next_generation, generation)
            self.version += 1

    def forget(self, name: str | int) -> None:
        """Drop ``name`` once none of its generations is in flight (a name used once)."""
        with self._lock:
            st = self._names.get(name)
            if st is not None and not st.in_flight:
                del self._names[name]
                self.version += 1


def _sig_text(sig: tuple[Any, ...]) -> str:
    if not sig:
        return "?"
    kind, dtype, count, op, param = sig
    return f"{kind} of {count} {dtype} (op {op}, param {param})"

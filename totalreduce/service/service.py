"""The service: one rank's engine and client calls, composed from the service's modules.

A :class:`Service` owns a transport, a :class:`~totalreduce.engine.loop.CommLoop`
run by its communication thread (:mod:`.lifecycle`).  The client methods check
arguments in the caller's thread (:mod:`.checks`), so invalid calls raise before
anything is sent, give each op its name and generation (:mod:`.names`), compile its
schedule and queue it (:mod:`.submit`); the comm thread does the rest.  The op families live in
:mod:`.collectives` (allreduce, broadcast, barrier, pairwise exchange),
:mod:`.partitions` (reduce-scatter, all-gather) and :mod:`.neighbors`
(neighbor ops, with the weights of :mod:`.weights`) and :mod:`.rooted` (reduce,
gather, scatter, all-to-all, send/recv).  Each op's blocking method
(``Service.allreduce`` ...) is its ``_async`` method and ``wait()``, built from its
record in :mod:`totalreduce.ops_table`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ..declare import build_function, forward, signature
from ..ops_table import OPS, OpDecl
from ..transport.base import Transport
from .adasum import AdasumOps
from .checks import as_array, reduce_op
from .collectives import CollectiveOps
from .config import Config
from .handle import Handle, HandleLike, ServiceLike
from .lifecycle import Lifecycle
from .neighbors import NeighborOps
from .partitions import PartitionOps
from .rooted import RootedOps
from .windows import Windows

__all__ = ["Service", "as_array", "reduce_op"]  # the daemon client imports the checks from here


class Service(CollectiveOps, PartitionOps, NeighborOps, RootedOps, AdasumOps, Lifecycle):
    """One rank's totalreduce engine and its client API (see the module docstring)."""

    def __init__(self, transport: Transport, config: Config | None = None) -> None:
        self._start(transport, config or Config.load())

    @property
    def windows(self) -> Windows:
        """This rank's windows: one-sided put, get and accumulate (:mod:`.windows`)."""
        with self._windows_lock:
            if self._windows is None:
                self._windows = Windows(self)
            return self._windows

    def node_layout(self) -> tuple[int, int, int, int]:
        """(local_rank, local_size, cross_rank, cross_size) of this rank, from the transport."""
        return self.transport.node_layout()

    def empty(self, shape: Any, dtype: Any = np.float32) -> np.ndarray:
        """A new, uninitialized array to run ops on.  A daemon client places it in the
        node's arena, so an ``allreduce``, ``broadcast`` or ``barrier`` of it takes no
        copy (the result lands in it in place); it gives its memory back when the last
        array over it goes.  Otherwise it is ``numpy.empty``."""
        if self._thin is not None:
            return self._thin.empty(shape, dtype)
        return np.empty(shape, dtype)

    def forget_name(self, name: str | int, generation: int | None = None) -> None:
        """Forget a name no later op will use (a node's service, for its clients' unnamed
        ops); its generations start again at the first if it comes back.  With
        ``generation``, that ended op is forgotten too, so the same name and generation
        can run again (a node's session agreement, once per job)."""
        self._names.forget(name)
        if generation is not None:
            self.loop.forget_op((self._wire_id(name), int(generation)))

    def start_name_at(self, name: str | int, generation: int) -> None:
        """The next op of ``name`` takes generation ``generation`` (unless ``name`` is past
        it): a node's service runs a large op's segments under names of their own, at
        the op's generation, so a generation one service skipped is skipped everywhere."""
        self._names.start_at(name, generation)

    def abort_next(self, name: str | int, reason: str, mismatch: bool = False) -> int:
        """Fail the next generation of ``name`` on every rank without submitting it here
        (this rank never will: a node's service, for an op its clients failed); returns
        that generation."""
        gen = self._names.skip(name)
        self.abort(name, gen, reason, mismatch)
        return gen

    def take_late_errors(self) -> Sequence[BaseException]:
        """The errors of ops that completed here but failed elsewhere, not raised yet
        (they are raised at this rank's next call otherwise)."""
        late = self.loop.failures.late
        if not late:
            return ()
        out = []
        while late:
            out.append(late.popleft())
        return out

    def quiet_late_errors(self) -> None:
        """Never raise an op's late error at a later call (a node's service, whose ops
        among the services are its clients' ops: it takes them, :meth:`take_late_errors`,
        and logs them; raised into the next job's first submission they would fail it)."""
        self._raise_late = False

    def abort(self, name: str | int, generation: int, reason: str, mismatch: bool = False) -> None:
        """Fail op ``name`` generation ``generation`` here and on every other rank.

        Every rank's handle of that op fails with ``OpFailedError(reason)``
        (``OpMismatchError`` if ``mismatch``), even on ranks (including this one)
        that have not submitted it yet.
        """
        self.loop.request_abort((self._wire_id(name), int(generation)), str(name), reason, mismatch)


def _blocking_method(decl: OpDecl) -> Callable[..., Any]:
    """``Service.{name}``: ``self.{name}_async(...).wait()`` with the numpy API's parameters
    (``self._{name}_direct(...)`` for an op declared ``direct``)."""
    sig = signature(decl.api_params(), more=decl.api_more, first="self", returns=decl.returns.value)
    args = forward(sig, skip=("self",))
    return build_function(
        decl.name,
        sig,
        f"return self._{decl.name}_direct({forward(sig, skip=('self',), in_order=True)})"
        if decl.direct
        else f"return self.{decl.method}({args}).wait()",
        {},
        doc=f"Blocking :meth:`{decl.method}`.",
        module=__name__,
        qualname=f"Service.{decl.name}",
        declared=(decl.name, "service blocking"),
    )


for _decl in OPS:
    setattr(Service, _decl.name, _blocking_method(_decl))


if TYPE_CHECKING:  # mypy checks that the embedded service and handle satisfy the protocols

    def _satisfies(service: Service, handle: Handle) -> tuple[ServiceLike, HandleLike]:
        return service, handle

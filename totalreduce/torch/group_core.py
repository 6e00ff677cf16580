"""The plumbing of the ``"totalreduce"`` backend of ``torch.distributed``: what every op of
:class:`~totalreduce.torch.process_group.TotalReduceProcessGroup` runs through.

:class:`GroupCore` is that class's base: the group's ranks and service, its names (an op
is named after its group, kind, dtype, size and reduce op or root; c10d's group name and
description), the host buffers of its tensors, and the ``Work`` of each op with its
deadline (:mod:`.futures`).  Beside it: the backend's name, its error for an op it does
not provide, torch's reduce ops and the table's ``c10d`` names.  The ops themselves, the
creator torch calls and the registration are in :mod:`.process_group`.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..declare import OpDecl
from ..errors import InvalidArgumentError, TotalReduceError
from ..group import Group
from ..ops_table import OPS
from ..service.handle import HandleLike, ServiceLike
from .futures import torch_work
from .tensors import HostBuffer, PinnedPool, host_buffer

#: The name ``init_process_group(backend=...)`` takes.
BACKEND_NAME = "totalreduce"


class UnsupportedOpError(TotalReduceError, NotImplementedError):
    """A ``torch.distributed`` op the totalreduce backend does not provide."""


_REDUCE_OPS = {
    dist.ReduceOp.SUM: "sum",
    dist.ReduceOp.AVG: "avg",
    dist.ReduceOp.MIN: "min",
    dist.ReduceOp.MAX: "max",
    dist.ReduceOp.PRODUCT: "product",
    dist.ReduceOp.BAND: "band",
    dist.ReduceOp.BOR: "bor",
    dist.ReduceOp.BXOR: "bxor",
}
_ALL_OPS = tuple(_REDUCE_OPS.values())


def _reduce_op(what: str, op: Any, allowed: tuple[str, ...] = _ALL_OPS) -> str:
    for torch_op, name in _REDUCE_OPS.items():
        if op == torch_op and name in allowed:
            return name
    raise UnsupportedOpError(
        f"the totalreduce backend's {what} takes ReduceOp {', '.join(a.upper() for a in allowed)}; "
        f"got {getattr(getattr(op, 'op', op), 'name', op)}"
    )


_NO_TIMEOUT_S = 1e7  # c10d's "unset" is -1 ms, "none" a huge value: neither is a deadline

#: The engine op each torch.distributed call runs on (the ``c10d`` names of the table).
_C10D: dict[str, OpDecl] = {name: decl for decl in OPS for name in decl.c10d}

#: What one torch op submits: its handles, its result, what runs once they completed.
_Part = tuple[list[HandleLike], Any, Callable[[], Any]]


def _joined(parts: list[_Part], result: Any) -> _Part:
    """Several ops' parts as one: every handle, ``result``, every finish in order."""

    def finish() -> None:
        for _handles, _result, each in parts:
            each()

    return [h for handles, _r, _f in parts for h in handles], result, finish


class GroupCore(dist.ProcessGroup):
    """The base of :class:`~totalreduce.torch.process_group.TotalReduceProcessGroup`: one
    group's service, ranks and names, and the ``Work`` of its ops (see the module docstring).
    """

    def __init__(
        self,
        service: ServiceLike,
        ranks: list[int],
        group_id: str,
        timeout: timedelta = timedelta(minutes=30),
    ) -> None:
        me = ranks.index(service.rank)
        super().__init__(me, len(ranks))
        self.service = service
        self.ranks = list(ranks)
        self.group_id = group_id
        self._group_name = group_id
        #: How long an op may take before ``Work.wait()`` raises (unless the op sets its own).
        self.timeout_s = (
            float(timeout.total_seconds()) if isinstance(timeout, timedelta) else 1800.0
        )
        self._group_desc = ""
        self._group = None if len(ranks) == service.size else Group(self.ranks)
        self._prefix = f"torch.distributed.{group_id}."
        # Staging copies (CUDA, non-contiguous tensors) reuse buffers: pinned ones are slow to make.
        self.staging = PinnedPool()

    # ------------------------------------------------------------------ naming

    def _name(self, what: str, t: torch.Tensor, detail: Any = "") -> str:
        """The op name of torch op ``what`` on ``t``: its engine op (the table's ``c10d``
        names) and the group, dtype, size and ``detail`` (reduce op, root)."""
        kind = _C10D[what].name
        return f"{self._prefix}{kind}.{str(t.dtype).removeprefix('torch.')}.{t.numel()}.{detail}"

    def _uneven(self, what: str, t: torch.Tensor, suffix: str = "") -> str:
        """The name of an op whose sizes differ between ranks (all-to-all with splits)."""
        kind = _C10D[what].name + suffix
        return f"{self._prefix}{kind}.{str(t.dtype).removeprefix('torch.')}.v"

    def getBackendName(self) -> str:  # noqa: N802 - c10d's name
        return BACKEND_NAME

    # c10d keeps a group's name in its backend; this group is its own backend, so it keeps the
    # name itself (torch's trampoline forwards these four to Python).  Without them
    # ``pg.group_name`` raises "ProcessGroup name not set" and DeviceMesh, DTensor and the
    # functional collectives (which find groups by name) cannot use the group.
    def setGroupName(self, name: str) -> None:  # noqa: N802 - c10d's name
        self._group_name = str(name)

    def getGroupName(self) -> str:  # noqa: N802 - c10d's name
        return self._group_name

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802 - c10d's name
        self._group_desc = str(desc)

    def getGroupDesc(self) -> str:  # noqa: N802 - c10d's name
        return self._group_desc

    def _tensors(self, what: str, tensors: Any) -> list[torch.Tensor]:
        if isinstance(tensors, torch.Tensor):
            return [tensors]
        out = list(tensors)
        if not out:
            raise InvalidArgumentError(f"{what} got no tensors")
        return out

    # ------------------------------------------------------------------ Work

    def _work(
        self,
        what: str,
        opts: Any,
        handles: list[HandleLike],
        result: Any,
        finish: Callable[[], Any] | None = None,
    ) -> dist.Work:
        """The ``Work`` of torch op ``what`` (:func:`~totalreduce.torch.futures.torch_work`):
        its future is ``result`` once every handle completed and ``finish`` (copies out
        of the engine's buffers) ran; ``wait()`` raises :class:`OpTimeoutError` naming
        ``what`` and the group once ``opts.timeout`` (where the caller set one, else the
        group's: ``init_process_group(timeout=...)``, 30 minutes unless set, as gloo's)
        has passed since submission.  The op stays in flight."""
        assert what in _C10D, f"{what} is no c10d name of an op in totalreduce.ops_table"
        timeout = getattr(opts, "timeout", None)
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else -1.0
        if not 0 < seconds < _NO_TIMEOUT_S:
            seconds = self.timeout_s

        def value() -> Any:
            if finish is not None:
                finish()
            return result

        def timed_out() -> str:
            return (
                f"{what} on torch.distributed group {self.group_id!r} (rank {self.rank()} of "
                f"{self.size()}, world ranks {self.ranks}) did not complete within its timeout "
                f"of {seconds:g} s"
            )

        return torch_work(
            handles, value, timeout_s=seconds, timeout_error=timed_out, hold_until_claimed=False
        )

    def _untimed(
        self,
        what: str,
        handles: list[HandleLike],
        result: Any,
        finish: Callable[[], Any] | None = None,
    ) -> dist.Work:
        """The ``Work`` of ``what`` without a deadline (send and recv: c10d gives them no
        options)."""
        assert what in _C10D, f"{what} is no c10d name of an op in totalreduce.ops_table"

        def value() -> Any:
            if finish is not None:
                finish()
            return result

        return torch_work(handles, value)

    # ------------------------------------------------------------------ buffers, the engine's view

    def _buffer(self, t: torch.Tensor, what: str) -> HostBuffer:
        return host_buffer(t, what, pool=self.staging)

    def _missing(self, h: Any) -> list[int]:
        """The group ranks op ``h`` still waits for (from the engine's view of it)."""
        spec = getattr(h, "_spec", None)
        if spec is None:
            return []
        recv_from = self.service.loop.stalls.waiting_for(spec)
        return sorted(self.ranks.index(r) for r in recv_from if r in self.ranks)

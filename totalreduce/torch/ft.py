"""torchft's names over this project's fault-tolerant mode (docs/fault_tolerance.md).

A script written for torchft runs with its imports changed::

    from totalreduce.torch.ft import (
        DistributedDataParallel, DistributedSampler, Manager, Optimizer,
        ProcessGroupGloo, ProcessGroupNCCL, PGTransport,
    )

against services started with ``totalreduce serve --fault-tolerant``: each process is a
*member* (torchft's replica group of one process) of its node's service, which keeps the
quorum with the other services (no lighthouse, no TCPStore).  The meanings are torchft's:

- :meth:`Manager.start_quorum` (called by :meth:`Optimizer.zero_grad`) asks for the step's
  quorum; a member behind the quorum's step receives the state (``state_dict()``, and
  the manager's step) from a member at it, through the services, before it returns;
- :meth:`Manager.allreduce` averages a tensor over the quorum's members.  An error (a
  member died, the quorum was replaced) is recorded (:meth:`Manager.errored`), not
  raised, and the step goes on with the tensor unchanged, as torchft does;
- :meth:`Manager.should_commit` (called by :meth:`Optimizer.step`) votes: True only if
  every member of the quorum voted without error while alive, the same answer on every
  member; then the step counts (:meth:`Manager.current_step`) and the optimizer steps.

The process-group and transport classes are stand-ins: they take torchft's arguments and
mean "the services' transport".  What has no equivalent here raises ``ValueError`` or
``TypeError`` naming it.  The allreduce runs when it is called (its future is done on
return): the gradients of a step are averaged in one op once backward has made them all.
"""

from __future__ import annotations

import io
import logging
import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils import data

from ..errors import TotalReduceError
from ..service.ft_member import Member, MemberDroppedError, StepFailedError

__all__ = [
    "DistributedDataParallel",
    "DistributedSampler",
    "Manager",
    "Optimizer",
    "OptimizerWrapper",
    "PGTransport",
    "ProcessGroupGloo",
    "ProcessGroupNCCL",
    "WorldSizeMode",
]

log = logging.getLogger("totalreduce.torch.ft")


def _seconds(t: timedelta | float | None, default: float) -> float:
    if t is None:
        return default
    return t.total_seconds() if isinstance(t, timedelta) else float(t)


class _StandIn:
    """A process group of torchft: here the services' transport, nothing to set up."""

    def __init__(self, timeout: timedelta | float = timedelta(seconds=60), **kwargs: Any) -> None:
        self.timeout = _seconds(timeout, 60.0)
        self.options = kwargs

    def configure(self, *args: Any, **kwargs: Any) -> None:
        """torchft reconfigures its group at every quorum; the services do it here."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(timeout={self.timeout})"


class ProcessGroupGloo(_StandIn):
    """torchft's ``ProcessGroupGloo(timeout=...)``: the services' transport (CPU)."""


class ProcessGroupNCCL(_StandIn):
    """torchft's ``ProcessGroupNCCL(timeout=...)``: the services' transport; CUDA tensors
    are copied to the host for their ops."""


class PGTransport:
    """torchft's ``PGTransport(pg, timeout, device, state_dict=None)``: the state goes from
    a live member to the ones behind through the services (never through disk)."""

    def __init__(
        self,
        pg: Any,
        timeout: timedelta | float = timedelta(seconds=60),
        device: Any = "cpu",
        state_dict: Callable[[], Any] | None = None,
    ) -> None:
        _check_pg(pg, "PGTransport")
        self.pg = pg
        self.timeout = _seconds(timeout, 60.0)
        self.device = torch.device(device)
        self.state_dict = state_dict


class WorldSizeMode:
    """torchft's ``WorldSizeMode``: ``DYNAMIC`` (the step's members) is the only one here."""

    DYNAMIC = "dynamic"
    FIXED_WITH_SPARES = "fixed_with_spares"


def _check_pg(pg: Any, who: str) -> None:
    if not isinstance(pg, _StandIn):
        raise TypeError(
            f"{who}: pg={type(pg).__module__}.{type(pg).__name__} has no equivalent here: "
            "pass totalreduce.torch.ft.ProcessGroupGloo or ProcessGroupNCCL"
        )


class Manager:
    """torchft's ``Manager``: one member's quorum, averages and commits (module docstring).

    ``timeout`` is also how long the service waits for a message of this member (it sends
    one every ``heartbeat_interval``) before it drops it as hung; a dropped manager
    attaches again at its next call and receives the state at its next quorum.
    Accepted and not needed: ``lighthouse_addr`` (and ``TORCHFT_LIGHTHOUSE``),
    ``store_addr``, ``store_port``, ``port``, ``hostname``,
    ``connect_timeout``, ``rank``/``world_size`` of one process, ``init_sync``,
    ``use_async_quorum`` (the quorum and any state transfer finish inside
    ``start_quorum``).  ``socket`` (this project's) names the node's ``ft{n}.sock``.
    """

    def __init__(
        self,
        pg: Any,
        load_state_dict: Callable[[Any], None] | None,
        state_dict: Callable[[], Any] | None,
        min_replica_size: int,
        use_async_quorum: bool = True,
        timeout: timedelta = timedelta(seconds=60),
        quorum_timeout: timedelta = timedelta(seconds=60),
        connect_timeout: timedelta = timedelta(seconds=60),
        rank: int | None = None,
        world_size: int | None = None,
        world_size_mode: str = WorldSizeMode.DYNAMIC,
        store_addr: str | None = None,
        store_port: int | None = None,
        lighthouse_addr: str | None = None,
        replica_id: str | None = None,
        port: int | None = None,
        hostname: str | None = None,
        heartbeat_interval: timedelta = timedelta(milliseconds=100),
        checkpoint_transport: PGTransport | None = None,
        init_sync: bool = True,
        max_retries: int | None = None,
        quorum_retries: int = 0,
        socket: str | None = None,
    ) -> None:
        _check_pg(pg, "Manager")
        if world_size_mode != WorldSizeMode.DYNAMIC:
            raise ValueError(
                f"Manager: world_size_mode={world_size_mode!r} has no equivalent here (spares); "
                "every member of a quorum takes part in its step (DYNAMIC)"
            )
        ws = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
        if ws != 1:
            raise ValueError(
                f"Manager: a replica group of {ws} processes (world_size) has no equivalent "
                "here yet: run one process per replica"
            )
        if checkpoint_transport is not None and not isinstance(checkpoint_transport, PGTransport):
            raise TypeError(
                f"Manager: checkpoint_transport={type(checkpoint_transport).__name__} has no "
                "equivalent here: pass totalreduce.torch.ft.PGTransport (or none)"
            )
        self._pg = pg
        self._min = int(min_replica_size)
        self._timeout = _seconds(timeout, 60.0)
        self._quorum_timeout = _seconds(quorum_timeout, 60.0)
        self._max_retries = max_retries
        self._user: dict[str, tuple[Callable[[Any], None], Callable[[], Any]]] = {}
        if load_state_dict is not None and state_dict is not None:
            self._user["default"] = (load_state_dict, state_dict)
        rid = replica_id if replica_id is not None else os.environ.get("REPLICA_GROUP_ID", "")
        self._replica_id = str(rid) or f"replica_{os.getpid()}"
        self._socket = socket
        self._beat = min(_seconds(heartbeat_interval, 0.1), self._timeout / 4)
        self._member = Member(self._replica_id, socket, timeout=self._timeout, heartbeat=self._beat)
        self._step = 0
        self._batches = 0
        self._errored: Exception | None = None
        self._failures = 0
        self._participants = 0
        self._rank: int | None = None
        self._flush: list[Callable[[], None]] = []

    # ------------------------------------------------------------------ state

    def register_state_dict_fn(
        self, key: str, load_state_dict: Callable[[Any], None], state_dict: Callable[[], Any]
    ) -> None:
        if key in self._user:
            raise ValueError(f"Manager: a state_dict function named {key!r} is registered")
        self._user[key] = (load_state_dict, state_dict)

    def set_state_dict_fns(
        self, load_state_dict: Callable[[Any], None], state_dict: Callable[[], Any]
    ) -> None:
        self._user["default"] = (load_state_dict, state_dict)

    def state_dict(self) -> dict[str, int]:
        return {"step": self._step, "batches_committed": self._batches}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self._step = int(state_dict["step"])
        self._batches = int(state_dict["batches_committed"])

    def _send_state(self) -> None:
        buf = io.BytesIO()
        torch.save(
            {"user": {k: fns[1]() for k, fns in self._user.items()}, "torchft": self.state_dict()},
            buf,
        )
        self._member.send_state(buf.getbuffer())

    def _recv_state(self) -> None:
        raw = self._member.recv_state()
        got = torch.load(io.BytesIO(bytes(raw)), weights_only=True)
        for k, fns in self._user.items():
            if k not in got["user"]:
                raise TotalReduceError(f"Manager: the state received has no {k!r} part")
            fns[0](got["user"][k])
        self.load_state_dict(got["torchft"])

    # ------------------------------------------------------------------ a step

    def start_quorum(
        self,
        allow_heal: bool = True,
        shrink_only: bool = False,
        timeout: timedelta | None = None,
    ) -> None:
        """Ask for the step's quorum; receive the state if this member is behind it."""
        if shrink_only:
            raise ValueError("Manager.start_quorum: shrink_only has no equivalent here")
        self._errored = None
        self._flush.clear()
        t = _seconds(timeout, self._quorum_timeout)
        try:
            q = self._member.start_quorum(self._step, self._min, t)
        except MemberDroppedError as exc:
            self._rejoin(exc)
            q = self._member.start_quorum(self._step, self._min, t)
        self._participants, self._rank = q.size, q.rank
        try:
            if q.heal_from >= 0:
                if not allow_heal:
                    raise TotalReduceError(
                        f"Manager: step {self._step} is behind the quorum's {q.step} and "
                        "allow_heal=False"
                    )
                self._recv_state()
                log.info("%s: received the state of step %d", self._replica_id, self._step)
            if q.heal_to:
                self._send_state()
        except StepFailedError as exc:
            self.report_error(exc)

    def _rejoin(self, exc: MemberDroppedError) -> None:
        """This member was hung past its ``timeout`` and its service dropped it: attach
        again as a new member (the next quorum sends it the state if it is behind)."""
        log.warning("%s: %s; attaching again", self._replica_id, exc)
        self._member.close()
        self._member = Member(
            self._replica_id, self._socket, timeout=self._timeout, heartbeat=self._beat
        )

    def _follow(self) -> None:
        """The step's members as the member knows them now: a member that left cleanly
        before the step's first op re-formed the quorum without it (fewer participants)."""
        q = self._member.quorum
        if q is not None:
            self._participants, self._rank = q.size, q.rank

    def wait_quorum(self) -> None:
        """The quorum is formed inside :meth:`start_quorum`: nothing to wait for."""

    def allreduce(
        self, tensor: torch.Tensor, should_quantize: bool = False, reduce_op: Any = None
    ) -> torch.futures.Future[torch.Tensor]:
        """Average ``tensor`` in place over the quorum's members; a done future of it.
        An error is recorded (:meth:`errored`) and the tensor left as it was."""
        if should_quantize:
            raise ValueError("Manager.allreduce: should_quantize=True has no equivalent here")
        op = "AVG" if reduce_op is None else str(getattr(reduce_op, "name", reduce_op)).upper()
        if op not in ("AVG", "SUM", "REDOPTYPE.AVG", "REDOPTYPE.SUM"):
            raise ValueError(f"Manager.allreduce: reduce_op={reduce_op!r} has no equivalent here")
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        if self._errored is None:
            try:
                host = tensor.detach().to("cpu").contiguous()
                avg = self._member.allreduce(host.numpy())
                self._follow()  # (a member that left before the step: the quorum re-formed)
                if "SUM" in op:
                    avg = avg * np.asarray(self._participants, avg.dtype)
                tensor.copy_(torch.from_numpy(avg.copy()).reshape(tensor.shape))
            except (StepFailedError, TotalReduceError, TimeoutError) as exc:
                self.report_error(exc)
        fut.set_result(tensor)
        return fut

    def report_error(self, e: Exception) -> None:
        """Fail this step: :meth:`should_commit` votes no."""
        if self._errored is None:
            self._errored = e
            log.warning("%s: step %d fails: %s", self._replica_id, self._step + 1, e)

    def errored(self) -> Exception | None:
        return self._errored

    def wrap_future(
        self, fut: torch.futures.Future[Any], default: Any, timeout: timedelta | None = None
    ) -> torch.futures.Future[Any]:
        """``fut``, with an error recorded and ``default`` as its value instead."""
        out: torch.futures.Future[Any] = torch.futures.Future()

        def done(f: torch.futures.Future[Any]) -> None:
            try:
                out.set_result(f.value())
            except Exception as exc:
                self.report_error(exc)
                out.set_result(default)

        fut.add_done_callback(done)
        return out

    def should_commit(self, timeout: timedelta | None = None) -> bool:
        """Vote on the step; True (the same on every member) if all voted ok while alive."""
        for flush in self._flush:
            flush()
        self._flush.clear()
        try:  # the vote asks for the next quorum too: one round a step among the services
            ok = self._member.should_commit(
                self._errored is None, _seconds(timeout, self._timeout), ask_next=self._step,
                min_replica_size=self._min, quorum_timeout=self._quorum_timeout,
            )  # fmt: skip
        except MemberDroppedError as exc:
            self._rejoin(exc)
            ok = False
        else:
            self._follow()
        if ok:
            self._step += 1
            self._batches += self._participants
            self._failures = 0
        else:
            self._failures += 1
            why = self._errored or self._member.failure
            log.warning("%s: step %d does not commit: %s", self._replica_id, self._step + 1, why)
            if self._max_retries is not None and self._failures > self._max_retries:
                raise RuntimeError(
                    f"Manager: {self._failures} steps failed in a row (max_retries "
                    f"{self._max_retries})"
                )
        return ok

    def current_step(self) -> int:
        return self._step

    def batches_committed(self) -> int:
        return self._batches

    def participating_rank(self) -> int | None:
        return self._rank

    def num_participants(self) -> int:
        return self._participants

    def is_participating(self) -> bool:
        return True

    def shutdown(self, wait: bool = True) -> None:
        self._member.close()


class OptimizerWrapper(torch.optim.Optimizer):
    """torchft's ``Optimizer(manager, optim)``: the quorum at ``zero_grad()``, the vote at
    ``step()``, and no step of ``optim`` on a step that does not commit."""

    def __init__(self, manager: Manager, optim: torch.optim.Optimizer) -> None:
        self.optim = optim
        self.manager = manager

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optim.add_param_group(param_group)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optim.load_state_dict(state_dict)

    def state_dict(self) -> dict[str, Any]:
        return self.optim.state_dict()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.manager.start_quorum()
        self.optim.zero_grad(set_to_none)

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ValueError("Optimizer.step: a closure has no equivalent here")
        if self.manager.should_commit():
            self.optim.step()

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optim.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optim.state


Optimizer = OptimizerWrapper


class DistributedDataParallel(nn.Module):
    """torchft's ``DistributedDataParallel(manager, module)``: the module's gradients are
    averaged over the step's members, in one op over all of them (in the parameters'
    order) once backward made the last one, or at ``should_commit`` for a step where
    some parameter got none."""

    def __init__(self, manager: Manager, module: nn.Module, **kwargs: Any) -> None:
        super().__init__()
        bad = sorted(k for k in kwargs if k not in ("device_ids", "output_device", "bucket_cap_mb"))
        if bad:
            raise ValueError(f"DistributedDataParallel: {bad} have no equivalent here")
        self.module = module
        self._manager = manager
        self._params = [p for p in module.parameters() if p.requires_grad]
        self._ready = 0
        for p in self._params:
            p.register_post_accumulate_grad_hook(self._grad_ready)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._ready = 0
        if self._flush not in self._manager._flush:
            self._manager._flush.append(self._flush)
        return self.module(*args, **kwargs)

    def _grad_ready(self, p: torch.Tensor) -> None:
        self._ready += 1
        if self._ready == len(self._params):
            self._flush()

    def _flush(self) -> None:
        m = self._manager
        if self._flush not in m._flush:
            return  # averaged already this step
        m._flush.remove(self._flush)
        grads = [
            p.grad if p.grad is not None else torch.zeros_like(p) for p in self._params
        ]  # fmt: skip
        if not grads:
            return
        flat = torch.cat([g.detach().reshape(-1).to("cpu") for g in grads])
        m.allreduce(flat)
        off = 0
        for p, g in zip(self._params, grads, strict=True):
            n = g.numel()
            part = flat[off : off + n].view_as(g).to(g.device)
            if p.grad is None:
                p.grad = part.clone()
            else:
                p.grad.copy_(part)
            off += n


class DistributedSampler(data.distributed.DistributedSampler):
    """torchft's ``DistributedSampler``: the dataset cut into ``num_replicas *
    num_replica_groups`` shards, this process's being ``group_rank + num_replicas *
    replica_rank``."""

    def __init__(
        self,
        dataset: data.Dataset,
        replica_rank: int,
        num_replica_groups: int,
        group_rank: int | None = None,
        num_replicas: int | None = None,
        **kwargs: Any,
    ) -> None:
        group_rank = 0 if group_rank is None else int(group_rank)
        num_replicas = 1 if num_replicas is None else int(num_replicas)
        self.global_rank = group_rank + num_replicas * int(replica_rank)
        self.global_world_size = num_replicas * int(num_replica_groups)
        super().__init__(
            dataset, rank=self.global_rank, num_replicas=self.global_world_size, **kwargs
        )

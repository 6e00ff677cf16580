"""Configuration: one name per option, as a keyword of ``init`` or a ``TOTALREDUCE_*`` variable.

One :class:`Config` serves the whole stack: the service reads its options, and the
engine's loop (:class:`~totalreduce.engine.loop.CommLoop`) takes the same object.

A keyword given to ``init()`` wins over the environment variable of the same
name (upper-cased, prefixed ``TOTALREDUCE_``), which wins over the default.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, fields
from typing import Any

from .errors import InvalidArgumentError

ENV_PREFIX = "TOTALREDUCE_"


@dataclass(frozen=True)
class Config:
    """Every option of a service.

    - ``segment_bytes``: largest piece of a step sent as one frame: the unit of
      pipelining and of preemption (the compiled lane cuts at 256 KiB, or at this if
      smaller). All ranks must agree.
    - ``micro_bytes``: bodies up to this size travel inside the header message
      (eager, no rendezvous; the compiled lane sends an op of at most eight such
      segments that way). 64 KiB: from 16 KiB, 64-512 KiB allreduces took 0.7-0.9
      of MPI's speed and now 0.95-1.2 (docs/benchmarks.md). All ranks must agree.
    - ``floating_pool_bytes``: bytes of early frames (ops not submitted here
      yet) held before backpressure stops receiving more.
    - ``stall_warning_s``: warn about an op that made no progress this long,
      naming the ranks that have not submitted it.
    - ``stall_shutdown_s``: fail an op that made no progress this long, on every
      rank, with ``OpTimeoutError`` naming the ranks that have not submitted it
      (0: off, the default).
    - ``backoff_max_s`` / ``idle_backoff_max_s``: longest sleep of the comm
      loop with ops in flight / with none (a submission wakes a sleeping loop at
      once, so the idle ceiling costs no latency: it sets the idle CPU).
    - ``backoff_min_s``: the comm loop's first sleep after a pass found nothing
      (it doubles up to the ceilings above).
    - ``spin_s``: how long the comm thread keeps polling, without sleeping, after
      the last progress while ops are in flight (frames are likely microseconds away).
    - ``wait_spin_s``: how long a thread in ``wait()`` polls before it sleeps, as
      ``MPI_Wait`` does.
    - ``nap_s``: how a thread that waits in the compiled lane (in ``wait()``) for a large
      op (256 KiB or more) waits once the lane has been silent for 50 µs (its peers are
      late): it sleeps ``nap_s`` (at most 0.01) between its polls, and yields its core
      between them before that.  0 (the default): it polls as for any op (a few polls,
      then yields).
      A thread that yields still takes its share of a core that another process wants
      for computing; one asleep takes none.  A node's service (``totalreduce serve``)
      naps by default, since its node's training processes compute on the cores
      (docs/daemon.md).
    - ``need_after_s``: how long a ``wait()`` lasts before the waiter asks the
      op's peers to send its frames first (NEED).
    - ``algorithm``: default allreduce algorithm (``auto`` chooses by size).
    - ``tuning_file``: the crossover table ``auto`` follows, as ``totalreduce
      tune`` writes it; for rank counts it lacks, the table shipped with the
      package (:mod:`totalreduce.service.tuning`).  ``auto`` reads it from the
      environment (``TOTALREDUCE_TUNING_FILE``) once per process, so set it
      there, on every rank: all ranks must agree.
    - ``shutdown_timeout_s``: how long ``shutdown()`` lets in-flight ops finish.
    - ``allow_serialized``: accept an MPI with only THREAD_SERIALIZED (your
      code must then make no MPI calls while totalreduce runs).
    - ``service``: ``embedded`` (this process runs its engine over MPI) or
      ``daemon`` (this process is a client rank of its node's ``totalreduce
      serve``; see docs/daemon.md).
    - ``socket``: daemon mode: the node service's socket (default: the one
      socket of the default directory).
    - ``local_rank``: daemon mode: the local slot to take (-1: the lowest free).
    - ``timeline``: write a Chrome trace of this rank's ops to this path
      (``{rank}`` in it is replaced by the rank, else ``.<rank>.json`` is
      appended); empty: no trace.  See docs/timeline.md.
    - ``lane_plan_bytes``: what the compiled lane keeps of its compiled plans (one
      per op shape: kind, count, element type, group, weights), counted as their
      words plus 4 KiB each for the schedule a plan keeps.  Past it the least
      recently used are dropped (a shape met again is compiled again), keeping
      those of ops in flight: a job whose shapes keep changing (new counts,
      dynamic topologies' weights) stays within it.  64 MiB: some 15,000 small
      shapes.  Each rank's own (nothing of it travels).
    - ``express_bytes``: what a service keeps of its express records (one per repeated
      op name and shape: service/express.py), each charged 4 KiB for itself and the
      schedule it keeps, more for a large op's segments and the arrays it holds
      (service/records.py).  Past it the least recently used are dropped (a name met
      again goes the whole way once and is kept again): a job that makes new names or
      counts every step stays within it.  64 MiB: some 16,000 small ops' records; at
      least 64 KiB.  Each rank's own.
    """

    segment_bytes: int = 1 << 20
    micro_bytes: int = 64 << 10
    floating_pool_bytes: int = 256 << 20
    stall_warning_s: float = 60.0
    stall_shutdown_s: float = 0.0
    backoff_max_s: float = 1e-3
    idle_backoff_max_s: float = 5e-2
    backoff_min_s: float = 1e-6
    spin_s: float = 2e-4
    wait_spin_s: float = 2e-2
    need_after_s: float = 5e-4
    nap_s: float = 0.0
    algorithm: str = "auto"
    tuning_file: str = ""
    shutdown_timeout_s: float = 30.0
    allow_serialized: bool = False
    service: str = "embedded"
    socket: str = ""
    local_rank: int = -1
    timeline: str = ""
    lane_plan_bytes: int = 64 << 20
    express_bytes: int = 64 << 20

    @classmethod
    def load(cls, env: dict[str, str] | None = None, **overrides: Any) -> Config:
        """Defaults, then ``TOTALREDUCE_*`` variables, then keyword overrides."""
        env = dict(os.environ) if env is None else env
        known = {f.name: f for f in fields(cls)}
        unknown = set(overrides) - set(known)
        if unknown:
            raise InvalidArgumentError(
                f"unknown option(s) {sorted(unknown)}; known: {sorted(known)}"
            )
        _retired(env)
        values: dict[str, Any] = {}
        for name, f in known.items():
            raw = env.get(ENV_PREFIX + name.upper())
            if name in overrides and overrides[name] is not None:
                values[name] = _convert(name, f.type, overrides[name])
            elif raw is not None:
                values[name] = _convert(name, f.type, raw)
        cfg = dataclasses.replace(cls(), **values)
        cfg.check()
        return cfg

    def joining(self, shared: dict[str, int], where: str) -> Config:
        """This configuration with the options a daemon world shares (``shared``, from the
        node's service at ``where``).  An option this process set to something else
        (not left at its default) is an error naming both values."""
        default = Config()
        for k, theirs in shared.items():
            mine = getattr(self, k)
            if mine != theirs and mine != getattr(default, k):
                raise InvalidArgumentError(
                    f"the service on {where} runs with {k}={theirs}, this process asks for "
                    f"{k}={mine}: every rank must agree (start the service with "
                    f"{ENV_PREFIX}{k.upper()}={mine}, or leave the option to the service)"
                )
        return dataclasses.replace(self, **shared)  # type: ignore[arg-type]

    def check(self) -> None:
        if self.segment_bytes < 64:
            raise InvalidArgumentError(f"segment_bytes must be >= 64, got {self.segment_bytes}")
        if not 0 <= self.micro_bytes <= 1 << 20:
            raise InvalidArgumentError(f"micro_bytes must be in 0..1048576, got {self.micro_bytes}")
        if self.service not in ("embedded", "daemon"):
            raise InvalidArgumentError(
                f"service must be 'embedded' or 'daemon', got {self.service!r}"
            )
        if self.local_rank < -1:
            raise InvalidArgumentError(f"local_rank must be >= 0 (or -1), got {self.local_rank}")
        for name in (
            "stall_warning_s", "stall_shutdown_s", "backoff_min_s", "backoff_max_s",
            "idle_backoff_max_s", "spin_s", "wait_spin_s", "need_after_s", "nap_s",
        ):  # fmt: skip
            value = getattr(self, name)
            if not value >= 0:  # NaN too
                raise InvalidArgumentError(f"{name} must be >= 0 seconds, got {value!r}")
        if self.nap_s > 0.01:
            raise InvalidArgumentError(
                f"nap_s must be at most 0.01 seconds (a sleep between two polls of a waiting "
                f"thread), got {self.nap_s!r}"
            )
        if self.lane_plan_bytes < 1 << 16:
            raise InvalidArgumentError(
                f"lane_plan_bytes must be >= 65536, got {self.lane_plan_bytes}"
            )
        if self.express_bytes < 1 << 16:
            raise InvalidArgumentError(f"express_bytes must be >= 65536, got {self.express_bytes}")
        if self.floating_pool_bytes < 0:
            raise InvalidArgumentError(
                f"floating_pool_bytes must be >= 0, got {self.floating_pool_bytes}"
            )


#: Options of the interpreted loop, gone with it (``TOTALREDUCE_<NAME>``): set, each is
#: ignored with a one-line warning (``LANE`` set to turn the lane off is an error).
RETIRED = ("LANE", "MAX_INFLIGHT_SENDS", "INLINE_COMPUTE_BYTES")


def _retired(env: dict[str, str]) -> None:
    """``TOTALREDUCE_LANE`` chose between two engines; there is one now, the compiled lane.
    Set to turn it off (0, false, no, off) it is an error, since nothing else can run the
    ops; set to keep it on, a one-line warning that it does nothing.  The interpreted
    loop's other options (``RETIRED``) likewise get a warning."""
    import logging

    for name in RETIRED[1:]:
        if ENV_PREFIX + name in env:
            logging.getLogger("totalreduce").warning(
                "%s%s is ignored: the interpreted loop it tuned is gone", ENV_PREFIX, name
            )
    raw = env.get(ENV_PREFIX + "LANE")
    if raw is None:
        return
    if raw.strip().lower() in ("0", "false", "no", "off", ""):
        raise InvalidArgumentError(
            f"{ENV_PREFIX}LANE={raw!r}: the interpreted main loop it chose is gone, every op "
            f"runs in the compiled lane; unset {ENV_PREFIX}LANE"
        )
    logging.getLogger("totalreduce").warning(
        "%sLANE=%s is ignored: every op runs in the compiled lane", ENV_PREFIX, raw
    )


def _convert(name: str, typ: Any, value: Any) -> Any:
    typ = {"int": int, "float": float, "str": str, "bool": bool}.get(str(typ), typ)
    try:
        if typ is bool:
            if isinstance(value, str):
                low = value.strip().lower()
                if low in ("1", "true", "yes", "on"):
                    return True
                if low in ("0", "false", "no", "off", ""):
                    return False
                raise ValueError(value)
            return bool(value)
        if typ is int and isinstance(value, str):
            return int(float(value)) if "e" in value.lower() else int(value, 0)
        return typ(value)
    except (TypeError, ValueError):
        raise InvalidArgumentError(
            f"option {name} (or {ENV_PREFIX}{name.upper()}) must be {typ.__name__}, got {value!r}"
        ) from None

"""Collective algorithms as schedules: pure data, no threads, no MPI, no I/O.

Each module holds one algorithm and documents its steps and cost; the
registry below maps the names users pass as ``algorithm=`` to them.
"""

from __future__ import annotations

from .ring import allreduce_ring
from .schedule import (
    Action,
    Buffer,
    LocalKind,
    LocalOp,
    Recv,
    Region,
    Schedule,
    SegmentPlan,
    Send,
    Step,
    balanced_parts,
    plan_segments,
)

__all__ = [
    "Action",
    "Buffer",
    "LocalKind",
    "LocalOp",
    "Recv",
    "Region",
    "Schedule",
    "SegmentPlan",
    "Send",
    "Step",
    "allreduce_ring",
    "balanced_parts",
    "plan_segments",
]

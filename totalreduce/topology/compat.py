"""Decent-DP's registration on this package's classes, and BlueFog's older import path.

Pure code.  With ``from totalreduce.topology import TopologyReg, Topology`` a Decent-DP
topology registers as its documentation writes it::

    @TopologyReg.register("my-ring")
    class MyRing(Topology):
        def _get_topo_edges(self):
            n = self._world_size
            ...

BlueFog's ``topology_util`` names live in ``bluefog.py``; they are importable from here
too, where this package first kept them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from .bluefog import (
    GetDynamicSendRecvRanks,
    GetRecvWeights,
    GetSendWeights,
    IsRegularGraph,
    IsTopologyEquivalent,
)
from .mixing import MixingTopology
from .registry import register

__all__ = [
    "GetDynamicSendRecvRanks",
    "GetRecvWeights",
    "GetSendWeights",
    "IsRegularGraph",
    "IsTopologyEquivalent",
    "TopologyReg",
]

T = TypeVar("T", bound=type[MixingTopology])


class TopologyReg:
    """Decent-DP's registry: ``@TopologyReg.register(name)`` on a :class:`Topology`."""

    @staticmethod
    def register(name: str) -> Callable[[T], T]:
        """The class decorator (the same registry as :func:`register`)."""
        return register(name)

"""Codes for collective kinds and algorithms: what every rank must agree on about an op.

They travel in every frame, so a receiver can tell that two ranks submitted the same
name and generation as different collectives or with different algorithms.  They live
here, beside the algorithms, so adding an algorithm touches this package only; the
engine carries the codes without knowing what they mean.
"""

from __future__ import annotations

import enum


class OpKind(enum.IntEnum):
    """The collective an op performs."""

    ALLREDUCE = 1
    BROADCAST = 2
    BARRIER = 3
    REDUCE_SCATTER = 4
    ALLGATHER = 5
    NEIGHBOR_ALLREDUCE = 6
    NEIGHBOR_ALLGATHER = 7
    PAIRWISE_EXCHANGE = 8
    REDUCE = 9
    GATHER = 10
    SCATTER = 11
    ALLTOALL = 12
    SEND_RECV = 13


class AlgorithmCode(enum.IntEnum):
    """The algorithm an op's schedule was made by (ranks must agree)."""

    NONE = 0
    RING = 1
    RING_CHUNKED = 2
    HALVING_DOUBLING = 3
    BCUBE = 4
    ALL_TO_ALL = 5
    ALL_TO_ONE = 6
    ONE_TO_ALL = 7
    PIPELINED = 8
    PAIRWISE = 9
    NEIGHBOR = 10
    EDGE = 11
    RECURSIVE_DOUBLING = 12
    HIERARCHICAL = 13  # three phases over clients and per-node relays (algorithms/hierarchical.py)
    DIRECT = 14  # one step straight to each destination (algorithms/rooted.py)

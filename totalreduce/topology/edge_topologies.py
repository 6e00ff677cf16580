"""The built-in edge-model topologies: ``complete``, ``ring``, ``exp`` (``one-peer-exp``),
``alternating-exp-ring``.

Every iteration is a partition of the ranks into averaging groups (see ``edge_model.py``),
so every mixing matrix here is symmetric and doubly stochastic.  Each class documents how
it handles the sizes where the naive rule breaks down (odd ring, world sizes that are not
powers of two, one rank per node, a single rank).

A shared building block is the hypercube pairing used by ``exp`` and by the inter-node
phase of ``alternating-exp-ring``: in round ``k``, member ``i`` pairs with ``i XOR 2**k``
if that member exists and otherwise sits the round out.  When the number of members is a
power of two, ``i XOR 2**k`` is ``i + 2**k`` for every ``i`` whose bit ``k`` is clear, which
is the one-peer exponential rule "``i`` pairs with ``i + 2**(t mod log2 n)``".
"""

from __future__ import annotations

from .edge_model import Edge, Topology
from .registry import register


def _rounds(members: int) -> int:
    """The number of hypercube rounds that connect ``members`` members: ceil(log2)."""
    return (members - 1).bit_length()


def _hypercube_pairs(members: int, k: int) -> list[tuple[int, ...]]:
    """Round ``k`` of the hypercube pairing of ``members`` members, singletons included."""
    bit = 1 << k
    groups: list[tuple[int, ...]] = []
    for i in range(members):
        partner = i ^ bit
        if partner >= members:
            groups.append((i,))
        elif i < partner:
            groups.append((i, partner))
    return groups


@register("complete")
class CompleteTopology(Topology):
    """Every rank averages with all the others at every iteration (an allreduce average),
    as Decent-DP's ``complete``.

    One iteration, one edge holding all ranks with weight ``1/n``, so ``W = J/n``.  For
    ``n = 1`` the single rank keeps its value.
    """

    def _edges(self) -> list[list[Edge]]:
        n = self.world_size
        return [[Edge(tuple(range(n)), 1.0 / n)]]


@register("ring")
class OnePeerRingTopology(Topology):
    """One-peer ring: each rank averages with its right neighbour, then its left one.

    Period 2, weight 1/2 in every pair.

    - Even ``n``: iteration 0 pairs ``(0, 1), (2, 3), ..., (n-2, n-1)``; iteration 1 pairs
      ``(1, 2), (3, 4), ..., (n-1, 0)``.  For ``n = 2`` both iterations pair 0 and 1.
      These are Decent-DP's ``ring`` iterations, which it builds for even ``n`` only.
    - Odd ``n >= 3`` (a ring of odd length has no perfect matching): iteration 0 pairs
      ``(0, 1), ..., (n-5, n-4)`` and the last three ranks ``(n-3, n-2, n-1)`` average
      together (a triple edge with weight 1/3, each member takes the mean of the three);
      iteration 1 pairs ``(1, 2), ..., (n-4, n-3)`` and the triple ``(n-2, n-1, 0)`` closes
      the ring.  Every ring link is used once per period, every matrix stays doubly
      stochastic, and the period mixes faster than leaving a rank out (for ``n = 9`` the
      period's rho is 0.57 with the triple against 0.88 with a rank left out).  For
      ``n = 3`` both iterations are the full average.
    - ``n = 1``: the rank keeps its value.
    """

    def _edges(self) -> list[list[Edge]]:
        n = self.world_size
        if n == 1:
            return [[Edge((0,), 1.0)]]
        if n % 2 == 0:
            first = [Edge((i, i + 1), 0.5) for i in range(0, n, 2)]
            second = [Edge(tuple(sorted((i, (i + 1) % n))), 0.5) for i in range(1, n, 2)]
            return [first, second]
        first = [Edge((i, i + 1), 0.5) for i in range(0, n - 3, 2)]
        first.append(Edge((n - 3, n - 2, n - 1), 1.0 / 3.0))
        second = [Edge((i, i + 1), 0.5) for i in range(1, n - 3, 2)]
        second.append(Edge((0, n - 2, n - 1), 1.0 / 3.0))
        return [first, second]


@register("exp")
class OnePeerExpTopology(Topology):
    """One-peer exponential: at iteration ``t`` rank ``i`` averages with ``i + 2**(t mod K)``.

    Weight 1/2 in every pair, period ``K = ceil(log2 n)``.

    - ``n`` a power of two: ``K = log2 n`` and iteration ``t`` pairs ``i`` with
      ``i + 2**t`` for every ``i`` whose bit ``t`` is clear (so ``i`` with bit ``t`` set
      pairs with ``i - 2**t``).  The product of the ``K`` matrices of a period is exactly
      ``J/n``: all ranks hold the exact average after ``log2 n`` iterations.
    - Other ``n``: the same hypercube rule, ``i`` pairs with ``i XOR 2**t``; when that rank
      does not exist (it is ``>= n``), ``i`` sits the iteration out and keeps its value.
      Every rank can reach rank 0 by clearing its bits one at a time, so the period is
      connected and its product converges (its rho works out to ``(2**K - n) / 2**K``,
      at most 1/2).
    - ``n = 1``: one iteration in which the rank keeps its value.
    """

    def _edges(self) -> list[list[Edge]]:
        n = self.world_size
        if n == 1:
            return [[Edge((0,), 1.0)]]
        return [[Edge(group, 0.5) for group in _hypercube_pairs(n, k)] for k in range(_rounds(n))]


@register("one-peer-exp")
class DecentOnePeerExpTopology(OnePeerExpTopology):
    """Decent-DP's name for ``exp``: the same schedule under the name its scripts pass.

    Decent-DP builds ``one-peer-exp`` for powers of two only; there ``exp``'s iteration
    ``t`` pairs ``i`` with ``(i + 2**t) mod n`` exactly as Decent-DP does.  Other sizes
    get ``exp``'s hypercube rule (a rank without a partner sits the iteration out).
    """


@register("alternating-exp-ring")
class AlternatingExpRingTopology(Topology):
    """Decent-DP's alternating topology: nodes average inside themselves, and pairs of nodes
    average as one group, in turns.

    Ranks are grouped by node in blocks of ``local_size``: node ``m`` holds ranks
    ``m*L .. m*L + L-1`` (``L = local_size``, required; ``n`` must be a multiple of it).
    With ``M = n / L`` nodes and ``K = ceil(log2 M)``, the period is ``2K`` iterations,
    two per round ``r = 0 .. K-1``.  In round ``r`` node ``m`` is paired with node
    ``m XOR 2**r`` (which is ``m + 2**r`` when bit ``r`` of ``m`` is clear, as in ``exp``).
    A pair does two things in its round, one per iteration:

    - *merge*: the ``2L`` ranks of both nodes form one edge of weight ``1/(2L)``, so each
      takes the mean of the two nodes;
    - *apart*: each of the two nodes is an edge of its own (weight ``1/L``), so each rank
      takes its node's mean.

    Which comes first alternates from pair to pair: the pairs are counted over the whole
    period, round by round and within a round by their lower node, and the pair counted
    ``c`` merges in the second iteration of its round when ``c`` is even and in the first
    when it is odd.  This is Decent-DP's schedule: every iteration's edges equal its
    ``alternating-exp-ring``'s for every size it accepts (``M`` a power of two, at least
    2).  Merged pairs hold equal values, so with ``M`` a power of two every rank holds the
    exact average after one period.

    Sizes Decent-DP refuses, and what happens here:

    - ``M`` not a power of two: a node whose partner ``m XOR 2**r`` does not exist sits the
      round out, averaging inside itself in both iterations (the pairs that do exist are
      counted as above);
    - a single node (``local_size == n``): there is no pair; every iteration is the node's
      average, which is the full average (period 1);
    - ``local_size == 1``: "apart" leaves a rank alone, which keeps its value (Decent-DP
      divides by zero there); each pair of ranks averages once per round;
    - ``n = 1`` (with ``local_size = 1``): the rank keeps its value.
    """

    def __init__(self, world_size: int, *, local_size: int | None = None) -> None:
        if local_size is None:
            raise ValueError(
                f"alternating-exp-ring needs local_size (ranks per node) for world size "
                f"{world_size}, e.g. local_size=8 for nodes of 8 ranks; use 'exp' if ranks "
                "are not grouped by node"
            )
        if isinstance(local_size, bool) or not isinstance(local_size, int):
            raise TypeError(f"local_size must be an int, got {local_size!r}")
        if local_size < 1:
            raise ValueError(f"local_size must be at least 1, got {local_size}")
        if isinstance(world_size, int) and world_size >= 1 and world_size % local_size:
            raise ValueError(
                f"world size {world_size} is not a multiple of local_size {local_size}; "
                "alternating-exp-ring needs the same number of ranks on every node"
            )
        self.local_size = local_size
        super().__init__(world_size)

    @property
    def nodes(self) -> int:
        """The number of nodes, ``world_size // local_size``."""
        return self.world_size // self.local_size

    def _node(self, m: int) -> tuple[int, ...]:
        return tuple(range(m * self.local_size, (m + 1) * self.local_size))

    def _edges(self) -> list[list[Edge]]:
        local = self.local_size
        if self.nodes == 1:
            return [[Edge(self._node(0), 1.0 / local)]]
        schedule: list[list[Edge]] = []
        pairs_so_far = 0
        for r in range(_rounds(self.nodes)):
            first: list[Edge] = []
            second: list[Edge] = []
            for group in _hypercube_pairs(self.nodes, r):
                apart = [Edge(self._node(m), 1.0 / local) for m in group]
                if len(group) == 1:  # no partner node this round
                    first += apart
                    second += apart
                    continue
                merged = Edge(self._node(group[0]) + self._node(group[1]), 1.0 / (2 * local))
                if pairs_so_far % 2 == 0:
                    first += apart
                    second.append(merged)
                else:
                    first.append(merged)
                    second += apart
                pairs_so_far += 1
            schedule += [first, second]
        return schedule

"""BlueFog's topology_util names and Decent-DP's TopologyReg on totalreduce.topology."""

from __future__ import annotations

import numpy as np
import pytest

from totalreduce import topology as topology_util
from totalreduce.topology import Edge, Topology, TopologyReg, get_topology, mixing_matrix


def test_decent_dp_registration_as_documented() -> None:
    @TopologyReg.register("test-dd-alt-pairs")
    class AltPairs(Topology):
        def _get_topo_edges(self):  # type: ignore[no-untyped-def]
            n = self._world_size
            return [
                [Edge(ranks=[i, (i + 1) % n], weight=0.5) for i in range(0, n, 2)],
                [Edge(ranks=[i, (i + 1) % n], weight=0.5) for i in range(1, n, 2)],
            ]

    topo = get_topology("test-dd-alt-pairs", 4)
    assert topo.period == 2
    np.testing.assert_array_equal(mixing_matrix(topo, 1)[1], [0, 0.5, 0.5, 0])


def test_a_topology_with_neither_method_is_refused_clearly() -> None:
    class Nothing(Topology):
        pass

    with pytest.raises(TypeError, match="_get_topo_edges"):
        Nothing(4)


def test_bluefog_weights_and_predicates() -> None:
    ring = topology_util.RingGraph(5)
    sw, src = topology_util.GetRecvWeights(ring, 0)
    assert sw == pytest.approx(1 / 3) and set(src) == {1, 4}
    sw2, dst = topology_util.GetSendWeights(ring, 0)
    assert set(dst) == {1, 4} and sum(dst.values()) + sw2 == pytest.approx(1.0)
    assert topology_util.IsRegularGraph(ring)
    assert not topology_util.IsRegularGraph(topology_util.StarGraph(5))
    assert topology_util.IsTopologyEquivalent(ring, topology_util.RingGraph(5))
    assert not topology_util.IsTopologyEquivalent(ring, topology_util.ExponentialTwoGraph(5))
    gen = topology_util.GetDynamicSendRecvRanks(topology_util.ExponentialTwoGraph(8), 0)
    assert [next(gen) for _ in range(3)] == [([1], [7]), ([2], [6]), ([4], [4])]

"""BlueFog's and Decent-DP's documented snippets with only their import lines changed
(test_bluefog_seed.py runs this under ``mpiexec -n 4``)."""

import torch

import totalreduce.torch as bf  # was: import bluefog.torch as bf
from totalreduce import topology as topology_util  # was: from bluefog.common import topology_util

bf.init()

# Static topology: consensus on a ring converges at the ring's rate.
bf.set_topology(topology_util.RingGraph(bf.size()))
assert bf.load_topology() is not None
n = bf.size()
assert bf.in_neighbor_ranks() == sorted({(bf.rank() - 1) % n, (bf.rank() + 1) % n})
assert bf.out_neighbor_ranks() == sorted({(bf.rank() - 1) % n, (bf.rank() + 1) % n})
x = torch.tensor([float(bf.rank())], dtype=torch.float64)
mean = (n - 1) / 2
errors = []
for _ in range(10):
    x = bf.neighbor_allreduce(x, name="x")
    errors.append(bf.allreduce((x - mean).abs(), average=True, name="err").item())
rate = (errors[-1] / errors[-5]) ** 0.25
assert rate < 0.75, rate  # ring over 4 ranks: 1/3 per step in the worst mode, 0 in others

# BlueFog's positional order: (tensor, self_weight, src_weights, dst_weights).
y = torch.tensor([float(bf.rank())], dtype=torch.float64)
left, right = (bf.rank() - 1) % n, (bf.rank() + 1) % n
y = bf.neighbor_allreduce(y, 0.5, {left: 0.5}, [right])
assert y.item() == 0.5 * bf.rank() + 0.5 * left, y

# Dynamic one-peer topology (BlueFog's example), on the exponential-2 graph.
bf.set_topology(topology_util.ExponentialTwoGraph(bf.size()))
gen = topology_util.GetDynamicSendRecvRanks(bf.load_topology(), bf.rank())
z = torch.tensor([float(bf.rank())], dtype=torch.float64)
for _ in range(4):
    send_neighbors, recv_neighbors = next(gen)
    neighbor_weights = {r: 1.0 / (len(recv_neighbors) + 1) for r in recv_neighbors}
    self_weight = 1.0 / (len(recv_neighbors) + 1)
    z = bf.neighbor_allreduce(
        z, self_weight=self_weight, src_weights=neighbor_weights, dst_weights=send_neighbors,
        name="z",
    )  # fmt: skip
assert abs(z.item() - mean) < 1e-12, z  # exact average after log2(n) one-peer steps

# Decent-DP's registration, as its documentation writes it.
from totalreduce.topology import Edge, Topology, TopologyReg  # noqa: E402 (decent_dp.topo)


@TopologyReg.register("my-pairs")
class MyPairs(Topology):
    def _get_topo_edges(self):
        return [[Edge(ranks=[i, i + 1], weight=0.5) for i in range(0, self._world_size, 2)]]


w = bf.neighbor_allreduce(
    torch.tensor([float(bf.rank())], dtype=torch.float64), topology="my-pairs"
)
assert w.item() == (bf.rank() // 2) * 2 + 0.5, w
print(f"SEED OK {bf.rank()}", flush=True)
bf.shutdown()

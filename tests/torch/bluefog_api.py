"""BlueFog's ``bluefog.torch`` calls beyond its two examples, with only the import changed
(test_bluefog_examples.py runs this under ``mpiexec -n 4``, as two machines of two ranks
when MPICH is told to split the node: ``MPIR_CVAR_NUM_CLIQUES=2``).

Each check prints ``API <name> OK rank <r>``; the values each expects are worked out here
from BlueFog's definitions, from every rank's starting value (a known function of the rank).
"""

from __future__ import annotations

import os
import tempfile

import torch

import totalreduce.torch as bf  # was: import bluefog.torch as bf
from totalreduce import topology as topology_util  # was: from bluefog.common import topology_util
from totalreduce.timeline.recorder import timeline_path
from totalreduce.timeline.trace import load as load_trace


def value(rank: int) -> torch.Tensor:
    """Rank ``rank``'s starting value."""
    return torch.tensor([1.0 + rank, 10.0 * rank * rank], dtype=torch.float64)


def close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert torch.allclose(got, want, rtol=0, atol=1e-12), f"{what}: {got.tolist()} != {want}"


def ok(name: str) -> None:
    print(f"API {name} OK rank {bf.rank()}", flush=True)


def raises(kind: type[BaseException], text: str, fn, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
    try:
        fn(*args, **kwargs)
    except kind as exc:
        assert text in str(exc), f"{kind.__name__} without {text!r}: {exc}"
        return
    raise AssertionError(f"{fn.__name__} raised no {kind.__name__} ({text!r})")


def static_defaults() -> None:
    """``neighbor_allreduce`` with no weights on the topology set: every out-neighbor, and
    equal weights unless ``is_weighted``; ``src_weights`` alone after ``set_topology``."""
    n, r = bf.size(), bf.rank()
    x = value(r)
    star = topology_util.StarGraph(n)
    bf.set_topology(star)
    assert not bf.is_topo_weighted()
    want = (
        sum(value(j) for j in range(n)) / n if r == 0 else (value(r) + value(0)) / 2
    )  # uniform: the center averages all, a leaf itself and the center
    close(bf.neighbor_allreduce(x, name="static"), want, "unweighted star")
    bf.set_topology(star, is_weighted=True)
    assert bf.is_topo_weighted()
    want = sum(value(j) for j in range(n)) / n if r == 0 else (n - 1) / n * x + value(0) / n
    close(bf.neighbor_allreduce(x, name="static"), want, "weighted star")
    # src_weights alone: the ring's in-neighbors weighed as given, the one left out by 0
    bf.set_topology(topology_util.RingGraph(n))
    left, right = (r - 1) % n, (r + 1) % n
    assert bf.in_neighbor_ranks() == sorted({left, right}) == bf.out_neighbor_ranks()
    got = bf.neighbor_allreduce(x, self_weight=0.75, src_weights={left: 0.25}, name="partial")
    close(got, 0.75 * x + 0.25 * value(left), "src_weights alone")
    raises(ValueError, "not in-neighbors", bf.neighbor_allreduce, x, self_weight=0.5,
           src_weights={(r + 2) % n: 0.5}, name="stranger")  # fmt: skip
    # BlueFog's positional order and enable_topo_check
    got = bf.neighbor_allreduce(x, 0.5, {left: 0.5}, [right], False, "positional")
    close(got, 0.5 * x + 0.5 * value(left), "positional")
    ok("static-defaults")


def networkx_topologies() -> None:
    """BlueFog's own kind of topology, a networkx DiGraph, set as is."""
    try:
        import networkx as nx
    except ImportError:
        print(f"API networkx SKIPPED rank {bf.rank()} (networkx is not installed)", flush=True)
        return
    n, r = bf.size(), bf.rank()
    x = value(r)
    ring = nx.DiGraph()
    ring.add_edges_from((i, (i + 1) % n) for i in range(n))  # no weights: only edges count
    bf.set_topology(ring)
    assert bf.in_neighbor_ranks() == [(r - 1) % n] and bf.out_neighbor_ranks() == [(r + 1) % n]
    close(bf.neighbor_allreduce(x, name="nx"), (x + value((r - 1) % n)) / 2, "networkx ring")
    star = topology_util.StarGraph(n).matrix(0).T  # BlueFog's orientation: A[src, dst]
    bf.set_topology(nx.from_numpy_array(star, create_using=nx.DiGraph), is_weighted=True)
    want = sum(value(j) for j in range(n)) / n if r == 0 else (n - 1) / n * x + value(0) / n
    close(bf.neighbor_allreduce(x, name="nx"), want, "networkx weighted star")
    ring.add_edges_from((i, i) for i in range(n))  # weights 1 and 1: no average
    raises(ValueError, "sums to", bf.set_topology, ring, is_weighted=True)
    ok("networkx")


def machines() -> None:
    """machine_rank/size, the machine topology and hierarchical_neighbor_allreduce."""
    n, r, local = bf.size(), bf.rank(), bf.local_size()
    nodes = bf.machine_size()
    assert nodes == n // local and bf.machine_rank() == r // local
    me = bf.machine_rank()
    assert bf.load_machine_topology() is None and bf.in_neighbor_machine_ranks() == []
    raises(RuntimeError, "no machine topology is set", bf.hierarchical_neighbor_allreduce, value(r))
    machine_avg = [sum(value(m * local + k) for k in range(local)) / local for m in range(nodes)]
    bf.set_machine_topology(topology_util.RingGraph(nodes))
    assert not bf.is_machine_topo_weighted()
    ring_in = sorted({(me - 1) % nodes, (me + 1) % nodes} - {me})
    assert bf.in_neighbor_machine_ranks() == ring_in == bf.out_neighbor_machine_ranks()
    got = bf.hierarchical_neighbor_allreduce(value(r), name="hier")
    want = (machine_avg[me] + sum(machine_avg[m] for m in ring_in)) / (len(ring_in) + 1)
    close(got, want, "hierarchical on the machine ring")
    if nodes >= 2:
        # BlueFog's dynamic machine loop: one machine per step, weights 1/2
        gen = topology_util.GetExp2DynamicSendRecvMachineRanks(
            world_size=n, local_size=local, self_rank=r, local_rank=bf.local_rank()
        )
        bf.set_machine_topology(topology_util.ExponentialGraph(nodes), is_weighted=True)
        assert bf.is_machine_topo_weighted()
        vals = list(machine_avg)
        x = value(r)
        for _ in range(3):
            send_machines, recv_machines = next(gen)
            x = bf.hierarchical_neighbor_allreduce(
                x, self_weight=0.5, src_machine_weights={m: 0.5 for m in recv_machines},
                dst_machine_weights=send_machines, name="hier.dynamic",
            )  # fmt: skip
            hops = (nodes - 1).bit_length()
            d = 2 ** ((_) % hops)
            vals = [0.5 * vals[m] + 0.5 * vals[(m - d) % nodes] for m in range(nodes)]
            close(x, vals[me], "hierarchical, dynamic machines")
        raises(ValueError, "give self_weight, src_machine_weights and dst_machine_weights",
               bf.hierarchical_neighbor_allreduce, x, self_weight=0.5,
               src_machine_weights={(me + 1) % nodes: 0.5})  # fmt: skip
        h = bf.hierarchical_neighbor_allreduce_nonblocking(value(r), name="hier.nb")
        e_in = bf.in_neighbor_machine_ranks()
        self_w, src_w = topology_util.GetRecvWeights(bf.load_machine_topology(), me)
        close(
            bf.synchronize(h),
            self_w * machine_avg[me] + sum(w * machine_avg[m] for m, w in src_w.items()),
            f"weighted machine graph (in-neighbors {e_in})",
        )
    ok("machines")


def allgather_and_infer() -> None:
    n, r = bf.size(), bf.rank()
    bf.set_topology(topology_util.ExponentialGraph(n))
    rows = r + 1  # the ranks differ in dimension 0, as BlueFog allows
    x = torch.full((rows, 2), float(r))
    got = bf.neighbor_allgather(x, name="gather")
    srcs = bf.in_neighbor_ranks()
    want = torch.cat([torch.full((s + 1, 2), float(s)) for s in srcs])
    assert torch.equal(got, want), (got, want)
    src = [(r - 1) % n, (r - 2) % n]  # given order is kept
    got = bf.neighbor_allgather(x, src_ranks=src, dst_ranks=[(r + 1) % n, (r + 2) % n])
    assert torch.equal(got, torch.cat([torch.full((s + 1, 2), float(s)) for s in src])), got
    h = bf.neighbor_allgather_nonblocking(torch.tensor([float(r)]), name="gather.nb")
    assert bf.synchronize(h).tolist() == [float(s) for s in srcs]
    raises(ValueError, "give src_ranks and dst_ranks together", bf.neighbor_allgather, x,
           src_ranks=[0])  # fmt: skip
    # who sends to me, from everyone's destinations
    dst = [(r + 1) % n, (r + 3) % n] if n > 3 else [(r + 1) % n]
    srcs_inferred, w = bf.InferSourceFromDestinationRanks(dst, construct_adjacency_matrix=True)
    assert srcs_inferred == sorted({(r - 1) % n, (r - 3) % n} if n > 3 else {(r - 1) % n})
    assert w.shape == (n, n) and abs(w.sum(axis=0) - 1).max() < 1e-12
    assert bf.InferDestinationFromSourceRanks(srcs_inferred) == sorted(set(dst))
    ok("allgather-infer")


def utilities() -> None:
    n, r = bf.size(), bf.rank()
    model = torch.nn.Linear(3, 2)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float(r))
    bf.allreduce_parameters(model.named_parameters())
    assert all(torch.all(p == (n - 1) / 2) for p in model.parameters())
    bf.allreduce_parameters(dict(model.named_parameters()))
    bf.set_skip_negotiate_stage(True)
    assert bf.get_skip_negotiate_stage() is True
    bf.set_skip_negotiate_stage(False)
    assert bf.unified_mpi_window_model_supported() is True
    raises(RuntimeError, "cannot be suspended", bf.suspend)
    raises(RuntimeError, "never suspended", bf.resume)
    # windows under BlueFog's current names
    bf.set_topology(topology_util.RingGraph(n))
    w = torch.zeros(2, dtype=torch.float64)
    bf.win_create(w, name="api.w", zero_init=True)
    assert "api.w" in bf.get_current_created_window_names()
    bf.neighbor_win_put(value(r), name="api.w")
    bf.barrier()
    got = bf.win_update(name="api.w", self_weight=0.0,
                        neighbor_weights={s: 0.5 for s in bf.in_neighbor_ranks()})  # fmt: skip
    close(got, sum(value(s) for s in bf.in_neighbor_ranks()) / 2, "neighbor_win_put")
    bf.barrier()
    bf.win_free(name="api.w")
    assert "api.w" not in bf.get_current_created_window_names()
    # activities of one's own on the timeline
    assert bf.timeline_start_activity("t", "a") is False  # none records yet
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    bf.start_timeline(path)
    with bf.timeline_context(tensor_name="api.tensor", activity_name="gradient computation"):
        sum(range(1000))
    bf.stop_timeline()
    events = load_trace(timeline_path(path, r))
    assert any(e.get("name") == "gradient computation" for e in events), events[:5]
    ok("utilities")


def main() -> None:
    bf.init()
    static_defaults()
    networkx_topologies()
    machines()
    allgather_and_infer()
    utilities()
    print(f"API DONE rank {bf.rank()}", flush=True)
    bf.shutdown()


if __name__ == "__main__":
    main()

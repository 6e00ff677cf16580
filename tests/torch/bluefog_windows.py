"""BlueFog's window examples with only the import lines changed (run by
test_bluefog_windows.py under ``mpiexec -n 4``).

1. Asynchronous push-sum average consensus (BlueFog's
   ``pytorch_average_consensus.py --asynchronous-mode``): every rank runs its own
   number of rounds, sleeps at its own moments, and nobody waits for anybody; the
   ratio x / p converges to the average and the total mass is kept exactly.
2. put, get, accumulate, update with weights, versions, win_mutex, clone.
3. ``DistributedWinPutOptimizer`` on a least-squares problem whose data differ per
   rank: the parameters reach consensus near the global optimum.
"""

from __future__ import annotations

import time

import torch

import totalreduce.torch as bf  # was: import bluefog.torch as bf
from totalreduce import topology as topology_util  # was: from bluefog.common import topology_util


def push_sum() -> None:
    bf.set_topology(topology_util.ExponentialTwoGraph(bf.size()))
    torch.manual_seed(12345 + bf.rank())
    start = torch.randn(50, dtype=torch.float64)
    everyone = bf.allgather(start.reshape(1, -1))
    want = everyone.mean(dim=0)

    x = start.clone()
    bf.turn_on_win_ops_with_associated_p()
    bf.win_create(x, name="x_buff", zero_init=True)
    outdegree = len(bf.out_neighbor_ranks())
    share = 1.0 / (outdegree + 1)
    for i in range(80 + 20 * bf.rank()):
        bf.win_accumulate(
            x, name="x_buff", self_weight=share,
            dst_weights={r: share for r in bf.out_neighbor_ranks()}, require_mutex=True,
        )  # fmt: skip
        bf.win_update_then_collect(name="x_buff")
        if i % 5 == bf.rank():
            time.sleep(0.002)
    bf.barrier()
    bf.win_update_then_collect(name="x_buff")  # what arrived after this rank's last round
    p = bf.win_associated_p(name="x_buff")
    mass = bf.allreduce(x, average=False, name="mass")
    total_p = bf.allreduce(torch.tensor([p], dtype=torch.float64), average=False, name="p")
    bf.win_free()
    bf.turn_off_win_ops_with_associated_p()
    assert torch.allclose(mass, everyone.sum(dim=0), rtol=1e-12, atol=1e-12), (mass, everyone)
    assert abs(float(total_p) - bf.size()) < 1e-12, float(total_p)
    err = float((x / p - want).abs().max())
    assert err < 1e-6, f"rank {bf.rank()}: push-sum error {err}"
    print(f"PUSH-SUM OK {bf.rank()} err {err:.2e}", flush=True)


def window_basics() -> None:
    bf.set_topology(topology_util.RingGraph(bf.size()))
    me, n = bf.rank(), bf.size()
    x = torch.full((3, 4), float(me), dtype=torch.float32)
    bf.win_create(x, name="w")
    ins, outs = bf.in_neighbor_ranks(), bf.out_neighbor_ranks()
    # not zero-initialised: the slots start as this rank's own tensor, so an update is x
    assert torch.equal(bf.win_update(name="w", clone=True), x)
    bf.barrier()
    h = bf.win_put_nonblocking(x, name="w", dst_weights={r: 2.0 for r in outs})
    assert bf.win_wait(h) and bf.win_poll(h)
    bf.barrier()  # a completed put has landed
    assert bf.get_win_version(name="w") == {r: 1 for r in ins}, bf.get_win_version(name="w")
    with bf.win_mutex(name="w", for_self=True):
        y = bf.win_update(name="w", self_weight=0.0, neighbor_weights={r: 0.5 for r in ins})
    assert y is x  # in place, the registered tensor
    want = sum(0.5 * 2.0 * r for r in ins)  # each slot holds 2 * its rank
    assert torch.allclose(x, torch.full_like(x, want)), (x, want)
    bf.barrier()
    bf.win_get(name="w", src_weights={r: 1.0 for r in ins})  # their values now: `want` of theirs
    assert bf.get_win_version(name="w") == {r: 1 for r in ins}
    bf.barrier()
    assert bf.win_free(name="w")
    print(f"WINDOWS OK {me} of {n}", flush=True)


def win_put_optimizer() -> None:
    bf.set_topology(topology_util.ExponentialTwoGraph(bf.size()))
    torch.manual_seed(0)
    w_true = torch.tensor([[1.0, -2.0, 0.5]], dtype=torch.float64)
    g = torch.Generator().manual_seed(100 + bf.rank())
    X = torch.randn(64, 3, generator=g, dtype=torch.float64) + 0.3 * bf.rank()
    Y = X @ w_true.T + 0.01 * torch.randn(64, 1, generator=g, dtype=torch.float64)
    model = torch.nn.Linear(3, 1, bias=False).double()
    bf.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = bf.DistributedWinPutOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model=model)
    first = None
    for _ in range(300):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(X), Y)
        loss.backward()
        opt.step()
        first = float(loss.detach()) if first is None else first
    bf.barrier()
    opt.step()  # mix in the last puts once more
    weights = bf.allgather(model.weight.detach().clone())
    spread = float((weights - weights.mean(dim=0)).abs().max())
    err = float((model.weight.detach() - w_true).abs().max())
    opt.free_windows()
    assert float(loss.detach()) < first / 100, (first, float(loss.detach()))
    assert spread < 1e-2 and err < 5e-2, (spread, err)
    print(f"WIN PUT OPTIMIZER OK {bf.rank()} spread {spread:.1e} err {err:.1e}", flush=True)


def main() -> None:
    bf.init()
    push_sum()
    window_basics()
    win_put_optimizer()
    bf.shutdown()


if __name__ == "__main__":
    main()

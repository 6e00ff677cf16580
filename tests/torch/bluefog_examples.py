"""BlueFog's two examples, reproduced call for call as a port runs them, at P=4 in one process.

``examples/pytorch_average_consensus.py`` with every topology of its ``--virtual-topology``
(expo2, expo3, expo4, ring, mesh, star, full) and every mode of its flags (plain,
``--enable-dynamic-topology``, ``--asynchronous-mode``, both), and its push-sum branch that
carries p by hand; and ``examples/pytorch_optimization.py`` with every ``--method``
(exact_diffusion, diffusion, gradient_tracking, push_diging) on every ``--topology`` (mesh,
star, ring, expo2) for the logistic regression, and exact diffusion on the ring for the
linear one.  The examples' imports become the two lines below and nothing else changes: the calls
and their arguments here are theirs (test_bluefog_examples.py runs this under
``mpiexec -n 4``; each example would start a process per case, which costs seconds each).
Flag values are chosen for time: ``--data-size 1000 --max-iters 100`` for the consensus,
and for the optimization ``--lr 0.5 --max-iter 120`` (the logistic regression on every
topology) and ``--lr 0.1 --max-iter 200`` (the linear one, exact diffusion on the ring; at
0.5 gradient tracking diverges there, in BlueFog's arithmetic as here).

What each case must show, on every rank:

- consensus: ``|x - mean| / |mean|`` below 1e-10 after the iterations; the one-peer rotation
  of the star is row stochastic only (the leaves all send to the center), so there the
  ranks must agree with each other (within 1e-8) instead.  Push-sum
  (``--asynchronous-mode``) keeps the mean of p at 1 exactly whatever the timing; how near
  x/p gets within the example's unsynchronised loop depends on the scheduler, so it is
  printed, and after the loop rounds with a barrier (push, barrier, collect; up to 100,
  fewer once every rank is within 1e-9) must bring it below 1e-8;
- optimization: starting 1 away from it, the distributed gradient descent's solution
  ``w_opt`` has a global gradient below 1e-3 (1e-4 to 1e-5 is what the step size and the
  iterations give); exact diffusion, gradient tracking and push-DIGing come within 1e-3 of
  it (their global gradient below 1e-3); diffusion, which keeps a bias of the order of the
  step size, must have settled (its last step below 1e-3) within half of ``|w_opt|`` of it
  (its bias is 0.06 to 0.3 of it here).

Prints ``CASE <label> OK <numbers>`` or ``CASE <label> FAILED: <why>`` per case and rank,
then ``EXAMPLES DONE <rank> failed=<n>``.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

import totalreduce.torch as bf  # was: import bluefog.torch as bf
from totalreduce import topology as topology_util  # was: from bluefog.common import topology_util

CONSENSUS_TOPOLOGIES = ("expo2", "expo3", "expo4", "ring", "mesh", "star", "full")
OPTIMIZATION_TOPOLOGIES = ("mesh", "star", "ring", "expo2")
METHODS = ("exact_diffusion", "diffusion", "gradient_tracking", "push_diging")

DATA_SIZE = 1000  # the example's --data-size (default 100000)
MAX_ITERS = 100  # its --max-iters (default 200)
SEED = 2020  # its --seed
SETTLE_ROUNDS = 100  # at most, push-sum rounds with a barrier after the example's loop
#: pytorch_optimization.py's --lr and --max-iter (defaults 0.1 and 1000) per --task
OPT_SETTINGS = {"logistic_regression": (0.5, 120), "linear_regression": (0.1, 200)}
TOLERANCE = 1e-3  # of the optimization, for w_opt at distance 1 from the start


def relative_error(x: torch.Tensor, x_bar: torch.Tensor) -> float:
    return float(torch.norm(x - x_bar, p=2) / torch.norm(x_bar, p=2))


# ---------------------------------------------------------------- average consensus


def set_consensus_topology(name: str) -> None:
    """The example's ``--virtual-topology`` chain.  ``expo2`` keeps what ``bf.init()`` set,
    BlueFog's exponential graph; the cases share a process here, so it is set again."""
    n = bf.size()
    if name == "expo2":
        bf.set_topology(topology_util.ExponentialGraph(n))
    elif name == "expo3":
        bf.set_topology(topology_util.ExponentialGraph(bf.size(), base=3))
    elif name == "expo4":
        bf.set_topology(topology_util.ExponentialGraph(bf.size(), base=4))
    elif name == "ring":
        bf.set_topology(topology_util.RingGraph(bf.size(), connect_style=1))
    elif name == "mesh":
        bf.set_topology(topology_util.RingGraph(bf.size(), connect_style=0), is_weighted=True)
    elif name == "star":
        bf.set_topology(topology_util.StarGraph(bf.size()), is_weighted=True)
    elif name == "full":
        bf.set_topology(topology_util.FullyConnectedGraph(bf.size()))
    else:
        raise ValueError(f"unknown virtual topology {name}")


def consensus_sync(topology: str, dynamic: bool) -> str:
    set_consensus_topology(topology)
    torch.random.manual_seed(SEED * bf.rank())
    x = torch.randn(DATA_SIZE, dtype=torch.double)
    x_bar = bf.allreduce(x, average=True)
    self_weight = neighbor_weights = send_neighbors = None
    if dynamic:
        gen = topology_util.GetDynamicOnePeerSendRecvRanks(bf.load_topology(), bf.rank())
    for _ in range(MAX_ITERS):
        if dynamic:
            send_neighbors, recv_neighbors = next(gen)
            neighbor_weights = {r: 1 / (len(recv_neighbors) + 1) for r in recv_neighbors}
            self_weight = 1 / (len(recv_neighbors) + 1)
        x = bf.neighbor_allreduce(
            x, name="x", self_weight=self_weight, src_weights=neighbor_weights,
            dst_weights=send_neighbors, enable_topo_check=False,
        )  # fmt: skip
    error = relative_error(x, x_bar)
    if dynamic and topology == "star":
        # every leaf sends to the center at every step: rows sum to 1, columns do not, so
        # the ranks agree on a weighted mean, not the plain one
        spread = relative_error(x, bf.allreduce(x, average=True))
        assert spread < 1e-8, f"the ranks disagree by {spread:.3g}"
        return f"spread={spread:.3g} distance to the mean={error:.3g}"
    assert error < 1e-10, f"|x - mean| / |mean| = {error:.3g} after {MAX_ITERS} iterations"
    return f"error={error:.3g}"


def push_sum_weights(i: int, dynamic: bool) -> tuple[float, dict[int, float]]:
    """The example's weights of round ``i``."""
    outdegree = len(bf.out_neighbor_ranks())
    if dynamic:
        num_out_neighbors = len(bf.out_neighbor_ranks())
        sent_neighbor = bf.out_neighbor_ranks()[i % num_out_neighbors]
        return 0.5, {sent_neighbor: 0.5}
    return 1 / (1 + outdegree), {rank: 1.0 / (outdegree + 1) for rank in bf.out_neighbor_ranks()}


def worst(error: float) -> float:
    """The largest ``error`` of all ranks (the same on every rank: they stop together)."""
    return float(bf.allreduce(torch.tensor([error]), op="max", name="worst").item())


def consensus_push_sum(topology: str, dynamic: bool) -> str:
    """``--asynchronous-mode``: the branch a build without NCCL takes (p travels with x)."""
    set_consensus_topology(topology)
    torch.random.manual_seed(SEED * bf.rank())
    x = torch.randn(DATA_SIZE, dtype=torch.double)
    x_bar = bf.allreduce(x, average=True)
    assert not bf.nccl_built()
    bf.turn_on_win_ops_with_associated_p()
    bf.win_create(x, name="x", zero_init=True)
    for i in range(MAX_ITERS):
        self_weight, dst_weights = push_sum_weights(i, dynamic)
        bf.win_accumulate(
            x, name="x", self_weight=self_weight, dst_weights=dst_weights, require_mutex=True
        )
        bf.win_update_then_collect(name="x")
        associated_p = bf.win_associated_p(name="x")
    bf.barrier()  # the example's last synchronisation
    bf.win_update_then_collect(name="x")
    associated_p = bf.win_associated_p(name="x")
    in_loop = relative_error(x / associated_p, x_bar)
    p_push_sum = bf.allreduce(torch.DoubleTensor([associated_p]), average=True)
    assert abs(p_push_sum.item() - 1.0) < 1e-12, f"the mean of p is {p_push_sum.item()!r}"
    for i in range(SETTLE_ROUNDS):
        self_weight, dst_weights = push_sum_weights(MAX_ITERS + i, dynamic)
        bf.win_accumulate(
            x, name="x", self_weight=self_weight, dst_weights=dst_weights, require_mutex=True
        )
        bf.barrier()  # every push of the round has landed
        bf.win_update_then_collect(name="x")
        if i % 5 == 4 and worst(relative_error(x / bf.win_associated_p(name="x"), x_bar)) < 1e-9:
            break
    settled = relative_error(x / bf.win_associated_p(name="x"), x_bar)
    bf.turn_off_win_ops_with_associated_p()
    bf.win_free(name="x")
    assert settled < 1e-8, f"x/p is {settled:.3g} from the mean after {SETTLE_ROUNDS} rounds"
    return f"p mean={p_push_sum.item():.17g} loop error={in_loop:.3g} settled={settled:.3g}"


def consensus_push_sum_by_hand(topology: str, dynamic: bool) -> str:
    """The example's other push-sum branch (BlueFog takes it when built with NCCL): p is
    the last element of the window, pushed and collected with x."""
    set_consensus_topology(topology)
    torch.random.manual_seed(SEED * bf.rank())
    x = torch.randn(DATA_SIZE, dtype=torch.double)
    x_bar = bf.allreduce(x, average=True)
    p = torch.DoubleTensor([1.0]).to(x.device)
    x_ext = torch.cat([x, p], 0)
    bf.win_create(x_ext, name="x_ext", zero_init=True)

    def push(i: int) -> None:
        self_weight, dst_weights = push_sum_weights(i, dynamic)
        bf.win_accumulate(
            x_ext, name="x_ext", self_weight=self_weight, dst_weights=dst_weights,
            require_mutex=True,
        )  # fmt: skip

    for i in range(MAX_ITERS):
        push(i)
        bf.win_update_then_collect(name="x_ext")
        x, associated_p = x_ext[:-1], x_ext[-1]
    bf.barrier()
    bf.win_update_then_collect(name="x_ext")
    for i in range(SETTLE_ROUNDS):  # as in consensus_push_sum
        push(MAX_ITERS + i)
        bf.barrier()
        bf.win_update_then_collect(name="x_ext")
        if i % 5 == 4 and worst(relative_error(x_ext[:-1] / x_ext[-1], x_bar)) < 1e-9:
            break
    x, associated_p = x_ext[:-1], x_ext[-1]
    settled = relative_error(x / associated_p, x_bar)
    p_push_sum = bf.allreduce(torch.DoubleTensor([associated_p]), average=True)
    bf.win_free(name="x_ext")
    assert abs(p_push_sum.item() - 1.0) < 1e-12, f"the mean of p is {p_push_sum.item()!r}"
    assert settled < 1e-8, f"x/p is {settled:.3g} from the mean"
    return f"p mean={p_push_sum.item():.17g} settled={settled:.3g}"


# ---------------------------------------------------------------- optimization


def set_optimization_topology(name: str) -> None:
    """The example's ``--topology`` chain."""
    if name == "mesh":
        bf.set_topology(topology_util.MeshGrid2DGraph(bf.size()), is_weighted=True)
    elif name == "expo2":
        bf.set_topology(topology_util.ExponentialGraph(bf.size()))
    elif name == "star":
        bf.set_topology(topology_util.StarGraph(bf.size()), is_weighted=True)
    elif name == "ring":
        bf.set_topology(topology_util.RingGraph(bf.size()))
    else:
        raise ValueError(f"unknown topology {name}")


def generate_data(m: int, n: int, task: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Each rank's own synthetic problem, as the example draws it."""
    if task == "logistic_regression":
        X = torch.randn(m, n).to(torch.double)
        w_0 = (torch.randn(n, 1)).to(torch.double)
        y = (torch.rand(m, 1).to(torch.double) < 1 / (1 + torch.exp(X.mm(w_0)))).double()
        return X, 2 * y - 1
    X = torch.randn(m, n).to(torch.double)
    x_o = torch.randn(n, 1).to(torch.double)
    return X, X.mm(x_o) + 0.1 * torch.randn(m, 1).to(torch.double)


def loss_step(X: torch.Tensor, y: torch.Tensor, x_: torch.Tensor, tensor_name: str,
              task: str, rho: float) -> torch.Tensor:  # fmt: skip
    """The local loss and its gradient (autograd), inside a timeline activity when the
    example's variable asks for one."""

    def step() -> torch.Tensor:
        if task == "logistic_regression":
            loss = torch.mean(torch.log(1 + torch.exp(-y * X.mm(x_)))) + 0.5 * rho * torch.norm(
                x_, p=2
            )
        else:
            loss = 0.5 * torch.mean(torch.norm(X.mm(x_) - y, p=2))
        loss.backward()
        return loss

    if os.getenv("BLUEFOG_TIMELINE"):
        with bf.timeline_context(tensor_name=tensor_name, activity_name="gradient computation"):
            return step()
    return step()


def distributed_grad_descent(X: Any, y: Any, task: str, n: int, maxite: int, alpha: float,
                             rho: float) -> torch.Tensor:  # fmt: skip
    w_opt = torch.zeros(n, 1, dtype=torch.double, requires_grad=True)
    for _ in range(maxite):
        loss_step(X, y, w_opt, "allreduce.gradient", task, rho)
        grad = bf.allreduce(w_opt.grad.data, name="gradient")
        w_opt.data = w_opt.data - alpha * grad
        w_opt.grad.data.zero_()
    loss_step(X, y, w_opt, "allreduce.gradient", task, rho)
    grad = bf.allreduce(w_opt.grad.data, name="gradient")
    w_opt.grad.data.zero_()
    norm = float(torch.norm(grad, p=2))
    assert norm < TOLERANCE, f"distributed gradient descent: global gradient {norm:.3g}"
    return w_opt


class Run:
    """A method's result: its ``w``, and the size of its last step."""

    def __init__(self, w: torch.Tensor, last_step: float) -> None:
        self.w, self.last_step = w, last_step


def diffusion(X: Any, y: Any, task: str, n: int, maxite: int, alpha: float, rho: float) -> Run:
    topology = bf.load_topology()
    self_weight, neighbor_weights = topology_util.GetRecvWeights(topology, bf.rank())
    w = torch.zeros(n, 1, dtype=torch.double, requires_grad=True)
    step = float("inf")
    for _ in range(maxite):
        loss_step(X, y, w, "neighbor.allreduce.local_variable", task, rho)
        with torch.no_grad():
            phi = w - alpha * w.grad.data
            new = bf.neighbor_allreduce(
                phi, self_weight=self_weight, src_weights=neighbor_weights, name="local variable"
            )
            step = float(torch.norm(new - w.data))
            w.data = new
            w.grad.data.zero_()
    return Run(w, step)


def exact_diffusion(X: Any, y: Any, task: str, n: int, maxite: int, alpha: float,
                    rho: float) -> Run:  # fmt: skip
    topology = bf.load_topology()
    self_weight, neighbor_weights = topology_util.GetRecvWeights(topology, bf.rank())
    w = torch.zeros(n, 1, dtype=torch.double, requires_grad=True)
    psi_prev = w.clone()
    self_weight = (self_weight + 1) / 2  # the example's A-bar = (I + A) / 2
    for k, v in neighbor_weights.items():
        neighbor_weights[k] = v / 2
    for _ in range(maxite):
        loss_step(X, y, w, "neighbor.allreduce.local_variable", task, rho)
        with torch.no_grad():
            psi = w - alpha * w.grad.data
            phi = psi + w.data - psi_prev
            w.data = bf.neighbor_allreduce(
                phi, self_weight=self_weight, src_weights=neighbor_weights, name="local variable"
            )
            psi_prev = psi.clone()
            w.grad.data.zero_()
    return Run(w, 0.0)


def gradient_tracking(X: Any, y: Any, task: str, n: int, maxite: int, alpha: float,
                      rho: float) -> Run:  # fmt: skip
    w = torch.zeros(n, 1, dtype=torch.double, requires_grad=True)
    loss_step(X, y, w, "neighbor.allreduce.Grad.Tracking.w", task, rho)
    q = w.grad.data.clone()
    w.grad.data.zero_()
    grad_prev = q.clone()
    for _ in range(maxite):
        w_handle = bf.neighbor_allreduce_nonblocking(w.data, name="Grad.Tracking.w")
        q_handle = bf.neighbor_allreduce_nonblocking(q, name="Grad.Tracking.q")
        w.data = bf.synchronize(w_handle) - alpha * q
        loss_step(X, y, w, "neighbor.allreduce.Grad.Tracking.w", task, rho)
        grad = w.grad.data.clone()
        q = bf.synchronize(q_handle) + grad - grad_prev
        grad_prev = grad
        w.grad.data.zero_()
    return Run(w, 0.0)


def push_diging(X: Any, y: Any, task: str, n: int, maxite: int, alpha: float,
                rho: float) -> Run:  # fmt: skip
    outdegree = len(bf.out_neighbor_ranks())
    w = torch.zeros(2 * n + 1, 1).to(torch.double)  # [u, y, v]
    x = torch.zeros(n, 1, dtype=torch.double, requires_grad=True)
    loss_step(X, y, x, "w_buff", task, rho)
    w[n : 2 * n] = x.grad.data.clone()
    x.grad.data.zero_()
    w[-1] = 1.0
    grad_prev = w[n : 2 * n].clone()
    bf.win_create(w, name="w_buff", zero_init=True)
    for _ in range(maxite):
        bf.barrier()
        w[:n] = w[:n] - alpha * w[n : 2 * n]
        bf.win_accumulate(
            w, name="w_buff",
            dst_weights={rank: 1.0 / (outdegree * 2) for rank in bf.out_neighbor_ranks()},
            require_mutex=True,
        )  # fmt: skip
        w.div_(2)
        bf.barrier()
        w = bf.win_update_then_collect(name="w_buff")
        x.data = w[:n] / w[-1]
        loss_step(X, y, x, "w_buff", task, rho)
        grad = x.grad.data.clone()
        x.grad.data.zero_()
        w[n : 2 * n] += grad - grad_prev
        grad_prev = grad
    bf.barrier()
    w = bf.win_update_then_collect(name="w_buff")
    x.data = w[:n] / w[-1]
    bf.win_free(name="w_buff")  # the example ends its process here instead
    return Run(x, 0.0)


SOLVERS: dict[str, Callable[..., Run]] = {
    "diffusion": diffusion,
    "exact_diffusion": exact_diffusion,
    "gradient_tracking": gradient_tracking,
    "push_diging": push_diging,
}


def optimization(method: str, topology: str, task: str, w_opts: dict[str, Any]) -> str:
    set_optimization_topology(topology)
    torch.random.manual_seed(123417 * bf.rank())
    m, n, rho = 20, 5, 1e-2
    alpha, maxite = OPT_SETTINGS[task]
    X, y = generate_data(m, n, task)
    if task not in w_opts:  # the same on every topology: an allreduce's
        w_opts[task] = distributed_grad_descent(X, y, task, n, maxite, alpha, rho)
    w_opt = w_opts[task]
    run = SOLVERS[method](X, y, task, n, maxite, alpha, rho)
    w = run.w
    loss_step(X, y, w, "w_buff", task, rho)
    global_grad = float(torch.norm(bf.allreduce(w.grad.data, name="gradient"), p=2))
    distance = float(torch.norm(w.data - w_opt.data, p=2))
    scale = float(torch.norm(w_opt.data, p=2))
    if method == "diffusion":
        assert run.last_step < TOLERANCE, f"diffusion moves: its last step was {run.last_step:.3g}"
        assert distance < 0.5 * scale, f"|w - w_opt| = {distance:.3g}, |w_opt| = {scale:.3g}"
    else:
        assert distance < TOLERANCE, f"|w - w_opt| = {distance:.3g}"
        assert global_grad < TOLERANCE, f"global gradient {global_grad:.3g}"
    return f"|w - w_opt|={distance:.3g} global gradient={global_grad:.3g}"


# ---------------------------------------------------------------- the cases


def cases() -> list[tuple[str, Callable[[], str]]]:
    out: list[tuple[str, Callable[[], str]]] = []
    for topo in CONSENSUS_TOPOLOGIES:
        out.append((f"consensus {topo}", lambda t=topo: consensus_sync(t, False)))
        out.append((f"consensus {topo} dynamic", lambda t=topo: consensus_sync(t, True)))
        out.append((f"consensus {topo} asynchronous", lambda t=topo: consensus_push_sum(t, False)))
        out.append(
            (f"consensus {topo} asynchronous dynamic", lambda t=topo: consensus_push_sum(t, True))
        )
    out.append(
        ("consensus star asynchronous dynamic, p by hand",
         lambda: consensus_push_sum_by_hand("star", True))
    )  # fmt: skip
    w_opts: dict[str, Any] = {}
    for topo in OPTIMIZATION_TOPOLOGIES:
        for method in METHODS:
            out.append(
                (f"optimization {method} {topo} logistic_regression",
                 lambda mt=method, t=topo: optimization(mt, t, "logistic_regression", w_opts))
            )  # fmt: skip
    out.append(
        ("optimization exact_diffusion ring linear_regression",
         lambda: optimization("exact_diffusion", "ring", "linear_regression", w_opts))
    )  # fmt: skip
    return out


#: Every case's label, in the order they run.
LABELS = [label for label, _ in cases()]
#: The cases a default run takes (the others with ``--full``): the average consensus of
#: one topology in its four modes and by hand, and each optimization method once.
REPRESENTATIVE = (
    "consensus expo2",
    "consensus star asynchronous dynamic, p by hand",
    *(f"optimization {method} ring logistic_regression" for method in METHODS),
    "optimization exact_diffusion ring linear_regression",
)


def representative(label: str) -> bool:
    """Whether a default run takes case ``label``."""
    return label in REPRESENTATIVE or label.startswith("consensus expo2 ")


def main() -> None:
    bf.init()
    only = sys.argv[1:]
    failed = 0
    for label, run in cases():
        if only == ["--representative"]:
            if not representative(label):
                continue
        elif only and not any(label.startswith(o) for o in only):
            continue
        t0 = time.perf_counter()
        try:
            detail = run()
            print(f"CASE {label} OK {detail} ({time.perf_counter() - t0:.2f} s)", flush=True)
        except Exception as exc:
            failed += 1
            print(f"CASE {label} FAILED: {exc!r}\n{traceback.format_exc()}", flush=True)
        bf.barrier()
    print(f"EXAMPLES DONE {bf.rank()} failed={failed}", flush=True)
    bf.shutdown()


if __name__ == "__main__":
    main()

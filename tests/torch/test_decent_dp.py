"""totalreduce.torch.decent_dp: Decent-DP's DecentralizedDataParallel, optimizers and helpers.

The ranks run as threads over the local transport.  Their parameters must follow
decent_dp_reference.py, a restatement of Decent-DP's algorithm for P ranks in one process.
"""

from __future__ import annotations

import copy
import functools
import math

import numpy as np
import pytest

from conftest import import_torch

torch = import_torch()

from decent_dp_reference import Reference  # noqa: E402

import totalreduce.torch as trt  # noqa: E402
from conftest import local_services, run_ranks  # noqa: E402
from totalreduce.errors import InvalidArgumentError  # noqa: E402
from totalreduce.topology import get_topology  # noqa: E402
from totalreduce.torch import decent_dp  # noqa: E402
from totalreduce.torch.decent_dp import (  # noqa: E402
    AccumAdam,
    AccumAdamW,
    DecentralizedDataParallel,
    lr_scheduler_fn_cosine_with_warmup,
    optim_fn_accum_adam,
    optim_fn_accum_adamw,
    optim_fn_adam,
    optim_fn_adamw,
)

torch.set_num_threads(1)
P = 4
TEACHER = torch.Generator().manual_seed(7)
W_TRUE = torch.randn(10, 1, generator=TEACHER, dtype=torch.float64)


def _net(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(10, 12), torch.nn.ReLU(), torch.nn.Linear(12, 1)
    ).double()


# Built here, not in the ranks' threads: they would race for torch's global generator.
_NETS = [_net(seed) for seed in range(P)]


def net(seed: int) -> torch.nn.Module:
    """A model of its own, initialized from seed ``seed``."""
    return copy.deepcopy(_NETS[seed])


def batch(rank: int, it: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * it + rank)
    x = torch.randn(8, 10, generator=g, dtype=torch.float64)
    return x, x @ W_TRUE


def mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out, y)


def flat(module: torch.nn.Module) -> np.ndarray:
    return torch.cat([q.detach().reshape(-1) for q in module.parameters()]).numpy().copy()


def train_ranks(make, iterations: int, *, evals: tuple[int, ...] = (), p: int = P):
    """Each rank: ``make(service, rank)`` -> its wrapped model; the README's loop; returns
    every rank's (flat parameters, losses, learning rates, wrapped model)."""

    def rank(s):
        model = make(s, s.rank)
        losses, lrs = [], []
        for it in range(iterations):
            model.train()
            x, y = batch(s.rank, it)
            loss = mse(model(x), y)
            model.zero_grad()
            loss.backward()
            losses.append(loss.item())
            if model._buckets and model._buckets[0].scheduler is not None:
                lrs.append(model.get_lr())
            if it in evals:  # evaluation forward passes count no iteration
                model.eval()
                with torch.no_grad():
                    model(x)
        return flat(model._model), losses, lrs, model

    with local_services(p) as svcs:
        return run_ranks(svcs, rank)


def reference_run(topology, iterations: int, *, p: int = P, **kw) -> Reference:
    ref = Reference(net(0), p, topology, kw.pop("optim_fn", optim_fn_adamw), **kw)
    for it in range(iterations):
        ref.iteration(lambda r, it=it: batch(r, it), mse)
    return ref


CASES = [
    ("complete", {}),
    ("ring", {}),
    ("one-peer-exp", {}),
    ("alternating-exp-ring", {"local_world_size": 2}),
]


@pytest.mark.parametrize(("topology", "options"), CASES)
def test_parameters_follow_decent_dp_s_algorithm(topology: str, options: dict) -> None:
    """Every rank's parameters after 7 iterations are Decent-DP's, to rounding, with a
    scheduler and evaluation passes between iterations."""
    sched = functools.partial(lr_scheduler_fn_cosine_with_warmup, t_max=10, t_warmup=3)
    got = train_ranks(
        lambda s, r: DecentralizedDataParallel(
            net(r), optim_fn_adamw, sched, topology, service=s, **options
        ),
        7,
        evals=(2, 4),
    )
    local = options.get("local_world_size")
    topo = get_topology(topology, P, **({"local_size": local} if local else {}))
    ref = reference_run(topo, 7, lr_scheduler_fn=sched)
    for r, (params, _losses, lrs, _model) in enumerate(got):
        np.testing.assert_allclose(params, flat(ref.ranks[r].model), rtol=0, atol=1e-12)
        assert lrs[-1] == pytest.approx(ref.ranks[r].scheds[0].get_last_lr()[0])
    # each rank's last step is its own: the ranks differ, and the check compares each
    assert min(np.abs(got[0][0] - g[0]).max() for g in got[1:]) > 1e-6


def test_the_step_sequence_matters() -> None:
    """The check above can fail: the reference walking the ring from step 0 (not
    Decent-DP's 1, 3, 4, ...) gives other numbers."""
    got = train_ranks(
        lambda s, r: DecentralizedDataParallel(net(r), optim_fn_adamw, None, "ring", service=s), 6
    )

    class Shifted(Reference):
        def _send(self, step: int) -> None:
            super()._send(step - 1)

    ref = Shifted(net(0), P, get_topology("ring", P), optim_fn_adamw)
    for it in range(6):
        ref.iteration(lambda r, it=it: batch(r, it), mse)
    assert np.abs(got[1][0] - flat(ref.ranks[1].model)).max() > 1e-6


@pytest.mark.parametrize("as_view", [True, False])
def test_buckets_clipping_scaler_and_adaptive_factor(as_view: bool) -> None:
    """Small buckets (each clipped on its own), a GradScaler, an adaptive factor from the
    fourth iteration on: still Decent-DP's numbers."""
    names = [n for n, _ in net(0).named_parameters()]
    # in gradient order 2.bias, 2.weight, 0.bias, 0.weight: each counted as 32, 32, 32,
    # 128 float64s (256, 512, 768, 1792 B so far): buckets cut at >= 700 B
    size_mb = 700 / 2**20

    def make(s, r):
        model = DecentralizedDataParallel(
            net(r), optim_fn_adam, None, "ring", torch.amp.GradScaler("cpu", init_scale=64.0),
            0.05, as_view, False, size_mb, service=s,
        )  # fmt: skip
        return model

    def rank(s):
        model = make(s, s.rank)
        for it in range(7):
            if it == 3:
                model.set_adaptive_factor(0.5)
            x, y = batch(s.rank, it)
            loss = mse(model(x), y)
            model.zero_grad()
            model._scaler.scale(loss).backward()
        return flat(model._model), [b.names for b in model._buckets]

    with local_services(P) as svcs:
        got = run_ranks(svcs, rank)
    buckets = [["2.bias", "2.weight", "0.bias"], ["0.weight"]]
    assert sorted(sum(buckets, [])) == sorted(names)
    assert got[0][1] == buckets
    scalers = [torch.amp.GradScaler("cpu", init_scale=64.0) for _ in range(P)]
    ref = Reference(
        net(0), P, get_topology("ring", P), optim_fn_adam, buckets=buckets,
        grad_clip_norm=0.05, scalers=scalers,
    )  # fmt: skip
    for it in range(7):
        if it == 3:
            ref.adaptive = 0.5
        ref.iteration(lambda r, it=it: batch(r, it), mse)
    for r in range(P):
        np.testing.assert_allclose(got[r][0], flat(ref.ranks[r].model), rtol=0, atol=1e-12)
    # clipping per bucket is not clipping the whole: the check sees the difference
    whole = Reference(
        net(0), P, get_topology("ring", P), optim_fn_adam, grad_clip_norm=0.05,
        scalers=[torch.amp.GradScaler("cpu", init_scale=64.0) for _ in range(P)],
    )  # fmt: skip
    for it in range(7):
        whole.adaptive = 0.5 if it >= 3 else 1.0
        whole.iteration(lambda r, it=it: batch(r, it), mse)
    assert np.abs(got[0][0] - flat(whole.ranks[0].model)).max() > 1e-9


def test_parameters_are_views_of_their_bucket() -> None:
    def rank(s):
        model = DecentralizedDataParallel(net(s.rank), optim_fn_adamw, service=s)
        for it in range(2):
            x, y = batch(s.rank, it)
            model.zero_grad()
            mse(model(x), y).backward()
        slab = model._buckets[0].slabs[0]
        ptr = slab.flat.untyped_storage().data_ptr()
        return all(q.untyped_storage().data_ptr() == ptr for q in model.parameters())

    with local_services(2) as svcs:
        assert run_ranks(svcs, rank) == [True, True]


def test_global_avg_revert_and_distance_to_the_center() -> None:
    def rank(s):
        inner = torch.nn.Sequential(
            torch.nn.Linear(10, 6), torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 1)
        ).double()
        model = DecentralizedDataParallel(
            inner, optim_fn_adamw, topology="ring", sync_buffer_in_global_avg=True, service=s
        )
        for it in range(5):
            x, y = batch(s.rank, it)
            model.zero_grad()
            mse(model(x), y).backward()
        before = flat(inner)
        buffer_before = inner[1].running_mean.clone()
        d2c = model.global_avg(will_revert=True, return_d2c=True)
        averaged = flat(inner), inner[1].running_mean.clone()
        model.revert_global_avg()
        return before, buffer_before, d2c, averaged, flat(inner)

    with local_services(P) as svcs:
        got = run_ranks(svcs, rank)
    mean = np.mean([g[0] for g in got], axis=0)
    buffer_mean = torch.stack([g[1] for g in got]).mean(dim=0)
    assert np.abs(got[0][0] - got[1][0]).max() > 1e-6  # the ring left them apart
    for before, _, d2c, (params, buffer), reverted in got:
        np.testing.assert_allclose(params, mean, rtol=0, atol=1e-13)
        torch.testing.assert_close(buffer, buffer_mean, rtol=0, atol=1e-13)
        assert d2c == pytest.approx(float(np.linalg.norm(before - mean)), rel=1e-9)
        np.testing.assert_array_equal(reverted, before)


@pytest.mark.parametrize("will_revert", [True, False])
def test_global_avg_keeps_or_drops_the_averages_in_flight(will_revert: bool) -> None:
    """With will_revert the next iteration still applies the average in flight (Decent-DP
    mixes the values sent before); without it that average is dropped."""
    zero_lr = functools.partial(optim_fn_adamw, lr=0.0, weight_decay=0.0)

    def rank(s):
        model = DecentralizedDataParallel(net(s.rank), zero_lr, topology="ring", service=s)
        with torch.no_grad():  # different parameters on every rank, after the broadcast
            for q in model.parameters():
                q.add_(float(s.rank))
        for it in range(3):
            x, y = batch(s.rank, it)
            model.zero_grad()
            mse(model(x), y).backward()
        sent = flat(model._model)  # what the last backward sent
        model.global_avg(will_revert=will_revert)
        x, y = batch(s.rank, 3)
        model.zero_grad()
        mse(model(x), y).backward()  # mixes (or not), a zero step, sends
        return sent, flat(model._model)

    with local_services(P) as svcs:
        got = run_ranks(svcs, rank)
    sent = np.stack([g[0] for g in got])
    mean = sent.mean(axis=0)
    w = get_topology("ring", P).matrix(4)  # the last send was for step 4 (3 forwards + 1)
    for r, (_, after) in enumerate(got):
        want = w[r] @ sent if will_revert else mean
        np.testing.assert_allclose(after, want, rtol=0, atol=1e-12)


def test_gradient_accumulation_steps_with_the_sum() -> None:
    """Two accumulated backward passes and a third step as one backward pass of the three
    losses' sum: the same parameters (Decent-DP's set_accumulate_grad)."""

    def run(accumulate: bool):
        def rank(s):
            model = DecentralizedDataParallel(
                net(s.rank), optim_fn_adamw, topology="one-peer-exp", service=s
            )
            for it in range(5):
                parts = [batch(s.rank, 10 * it + k) for k in range(3)]
                if accumulate:
                    model.set_accumulate_grad(True)
                    for k, (x, y) in enumerate(parts):
                        if k == 2:
                            model.set_accumulate_grad(False)
                        loss = mse(model(x), y)
                        if k == 0:
                            model.zero_grad()
                        loss.backward()
                else:
                    out = model(torch.cat([x for x, _ in parts]))
                    model.zero_grad()
                    sum(mse(out[8 * k : 8 * k + 8], y) for k, (_, y) in enumerate(parts)).backward()
            return flat(model._model), model._step

        with local_services(P) as svcs:
            return run_ranks(svcs, rank)

    for (a, steps_a), (b, steps_b) in zip(run(True), run(False), strict=True):
        assert steps_a == steps_b == 5
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-12)


def test_pre_average_hook_sees_decent_dp_s_edges_and_comm_buffers() -> None:
    calls: dict[int, list] = {r: [] for r in range(P)}

    class Aware(torch.optim.SGD):
        def pre_average_hook(self, edge, weight):
            first = self.first_layer
            calls[self.rank].append((edge.ranks, weight, first.comm_buffer.clone()))

    def rank(s):
        inner = net(s.rank)

        def optim_fn(params):
            opt = Aware([q for _, q in params], lr=0.01)
            opt.rank, opt.first_layer = s.rank, inner[0].weight
            return opt

        model = DecentralizedDataParallel(inner, optim_fn, topology="ring", service=s)
        at_forward = []  # the first layer's weight in each forward pass: what was last sent
        for it in range(4):
            x, y = batch(s.rank, it)
            out = model(x)
            at_forward.append(inner[0].weight.detach().clone())
            model.zero_grad()
            mse(out, y).backward()
        return at_forward

    with local_services(P) as svcs:
        sent = run_ranks(svcs, rank)
    ring = get_topology("ring", P)
    for r in range(P):
        # the first step's hook (before anything was received), then the averages of
        # steps 1, 3, 4 as they are applied
        assert [c[0] for c in calls[r]] == [ring.edge_of(r, t).ranks for t in (1, 1, 3, 4)]
        assert all(c[1] == 0.5 for c in calls[r])
        for (ranks, _, comm), it in zip(calls[r][1:], (1, 2, 3), strict=True):
            # the edge's sum of (1 - w) / (k - 1) x_j: what each member sent, halved
            want = sum(0.5 * sent[j][it] for j in ranks)
            torch.testing.assert_close(comm, want, rtol=0, atol=1e-13)


def test_eval_does_not_count_and_train_returns_the_wrapper() -> None:
    with local_services(1) as (s,):
        model = DecentralizedDataParallel(net(0), optim_fn_adamw, service=s)
        assert model.train() is model and model.eval() is model
        assert not model._model.training
        model(batch(0, 0)[0])
        assert model._step == 0 and model.get_lr() == 0.0
        model.train()
        model(batch(0, 0)[0])
        assert model._step == 1
        assert [n for n, _ in model.named_parameters()][0] == "_model.0.weight"
        assert list(model.state_dict())[0] == "_model.0.weight"


def test_unused_parameters_are_left_out_with_a_warning() -> None:
    class TwoHeads(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.spare = torch.nn.Linear(10, 1).double(), torch.nn.Linear(3, 1)

        def forward(self, x):
            return self.body(x)

    with local_services(1) as (s,):
        model = DecentralizedDataParallel(TwoHeads(), optim_fn_adamw, service=s)
        x, y = batch(0, 0)
        mse(model(x), y).backward()
        with pytest.warns(UserWarning, match=r"\['spare.weight', 'spare.bias'\] received no"):
            mse(model(x), y).backward()
        assert [b.names for b in model._buckets] == [["body.bias", "body.weight"]]


# ---------------------------------------------------------------------- errors


def test_bad_arguments_name_what_is_wrong() -> None:
    with local_services(2) as (s, _):
        m = net(0)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        with pytest.raises(InvalidArgumentError, match="optim_fn must be a function.*takes an"):
            DecentralizedDataParallel(m, opt, service=s)
        with pytest.raises(InvalidArgumentError, match="unknown topology 'torus'.*one-peer-exp"):
            DecentralizedDataParallel(m, optim_fn_adamw, topology="torus", service=s)
        with pytest.raises(InvalidArgumentError, match="world size 2 is not a multiple of"):
            DecentralizedDataParallel(
                m, optim_fn_adamw, topology="alternating-exp-ring", local_world_size=3, service=s
            )
        with pytest.raises(InvalidArgumentError, match="local_world_size=2 and _local_world_si"):
            DecentralizedDataParallel(m, optim_fn_adamw, None, "ring", None, 0.0, True, False,
                                      25, 1, local_world_size=2, service=s)  # fmt: skip
        with pytest.raises(InvalidArgumentError, match="grad_clip_norm must be a number >= 0"):
            DecentralizedDataParallel(m, optim_fn_adamw, grad_clip_norm=-1, service=s)
        with pytest.raises(InvalidArgumentError, match="bucket_size_in_mb must be a number > 0"):
            DecentralizedDataParallel(m, optim_fn_adamw, bucket_size_in_mb=0, service=s)
        with pytest.raises(InvalidArgumentError, match="scaler must be a torch.amp.GradScaler"):
            DecentralizedDataParallel(m, optim_fn_adamw, scaler=object(), service=s)
        with pytest.raises(InvalidArgumentError, match="lr_scheduler_fn must be a function"):
            DecentralizedDataParallel(m, optim_fn_adamw, lr_scheduler_fn=3, service=s)
    with pytest.raises(InvalidArgumentError, match="takes an optimizer.*decent_dp"):
        trt.DecentralizedDataParallel(net(0), optim_fn_adamw)


def test_errors_while_training_name_the_cause() -> None:
    with local_services(1) as (s,):
        model = DecentralizedDataParallel(net(0), lambda ps: "sgd", service=s)
        for it in range(2):
            x, y = batch(0, it)
            model.zero_grad()
            if it == 1:
                with pytest.raises(InvalidArgumentError, match="must return an optimizer.*str"):
                    model(x)
            else:
                mse(model(x), y).backward()

        model = DecentralizedDataParallel(net(0), optim_fn_adamw, service=s)
        x, y = batch(0, 0)
        model(x)  # no backward in the first iteration
        with pytest.raises(RuntimeError, match="no parameter received a gradient"):
            model(x)

        model = DecentralizedDataParallel(net(0), optim_fn_adamw, service=s)
        out = model(x)
        mse(out, y).backward(retain_graph=True)
        with pytest.raises(RuntimeError, match=r"'\d.\w+' received its gradient twice"):
            mse(out, y).backward()

        model = DecentralizedDataParallel(net(0), optim_fn_adamw, service=s)
        with pytest.raises(RuntimeError, match="nothing to revert"):
            model.revert_global_avg()
        with pytest.raises(InvalidArgumentError, match="adaptive factor must be a number"):
            model.set_adaptive_factor("half")
        for it in range(2):
            x, y = batch(0, it)
            model.zero_grad()
            mse(model(x), y).backward()
        with pytest.raises(RuntimeError, match="get_lr.*pass lr_scheduler_fn"):
            model.get_lr()


def test_ranks_with_different_models_all_raise_naming_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # rank 2's initial broadcast would not match the others' either: leave it out
    monkeypatch.setattr(decent_dp, "broadcast_parameters", lambda *a, **k: None)

    def rank(s):
        inner = net(0) if s.rank != 2 else torch.nn.Linear(10, 1).double()
        model = DecentralizedDataParallel(inner, optim_fn_adamw, service=s, prefix="odd.")
        for it in range(2):
            x, y = batch(s.rank, it)
            model.zero_grad()
            try:
                mse(model(x), y).backward()
            except RuntimeError as exc:
                return str(exc)
        return "no error"

    with local_services(3) as svcs:
        messages = run_ranks(svcs, rank)
    for msg in messages:
        assert "differ between rank 0 and ranks [2]" in msg


def test_initialize_dist_names_what_it_needs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with pytest.raises(RuntimeError, match="needs LOCAL_WORLD_SIZE and LOCAL_RANK.*mpiexec"):
        decent_dp.initialize_dist()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    with pytest.raises(ValueError, match="lists 3 devices for LOCAL_WORLD_SIZE=2"):
        decent_dp.initialize_dist()


# ---------------------------------------------------------------------- optimizers


def named(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return list(model.named_parameters())


def test_optim_fns_split_as_decent_dp_does() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    model.add_module("bn_scale", torch.nn.Linear(2, 1, bias=False))
    for fn, cls, decay in [
        (optim_fn_adam, torch.optim.Adam, 1 / 32768),
        (optim_fn_adamw, torch.optim.AdamW, 0.1),
        (optim_fn_accum_adam, AccumAdam, 1 / 32768),
        (optim_fn_accum_adamw, AccumAdamW, 0.1),
    ]:
        opt = fn(named(model))
        assert type(opt) is cls
        plain, decayed = opt.param_groups
        # decay on names with "bn" or "bias", none on the others (Decent-DP's split)
        ids = {id(q): n for n, q in named(model)}
        assert [ids[id(q)] for q in plain["params"]] == ["0.weight", "1.weight"]
        assert [ids[id(q)] for q in decayed["params"]] == ["0.bias", "1.bias", "bn_scale.weight"]
        assert plain["weight_decay"] == 0.0 and decayed["weight_decay"] == decay
        assert plain["lr"] == 1e-3 and plain["betas"] == (0.9, 0.999) and plain["eps"] == 1e-8
    assert optim_fn_accum_adamw(named(model)).param_groups[0]["accum_iter"] == 4
    custom = functools.partial(optim_fn_adamw, lr=0.5, beta1=0.8, weight_decay=0.2)(named(model))
    assert custom.param_groups[1]["lr"] == 0.5 and custom.param_groups[1]["betas"][0] == 0.8


def run_optimizer(opt_cls, steps: int = 9, **kw) -> list[np.ndarray]:
    torch.manual_seed(3)
    p = torch.nn.Parameter(torch.randn(5, dtype=torch.float64))
    opt = opt_cls([p], **kw)
    g = torch.Generator().manual_seed(4)
    out = []
    for _ in range(steps):
        p.grad = torch.randn(5, generator=g, dtype=torch.float64)
        opt.step()
        out.append(p.detach().numpy().copy())
    return out


@pytest.mark.parametrize(
    ("ours", "torchs"), [(AccumAdam, torch.optim.Adam), (AccumAdamW, torch.optim.AdamW)]
)
def test_accum_adam_with_one_step_per_round_is_adam(ours, torchs) -> None:
    kw = dict(lr=0.01, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.05)
    a = run_optimizer(ours, accum_iter=1, **kw)
    b = run_optimizer(torchs, **kw)
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-14)


@pytest.mark.parametrize("decoupled", [False, True])
def test_accum_adam_advances_its_moments_every_accum_iter_steps(decoupled: bool) -> None:
    lr, b1, b2, eps, wd, k = 0.01, 0.8, 0.95, 1e-6, 0.05, 3
    got = run_optimizer(
        AccumAdamW if decoupled else AccumAdam, lr=lr, betas=(b1, b2), eps=eps,
        weight_decay=wd, accum_iter=k,
    )  # fmt: skip
    # The rule, step by step: moments m, v (Adam's, of the mean gradient of each round
    # of k steps); each step looks ahead with its own gradient.
    torch.manual_seed(3)
    x = torch.randn(5, dtype=torch.float64)
    gen = torch.Generator().manual_seed(4)
    m = torch.zeros(5, dtype=torch.float64)
    v = torch.zeros(5, dtype=torch.float64)
    round_grads = []
    for step in range(1, 10):
        g = torch.randn(5, generator=gen, dtype=torch.float64)
        if decoupled:
            x = x * (1 - lr * wd)
        else:
            g = g + wd * x
        round_grads.append(g)
        rounds = math.ceil(step / k)
        look_m = b1 * m + (1 - b1) * g
        look_v = b2 * v + (1 - b2) * g * g
        x = x - lr / (1 - b1**rounds) * look_m / (look_v.sqrt() / math.sqrt(1 - b2**rounds) + eps)
        if step % k == 0:
            mean = sum(round_grads) / k
            m, v = b1 * m + (1 - b1) * mean, b2 * v + (1 - b2) * mean * mean
            round_grads = []
        np.testing.assert_allclose(got[step - 1], x.numpy(), rtol=0, atol=1e-14, err_msg=step)


def test_accum_adam_refuses_bad_hyper_parameters() -> None:
    p = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(InvalidArgumentError, match="accum_iter must be an int >= 1, got 0"):
        AccumAdamW(p, accum_iter=0)
    with pytest.raises(InvalidArgumentError, match=r"betas must be two numbers in \[0, 1\)"):
        AccumAdam(p, betas=(0.9, 1.0))


def test_cosine_with_warmup() -> None:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = lr_scheduler_fn_cosine_with_warmup(opt, t_max=6, t_warmup=4, cosine_eta_min=0.1)
    lrs = []
    for _ in range(10):
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    warm = [0.01 + (1 - 0.01) * t / 4 for t in range(4)]
    cosine = [0.1 + 0.9 * (1 + math.cos(math.pi * t / 6)) / 2 for t in range(6)]
    np.testing.assert_allclose(lrs, warm + cosine, rtol=0, atol=1e-12)

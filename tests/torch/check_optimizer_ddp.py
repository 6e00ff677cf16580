"""Run under ``mpiexec -n P``: DistributedOptimizer trains as DDP does (test_optimizer_ddp.py).

Every rank builds the same float64 model from one seed, feeds its own batches
and trains ``STEPS`` steps of SGD with momentum three ways: with
``DistributedOptimizer`` at several bucket caps, with DDP over gloo and with
DDP over the ``"totalreduce"`` backend.  DDP multiplies each gradient by
``1/P`` and sums; so does the optimizer's bucket, so with two ranks (one
addition, which is commutative) the parameters must be bitwise equal.  With
more ranks the order of the additions may differ between gloo and the
engine's algorithm, so they must agree to 1e-12.  Each rank prints
``OPTIMIZER-DDP OK rank R`` when its checks passed.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import totalreduce.torch as trt

torch.set_num_threads(1)
STEPS = 6


class Net(torch.nn.Module):
    """A small conv net: parameters of several sizes, so the caps below make several buckets."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(8, 16, 3, padding=1)
        self.fc1 = torch.nn.Linear(16 * 4 * 4, 32)
        self.fc2 = torch.nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.max_pool2d(torch.tanh(self.conv1(x)), 2)
        h = torch.nn.functional.max_pool2d(torch.tanh(self.conv2(h)), 2)
        return self.fc2(torch.tanh(self.fc1(h.flatten(1))))


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def main() -> None:
    dist.init_process_group(backend="totalreduce", init_method="totalreduce://")
    rank, size = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    torch.manual_seed(11)
    template = Net().double()
    g = torch.Generator().manual_seed(200 + rank)
    xs = torch.randn(STEPS, 4, 3, 16, 16, generator=g, dtype=torch.float64)
    ys = torch.randint(0, 5, (STEPS, 4), generator=g)
    loss_fn = torch.nn.CrossEntropyLoss()

    def train(kind: str, fusion_bytes: int = 0) -> torch.Tensor:
        model = copy.deepcopy(template)
        if kind == "optimizer":
            opt = trt.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                named_parameters=model.named_parameters(),
                fusion_bytes=fusion_bytes,
                prefix=f"fb{fusion_bytes}.",
            )
            net: torch.nn.Module = model
        else:
            net = DDP(model, process_group=gloo if kind == "gloo" else None, bucket_cap_mb=0.01)
            opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
        for k in range(STEPS):
            opt.zero_grad()
            loss_fn(net(xs[k]), ys[k]).backward()
            opt.step()
        return flat(model)

    want = train("gloo")
    assert not torch.equal(want, flat(template)), "DDP did not train"
    candidates = {"DDP over totalreduce": train("totalreduce")}
    total = sum(p.numel() * p.element_size() for p in template.parameters())
    # No fusion (each gradient alone, averaged in place by the engine), several buckets, one.
    for fb in (0, 4096, total // 3, 25 << 20):
        candidates[f"DistributedOptimizer fusion_bytes={fb}"] = train("optimizer", fb)
    for what, got in candidates.items():
        err = float((got - want).abs().max())
        if size == 2:
            assert torch.equal(got, want), f"{what} differs from DDP over gloo by {err}"
        else:
            assert err < 1e-12, f"{what} differs from DDP over gloo by {err}"
    everyone = [torch.empty_like(want) for _ in range(size)]
    dist.all_gather(everyone, candidates["DistributedOptimizer fusion_bytes=4096"], group=gloo)
    assert all(torch.equal(everyone[0], e) for e in everyone), "ranks disagree"
    print(f"OPTIMIZER-DDP OK rank {rank}", flush=True)
    dist.destroy_process_group()
    trt.shutdown()


if __name__ == "__main__":
    main()

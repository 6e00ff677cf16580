"""A torchft-style DDP training script (the shape of torchft's ``train_ddp.py``), with only
its imports pointing at ``totalreduce.torch.ft``.  Synthetic data, a small model, CPU.

Environment: ``REPLICA_GROUP_ID``, ``NUM_REPLICA_GROUPS``, ``STEPS``, ``STEP_SLEEP``,
``START_AFTER`` (the test's knobs); ``TOTALREDUCE_FT_SOCKET`` names the node's service.
Prints ``[step] loss = ...`` per committed step and, at the end, ``FINAL step sha`` of the
parameters.
"""

import hashlib
import logging
import os
import sys
import time
from datetime import timedelta

import torch
from torch import nn, optim

from totalreduce.torch.ft import (
    DistributedDataParallel,
    DistributedSampler,
    Manager,
    Optimizer,
    PGTransport,
    ProcessGroupGloo,
    ProcessGroupNCCL,
)

logging.basicConfig(level=logging.WARNING)


def make_data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 16, generator=g)
    w = torch.randn(16, 4, generator=g)
    y = (x @ w).argmax(dim=1)
    return torch.utils.data.TensorDataset(x, y)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(1)
    while os.environ.get("START_AFTER") and not os.path.exists(os.environ["START_AFTER"]):
        time.sleep(0.01)  # (a test's replacement, started early: its imports take seconds)
    replica_group_id = int(os.environ.get("REPLICA_GROUP_ID", 0))
    num_replica_groups = int(os.environ.get("NUM_REPLICA_GROUPS", 2))
    steps = int(os.environ.get("STEPS", 20))
    trainset = make_data()
    sampler = DistributedSampler(
        trainset,
        replica_rank=replica_group_id,
        num_replica_groups=num_replica_groups,
        group_rank=0,
        num_replicas=1,
        shuffle=True,
    )
    trainloader = torch.utils.data.DataLoader(trainset, batch_size=32, sampler=sampler)

    def load_state_dict(state_dict):
        m.load_state_dict(state_dict["model"])
        optimizer.load_state_dict(state_dict["optim"])

    def state_dict():
        return {"model": m.state_dict(), "optim": optimizer.state_dict()}

    device = "cuda" if torch.cuda.is_available() else "cpu"
    pg = (
        ProcessGroupNCCL(timeout=timedelta(seconds=30))
        if device == "cuda"
        else ProcessGroupGloo(timeout=timedelta(seconds=5))
    )
    transport = PGTransport(pg, timeout=timedelta(seconds=10), device=device)
    manager = Manager(
        pg=pg,
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"train_ddp_{replica_group_id}",
        timeout=timedelta(seconds=30),
        checkpoint_transport=transport,
    )
    m = Net().to(device)
    m = DistributedDataParallel(manager, m)
    optimizer = Optimizer(manager, optim.AdamW(m.parameters()))
    criterion = nn.CrossEntropyLoss()

    while True:
        for inputs, labels in trainloader:
            inputs, labels = inputs.to(device), labels.to(device)
            optimizer.zero_grad()
            out = m(inputs)
            loss = criterion(out, labels)
            loss.backward()
            optimizer.step()
            time.sleep(float(os.environ.get("STEP_SLEEP", 0)))  # (a test's kill lands mid-run)
            print(f"[{manager.current_step()}] loss = {loss.item()}", flush=True)
            if manager.current_step() >= steps:
                raw = b"".join(p.detach().cpu().numpy().tobytes() for p in m.parameters())
                sha = hashlib.sha1(raw).hexdigest()[:16]
                print(f"FINAL {manager.current_step()} {sha}", flush=True)
                manager.shutdown()
                sys.exit(0)


if __name__ == "__main__":
    main()

"""Decent-DP's README example ("Quickstart") with its imports changed, under ``mpiexec -n 4``.

Usage: ``decent_dp_readme.py TOPOLOGY [LOCAL_WORLD_SIZE]``.  The calls are the README's:
``initialize_dist()``, the same model, ``DecentDP(model, optim_fn=optim_fn_adamw,
topology=...)``, then per epoch ``model.train()``, ``output = model(data)``, MSE,
``model.zero_grad()``, ``loss.backward()`` (no ``optimizer.step()``), and ``model.eval()``
with a validation loop under ``torch.no_grad()``.  The README leaves ``num_epochs``,
``train_loader`` and ``val_loader`` to the reader: here a noisy linear target, a shard of
its own per rank.  ``LOCAL_WORLD_SIZE`` (for ``alternating-exp-ring``: 2 makes the 4 ranks
two nodes of 2) is passed as Decent-DP's ``_local_world_size``.  ``.cuda()`` becomes
``.to(device)`` so that the script runs without a GPU.

Each rank prints ``README <topology> OK rank R ...`` when the training loss went down to
a third of the first epoch's, the validation loss too, the ranks stayed close to each other
while training, and ``global_avg()`` left them all with one model.
"""

import sys

import torch
import torch.nn as nn

import totalreduce.torch as trt  # the checks only
from totalreduce.torch.decent_dp import DecentralizedDataParallel as DecentDP
from totalreduce.torch.decent_dp import initialize_dist, optim_fn_adamw

topology = sys.argv[1]
extra = {"_local_world_size": int(sys.argv[2])} if len(sys.argv) > 2 else {}

# Initialize distributed environment
rank, world_size = initialize_dist()
device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(1234 + rank)  # each rank's own initial model: rank 0's is broadcast

# Create your model
model = nn.Sequential(nn.Linear(10, 50), nn.ReLU(), nn.Linear(50, 1)).to(device)

# Wrap model with DecentDP
model = DecentDP(model, optim_fn=optim_fn_adamw, topology=topology, **extra)

# The README's undefined names: a linear target with noise, sharded by rank.
data_gen = torch.Generator().manual_seed(99)
w_true = 0.2 * torch.randn(10, 1, generator=data_gen)


def loader(split: int, batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1000 * split + rank)
    out = []
    for _ in range(batches):
        x = torch.randn(32, 10, generator=g)
        out.append((x, x @ w_true + 0.01 * torch.randn(32, 1, generator=g)))
    return out


num_epochs = 3
train_loader = loader(1, 25)
val_loader = loader(2, 4)

train_losses, val_losses, spreads = [], [], []
for epoch in range(num_epochs):  # noqa: B007 (the README's loop)
    model.train()
    total = 0.0
    for batch_idx, (data, target) in enumerate(train_loader):  # noqa: B007
        data, target = data.to(device), target.to(device)
        output = model(data)
        loss = nn.functional.mse_loss(output, target)

        # Zero gradients, backward pass
        model.zero_grad()
        loss.backward()
        # Note: optimizer.step() is automatically called by DecentDP
        total += loss.item()
    train_losses.append(total / len(train_loader))

    # Evaluation
    model.eval()
    with torch.no_grad():
        total = 0.0
        for data, target in val_loader:
            data, target = data.to(device), target.to(device)
            output = model(data)
            val_loss = nn.functional.mse_loss(output, target)
            total += val_loss.item()
    val_losses.append(total / len(val_loader))
    # how far this rank's model is from the ranks' mean (then put back)
    spreads.append(model.global_avg(will_revert=True, return_d2c=True))
    model.revert_global_avg()

model.global_avg(will_revert=False)
flat = torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()])
size = flat.norm().item()
others = trt.allgather_object(flat, name=f"readme.{topology}.final")
agree = max((o - flat).abs().max().item() for o in others)
problems = []
if not train_losses[-1] < train_losses[0] / 3:
    problems.append(f"training loss {train_losses[0]:.4f} -> {train_losses[-1]:.4f}")
if not val_losses[-1] < val_losses[0]:
    problems.append(f"validation loss {val_losses[0]:.4f} -> {val_losses[-1]:.4f}")
if not max(spreads) < 0.05 * size:
    problems.append(f"distance to the mean {spreads} against a norm of {size:.3f}")
if agree != 0.0:
    problems.append(f"after global_avg() the ranks' models differ by {agree}")
if problems:
    raise SystemExit(f"rank {rank} {topology}: " + "; ".join(problems))
print(
    f"README {topology} OK rank {rank} train loss {train_losses[0]:.4f} -> "
    f"{train_losses[-1]:.4f}, validation {val_losses[0]:.4f} -> {val_losses[-1]:.4f}, "
    f"distance to the mean {max(spreads):.2e}"
)

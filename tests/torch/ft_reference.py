"""What ``ft_train_ddp.py`` computes with ``NUM_REPLICA_GROUPS`` members and no fault, in one
process: each replica's batch, the gradients averaged as the services do (summed, then
divided by the members), one AdamW step.  Prints ``FINAL step sha`` and the losses."""

import hashlib
import os
import sys

import torch
from torch import nn, optim

sys.path.insert(0, os.path.dirname(__file__))
from ft_train_ddp import Net, make_data  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(1)
    n = int(os.environ.get("NUM_REPLICA_GROUPS", 2))
    steps = int(os.environ.get("STEPS", 20))
    data = make_data()
    loaders = []
    for r in range(n):
        sampler = torch.utils.data.distributed.DistributedSampler(
            data, rank=r, num_replicas=n, shuffle=True
        )
        loaders.append(torch.utils.data.DataLoader(data, batch_size=32, sampler=sampler))
    model = Net()
    opt = optim.AdamW(model.parameters())
    criterion = nn.CrossEntropyLoss()
    iters = [iter(x) for x in loaders]
    for step in range(steps):
        grads = []
        for r in range(n):
            try:
                x, y = next(iters[r])
            except StopIteration:
                iters[r] = iter(loaders[r])
                x, y = next(iters[r])
            model.zero_grad(set_to_none=True)
            loss = criterion(model(x), y)
            loss.backward()
            grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
            if r == 0:
                print(f"[{step}] loss = {loss.item()}", flush=True)
        total = grads[0].clone()
        for g in grads[1:]:
            total += g
        total /= n
        off = 0
        for p in model.parameters():
            k = p.numel()
            p.grad = total[off : off + k].view_as(p).clone()
            off += k
        opt.step()
    raw = b"".join(p.detach().numpy().tobytes() for p in model.parameters())
    print(f"FINAL {steps} {hashlib.sha1(raw).hexdigest()[:16]}", flush=True)


if __name__ == "__main__":
    main()

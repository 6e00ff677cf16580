"""A Horovod ``pytorch_synthetic_benchmark``-style script with only its import changed, plus
the Horovod names it and others use (test_horovod_script.py runs it under mpiexec -n 2)."""

import torch
import torch.nn.functional as F

import totalreduce.torch as hvd  # was: import horovod.torch as hvd

hvd.init()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size())
compression = hvd.Compression.none
# Horovod's positional order: (optimizer, named_parameters, compression, ...).
optimizer = hvd.DistributedOptimizer(
    optimizer, model.named_parameters(), compression, 1, hvd.Average, 1.0
)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)
hvd.broadcast_parameters(model.parameters(), root_rank=0)  # bare parameters work too
data = torch.randn(32, 8, generator=torch.Generator().manual_seed(hvd.rank()))
target = torch.randint(0, 4, (32,), generator=torch.Generator().manual_seed(7 + hvd.rank()))
for _ in range(3):
    optimizer.zero_grad()
    loss = F.cross_entropy(model(data), target)
    loss.backward()
    optimizer.step()
# Every rank ends with the same parameters.
for name, p in model.named_parameters():
    ref = hvd.broadcast(p.detach().clone(), root_rank=0, name=f"check.{name}")
    assert torch.equal(ref, p.detach()), name

r, n = hvd.rank(), hvd.size()
# allreduce with Horovod's average=
t = torch.tensor([float(r + 1)])
assert hvd.allreduce(t, average=False, name="s").item() == n * (n + 1) / 2
assert hvd.allreduce(t, average=True, name="a").item() == (n + 1) / 2
# Horovod's compression, prescale_factor and postscale_factor
f = torch.arange(6, dtype=torch.float32) + r
want_avg = torch.arange(6, dtype=torch.float32) + (n - 1) / 2
got = hvd.allreduce(f, average=True, name="fp16", compression=hvd.Compression.fp16)
assert got.dtype == torch.float32 and torch.allclose(got, want_avg), got
got = hvd.allreduce(f, op=hvd.Sum, name="scaled", prescale_factor=2.0, postscale_factor=0.25)
assert torch.allclose(got, want_avg * n * 0.5), got
g2 = f.clone()
hvd.allreduce_(
    g2, op=hvd.Sum, name="scaled_", prescale_factor=0.5, compression=hvd.Compression.fp16
)
assert torch.allclose(g2, want_avg * n * 0.5) and torch.equal(f, torch.arange(6.0) + r), g2
# grouped_allreduce
outs = hvd.grouped_allreduce([torch.ones(3) * (r + 1), torch.full((2,), 2.0)], average=False)
assert torch.equal(outs[0], torch.ones(3) * n * (n + 1) / 2) and torch.equal(
    outs[1], torch.full((2,), 2.0 * n)
)
# alltoall: equal rows, and splits with the received counts back
x = torch.arange(n * 2, dtype=torch.float32).reshape(n, 2) + 100 * r
y = hvd.alltoall(x, name="a2a")
assert torch.equal(
    y, torch.stack([torch.tensor([2.0 * r, 2.0 * r + 1]) + 100 * j for j in range(n)])
)
splits = [j + 1 for j in range(n)]
z = torch.full((sum(splits), 3), float(r))
got, received = hvd.alltoall(z, splits=splits, name="a2a.uneven")
assert received.tolist() == [r + 1] * n and got.shape == (n * (r + 1), 3)
assert torch.equal(got[:, 0], torch.repeat_interleave(torch.arange(n, dtype=torch.float32), r + 1))
# reducescatter: Horovod's average by default, split along dimension 0
rows = 2 * n + 1
full = torch.arange(rows * 2, dtype=torch.float64).reshape(rows, 2) * (r + 1)
part = hvd.reducescatter(full, name="rs")
mine = [3 if j == 0 else 2 for j in range(n)]
start = sum(mine[:r])
want = torch.arange(rows * 2, dtype=torch.float64).reshape(rows, 2)[start : start + mine[r]]
assert torch.allclose(part, want * (n + 1) / 2), (part, want)
# Adasum: orthogonal gradients add, equal ones average; the same bits on every rank
e = torch.zeros(n, dtype=torch.float64)
e[r] = r + 1.0
assert torch.equal(hvd.allreduce(e, op=hvd.Adasum, name="ada"), torch.arange(1.0, n + 1))
g = torch.randn(5, generator=torch.Generator().manual_seed(r))
ada = hvd.allreduce(g, op=hvd.Adasum, name="ada.g")
assert torch.equal(hvd.broadcast(ada.clone(), root_rank=0, name="ada.check"), ada)
# --use-adasum: DistributedOptimizer(op=hvd.Adasum) combines the updates; ranks agree
m2 = torch.nn.Linear(8, 4)
hvd.broadcast_parameters(m2.state_dict(), root_rank=0)
opt2 = hvd.DistributedOptimizer(
    torch.optim.SGD(m2.parameters(), lr=0.1), named_parameters=m2.named_parameters(),
    op=hvd.Adasum,
)  # fmt: skip
before = [p.detach().clone() for p in m2.parameters()]
for _ in range(2):
    opt2.zero_grad()
    F.cross_entropy(m2(data), target).backward()
    opt2.step()
for i, p in enumerate(m2.parameters()):
    ref = hvd.broadcast(p.detach().clone(), root_rank=0, name=f"ada.param.{i}")
    assert torch.equal(ref, p.detach()) and not torch.equal(p.detach(), before[i])
# what Horovod was built with, and a timeline started and stopped at run time
assert hvd.mpi_built() and hvd.mpi_enabled() and hvd.mpi_threads_supported()
assert not (hvd.nccl_built() or hvd.gloo_built() or hvd.cuda_built() or hvd.ddl_built())
assert hvd.is_homogeneous()
import json  # noqa: E402
import os  # noqa: E402
import tempfile  # noqa: E402

trace = os.path.join(tempfile.gettempdir(), f"hvd-timeline-{os.getppid()}")
hvd.start_timeline(trace)
hvd.allreduce(torch.ones(3), name="timed")
hvd.stop_timeline()
with open(f"{trace}.{r}.json") as fh:
    events = json.load(fh)
assert any("timed" in str(e.get("name", "")) for e in events), events[:5]
os.remove(f"{trace}.{r}.json")
# join: this rank is done (the optimizer keeps the others' steps going)
last = hvd.join()
assert 0 <= last < n
print(f"HOROVOD OK {r}", flush=True)
hvd.shutdown()

"""A torch ``Manager`` stopped (SIGSTOP) past its ``timeout``: its service drops it, the other
member's step fails and it goes on alone; continued (SIGCONT), the manager finds it was
dropped, attaches again, receives the state, and both end with equal parameters (issue 50's
liveness; ``--full``: the plain members' test in tests/daemon/test_ft.py is the default one)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "daemon"))
from cluster import have_mpiexec, serve  # noqa: E402

pytestmark = [
    pytest.mark.skipif(not have_mpiexec(), reason="mpiexec missing (install mpich)"),
    pytest.mark.full,
]

SCRIPT = """
import hashlib, sys, time, logging
from datetime import timedelta
import torch
from totalreduce.torch.ft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo
logging.basicConfig(level=logging.WARNING, stream=sys.stdout)
torch.manual_seed(0)
model = torch.nn.Linear(8, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
manager = Manager(
    pg=ProcessGroupGloo(), min_replica_size=1, replica_id=sys.argv[1],
    load_state_dict=lambda s: (model.load_state_dict(s["m"]), opt.load_state_dict(s["o"])),
    state_dict=lambda: {"m": model.state_dict(), "o": opt.state_dict()},
    timeout=timedelta(seconds=float(sys.argv[2])),
)
ddp, optim = DistributedDataParallel(manager, model), Optimizer(manager, opt)
x = torch.linspace(-1, 1, 32).reshape(4, 8)
while manager.current_step() < 60:
    optim.zero_grad()
    ddp(x).square().sum().backward()
    optim.step()
    print("STEP", manager.current_step(), manager.num_participants(), flush=True)
    time.sleep(0.05)
raw = b"".join(p.detach().numpy().tobytes() for p in model.parameters())
print("FINAL", hashlib.sha1(raw).hexdigest(), flush=True)
manager.shutdown()
"""


def test_a_stopped_manager_is_dropped_then_attaches_again(tmp_path: Path) -> None:
    served = serve(2, 1, tmp_path, timeout=600, extra=("--fault-tolerant", "--first-quorum", "2"))
    procs = []
    try:
        for node, (rid, timeout) in enumerate([("a", "30"), ("b", "2")]):
            env = dict(os.environ, PYTHONUNBUFFERED="1",
                       TOTALREDUCE_FT_SOCKET=str(served.directory / f"ft{node}.sock"))  # fmt: skip
            procs.append(subprocess.Popen(
                [sys.executable, "-c", SCRIPT, rid, timeout], env=env, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, text=True,
            ))  # fmt: skip
        b = procs[1]
        assert b.stdout is not None
        for line in b.stdout:
            if line.startswith("STEP 5 "):
                break
        b.send_signal(signal.SIGSTOP)
        time.sleep(4)  # past b's timeout: a goes on alone
        b.send_signal(signal.SIGCONT)
        outs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
        served.stop()
    a, b_out = outs
    assert all(p.returncode == 0 for p in procs), outs
    assert "b stopped answering" in a and "timeout of 2 s" in a, a[-3000:]
    assert " 1\n" in a, "a never stepped alone"
    assert "was dropped" in b_out and "attaching again" in b_out, b_out[-3000:]
    fa = next(x for x in a.splitlines() if x.startswith("FINAL"))
    fb = next(x for x in b_out.splitlines() if x.startswith("FINAL"))
    assert fa == fb, (a[-2000:], b_out[-2000:])

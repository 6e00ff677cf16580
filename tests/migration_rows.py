"""Run every row of docs/migration.md: each call its totalreduce column shows, at P=2.

Started by test_migration_rows.py under ``mpiexec -n 2``.  For each table row, every code
span of the totalreduce column is run the way a reader would type it:

- a call (``trt.allreduce(t, name=, op="avg")``): keywords shown without a value get a
  sample value for that keyword, ``(...)`` and ``, ...`` get the sample arguments of that
  function, and the statement runs in a namespace of sample objects (``t``, ``x``,
  ``model``, ``opt``, ``h``, ...); a bare function name (``trt.allreduce_``) is called with
  its sample arguments, a bare class or constant is resolved;
- an import line runs; a topology name builds that topology; an environment variable
  is set and the configuration must read it; a launch line is the one running this script;
- ``tr.shutdown()`` runs last (once every other row ran).

Every rank prints ``ROW <line> OK`` per row or ``ROW <line> FAILED: <why>``; the test
checks that no row failed and that every row ran something.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import totalreduce as tr
import totalreduce.torch as trt
import totalreduce.torch.decent_dp  # trt.decent_dp in the rows
from totalreduce import topology as topology_util

DOC = Path(__file__).resolve().parent.parent / "docs" / "migration.md"

# Sample values of keywords a row shows without a value (``name=``, ``splits=``).
KEYWORDS = {
    "name": '"k{n}"',
    "op": '"sum"',
    "average": "True",
    "root": "0",
    "root_rank": "0",
    "splits": "[t.shape[0] // tr.size()] * tr.size()",
    "topology": '"ring"',
    "local_size": "1",
    "src_ranks": "[(tr.rank() - 1) % tr.size()]",
    "dst_ranks": "[(tr.rank() + 1) % tr.size()]",
    "zero_init": "True",
    "self_weight": "0.5",
    "dst_weights": "{r: 0.5 for r in trt.out_neighbor_ranks()}",
    "src_weights": "{r: 1.0 for r in trt.in_neighbor_ranks()}",
    "neighbor_weights": "{r: 0.5 for r in trt.in_neighbor_ranks()}",
    "reset": "True",
    "clone": "True",
    "for_self": "True",
    "num_steps_per_communication": "1",
    "window_prefix": '"wpo."',
    "compression": "trt.Compression.fp16",
    "prescale_factor": "2.0",
    "postscale_factor": "0.5",
    "group": "tr.Group([0, 1])",
    # Decent-DP's DecentralizedDataParallel and its methods
    "optim_fn": "trt.decent_dp.optim_fn_adamw",
    "lr_scheduler_fn": "lambda o: torch.optim.lr_scheduler.StepLR(o, 5)",
    "scaler": "torch.amp.GradScaler('cpu')",
    "grad_clip_norm": "1.0",
    "param_as_bucket_view": "True",
    "sync_buffer_in_global_avg": "True",
    "bucket_size_in_mb": "25",
    "local_world_size": "1",
    "will_revert": "True",
    "return_d2c": "True",
    "enable": "False",
}

# Sample arguments of a function a row shows bare or with ``(...)``.
ARGS = {
    "allreduce_": "t.clone(), name='k{n}'",
    "allreduce_async": "t, name='k{n}'",
    "allreduce_async_": "t.clone(), name='k{n}'",
    "DistributedOptimizer": "opt, model.named_parameters(), prefix='k{n}.'",
    "fp16_compress_hook": None,  # a DDP comm hook: registered by its own row
    "bfloat16_compress_hook": None,
    "allreduce_hook": None,
    "set_topology": "topology_util.RingGraph(tr.size())",
    "neighbor_allreduce": "t, name='k{n}'",
    "hierarchical_neighbor_allreduce": "x, topology='ring', local_size=1",
    "ExponentialGraph": "tr.size()",
    "start_timeline": "os.path.join(tempfile.mkdtemp(), 'trace')",
    "initialize_dist": "",
    "optim_fn_adam": "list(model.named_parameters())",
    "optim_fn_adamw": "list(model.named_parameters())",
    "optim_fn_accum_adam": "list(model.named_parameters())",
    "optim_fn_accum_adamw": "list(model.named_parameters())",
    "AccumAdam": "model.parameters()",
    "AccumAdamW": "model.parameters()",
    "lr_scheduler_fn_cosine_with_warmup": "torch.optim.SGD(model.parameters(), lr=0.1), 10, 2",
}

NOT_PYTHON = (
    re.compile(r"^(mpiexec|horovodrun|bfrun|torchrun) "),  # the launch running this script
    re.compile(r"^mpiexec -n N$"),
)


def samples() -> dict[str, Any]:
    """The namespace a row's call runs in (fresh per row)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    h = trt.allreduce_async(torch.ones(3), name="sample.h")
    return {
        "tr": tr,
        "trt": trt,
        "torch": torch,
        "np": np,
        "topology_util": topology_util,
        "totalreduce": __import__("totalreduce"),
        "t": torch.arange(4, dtype=torch.float32) + tr.rank(),
        "x": np.arange(4, dtype=np.float64) + tr.rank(),
        "tensors": [torch.ones(3), torch.full((2,), 2.0)],
        "model": model,
        "opt": torch.optim.SGD(model.parameters(), lr=0.1),
        "obj": {"rank": tr.rank()},
        "h": h,
        "state": None,
        "name": "win",  # the window rows' window
        "self_weight": 0.5,
        "src_weights": {(tr.rank() + 1) % tr.size(): 0.5},
        "dst_weights": {(tr.rank() + 1) % tr.size(): 1.0},
        "DistributedOptimizer": trt.DistributedOptimizer,
        "path": os.path.join(tempfile.mkdtemp(), "trace"),
    }


def fill(span: str, n: int) -> str:
    """A code span as a runnable statement (see the module docstring)."""

    def kw(m: re.Match[str]) -> str:
        key = m.group(1)
        if key not in KEYWORDS:
            raise KeyError(f"no sample for keyword {key}= (add it to KEYWORDS)")
        value = KEYWORDS[key].replace("{n}", str(n))
        return f"{key}={value}{m.group(2)}"

    code = re.sub(r"\b([a-z_][a-z0-9_]*)=\s*(?=[,)])()", kw, span)
    code = re.sub(
        r"\b([a-z_][a-z0-9_]*)=\.\.\.", lambda m: f"{m.group(1)}={KEYWORDS[m.group(1)]}", code
    ).replace("{n}", str(n))
    m = re.match(r"^(?:\w+ = )?(trt|tr)\.(\w+)\(\.\.\.\)$", code)
    if m:
        args = ARGS.get(m.group(2))
        if args is None:
            raise KeyError(f"no sample arguments for {m.group(2)}(...) (add it to ARGS)")
        code = code.replace("(...)", "(" + args.replace("{n}", str(n)) + ")")
    code = code.replace(", ...)", ")").replace("(..., ", "(opt, ")
    return code


def run_span(span: str, n: int, ns: dict[str, Any]) -> str:
    """Run one span; returns what was done (for the log), raises if it fails."""
    span = span.strip()
    if any(p.match(span) for p in NOT_PYTHON):
        assert tr.size() == int(os.environ.get("PMI_SIZE", tr.size()))
        return "launch: this script's own"
    if span.startswith(("import ", "from ")):
        exec(span, ns)
        return "import"
    if re.fullmatch(r"TOTALREDUCE_[A-Z_]+(=\w+)?", span):
        var = span.split("=")[0]
        value = "file" if var == "TOTALREDUCE_TIMELINE" else "7"
        cfg = tr.Config.load(env={var: value})
        field = var[len("TOTALREDUCE_") :].lower()
        want = value if var == "TOTALREDUCE_TIMELINE" else 7
        assert getattr(cfg, field) == want, (var, getattr(cfg, field))
        return "environment"
    op = re.fullmatch(r'(?:op=)?"(sum|avg|max|min|product|adasum|band|bor|bxor)"', span)
    if op:  # a value of op=
        x = np.arange(3) if op.group(1).startswith("b") else np.ones(3)  # bitwise: integers
        tr.allreduce(x, op=op.group(1), name=f"k{n}.{op.group(1)}")
        return f"allreduce op={op.group(1)}"
    if re.fullmatch(r'"[a-z0-9-]+"', span):  # a topology by name
        topology_util.get_topology(span.strip('"'), tr.size())
        return "topology name"
    if re.fullmatch(r"[a-z_]+=", span):  # a keyword named alone: its call's row runs it
        return "keyword"
    code = fill(span, n)
    bare = re.fullmatch(r"(trt|tr|totalreduce\.topology)\.([\w.]+)", code)
    if bare:
        obj = eval(code, ns)
        name = bare.group(2).split(".")[-1]
        if name.endswith("_hook"):  # a DDP comm hook: registered, then run by a backward
            ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
            ddp.register_comm_hook(None, obj)
            ddp(torch.ones(3, 4)).sum().backward()
            return f"ran the DDP hook {code}"
        if callable(obj) and name in ARGS and ARGS[name] is not None:
            exec(f"_result = {code}({ARGS[name].replace('{n}', str(n))})", ns)
            return f"called {code}"
        return f"resolved {code}"
    if code in ("DistributedDataParallel",):
        return "torch's name"
    if "register_comm_hook" in code:
        ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
        exec(code, {**ns, "model": ddp})
        out = ddp(torch.ones(3, 4)).sum()
        out.backward()  # the hook runs
        return "registered and ran a DDP hook"
    try:
        value = eval(compile(code, f"<row {n}>", "eval"), ns)
    except SyntaxError:  # a statement (h = ...)
        exec(compile(code, f"<row {n}>", "exec"), ns)
    else:
        if hasattr(value, "__enter__"):  # a context manager: the row's call is its block
            with value:
                pass
    for value in list(ns.values()):  # a handle or window transfer a row started: finish it
        if hasattr(value, "wait") and hasattr(value, "done") and value is not ns.get("h"):
            value.wait(60)
    return f"ran {code}"


def rows() -> list[tuple[int, list[str]]]:
    out = []
    for n, line in enumerate(DOC.read_text().splitlines(), 1):
        if not line.startswith("| ") or line.startswith("| ---"):
            continue
        cells = line.split(" | ")
        if cells[0] in ("| Horovod", "| torch.distributed", "| BlueFog", "| Decent-DP"):
            continue  # a header
        if cells[1].strip() == "none":
            continue  # no counterpart: nothing to run (the notes say why)
        out.append((n, re.findall(r"`([^`]*)`", cells[1])))
    return out


def main() -> None:
    trt.init()
    dist.init_process_group("totalreduce", init_method="totalreduce://")
    later = []
    failed = 0
    for n, spans in rows():
        ns = samples()
        if any(span.startswith("ddp.") for span in spans):  # a Decent-DP row's wrapped model
            ns["ddp"] = trt.decent_dp.DecentralizedDataParallel(
                torch.nn.Linear(4, 2), trt.decent_dp.optim_fn_adamw
            )
        done = []
        try:
            for span in spans:
                if span.strip() == "tr.shutdown()":
                    later.append(n)
                    done.append("deferred to the end")
                    continue
                windows = tr.default_service().windows
                if "win_create" in span and "win" in windows.names():
                    trt.win_free("win")  # a row that creates it again
                elif "win_" in span and "win_create" not in span and "win" not in windows.names():
                    trt.win_create(torch.zeros(4), "win")  # the window the row works on
                done.append(run_span(span, n, ns))
            if not done:
                raise AssertionError("the row shows no code")
            print(f"ROW {n} OK: {'; '.join(done)}", flush=True)
        except Exception as exc:
            failed += 1
            print(f"ROW {n} FAILED: {exc!r}\n{traceback.format_exc()}", flush=True)
        tr.barrier(name=f"row {n}")
    trt.win_free()
    dist.destroy_process_group()
    tr.shutdown()
    for n in later:
        print(f"ROW {n} OK: tr.shutdown() ran last", flush=True)
    print(f"ROWS DONE rank failed={failed}", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()

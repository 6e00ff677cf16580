"""The torch forms, the Horovod and BlueFog names and the backend, against the op table.

Every torch form a record declares exists with the declared parameters and was
built from the record; nothing else in torch/collectives.py takes an op's
arguments; the aliases are where the table says; the backend's torch ops are the
table's ``c10d`` names; and one ``Work`` class carries engine handles to torch.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import threading
import time
import types
from pathlib import Path
from typing import Any

import pytest

from conftest import import_torch

torch = import_torch()

import torch.distributed as dist  # noqa: E402

import totalreduce.torch as trt  # noqa: E402
import totalreduce.torch.collectives as collectives  # noqa: E402
from conftest import local_services, run_ranks  # noqa: E402
from totalreduce.declare import REQUIRED, Form, OpDecl, Param  # noqa: E402
from totalreduce.errors import OpTimeoutError  # noqa: E402
from totalreduce.ops_table import OPS  # noqa: E402
from totalreduce.service.service import Service  # noqa: E402
from totalreduce.torch.futures import torch_work  # noqa: E402
from totalreduce.torch.group_core import _C10D  # noqa: E402

TORCH_OPS = [d for d in OPS if d.torch is not None]
ALIASES = [(d, a) for d in OPS for a in d.aliases]

#: The public functions of torch/collectives.py that are not op forms.
NOT_FORMS = {
    "resolve_root",
    "resolve_service",
    "priority_value",
    "in_place_result",
    "new_tensor_result",
    "rows_result",
    "submit",
    "run",
    "tensor_forms",
    "poll",
    "synchronize",
}


P = inspect.Parameter


def shape(sig: inspect.Signature) -> list[tuple[str, Any, Any]]:
    """Each parameter's name, kind and default (annotations may differ)."""
    return [(p.name, p.kind, p.default) for p in sig.parameters.values()]


def declared_shape(params: tuple[Param, ...]) -> list[tuple[str, Any, Any]]:
    return [
        (
            p.name,
            P.KEYWORD_ONLY if p.keyword_only else P.POSITIONAL_OR_KEYWORD,
            P.empty if p.default is REQUIRED else p.default,
        )
        for p in params
    ]


def torch_problems(module: Any, ops: list[OpDecl]) -> list[str]:
    """What in ``module`` (torch/collectives.py) disagrees with the torch forms of ``ops``."""
    problems = []
    wanted = set()
    for d in ops:
        assert d.torch is not None
        for form in Form:
            name = form.name_of(d.name)
            fn = getattr(module, name, None)
            if form not in d.torch.forms:
                if fn is not None:
                    problems.append(f"{name}: a form the record does not declare")
                continue
            wanted.add(name)
            if fn is None:
                problems.append(f"{name}: missing")
            elif getattr(fn, "__op_declaration__", None) != (d.name, f"torch {form.name.lower()}"):
                problems.append(f"{name}: not built from the table")
            elif shape(inspect.signature(fn)) != declared_shape(d.torch.params_of(form)):
                problems.append(f"{name}: parameters differ from the record")
    spellings = getattr(module, "NONBLOCKING", {})  # BlueFog's names of declared forms
    for name, obj in vars(module).items():
        if name.startswith("_") or not inspect.isfunction(obj) or name in wanted:
            continue
        if name in spellings and obj is getattr(module, spellings[name], None):
            continue
        if obj.__module__ == module.__name__ and name not in NOT_FORMS:
            problems.append(f"{name}: a public function outside the table")
    return problems


def test_every_torch_form_is_built_from_the_table() -> None:
    assert {d.name for d in TORCH_OPS} >= {"allreduce", "broadcast", "neighbor_allreduce"}
    assert torch_problems(collectives, TORCH_OPS) == []


@pytest.mark.parametrize("decl", TORCH_OPS, ids=lambda d: d.name)
def test_the_package_exports_every_torch_form(decl: OpDecl) -> None:
    assert decl.torch is not None
    for form in decl.torch.forms:
        name = form.name_of(decl.name)
        assert getattr(trt, name) is getattr(collectives, name) and name in trt.__all__


def test_a_hand_written_torch_form_is_caught() -> None:
    fake = types.ModuleType("fake_collectives")
    vars(fake).update({n: getattr(collectives, n) for n in dir(collectives) if n[:2] != "__"})

    def allreduce_(tensor: Any, name: Any = None) -> Any:
        return tensor

    def reduce_scatter_(tensor: Any) -> Any:
        return tensor

    def alltoall_async(tensor: Any) -> Any:
        return tensor

    for fn in (allreduce_, reduce_scatter_, alltoall_async):
        fn.__module__ = "fake_collectives"
        setattr(fake, fn.__name__, fn)
    found = torch_problems(fake, TORCH_OPS)
    assert "allreduce_: not built from the table" in found
    assert "reduce_scatter_: a form the record does not declare" in found
    assert "alltoall_async: a public function outside the table" in found


@pytest.mark.parametrize(("decl", "alias"), ALIASES, ids=lambda v: getattr(v, "name", ""))
def test_every_alias_is_where_the_table_says(decl: OpDecl, alias: Any) -> None:
    module = importlib.import_module(alias.module)
    for form in alias.forms:
        name = form.name_of(alias.name)
        fn = getattr(module, name)
        assert getattr(trt, name) is fn, f"totalreduce.torch.{name} is not {alias.module}'s"
        assert shape(inspect.signature(fn)) == declared_shape(alias.params), name
        marked = getattr(fn, "__op_declaration__", ("", ""))
        if alias.derived:
            assert marked[0] == decl.name, f"{name} is not built from {decl.name}'s record"
        else:
            assert marked == ("", ""), f"{name} is declared as having a body of its own"


# ---------------------------------------------------------------- what the kinds mean


def test_the_forms_read_the_parameter_kinds() -> None:
    """average=, root_rank=, BlueFog's positional order and older names, in place, rows."""

    def rank(s: Any) -> Any:
        r, other = s.rank, 1 - s.rank
        x = torch.tensor([float(r + 1), 2.0 * r])
        out = {
            "avg": trt.allreduce(x, "k.avg", op="sum", average=True, service=s),
            "sum": trt.allreduce(x, "k.sum", average=False, service=s),
            "root_rank": trt.broadcast(x, name="k.b", root_rank=1, service=s),
        }
        t = x.clone()
        out["in_place"] = trt.allreduce_(t, "k.ip", "sum", service=s) is t and t.tolist()
        out["rows"] = trt.allgather(torch.full((1, 2), float(r)), "k.rows", service=s).shape
        y = torch.full((2,), float(r))
        out["bluefog"] = trt.neighbor_allreduce(y, 0.5, {other: 0.5}, [other], service=s)
        out["older"] = trt.neighbor_allreduce(
            y, "k.old", self_weight=0.5, neighbor_weights={other: 0.5}, send_neighbors=[other],
            service=s,
        )  # fmt: skip
        grouped = trt.grouped_allreduce([x, 2 * x], name="k.g", service=s)
        out["grouped"] = [g.tolist() for g in grouped]
        return out

    with local_services(2) as svcs:
        results = run_ranks(svcs, rank, timeout=60)
    for got in results:
        assert got["avg"].tolist() == [1.5, 1.0] and got["sum"].tolist() == [3.0, 2.0]
        assert got["root_rank"].tolist() == [2.0, 2.0] and got["in_place"] == [3.0, 2.0]
        assert got["rows"] == (2, 2)
        assert got["bluefog"].tolist() == got["older"].tolist() == [0.5, 0.5]
        assert got["grouped"] == [[1.5, 1.0], [3.0, 2.0]]


# ---------------------------------------------------------------- the backend and the adapter


def _literal_calls(path: Path, methods: set[str]) -> set[str]:
    """The string literals passed first to ``self.<method>(...)`` in ``path``."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in methods
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            found.add(node.args[0].value)
    return found


def test_the_backend_names_its_ops_after_the_table() -> None:
    path = Path(importlib.import_module("totalreduce.torch.process_group").__file__ or "")
    used = _literal_calls(path, {"_work", "_untimed", "_name", "_uneven", "_barrier"})
    assert used >= {"all_reduce", "broadcast", "reduce", "all_to_all", "send", "recv"}
    assert used <= set(_C10D), f"not c10d names of the table: {used - set(_C10D)}"
    for what, decl in _C10D.items():
        assert what in decl.c10d and callable(getattr(Service, decl.method))


def test_one_work_class_carries_engine_handles_to_torch() -> None:
    import totalreduce.torch as package

    works = set()
    for info in pkgutil.iter_modules(package.__path__, package.__name__ + "."):
        module = importlib.import_module(info.name)
        for obj in vars(module).values():
            if inspect.isclass(obj) and issubclass(obj, dist.Work) and obj is not dist.Work:
                works.add(f"{obj.__module__}.{obj.__qualname__}")
    assert works == {"totalreduce.torch.futures._Work"}


def test_a_work_with_a_deadline_names_the_op_and_stays_in_flight() -> None:
    with local_services(2) as svcs:
        t = torch.ones(3)
        h = trt.allreduce_async_(t, name="decl.deadline", op="sum", service=svcs[0])
        work = torch_work([h], lambda: t, timeout_s=0.2, timeout_error=lambda: "all_reduce: late")
        t0 = time.monotonic()
        with pytest.raises(OpTimeoutError, match="all_reduce: late") as caught:
            work.wait()
        assert isinstance(caught.value.__cause__, OpTimeoutError)
        assert 0.15 < time.monotonic() - t0 < 10
        other = threading.Thread(
            target=lambda: trt.allreduce_(torch.ones(3), "decl.deadline", "sum", service=svcs[1])
        )
        other.start()
        other.join(30)
        assert work.get_future().wait() is t and t.tolist() == [2.0, 2.0, 2.0]


def test_bluefogs_nonblocking_spellings_are_the_declared_forms() -> None:
    """``bf.neighbor_allreduce_nonblocking`` and the rest are the ``_async`` forms built from
    the table, not functions of their own."""
    from totalreduce.torch import collectives

    assert len(collectives.NONBLOCKING) >= 7
    for spelling, form in collectives.NONBLOCKING.items():
        assert getattr(trt, spelling) is getattr(trt, form), spelling
        assert spelling in trt.__all__, spelling

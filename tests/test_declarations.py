"""Every op is declared once (totalreduce/ops_table.py); the numpy API and the service agree.

The torch forms and aliases are checked in tests/torch/test_torch_declarations.py.
Each check is a function returning what it finds wrong, so the last tests can show
that a hand-written op function or a record that contradicts itself is caught.
"""

from __future__ import annotations

import ast
import inspect
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import totalreduce as tr
import totalreduce.api as api
from conftest import local_services, run_ranks
from totalreduce.declare import (
    MORE,
    REQUIRED,
    Kind,
    OpDecl,
    Param,
    Returns,
    Takes,
    build_function,
    forward,
    signature,
)
from totalreduce.ops_table import OPS, op
from totalreduce.service.handle import ServiceLike
from totalreduce.service.service import Service

PACKAGE = Path(__file__).resolve().parents[1] / "totalreduce"

#: The public functions of api.py that are not ops (lifecycle, layout, handles).
NOT_OPS = {
    "init",
    "empty",
    "shutdown",
    "default_service",
    "is_initialized",
    "rank",
    "size",
    "local_rank",
    "local_size",
    "cross_rank",
    "cross_size",
    "poll",
    "synchronize",
}

P = inspect.Parameter


def shape(sig: inspect.Signature) -> list[tuple[str, Any, Any]]:
    """What must agree: each parameter's name, kind and default (annotations may differ)."""
    return [(p.name, p.kind, p.default) for p in sig.parameters.values()]


def declared_shape(params: tuple[Param, ...], more: bool = False) -> list[tuple[str, Any, Any]]:
    out = [
        (
            p.name,
            P.KEYWORD_ONLY if p.keyword_only else P.POSITIONAL_OR_KEYWORD,
            P.empty if p.default is REQUIRED else p.default,
        )
        for p in params
    ]
    return out + ([("kw", P.VAR_KEYWORD, P.empty)] if more else [])


def numpy_problems(module: Any, ops: tuple[OpDecl, ...]) -> list[str]:
    """What in ``module`` (api.py) disagrees with ``ops``: missing, hand-written or
    misdeclared op functions, and public functions that are neither ops nor known."""
    problems = []
    wanted = {}
    for d in ops:
        wanted[d.method] = (d, "async")
        wanted[d.name] = (d, "blocking")
    for name, (d, form) in wanted.items():
        fn = getattr(module, name, None)
        if fn is None:
            problems.append(f"{name}: missing")
            continue
        if getattr(fn, "__op_declaration__", None) != (d.name, form):
            problems.append(f"{name}: not built from the table")
            continue
        if shape(inspect.signature(fn)) != declared_shape(d.api_params(), d.api_more):
            problems.append(f"{name}: parameters differ from the record")
        if fn.__name__ != name or not fn.__doc__:
            problems.append(f"{name}: its name or docstring is missing")
    for name, obj in vars(module).items():
        if name.startswith("_") or not inspect.isfunction(obj) or name in wanted:
            continue
        if obj.__module__ == module.__name__ and name not in NOT_OPS:
            problems.append(f"{name}: a public function outside the table")
    return problems


# ---------------------------------------------------------------- the table itself


def test_the_table_declares_the_ops() -> None:
    names = [d.name for d in OPS]
    assert len(names) == len(set(names)) >= 15
    assert op("allreduce").method == "allreduce_async"
    with pytest.raises(KeyError, match="no op 'allreduc'"):
        op("allreduc")
    for d in OPS:
        d.check()
        assert d.doc and d.async_doc, d.name
        first = d.params[0]
        assert (first.kind is Kind.INPUT) == (d.takes is Takes.ONE), d.name


def test_the_declaration_modules_are_pure() -> None:
    """ops_table.py, window_table.py and declare.py import the standard library and each
    other only."""
    for module in ("ops_table.py", "window_table.py", "declare.py"):
        tree = ast.parse((PACKAGE / module).read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level:
                assert node.module in {"declare", "window_table"}, (
                    f"{module} imports .{node.module}"
                )
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
                for name in names or [node.module or ""]:
                    top = name.split(".")[0]
                    assert top in {"__future__", "enum", "inspect", "keyword", "collections",
                                   "dataclasses", "typing"}, f"{module} imports {name}"  # fmt: skip


def test_a_record_that_contradicts_itself_is_refused() -> None:
    x = Param("x", Kind.INPUT)
    bad = [
        OpDecl("a", (x, x), Takes.ONE, Returns.ARRAY, "d", "d"),
        OpDecl("a", (x,), Takes.ONE, Returns.ARRAY, "d", "d", api=("x", "y")),
        OpDecl("a", (x, Param("n", Kind.NAME, None)), Takes.ONE, Returns.ARRAY, "d", "d",
               api=("x", MORE, "n")),
    ]  # fmt: skip
    for record in bad:
        with pytest.raises(ValueError):
            record.check()
    with pytest.raises(ValueError, match="of= goes with"):
        Param("old", Kind.OLDER_NAME, None)
    with pytest.raises(ValueError, match="not an identifier"):
        Param("not a name", Kind.NAME)


# ---------------------------------------------------------------- the numpy API


def test_every_op_has_its_numpy_forms_built_from_the_table() -> None:
    assert numpy_problems(api, OPS) == []


@pytest.mark.parametrize("decl", OPS, ids=lambda d: d.name)
def test_the_package_exports_both_forms(decl: OpDecl) -> None:
    for name in (decl.name, decl.method):
        assert getattr(tr, name) is getattr(api, name)
        assert name in tr.__all__


def test_a_hand_written_op_function_is_caught() -> None:
    fake = types.ModuleType("fake_api")
    vars(fake).update({n: getattr(api, n) for n in dir(api) if not n.startswith("__")})

    def allreduce(x: Any, name: Any = None) -> Any:  # written by hand, outside the table
        return x

    def allgather_v(x: Any) -> Any:  # a new op no record declares
        return x

    allreduce.__module__ = allgather_v.__module__ = "fake_api"
    fake.allreduce, fake.allgather_v = allreduce, allgather_v
    del fake.barrier_async
    found = numpy_problems(fake, OPS)
    assert "allreduce: not built from the table" in found
    assert "allgather_v: a public function outside the table" in found
    assert "barrier_async: missing" in found
    # A record whose parameters differ from the function built earlier is caught too.
    d = op("alltoall")
    changed = OpDecl(d.name, d.params[:-1], d.takes, d.returns, d.doc, d.async_doc, api=None)
    assert "alltoall_async: parameters differ from the record" in numpy_problems(api, (changed,))


def test_blocking_is_the_async_form_and_wait() -> None:
    def rank(s: Service) -> Any:
        x = np.arange(4.0) + s.rank
        got = s.allreduce(x, "blk")
        waited = s.allreduce_async(x, name="blk").wait()
        s.barrier("b")
        sent = s.send(np.ones(2), 1, tag=3) if s.rank == 0 else s.recv(np.zeros(2), 0, tag=3)
        return got, waited, sent

    with local_services(2) as svcs:
        results = run_ranks(svcs, rank)
    for got, waited, _ in results:
        assert got.tolist() == waited.tolist() == [1.0, 3.0, 5.0, 7.0]
    assert results[0][2] is None and results[1][2].tolist() == [1.0, 1.0]


def test_a_wrong_argument_names_the_function() -> None:
    with pytest.raises(TypeError, match=r"allreduce_async\(\) got an unexpected keyword"):
        tr.allreduce_async(np.ones(2), nam="x")
    with pytest.raises(TypeError, match=r"broadcast\(\) missing 1 required positional"):
        tr.broadcast()


# ---------------------------------------------------------------- the service


@pytest.mark.parametrize("decl", OPS, ids=lambda d: d.name)
def test_the_service_method_takes_the_declared_parameters(decl: OpDecl) -> None:
    method = getattr(Service, decl.method)
    assert shape(inspect.signature(method))[1:] == declared_shape(decl.params)


@pytest.mark.parametrize("decl", OPS, ids=lambda d: d.name)
def test_the_services_blocking_method_is_built_from_the_table(decl: OpDecl) -> None:
    method = getattr(Service, decl.name)
    assert method.__op_declaration__ == (decl.name, "service blocking")
    assert shape(inspect.signature(method))[1:] == declared_shape(decl.api_params(), decl.api_more)
    for cls in Service.__mro__[1:]:  # no mixin writes it by hand any more
        assert decl.name not in vars(cls), f"{cls.__name__}.{decl.name}"


@pytest.mark.parametrize("decl", [d for d in OPS if d.direct], ids=lambda d: d.name)
def test_a_direct_op_has_its_blocking_path_with_the_declared_parameters(decl: OpDecl) -> None:
    """The blocking forms of an op declared ``direct`` call ``Service._{name}_direct``: it
    takes what the blocking method takes."""
    method = getattr(Service, f"_{decl.name}_direct")
    assert shape(inspect.signature(method))[1:] == declared_shape(decl.api_params(), decl.api_more)


@pytest.mark.parametrize("decl", OPS, ids=lambda d: d.name)
def test_the_protocol_agrees_with_the_table(decl: OpDecl) -> None:
    """ServiceLike (static typing's copy) lists each form with the declared parameters,
    the rest behind ``**kw`` where it abbreviates."""
    for name, params in ((decl.method, decl.params), (decl.name, decl.api_params())):
        member = getattr(ServiceLike, name, None)
        if member is None:
            assert name == "pairwise_exchange"  # the API calls the _async form only
            continue
        got = shape(inspect.signature(member))[1:]
        if got and got[-1][1] is P.VAR_KEYWORD:
            got = got[:-1]
        assert got == declared_shape(params)[: len(got)], name


# ---------------------------------------------------------------- building functions


def test_build_function_writes_the_declared_signature() -> None:
    marker = object()
    params = (
        Param("x", Kind.INPUT),
        Param("name", Kind.NAME, None),
        Param("out", Kind.OUTPUT, marker),
        Param("flag", Kind.FLAT, False, keyword_only=True),
    )
    sig = signature(params, more=True, returns="Any")
    fn = build_function(
        "f", sig, f"return dict({forward(sig)})", {}, doc="F.", module=__name__,
        declared=("f", "test"),
    )  # fmt: skip
    assert str(inspect.signature(fn)).startswith("(x: 'Any', name: 'str | int | None' = None,")
    assert shape(inspect.signature(fn)) == shape(sig)
    assert fn(1) == {"x": 1, "name": None, "out": marker, "flag": False}
    assert fn(1, "n", flag=True, extra=2)["extra"] == 2
    assert fn.__doc__ == "F." and fn.__module__ == __name__ and fn.__name__ == "f"
    with pytest.raises(TypeError, match="positional"):
        fn(1, 2, 3, 4)
    with pytest.raises(ValueError, match="not an identifier"):
        build_function("no name", sig, "pass", {}, doc="", module=__name__)


def test_the_api_reference_lists_every_op() -> None:
    text = (PACKAGE.parent / "docs" / "api.rst").read_text(encoding="utf-8")
    for d in OPS:
        for name in (d.name, d.method):
            assert f".. autofunction:: totalreduce.{name}\n" in text, name

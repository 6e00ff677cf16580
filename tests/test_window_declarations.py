"""The window ops (BlueFog's one-sided ops) are declared once, in ``WINDOW_OPS`` of
totalreduce/window_table.py: the numpy functions (totalreduce.windows) and the torch ones
(totalreduce.torch.windows) are built from those records, with the declared parameters."""

from __future__ import annotations

import inspect
import types

import pytest

import totalreduce as tr
import totalreduce.windows as windows
from totalreduce.declare import WinDecl, signature
from totalreduce.window_table import WINDOW_OPS

#: Handle utilities, not window ops (as poll/synchronize beside the collectives).
HANDLE_UTILITIES = {"win_poll", "win_wait"}


def forms(d: WinDecl) -> list[tuple[str, str]]:
    """(function name, form) of each function a record declares."""
    out = [(d.name, "window")]
    if d.nonblocking:
        out.append((f"{d.name}_nonblocking", "window nonblocking"))
    return out


def problems(module: types.ModuleType, torch_forms: bool = False) -> list[str]:
    """What in ``module`` disagrees with WINDOW_OPS (empty: nothing)."""
    wrong = []
    declared = set()
    for d in WINDOW_OPS:
        for name, form in forms(d):
            declared.add(name)
            fn = getattr(module, name, None)
            want_form = f"torch {form}" if torch_forms else form
            if fn is None:
                wrong.append(f"{module.__name__}.{name} missing")
                continue
            if getattr(fn, "__op_declaration__", None) != (d.name, want_form):
                wrong.append(f"{module.__name__}.{name} is not built from the table")
            params = d.torch_params() if torch_forms else d.numpy_params()
            got = list(inspect.signature(fn).parameters.values())
            want = list(signature(params).parameters.values())
            if [(p.name, p.kind, p.default) for p in got] != [
                (p.name, p.kind, p.default) for p in want
            ]:
                wrong.append(f"{module.__name__}.{name}{inspect.signature(fn)} is not the record's")
    for name, obj in vars(module).items():
        if (
            callable(obj)
            and not isinstance(obj, type)
            and (name.startswith("win_") or "win_ops" in name or name == "get_win_version")
        ):
            if name not in declared and name not in HANDLE_UTILITIES:
                wrong.append(f"{module.__name__}.{name} is a window op outside the table")
    return wrong


def test_the_numpy_window_ops_are_built_from_the_table() -> None:
    assert len(WINDOW_OPS) >= 12
    assert problems(windows) == []


def test_the_package_exports_them() -> None:
    for d in WINDOW_OPS:
        for name, _ in forms(d):
            assert getattr(tr, name) is getattr(windows, name), name
            assert name in tr.__all__, name


def test_a_hand_written_window_op_is_caught() -> None:
    fake = types.ModuleType("fake")
    for d in WINDOW_OPS:
        for name, _ in forms(d):
            setattr(fake, name, getattr(windows, name))

    def win_lock(name: str) -> None:  # a window op nobody declared
        del name

    fake.win_lock = win_lock  # type: ignore[attr-defined]

    def win_put(x, name):  # a hand-written form with fewer parameters
        del x, name

    fake.win_put = win_put  # type: ignore[attr-defined]
    found = problems(fake)
    assert any("win_lock is a window op outside the table" in p for p in found), found
    assert any("fake.win_put is not built from the table" in p for p in found), found


def test_the_torch_window_ops_are_built_from_the_table() -> None:
    pytest.importorskip("torch")
    import totalreduce.torch as trt
    import totalreduce.torch.windows as tw

    assert problems(tw, torch_forms=True) == []
    for d in WINDOW_OPS:
        for name, _ in forms(d):
            assert getattr(trt, name) is getattr(tw, name), name
    assert "tensor" in inspect.signature(trt.win_put).parameters
    assert "topology" not in inspect.signature(trt.win_create).parameters  # numpy's only

"""docs/migration.md cannot go stale: every totalreduce name its tables give exists, and
every call of the form ``tr.name(...)`` / ``trt.name(...)`` there takes the keywords shown.

The tables map each Horovod, torch.distributed and BlueFog name to ours; a row that names
a function we do not have, or a keyword it does not take, fails here.
"""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parent.parent / "docs" / "migration.md"
ALIASES = {
    "tr": "totalreduce",
    "trt": "totalreduce.torch",
    "topology_util": "totalreduce.topology",
    "totalreduce.topology": "totalreduce.topology",
}
# `alias.name` or `alias.name(kw=, kw=...)` inside the tables' code spans
NAME = re.compile(
    r"\b(trt|tr|topology_util|totalreduce\.topology)\.([A-Za-z_][A-Za-z0-9_.]*)(\(([^`]*)\))?"
)


def _rows() -> list[str]:
    return [line for line in DOC.read_text().splitlines() if line.startswith("| ")]


def _uses() -> list[tuple[str, str, str | None]]:
    uses = set()
    for row in _rows():
        cells = row.split(" | ")
        ours = " | ".join(cells[1:])  # the totalreduce side and the notes
        for span in re.findall(r"`([^`]*)`", ours):
            for alias, name, _paren, args in NAME.findall(span):
                uses.add((alias, name, args if _paren else None))
    return sorted(uses, key=lambda u: (u[0], u[1], u[2] or ""))


def _resolve(alias: str, dotted: str) -> object:
    if alias == "trt":
        pytest.importorskip("torch")
    obj: object = importlib.import_module(ALIASES[alias])
    for part in dotted.split("."):
        if inspect.ismodule(obj) and not hasattr(obj, part):  # a submodule (trt.decent_dp)
            importlib.import_module(f"{obj.__name__}.{part}")
        obj = getattr(obj, part)
    return obj


def test_the_tables_name_things() -> None:
    assert len(_uses()) > 30


@pytest.mark.parametrize(("alias", "name", "args"), _uses())
def test_every_name_in_the_tables_exists_and_takes_its_keywords(
    alias: str, name: str, args: str | None
) -> None:
    obj = _resolve(alias, name)
    if args is None or not callable(obj):
        return
    keywords = re.findall(r"\b([a-z_][a-z0-9_]*)=", args)
    try:
        params = inspect.signature(obj).parameters  # type: ignore[arg-type]
    except (TypeError, ValueError):  # a builtin without a signature
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    unknown = [k for k in keywords if k not in params]
    assert not unknown, f"docs/migration.md: {alias}.{name} takes no {unknown} (row: {args})"

"""Tuning tables: the measured crossovers ``algorithm="auto"`` follows.

A table is a JSON file that ``totalreduce tune`` writes (measured on the
machine it runs on, at the P it runs at) and a copy of which ships with the
package (``totalreduce/data/tuning.json``)::

    {
      "format": 1,
      "about": "where and how it was measured",
      "allreduce": {"*": {"2": [[4096, "recursive_doubling"], [null, "ring"]]}},
      "broadcast": {"*": {"2": [[null, "one_to_all"]]}}
    }

Per collective, then per dtype (``"*"``: any dtype; a dtype's own entry wins
where it matters), then per rank count P: rows ``[limit, name]`` in increasing
``limit`` (bytes); ``name`` is chosen for buffers below ``limit``, and the last
row (``null``: no limit) above all of them.

The table in force for P ranks: the user's (``tuning_file``, or the variable
``TOTALREDUCE_TUNING_FILE``) if it has an entry for exactly P, else the shipped
one, which picks its largest tabulated P not above P.  Tables are read once
and cached; :func:`clear_cache` forgets them (``tune`` does, after writing).
All ranks must follow the same table.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import InvalidArgumentError

FORMAT = 1
SHIPPED = Path(__file__).resolve().parent.parent / "data" / "tuning.json"
ANY_DTYPE = "*"

Rows = list[tuple[float, str]]


def _known(kind: str) -> set[str]:
    if kind == "allreduce":
        from ..algorithms.registry import ALLREDUCE

        return set(ALLREDUCE)
    if kind == "broadcast":
        return {"one_to_all", "pipelined"}
    raise InvalidArgumentError(f"no tuning for collective {kind!r}; known: allreduce, broadcast")


@dataclass(frozen=True)
class TuningTable:
    """A parsed tuning table: ``tables[kind][dtype][P]`` is a list of rows ``(limit, name)``."""

    path: str
    about: str
    tables: Mapping[str, Mapping[str, Mapping[int, Rows]]]

    def sizes(self, kind: str) -> list[int]:
        """The rank counts this table has rows for, for collective ``kind``."""
        return sorted({p for per_p in self.tables.get(kind, {}).values() for p in per_p})

    def rows(self, kind: str, dtype: str | None) -> Mapping[int, Rows]:
        """Rows per P for ``dtype``: its own where it has them, else those for any dtype."""
        by_dtype = self.tables.get(kind, {})
        merged = dict(by_dtype.get(ANY_DTYPE, {}))
        if dtype is not None:
            merged.update(by_dtype.get(dtype, {}))
        return merged


def _parse_rows(path: str, where: str, kind: str, raw: Any) -> Rows:
    if not isinstance(raw, list) or not raw:
        raise InvalidArgumentError(f"tuning table {path}: {where} must be a non-empty list of rows")
    rows: Rows = []
    known = _known(kind)
    for i, item in enumerate(raw):
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[1], str)):
            raise InvalidArgumentError(
                f"tuning table {path}: {where} row {i} must be [limit, name], got {item!r}"
            )
        limit, name = item
        last = i == len(raw) - 1
        if limit is None and not last:
            raise InvalidArgumentError(f"tuning table {path}: {where}: only the last row has null")
        value = math.inf if limit is None else float(limit)
        if rows and value <= rows[-1][0]:
            raise InvalidArgumentError(
                f"tuning table {path}: {where}: limits must increase, got {limit} after "
                f"{rows[-1][0]:g}"
            )
        if name not in known:
            raise InvalidArgumentError(
                f"tuning table {path}: {where} names unknown {kind} algorithm {name!r}; "
                f"known: {', '.join(sorted(known))}"
            )
        rows.append((value, name))
    return rows


def parse_table(doc: Any, path: str) -> TuningTable:
    """Validate a table's JSON document; errors name the file and the entry."""
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise InvalidArgumentError(f"tuning table {path}: expected an object with format {FORMAT}")
    tables: dict[str, dict[str, dict[int, Rows]]] = {}
    for kind in ("allreduce", "broadcast"):
        by_dtype = doc.get(kind, {})
        if not isinstance(by_dtype, dict):
            raise InvalidArgumentError(f"tuning table {path}: {kind} must be an object")
        tables[kind] = {}
        for dtype, per_p in by_dtype.items():
            if not isinstance(per_p, dict):
                raise InvalidArgumentError(f"tuning table {path}: {kind}.{dtype} must be an object")
            parsed: dict[int, Rows] = {}
            for p, raw in per_p.items():
                try:
                    size = int(p)
                except ValueError:
                    size = 0
                if size < 1:
                    raise InvalidArgumentError(
                        f"tuning table {path}: {kind}.{dtype}: rank count {p!r} is not >= 1"
                    )
                parsed[size] = _parse_rows(path, f"{kind}.{dtype}.{p}", kind, raw)
            tables[kind][dtype] = parsed
    return TuningTable(path, str(doc.get("about", "")), tables)


@functools.lru_cache(maxsize=16)
def load_table(path: str) -> TuningTable:
    """Read and validate the table at ``path`` (cached per path)."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except FileNotFoundError:
        raise InvalidArgumentError(
            f"tuning table {path} does not exist (write one with `totalreduce tune`)"
        ) from None
    except json.JSONDecodeError as exc:
        raise InvalidArgumentError(f"tuning table {path} is not valid JSON: {exc}") from None
    return parse_table(doc, path)


def shipped_table() -> TuningTable:
    """The table that ships with the package."""
    return load_table(str(SHIPPED))


@functools.lru_cache(maxsize=1)
def configured_file() -> str | None:
    """The tuning file of the configuration (``TOTALREDUCE_TUNING_FILE``), read once."""
    from .config import Config

    return Config.load().tuning_file or None


#: Choices already made, by (collective, P, bytes, dtype, table file): a training loop asks
#: again every step for the same shapes, and walking the tables costs more than a frame.
CHOICES: dict[tuple[Any, ...], str] = {}


#: Bumped by :func:`clear_cache`: caches of choices elsewhere (a service's routes) key on it.
EPOCH = [0]


def clear_cache() -> None:
    """Forget every table read, every choice made and the configured file name."""
    EPOCH[0] += 1
    load_table.cache_clear()
    configured_file.cache_clear()
    CHOICES.clear()


def table_for(
    kind: str, size: int, dtype: str | None = None, tuning_file: str | None = None
) -> tuple[Mapping[int, Rows], TuningTable]:
    """The crossover rows in force for ``size`` ranks, and the table they come from.

    ``tuning_file`` None means the configured one (if any).
    """
    path = tuning_file if tuning_file is not None else configured_file()
    if path:
        user = load_table(path)
        rows = user.rows(kind, dtype)
        if size in rows:
            return {size: rows[size]}, user
    shipped = shipped_table()
    return shipped.rows(kind, dtype), shipped


def crossover_rows(winners: Sequence[tuple[int, str]]) -> list[list[Any]]:
    """Table rows from the fastest algorithm at each measured size (sizes increasing).

    Neighbouring sizes with the same winner merge; between two sizes with
    different winners the limit is their geometric mean.

    >>> crossover_rows([(8, "a"), (64, "a"), (512, "b"), (4096, "b")])
    [[181, 'a'], [None, 'b']]
    """
    rows: list[list[Any]] = []
    for i, (size, name) in enumerate(winners):
        if rows and rows[-1][1] == name:
            continue
        if rows:
            prev = winners[i - 1][0]
            rows[-1][0] = int(math.sqrt(prev * size))
        rows.append([None, name])
    return rows


def write_entry(
    path: str,
    kind: str,
    size: int,
    rows: list[list[Any]],
    dtype: str = ANY_DTYPE,
    about: str | None = None,
    measured: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Put the rows for ``size`` ranks into the table at ``path`` (created if absent).

    Entries for other rank counts, collectives and dtypes are kept, so running
    ``tune`` at several P builds one table.  ``measured`` (times per size and
    algorithm) is kept beside the rows for the record.  Returns the document.
    """
    doc: dict[str, Any] = {"format": FORMAT}
    if os.path.exists(path):
        with open(path) as f:
            doc = json.load(f)
        parse_table(doc, path)
    parse_table({"format": FORMAT, kind: {dtype: {str(size): rows}}}, path)
    doc.setdefault(kind, {}).setdefault(dtype, {})[str(size)] = rows
    if about is not None:
        doc["about"] = about
    if measured is not None:
        doc.setdefault("measured", {}).setdefault(kind, {}).setdefault(dtype, {})[str(size)] = (
            measured
        )
    # One line per row, per measured size: readable and diffable.
    text = re.sub(
        r"\[\s+([^\[\]{}]*?)\s+\]",
        lambda m: "[" + " ".join(m.group(1).split()) + "]",
        json.dumps(doc, indent=1),
    )
    text = re.sub(
        r"\{\s+([^\[\]{}]*?)\s+\}", lambda m: "{" + " ".join(m.group(1).split()) + "}", text
    )
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text + "\n")
    os.replace(tmp, path)
    clear_cache()
    return doc


def describe(tuning_file: str | None = None) -> str:
    """Which table ``auto`` follows, for ``totalreduce info``."""
    shipped = shipped_table()
    text = f"shipped {shipped.path} (allreduce P={_ps(shipped.sizes('allreduce'))})"
    path = tuning_file if tuning_file is not None else configured_file()
    if not path:
        return f"{text}; no tuning_file set"
    try:
        user = load_table(path)
    except InvalidArgumentError as exc:
        return f"{text}; tuning_file unusable: {exc}"
    return (
        f"{path} for allreduce P={_ps(user.sizes('allreduce'))}, "
        f"broadcast P={_ps(user.sizes('broadcast'))}; {text} for other P"
    )


def _ps(sizes: list[int]) -> str:
    return ",".join(map(str, sizes)) or "none"

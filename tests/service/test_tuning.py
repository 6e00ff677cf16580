"""Tuning tables: parsing, the table in force for each P, and ``auto`` following them."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import totalreduce as tr
from conftest import local_services, run_ranks
from totalreduce.algorithms.registry import ALLREDUCE
from totalreduce.service import tuning
from totalreduce.service.ops import choose_allreduce


@pytest.fixture(autouse=True)
def fresh_cache(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("TOTALREDUCE_TUNING_FILE", raising=False)
    tuning.clear_cache()
    yield
    tuning.clear_cache()


def table(path: Path, allreduce: dict, **extra: object) -> str:
    path.write_text(json.dumps({"format": 1, "allreduce": allreduce, **extra}))
    return str(path)


def test_shipped_table_is_valid_and_covers_every_p() -> None:
    shipped = tuning.shipped_table()
    assert shipped.sizes("allreduce") and "totalreduce tune" in shipped.about
    for p in range(1, 65):
        for nbytes in (0, 4096, 1 << 20, 1 << 30):
            assert choose_allreduce("auto", p, nbytes) in ALLREDUCE


def test_auto_follows_a_table_choosing_recursive_doubling(tmp_path: Path) -> None:
    path = table(tmp_path / "t.json", {"*": {"2": [[None, "recursive_doubling"]]}})
    for nbytes in (0, 8, 4096, 1 << 26):
        assert choose_allreduce("auto", 2, nbytes, tuning_file=path) == "recursive_doubling"
    # An explicit algorithm is never overridden.
    assert choose_allreduce("ring", 2, 8, tuning_file=path) == "ring"


def test_user_table_covers_only_its_p_the_shipped_one_the_rest(tmp_path: Path) -> None:
    path = table(tmp_path / "t.json", {"*": {"4": [[None, "bcube"]]}})
    shipped, _ = tuning.table_for("allreduce", 8)
    rows, src = tuning.table_for("allreduce", 4, tuning_file=path)
    assert src.path == path and rows == {4: [(float("inf"), "bcube")]}
    for p in (2, 3, 5, 8):
        _, src = tuning.table_for("allreduce", p, tuning_file=path)
        assert src.path == str(tuning.SHIPPED)
        assert choose_allreduce("auto", p, 100, tuning_file=path) == choose_allreduce(
            "auto", p, 100
        )


def test_dtype_entry_wins_over_any_dtype(tmp_path: Path) -> None:
    path = table(
        tmp_path / "t.json",
        {"*": {"2": [[None, "ring"]]}, "float64": {"2": [[1024, "bcube"], [None, "ring"]]}},
    )
    assert choose_allreduce("auto", 2, 100, tuning_file=path) == "ring"
    assert choose_allreduce("auto", 2, 100, tuning_file=path, dtype="float64") == "bcube"
    assert choose_allreduce("auto", 2, 4096, tuning_file=path, dtype="float64") == "ring"


def test_environment_variable_names_the_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = table(tmp_path / "t.json", {"*": {"3": [[64, "bcube"], [None, "halving_doubling"]]}})
    monkeypatch.setenv("TOTALREDUCE_TUNING_FILE", path)
    tuning.clear_cache()
    assert choose_allreduce("auto", 3, 10) == "bcube"
    assert choose_allreduce("auto", 3, 64) == "halving_doubling"
    assert path in tuning.describe()


@pytest.mark.parametrize(
    ("allreduce", "message"),
    [
        ({"*": {"2": [[None, "tree"]]}}, "unknown allreduce algorithm 'tree'"),
        ({"*": {"2": [[100, "ring"], [50, "bcube"]]}}, "limits must increase"),
        ({"*": {"2": [[None, "ring"], [50, "bcube"]]}}, "only the last row"),
        ({"*": {"0": [[None, "ring"]]}}, "rank count"),
        ({"*": {"2": []}}, "non-empty"),
    ],
)
def test_bad_tables_are_rejected_naming_the_file(tmp_path: Path, allreduce: dict, message: str):
    path = table(tmp_path / "bad.json", allreduce)
    with pytest.raises(tr.InvalidArgumentError, match=message) as err:
        choose_allreduce("auto", 2, 10, tuning_file=path)
    assert "bad.json" in str(err.value)


def test_missing_table_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(tr.InvalidArgumentError, match="does not exist"):
        choose_allreduce("auto", 2, 10, tuning_file=str(tmp_path / "nope.json"))


def test_crossover_rows_and_write_entry(tmp_path: Path) -> None:
    assert tuning.crossover_rows([(8, "ring")]) == [[None, "ring"]]
    rows = tuning.crossover_rows([(8, "bcube"), (32, "ring"), (128, "ring"), (512, "bcube")])
    assert rows == [[16, "bcube"], [256, "ring"], [None, "bcube"]]
    path = str(tmp_path / "t.json")
    tuning.write_entry(path, "allreduce", 2, rows, measured={"8": {"bcube": 1.0}})
    tuning.write_entry(path, "allreduce", 4, [[None, "ring"]])
    tuning.write_entry(path, "broadcast", 2, [[None, "pipelined"]])
    written = tuning.load_table(path)
    assert written.sizes("allreduce") == [2, 4] and written.sizes("broadcast") == [2]
    assert [choose_allreduce("auto", 2, n, tuning_file=path) for n in (8, 16, 255, 256)] == [
        "bcube",
        "ring",
        "ring",
        "bcube",
    ]
    with pytest.raises(tr.InvalidArgumentError):
        tuning.write_entry(path, "allreduce", 2, [[None, "nonsense"]])


def test_an_auto_op_runs_the_algorithm_the_table_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The op's algorithm code travels in its frames: a rank running the table's
    choice under ``auto`` matches a rank naming it, and mismatches any other."""
    path = table(tmp_path / "t.json", {"*": {"2": [[None, "recursive_doubling"]]}})
    monkeypatch.setenv("TOTALREDUCE_TUNING_FILE", path)
    tuning.clear_cache()
    x = np.arange(100, dtype=np.int64)

    def agree(svc):
        algo = "auto" if svc.rank == 0 else "recursive_doubling"
        return svc.allreduce(x + svc.rank, name="agree", algorithm=algo)

    def differ(svc):
        algo = "auto" if svc.rank == 0 else "ring"
        try:
            svc.allreduce(x, name="differ", algorithm=algo)
        except tr.OpMismatchError as exc:
            return str(exc)
        return "no error"

    with local_services(2) as svcs:
        for got in run_ranks(svcs, agree):
            np.testing.assert_array_equal(got, 2 * x + 1)
        errors = run_ranks(svcs, differ)
    for msg in errors:
        assert "algorithm recursive_doubling" in msg and "algorithm ring" in msg, msg


def test_broadcast_auto_follows_the_table(tmp_path) -> None:
    from totalreduce.service.ops import choose_broadcast

    table = tmp_path / "t.json"
    table.write_text(
        '{"format": 1, "broadcast": {"*": {"3": [[1024, "one_to_all"], [null, "pipelined"]]}}}'
    )
    assert choose_broadcast("auto", 3, 100, str(table)) == "one_to_all"
    assert choose_broadcast("auto", 3, 1 << 20, str(table)) == "pipelined"
    assert choose_broadcast("pipelined", 3, 100, str(table)) == "pipelined"
    with pytest.raises(tr.InvalidArgumentError, match="unknown broadcast algorithm"):
        choose_broadcast("tree", 3, 100)

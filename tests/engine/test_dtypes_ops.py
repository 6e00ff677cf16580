"""The engine reduces every element type with every reduce op: allreduce on the local transport.

Each rank's values span the type's range, so integer sums and products wrap;
the expected result is numpy's reduction of all ranks' inputs in rank order
(the ops are exact on integers and bool, so order does not matter).  Every
allreduce algorithm runs, with segments small enough to pipeline.
"""

from __future__ import annotations

import numpy as np
import pytest

import totalreduce as tr
from conftest import local_services, run_ranks
from totalreduce.dtypes import DType, ReduceOp

NEW_TYPES = [np.uint8, np.int8, np.int16, np.bool_]
NUMPY = {
    "sum": np.add,
    "max": np.maximum,
    "min": np.minimum,
    "product": np.multiply,
    "band": np.bitwise_and,
    "bor": np.bitwise_or,
    "bxor": np.bitwise_xor,
}
ALGORITHMS = ["ring", "ring_chunked", "halving_doubling", "recursive_doubling", "bcube"]


def value(rank: int, dtype: type, n: int) -> np.ndarray:
    rng = np.random.default_rng(rank * 1000 + np.dtype(dtype).num)
    if dtype is np.bool_:
        return rng.random(n) < 0.5
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, n, endpoint=True, dtype=dtype)


@pytest.mark.parametrize("p", [2, 3, 4])
def test_allreduce_new_types_and_ops(p: int) -> None:
    n = 301  # several segments of 64 bytes, chunks of uneven size
    cases = [(t, op, a) for t in NEW_TYPES for op in NUMPY for a in ALGORITHMS]
    cases += [(t, "avg", "ring") for t in (np.uint8, np.int8, np.int16)]

    def rank_main(svc):
        handles = [
            svc.allreduce_async(value(svc.rank, t, n), name=f"{np.dtype(t).name}.{op}.{a}",
                                op=op, algorithm=a)
            for t, op, a in cases
        ]  # fmt: skip
        return [h.wait(timeout=60) for h in handles]

    with local_services(p, segment_bytes=64, micro_bytes=32) as svcs:
        results = run_ranks(svcs, rank_main, timeout=240)
    for k, (t, op, a) in enumerate(cases):
        with np.errstate(all="ignore"):
            if op == "avg":
                want = np.add.reduce([value(r, t, n) for r in range(p)], dtype=t) // t(p)
            else:
                want = NUMPY[op].reduce([value(r, t, n) for r in range(p)], dtype=t)
        for r in range(p):
            got = results[r][k]
            assert got.dtype == np.dtype(t), (t, op, a)
            np.testing.assert_array_equal(got, want, err_msg=f"{t} {op} {a} P={p} rank {r}")


def test_product_on_floats() -> None:
    def rank_main(svc):
        x = np.array([1.5, -2.0, 0.5, 3.0], dtype=np.float32) + svc.rank
        return svc.allreduce(x, name="prod", op="prod")

    with local_services(3) as svcs:
        results = run_ranks(svcs, rank_main, timeout=60)
    base = np.array([1.5, -2.0, 0.5, 3.0], dtype=np.float32)
    want = base * (base + 1) * (base + 2)
    for got in results:
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("op", ["band", "bor", "bxor"])
def test_bitwise_on_floats_is_refused_at_the_call(op: str) -> None:
    with local_services(1) as (svc,):
        with pytest.raises(tr.InvalidArgumentError, match=f"allreduce: reduce op '{op}'.*float64"):
            svc.allreduce(np.ones(4), op=op)
        with pytest.raises(tr.InvalidArgumentError, match="'avg'.*bool"):
            svc.allreduce(np.ones(4, dtype=bool), op="avg")
        # The refused calls named nothing: the service still works.
        np.testing.assert_array_equal(svc.allreduce(np.arange(3, dtype=np.int8), op="bor"),
                                      np.arange(3, dtype=np.int8))  # fmt: skip


def test_broadcast_and_allgather_move_the_new_types() -> None:
    def rank_main(svc):
        b = svc.broadcast(value(svc.rank, np.bool_, 17), root=1, name="bb")
        g = svc.allgather(value(svc.rank, np.int8, 5 + svc.rank), name="g8")
        return b, g

    with local_services(3) as svcs:
        results = run_ranks(svcs, rank_main, timeout=60)
    for b, g in results:
        np.testing.assert_array_equal(b, value(1, np.bool_, 17))
        np.testing.assert_array_equal(
            g, np.concatenate([value(r, np.int8, 5 + r) for r in range(3)])
        )


def test_codes_travel_on_the_wire() -> None:
    assert {int(DType.UINT8), int(DType.INT8), int(DType.INT16), int(DType.BOOL)} == {7, 8, 9, 10}
    assert [int(ReduceOp[o.upper()]) for o in ("product", "band", "bor", "bxor")] == [5, 6, 7, 8]

"""The engine over the local transport: random orders, priorities and delays per rank."""

from __future__ import annotations

import random
import time

import numpy as np
import pytest

from conftest import local_services, run_ranks

SEGMENT = 4096  # bytes: small, so ops cut into many segments


def op_table(p: int, n_ops: int, seed: int) -> list[tuple[str, int, str, str]]:
    """(name, count, dtype, op) of each op; identical on every rank."""
    rng = random.Random(seed)
    sizes = [0, 1, p - 1 if p > 1 else 2, 17, 1000, 3 * SEGMENT // 8 + 5, 5 * SEGMENT // 4]
    ops = []
    for k in range(n_ops):
        dtype = rng.choice(["int64", "int32", "float64", "float32"])
        op = rng.choice(["sum", "sum", "max", "min", "avg"])
        ops.append((f"grad.{k}", rng.choice(sizes), dtype, op))
    return ops


def data(name_index: int, count: int, dtype: str, rank: int, p: int) -> np.ndarray:
    idx = np.arange(count, dtype=np.int64)
    return ((idx * p + rank + name_index) % 1000).astype(dtype)


def expected(name_index: int, count: int, dtype: str, op: str, p: int) -> np.ndarray:
    stack = np.stack([data(name_index, count, dtype, r, p) for r in range(p)]) if count else None
    if stack is None:
        return np.zeros(0, dtype=dtype)
    if op == "sum":
        return stack.sum(axis=0, dtype=dtype)
    if op == "max":
        return stack.max(axis=0)
    if op == "min":
        return stack.min(axis=0)
    total = stack.sum(axis=0, dtype=dtype)
    return total // p if np.dtype(dtype).kind == "i" else total / p


@pytest.mark.parametrize("p", range(1, 9))
def test_random_orders_priorities_delays(p: int) -> None:
    n_ops = 50
    table = op_table(p, n_ops, seed=p)

    def rank_main(svc):
        rng = random.Random(1000 + svc.rank)
        order = list(range(n_ops))
        rng.shuffle(order)
        handles = {}
        for k in order:
            name, count, dtype, op = table[k]
            x = data(k, count, dtype, svc.rank, p)
            in_place = rng.random() < 0.3
            h = svc.allreduce_async(
                x, name=name, op=op, out=x if in_place else None, priority=rng.randrange(4)
            )
            handles[k] = h
            if rng.random() < 0.2:
                time.sleep(rng.random() * 0.002)
        return {k: h.wait(timeout=60) for k, h in handles.items()}

    with local_services(p, segment_bytes=SEGMENT, micro_bytes=512, jitter=0.2, seed=p) as svcs:
        results = run_ranks(svcs, rank_main)
    for k, (name, count, dtype, op) in enumerate(table):
        want = expected(k, count, dtype, op, p)
        for r in range(p):
            got = results[r][k]
            assert got.dtype == want.dtype
            np.testing.assert_array_equal(got, want, err_msg=f"P={p} {name} {op} rank {r}")


def test_name_reused_every_step_matches_by_generation() -> None:
    p = 3

    def rank_main(svc):
        outs = []
        for step in range(5):
            x = np.full(10, svc.rank + 10 * step, dtype=np.int64)
            outs.append(svc.allreduce(x, name="w.grad"))
        return outs

    with local_services(p) as svcs:
        results = run_ranks(svcs, rank_main)
    for step in range(5):
        want = np.full(10, sum(r + 10 * step for r in range(p)), dtype=np.int64)
        for r in range(p):
            np.testing.assert_array_equal(results[r][step], want)


def test_unnamed_calls_match_by_call_order() -> None:
    p = 4

    def rank_main(svc):
        return [svc.allreduce(np.arange(5, dtype=np.int64) + k + svc.rank) for k in range(6)]

    with local_services(p) as svcs:
        results = run_ranks(svcs, rank_main)
    for k in range(6):
        want = sum(np.arange(5, dtype=np.int64) + k + r for r in range(p))
        for r in range(p):
            np.testing.assert_array_equal(results[r][k], want)

"""ReduceScatter and AllGather layers: forward values and adjointness through autograd."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import import_torch

torch = import_torch()

import totalreduce.torch as trt  # noqa: E402
from conftest import local_services, run_ranks  # noqa: E402
from totalreduce import Partition  # noqa: E402
from totalreduce.errors import InvalidArgumentError  # noqa: E402

torch.set_num_threads(1)

# (world size, partition shape or None, axis, per-rank input shape)
CASES = [
    (4, None, None, (13,)),
    (6, None, None, (5, 7)),
    (6, (2, 3), 0, (8, 5)),
    (6, (2, 3), 1, (4, 11)),
    (4, (3,), 0, (7, 2)),  # rank 3 is outside the partition
    (12, (2, 2, 3), 2, (3, 7, 12)),  # seed 003's example: 3 x 7 x 4 on every rank
]


def ids(case: tuple) -> str:
    p, shape, axis, x = case
    return f"P{p}-{'flat' if shape is None else 'x'.join(map(str, shape))}-axis{axis}-{x}"


def balanced(n: int, parts: int) -> list[int]:
    return [n // parts + (1 if i < n % parts else 0) for i in range(parts)]


def part_shape(case: tuple, rank: int) -> tuple[int, ...]:
    p, shape, axis, x = case
    if shape is None:
        return (balanced(int(np.prod(x)), p)[rank],)
    part = Partition(shape)
    coords = part.coords_of(rank)
    if coords is None:
        return (0,)
    out = list(x)
    out[axis] = balanced(x[axis], shape[axis])[coords[axis]]
    return tuple(out)


def random_inputs(case: tuple, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per rank: a full-shaped tensor and a part-shaped tensor (zero-volume if inactive)."""
    p, shape, _axis, x = case
    g = torch.Generator().manual_seed(seed)
    full, parts = [], []
    for r in range(p):
        active = shape is None or Partition(shape).is_active(r)
        full.append(torch.randn(x if active else (0,), generator=g, dtype=torch.float64))
        parts.append(torch.randn(part_shape(case, r), generator=g, dtype=torch.float64))
    return full, parts


def layers(case: tuple, name: str) -> tuple[trt.ReduceScatter, trt.AllGather]:
    _p, shape, axis, _x = case
    part = None if shape is None else Partition(shape)
    axes = None if axis is None else (axis,)
    return trt.ReduceScatter(part, axes, name=f"{name}.rs"), trt.AllGather(
        part, axes, name=f"{name}.ag"
    )


@pytest.mark.parametrize("case", CASES, ids=ids)
def test_adjoint_through_autograd(case: tuple) -> None:
    p = case[0]
    xs, ys = random_inputs(case, seed=3)
    zs, ws = random_inputs(case, seed=4)

    def rank(s):
        rs, ag = layers(case, "adjoint")
        rs._service = ag._service = s
        r = s.rank
        x = xs[r].clone().requires_grad_(True)
        out = rs(x)
        assert out.shape == ys[r].shape
        torch.dot(out.reshape(-1), ys[r].reshape(-1)).backward()
        z = ws[r].clone().requires_grad_(True)  # ws are part-shaped, zs full-shaped
        gathered = ag(z)
        # Without a partition the gathered tensor is flat.
        assert gathered.shape == (zs[r].shape if case[1] else (zs[r].numel(),))
        torch.dot(gathered.reshape(-1), zs[r].reshape(-1)).backward()
        return (
            float(torch.dot(out.detach().reshape(-1), ys[r].reshape(-1))),
            float(torch.dot(xs[r].reshape(-1), x.grad.reshape(-1))),
            float(torch.dot(gathered.detach().reshape(-1), zs[r].reshape(-1))),
            float(torch.dot(ws[r].reshape(-1), z.grad.reshape(-1))),
        )

    with local_services(p) as svcs:
        results = run_ranks(svcs, rank)
    lhs, rhs, ag_lhs, ag_rhs = (sum(col) for col in zip(*results, strict=True))
    assert lhs == pytest.approx(rhs, rel=1e-12, abs=1e-12)
    assert ag_lhs == pytest.approx(ag_rhs, rel=1e-12, abs=1e-12)
    assert abs(lhs) > 1e-3  # not trivially zero


def test_forward_values_on_seed_partition() -> None:
    case = (12, (2, 2, 3), 2, (3, 7, 12))
    xs, _ = random_inputs(case, seed=5)
    part = Partition((2, 2, 3))

    def rank(s):
        out = trt.ReduceScatter(part, (2,), service=s)(xs[s.rank])
        back = trt.AllGather(part, (2,), service=s)(out)
        return out, back

    with local_services(12) as svcs:
        results = run_ranks(svcs, rank)
    for r, (out, back) in enumerate(results):
        c = part.coords_of(r)
        members = part.axis_group(r, 2).ranks
        total = sum(xs[m] for m in members)
        assert out.shape == (3, 7, 4)
        torch.testing.assert_close(out, total[:, :, 4 * c[2] : 4 * c[2] + 4])
        torch.testing.assert_close(back, total)


def test_axes_without_partition_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="partition"):
        trt.ReduceScatter(None, (1,))

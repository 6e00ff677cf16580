"""The bucket plan: the bucket nearest the input is small, the others fill up to the cap."""

from __future__ import annotations

import pytest

from conftest import import_torch

torch = import_torch()

from totalreduce.torch.buckets import LAST_BUCKET_BYTES, plan_buckets  # noqa: E402
from totalreduce.torch.compression import Compression  # noqa: E402
from totalreduce.torch.resnet import resnet  # noqa: E402


def layers(sizes: list[int]) -> list[tuple[str, torch.Tensor]]:
    return [(f"p{i}", torch.zeros(n)) for i, n in enumerate(sizes)]


@pytest.mark.parametrize("name", ["resnet18", "resnet50"])
def test_resnet_plan(name: str) -> None:
    named = list(resnet(name, num_classes=10, prefer_torchvision=False).named_parameters())
    cap = 25 << 20
    plans = plan_buckets(named, list(range(len(named), 0, -1)), cap, Compression.none, "g.")
    order = [n for n, _ in named]
    # Every parameter exactly once, in backward order (reverse registration), consecutive.
    listed = [n for plan in plans for n, _ in plan.members]
    assert listed == order[::-1]
    nbytes = [plan.numel * 4 for plan in plans]
    assert all(b <= cap for b in nbytes)
    # The input side's bucket (completed last by backward) is at most 1 MiB, and the others
    # are full: the next parameter toward the output would not have fitted.
    assert plans[-1].members[-1][0] == "conv1.weight" and nbytes[-1] <= LAST_BUCKET_BYTES
    for plan, b in zip(plans[1:-1], nbytes[1:-1], strict=True):
        nxt = order.index(plan.members[0][0]) + 1
        assert b + named[nxt][1].numel() * 4 > cap
    # The most urgent bucket is the input side's (default priorities: first listed highest).
    assert max(plans, key=lambda p: p.priority) is plans[-1]


def test_plan_caps_and_large_parameters() -> None:
    f32 = 4
    # From the input: [1] under the last-bucket cap (2 elements), then [2,2], [5] alone
    # (larger than the cap of 4), [1,3]; listed from the output side.
    named = layers([1, 2, 2, 5, 1, 3])
    plans = plan_buckets(named, [0] * 6, 4 * f32, Compression.none, "", last_bytes=2 * f32)
    assert [[n for n, _ in p.members] for p in plans] == [
        ["p5", "p4"],
        ["p3"],
        ["p2", "p1"],
        ["p0"],
    ]
    assert [p.name for p in plans] == [f"bucket.{i}" for i in range(4)]
    # A last-bucket cap above fusion_bytes: fusion_bytes bounds every bucket, the input
    # side's too, so [1, 2] fill the first from the input.
    wide = plan_buckets(named, [0] * 6, 4 * f32, Compression.none, "", last_bytes=1 << 30)
    assert [[n for n, _ in p.members] for p in wide] == [
        ["p5", "p4"],
        ["p3"],
        ["p2"],
        ["p1", "p0"],
    ]
    # No fusion: one parameter per op, named after it, in registration order.
    alone = plan_buckets(named, [0] * 6, 0, Compression.none, "g.")
    assert [p.name for p in alone] == [f"g.p{i}" for i in range(6)]

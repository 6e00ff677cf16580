"""ResNet-50's gradient tensors, as torchvision's resnet50 has them."""

from __future__ import annotations

from conftest import optional_module
from totalreduce.bench.resnet50 import RESNET50_GRADIENTS, resnet50_gradient_counts


def test_resnet50_counts() -> None:
    assert len(RESNET50_GRADIENTS) == 161
    assert sum(RESNET50_GRADIENTS) == 25_557_032
    assert RESNET50_GRADIENTS[:3] == (9408, 64, 64)  # conv1 7x7x3x64, bn1
    assert RESNET50_GRADIENTS[-2:] == (2_048_000, 1000)  # fc
    assert max(RESNET50_GRADIENTS) == 512 * 512 * 9  # layer4's 3x3 convolutions
    assert sum(resnet50_gradient_counts(classes=10)) == 25_557_032 - 2048 * 990 - 990


def test_matches_torchvision_when_installed() -> None:
    models = optional_module("torchvision.models")
    model = models.resnet50()
    assert tuple(p.numel() for p in model.parameters()) == RESNET50_GRADIENTS

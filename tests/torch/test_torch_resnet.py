"""The in-repo ResNets have torchvision's parameter tensors: counts, names, shapes."""

from __future__ import annotations

import pytest

from conftest import import_torch, optional_module

torch = import_torch()

from totalreduce.torch.resnet import resnet  # noqa: E402

# torchvision's figures (num_classes=1000): tensors and elements.
TORCHVISION = {"resnet18": (62, 11_689_512), "resnet50": (161, 25_557_032)}


@pytest.mark.parametrize("name", sorted(TORCHVISION))
def test_parameter_tensors_match_torchvision(name: str) -> None:
    ours = list(resnet(name, prefer_torchvision=False).named_parameters())
    assert (len(ours), sum(p.numel() for _, p in ours)) == TORCHVISION[name]
    assert ours[0][0] == "conv1.weight" and tuple(ours[0][1].shape) == (64, 3, 7, 7)
    assert ours[-1][0] == "fc.bias"
    tvm = optional_module("torchvision.models")
    theirs = [(n, tuple(p.shape)) for n, p in getattr(tvm, name)().named_parameters()]
    assert [(n, tuple(p.shape)) for n, p in ours] == theirs


def test_forward_on_small_images() -> None:
    model = resnet("resnet18", num_classes=10, prefer_torchvision=False)
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)

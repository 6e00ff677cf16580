"""ResNet-18 and ResNet-50 with torchvision's parameter tensors, for benchmarks without torchvision.

This module owns :func:`resnet`: torchvision's ``resnet18`` / ``resnet50`` when
torchvision is installed, else the same architecture built here, with the same
parameter tensors in the same order (62 for ResNet-18, 161 for ResNet-50; the
same names and shapes), so gradient traffic, bucketing and hook order are
those of the real model.  Initialisation differs; nothing here is pretrained.

>>> model = resnet("resnet18", num_classes=10)   # doctest: +SKIP
>>> len(list(model.parameters()))                # doctest: +SKIP
62
"""

from __future__ import annotations

import warnings

import torch
from torch import nn


class BasicBlock(nn.Module):
    """Two 3x3 convolutions and a shortcut (ResNet-18/34)."""

    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = _downsample(inplanes, planes * self.expansion, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        identity = x if self.downsample is None else self.downsample(x)
        return self.relu(out + identity)


class Bottleneck(nn.Module):
    """1x1, 3x3 (strided), 1x1 convolutions and a shortcut (ResNet-50 and deeper)."""

    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * self.expansion, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = _downsample(inplanes, planes * self.expansion, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        identity = x if self.downsample is None else self.downsample(x)
        return self.relu(out + identity)


def _downsample(inplanes: int, outplanes: int, stride: int) -> nn.Module | None:
    if stride == 1 and inplanes == outplanes:
        return None
    return nn.Sequential(
        nn.Conv2d(inplanes, outplanes, 1, stride, bias=False), nn.BatchNorm2d(outplanes)
    )


class ResNet(nn.Module):
    """torchvision's ResNet layout: stem, four stages, average pool, classifier."""

    def __init__(
        self, block: type[BasicBlock | Bottleneck], layers: list[int], num_classes: int
    ) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        inplanes = 64
        stages = []
        for i, (planes, blocks) in enumerate(zip((64, 128, 256, 512), layers, strict=True)):
            stride = 1 if i == 0 else 2
            seq = []
            for b in range(blocks):
                seq.append(block(inplanes, planes, stride if b == 0 else 1))
                inplanes = planes * block.expansion
            stages.append(nn.Sequential(*seq))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512 * block.expansion, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


_LAYOUTS: dict[str, tuple[type[BasicBlock | Bottleneck], list[int]]] = {
    "resnet18": (BasicBlock, [2, 2, 2, 2]),
    "resnet50": (Bottleneck, [3, 4, 6, 3]),
}


def resnet(name: str = "resnet18", num_classes: int = 1000, *, prefer_torchvision: bool = True):
    """``name`` (``resnet18`` or ``resnet50``): torchvision's if installed, else this module's."""
    if name not in _LAYOUTS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(_LAYOUTS)}")
    if prefer_torchvision:
        try:
            import torchvision.models as tvm
        except ImportError:
            pass
        except Exception as exc:  # installed but broken, e.g. built for another torch
            warnings.warn(
                f"torchvision is installed but does not import ({type(exc).__name__}: {exc}); "
                f"using totalreduce.torch.resnet's {name}, which has the same parameters",
                stacklevel=2,
            )
        else:
            return getattr(tvm, name)(num_classes=num_classes)
    block, layers = _LAYOUTS[name]
    return ResNet(block, layers, num_classes)

"""The gradient tensors of ResNet-18, as element counts: the tensors of the step scenario.

torchvision's ``resnet18`` in ``named_parameters`` order: the stem (7x7
convolution and its batch norm), four stages of two basic blocks (two 3x3
convolutions, each with a batch norm's weight and bias; the first block of
stages 2-4 adds a 1x1 downsampling convolution and its batch norm) and the
1000-way classifier: 62 tensors, 11,689,512 elements.
"""

from __future__ import annotations


def resnet18_gradient_counts(classes: int = 1000) -> tuple[int, ...]:
    """Element counts of ResNet-18's parameters (so of its gradients), in model order.

    >>> counts = resnet18_gradient_counts()
    >>> len(counts), sum(counts)
    (62, 11689512)
    """
    counts = [64 * 3 * 7 * 7, 64, 64]  # conv1, bn1
    inplanes = 64
    for width in (64, 128, 256, 512):
        for b in range(2):
            counts += [width * inplanes * 9, width, width]  # conv1 3x3, bn1
            counts += [width * width * 9, width, width]  # conv2 3x3, bn2
            if b == 0 and width != inplanes:
                counts += [width * inplanes, width, width]  # downsample 1x1, its bn
            inplanes = width
    counts += [classes * inplanes, classes]  # fc
    return tuple(counts)


#: Element counts of ResNet-18's 62 gradient tensors (11,689,512 elements).
RESNET18_GRADIENTS: tuple[int, ...] = resnet18_gradient_counts()

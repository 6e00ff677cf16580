"""The gradient tensors of ResNet-50, as element counts: the burst a training step submits.

torchvision's ``resnet50`` in ``named_parameters`` order: the stem (7x7
convolution and its batch norm), four stages of 3, 4, 6 and 3 bottleneck
blocks (1x1, 3x3, 1x1 convolutions, each with a batch norm's weight and bias;
the first block of a stage adds a 1x1 downsampling convolution and its batch
norm) and the 1000-way classifier: 161 tensors, 25,557,032 elements.
"""

from __future__ import annotations


def resnet50_gradient_counts(classes: int = 1000) -> tuple[int, ...]:
    """Element counts of ResNet-50's parameters (so of its gradients), in model order.

    >>> counts = resnet50_gradient_counts()
    >>> len(counts), sum(counts)
    (161, 25557032)
    """
    counts = [64 * 3 * 7 * 7, 64, 64]  # conv1, bn1
    inplanes = 64
    for width, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for b in range(blocks):
            counts += [width * inplanes, width, width]  # conv1 1x1, bn1
            counts += [width * width * 9, width, width]  # conv2 3x3, bn2
            counts += [4 * width * width, 4 * width, 4 * width]  # conv3 1x1, bn3
            if b == 0:
                counts += [4 * width * inplanes, 4 * width, 4 * width]  # downsample, its bn
            inplanes = 4 * width
    counts += [classes * inplanes, classes]  # fc
    return tuple(counts)


#: Element counts of ResNet-50's 161 gradient tensors (25,557,032 elements).
RESNET50_GRADIENTS: tuple[int, ...] = resnet50_gradient_counts()

"""Wide-ResNet as Alpa evaluates it (Zheng et al. 2022, §8.1, Table 4): a ResNet-50/101 of bottleneck blocks whose
3×3 convolution is ``width_factor`` times wider than the block's base filters.

Shapes (image 224, fp32 in Alpa's runs): ``num_filters`` base channels ``C``, stage ``i`` of the blocks uses
``C·2^i`` filters; a bottleneck block is 1×1 conv (→ f) · 3×3 conv (f → f·W, stride 2 in the first block of stages
1–3) · 1×1 conv (f·W → 4f), each followed by BatchNorm, ReLU after the first two and after the residual add; a 1×1
projection on the residual where its shape changes. Alpa's sizes: 250M (50 layers, C 160, W 2) … 6.8B (50, 320, 16),
13B (50, 320, 32), batch 1,536 in 24–48 micro-batches.

``forward(pixel_values, labels)`` returns the cross-entropy loss, so the model plans as the language models of
:mod:`plan_scaling` do (one dict batch, no ``loss_fn``).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

STAGE_BLOCKS = {50: (3, 4, 6, 3), 101: (3, 4, 23, 3)}
"""Bottleneck blocks per stage of the ResNet depths Alpa uses."""
SIZES = {  # Alpa's Wide-ResNet sizes: depth, base filters, width factor
    "wresnet-250m": (50, 160, 2),
    "wresnet-1b": (50, 320, 2),
    "wresnet-2b": (50, 448, 2),
    "wresnet-4b": (50, 640, 2),
    "wresnet-6.8b": (50, 320, 16),
    "wresnet-13b": (50, 320, 32),
}


class Bottleneck(nn.Module):
    """1×1 → 3×3 (``width_factor`` wider, ``stride``) → 1×1 (4× the filters), plus the residual."""

    def __init__(self, in_channels: int, filters: int, width_factor: int, stride: int):
        super().__init__()
        wide = filters * width_factor
        self.reduce = nn.Conv2d(in_channels, filters, 1, bias=False)
        self.reduce_norm = nn.BatchNorm2d(filters)
        self.spatial = nn.Conv2d(filters, wide, 3, stride=stride, padding=1, bias=False)
        self.spatial_norm = nn.BatchNorm2d(wide)
        self.expand = nn.Conv2d(wide, 4 * filters, 1, bias=False)
        self.expand_norm = nn.BatchNorm2d(4 * filters)
        self.project = None
        if stride != 1 or in_channels != 4 * filters:
            self.project = nn.Sequential(nn.Conv2d(in_channels, 4 * filters, 1, stride=stride, bias=False),
                                         nn.BatchNorm2d(4 * filters))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.reduce_norm(self.reduce(x)))
        y = F.relu(self.spatial_norm(self.spatial(y)))
        y = self.expand_norm(self.expand(y))
        return F.relu(y + (x if self.project is None else self.project(x)))


class WideResNet(nn.Module):
    """Images ``[B, 3, H, W]`` and labels ``[B]`` → the mean cross-entropy over ``num_classes``."""

    def __init__(self, depth: int = 50, num_filters: int = 64, width_factor: int = 2, num_classes: int = 1024):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, num_filters, 7, stride=2, padding=3, bias=False),
                                  nn.BatchNorm2d(num_filters), nn.ReLU(), nn.MaxPool2d(3, stride=2, padding=1))
        blocks, channels = [], num_filters
        for stage, count in enumerate(STAGE_BLOCKS[depth]):
            filters = num_filters * 2 ** stage
            for index in range(count):
                blocks.append(Bottleneck(channels, filters, width_factor, 2 if stage > 0 and index == 0 else 1))
                channels = 4 * filters
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(channels, num_classes)

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        features = self.blocks(self.stem(pixel_values)).mean(dim=(2, 3))
        return F.cross_entropy(self.head(features), labels)


def build(size: str, batch: int = 1536, image: int = 224) -> tuple[WideResNet, dict[str, torch.Tensor]]:
    """``(model on the meta device, example batch)`` of one of :data:`SIZES`."""
    depth, filters, width = SIZES[size]
    with torch.device("meta"):
        model = WideResNet(depth, filters, width)
        batch_tensors = {"pixel_values": torch.zeros(batch, 3, image, image),
                         "labels": torch.zeros(batch, dtype=torch.long)}
    return model, batch_tensors

"""A frozen 4-block CNN standing in for a pretrained backbone, heads to train on its
layers, and synthetic 3x32x32 images; shared by the transfer-learning example and
benchmark.

The backbone's weights are fixed by a seed, as a pretrained network's are fixed by
its checkpoint; with real weights ``backbone_fn`` would load them (for instance
``torchvision.models.resnet50(weights=...)``) and return ``model.requires_grad_(False)``.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import cloudpickle
import numpy as np
import torch
from torch import nn

cloudpickle.register_pickle_by_value(sys.modules[__name__])

CHANNELS = (16, 32, 64, 128)
# The channels of each block's output, per backbone (a config's "arch"; "cnn" without one).
ARCH_CHANNELS = {"cnn": CHANNELS, "resnet50": (256, 512, 1024, 2048)}
# Feature name -> the submodule whose output it is (as nn.Module.get_submodule takes it).
LAYERS = {f"block{i + 1}": f"blocks.{i}" for i in range(len(CHANNELS))}
CLASSES = 4


class Backbone(nn.Module):
    """Four conv blocks (conv, BatchNorm, ReLU, 2x2 max-pool) and a classifier the search never uses."""

    def __init__(self) -> None:
        super().__init__()
        blocks, c_in = [], 3
        for c_out in CHANNELS:
            blocks.append(nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1), nn.BatchNorm2d(c_out),
                                        nn.ReLU(inplace=True), nn.MaxPool2d(2)))
            c_in = c_out
        self.blocks = nn.Sequential(*blocks)
        self.classifier = nn.Linear(c_in * 2 * 2, 1000)
        for block in self.blocks:  # non-trivial statistics, as a trained network has
            block[1].running_mean.uniform_(-0.2, 0.2)
            block[1].running_var.uniform_(0.5, 1.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.blocks(x).flatten(1))


class _Bottleneck(nn.Module):
    """ResNet's bottleneck block: 1x1, 3x3 (stride), 1x1 convolutions and a shortcut."""

    def __init__(self, c_in: int, mid: int, stride: int) -> None:
        super().__init__()
        c_out = 4 * mid
        self.body = nn.Sequential(
            nn.Conv2d(c_in, mid, 1, bias=False), nn.BatchNorm2d(mid), nn.ReLU(inplace=True),
            nn.Conv2d(mid, mid, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(mid), nn.ReLU(inplace=True),
            nn.Conv2d(mid, c_out, 1, bias=False), nn.BatchNorm2d(c_out))
        self.shortcut = (nn.Identity() if stride == 1 and c_in == c_out else
                         nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.shortcut(x))


class ResNet50Backbone(nn.Module):
    """ResNet-50-shaped (bottleneck stages of 3, 4, 6 and 3 blocks, 23.5M parameters) with a
    3x3 stem for 32x32 inputs, as CIFAR ResNets have; ``blocks[i]`` ends stage i + 1."""

    def __init__(self) -> None:
        super().__init__()
        stages, c_in = [], 64
        for i, (mid, n) in enumerate(zip((64, 128, 256, 512), (3, 4, 6, 3), strict=True)):
            layers = [_Bottleneck(c_in if j == 0 else 4 * mid, mid, 2 if (i > 0 and j == 0) else 1) for j in range(n)]
            stages.append(nn.Sequential(*layers))
            c_in = 4 * mid
        stem = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True))
        self.blocks = nn.Sequential(nn.Sequential(stem, stages[0]), *stages[1:])
        self.classifier = nn.Linear(2048, 1000)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.blocks(x).mean(dim=(2, 3)))


def backbone_fn(arch: str = "cnn") -> nn.Module:
    """The frozen backbone (``"cnn"`` or ``"resnet50"``), its weights fixed by a seed."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(2024)
        net = Backbone() if arch == "cnn" else ResNet50Backbone()
        return net.requires_grad_(False)


def head_fn(config: Mapping[str, Any]) -> nn.Module:
    """The trainable part: an MLP on one layer's average-pooled features."""
    channels = ARCH_CHANNELS[config.get("arch", "cnn")][int(config["layer"][-1]) - 1]
    return nn.Sequential(nn.Linear(channels, config["width"]), nn.ReLU(), nn.Linear(config["width"], CLASSES))


class _FrozenBlocks(nn.Module):
    """The backbone's blocks up to one layer, frozen and kept in eval mode, then pooled."""

    def __init__(self, depth: int, arch: str) -> None:
        super().__init__()
        self.blocks = backbone_fn(arch).blocks[:depth]

    def train(self, mode: bool = True) -> _FrozenBlocks:
        super().train(mode)
        self.blocks.eval()  # BatchNorm statistics must not move
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.blocks(x).flatten(2).mean(dim=-1)


def full_model_fn(config: Mapping[str, Any]) -> nn.Module:
    """The same model with the frozen backbone inside ``model_fn``: what a user writes
    without FrozenFeatures. Every unit of every configuration runs the frozen layers."""
    return nn.Sequential(_FrozenBlocks(int(config["layer"][-1]), config.get("arch", "cnn")), head_fn(config))


def optimizer_fn(config: Mapping[str, Any], params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=config["lr"])


def synthetic_images(rows: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``rows`` noisy images of ``CLASSES`` smooth random patterns, float32, and their classes."""
    rng = np.random.default_rng(seed)
    coarse = rng.normal(size=(CLASSES, 3, 4, 4))
    templates = np.kron(coarse, np.ones((1, 1, 8, 8)))  # 3x32x32, constant on 8x8 squares
    y = rng.integers(0, CLASSES, size=rows)
    X = 0.25 * templates[y] + rng.normal(size=(rows, 3, 32, 32))
    return X.astype(np.float32), y.astype(np.int64)

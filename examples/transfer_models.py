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


def backbone_fn() -> nn.Module:
    """The frozen backbone, its weights fixed by a seed."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(2024)
        return Backbone().requires_grad_(False)


def head_fn(config: Mapping[str, Any]) -> nn.Module:
    """The trainable part: an MLP on one layer's average-pooled features."""
    channels = CHANNELS[int(config["layer"][-1]) - 1]
    return nn.Sequential(nn.Linear(channels, config["width"]), nn.ReLU(), nn.Linear(config["width"], CLASSES))


class _FrozenBlocks(nn.Module):
    """The backbone's blocks up to one layer, frozen and kept in eval mode, then pooled."""

    def __init__(self, depth: int) -> None:
        super().__init__()
        self.blocks = backbone_fn().blocks[:depth]

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
    return nn.Sequential(_FrozenBlocks(int(config["layer"][-1])), head_fn(config))


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

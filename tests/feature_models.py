"""A frozen CNN backbone and trainable heads for the frozen-feature tests; cloudpickle
sends this module to Dask workers by value."""

from __future__ import annotations

import sys

import cloudpickle
import numpy as np
import torch
from torch import nn

from cerebro_automl import FrozenFeatures, PartitionedDataset, TrainingSpec, accuracy

cloudpickle.register_pickle_by_value(sys.modules[__name__])

LAYERS = {"b1": "blocks.0", "b2": "blocks.1", "b3": "blocks.2"}
CHANNELS = 6
# Forward calls of the backbone in this process (the local executor's), per input row.
ROWS_SEEN = [0]


class Backbone(nn.Module):
    """Three conv blocks with BatchNorm (running statistics that must not move)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[
            nn.Sequential(nn.Conv2d(3 if i == 0 else CHANNELS, CHANNELS, 3, padding=1),
                          nn.BatchNorm2d(CHANNELS), nn.ReLU(inplace=True))
            for i in range(3)
        ])
        for block in self.blocks:  # non-trivial statistics, as a pretrained network has
            block[1].running_mean.uniform_(-0.5, 0.5)
            block[1].running_var.uniform_(0.5, 1.5)

    def forward(self, x):
        ROWS_SEEN[0] += len(x)
        return self.blocks(x)


def backbone_fn():
    with torch.random.fork_rng(devices=[]):  # its own weights, whatever the caller's seed
        torch.manual_seed(7)
        return Backbone().requires_grad_(False)


def trainable_backbone_fn():
    return Backbone()


def head_fn(config):
    """The trainable part: it reads the pooled features of one layer."""
    return nn.Sequential(nn.Linear(CHANNELS, config["width"]), nn.ReLU(), nn.Linear(config["width"], 3))


def full_model_fn(config):
    """The same model with the backbone inside model_fn (the slow way), frozen and kept
    in eval mode, and pooled as FrozenFeatures(pool="avg") pools."""
    depth = int(config["layer"][1])
    return nn.Sequential(_Frozen(backbone_fn().blocks[:depth]), _Pool(), head_fn(config))


class _Frozen(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def train(self, mode=True):  # the frozen part stays in eval mode
        super().train(mode)
        self.inner.eval()
        return self

    def forward(self, x):
        with torch.no_grad():
            return self.inner(x)


class _Pool(nn.Module):
    def forward(self, x):
        return x.flatten(2).mean(dim=-1)


def optimizer_fn(config, params):
    return torch.optim.SGD(params, lr=config["lr"], momentum=0.9)


def make_spec(**features_kwargs) -> TrainingSpec:
    kwargs = {"layers": LAYERS, "pool": "avg", **features_kwargs}
    return TrainingSpec(model_fn=head_fn, optimizer_fn=optimizer_fn, metrics={"accuracy": accuracy},
                        batch_size=16, features=FrozenFeatures(backbone_fn, **kwargs))


def images(rows: int = 480, seed: int = 0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(rows, 3, 8, 8)).astype(np.float32)
    y = (X[:, 0].mean(axis=(1, 2)) > 0).astype(np.int64) + (X[:, 1, :4].mean(axis=(1, 2)) > 0)
    return X, y


def image_data(rows: int = 480, partitions: int = 3) -> PartitionedDataset:
    X, y = images(rows)
    return PartitionedDataset.from_arrays(X, y, num_partitions=partitions, valid_fraction=0.25)


CONFIGS = [{"layer": layer, "width": width, "lr": 0.05} for layer in ("b1", "b3") for width in (4, 8)]

"""Models with a frozen base for the tests (sent to Dask workers by value): a seeded
"pretrained" trunk with BatchNorm, frozen by ``requires_grad_(False)``, and a trainable head."""

from __future__ import annotations

import os
import sys

import cloudpickle
import torch
from torch import nn

from cerebro_automl import TrainingSpec, accuracy

cloudpickle.register_pickle_by_value(sys.modules[__name__])


class FineTuned(nn.Module):
    """A trunk whose weights come from ``base_seed`` (a stand-in for a checkpoint), frozen,
    and a head of width ``width``; ``unfreeze`` trains the trunk's last layer too."""

    def __init__(self, width: int, base_seed: int = 0, unfreeze: bool = False) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(8, 256), nn.ReLU(), nn.Linear(256, 256), nn.BatchNorm1d(256), nn.ReLU())
        g = torch.Generator().manual_seed(base_seed)
        with torch.no_grad():
            for p in self.trunk.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        self.trunk.requires_grad_(False)
        if unfreeze:
            self.trunk[2].requires_grad_(True)
        self.head = nn.Sequential(nn.Linear(256, width), nn.ReLU(), nn.Linear(width, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.trunk(x))


BUILDS = {"count": 0}


def model_fn(config):
    if torch.empty(0).device.type != "meta":  # Session.add checks a config on the meta device
        BUILDS["count"] += 1
    return FineTuned(config["width"], config.get("base_seed", 0), config.get("unfreeze", False))


def per_process_model_fn(config):
    """A base that differs on every process: as if each node read another file."""
    return FineTuned(config["width"], os.getpid())


def adamw(config, params):
    return torch.optim.AdamW(params, lr=config["lr"])


def make_spec(**overrides) -> TrainingSpec:
    options = dict(model_fn=model_fn, optimizer_fn=adamw, metrics={"accuracy": accuracy}, batch_size=32)
    return TrainingSpec(**{**options, **overrides})


CONFIGS = [{"width": w, "lr": lr} for w in (8, 16) for lr in (1e-3, 1e-2)]

"""Model code for the tests; cloudpickle sends it to Dask workers by value."""

from __future__ import annotations

import sys
import time

import cloudpickle
import torch
from torch import nn

from cerebro_automl import TrainingSpec, accuracy

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def model_fn(config):
    return nn.Sequential(nn.Linear(8, config["width"]), nn.ReLU(),
                         nn.Dropout(config.get("dropout", 0.1)), nn.Linear(config["width"], 3))


class SlowLinear(nn.Linear):
    """Slow enough that a driver can be killed mid-epoch (the resume tests)."""

    def forward(self, x):
        time.sleep(0.004)
        return super().forward(x)


def slow_model_fn(config):
    return nn.Sequential(SlowLinear(8, config["width"]), nn.ReLU(), nn.Linear(config["width"], 3))


def optimizer_fn(config, params):
    return torch.optim.Adam(params, lr=config["lr"])


def step_scheduler(config, optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)


def make_spec(**overrides) -> TrainingSpec:
    kwargs = dict(model_fn=model_fn, optimizer_fn=optimizer_fn,
                  loss_fn=nn.functional.cross_entropy, metrics={"accuracy": accuracy},
                  batch_size=32)
    kwargs.update(overrides)
    return TrainingSpec(**kwargs)


CONFIGS = [{"lr": lr, "width": w} for lr in (1e-3, 1e-2) for w in (8, 16)]

"""MNIST-1D data and models shared by the examples and the benchmarks.

MNIST-1D (Greydanus 2020) is generated locally by the ``mnist1d`` package: no
download. Published test accuracies: logistic regression ~32%, MLP ~68%, CNN ~94%.
"""

from __future__ import annotations

from typing import Any, Mapping

import cloudpickle
import numpy as np
import torch
from torch import nn

import sys

# Send this module's functions to Dask workers by value, so that workers started
# elsewhere (`dask worker ...`) need not have the examples folder on their path.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def load_mnist1d(num_samples: int = 5000, seed: int = 42) -> tuple[np.ndarray, ...]:
    """(X_train, y_train, X_test, y_test) as float32 / int64, 80/20 split."""
    from mnist1d.data import get_dataset_args, make_dataset

    args = get_dataset_args()
    args.num_samples, args.seed = num_samples, seed
    d = make_dataset(args)
    return (d["x"].astype(np.float32), d["y"].astype(np.int64),
            d["x_test"].astype(np.float32), d["y_test"].astype(np.int64))


class ConvNet(nn.Module):
    """A small 1-D CNN for length-40 sequences."""

    def __init__(self, width: int = 32, dropout: float = 0.0) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv1d(1, width, 5, padding=2), nn.ReLU(),
            nn.Conv1d(width, width, 3, padding=1, stride=2), nn.ReLU(),
            nn.Conv1d(width, width, 3, padding=1, stride=2), nn.ReLU(),
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Dropout(dropout), nn.Linear(width * 10, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x.unsqueeze(1)))


def model_fn(config: Mapping[str, Any]) -> nn.Module:
    """``arch`` "mlp" or "cnn", ``width``, optional ``dropout``."""
    width, dropout = config["width"], config.get("dropout", 0.0)
    if config["arch"] == "cnn":
        return ConvNet(width, dropout)
    return nn.Sequential(nn.Linear(40, width), nn.ReLU(), nn.Dropout(dropout),
                         nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))


def optimizer_fn(config: Mapping[str, Any], params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=config["lr"], weight_decay=config.get("weight_decay", 0.0))


def sample_config(rng: np.random.Generator) -> dict[str, Any]:
    """A random MLP/CNN configuration, for the multi-fidelity tuners' ``sampler(rng)``."""
    arch = str(rng.choice(["mlp", "cnn"]))
    widths = [32, 64, 128] if arch == "mlp" else [16, 32, 64]
    return {"arch": arch, "width": int(rng.choice(widths)),
            "lr": float(10 ** rng.uniform(np.log10(3e-4), -2)),
            "weight_decay": float(10 ** rng.uniform(-6, -2)), "batch_size": 64}

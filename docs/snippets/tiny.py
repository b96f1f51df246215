"""Tiny data and a spec for the manual's snippets: a few rows, runs in seconds.

Every snippet file under docs/snippets runs as a script (tests/test_docs.py); the
manual shows the part between its ``--8<-- [start:...]`` and ``[end:...]`` markers.
"""

import numpy as np
import torch

from cerebro_automl import PartitionedDataset, TrainingSpec, accuracy

rng = np.random.default_rng(0)
X = rng.normal(size=(96, 40)).astype("float32")
y = (X[:, 0] > 0).astype("int64") + (X[:, 1] > 0).astype("int64")
X_val, y_val = X[:32], y[:32]


def mlp(c):
    return torch.nn.Sequential(torch.nn.Linear(40, c["width"]), torch.nn.ReLU(),
                               torch.nn.Linear(c["width"], 10))


spec = TrainingSpec(model_fn=mlp, optimizer_fn=lambda c, params: torch.optim.Adam(params, lr=c["lr"]),
                    loss_fn=torch.nn.functional.cross_entropy, metrics={"accuracy": accuracy},
                    batch_size=16)
data = PartitionedDataset.from_arrays(X, y, num_partitions=2, valid=(X_val, y_val))

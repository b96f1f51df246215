"""Models and data for the structured-data tests: a Criteo-style two-input model,
an autoencoder, augmentation, a map-style Dataset and a LightningDataModule.
Sent to Dask workers by value (cloudpickle)."""

from __future__ import annotations

import os
import sys

import cloudpickle
import lightning.pytorch as L
import numpy as np
import torch
from torch import nn

from cerebro_automl import TrainingSpec, accuracy

cloudpickle.register_pickle_by_value(sys.modules[__name__])

DENSE, CATEGORICAL, BUCKETS = 13, 4, 97
BIG_ID = 2**24 + 1  # float32 cannot hold it: it would become 2**24


def criteo_arrays(rows: int, seed: int = 0) -> tuple[dict, np.ndarray]:
    """13 float64 dense features and 4 int64 id columns with ids at and above 2**24;
    the label depends on the exact ids (a float32 id would change it)."""
    rng = np.random.default_rng(seed)
    dense = rng.normal(size=(rows, DENSE))
    cat = BIG_ID + rng.integers(0, 10_000, size=(rows, CATEGORICAL), dtype=np.int64)
    label = ((cat[:, 0] % BUCKETS) % 2).astype(np.int64)
    return {"dense": dense, "cat": cat}, label


class CriteoNet(nn.Module):
    """Dense features through a linear layer, ids hashed into embedding tables."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.embed = nn.ModuleList(nn.Embedding(BUCKETS, 4) for _ in range(CATEGORICAL))
        self.dense = nn.Linear(DENSE, width)
        self.head = nn.Sequential(nn.ReLU(), nn.Dropout(0.1), nn.Linear(width + 4 * CATEGORICAL, 2))

    def forward(self, dense: torch.Tensor, cat: torch.Tensor) -> torch.Tensor:
        assert cat.dtype == torch.int64 and dense.dtype == torch.float32
        ids = cat % BUCKETS
        embedded = [table(ids[:, i]) for i, table in enumerate(self.embed)]
        return self.head(torch.cat([self.dense(dense), *embedded], dim=1))


def criteo_spec(**overrides) -> TrainingSpec:
    kwargs = dict(model_fn=lambda c: CriteoNet(c["width"]),
                  optimizer_fn=lambda c, p: torch.optim.Adam(p, lr=c["lr"]),
                  loss_fn=nn.functional.cross_entropy, metrics={"accuracy": accuracy}, batch_size=64)
    kwargs.update(overrides)
    return TrainingSpec(**kwargs)


def autoencoder_spec(**overrides) -> TrainingSpec:
    """Unlabeled data: the targets are the inputs (forward_fn)."""
    kwargs = dict(model_fn=lambda c: nn.Sequential(nn.Linear(8, c["width"]), nn.ReLU(),
                                                   nn.Dropout(0.1), nn.Linear(c["width"], 8)),
                  optimizer_fn=lambda c, p: torch.optim.Adam(p, lr=c["lr"]),
                  loss_fn=nn.functional.mse_loss, forward_fn=lambda model, x, y: (model(x), x),
                  metrics={"mae": lambda out, x: (out - x).abs().mean()}, batch_size=32)
    kwargs.update(overrides)
    return TrainingSpec(**kwargs)


def noise_augment(x: torch.Tensor, y: torch.Tensor, generator: torch.Generator):
    """Gaussian noise drawn from the unit's generator."""
    return x + 0.3 * torch.randn(x.shape, generator=generator, device=x.device), y


def scale_eval(x: torch.Tensor, y: torch.Tensor):
    return x * 1.0, y


class ItemDataset(torch.utils.data.Dataset):
    """``rows`` items ``(features float64 numpy, label int)``, made on access from the index;
    built on the worker, it leaves a mark naming the process in ``marks`` (if given)."""

    def __init__(self, rows: int, marks: str | None = None, labeled: bool = True, offset: int = 0) -> None:
        self.rows, self.labeled, self.offset = rows, labeled, offset
        if marks is not None:
            with open(os.path.join(marks, f"built-{os.getpid()}-{id(self)}"), "w"):
                pass

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, index: int):
        if not 0 <= index < self.rows:
            raise IndexError(index)
        rng = np.random.default_rng(index + self.offset)
        x = rng.normal(size=8)
        if not self.labeled:
            return torch.from_numpy(x).float()
        return x, int(x[0] > 0) + int(x[1] > 0)


class FileDataModule(L.LightningDataModule):
    """Writes its data to ``folder`` in prepare_data (once), reads it in setup."""

    def __init__(self, folder: str, rows: int = 480) -> None:
        super().__init__()
        self.folder, self.rows = folder, rows

    def prepare_data(self) -> None:
        path = os.path.join(self.folder, "data.npz")
        if not os.path.exists(path):
            rng = np.random.default_rng(0)
            x = rng.normal(size=(self.rows, 8)).astype(np.float32)
            y = (x @ rng.normal(size=(8, 3))).argmax(1)
            np.savez(path + ".tmp.npz", x=x, y=y)
            os.replace(path + ".tmp.npz", path)

    def setup(self, stage: str) -> None:
        with np.load(os.path.join(self.folder, "data.npz")) as f:
            x, y = torch.from_numpy(f["x"]), torch.from_numpy(f["y"])
        cut = int(self.rows * 0.8)
        self.train_set = torch.utils.data.TensorDataset(x[:cut], y[:cut])
        self.val_set = torch.utils.data.TensorDataset(x[cut:], y[cut:])

    def train_dataloader(self):
        return torch.utils.data.DataLoader(self.train_set, batch_size=32)

    def val_dataloader(self):
        return torch.utils.data.DataLoader(self.val_set, batch_size=32)


class LitClassifier8(L.LightningModule):
    """Classifies 8 features into 3 classes; logs val_loss and val_acc."""

    def __init__(self, lr: float) -> None:
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 3))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        self.log_dict({"val_loss": nn.functional.cross_entropy(logits, y),
                       "val_acc": (logits.argmax(-1) == y).float().mean()})

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.lr)

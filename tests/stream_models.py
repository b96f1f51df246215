"""Streams for the IterableDataset tests: a class-sorted stream (with and without
``len()``), the same rows as a map-style Dataset, a DataModule over streams, and a
small MLP spec for 4 classes. Sent to Dask workers by value (cloudpickle)."""

from __future__ import annotations

import sys
import weakref
from typing import ClassVar

import cloudpickle
import lightning.pytorch as L
import torch
from torch import nn

from cerebro_automl import TrainingSpec, accuracy

cloudpickle.register_pickle_by_value(sys.modules[__name__])

FEATURES, CLASSES = 8, 4


def sorted_rows(rows: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` float32 rows of FEATURES drawn with ``seed`` and their labels (0..CLASSES-1,
    the same function of the rows for every seed), sorted by label: the stream order that
    contiguous partitions ruin."""
    x = torch.randn(rows, FEATURES, generator=torch.Generator().manual_seed(seed))
    y = (x @ torch.randn(FEATURES, CLASSES, generator=torch.Generator().manual_seed(99))).argmax(1)  # one task
    order = y.argsort(stable=True)
    return x[order].contiguous(), y[order].contiguous()


class Stream(torch.utils.data.IterableDataset):
    """``(x, label)`` items of :func:`sorted_rows`, in order; no ``len()``."""

    def __init__(self, rows: int = 400, seed: int = 0) -> None:
        self.rows, self.seed = rows, seed

    def __iter__(self):
        x, y = sorted_rows(self.rows, self.seed)
        for i in range(self.rows):
            yield x[i], int(y[i])


class SizedStream(Stream):
    """A :class:`Stream` whose ``len()`` is ``length`` (its true length unless told otherwise)."""

    def __init__(self, rows: int = 400, seed: int = 0, length: int | None = None) -> None:
        super().__init__(rows, seed)
        self.length = rows if length is None else length

    def __len__(self) -> int:
        return self.length


class Unread(torch.utils.data.IterableDataset):
    """A stream that must not be read: iterating it fails."""

    def __iter__(self):
        raise AssertionError("the stream was read")


class Items(torch.utils.data.IterableDataset):
    """The given items, in order."""

    def __init__(self, items: list) -> None:
        self.items = items

    def __iter__(self):
        return iter(self.items)


class Tracked(Stream):
    """A :class:`Stream` that counts, when it ends, how many of the items it yielded
    are still alive (held by the reader): ``Tracked.alive_at_end``."""

    alive_at_end: ClassVar[list[int]] = []

    def __iter__(self):
        refs = []
        for item in super().__iter__():
            refs.append(weakref.ref(item[0]))
            yield item
        Tracked.alive_at_end.append(sum(r() is not None for r in refs))


class Rows(torch.utils.data.Dataset):
    """Map-style: the given ``(x, label)`` items."""

    def __init__(self, items: list) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int):
        return self.items[index]


class StreamDataModule(L.LightningDataModule):
    """A DataModule whose train and val loaders read streams."""

    def __init__(self, rows: int = 400, valid_rows: int = 80) -> None:
        super().__init__()
        self.rows, self.valid_rows = rows, valid_rows

    def train_dataloader(self):
        return torch.utils.data.DataLoader(Stream(self.rows), batch_size=32)

    def val_dataloader(self):
        return torch.utils.data.DataLoader(Stream(self.valid_rows, seed=1), batch_size=32)


def mlp(config):
    return nn.Sequential(nn.Linear(FEATURES, config["width"]), nn.ReLU(), nn.Linear(config["width"], CLASSES))


def mlp_spec() -> TrainingSpec:
    return TrainingSpec(model_fn=mlp, optimizer_fn=lambda c, p: torch.optim.Adam(p, lr=c["lr"]),
                        loss_fn=nn.functional.cross_entropy, metrics={"accuracy": accuracy}, batch_size=16)


CONFIGS = ({"lr": 1e-2, "width": 8}, {"lr": 3e-3, "width": 16}, {"lr": 1e-2, "width": 4})

"""torch Datasets built on the workers: ``from_torch`` and ``from_datamodule``.

A factory (``dataset_fn``, or a LightningDataModule's dataloaders) builds the
Dataset on each worker. Of a map-style Dataset, partition ``i`` is a subset of
its indices; without a cache, items are read and collated through the Dataset
on every batch; with ``cache="memory"`` or ``"disk"`` they are collated once,
when the partition loads. An ``IterableDataset`` (a stream) is read whole by
every partition's worker, which keeps its share of the items
(:mod:`~cerebro_automl.data.streams`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .assign import assign_rows
from .options import LoadOptions, check_options, check_partitions, check_picklable
from .partition import CACHES, PartitionData, dataset_partition
from .shards import DatasetShard
from .source import Source, SourcePlan
from .streams import StreamShare, is_stream, stream_share

__all__ = ["TorchSource", "torch_plan", "datamodule_plan"]


class _DatasetFactory:
    """Builds the train and validation Datasets on the worker (``from_torch``)."""

    def __init__(
        self, dataset_fn: Callable[[], Any], valid_fn: Callable[[], Any] | None, collate_fn: Callable | None
    ) -> None:
        self.dataset_fn, self.valid_fn, self.collate_fn = dataset_fn, valid_fn, collate_fn

    def train(self) -> tuple[Any, Callable]:
        return _check_dataset(self.dataset_fn(), "dataset_fn()"), self._collate()

    def valid(self) -> tuple[Any, Callable] | None:
        if self.valid_fn is None:
            return None
        return _check_dataset(self.valid_fn(), "valid_fn()"), self._collate()

    def _collate(self) -> Callable:
        from torch.utils.data import default_collate

        return self.collate_fn or default_collate


class _DataModuleDatasets:
    """A LightningDataModule's datasets, set up on the worker (``from_datamodule``)."""

    def __init__(self, datamodule: Any, has_validation: bool) -> None:
        self.datamodule, self.has_validation = datamodule, has_validation
        self._ready = False

    def _setup(self) -> None:
        if not self._ready:  # once per copy of the DataModule on a worker
            self.datamodule.prepare_data()
            self.datamodule.setup("fit")
            self._ready = True

    def train(self) -> tuple[Any, Callable]:
        self._setup()
        loader = self.datamodule.train_dataloader()
        return _check_dataset(loader.dataset, "train_dataloader().dataset"), loader.collate_fn

    def valid(self) -> tuple[Any, Callable] | None:
        if not self.has_validation:
            return None
        self._setup()
        loader = self.datamodule.val_dataloader()
        if isinstance(loader, (list, tuple)):
            if len(loader) != 1:
                raise ValueError(
                    f"val_dataloader() returned {len(loader)} loaders, but cerebro_automl validates on one"
                )
            loader = loader[0]
        return _check_dataset(loader.dataset, "val_dataloader().dataset"), loader.collate_fn


def _check_dataset(dataset: Any, where: str) -> Any:
    """``dataset`` itself, once it proves a map-style Dataset (``__len__`` and
    ``__getitem__``) or a stream (an ``IterableDataset``)."""
    if not (is_stream(dataset) or (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__"))):
        raise TypeError(
            f"{where} is a {type(dataset).__name__}, but must be a map-style torch Dataset "
            "(with __len__ and __getitem__) or a torch IterableDataset"
        )
    return dataset


class TorchSource(Source):
    """A partition's share of a torch Dataset (map-style, or a stream) built on the worker."""

    def __init__(self, datasets: Any, num_partitions: int, index: int, options: LoadOptions) -> None:
        self.datasets, self.num_partitions, self.index, self.options = datasets, num_partitions, index, options

    def _shards(self) -> tuple[DatasetShard | StreamShare, DatasetShard | StreamShare | None]:
        dataset, collate = self.datasets.train()
        train = self._share(dataset, collate, self.where, self.options.seed, validation=False)
        held_out = self.datasets.valid()
        if held_out is None:
            return train, None
        vdataset, vcollate = held_out
        return train, self._share(vdataset, vcollate, f"{self.where} validation", None, validation=True)

    def _share(
        self, dataset: Any, collate: Callable, where: str, seed: int | None, *, validation: bool
    ) -> DatasetShard | StreamShare:
        """This partition's rows of ``dataset``: validation rows are never seeded (contiguous, or dealt in turn)."""
        if is_stream(dataset):
            return stream_share(dataset, collate, where, self.num_partitions, self.index, seed, validation=validation)
        rows = len(dataset)
        if not validation:
            check_partitions(self.num_partitions, rows)
        chosen = assign_rows(rows, self.num_partitions, seed)[self.index]
        return DatasetShard(dataset, np.arange(rows)[chosen], collate, where)

    def load(self, *external: Any, scratch: str | None = None) -> PartitionData:
        train, valid = self._shards()
        return dataset_partition(train, valid, self.options, where=self.where, partition=self.index, scratch=scratch)


def torch_plan(
    dataset_fn: Callable[[], Any],
    num_partitions: int | None,
    *,
    valid_fn: Callable[[], Any] | None,
    valid_fraction: float | None,
    shuffle_seed: int | None,
    collate_fn: Callable[[list], Any] | None,
    cache: str | None,
    cache_dir: str | None,
    shuffle: bool = True,
) -> SourcePlan:
    """Check ``from_torch``'s arguments and plan one :class:`TorchSource` per partition."""
    if not callable(dataset_fn):
        raise TypeError(f"dataset_fn is {dataset_fn!r}, but must be callable as dataset_fn()")
    if valid_fn is not None and not callable(valid_fn):
        raise TypeError(f"valid_fn is {valid_fn!r}, but must be callable as valid_fn() or None")
    if collate_fn is not None and not callable(collate_fn):
        raise TypeError(f"collate_fn is {collate_fn!r}, but must be callable or None")
    check_partitions(num_partitions, None)
    if valid_fn is not None and valid_fraction is not None:
        raise ValueError("give valid_fn or valid_fraction, not both")
    options = check_options(
        None, valid_fraction, shuffle_seed, cache, cache_dir, caches=(None, *CACHES), shuffle=shuffle
    )
    datasets = _DatasetFactory(dataset_fn, valid_fn, collate_fn)
    check_picklable(datasets, "dataset_fn, valid_fn or collate_fn")
    return SourcePlan(
        lambda parts, resolved: [TorchSource(datasets, parts, i, resolved) for i in range(parts)],
        num_partitions,
        None,
        valid_fn is not None or valid_fraction is not None,
        options,
    )


def datamodule_plan(
    datamodule: Any,
    num_partitions: int | None,
    *,
    valid_fraction: float | None,
    shuffle_seed: int | None,
    cache: str | None,
    cache_dir: str | None,
    shuffle: bool = True,
) -> SourcePlan:
    """Check ``from_datamodule``'s arguments and plan one :class:`TorchSource` per partition."""
    if not callable(getattr(datamodule, "train_dataloader", None)):
        raise TypeError(
            f"datamodule is a {type(datamodule).__name__}, but must be a LightningDataModule (with train_dataloader)"
        )
    has_val = _defines_val_dataloader(datamodule)
    if has_val and valid_fraction is not None:
        raise ValueError("the DataModule defines val_dataloader; give valid_fraction only for one that does not")
    check_partitions(num_partitions, None)
    options = check_options(
        None, valid_fraction, shuffle_seed, cache, cache_dir, caches=(None, *CACHES), shuffle=shuffle
    )
    datasets = _DataModuleDatasets(datamodule, has_val)
    check_picklable(datasets, "datamodule")
    return SourcePlan(
        lambda parts, resolved: [TorchSource(datasets, parts, i, resolved) for i in range(parts)],
        num_partitions,
        None,
        has_val or valid_fraction is not None,
        options,
    )


def _defines_val_dataloader(datamodule: Any) -> bool:
    """Whether the DataModule's class defines its own ``val_dataloader`` (not Lightning's stub)."""
    method = getattr(type(datamodule), "val_dataloader", None)
    if method is None:
        return False
    for name in ("lightning.pytorch", "pytorch_lightning"):
        try:
            base = __import__(name, fromlist=["LightningDataModule"]).LightningDataModule
        except ImportError:
            continue
        if method is base.val_dataloader:
            return False
    return True

"""Shards: the rows of training or validation data a worker holds for one partition.

A shard hands out batches: ``shard.batch(rows)`` returns ``(x, y)``, the given
rows of every leaf (see :mod:`cerebro_automl.data.structure`). Three kinds:

* :class:`TensorShard`: tensors in the worker's memory (``cache="memory"``).
* :class:`~cerebro_automl.data.disk_cache.DiskShard`: leaves in files in the
  worker's scratch folder, read row by row as batches ask (``cache="disk"``).
* :class:`DatasetShard`: a map-style ``torch.utils.data.Dataset`` built on the
  worker, items collated per batch (``from_torch`` without a cache).

Example:
    >>> shard = TensorShard(torch.arange(6).reshape(3, 2), torch.tensor([0, 1, 0]))
    >>> shard.batch(torch.tensor([2, 0]))
    (tensor([[4, 5],
            [0, 1]]), tensor([0, 0]))
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from .structure import as_structure, leaves, map_structure, rows_of, take

__all__ = ["Shard", "TensorShard", "DatasetShard"]


class Shard:
    """Rows of training or validation data on one worker."""

    def __len__(self) -> int:
        raise NotImplementedError

    def batch(self, rows: torch.Tensor) -> tuple[Any, Any]:
        """``(x, y)``: the given rows of every leaf, on the CPU (``y`` None when unlabeled)."""
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        """Bytes this shard holds in the process's memory."""
        return 0


class TensorShard(Shard):
    """Tensors in memory; ``x`` and ``y`` are structures of tensors (``y`` may be None)."""

    def __init__(self, x: Any, y: Any) -> None:
        self.x, self.y = x, y
        self._rows = rows_of(x)

    def __len__(self) -> int:
        return self._rows

    def batch(self, rows: torch.Tensor) -> tuple[Any, Any]:
        return take(self.x, rows), take(self.y, rows)

    def select(self, rows: slice | np.ndarray) -> TensorShard:
        """A shard of some rows: a view for a slice, a copy for an index array."""
        if isinstance(rows, slice):
            return TensorShard(map_structure(lambda t: t[rows], self.x), map_structure(lambda t: t[rows], self.y))
        index = torch.from_numpy(rows)
        return TensorShard(take(self.x, index), take(self.y, index))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for s in (self.x, self.y) for _, t in leaves(s, "x"))


def _split_item(item: Any) -> tuple[Any, Any]:
    """A dataset item or collated batch: a 2-tuple or 2-list is ``(x, y)``, anything else ``x``."""
    if isinstance(item, (tuple, list)) and len(item) == 2:
        return item[0], item[1]
    return item, None


def _as_tuple(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


class DatasetShard(Shard):
    """Items ``indices`` of a map-style torch Dataset, collated per batch."""

    def __init__(self, dataset: Any, indices: np.ndarray, collate_fn: Callable[[list], Any], where: str) -> None:
        self.dataset, self.indices, self.collate_fn, self.where = dataset, indices, collate_fn, where

    def __len__(self) -> int:
        return len(self.indices)

    def batch(self, rows: torch.Tensor) -> tuple[Any, Any]:
        items = [self.dataset[int(self.indices[i])] for i in rows.tolist()]
        x, y = _split_item(self.collate_fn(items))
        return (
            as_structure(_as_tuple(x), f"{self.where} x"),
            as_structure(_as_tuple(y), f"{self.where} y", optional=True),
        )

    def chunks(self, size: int = 256) -> Iterator[tuple[Any, Any]]:
        """The shard's rows in order, ``size`` at a time (to cache them)."""
        for start in range(0, len(self), size):
            yield self.batch(torch.arange(start, min(start + size, len(self))))

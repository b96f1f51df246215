"""A partition on its worker: its train and validation shards, built from chunks.

Sources hand :func:`build_partition` *chunks*, ``(x, y)`` pieces of the
partition in row order; each chunk is converted and checked against the first,
then kept in memory or written to the disk cache as it comes, so a partition on
disk never needs to fit in memory while it loads.

Example:
    >>> import numpy as np
    >>> part = build_partition([(np.zeros((6, 2)), np.arange(6))], None, where="partition 0",
    ...                        partition=0, valid_fraction=0.5)
    >>> len(part.train), len(part.valid)
    (3, 3)
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np
import torch

from .disk_cache import DiskShard, DiskWriter, ScratchFolder
from .fingerprint import partition_fingerprint
from .shards import Shard, TensorShard
from .structure import as_structure, concat, count_rows, leaves

__all__ = ["PartitionData", "build_partition", "split_rows", "CACHES"]

CACHES = ("memory", "disk")


@dataclass(frozen=True)
class PartitionData:
    """What a worker holds for one partition, and its fingerprint (see
    :mod:`~cerebro_automl.data.fingerprint`), taken as it is made, where it loads."""
    train: Shard
    valid: Shard | None
    fingerprint: dict[str, Any] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "fingerprint", partition_fingerprint(self.train, self.valid))

    @property
    def nbytes(self) -> int:
        """Bytes held in memory (a disk-cached partition holds almost none)."""
        return self.train.nbytes + (self.valid.nbytes if self.valid is not None else 0)


def split_rows(rows: int, fraction: float, seed: int | None,
               partition: int) -> tuple[slice | np.ndarray, slice | np.ndarray]:
    """Train and validation rows of a shard of ``rows`` rows holding out ``fraction``:
    the last rows without a seed, a seeded random choice with one.

    >>> split_rows(10, 0.2, None, 0)
    (slice(0, 8, None), slice(8, 10, None))
    """
    n_valid = int(round(rows * fraction))
    if seed is None:
        return slice(0, rows - n_valid), slice(rows - n_valid, rows)
    order = np.random.default_rng([seed, partition, 1]).permutation(rows)
    return np.sort(order[n_valid:]), np.sort(order[:n_valid])


class _Layout:
    """The structure, dtypes and row shapes of a partition's chunks: every chunk must match."""

    def __init__(self, x: Any, y: Any, where: str) -> None:
        self.where = where
        self.signature = self._signature(x, y)

    @staticmethod
    def _signature(x: Any, y: Any) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        return [(name, t.dtype, tuple(t.shape[1:]))
                for part, label in ((x, "X"), (y, "y")) for name, t in leaves(part, label)]

    def check(self, x: Any, y: Any, chunk: int) -> None:
        got = self._signature(x, y)
        if [name for name, _, _ in got] != [name for name, _, _ in self.signature]:
            raise ValueError(f"{self.where}: chunk {chunk} has leaves {[n for n, _, _ in got]}, but the "
                             f"first chunk had {[n for n, _, _ in self.signature]}; every chunk must match")
        for (name, dtype, shape), (_, dtype0, shape0) in zip(got, self.signature):
            if (dtype, shape) != (dtype0, shape0):
                raise ValueError(f"{self.where}: chunk {chunk} has {name} of dtype {dtype} and row shape "
                                 f"{shape}, but the first chunk had {dtype0} and {shape0}; every chunk "
                                 "must match")



def _store(chunks: Iterable[tuple[Any, Any]], where: str, cache: str, folder: ScratchFolder | None,
           name: str) -> TensorShard | DiskShard | None:
    """Convert and check every chunk, then keep them in memory or write them to ``folder``
    (None: there was no chunk)."""
    layout: _Layout | None = None
    parts: list[tuple[Any, Any]] = []
    writer = DiskWriter(folder, name) if cache == "disk" else None
    first: tuple[Any, Any] | None = None
    for i, (x, y) in enumerate(chunks):
        x = as_structure(x, "X")
        y = as_structure(y, "y", optional=True)
        count_rows([("X", x), ("y", y)], f"{where} chunk {i}")
        if layout is None:
            layout, first = _Layout(x, y, where), (x, y)
        else:
            layout.check(x, y, i)
        if writer is not None:
            writer.append(x, y)
        else:
            parts.append((x, y))
    if first is None:
        return None
    if writer is not None:
        return writer.finish(*first)
    if len(parts) == 1:
        return TensorShard(*parts[0])
    return TensorShard(concat([p[0] for p in parts]), concat([p[1] for p in parts]))


def build_partition(train: Iterable[tuple[Any, Any]], valid: Iterable[tuple[Any, Any]] | None, *,
                    where: str, partition: int, valid_fraction: float | None = None,
                    split_seed: int | None = None, cache: str = "memory",
                    scratch: str | None = None) -> PartitionData:
    """A partition from chunks of its training rows (and of its validation rows, or a
    ``valid_fraction`` of the training rows held out, as :func:`split_rows` picks them).

    ``cache="disk"`` writes the chunks into a new folder under ``scratch`` as they
    come, so the partition never has to fit in memory; the folder is removed when
    the partition is collected.
    """
    folder = None
    if cache == "disk":
        if scratch is None:
            import tempfile
            scratch = tempfile.gettempdir()
        folder = ScratchFolder(os.path.join(scratch, f"p{partition}-{uuid.uuid4().hex[:12]}"))
    try:
        shard = _store(train, where, cache, folder, "train")
        if shard is None:
            raise ValueError(f"{where} holds no training data")
        if valid_fraction:
            train_rows, valid_rows = split_rows(len(shard), valid_fraction, split_seed, partition)
            return PartitionData(shard.select(train_rows), shard.select(valid_rows))
        held_out = _store(valid, f"{where} validation", cache, folder, "valid") if valid is not None else None
        return PartitionData(shard, held_out)
    except BaseException:
        if folder is not None:
            folder.remove()
        raise

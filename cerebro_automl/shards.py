"""What a worker holds for one partition: a train shard and a validation shard.

A shard hands out batches: ``shard.batch(rows)`` returns ``(x, y)``, the given
rows of every leaf (see :mod:`cerebro_automl.structure`). Three kinds:

* :class:`TensorShard`: tensors in the worker's memory (``cache="memory"``).
* :class:`DiskShard`: leaves in files in the worker's scratch folder, read row
  by row as batches ask (``cache="disk"``), through the page cache, so the
  worker's resident memory stays far below the partition's size.
* :class:`DatasetShard`: a map-style ``torch.utils.data.Dataset`` built on the
  worker, items collated per batch (``from_torch`` without a cache).

Sources build shards from *chunks*, ``(x, y)`` pieces of the partition in row
order, with :func:`build_partition`, so a partition on disk never needs to fit
in memory while it loads.
"""

from __future__ import annotations

import math
import os
import shutil
import uuid
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import torch

from .structure import as_structure, concat, count_rows, leaves, map_structure, rows_of, take

__all__ = ["Shard", "TensorShard", "DiskShard", "DatasetShard", "PartitionData",
           "build_partition", "split_rows", "CACHES"]

CACHES = ("memory", "disk")
# Rows of a disk-cached batch this close together are read with one pread of their span
# (a pread costs about as much as copying 8 KiB), up to READ_SPAN bytes at once.
MERGE_GAP = 8 * 2**10
READ_SPAN = 8 * 2**20


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

    def select(self, rows: slice | np.ndarray) -> "TensorShard":
        """A shard of some rows: a view for a slice, a copy for an index array."""
        if isinstance(rows, slice):
            return TensorShard(map_structure(lambda t: t[rows], self.x), map_structure(lambda t: t[rows], self.y))
        index = torch.from_numpy(rows)
        return TensorShard(take(self.x, index), take(self.y, index))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for s in (self.x, self.y) for _, t in leaves(s, "x"))


class _Folder:
    """A scratch folder, removed when the last shard reading from it is collected."""

    def __init__(self, path: str) -> None:
        self.path = path
        os.makedirs(path)
        self._remove = weakref.finalize(self, shutil.rmtree, path, True)

    def remove(self) -> None:
        self._remove()


class _DiskLeaf:
    """One leaf stored as raw rows in a file, gathered with ``pread``.

    Not a memory map: on a page fault, Linux maps the faulting page's neighbours
    too (fault-around, 64 KiB), so a batch of 4096 random rows put up to 256 MiB
    of file pages in the process's resident set, which Dask's nanny counts
    against the worker's memory limit. Reads through the page cache add nothing
    to it. Rows near each other in a batch are read together.
    """

    def __init__(self, path: str, dtype: torch.dtype, row_shape: tuple[int, ...], rows: int) -> None:
        self.path, self.dtype, self.row_shape, self.rows = path, dtype, row_shape, rows
        self.row_bytes = math.prod(row_shape) * torch.empty((), dtype=dtype).element_size()
        self._fd: int | None = None

    def _open(self) -> int:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
            weakref.finalize(self, os.close, self._fd)
        return self._fd

    def take(self, rows: np.ndarray) -> torch.Tensor:
        out = np.empty((len(rows), self.row_bytes), np.uint8)
        if len(rows) and self.row_bytes:
            _gather(self._open(), rows, self.row_bytes, out)
        return torch.from_numpy(out).view(self.dtype).reshape(len(rows), *self.row_shape)


def _gather(fd: int, rows: np.ndarray, row_bytes: int, out: np.ndarray) -> None:
    """Read ``rows`` of a file of ``row_bytes``-byte rows into ``out``, in the order given.

    The rows are read in ascending order: a row alone with one ``preadv`` straight
    into ``out``, rows within MERGE_GAP bytes of each other with one ``pread`` of
    their span (at most READ_SPAN bytes), then picked out of it.
    """
    order = np.argsort(rows, kind="stable")
    ascending = rows[order]
    span_rows = max(1, READ_SPAN // row_bytes)
    cut = (np.diff(ascending) * row_bytes > row_bytes + MERGE_GAP) | (np.diff(ascending // span_rows) != 0)
    breaks = np.flatnonzero(cut) + 1
    starts, ends = np.concatenate(([0], breaks)), np.concatenate((breaks, [len(ascending)]))
    flat = memoryview(out.reshape(-1))
    for i, j in zip(starts.tolist(), ends.tolist()):
        first = int(ascending[i])
        if j - i == 1:
            r = int(order[i])
            os.preadv(fd, [flat[r * row_bytes:(r + 1) * row_bytes]], first * row_bytes)
            continue
        last = int(ascending[j - 1]) + 1
        span = np.frombuffer(os.pread(fd, (last - first) * row_bytes, first * row_bytes), np.uint8)
        out[order[i:j]] = span.reshape(last - first, row_bytes)[ascending[i:j] - first]


class DiskShard(Shard):
    """Leaves in files of a scratch folder (``cache="disk"``), read row by row as batches
    ask; ``rows`` selects some of their rows (None: all), so a train and a validation
    shard can share the files."""

    def __init__(self, folder: _Folder, x: Any, y: Any, rows: np.ndarray | None = None) -> None:
        self.folder, self.x, self.y, self.rows = folder, x, y, rows
        self._rows = len(rows) if rows is not None else leaves(x, "x")[0][1].rows

    def __len__(self) -> int:
        return self._rows

    def batch(self, rows: torch.Tensor) -> tuple[Any, Any]:
        index = rows.numpy()
        if self.rows is not None:
            index = self.rows[index]
        return (map_structure(lambda leaf: leaf.take(index), self.x),
                map_structure(lambda leaf: leaf.take(index), self.y))

    def select(self, rows: slice | np.ndarray) -> "DiskShard":
        if isinstance(rows, slice):
            rows = np.arange(len(self))[rows]
        return DiskShard(self.folder, self.x, self.y, rows if self.rows is None else self.rows[rows])

    @property
    def nbytes(self) -> int:
        return 0 if self.rows is None else self.rows.nbytes

    @property
    def disk_bytes(self) -> int:
        return sum(leaf.rows * leaf.row_bytes for s in (self.x, self.y) for _, leaf in leaves(s, "x"))

    def __getstate__(self) -> Any:
        raise TypeError("a disk-cached shard lives in its worker's scratch folder and cannot be "
                        "sent to another process")


def _split_item(item: Any) -> tuple[Any, Any]:
    """A dataset item or collated batch: a 2-tuple or 2-list is ``(x, y)``, anything else ``x``."""
    if isinstance(item, (tuple, list)) and len(item) == 2:
        return item[0], item[1]
    return item, None


def _as_tuple(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


class DatasetShard(Shard):
    """Items ``indices`` of a map-style torch Dataset, collated per batch."""

    def __init__(self, dataset: Any, indices: np.ndarray, collate_fn: Callable[[list], Any],
                 where: str) -> None:
        self.dataset, self.indices, self.collate_fn, self.where = dataset, indices, collate_fn, where

    def __len__(self) -> int:
        return len(self.indices)

    def batch(self, rows: torch.Tensor) -> tuple[Any, Any]:
        items = [self.dataset[int(self.indices[i])] for i in rows.tolist()]
        x, y = _split_item(self.collate_fn(items))
        return (as_structure(_as_tuple(x), f"{self.where} x"),
                as_structure(_as_tuple(y), f"{self.where} y", optional=True))

    def chunks(self, size: int = 256) -> Iterator[tuple[Any, Any]]:
        """The shard's rows in order, ``size`` at a time (to cache them)."""
        for start in range(0, len(self), size):
            yield self.batch(torch.arange(start, min(start + size, len(self))))


@dataclass(frozen=True)
class PartitionData:
    """What a worker holds for one partition."""
    train: Shard
    valid: Shard | None

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


# ------------------------------------------------------------- building shards
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


class _DiskWriter:
    """Streams chunks into one raw file per leaf in ``folder``."""

    def __init__(self, folder: _Folder, name: str) -> None:
        self.folder, self.name = folder, name
        self.files: list[tuple[str, Any]] = []
        self.rows = 0

    def append(self, x: Any, y: Any) -> None:
        named = [t for part, label in ((x, "x"), (y, "y")) for _, t in leaves(part, label)]
        if not self.files:
            for i in range(len(named)):
                path = os.path.join(self.folder.path, f"{self.name}-{i}.bin")
                self.files.append((path, open(path, "wb")))
        for (_, f), tensor in zip(self.files, named):
            tensor.contiguous().view(torch.uint8).numpy().tofile(f)
        self.rows += rows_of(x)

    def finish(self, x: Any, y: Any) -> DiskShard:
        """The shard; ``x`` and ``y`` are the first chunk (its structure, dtypes and row shapes)."""
        for _, f in self.files:
            f.close()
        paths = iter(path for path, _ in self.files)

        def leaf(t: torch.Tensor) -> _DiskLeaf:
            return _DiskLeaf(next(paths), t.dtype, tuple(t.shape[1:]), self.rows)

        return DiskShard(self.folder, map_structure(leaf, x), map_structure(leaf, y))


def _store(chunks: Iterable[tuple[Any, Any]], where: str, cache: str, folder: _Folder | None,
           name: str) -> TensorShard | DiskShard | None:
    """Convert and check every chunk, then keep them in memory or write them to ``folder``
    (None: there was no chunk)."""
    layout: _Layout | None = None
    parts: list[tuple[Any, Any]] = []
    writer = _DiskWriter(folder, name) if cache == "disk" else None
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
        folder = _Folder(os.path.join(scratch, f"p{partition}-{uuid.uuid4().hex[:12]}"))
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

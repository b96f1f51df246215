"""The disk cache (``cache="disk"``): a partition's leaves in files, read row by row.

Each leaf is one file of raw rows in a scratch folder of the worker's (the Dask
worker's ``local_directory``, or ``cache_dir``). Batches gather their rows with
``pread`` through the page cache, so the worker's resident memory stays far
below the partition's size. The folder is removed when the last shard reading
from it is collected.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
import uuid
import weakref
from typing import Any

import numpy as np
import torch

from .shards import Shard
from .structure import leaves, map_structure, rows_of

__all__ = ["DiskShard", "DiskWriter", "ScratchFolder", "partition_folder"]

# Rows of a disk-cached batch this close together are read with one pread of their span
# (a pread costs about as much as copying 8 KiB), up to READ_SPAN bytes at once.
MERGE_GAP = 8 * 2**10
READ_SPAN = 8 * 2**20


class ScratchFolder:
    """A scratch folder, removed when the last shard reading from it is collected."""

    def __init__(self, path: str) -> None:
        self.path = path
        os.makedirs(path)
        self._remove = weakref.finalize(self, shutil.rmtree, path, True)

    def remove(self) -> None:
        self._remove()


def partition_folder(scratch: str | None, partition: int) -> ScratchFolder:
    """A new scratch folder for one partition's cache, under ``scratch`` (the system's
    temporary folder when None), named uniquely: a worker may hold a partition twice."""
    return ScratchFolder(os.path.join(scratch or tempfile.gettempdir(), f"p{partition}-{uuid.uuid4().hex[:12]}"))


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
    flat = out.reshape(-1).data
    for i, j in zip(starts.tolist(), ends.tolist(), strict=True):
        first = int(ascending[i])
        if j - i == 1:
            r = int(order[i])
            os.preadv(fd, [flat[r * row_bytes : (r + 1) * row_bytes]], first * row_bytes)
            continue
        last = int(ascending[j - 1]) + 1
        span = np.frombuffer(os.pread(fd, (last - first) * row_bytes, first * row_bytes), np.uint8)
        out[order[i:j]] = span.reshape(last - first, row_bytes)[ascending[i:j] - first]


class DiskShard(Shard):
    """Leaves in files of a scratch folder (``cache="disk"``), read row by row as batches
    ask; ``rows`` selects some of their rows (None: all), so a train and a validation
    shard can share the files."""

    def __init__(self, folder: ScratchFolder, x: Any, y: Any, rows: np.ndarray | None = None) -> None:
        self.folder, self.x, self.y, self.rows = folder, x, y, rows
        self._rows = len(rows) if rows is not None else leaves(x, "x")[0][1].rows

    def __len__(self) -> int:
        return self._rows

    def batch(self, rows: torch.Tensor) -> tuple[Any, Any]:
        index = rows.numpy()
        if self.rows is not None:
            index = self.rows[index]
        return (
            map_structure(lambda leaf: leaf.take(index), self.x),
            map_structure(lambda leaf: leaf.take(index), self.y),
        )

    def select(self, rows: slice | np.ndarray) -> DiskShard:
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
        raise TypeError(
            "a disk-cached shard lives in its worker's scratch folder and cannot be sent to another process"
        )


class DiskWriter:
    """Streams chunks into one raw file per leaf in ``folder``."""

    def __init__(self, folder: ScratchFolder, name: str) -> None:
        self.folder, self.name = folder, name
        self.files: list[tuple[str, Any]] = []
        self.rows = 0

    def append(self, x: Any, y: Any) -> None:
        named = [t for part, label in ((x, "x"), (y, "y")) for _, t in leaves(part, label)]
        if not self.files:
            for i in range(len(named)):
                path = os.path.join(self.folder.path, f"{self.name}-{i}.bin")
                self.files.append((path, open(path, "wb")))  # noqa: SIM115 (open until finish())
        for (_, f), tensor in zip(self.files, named, strict=True):
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

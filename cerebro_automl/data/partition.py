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

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, overload

import numpy as np
import torch

from .disk_cache import DiskShard, DiskWriter, ScratchFolder, partition_folder
from .errors import DataError
from .fingerprint import partition_fingerprint
from .shards import DatasetShard, Shard, TensorShard
from .streams import StreamShare
from .structure import as_structure, concat, count_rows, leaves

__all__ = [
    "PartitionData",
    "build_partition",
    "dataset_partition",
    "held_out_rows",
    "split_rows",
    "check_finite",
    "CACHES",
]

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


def held_out_rows(rows: int, fraction: float, where: str) -> int:
    """How many of a partition's ``rows`` rows ``fraction`` holds out: ``round(rows *
    fraction)``, which must leave at least one validation row and one training row
    (a ValueError names ``where``, the value and the rule).

    >>> held_out_rows(150, 0.0001, "partition 0")  # doctest: +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
    cerebro_automl.data.errors.DataError: valid_fraction is 0.0001, but partition 0 holds out
    round(150 x 0.0001) = 0 of its 150 rows; each partition holds out that fraction of its own rows, rounded,
    and must keep at least one validation row and one training row
    """
    n_valid = int(round(rows * fraction))
    if 0 < n_valid < rows:
        return n_valid
    raise DataError(
        f"valid_fraction is {fraction}, but {where} holds out round({rows} x {fraction}) = "
        f"{n_valid} of its {rows} rows; each partition holds out that fraction of its own "
        "rows, rounded, and must keep at least one validation row and one training row"
    )


def split_rows(
    rows: int, fraction: float, seed: int | None, partition: int
) -> tuple[slice | np.ndarray, slice | np.ndarray]:
    """Train and validation rows of a shard of ``rows`` rows holding out ``fraction``
    (see :func:`held_out_rows`): the last rows without a seed, a seeded random
    choice with one.

    >>> split_rows(10, 0.2, None, 0)
    (slice(0, 8, None), slice(8, 10, None))
    """
    n_valid = held_out_rows(rows, fraction, f"partition {partition}")
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
        return [
            (name, t.dtype, tuple(t.shape[1:]))
            for part, label in ((x, "X"), (y, "y"))
            for name, t in leaves(part, label)
        ]

    def check_validation(self, valid: _Layout) -> None:
        """Validation rows must have the training rows' leaves, dtypes and row shapes:
        a model trained on one and evaluated on the other fails only after an epoch."""
        names = [name for name, _, _ in self.signature]
        if [name for name, _, _ in valid.signature] != names:
            raise DataError(
                f"{valid.where} has leaves {[n for n, _, _ in valid.signature]}, but the "
                f"training data has {names}; they must match"
            )
        for (name, dtype, shape), (_, dtype0, shape0) in zip(valid.signature, self.signature, strict=True):
            if (dtype, shape) != (dtype0, shape0):
                raise DataError(
                    f"{valid.where} has {name} of dtype {dtype} and row shape {shape}, but the "
                    f"training data has {dtype0} and {shape0}; validation data must match the "
                    "training data leaf for leaf"
                )

    def check(self, x: Any, y: Any, chunk: int) -> None:
        got = self._signature(x, y)
        if [name for name, _, _ in got] != [name for name, _, _ in self.signature]:
            raise DataError(
                f"{self.where}: chunk {chunk} has leaves {[n for n, _, _ in got]}, but the "
                f"first chunk had {[n for n, _, _ in self.signature]}; every chunk must match"
            )
        for (name, dtype, shape), (_, dtype0, shape0) in zip(got, self.signature, strict=True):
            if (dtype, shape) != (dtype0, shape0):
                raise DataError(
                    f"{self.where}: chunk {chunk} has {name} of dtype {dtype} and row shape "
                    f"{shape}, but the first chunk had {dtype0} and {shape0}; every chunk "
                    "must match"
                )


def _store(
    chunks: Iterable[tuple[Any, Any]], where: str, folder: ScratchFolder | None, name: str
) -> tuple[TensorShard | DiskShard | None, _Layout | None]:
    """Convert and check every chunk, then keep them in memory, or write them to ``folder``
    when one is given (``cache="disk"``); returns the shard and the chunks' layout (None,
    None: there was no chunk)."""
    layout: _Layout | None = None
    parts: list[tuple[Any, Any]] = []
    writer = DiskWriter(folder, name) if folder is not None else None
    first: tuple[Any, Any] | None = None
    for i, (raw_x, raw_y) in enumerate(chunks):
        x = as_structure(raw_x, "X")
        y = as_structure(raw_y, "y", optional=True)
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
        return None, None
    if writer is not None:
        return writer.finish(*first), layout
    if len(parts) == 1:
        return TensorShard(*parts[0]), layout
    return TensorShard(concat([p[0] for p in parts]), concat([p[1] for p in parts])), layout


def check_finite(shard: Shard, where: str, names: tuple[str, str] = ("X", "y"), block: int = 2**16) -> None:
    """Every float leaf of ``shard`` (its x and y called ``names``) is finite, or a
    ValueError names the leaf, the row and the value: one NaN in validation data makes
    every model's ``val_loss`` NaN, and no training loss would say so. Reads ``block``
    rows at a time."""
    for start in range(0, len(shard), block):
        x, y = shard.batch(torch.arange(start, min(start + block, len(shard))))
        for name, leaf in leaves(x, names[0]) + leaves(y, names[1]):
            if not (leaf.is_floating_point() or leaf.is_complex()):
                continue
            bad = ~torch.isfinite(leaf).reshape(len(leaf), -1).all(dim=1)
            if bool(bad.any()):
                row = int(bad.nonzero()[0, 0])
                value = leaf[row][~torch.isfinite(leaf[row])].reshape(-1)[0].item()
                raise DataError(
                    f"{where}: {name} is {value} in row {start + row}; validation inputs and "
                    "labels must be finite (a NaN or infinity there makes every model's "
                    "val_loss NaN)"
                )


def build_partition(
    train: Iterable[tuple[Any, Any]],
    valid: Iterable[tuple[Any, Any]] | None,
    *,
    where: str,
    partition: int,
    valid_fraction: float | None = None,
    split_seed: int | None = None,
    cache: str = "memory",
    scratch: str | None = None,
) -> PartitionData:
    """A partition from chunks of its training rows (and of its validation rows, or a
    ``valid_fraction`` of the training rows held out, as :func:`split_rows` picks them).
    Validation rows must match the training rows' layout and be finite
    (:func:`check_finite`), or the load fails naming the leaf.

    ``cache="disk"`` writes the chunks into a new folder under ``scratch`` as they
    come, so the partition never has to fit in memory; the folder is removed when
    the partition is collected.
    """
    folder = partition_folder(scratch, partition) if cache == "disk" else None
    try:
        shard, layout = _store(train, where, folder, "train")
        if shard is None or layout is None:
            raise DataError(f"{where} holds no training data")
        if valid_fraction:
            train_rows, valid_rows = split_rows(len(shard), valid_fraction, split_seed, partition)
            data = PartitionData(shard.select(train_rows), shard.select(valid_rows))
        else:
            held_out, valid_layout = (
                _store(valid, f"{where} validation", folder, "valid") if valid is not None else (None, None)
            )
            if valid_layout is not None:
                layout.check_validation(valid_layout)
            data = PartitionData(shard, held_out)
        if data.valid is not None:
            check_finite(data.valid, f"{where} validation")
        return data
    except BaseException:
        if folder is not None:
            folder.remove()
        raise


def dataset_partition(
    train: DatasetShard | StreamShare,
    valid: DatasetShard | StreamShare | None,
    options: Any,
    *,
    where: str,
    partition: int,
    scratch: str | None,
) -> PartitionData:
    """A partition read item by item (a torch Dataset, files, a stream's share): with
    ``cache=None`` the shards themselves, read on every batch (a stream's share held as
    its items; ``valid_fraction`` taken from the training rows); else built once into
    the cache (:func:`build_partition`), a stream's share collated as it comes.
    ``options``: the source's :class:`~.options.LoadOptions`."""
    o = options
    if o.cache is None:
        train, valid = _held(train), _held(valid)
        if o.valid_fraction:
            train_rows, valid_rows = split_rows(len(train), o.valid_fraction, o.seed, partition)
            # The held-out rows read the deterministic form only: validation is never randomly transformed.
            return PartitionData(train.select(train_rows, drawn=True), train.select(valid_rows, drawn=False))
        return PartitionData(train, valid)
    return build_partition(
        train.chunks(),
        valid.chunks() if valid is not None else None,
        where=where,
        partition=partition,
        valid_fraction=o.valid_fraction,
        split_seed=o.seed,
        cache=o.cache,
        scratch=scratch,
    )


@overload
def _held(shard: DatasetShard | StreamShare) -> DatasetShard: ...
@overload
def _held(shard: DatasetShard | StreamShare | None) -> DatasetShard | None: ...
def _held(shard: DatasetShard | StreamShare | None) -> DatasetShard | None:
    """A stream's share read into memory (its items, read per batch); other shards as they are."""
    return shard.shard() if isinstance(shard, StreamShare) else shard

"""Shards: the rows of training or validation data a worker holds for one partition.

A shard hands out batches: ``shard.batch(rows)`` returns ``(x, y)``, the given
rows of every leaf (see :mod:`cerebro_automl.data.structure`), and
``shard.read(row_batches)`` the batches of a pass, in order. Three kinds:

* :class:`TensorShard`: tensors in the worker's memory (``cache="memory"``).
* :class:`~cerebro_automl.data.disk_cache.DiskShard`: leaves in files in the
  worker's scratch folder, read row by row as batches ask (``cache="disk"``).
* :class:`DatasetShard`: a map-style ``torch.utils.data.Dataset`` built on the
  worker, items collated per batch (``from_torch`` and file sources without a
  cache), decoded in threads a few batches ahead with ``decode_threads >= 1``
  (see :mod:`cerebro_automl.data.decode`).

A training pass reads ``shard.with_item_seed(seed)``: a file source's training
shard with a ``random_transform`` draws each item's transform from a generator
seeded from (``seed``, the item's index), :func:`item_generator`; every other
shard returns itself.

Example:
    >>> shard = TensorShard(torch.arange(6).reshape(3, 2), torch.tensor([0, 1, 0]))
    >>> shard.batch(torch.tensor([2, 0]))
    (tensor([[4, 5],
            [0, 1]]), tensor([0, 0]))
"""

from __future__ import annotations

import copy
import hashlib
import logging
import struct
from collections.abc import Callable, Generator, Iterable
from typing import Any

import numpy as np
import torch

from .decode import draws_global_rng, read_ahead
from .structure import as_structure, leaves, map_structure, rows_of, take

__all__ = ["Shard", "TensorShard", "DatasetShard", "item_generator"]

logger = logging.getLogger("cerebro_automl")


class Shard:
    """Rows of training or validation data on one worker."""

    def __len__(self) -> int:
        raise NotImplementedError

    def batch(self, rows: torch.Tensor) -> tuple[Any, Any]:
        """``(x, y)``: the given rows of every leaf, on the CPU (``y`` None when unlabeled)."""
        raise NotImplementedError

    def read(self, row_batches: Iterable[torch.Tensor]) -> Generator[tuple[Any, Any], None, None]:
        """``batch(rows)`` for each ``rows`` of ``row_batches``, in order (a pass's batches).
        Close the iterator when leaving a pass early: a shard may read ahead."""
        for rows in row_batches:
            yield self.batch(rows)

    def with_item_seed(self, seed: int) -> Shard:
        """The shard a training pass reads, its items' random draws seeded from ``seed``
        (the pass's: from the model's seed and the epoch). Only a shard that draws per
        item (a file source's ``random_transform``) differs; others return themselves."""
        return self

    @property
    def nbytes(self) -> int:
        """Bytes this shard holds in the process's memory."""
        return 0


def item_generator(seed: int, index: int) -> torch.Generator:
    """A CPU generator for one item of a pass, seeded from the pass's ``seed`` and the
    item's index: the same draws whichever thread, worker or executor reads it, and
    whenever. Hashed (not ``seed + index``) so neighbouring items' streams are unrelated.

    >>> a = torch.rand(2, generator=item_generator(7, 3)); b = torch.rand(2, generator=item_generator(7, 3))
    >>> torch.equal(a, b), torch.equal(a, torch.rand(2, generator=item_generator(7, 4)))
    (True, False)
    """
    digest = hashlib.blake2b(struct.pack("<QQ", seed & 2**64 - 1, index), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))


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
    """Items ``indices`` of a map-style torch Dataset, collated per batch; read by
    ``decode_threads`` threads a few batches ahead (0: one by one, in the calling thread).

    ``draw(index, generator)``, when given, reads an item with a random transform: a
    training pass's shard (:meth:`with_item_seed`) reads through it, with the item's
    :func:`item_generator`; a shard without an item seed (validation, a cache being
    filled) reads ``dataset[index]``, the deterministic form."""

    def __init__(
        self,
        dataset: Any,
        indices: np.ndarray,
        collate_fn: Callable[[list], Any],
        where: str,
        decode_threads: int = 0,
        draw: Callable[[int, torch.Generator], Any] | None = None,
    ) -> None:
        self.dataset, self.indices, self.collate_fn, self.where = dataset, indices, collate_fn, where
        self.decode_threads, self.draw = decode_threads, draw
        self.item_seed: int | None = None
        # Found on the first read (see _decodes_in_threads), shared with the per-pass copies.
        self._threads_keep_bits: dict[str, bool] = {}

    def __len__(self) -> int:
        return len(self.indices)

    def with_item_seed(self, seed: int) -> Shard:
        if self.draw is None:
            return self
        seeded = copy.copy(self)
        seeded.item_seed = seed
        return seeded

    def select(self, rows: slice | np.ndarray, *, drawn: bool) -> DatasetShard:
        """Some rows, read through the same Dataset; ``drawn=False`` drops ``draw`` (rows
        held out for validation are never randomly transformed)."""
        return DatasetShard(
            self.dataset, self.indices[rows], self.collate_fn, self.where, self.decode_threads,
            self.draw if drawn else None,
        )  # fmt: skip

    def batch(self, rows: torch.Tensor) -> tuple[Any, Any]:
        return self._collate([self._item(i) for i in rows.tolist()])

    def read(self, row_batches: Iterable[torch.Tensor]) -> Generator[tuple[Any, Any], None, None]:
        if not self._decodes_in_threads():
            return super().read(row_batches)
        return read_ahead(self._item, (rows.tolist() for rows in row_batches), self._collate, self.decode_threads)

    def _item(self, row: int) -> Any:
        index = int(self.indices[row])
        if self.draw is not None and self.item_seed is not None:
            return self.draw(index, item_generator(self.item_seed, index))
        return self.dataset[index]

    def _collate(self, items: list) -> tuple[Any, Any]:
        x, y = _split_item(self.collate_fn(items))
        return (
            as_structure(_as_tuple(x), f"{self.where} x"),
            as_structure(_as_tuple(y), f"{self.where} y", optional=True),
        )

    def _decodes_in_threads(self) -> bool:
        """Whether threads decode this shard: ``decode_threads >= 1``, and its first item
        draws from no global random number generator (threads would draw in an order
        that depends on timing; see :mod:`~cerebro_automl.data.decode`). Found once."""
        if self.decode_threads == 0 or len(self) == 0:
            return False
        key = "drawn" if self.item_seed is not None else "plain"
        if key not in self._threads_keep_bits:
            keeps = self._threads_keep_bits[key] = not draws_global_rng(lambda: self._item(0))
            if not keeps:
                logger.warning(
                    "%s: reading an item draws from a global random number generator (torch.rand, "
                    "numpy.random or random), so its items are decoded one by one in the training thread "
                    "(decode_threads=%d is not used): threads would draw in an order that depends on "
                    "timing, and change the bits. Draw random augmentation from a generator: the one "
                    "random_transform(image, generator) is given per item, or the TrainingSpec's "
                    "train_transform's, on the batch",
                    self.where,
                    self.decode_threads,
                )
        return self._threads_keep_bits[key]

    @property
    def nbytes(self) -> int:
        held = getattr(self.dataset, "held_bytes", None)  # a cache of the files' bytes (random_transform)
        return int(held(self.indices)) if held is not None else 0

    def chunks(self, size: int = 256) -> Generator[tuple[Any, Any], None, None]:
        """The shard's rows in order, ``size`` at a time (to cache them)."""
        return self.read(torch.arange(start, min(start + size, len(self))) for start in range(0, len(self), size))

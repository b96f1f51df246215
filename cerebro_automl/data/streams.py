"""Streams: a torch ``IterableDataset`` cut into partitions as it is read.

The worker that loads partition ``i`` builds the stream and iterates it once,
keeping the items that belong to ``i`` and skipping the others untouched (every
partition reads the whole stream). Items are dealt in consecutive blocks of
``P`` (the number of partitions), one item of each block per partition, in an
order drawn from a generator seeded by the data seed: partition sizes differ by
at most one and each partition is a sample of the whole stream, even of a
stream sorted by class. Without a seed (validation streams) the items are dealt
in turn. ``shuffle=False`` cuts a stream with ``len()`` into contiguous ranges,
as a map-style Dataset is cut.

A partition's share then goes where a map-style Dataset's rows go: held as a
map-style Dataset of its items, collated per batch (``cache=None``), or
collated in chunks into the cache as the stream comes (:meth:`StreamShare.chunks`),
so a share larger than memory streams into ``cache="disk"``.

Example:
    >>> list(itertools.islice(dealt(3, None), 7))
    [0, 1, 2, 0, 1, 2, 0]
    >>> blocks = list(itertools.islice(dealt(3, 0), 9))
    >>> [sorted(blocks[b : b + 3]) for b in (0, 3, 6)]
    [[0, 1, 2], [0, 1, 2], [0, 1, 2]]
    >>> share = stream_share(range(10), list, "partition 1", 3, 1, None, validation=True)
    >>> share.shard().indices
    array([1, 4, 7])
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Generator, Iterable, Iterator
from typing import Any

import numpy as np

from .assign import row_ranges
from .shards import DatasetShard

__all__ = ["DEAL_ITEMS", "StreamShare", "dealt", "is_stream", "stream_share"]

# Items whose partitions one seeded generator deals: a generator per block of P items
# would cost more to seed (~30 us) than reading a small item.
DEAL_ITEMS = 2**16
CHUNK_ITEMS = 256  # items collated at once into the cache, as DatasetShard.chunks collates


def is_stream(dataset: Any) -> bool:
    """Whether ``dataset`` is a torch ``IterableDataset`` (WebDataset, HF streaming, a generator's)."""
    from torch.utils.data import IterableDataset

    return isinstance(dataset, IterableDataset)


def dealt(parts: int, seed: int | None) -> Iterator[int]:
    """The partition of each item of a stream, in order, without end: blocks of ``parts``
    items, each dealt one item per partition, in a seeded random order (in turn without
    a seed)."""
    if seed is None:
        return itertools.cycle(range(parts))
    return itertools.chain.from_iterable(_deal(parts, seed, group) for group in itertools.count())


def _deal(parts: int, seed: int, group: int) -> list[int]:
    """The partitions of the items of one group of blocks: a random permutation of
    ``range(parts)`` per block, drawn from a generator seeded by ``seed`` and the group."""
    blocks = max(1, DEAL_ITEMS // parts)
    draws = np.random.default_rng([seed, group, 2]).random((blocks, parts))
    return draws.argsort(axis=1, kind="stable").reshape(-1).tolist()


class StreamShare:
    """The ``(position, item)`` pairs of a stream that one partition keeps, read once:
    as a map-style Dataset (:meth:`shard`) or collated in chunks (:meth:`chunks`)."""

    def __init__(self, items: Iterator[tuple[int, Any]], collate_fn: Callable[[list], Any], where: str) -> None:
        self.items, self.collate_fn, self.where = items, collate_fn, where

    def shard(self) -> DatasetShard:
        """The kept items in memory, read by stream position (a dict is a map-style Dataset)."""
        kept = dict(self.items)
        return DatasetShard(kept, np.fromiter(kept, np.int64, len(kept)), self.collate_fn, self.where)

    def chunks(self) -> Generator[tuple[Any, Any], None, None]:
        """The kept items collated ``CHUNK_ITEMS`` at a time as the stream comes (to cache them)."""
        while group := list(itertools.islice(self.items, CHUNK_ITEMS)):
            positions = np.array([position for position, _ in group], np.int64)
            yield from DatasetShard(dict(group), positions, self.collate_fn, self.where).chunks(CHUNK_ITEMS)


def stream_share(
    dataset: Iterable,
    collate_fn: Callable[[list], Any],
    where: str,
    parts: int,
    index: int,
    seed: int | None,
    *,
    validation: bool,
) -> StreamShare:
    """Partition ``index``'s share of ``dataset``: dealt with ``seed``; for ``validation``
    dealt in turn; with neither (``shuffle=False``) the contiguous range a map-style
    Dataset of the stream's ``len()`` would give, which a stream without one cannot
    (refused here, before it is read)."""
    if validation:
        return StreamShare(_dealt_items(dataset, parts, index, None, where, at_least=0), collate_fn, where)
    if seed is not None:
        return StreamShare(_dealt_items(dataset, parts, index, seed, where, at_least=parts), collate_fn, where)
    length = _length(dataset)
    if length is None:
        raise TypeError(
            f"{where}: shuffle is False, but the {type(dataset).__name__} is an IterableDataset without "
            "len(): shuffle=False cuts the items into contiguous ranges by the stream's length. Give the "
            "dataset a __len__, or leave shuffle=True (the items are then dealt to the partitions as the "
            "stream comes, a seeded sample in each)"
        )
    if length < parts:
        raise ValueError(f"num_partitions is {parts}, but must be <= the {length} items of the stream (its len())")
    return StreamShare(_range_items(dataset, length, parts, index, where), collate_fn, where)


def _length(dataset: Any) -> int | None:
    try:
        return len(dataset)
    except TypeError:  # no __len__, or one that says the length is unknown
        return None


def _dealt_items(
    dataset: Iterable, parts: int, index: int, seed: int | None, where: str, at_least: int
) -> Iterator[tuple[int, Any]]:
    """The items dealt to ``index``, read as the whole stream is; a stream of fewer than
    ``at_least`` items is refused once it ends."""
    read = 0
    for read, (item, owner) in enumerate(zip(dataset, dealt(parts, seed), strict=False), 1):  # dealt is endless
        if owner == index:
            yield read - 1, item
    if read < at_least:
        remedy = f"pass num_partitions <= {read}, or a longer stream" if read else "the stream is empty"
        raise ValueError(
            f"{where}: the {type(dataset).__name__} yielded {read} items for {parts} partitions, but each "
            f"partition needs at least one item: {remedy}"
        )


def _range_items(dataset: Iterable, length: int, parts: int, index: int, where: str) -> Iterator[tuple[int, Any]]:
    """The items of partition ``index``'s contiguous range of a stream of ``length`` items;
    the stream is read up to the range's end (the last partition reads one more item,
    to check that it has no more than ``length``)."""
    first, end = row_ranges(length, parts)[index]  # as assign_rows cuts rows without a seed
    read = 0
    for read, item in enumerate(itertools.islice(dataset, end + (index == parts - 1)), 1):
        if first < read <= end:
            yield read - 1, item
    if read != end:
        raise ValueError(
            f"{where}: the {type(dataset).__name__}'s len() is {length}, but it yielded "
            f"{'only ' if read < end else 'more than '}{min(read, end)} items; shuffle=False cuts the "
            "stream into ranges by its len(), which must be the number of items it yields"
        )

"""Which rows go to which partition, decided on the driver.

Without a seed, partition ``i`` gets the ``i``-th of ``P`` contiguous, nearly
equal row ranges. With one, rows (arrays, torch Datasets) or read units (Parquet
row groups, dask blocks) are first put in a seeded order.

Example:
    >>> row_ranges(10, 3)
    [(0, 3), (3, 7), (7, 10)]
    >>> cut_units([("a", 4), ("b", 4)], 2)
    [[('a', 0, 4)], [('b', 0, 4)]]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = [
    "row_ranges",
    "assign_rows",
    "partition_rows",
    "rows_within",
    "draws_rows",
    "MIXED_UNITS",
    "cut_units",
    "shuffled",
]


def row_ranges(rows: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ``(start, stop)`` ranges covering ``rows`` rows, sizes within one."""
    bounds = np.linspace(0, rows, parts + 1).round().astype(int)
    return [(int(bounds[i]), int(bounds[i + 1])) for i in range(parts)]


def assign_rows(rows: int, parts: int, seed: int | None) -> list[slice | np.ndarray]:
    """The rows of each partition: contiguous ranges, or sorted sets drawn by a seeded permutation."""
    ranges = row_ranges(rows, parts)
    if seed is None:
        return [slice(a, b) for a, b in ranges]
    order = np.random.default_rng([seed, 0]).permutation(rows)
    return [np.sort(order[a:b]) for a, b in ranges]


# Read units (row groups, blocks) per partition from which whole units mix a dataset
# sorted by class well enough; with fewer, partitions are drawn row by row.
MIXED_UNITS = 16


def draws_rows(units: int, parts: int) -> bool:
    """Whether ``parts`` shuffled partitions of ``units`` read units are drawn row by row
    (as arrays are), rather than in whole units: whole units would give each partition
    of a class-sorted dataset a few classes.

    >>> draws_rows(2, 2), draws_rows(64, 2)
    (True, False)
    """
    return units < MIXED_UNITS * parts


def rows_within(chosen: np.ndarray, first: int, n: int) -> np.ndarray:
    """The rows of ``chosen`` (sorted global row indices) that fall in a unit of ``n``
    rows starting at global row ``first``, as indices into the unit.

    >>> rows_within(np.array([0, 2, 3, 7]), 2, 4).tolist()
    [0, 1]
    """
    lo, hi = np.searchsorted(chosen, [first, first + n])
    return chosen[lo:hi] - first


def partition_rows(rows: int, parts: int, seed: int, index: int) -> np.ndarray:
    """Partition ``index``'s rows of ``assign_rows(rows, parts, seed)``, drawn alone
    (where the partition loads: no driver holds every partition's indices).

    >>> bool((partition_rows(10, 3, 7, 1) == assign_rows(10, 3, 7)[1]).all())
    True
    """
    a, b = row_ranges(rows, parts)[index]
    return np.sort(np.random.default_rng([seed, 0]).permutation(rows)[a:b])


def cut_units(units: Sequence[tuple[Any, int]], parts: int) -> list[list[tuple[Any, int, int]]]:
    """Cut a sequence of read units (``(unit, rows)``: row groups, blocks) into ``parts``
    equal row ranges; each partition gets ``(unit, first, end)`` slices of units."""
    total = sum(n for _, n in units)
    out: list[list[tuple[Any, int, int]]] = []
    for start, stop in row_ranges(total, parts):
        piece, first = [], 0
        for unit, n in units:
            lo, hi = max(start, first), min(stop, first + n)
            if lo < hi:
                piece.append((unit, lo - first, hi - first))
            first += n
        out.append(piece)
    return out


def shuffled(units: list, seed: int | None) -> list:
    """``units`` in a seeded order (as given without a seed)."""
    if seed is None:
        return units
    return [units[i] for i in np.random.default_rng([seed, 0]).permutation(len(units))]

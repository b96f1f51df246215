"""Arrays the driver holds (numpy or torch), cut into partitions: ``from_arrays``.

The driver sends each worker its shard. With shuffled rows, only the
partition's rows are copied, and only when the source is sent or loaded.

Example:
    >>> import numpy as np
    >>> plan = arrays_plan(np.zeros((10, 2)), np.zeros(10), 2, valid=None, valid_fraction=None,
    ...                    shuffle_seed=None, cache="memory", cache_dir=None)
    >>> [len(s.load().train) for s in plan.make_sources(2)]
    [5, 5]
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from .assign import assign_rows
from .options import LoadOptions, check_options, check_partitions
from .partition import check_finite
from .shards import TensorShard
from .source import Source, SourcePlan
from .structure import as_leaf, as_structure, check_structure, count_rows, leaves, map_structure

__all__ = ["ArraysSource", "arrays_plan"]

logger = logging.getLogger("cerebro_automl")


class ArraysSource(Source):
    """A shard of arrays the driver holds; the executor sends it to its worker.

    With shuffled rows, only the partition's rows are copied, and only when the
    source is sent (pickled) or loaded.
    """

    in_memory = True

    def __init__(
        self,
        x: Any,
        y: Any,
        valid: tuple[Any, Any] | None,
        rows: slice | np.ndarray,
        valid_rows: slice | np.ndarray | None,
        index: int,
        options: LoadOptions,
    ) -> None:
        self.x, self.y, self.valid, self.rows, self.valid_rows = x, y, valid, rows, valid_rows
        self.index, self.options = index, options

    def _taken(self) -> tuple[Any, Any, tuple[Any, Any] | None]:
        valid = None
        if self.valid is not None:
            if self.valid_rows is None:
                raise AssertionError("from_arrays assigns validation rows whenever it is given validation arrays")
            valid = (_take_raw(self.valid[0], self.valid_rows), _take_raw(self.valid[1], self.valid_rows))
        return _take_raw(self.x, self.rows), _take_raw(self.y, self.rows), valid

    def __reduce__(self) -> Any:
        # Pickle only this partition's rows, not the whole arrays the driver holds.
        x, y, valid = self._taken()
        every = slice(None)
        return (ArraysSource, (x, y, valid, every, every if valid is not None else None, self.index, self.options))

    def chunks(self, *external: Any) -> tuple[Iterable[tuple[Any, Any]], Iterable[tuple[Any, Any]] | None]:
        x, y, valid = self._taken()
        return [(x, y)], ([valid] if valid is not None else None)


def arrays_plan(
    X: Any,
    y: Any,
    num_partitions: int | None,
    *,
    valid: tuple[Any, Any] | None,
    valid_fraction: float | None,
    shuffle_seed: int | None,
    cache: str,
    cache_dir: str | None,
    shuffle: bool = True,
) -> SourcePlan:
    """Check ``from_arrays``'s arguments and plan one :class:`ArraysSource` per partition.

    Validation data must match the training data's structure, row shapes and dtypes,
    be finite, and hold integer labels within the training labels' span.
    """
    options = check_options(valid, valid_fraction, shuffle_seed, cache, cache_dir, shuffle=shuffle)
    X, y = _raw_structure(X, "X"), _raw_structure(y, "y", optional=True)
    rows = count_rows([("X", X), ("y", y)], "from_arrays")
    if rows == 0:
        raise ValueError("from_arrays: X has 0 rows; the dataset must not be empty")
    check_partitions(num_partitions, rows)
    _check_leaf_dtypes(X, "X")
    _check_leaf_dtypes(y, "y")
    if valid is not None:
        if not (isinstance(valid, (tuple, list)) and len(valid) == 2):
            raise TypeError(f"valid is {type(valid).__name__}, but must be a tuple (X_valid, y_valid)")
        valid = (_raw_structure(valid[0], "X_valid"), _raw_structure(valid[1], "y_valid", optional=True))
        valid_rows = count_rows([("X_valid", valid[0]), ("y_valid", valid[1])], "from_arrays valid")
        if valid_rows == 0:
            raise ValueError("from_arrays: X_valid has 0 rows; give validation data or none")
        _check_same_layout(valid[0], X, "X_valid", "X")
        _check_same_layout(valid[1], y, "y_valid", "y")
        check_finite(
            TensorShard(as_structure(valid[0], "X_valid"), as_structure(valid[1], "y_valid", optional=True)),
            "from_arrays",
            names=("X_valid", "y_valid"),
        )
        _check_label_range(valid[1], y)

    def make(parts: int, resolved: LoadOptions) -> list[ArraysSource]:
        train = assign_rows(rows, parts, resolved.seed)
        vrows = assign_rows(valid_rows, parts, None) if valid is not None else [None] * parts
        return [ArraysSource(X, y, valid, train[i], vrows[i], i, resolved) for i in range(parts)]

    return SourcePlan(make, num_partitions, rows, valid is not None or valid_fraction is not None, options)


def _take_raw(value: Any, rows: slice | np.ndarray) -> Any:
    """Rows of a structure of numpy arrays or tensors: a view for a slice, a copy otherwise."""
    if isinstance(rows, slice):
        return map_structure(lambda a: a[rows], value)
    return map_structure(lambda a: a[torch.from_numpy(rows)] if isinstance(a, torch.Tensor) else a[rows], value)


def _raw_structure(value: Any, name: str, *, optional: bool = False) -> Any:
    """``value`` checked, with every leaf a numpy array or a tensor (no copy)."""
    check_structure(value, name, optional=optional)

    def as_array(a: Any) -> Any:
        return a if isinstance(a, (torch.Tensor, np.ndarray)) else np.asarray(a)

    return map_structure(as_array, np.asarray(value) if isinstance(value, list) else value)


def _check_leaf_dtypes(value: Any, name: str) -> None:
    for leaf_name, leaf in leaves(value, name):
        as_leaf(leaf[:1], leaf_name)  # dtype and shape rules, on one row


def _check_same_layout(got: Any, expected: Any, got_name: str, expected_name: str) -> None:
    """Validation data must have the structure and row shapes of the training data."""
    a, b = leaves(got, got_name), leaves(expected, expected_name)
    if type(got) is not type(expected) or len(a) != len(b) or (isinstance(got, dict) and list(got) != list(expected)):
        raise ValueError(
            f"{got_name} has leaves {[n for n, _ in a]}, but {expected_name} has {[n for n, _ in b]}; they must match"
        )
    for (na, la), (nb, lb) in zip(a, b, strict=True):
        if tuple(np.shape(la)[1:]) != tuple(np.shape(lb)[1:]):
            raise ValueError(
                f"{na} rows have shape {tuple(np.shape(la)[1:])}, but {nb} rows have "
                f"{tuple(np.shape(lb)[1:])}; they must match"
            )
        # Compared as the workers will hold them: float64 becomes float32 on both sides.
        da, db = as_leaf(la[:1], na).dtype, as_leaf(lb[:1], nb).dtype
        if da != db:
            raise ValueError(
                f"{na} has dtype {da}, but {nb} has {db}; validation data must have the "
                "training data's dtypes (a model trained on one fails on the other only "
                "after an epoch)"
            )


def _is_integer(leaf: Any) -> bool:
    """An integer leaf (not bool), numpy or torch."""
    if isinstance(leaf, torch.Tensor):
        return not (leaf.is_floating_point() or leaf.is_complex() or leaf.dtype == torch.bool)
    return leaf.dtype.kind in "iu"


def _check_label_range(y_valid: Any, y: Any) -> None:
    """Warn when an integer label of ``y_valid`` lies outside the span (min to max) of
    the training labels ``y``, leaf for leaf: a class index past every training label
    is likely out of the model's range (the evaluation would then fail after an
    epoch), but integer targets may also be counts, or a class only validation holds,
    so it is not refused. Float and bool labels are not checked."""
    for (vname, vleaf), (name, leaf) in zip(leaves(y_valid, "y_valid"), leaves(y, "y"), strict=False):
        if not _is_integer(vleaf) or not _is_integer(leaf) or 0 in np.shape(vleaf):
            continue
        v, t = as_leaf(vleaf, vname), as_leaf(leaf, name)
        low, high = t.min(), t.max()
        outside = ((v < low) | (v > high)).reshape(len(v), -1).any(dim=1)
        if bool(outside.any()):
            row = int(outside.nonzero()[0, 0])
            value = v[row][(v[row] < low) | (v[row] > high)].reshape(-1)[0].item()
            logger.warning(
                "from_arrays: %s is %s in row %d, outside %d..%d, the span of the training "
                "labels: a class index past them is out of the model's range, or one it never "
                "trains on (integer targets that are counts may be fine)",
                vname,
                value,
                row,
                int(low),
                int(high),
            )

"""Which table columns make up ``X`` and ``y``: Parquet files and dask DataFrames.

``features`` and ``label`` name columns; :class:`Columns` turns the columns of a
table into a batch's structure, stacking several columns into one 2-D leaf.

Example:
    >>> import numpy as np
    >>> table = {"a": np.array([1.0, 2.0]), "b": np.array([3, 4]), "t": np.array([0, 1])}
    >>> x, y = Columns(["a", "b"], "t").build(table.__getitem__, "a table")
    >>> x.dtype, x.shape, y.shape
    (dtype('float32'), (2, 2), (2,))
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .structure import leaves, map_structure

__all__ = ["Columns", "precision_message"]


@dataclass(frozen=True)
class _Group:
    """Table columns that make one leaf: stacked into a 2-D leaf, or one column as a 1-D leaf."""

    columns: tuple[str, ...]
    stacked: bool


class Columns:
    """Which table columns make up ``X`` and ``y`` (Parquet, dask DataFrames).

    ``features`` is a list of columns (stacked into one 2-D leaf), or a dict of
    input name -> list of columns (2-D) or one column (1-D). ``label`` is one
    column (1-D), a list (2-D), a dict like ``features``, or None (unlabeled).
    Integer columns are read as integers. A leaf that stacks integer and float
    columns is float32, and refused if an integer in it is beyond 2**24, which
    float32 cannot hold exactly.
    """

    def __init__(self, features: Any, label: Any) -> None:
        if features is None:
            raise ValueError("features is None, but must name the input columns")
        self.x = self._groups(features, "features", top_level=True)
        self.y = None if label is None else self._groups(label, "label", top_level=False)

    @staticmethod
    def _groups(spec: Any, name: str, top_level: bool) -> Any:
        def group(value: Any, where: str, single_is_1d: bool) -> _Group:
            if isinstance(value, str):
                return _Group((value,), stacked=not single_is_1d)
            if isinstance(value, (list, tuple)) and value and all(isinstance(c, str) for c in value):
                return _Group(tuple(value), stacked=True)
            raise TypeError(f"{where} is {value!r}, but must be a column name or a non-empty list of them")

        if isinstance(spec, Mapping):
            if not spec:
                raise ValueError(f"{name} is an empty dict; name at least one input")
            return {str(k): group(v, f"{name}[{k!r}]", True) for k, v in spec.items()}
        # A bare feature name stays a 2-D leaf (one column), a bare label a 1-D one.
        return group(spec, name, not top_level)

    def _all_groups(self) -> list[_Group]:
        return [g for part in (self.x, self.y) for _, g in leaves(part, "x")]

    def names(self) -> list[str]:
        out: list[str] = []
        for group in self._all_groups():
            out += [c for c in group.columns if c not in out]
        return out

    def stacked_with_others(self, column: str) -> bool:
        """Whether ``column`` is stacked with other columns into a 2-D leaf."""
        return any(len(g.columns) > 1 and column in g.columns for g in self._all_groups())

    def mixed_int_columns(self, is_int: Callable[[str], bool], is_float: Callable[[str], bool]) -> list[str]:
        """Integer columns stacked with float columns (they become float32)."""
        return [c for g in self._all_groups() if any(is_float(c) for c in g.columns) for c in g.columns if is_int(c)]

    def build(self, column: Callable[[str], np.ndarray], where: str) -> tuple[Any, Any]:
        """``(x, y)`` from ``column(name) -> array`` (1-D, or 2-D for a column of lists)."""

        def leaf(group: _Group) -> np.ndarray:
            arrays = [column(c) for c in group.columns]
            if not group.stacked or (len(arrays) == 1 and arrays[0].ndim == 2):  # a column of lists is 2-D already
                return arrays[0]
            kinds = {a.dtype.kind for a in arrays}
            if "f" in kinds and kinds & {"i", "u"}:
                for c, a in zip(group.columns, arrays, strict=True):
                    largest = max(abs(int(a.min())), abs(int(a.max()))) if a.dtype.kind in "iu" and len(a) else 0
                    if largest > 2**24:
                        raise ValueError(precision_message(c, largest, where))
                arrays = [a.astype(np.float32) for a in arrays]
            return np.stack(arrays, axis=1)

        return map_structure(leaf, self.x), map_structure(leaf, self.y)


def precision_message(column: str, value: int, where: str) -> str:
    """The error for an integer beyond 2**24 in a float32 input, naming the way out."""
    return (
        f"{where}: integer column {column!r} holds {value}, which float32 cannot hold exactly "
        "(above 2**24), and it is stacked with float columns into one float32 input; give it an "
        f"input of its own, e.g. features={{'dense': [...], 'ids': [{column!r}, ...]}}"
    )

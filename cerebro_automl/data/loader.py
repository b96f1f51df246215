"""A function the worker calls to load its partition: ``from_loader``.

``fn(i)`` runs on the worker holding partition ``i`` and returns ``(X, y)``,
``(X, y, X_valid, y_valid)``, or an iterator of ``(X, y)`` chunks. The driver
never calls it.

Example:
    >>> import numpy as np
    >>> def read(i):
    ...     return np.full((4, 2), i, "float32"), np.zeros(4, "int64")
    >>> plan = loader_plan(read, 2, valid_fraction=None, has_validation=False,
    ...                    shuffle_seed=None, cache="memory", cache_dir=None)
    >>> plan.make_sources(2)[1].load().train.x[0]
    tensor([1., 1.])
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from .errors import DataError
from .options import LoadOptions, check_options, check_partitions, check_picklable
from .source import Source, SourcePlan

__all__ = ["LoaderSource", "loader_plan"]


class LoaderSource(Source):
    """``fn(i)`` on the worker: ``(X, y)``, ``(X, y, X_valid, y_valid)``, or an
    iterator of ``(X, y)`` chunks (a partition read piece by piece)."""

    def __init__(
        self, fn: Callable[[int], Any], index: int, options: LoadOptions, has_validation: bool | None = None
    ) -> None:
        self.fn, self.index, self.options = fn, index, options
        self.has_validation = has_validation

    @property
    def where(self) -> str:
        return f"loader fn({self.index})"

    def chunks(self, *external: Any) -> tuple[Iterable[tuple[Any, Any]], Iterable[tuple[Any, Any]] | None]:
        out = self.fn(self.index)
        if isinstance(out, tuple):
            if len(out) not in (2, 4):
                raise DataError(
                    f"loader fn({self.index}) returned a tuple of {len(out)}, but must return "
                    "(X, y), (X, y, X_valid, y_valid) or an iterator of (X, y) chunks"
                )
            if len(out) == 4 and self.has_validation is False:
                raise DataError(
                    f"loader fn({self.index}) returned validation data (X, y, X_valid, y_valid), "
                    "but from_loader was given has_validation=False, so no evaluation would "
                    "read it: pass has_validation=True, or return (X, y)"
                )
            return [out[:2]], ([out[2:]] if len(out) == 4 else None)
        if isinstance(out, Iterator):
            return self._checked(out), None
        raise TypeError(
            f"loader fn({self.index}) returned {type(out).__name__}, but must return (X, y), "
            "(X, y, X_valid, y_valid) or an iterator of (X, y) chunks"
        )

    def _checked(self, chunks: Iterator) -> Iterator[tuple[Any, Any]]:
        for i, chunk in enumerate(chunks):
            if not (isinstance(chunk, tuple) and len(chunk) == 2):
                raise TypeError(
                    f"loader fn({self.index}) yielded {type(chunk).__name__} as chunk {i}, "
                    "but each chunk must be a tuple (X, y)"
                )
            yield chunk


def loader_plan(
    fn: Callable[[int], Any],
    num_partitions: int,
    *,
    valid_fraction: float | None,
    has_validation: bool | None,
    shuffle_seed: int | None,
    cache: str,
    cache_dir: str | None,
    shuffle: bool = True,
) -> SourcePlan:
    """Check ``from_loader``'s arguments and plan one :class:`LoaderSource` per partition."""
    if not callable(fn):
        raise TypeError(f"fn is {fn!r}, but must be callable as fn(partition_index)")
    if num_partitions is None:
        raise ValueError("from_loader needs num_partitions: fn(i) defines partition i")
    check_partitions(num_partitions, None)
    options = check_options(None, valid_fraction, shuffle_seed, cache, cache_dir, shuffle=shuffle)
    check_picklable(fn, "fn")
    if has_validation is not None and not isinstance(has_validation, bool):
        raise TypeError(f"has_validation is {has_validation!r}, but must be True, False or None")
    if has_validation is False and valid_fraction:
        raise ValueError(
            f"has_validation is False, but valid_fraction={valid_fraction!r} holds out "
            "validation rows: drop one of them"
        )
    has_valid = True if valid_fraction else has_validation
    return SourcePlan(
        lambda parts, resolved: [LoaderSource(fn, i, resolved, has_validation) for i in range(parts)],
        num_partitions,
        None,
        has_valid,
        options,
    )

"""Sources: how to load one partition, sent to the worker that holds it.

A :class:`Source` is small and picklable; ``load`` runs on the worker and
returns the partition's :class:`~cerebro_automl.data.partition.PartitionData`.
Each source kind (arrays, a loader function, Parquet, dask collections, torch
Datasets) has a module that builds its sources and checks its arguments into a
:class:`SourcePlan`, which ``PartitionedDataset`` wraps.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from .options import LoadOptions
from .partition import PartitionData, build_partition

__all__ = ["Source", "SourcePlan"]


@dataclass(frozen=True)
class SourcePlan:
    """A checked source description: what ``PartitionedDataset``'s fields are made of."""

    make_sources: Callable[[int, LoadOptions], list]  # (num_partitions, seeded options) -> a source per partition
    num_partitions: int | None
    num_rows: int | None
    has_validation: bool | None
    options: LoadOptions


class Source:
    """How to load one partition on a worker. ``load`` returns its :class:`PartitionData`."""

    in_memory = False  # True: the driver holds the data and sends it to the worker
    index: int
    options: LoadOptions

    @property
    def where(self) -> str:
        return f"partition {self.index}"

    def describe(self, limit: int = 300) -> str:
        """A short description for error messages: the fields, arrays as their shapes.

        >>> from cerebro_automl.data.loader import LoaderSource
        >>> def read(folder, i): ...
        >>> LoaderSource(functools.partial(read, "/data"), 1, LoadOptions()).describe()[:51]
        "LoaderSource(fn=partial(read, '/data'), index=1, op"
        """
        fields = ", ".join(f"{name}={_describe_value(value)}" for name, value in vars(self).items())
        text = f"{type(self).__name__}({fields})"
        return text if len(text) <= limit else text[: limit - 3] + "..."

    def chunks(self, *external: Any) -> tuple[Iterable[tuple[Any, Any]], Iterable[tuple[Any, Any]] | None]:
        """The partition's training rows and validation rows (or None), in ``(x, y)`` chunks."""
        raise NotImplementedError

    def load(self, *external: Any, scratch: str | None = None) -> PartitionData:
        """Load the partition here; ``scratch`` is the folder for ``cache="disk"``."""
        train, valid = self.chunks(*external)
        o = self.options
        return build_partition(
            train,
            valid,
            where=self.where,
            partition=self.index,
            valid_fraction=o.valid_fraction,
            split_seed=o.seed,
            cache=o.cache or "memory",
            scratch=scratch,
        )


def _describe_value(value: Any) -> str:
    """A field of a source, short: arrays by shape, callables by name, structures leaf by leaf."""
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        try:
            shape = str(tuple(value.shape))
        except TypeError:  # a Delayed's, or a dask collection's of unknown length
            shape = "unknown"
        return f"<{type(value).__name__} shape {shape}>"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {_describe_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (tuple, list)) and len(value) <= 8:
        inner = ", ".join(map(_describe_value, value))
        return (
            f"({inner},)"
            if isinstance(value, tuple) and len(value) == 1
            else (f"({inner})" if isinstance(value, tuple) else f"[{inner}]")
        )
    if isinstance(value, (tuple, list)):
        return f"<{type(value).__name__} of {len(value)}>"
    if isinstance(value, functools.partial):
        args = [*map(_describe_value, value.args), *(f"{k}={_describe_value(v)}" for k, v in value.keywords.items())]
        return f"partial({', '.join([_describe_value(value.func), *args])})"
    if callable(value) and not isinstance(value, type) and hasattr(value, "__qualname__"):
        return value.__qualname__
    return repr(value)

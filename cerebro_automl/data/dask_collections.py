"""Dask collections, computed piece by piece on the workers: ``from_dask``.

``X`` is a dask array, a tuple or a dict of them (``y`` the same or None), or a
dask DataFrame with ``features`` and ``label`` naming columns. Each partition
is a tuple of Delayed pieces (slices of the collection's blocks); the worker
holding the partition computes them one after the other, so the data goes
straight to it and a partition cached on disk never has to fit in memory.

Shuffled, partitions take whole blocks where each gets at least ``MIXED_UNITS``
of them (:func:`~.assign.draws_rows`); with fewer, a partition gets the rows
``from_arrays`` would give it: a piece per block, each computing its whole block
and keeping the partition's rows of it, drawn on the worker from the seed.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from .assign import cut_units, draws_rows, partition_rows, rows_within, shuffled
from .columns import Columns
from .errors import DataError
from .options import LoadOptions, check_options, check_partitions
from .source import Source, SourcePlan
from .structure import as_leaf, check_structure, count_rows, leaves

__all__ = ["DaskSource", "dask_plan"]

logger = logging.getLogger("cerebro_automl")


class DaskSource(Source):
    """Pieces of a dask collection (slices of its blocks), each computed on the worker
    in turn, so a partition cached on disk never has to fit in memory."""

    def __init__(self, pieces: tuple, valid_pieces: tuple | None, index: int, options: LoadOptions) -> None:
        self.pieces, self.valid_pieces, self.index, self.options = pieces, valid_pieces, index, options

    def _graph(self) -> dict:
        graph: dict = {}
        for piece in (*self.pieces, *(self.valid_pieces or ())):
            graph.update(piece.__dask_graph__())
        return graph

    def external_keys(self) -> list:
        """Keys the graph reads but does not define: blocks of a collection that was
        persisted on a cluster. The cluster must provide their values to ``load``."""
        return _external_keys(self._graph())

    def chunks(self, *external: Any) -> tuple[Iterable[tuple[Any, Any]], Iterable[tuple[Any, Any]] | None]:
        graph = self._graph()
        graph.update(zip(_external_keys(graph), external, strict=True))
        return (
            self._compute(graph, self.pieces),
            self._compute(graph, self.valid_pieces) if self.valid_pieces else None,
        )

    @staticmethod
    def _compute(graph: dict, pieces: tuple) -> Iterator[tuple[Any, Any]]:
        from dask.local import get_sync
        from dask.optimization import cull

        for piece in pieces:
            needed, _ = cull(graph, [piece.key])
            yield get_sync(needed, piece.key)


def _external_keys(graph: dict) -> list:
    """Keys that tasks of ``graph`` depend on but that ``graph`` does not define."""
    needed = {dep for task in graph.values() for dep in getattr(task, "dependencies", ())}
    return sorted(needed - set(graph), key=str)


def dask_plan(
    X: Any,
    y: Any,
    num_partitions: int | None,
    *,
    features: Any,
    label: Any,
    valid: tuple[Any, Any] | None,
    valid_fraction: float | None,
    shuffle_seed: int | None,
    cache: str,
    cache_dir: str | None,
    shuffle: bool = True,
) -> SourcePlan:
    """Check ``from_dask``'s arguments and plan one :class:`DaskSource` per partition."""
    options = check_options(valid, valid_fraction, shuffle_seed, cache, cache_dir, shuffle=shuffle)
    units, vunits, rows = _read_units(X, y, features, label, valid)
    if rows == 0:
        raise ValueError("from_dask: X has 0 rows; the dataset must not be empty")
    check_partitions(num_partitions, rows)

    def make(parts: int, resolved: LoadOptions) -> list[DaskSource]:
        vpieces = cut_units(vunits, parts) if vunits else [None] * parts
        train = _drawn_pieces(units, rows, parts, resolved)
        if train is None:
            train = [
                tuple(_piece(u, lo, hi) for u, lo, hi in p) for p in cut_units(shuffled(units, resolved.seed), parts)
            ]
        return [
            DaskSource(piece, tuple(_piece(u, lo, hi) for u, lo, hi in vpiece) if vpiece else None, i, resolved)
            for i, (piece, vpiece) in enumerate(zip(train, vpieces, strict=True))
        ]

    return SourcePlan(make, num_partitions, rows, valid is not None or valid_fraction is not None, options)


def _drawn_pieces(units: list, rows: int, parts: int, resolved: LoadOptions) -> list[tuple] | None:
    """Each partition's pieces, drawn row by row (see the module docstring); None where
    partitions take whole blocks: many blocks, no shuffle, or a persisted collection,
    whose every block would reach each loading worker at once."""
    seed = resolved.seed
    if seed is None or not draws_rows(len(units), parts):
        return None
    starts = np.cumsum([0] + [n for _, n in units])
    drawn = [
        tuple(
            _drawn_piece(u, int(first), n, (rows, parts, seed, i)) for (u, n), first in zip(units, starts, strict=False)
        )
        for i in range(parts)
    ]
    if DaskSource(drawn[0], None, 0, resolved).external_keys():
        logger.warning(
            "from_dask: the collection is persisted in %d blocks, fewer than 16 per partition, so its partitions "
            "take whole blocks: sorted by class, each would hold a few classes (shuffle it, or give it more "
            "blocks, before persisting)",
            len(units),
        )
        return None
    return drawn


def _read_units(X: Any, y: Any, features: Any, label: Any, valid: Any) -> tuple[list, list | None, int]:
    """The read units of the training and validation collections, and the training rows."""
    import dask.dataframe as dd

    if isinstance(X, dd.DataFrame):
        if y is not None or features is None:
            raise ValueError("from_dask with a DataFrame takes features=... and label=..., not y")
        columns = Columns(features, label)
        units, rows = _frame_units(X, columns)
        vunits = None
        if valid is not None:
            if not isinstance(valid, dd.DataFrame):
                raise TypeError(
                    f"valid is {type(valid).__name__}, but with a DataFrame X it must be "
                    "a dask DataFrame with the same columns"
                )
            vunits, _ = _frame_units(valid, columns)
    else:
        units, rows = _array_units(X, y, "X", "y")
        vunits = None
        if valid is not None:
            if not (isinstance(valid, (tuple, list)) and len(valid) == 2):
                raise TypeError(f"valid is {type(valid).__name__}, but must be a tuple (X_valid, y_valid)")
            vunits, _ = _array_units(valid[0], valid[1], "X_valid", "y_valid")
    return units, vunits, rows


def _array_units(X: Any, y: Any, xname: str, yname: str) -> tuple[list, int]:
    """Read units of dask arrays: ``((leaves, template, block), rows)`` per block along
    the rows, with every leaf rechunked to the first leaf's row blocks."""
    import dask.array as da

    check_structure(X, xname)
    check_structure(y, yname, optional=True)
    named = leaves(X, xname) + leaves(y, yname)
    for name, leaf in named:
        if not isinstance(leaf, da.Array):
            raise TypeError(f"from_dask takes dask arrays (or a dask DataFrame); {name} is a {type(leaf).__name__}")
        if leaf.ndim == 0:
            raise ValueError(f"from_dask: {name} is a scalar, but must have one row per sample")
        if any(np.isnan(c) for c in leaf.chunks[0]):
            raise ValueError(f"from_dask: {name} has unknown chunk sizes; call compute_chunk_sizes() first")
        as_leaf(np.empty((0, *leaf.shape[1:]), leaf.dtype), name)  # dtype rules, before any work
    rows = count_rows([(xname, X), (yname, y)], "from_dask")
    chunks = named[0][1].chunks[0]
    aligned = [leaf.rechunk((chunks, *((-1,) * (leaf.ndim - 1)))) for _, leaf in named]
    template = (_template(X), _template(y))
    return [((tuple(aligned), template, b), n) for b, n in enumerate(chunks) if n], rows


def _template(value: Any) -> Any:
    """The structure's shape: None, "leaf", a tuple length or a dict's keys."""
    if value is None:
        return None
    if isinstance(value, dict):
        return tuple(value)
    if isinstance(value, tuple):
        return len(value)
    return "leaf"


def _fill(template: Any, arrays: Iterator) -> Any:
    if template is None:
        return None
    if template == "leaf":
        return next(arrays)
    if isinstance(template, int):
        return tuple(next(arrays) for _ in range(template))
    return {k: next(arrays) for k in template}


def _assemble(template: tuple, *arrays: Any) -> tuple[Any, Any]:
    it = iter(arrays)
    return _fill(template[0], it), _fill(template[1], it)


def _frame_piece(frame: Any, rows: slice | np.ndarray, columns: Columns, where: str) -> tuple[Any, Any]:
    part = frame.iloc[rows]

    def column(name: str) -> np.ndarray:
        values = part[name]
        if values.isna().any():
            raise DataError(
                f"{where}: column {name!r} holds {int(values.isna().sum())} nulls; fill or drop them before training"
            )
        return values.to_numpy()

    return columns.build(column, where)


def _frame_units(frame: Any, columns: Columns) -> tuple[list, int]:
    missing = [c for c in columns.names() if c not in frame.columns]
    if missing:
        raise ValueError(f"columns {missing} are not in the DataFrame's columns {list(frame.columns)}")
    for name in columns.names():
        kind = np.dtype(frame[name].dtype).kind if _numpy_dtype(frame[name].dtype) else "O"
        if kind not in "biuf":
            raise TypeError(f"column {name!r} has dtype {frame[name].dtype}, but must be numeric")
    lengths = _partition_lengths(frame)
    return [((frame, columns, b), int(n)) for b, n in enumerate(lengths) if n], int(sum(lengths))


def _partition_lengths(frame: Any) -> list[int]:
    """Each of ``frame``'s partitions' rows, as ``get_partition`` reads them. Counted
    from ``to_delayed``, which is partition by partition: ``map_partitions(len)`` may
    be optimized into fewer partitions (dask 2026.8 fuses a read_parquet with
    ``columns=`` into one, [2000] for 2 partitions of 1000), so that rows went unread."""
    import dask

    lengths = [int(n) for n in dask.compute(*(dask.delayed(len)(d) for d in frame.to_delayed(optimize_graph=True)))]
    if len(lengths) != frame.npartitions:
        raise RuntimeError(f"the DataFrame has {frame.npartitions} partitions, but {len(lengths)} were counted")
    return lengths


def _numpy_dtype(dtype: Any) -> bool:
    try:
        np.dtype(dtype)
        return True
    except TypeError:
        return False


def _piece(unit: tuple, lo: int, hi: int) -> Any:
    """A Delayed computing rows ``lo:hi`` of one read unit as ``(x, y)``."""
    import dask

    first = unit[0]
    if isinstance(first, tuple):  # dask arrays: (aligned leaves, template, block)
        arrays, template, b = unit
        blocks = [a.blocks[b][lo:hi].to_delayed(optimize_graph=True).ravel()[0] for a in arrays]
        return dask.delayed(_assemble, pure=True)(template, *blocks)
    frame, columns, b = unit  # a dask DataFrame: (frame, columns, partition)
    [delayed_frame] = frame.get_partition(b).to_delayed(optimize_graph=True)
    return dask.delayed(_frame_piece, pure=True)(delayed_frame, slice(lo, hi), columns, f"DataFrame partition {b}")


def _drawn_piece(unit: tuple, first: int, n: int, draw: tuple[int, int, int, int]) -> Any:
    """A Delayed computing the rows of one read unit (``n`` rows from global row
    ``first``) that partition ``draw = (rows, parts, seed, index)`` draws."""
    import dask

    head = unit[0]
    if isinstance(head, tuple):  # dask arrays
        arrays, template, b = unit
        blocks = [a.blocks[b].to_delayed(optimize_graph=True).ravel()[0] for a in arrays]
        return dask.delayed(_assemble_drawn, pure=True)(template, first, n, draw, *blocks)
    frame, columns, b = unit
    [delayed_frame] = frame.get_partition(b).to_delayed(optimize_graph=True)
    return dask.delayed(_frame_drawn, pure=True)(delayed_frame, first, n, draw, columns, f"DataFrame partition {b}")


def _drawn_rows(first: int, n: int, draw: tuple[int, int, int, int]) -> np.ndarray:
    return rows_within(_partition_rows(draw), first, n)


@functools.lru_cache(maxsize=2)
def _partition_rows(draw: tuple[int, int, int, int]) -> np.ndarray:
    """A partition's rows, drawn once for all the pieces of its load (one per block)."""
    return partition_rows(*draw)


def _assemble_drawn(template: tuple, first: int, n: int, draw: tuple[int, int, int, int], *blocks: Any) -> Any:
    rows = _drawn_rows(first, n, draw)
    return _assemble(template, *(np.asarray(block)[rows] for block in blocks))


def _frame_drawn(
    frame: Any, first: int, n: int, draw: tuple[int, int, int, int], columns: Columns, where: str
) -> tuple[Any, Any]:
    return _frame_piece(frame, _drawn_rows(first, n, draw), columns, where)

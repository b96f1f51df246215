"""Parquet files, read on the workers through fsspec: ``from_parquet``.

The driver reads only the files' metadata (row groups, column types, and
statistics that show nulls or integers too large for float32); each worker
reads its own slices of row groups, one at a time.

Shuffled, partitions are drawn in whole row groups where each partition gets at
least ``MIXED_UNITS`` of them (:func:`~.assign.draws_rows`), a sample of the whole even from a table
sorted by class. With fewer (pandas writes one row group per file), whole row
groups would give each partition a few classes of a sorted table: each partition
then gets the rows ``from_arrays`` would give it from the table, and its worker
reads every row group, keeping its own rows (drawn there, from the seed).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from functools import partial
from typing import Any

import numpy as np

from .assign import cut_units, draws_rows, partition_rows, rows_within, shuffled
from .columns import Columns, precision_message
from .options import LoadOptions, check_options, check_partitions
from .source import Source, SourcePlan

__all__ = ["ParquetSource", "parquet_plan"]


class ParquetSource(Source):
    """Slices of Parquet row groups, read on the worker through fsspec; or, with
    ``drawn`` (every row group and its rows, the partitions and the seed), the rows
    of partition ``index`` that ``from_arrays`` would draw."""

    def __init__(
        self,
        fs: Any,
        pieces: tuple,
        valid_pieces: tuple | None,
        columns: Columns,
        index: int,
        options: LoadOptions,
        drawn: tuple[tuple, int, int] | None = None,
    ) -> None:
        self.fs, self.pieces, self.valid_pieces, self.columns = fs, pieces, valid_pieces, columns
        self.index, self.options, self.drawn = index, options, drawn

    def _train_pieces(self) -> tuple:
        if self.drawn is None:
            return self.pieces
        units, parts, seed = self.drawn
        return tuple(drawn_rows(units, partition_rows(sum(n for _, n in units), parts, seed, self.index)))

    def _read(self, pieces: tuple) -> Iterator[tuple[Any, Any]]:
        import pyarrow.parquet as pq

        names = self.columns.names()
        opened: dict[str, Any] = {}
        try:
            for (path, group), *rows in pieces:  # rows: (first, end), or the row indices to take
                if path not in opened:
                    opened[path] = pq.ParquetFile(self.fs.open(path, "rb"))
                table = opened[path].read_row_group(group, columns=names)
                table = table.take(rows[0]) if len(rows) == 1 else table.slice(rows[0], rows[1] - rows[0])
                where = f"{path!r} row group {group}"
                yield self.columns.build(partial(_table_column, table, where=where), where)
        finally:
            for f in opened.values():
                f.close()

    def chunks(self, *external: Any) -> tuple[Iterable[tuple[Any, Any]], Iterable[tuple[Any, Any]] | None]:
        return self._read(self._train_pieces()), (self._read(self.valid_pieces) if self.valid_pieces else None)


def parquet_plan(
    paths: str | Sequence[str],
    *,
    features: Any,
    label: Any,
    num_partitions: int | None,
    valid: str | Sequence[str] | None,
    valid_fraction: float | None,
    shuffle_seed: int | None,
    cache: str,
    cache_dir: str | None,
    storage_options: Mapping[str, Any] | None,
    shuffle: bool = True,
) -> SourcePlan:
    """Check ``from_parquet``'s arguments and files and plan one :class:`ParquetSource` per partition."""
    options = check_options(valid, valid_fraction, shuffle_seed, cache, cache_dir, shuffle=shuffle)
    columns = Columns(features, label)
    fs, files = _parquet_files(paths, columns, "paths", storage_options)
    units = [((path, g), n) for path, groups in files for g, n in enumerate(groups) if n]
    rows = sum(n for _, n in units)
    if rows == 0:
        raise ValueError(f"the Parquet files {[p for p, _ in files]} hold 0 rows; the dataset must not be empty")
    check_partitions(num_partitions, rows)
    vunits = None
    if valid is not None:
        _, vfiles = _parquet_files(valid, columns, "valid", storage_options)
        vunits = [((path, g), n) for path, groups in vfiles for g, n in enumerate(groups) if n]

    def make(parts: int, resolved: LoadOptions) -> list[ParquetSource]:
        drawn: tuple[tuple, int, int] | None = None
        train: list[list[tuple[Any, int, int]]]
        if resolved.seed is not None and draws_rows(len(units), parts):
            drawn, train = (tuple(units), parts, resolved.seed), [[] for _ in range(parts)]
        else:
            train = cut_units(shuffled(units, resolved.seed), parts)
        vpieces = cut_units(vunits, parts) if vunits else [None] * parts
        return [
            ParquetSource(fs, tuple(piece), tuple(vpiece) if vpiece else None, columns, i, resolved, drawn)
            for i, (piece, vpiece) in enumerate(zip(train, vpieces, strict=True))
        ]

    return SourcePlan(make, num_partitions, rows, valid is not None or valid_fraction is not None, options)


def drawn_rows(units: Sequence[tuple[Any, int]], chosen: np.ndarray) -> list[tuple[Any, np.ndarray]]:
    """A partition's rows (``chosen``, sorted indices into the units' rows, end to end)
    as ``(unit, indices within it)`` pieces.

    >>> [(u, i.tolist()) for u, i in drawn_rows([("a", 3), ("b", 2)], np.array([0, 2, 3]))]
    [('a', [0, 2]), ('b', [0])]
    """
    pieces, first = [], 0
    for unit, n in units:
        within = rows_within(chosen, first, n)
        if len(within):
            pieces.append((unit, within))
        first += n
    return pieces


def _table_column(table: Any, name: str, where: str) -> np.ndarray:
    column = table.column(name)
    if column.null_count:
        raise ValueError(
            f"{where}: column {name!r} holds {column.null_count} nulls; fill or drop them "
            "before training (a null cannot become a number without changing the data)"
        )
    if _is_list(column.type):
        return _list_column(column.combine_chunks(), name, where)
    return column.to_numpy()


def _element_type(kind: Any) -> tuple[bool, Any]:
    """Whether ``kind`` is a list type, and the type of its elements (``kind`` itself if not)."""
    return (True, kind.value_type) if _is_list(kind) else (False, kind)


def _is_list(kind: Any) -> bool:
    import pyarrow.types as pat

    return bool(pat.is_list(kind) or pat.is_large_list(kind) or pat.is_fixed_size_list(kind))


def _list_column(lists: Any, name: str, where: str) -> np.ndarray:
    """A column of lists of one length as ``[rows, length]`` (HuggingFace's tokenized
    columns, as ``Dataset.to_parquet`` writes them)."""
    lengths = np.asarray(lists.value_lengths())
    if len(lengths) and lengths.min() != lengths.max():
        raise ValueError(
            f"{where}: column {name!r} holds lists of {lengths.min()} to {lengths.max()} values, but the rows of a "
            "batch must stack: pad them to one length (tokenize with padding='max_length' and truncation=True)"
        )
    values = lists.flatten()
    if values.null_count:
        raise ValueError(f"{where}: column {name!r} holds {values.null_count} null values inside its lists")
    return values.to_numpy(zero_copy_only=False).reshape(len(lists), int(lengths[0]) if len(lengths) else 0)


def _parquet_files(
    paths: Any, columns: Columns, what: str, storage_options: Mapping[str, Any] | None
) -> tuple[Any, list[tuple[str, list[int]]]]:
    """The filesystem and ``(path, rows per row group)`` of every file; checks the columns
    (present, numeric, no nulls, no integer too large for a float32 input) from metadata."""
    import fsspec
    import pyarrow.parquet as pq
    import pyarrow.types as pat

    if isinstance(paths, os.PathLike):
        paths = os.fspath(paths)
    if not isinstance(paths, str):
        paths = [os.fspath(p) for p in paths]
        if not paths:
            raise ValueError(f"{what} matches no Parquet files")
    fs, _, found = fsspec.get_fs_token_paths(paths, mode="rb", storage_options=dict(storage_options or {}))
    if not found:
        raise ValueError(f"{what} {paths!r} matches no Parquet files")
    out = []
    first: tuple[str, dict] | None = None  # the first file and its columns' types
    for path in found:
        if not fs.exists(path):
            raise ValueError(f"{what}: Parquet file {path!r} does not exist")
        with fs.open(path, "rb") as f:
            meta = pq.ParquetFile(f).metadata
        schema = meta.schema.to_arrow_schema()
        for column in columns.names():
            if column not in schema.names:
                raise ValueError(f"column {column!r} is not in {path!r}, whose columns are {schema.names}")
            kind = schema.field(column).type
            if _is_list(kind):
                if columns.stacked_with_others(column):
                    raise TypeError(
                        f"column {column!r} of {path!r} holds lists ({kind}), which make a leaf of their own: "
                        "name it alone, e.g. features={'input_ids': 'input_ids', ...}, not with other columns"
                    )
                kind = kind.value_type
            if not (pat.is_integer(kind) or pat.is_floating(kind) or pat.is_boolean(kind)):
                raise TypeError(
                    f"column {column!r} of {path!r} has type {schema.field(column).type}, but must be numeric, "
                    "or a list of numbers of one length (token ids, say)"
                )
        types = {c: schema.field(c).type for c in columns.names()}
        first = first or (path, types)
        _check_same_types(first, path, types, columns)
        _check_statistics(meta, columns, types, path)
        out.append((path, [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]))
    return fs, out


def _check_same_types(first: tuple[str, dict], path: str, types: dict, columns: Columns) -> None:
    """Every file gives each column one element type: a partition's rows stack into one
    tensor, and which files share a partition depends on the seed. Lists compare by their
    elements' type (not list, large or fixed, nor nullability); a column stacked with
    others is converted with them, and compared there."""
    where, expected = first
    for name, kind in types.items():
        if columns.stacked_with_others(name):
            continue
        if _element_type(kind) != _element_type(expected[name]):
            raise TypeError(
                f"column {name!r} is {kind} in {path!r}, but {expected[name]} in {where!r}: every file must "
                "give a column one type (cast the files to one schema)"
            )


def _check_statistics(meta: Any, columns: Columns, types: dict, path: str) -> None:
    """Nulls, and integers beyond float32 in a mixed input, from the row-group statistics
    (when the file has them; otherwise the worker finds them while reading)."""
    import pyarrow.types as pat

    mixed = set(columns.mixed_int_columns(lambda c: pat.is_integer(types[c]), lambda c: pat.is_floating(types[c])))
    index = {meta.schema.column(i).name: i for i in range(meta.num_columns)}
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        for name in columns.names():
            if _is_list(types[name]):
                continue  # its statistics are the elements'; the worker checks the lists as it reads them
            stats = group.column(index[name]).statistics
            if stats is None:
                continue
            if stats.has_null_count and stats.null_count:
                raise ValueError(
                    f"{path!r} row group {g}: column {name!r} holds {stats.null_count} nulls; "
                    "fill or drop them before training (a null cannot become a number "
                    "without changing the data)"
                )
            if name in mixed and stats.has_min_max:
                largest = max(abs(int(stats.min)), abs(int(stats.max)))
                if largest > 2**24:
                    raise ValueError(precision_message(name, largest, f"{path!r} row group {g}"))

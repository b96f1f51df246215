"""PartitionedDataset: a data source cut into P partitions, each loaded on one worker.

Each partition is a train shard and (optionally) a validation shard that live
together on the worker holding the partition. A source describes how to load
partition ``i``; the loading runs on the worker (``from_parquet``,
``from_loader``, ``from_dask``, ``from_torch`` and ``from_datamodule`` never
bring the data to the driver; with ``from_arrays`` the driver has the data
already and sends each worker its shard).

Batches are structured (:mod:`cerebro_automl.structure`): ``X`` is an array, a
tuple of arrays or a dict of name -> array; ``y`` the same or None (unlabeled).
Every leaf keeps its dtype; float64 becomes float32.

Options every source takes:

* ``num_partitions``: a property of the data; give it explicitly for results
  that are reproducible across cluster sizes. Left as None, it becomes the
  number of workers when the session starts.
* ``shuffle_seed``: None (default) cuts the rows into contiguous ranges in
  their given order, and ``valid_fraction`` holds out the last rows of each
  partition. An int assigns rows to partitions by a seeded permutation, in the
  units the source reads cheaply (rows for arrays and torch Datasets, row
  groups for Parquet, blocks for Dask), and holds out a seeded random
  ``valid_fraction`` of each partition.
* ``cache``: ``"memory"`` (default) keeps a partition in its worker's memory;
  ``"disk"`` writes it, while it loads, to files in the worker's scratch folder
  (the Dask worker's ``local_directory``, or ``cache_dir``) that batches read
  row by row, so a partition may be larger than the worker's memory. ``from_torch`` also takes
  ``None`` (its default): items are read through the Dataset on every batch.

Example:
    >>> import numpy as np
    >>> X, y = np.zeros((100, 4), "float32"), np.zeros(100, "int64")
    >>> data = PartitionedDataset.from_arrays(X, y, num_partitions=4, valid_fraction=0.2)
    >>> data.resolve(2).num_partitions
    4
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np
import torch

from .shards import CACHES, DatasetShard, PartitionData, Shard, build_partition, split_rows
from .structure import as_leaf, check_structure, count_rows, leaves, map_structure

__all__ = ["PartitionedDataset", "PartitionData", "Shard", "LoadOptions"]


@dataclass(frozen=True)
class LoadOptions:
    """How every partition of a dataset is split and kept (see the module docstring)."""
    valid_fraction: float | None = None
    shuffle_seed: int | None = None
    cache: str | None = "memory"
    cache_dir: str | None = None


def _check_options(valid: Any, valid_fraction: Any, shuffle_seed: Any, cache: Any,
                   cache_dir: Any, caches: tuple = CACHES) -> LoadOptions:
    if valid is not None and valid_fraction is not None:
        raise ValueError("give valid or valid_fraction, not both")
    if valid_fraction is not None and (isinstance(valid_fraction, bool)
                                       or not isinstance(valid_fraction, (int, float))
                                       or not 0.0 < valid_fraction < 1.0):
        raise ValueError(f"valid_fraction is {valid_fraction!r}, but must be in (0, 1)")
    if shuffle_seed is not None and (isinstance(shuffle_seed, bool) or not isinstance(shuffle_seed, int)
                                     or shuffle_seed < 0):
        raise ValueError(f"shuffle_seed is {shuffle_seed!r}, but must be None or an int >= 0")
    if cache not in caches:
        raise ValueError(f"cache is {cache!r}, but must be one of {caches}")
    if cache_dir is not None and not isinstance(cache_dir, (str, os.PathLike)):
        raise TypeError(f"cache_dir is {cache_dir!r}, but must be a folder path or None")
    return LoadOptions(valid_fraction, shuffle_seed, cache,
                       os.fspath(cache_dir) if cache_dir is not None else None)


def _check_partitions(num_partitions: Any, rows: int | None) -> None:
    if num_partitions is None:
        return
    if isinstance(num_partitions, bool) or not isinstance(num_partitions, int):
        raise TypeError(f"num_partitions is {num_partitions!r}, but must be an int")
    if num_partitions < 1:
        raise ValueError(f"num_partitions is {num_partitions}, but must be >= 1")
    if rows is not None and num_partitions > rows:
        raise ValueError(f"num_partitions is {num_partitions}, but must be <= the {rows} training rows")


def _check_picklable(value: Any, name: str) -> None:
    import cloudpickle

    try:
        cloudpickle.dumps(value)
    except Exception as err:
        raise TypeError(f"{name} cannot be pickled for the Dask workers ({err}); define it so that "
                        "cloudpickle can send it (no open files, locks or live connections)") from None


def _row_ranges(rows: int, parts: int) -> list[tuple[int, int]]:
    bounds = np.linspace(0, rows, parts + 1).round().astype(int)
    return [(int(bounds[i]), int(bounds[i + 1])) for i in range(parts)]


def _assign_rows(rows: int, parts: int, seed: int | None) -> list[slice | np.ndarray]:
    """The rows of each partition: contiguous ranges, or sorted sets drawn by a seeded permutation."""
    ranges = _row_ranges(rows, parts)
    if seed is None:
        return [slice(a, b) for a, b in ranges]
    order = np.random.default_rng([seed, 0]).permutation(rows)
    return [np.sort(order[a:b]) for a, b in ranges]


def _pieces(units: Sequence[tuple[Any, int]], parts: int) -> list[list[tuple[Any, int, int]]]:
    """Cut a sequence of read units (``(unit, rows)``: row groups, blocks) into ``parts``
    equal row ranges; each partition gets ``(unit, first, end)`` slices of units."""
    total = sum(n for _, n in units)
    out: list[list[tuple[Any, int, int]]] = []
    for start, stop in _row_ranges(total, parts):
        piece, first = [], 0
        for unit, n in units:
            lo, hi = max(start, first), min(stop, first + n)
            if lo < hi:
                piece.append((unit, lo - first, hi - first))
            first += n
        out.append(piece)
    return out


def _shuffled(units: list, seed: int | None) -> list:
    if seed is None:
        return units
    return [units[i] for i in np.random.default_rng([seed, 0]).permutation(len(units))]


# ------------------------------------------------------------------- sources
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

        >>> def read(folder, i): ...
        >>> LoaderSource(functools.partial(read, "/data"), 1, LoadOptions()).describe()[:51]
        "LoaderSource(fn=partial(read, '/data'), index=1, op"
        """
        fields = ", ".join(f"{name}={_describe_value(value)}" for name, value in vars(self).items())
        text = f"{type(self).__name__}({fields})"
        return text if len(text) <= limit else text[:limit - 3] + "..."

    def chunks(self, *external: Any) -> tuple[Iterable[tuple[Any, Any]], Iterable[tuple[Any, Any]] | None]:
        """The partition's training rows and validation rows (or None), in ``(x, y)`` chunks."""
        raise NotImplementedError

    def load(self, *external: Any, scratch: str | None = None) -> PartitionData:
        """Load the partition here; ``scratch`` is the folder for ``cache="disk"``."""
        train, valid = self.chunks(*external)
        o = self.options
        return build_partition(train, valid, where=self.where, partition=self.index,
                               valid_fraction=o.valid_fraction, split_seed=o.shuffle_seed,
                               cache=o.cache, scratch=scratch)


def _describe_value(value: Any) -> str:
    """A field of a source, short: arrays by shape, callables by name, structures leaf by leaf."""
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return f"<{type(value).__name__} shape {tuple(value.shape)}>"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {_describe_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (tuple, list)) and len(value) <= 8:
        inner = ", ".join(map(_describe_value, value))
        return f"({inner},)" if isinstance(value, tuple) and len(value) == 1 else (
            f"({inner})" if isinstance(value, tuple) else f"[{inner}]")
    if isinstance(value, (tuple, list)):
        return f"<{type(value).__name__} of {len(value)}>"
    if isinstance(value, functools.partial):
        args = [*map(_describe_value, value.args), *(f"{k}={_describe_value(v)}" for k, v in value.keywords.items())]
        return f"partial({', '.join([_describe_value(value.func), *args])})"
    if callable(value) and not isinstance(value, type) and hasattr(value, "__qualname__"):
        return value.__qualname__
    return repr(value)


def _take_raw(value: Any, rows: slice | np.ndarray) -> Any:
    """Rows of a structure of numpy arrays or tensors: a view for a slice, a copy otherwise."""
    if isinstance(rows, slice):
        return map_structure(lambda a: a[rows], value)
    return map_structure(lambda a: a[torch.from_numpy(rows)] if isinstance(a, torch.Tensor) else a[rows],
                         value)


class ArraysSource(Source):
    """A shard of arrays the driver holds; the executor sends it to its worker.

    With shuffled rows, only the partition's rows are copied, and only when the
    source is sent (pickled) or loaded.
    """

    in_memory = True

    def __init__(self, x: Any, y: Any, valid: tuple[Any, Any] | None, rows: slice | np.ndarray,
                 valid_rows: slice | np.ndarray | None, index: int, options: LoadOptions) -> None:
        self.x, self.y, self.valid, self.rows, self.valid_rows = x, y, valid, rows, valid_rows
        self.index, self.options = index, options

    def _taken(self) -> tuple[Any, Any, tuple[Any, Any] | None]:
        valid = None
        if self.valid is not None:
            valid = (_take_raw(self.valid[0], self.valid_rows), _take_raw(self.valid[1], self.valid_rows))
        return _take_raw(self.x, self.rows), _take_raw(self.y, self.rows), valid

    def __reduce__(self) -> Any:
        x, y, valid = self._taken()
        every = slice(None)
        return (ArraysSource, (x, y, valid, every, every if valid is not None else None,
                               self.index, self.options))

    def chunks(self, *external: Any):
        x, y, valid = self._taken()
        return [(x, y)], ([valid] if valid is not None else None)


class LoaderSource(Source):
    """``fn(i)`` on the worker: ``(X, y)``, ``(X, y, X_valid, y_valid)``, or an
    iterator of ``(X, y)`` chunks (a partition read piece by piece)."""

    def __init__(self, fn: Callable[[int], Any], index: int, options: LoadOptions,
                 has_validation: bool | None = None) -> None:
        self.fn, self.index, self.options = fn, index, options
        self.has_validation = has_validation

    @property
    def where(self) -> str:
        return f"loader fn({self.index})"

    def chunks(self, *external: Any):
        out = self.fn(self.index)
        if isinstance(out, tuple):
            if len(out) not in (2, 4):
                raise TypeError(f"loader fn({self.index}) returned a tuple of {len(out)}, but must return "
                                "(X, y), (X, y, X_valid, y_valid) or an iterator of (X, y) chunks")
            if len(out) == 4 and self.has_validation is False:
                raise ValueError(f"loader fn({self.index}) returned validation data (X, y, X_valid, y_valid), "
                                 "but from_loader was given has_validation=False, so no evaluation would "
                                 "read it: pass has_validation=True, or return (X, y)")
            return [out[:2]], ([out[2:]] if len(out) == 4 else None)
        if isinstance(out, Iterator):
            return self._checked(out), None
        raise TypeError(f"loader fn({self.index}) returned {type(out).__name__}, but must return (X, y), "
                        "(X, y, X_valid, y_valid) or an iterator of (X, y) chunks")

    def _checked(self, chunks: Iterator) -> Iterator[tuple[Any, Any]]:
        for i, chunk in enumerate(chunks):
            if not (isinstance(chunk, tuple) and len(chunk) == 2):
                raise TypeError(f"loader fn({self.index}) yielded {type(chunk).__name__} as chunk {i}, "
                                "but each chunk must be a tuple (X, y)")
            yield chunk


# ------------------------------------------------------------------- columns
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

    def mixed_int_columns(self, is_int: Callable[[str], bool], is_float: Callable[[str], bool]) -> list[str]:
        """Integer columns stacked with float columns (they become float32)."""
        return [c for g in self._all_groups() if any(is_float(c) for c in g.columns)
                for c in g.columns if is_int(c)]

    def build(self, column: Callable[[str], np.ndarray], where: str) -> tuple[Any, Any]:
        """``(x, y)`` from ``column(name) -> 1-D array``."""
        def leaf(group: _Group) -> np.ndarray:
            arrays = [column(c) for c in group.columns]
            if not group.stacked:
                return arrays[0]
            kinds = {a.dtype.kind for a in arrays}
            if "f" in kinds and kinds & {"i", "u"}:
                for c, a in zip(group.columns, arrays):
                    largest = max(abs(int(a.min())), abs(int(a.max()))) if a.dtype.kind in "iu" and len(a) else 0
                    if largest > 2**24:
                        raise ValueError(_precision_message(c, largest, where))
                arrays = [a.astype(np.float32) for a in arrays]
            return np.stack(arrays, axis=1)

        return map_structure(leaf, self.x), map_structure(leaf, self.y)


def _precision_message(column: str, value: int, where: str) -> str:
    return (f"{where}: integer column {column!r} holds {value}, which float32 cannot hold exactly "
            "(above 2**24), and it is stacked with float columns into one float32 input; give it an "
            f"input of its own, e.g. features={{'dense': [...], 'ids': [{column!r}, ...]}}")


def _table_column(table: Any, name: str, where: str) -> np.ndarray:
    column = table.column(name)
    if column.null_count:
        raise ValueError(f"{where}: column {name!r} holds {column.null_count} nulls; fill or drop them "
                         "before training (a null cannot become a number without changing the data)")
    return column.to_numpy()


class ParquetSource(Source):
    """Slices of Parquet row groups, read on the worker through fsspec."""

    def __init__(self, fs: Any, pieces: tuple, valid_pieces: tuple | None, columns: Columns,
                 index: int, options: LoadOptions) -> None:
        self.fs, self.pieces, self.valid_pieces, self.columns = fs, pieces, valid_pieces, columns
        self.index, self.options = index, options

    def _read(self, pieces: tuple) -> Iterator[tuple[Any, Any]]:
        import pyarrow.parquet as pq

        names = self.columns.names()
        opened: dict[str, Any] = {}
        try:
            for (path, group), lo, hi in pieces:
                if path not in opened:
                    opened[path] = pq.ParquetFile(self.fs.open(path, "rb"))
                table = opened[path].read_row_group(group, columns=names).slice(lo, hi - lo)
                where = f"{path!r} row group {group}"
                yield self.columns.build(lambda c: _table_column(table, c, where), where)
        finally:
            for f in opened.values():
                f.close()

    def chunks(self, *external: Any):
        return self._read(self.pieces), (self._read(self.valid_pieces) if self.valid_pieces else None)


class DaskSource(Source):
    """Pieces of a dask collection (slices of its blocks), each computed on the worker
    in turn, so a partition cached on disk never has to fit in memory."""

    def __init__(self, pieces: tuple, valid_pieces: tuple | None, index: int,
                 options: LoadOptions) -> None:
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

    def chunks(self, *external: Any):
        graph = self._graph()
        graph.update(zip(_external_keys(graph), external))
        return (self._compute(graph, self.pieces),
                self._compute(graph, self.valid_pieces) if self.valid_pieces else None)

    @staticmethod
    def _compute(graph: dict, pieces: tuple) -> Iterator[tuple[Any, Any]]:
        from dask.local import get_sync
        from dask.optimization import cull

        for piece in pieces:
            needed, _ = cull(graph, [piece.key])
            yield get_sync(needed, piece.key)


def _external_keys(graph: dict) -> list:
    needed = {dep for task in graph.values() for dep in getattr(task, "dependencies", ())}
    return sorted(needed - set(graph), key=str)


class _DatasetFactory:
    """Builds the train and validation Datasets on the worker (``from_torch``)."""

    def __init__(self, dataset_fn: Callable[[], Any], valid_fn: Callable[[], Any] | None,
                 collate_fn: Callable | None) -> None:
        self.dataset_fn, self.valid_fn, self.collate_fn = dataset_fn, valid_fn, collate_fn

    def train(self) -> tuple[Any, Callable]:
        return _check_dataset(self.dataset_fn(), "dataset_fn()"), self._collate()

    def valid(self) -> tuple[Any, Callable] | None:
        if self.valid_fn is None:
            return None
        return _check_dataset(self.valid_fn(), "valid_fn()"), self._collate()

    def _collate(self) -> Callable:
        from torch.utils.data import default_collate
        return self.collate_fn or default_collate


class _DataModuleDatasets:
    """A LightningDataModule's datasets, set up on the worker (``from_datamodule``)."""

    def __init__(self, datamodule: Any, has_validation: bool) -> None:
        self.datamodule, self.has_validation = datamodule, has_validation
        self._ready = False

    def _setup(self) -> None:
        if not self._ready:  # once per copy of the DataModule on a worker
            self.datamodule.prepare_data()
            self.datamodule.setup("fit")
            self._ready = True

    def train(self) -> tuple[Any, Callable]:
        self._setup()
        loader = self.datamodule.train_dataloader()
        return _check_dataset(loader.dataset, "train_dataloader().dataset"), loader.collate_fn

    def valid(self) -> tuple[Any, Callable] | None:
        if not self.has_validation:
            return None
        self._setup()
        loader = self.datamodule.val_dataloader()
        if isinstance(loader, (list, tuple)):
            if len(loader) != 1:
                raise ValueError(f"val_dataloader() returned {len(loader)} loaders, but cerebro_automl "
                                 "validates on one")
            loader = loader[0]
        return _check_dataset(loader.dataset, "val_dataloader().dataset"), loader.collate_fn


def _check_dataset(dataset: Any, where: str) -> Any:
    if not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
        raise TypeError(f"{where} is a {type(dataset).__name__}, but must be a map-style torch Dataset "
                        "(with __len__ and __getitem__)")
    return dataset


class TorchSource(Source):
    """A subset of a map-style torch Dataset built on the worker."""

    def __init__(self, datasets: Any, num_partitions: int, index: int, options: LoadOptions) -> None:
        self.datasets, self.num_partitions, self.index, self.options = datasets, num_partitions, index, options

    def _shards(self) -> tuple[DatasetShard, DatasetShard | None]:
        dataset, collate = self.datasets.train()
        rows = len(dataset)
        _check_partitions(self.num_partitions, rows)
        chosen = _assign_rows(rows, self.num_partitions, self.options.shuffle_seed)[self.index]
        indices = np.arange(rows)[chosen]
        train = DatasetShard(dataset, indices, collate, self.where)
        valid = None
        held_out = self.datasets.valid()
        if held_out is not None:
            vdataset, vcollate = held_out
            vrows = _assign_rows(len(vdataset), self.num_partitions, None)[self.index]
            valid = DatasetShard(vdataset, np.arange(len(vdataset))[vrows], vcollate, f"{self.where} validation")
        return train, valid

    def load(self, *external: Any, scratch: str | None = None) -> PartitionData:
        train, valid = self._shards()
        o = self.options
        if o.cache is None:  # read through the Dataset on every batch
            if o.valid_fraction:
                train_rows, valid_rows = split_rows(len(train), o.valid_fraction, o.shuffle_seed, self.index)
                return PartitionData(_subset(train, train_rows), _subset(train, valid_rows))
            return PartitionData(train, valid)
        return build_partition(train.chunks(), valid.chunks() if valid is not None else None,
                               where=self.where, partition=self.index, valid_fraction=o.valid_fraction,
                               split_seed=o.shuffle_seed, cache=o.cache, scratch=scratch)


def _subset(shard: DatasetShard, rows: slice | np.ndarray) -> DatasetShard:
    return DatasetShard(shard.dataset, shard.indices[rows], shard.collate_fn, shard.where)


# ------------------------------------------------------------------- dataset
@dataclass(frozen=True)
class PartitionedDataset:
    """P partitions of training data (and validation data), each loaded on one worker.

    Build one with ``from_arrays``, ``from_parquet``, ``from_dask``, ``from_loader``,
    ``from_torch`` or ``from_datamodule``.
    """

    make_sources: Callable[[int], list]  # num_partitions -> one source per partition
    num_partitions: int | None
    num_rows: int | None
    # Whether the partitions hold validation rows; None: only the worker-side loader
    # knows (from_loader without has_validation), so every shard is evaluated.
    has_validation: bool | None
    sources: tuple | None = None
    options: LoadOptions = LoadOptions()

    def resolve(self, default_partitions: int) -> "PartitionedDataset":
        """Fix the number of partitions (``default_partitions`` when none was given)."""
        parts = self.num_partitions if self.num_partitions is not None else default_partitions
        if self.num_rows is not None:
            parts = min(parts, self.num_rows) if self.num_partitions is None else parts
        _check_partitions(parts, self.num_rows)
        return replace(self, num_partitions=parts, sources=tuple(self.make_sources(parts)))

    # ------------------------------------------------------------ builders
    @classmethod
    def from_arrays(cls, X: Any, y: Any, num_partitions: int | None = None, *,
                    valid: tuple[Any, Any] | None = None, valid_fraction: float | None = None,
                    shuffle_seed: int | None = None, cache: str = "memory",
                    cache_dir: str | None = None) -> "PartitionedDataset":
        """In-memory arrays (numpy or torch) cut into ``num_partitions`` partitions.

        ``X`` is an array, a tuple of arrays or a dict of name -> array; ``y`` an
        array, a tuple, a dict or None (unlabeled data). ``valid=(X_valid, y_valid)``,
        of the same structure, is cut into as many shards; with ``valid_fraction``
        each partition holds out some of its rows instead. Leaves keep their
        dtype, except float64, which becomes float32.

        Example:
            >>> dense, ids = np.zeros((100, 13), "float32"), np.arange(200).reshape(100, 2)
            >>> data = PartitionedDataset.from_arrays({"dense": dense, "ids": ids}, np.zeros(100),
            ...                                       num_partitions=2, shuffle_seed=0)
        """
        options = _check_options(valid, valid_fraction, shuffle_seed, cache, cache_dir)
        X, y = _raw_structure(X, "X"), _raw_structure(y, "y", optional=True)
        rows = count_rows([("X", X), ("y", y)], "from_arrays")
        if rows == 0:
            raise ValueError("from_arrays: X has 0 rows; the dataset must not be empty")
        _check_partitions(num_partitions, rows)
        _check_leaf_dtypes(X, "X"), _check_leaf_dtypes(y, "y")
        if valid is not None:
            if not (isinstance(valid, (tuple, list)) and len(valid) == 2):
                raise TypeError(f"valid is {type(valid).__name__}, but must be a tuple (X_valid, y_valid)")
            valid = (_raw_structure(valid[0], "X_valid"), _raw_structure(valid[1], "y_valid", optional=True))
            valid_rows = count_rows([("X_valid", valid[0]), ("y_valid", valid[1])], "from_arrays valid")
            if valid_rows == 0:
                raise ValueError("from_arrays: X_valid has 0 rows; give validation data or none")
            _check_same_layout(valid[0], X, "X_valid", "X")
            _check_same_layout(valid[1], y, "y_valid", "y")

        def make(parts: int) -> list[ArraysSource]:
            train = _assign_rows(rows, parts, shuffle_seed)
            vrows = _assign_rows(valid_rows, parts, None) if valid is not None else [None] * parts
            return [ArraysSource(X, y, valid, train[i], vrows[i], i, options) for i in range(parts)]

        return cls(make, num_partitions, rows, valid is not None or valid_fraction is not None,
                   options=options)

    @classmethod
    def from_loader(cls, fn: Callable[[int], Any], num_partitions: int, *,
                    valid_fraction: float | None = None, has_validation: bool | None = None,
                    shuffle_seed: int | None = None, cache: str = "memory",
                    cache_dir: str | None = None) -> "PartitionedDataset":
        """``fn(i)`` runs on the worker holding partition ``i`` and returns ``(X, y)``,
        ``(X, y, X_valid, y_valid)``, or an iterator of ``(X, y)`` chunks, so that a
        partition larger than memory can stream into ``cache="disk"``.

        ``fn(i)`` defines partition ``i``, so ``shuffle_seed`` only picks the rows
        ``valid_fraction`` holds out. The driver never calls ``fn``, so it cannot
        look: say ``has_validation=True`` when ``fn`` returns validation data (the
        tuners then offer ``val_*`` metrics), and ``has_validation=False`` when it
        never does (each epoch's evaluation then reads only the training figures, in
        one task instead of one per partition; validation data returned anyway is
        refused). Left None, every partition is evaluated, and ``fn`` decides.
        """
        if not callable(fn):
            raise TypeError(f"fn is {fn!r}, but must be callable as fn(partition_index)")
        if num_partitions is None:
            raise ValueError("from_loader needs num_partitions: fn(i) defines partition i")
        _check_partitions(num_partitions, None)
        options = _check_options(None, valid_fraction, shuffle_seed, cache, cache_dir)
        _check_picklable(fn, "fn")
        if has_validation is not None and not isinstance(has_validation, bool):
            raise TypeError(f"has_validation is {has_validation!r}, but must be True, False or None")
        if has_validation is False and valid_fraction:
            raise ValueError(f"has_validation is False, but valid_fraction={valid_fraction!r} holds out "
                             "validation rows: drop one of them")
        has_valid = True if valid_fraction else has_validation
        return cls(lambda parts: [LoaderSource(fn, i, options, has_validation) for i in range(parts)],
                   num_partitions, None, has_valid, options=options)

    @classmethod
    def from_parquet(cls, paths: str | Sequence[str], *, features: Any, label: Any,
                     num_partitions: int | None = None, valid: str | Sequence[str] | None = None,
                     valid_fraction: float | None = None, shuffle_seed: int | None = None,
                     cache: str = "memory", cache_dir: str | None = None,
                     storage_options: Mapping[str, Any] | None = None) -> "PartitionedDataset":
        """Parquet files (a path, a glob, a list, or fsspec URLs such as ``s3://bucket/x/*.parquet``).

        The driver reads only the files' metadata; each worker reads its own row
        groups. ``features`` is a list of columns (one 2-D input) or a dict of input
        name -> columns, e.g. ``{"dense": ["i1", ...], "cat": ["c1", ...]}``;
        ``label`` a column, a list, a dict or None. Integer columns stay integers.
        ``storage_options`` go to fsspec (credentials, endpoints).
        """
        options = _check_options(valid, valid_fraction, shuffle_seed, cache, cache_dir)
        columns = Columns(features, label)
        fs, files = _parquet_files(paths, columns, "paths", storage_options)
        units = [((path, g), n) for path, groups in files for g, n in enumerate(groups) if n]
        rows = sum(n for _, n in units)
        if rows == 0:
            raise ValueError(f"the Parquet files {[p for p, _ in files]} hold 0 rows; the dataset must not be empty")
        _check_partitions(num_partitions, rows)
        vunits = None
        if valid is not None:
            _, vfiles = _parquet_files(valid, columns, "valid", storage_options)
            vunits = [((path, g), n) for path, groups in vfiles for g, n in enumerate(groups) if n]

        def make(parts: int) -> list[ParquetSource]:
            train = _pieces(_shuffled(units, shuffle_seed), parts)
            vpieces = _pieces(vunits, parts) if vunits else [None] * parts
            return [ParquetSource(fs, tuple(train[i]), tuple(vpieces[i]) if vpieces[i] else None,
                                  columns, i, options) for i in range(parts)]

        return cls(make, num_partitions, rows, valid is not None or valid_fraction is not None,
                   options=options)

    @classmethod
    def from_dask(cls, X: Any, y: Any = None, num_partitions: int | None = None, *,
                  features: Any = None, label: Any = None, valid: tuple[Any, Any] | None = None,
                  valid_fraction: float | None = None, shuffle_seed: int | None = None,
                  cache: str = "memory", cache_dir: str | None = None) -> "PartitionedDataset":
        """Dask arrays (``X`` an array, a tuple or a dict of arrays; ``y`` the same or
        None), or a dask DataFrame ``X`` with ``features`` and ``label`` as in
        :meth:`from_parquet`.

        Each partition's slices of the collection's blocks are computed on the
        worker that holds the partition, one after the other, so the data goes
        straight to it. ``shuffle_seed`` assigns whole blocks to partitions.
        """
        import dask.dataframe as dd

        options = _check_options(valid, valid_fraction, shuffle_seed, cache, cache_dir)
        if isinstance(X, dd.DataFrame):
            if y is not None or features is None:
                raise ValueError("from_dask with a DataFrame takes features=... and label=..., not y")
            columns = Columns(features, label)
            units, rows = _frame_units(X, columns)
            vunits = None
            if valid is not None:
                if not isinstance(valid, dd.DataFrame):
                    raise TypeError(f"valid is {type(valid).__name__}, but with a DataFrame X it must be "
                                    "a dask DataFrame with the same columns")
                vunits, _ = _frame_units(valid, columns)
        else:
            units, rows = _array_units(X, y, "X", "y")
            vunits = None
            if valid is not None:
                if not (isinstance(valid, (tuple, list)) and len(valid) == 2):
                    raise TypeError(f"valid is {type(valid).__name__}, but must be a tuple (X_valid, y_valid)")
                vunits, _ = _array_units(valid[0], valid[1], "X_valid", "y_valid")
        if rows == 0:
            raise ValueError("from_dask: X has 0 rows; the dataset must not be empty")
        _check_partitions(num_partitions, rows)

        def make(parts: int) -> list[DaskSource]:
            train = _pieces(_shuffled(units, shuffle_seed), parts)
            vpieces = _pieces(vunits, parts) if vunits else [None] * parts
            return [DaskSource(tuple(_piece(u, lo, hi) for u, lo, hi in train[i]),
                               tuple(_piece(u, lo, hi) for u, lo, hi in vpieces[i]) if vpieces[i] else None,
                               i, options) for i in range(parts)]

        return cls(make, num_partitions, rows, valid is not None or valid_fraction is not None,
                   options=options)

    @classmethod
    def from_torch(cls, dataset_fn: Callable[[], Any], num_partitions: int | None = None, *,
                   valid_fn: Callable[[], Any] | None = None, valid_fraction: float | None = None,
                   shuffle_seed: int | None = None, collate_fn: Callable[[list], Any] | None = None,
                   cache: str | None = None, cache_dir: str | None = None) -> "PartitionedDataset":
        """A map-style ``torch.utils.data.Dataset`` that ``dataset_fn()`` builds on each
        worker (an image folder decoded per item, say); partition ``i`` is a subset of
        its indices, batches come from a seeded sampler over that subset.

        An item is ``(x, y)`` (a 2-tuple or 2-list) or ``x`` alone; items are
        collated with ``collate_fn`` (default: torch's ``default_collate``).
        ``valid_fn()`` builds the validation Dataset, cut into as many shards.
        ``cache=None`` (default) reads items through the Dataset on every batch;
        ``"memory"`` or ``"disk"`` collate them once, when the partition loads.

        Example:
            >>> data = PartitionedDataset.from_torch(lambda: ImageFolder("imgs/"), 4,
            ...                                      valid_fraction=0.1, shuffle_seed=0)  # doctest: +SKIP
        """
        if not callable(dataset_fn):
            raise TypeError(f"dataset_fn is {dataset_fn!r}, but must be callable as dataset_fn()")
        if valid_fn is not None and not callable(valid_fn):
            raise TypeError(f"valid_fn is {valid_fn!r}, but must be callable as valid_fn() or None")
        if collate_fn is not None and not callable(collate_fn):
            raise TypeError(f"collate_fn is {collate_fn!r}, but must be callable or None")
        _check_partitions(num_partitions, None)
        if valid_fn is not None and valid_fraction is not None:
            raise ValueError("give valid_fn or valid_fraction, not both")
        options = _check_options(None, valid_fraction, shuffle_seed, cache, cache_dir,
                                 caches=(None, *CACHES))
        datasets = _DatasetFactory(dataset_fn, valid_fn, collate_fn)
        _check_picklable(datasets, "dataset_fn, valid_fn or collate_fn")
        return cls(lambda parts: [TorchSource(datasets, parts, i, options) for i in range(parts)],
                   num_partitions, None, valid_fn is not None or valid_fraction is not None,
                   options=options)

    @classmethod
    def from_datamodule(cls, datamodule: Any, num_partitions: int | None = None, *,
                        valid_fraction: float | None = None, shuffle_seed: int | None = None,
                        cache: str | None = None, cache_dir: str | None = None) -> "PartitionedDataset":
        """A ``LightningDataModule``: on each worker, ``prepare_data()`` and
        ``setup("fit")`` run where the data lives; the Dataset behind
        ``train_dataloader()`` is partitioned as in :meth:`from_torch`, with that
        loader's ``collate_fn``, and ``val_dataloader()``'s Dataset is the validation
        set (when the DataModule defines one). The loaders' batch sizes, samplers and
        workers are not used: the TrainingSpec's batch size and MOP's seeded sampler are.
        """
        if not callable(getattr(datamodule, "train_dataloader", None)):
            raise TypeError(f"datamodule is a {type(datamodule).__name__}, but must be a LightningDataModule "
                            "(with train_dataloader)")
        has_val = _defines_val_dataloader(datamodule)
        if has_val and valid_fraction is not None:
            raise ValueError("the DataModule defines val_dataloader; give valid_fraction only for one "
                             "that does not")
        _check_partitions(num_partitions, None)
        options = _check_options(None, valid_fraction, shuffle_seed, cache, cache_dir,
                                 caches=(None, *CACHES))
        datasets = _DataModuleDatasets(datamodule, has_val)
        _check_picklable(datasets, "datamodule")
        return cls(lambda parts: [TorchSource(datasets, parts, i, options) for i in range(parts)],
                   num_partitions, None, has_val or valid_fraction is not None, options=options)


# ------------------------------------------------------------------ helpers
def _raw_structure(value: Any, name: str, *, optional: bool = False) -> Any:
    """``value`` checked, with every leaf a numpy array or a tensor (no copy)."""
    check_structure(value, name, optional=optional)
    as_array = (lambda a: a if isinstance(a, (torch.Tensor, np.ndarray)) else np.asarray(a))
    return map_structure(as_array, np.asarray(value) if isinstance(value, list) else value)


def _check_leaf_dtypes(value: Any, name: str) -> None:
    for leaf_name, leaf in leaves(value, name):
        as_leaf(leaf[:1], leaf_name)  # dtype and shape rules, on one row


def _check_same_layout(got: Any, expected: Any, got_name: str, expected_name: str) -> None:
    """Validation data must have the structure and row shapes of the training data."""
    a, b = leaves(got, got_name), leaves(expected, expected_name)
    if type(got) is not type(expected) or len(a) != len(b) or (
            isinstance(got, dict) and list(got) != list(expected)):
        raise ValueError(f"{got_name} has leaves {[n for n, _ in a]}, but {expected_name} has "
                         f"{[n for n, _ in b]}; they must match")
    for (na, la), (nb, lb) in zip(a, b):
        if tuple(np.shape(la)[1:]) != tuple(np.shape(lb)[1:]):
            raise ValueError(f"{na} rows have shape {tuple(np.shape(la)[1:])}, but {nb} rows have "
                             f"{tuple(np.shape(lb)[1:])}; they must match")


def _defines_val_dataloader(datamodule: Any) -> bool:
    method = getattr(type(datamodule), "val_dataloader", None)
    if method is None:
        return False
    for name in ("lightning.pytorch", "pytorch_lightning"):
        try:
            base = __import__(name, fromlist=["LightningDataModule"]).LightningDataModule
        except ImportError:
            continue
        if method is base.val_dataloader:
            return False
    return True


def _array_units(X: Any, y: Any, xname: str, yname: str) -> tuple[list, int]:
    """Read units of dask arrays: ``((leaves, template, block), rows)`` per block along
    the rows, with every leaf rechunked to the first leaf's row blocks."""
    import dask.array as da

    check_structure(X, xname)
    check_structure(y, yname, optional=True)
    named = leaves(X, xname) + leaves(y, yname)
    for name, leaf in named:
        if not isinstance(leaf, da.Array):
            raise TypeError(f"from_dask takes dask arrays (or a dask DataFrame); {name} is a "
                            f"{type(leaf).__name__}")
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


def _frame_piece(frame: Any, lo: int, hi: int, columns: Columns, where: str) -> tuple[Any, Any]:
    part = frame.iloc[lo:hi]

    def column(name: str) -> np.ndarray:
        values = part[name]
        if values.isna().any():
            raise ValueError(f"{where}: column {name!r} holds {int(values.isna().sum())} nulls; fill or "
                             "drop them before training")
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
    lengths = frame.map_partitions(len).compute()
    return [((frame, columns, b), int(n)) for b, n in enumerate(lengths) if n], int(sum(lengths))


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
    return dask.delayed(_frame_piece, pure=True)(delayed_frame, lo, hi, columns, f"DataFrame partition {b}")


def _parquet_files(paths: Any, columns: Columns, what: str,
                   storage_options: Mapping[str, Any] | None) -> tuple[Any, list[tuple[str, list[int]]]]:
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
            if not (pat.is_integer(kind) or pat.is_floating(kind) or pat.is_boolean(kind)):
                raise TypeError(f"column {column!r} of {path!r} has type {kind}, but must be numeric")
        types = {c: schema.field(c).type for c in columns.names()}
        _check_statistics(meta, columns, types, path)
        out.append((path, [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]))
    return fs, out


def _check_statistics(meta: Any, columns: Columns, types: dict, path: str) -> None:
    """Nulls, and integers beyond float32 in a mixed input, from the row-group statistics
    (when the file has them; otherwise the worker finds them while reading)."""
    import pyarrow.types as pat

    mixed = set(columns.mixed_int_columns(lambda c: pat.is_integer(types[c]),
                                          lambda c: pat.is_floating(types[c])))
    index = {meta.schema.column(i).name: i for i in range(meta.num_columns)}
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        for name in columns.names():
            stats = group.column(index[name]).statistics
            if stats is None:
                continue
            if stats.has_null_count and stats.null_count:
                raise ValueError(f"{path!r} row group {g}: column {name!r} holds {stats.null_count} nulls; "
                                 "fill or drop them before training (a null cannot become a number "
                                 "without changing the data)")
            if name in mixed and stats.has_min_max:
                largest = max(abs(int(stats.min)), abs(int(stats.max)))
                if largest > 2**24:
                    raise ValueError(_precision_message(name, largest, f"{path!r} row group {g}"))

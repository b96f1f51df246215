"""PartitionedDataset: a data source cut into P partitions, each loaded on one worker.

Each partition is a train shard and (optionally) a validation shard that live
together on the worker holding the partition. A source describes how to load
partition ``i``; the loading runs on the worker (``from_parquet``,
``from_loader`` and ``from_dask`` never bring the data to the driver; with
``from_arrays`` the driver has the data already and sends each worker its shard).

Partitions are a property of the data: give ``num_partitions`` explicitly for
results that are reproducible across cluster sizes. Left as None, it becomes
the number of workers when the session starts.

Example:
    >>> import numpy as np
    >>> X, y = np.zeros((100, 4), "float32"), np.zeros(100, "int64")
    >>> data = PartitionedDataset.from_arrays(X, y, num_partitions=4, valid_fraction=0.2)
    >>> data.resolve(2).num_partitions
    4
"""

from __future__ import annotations

import glob as globlib
import os
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import numpy as np
import torch

__all__ = ["PartitionedDataset", "PartitionData", "Shard"]

Shard = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class PartitionData:
    """What a worker holds for one partition."""
    train: Shard
    valid: Shard | None

    @property
    def nbytes(self) -> int:
        shards = [self.train] + ([self.valid] if self.valid is not None else [])
        return sum(t.numel() * t.element_size() for shard in shards for t in shard)


def _as_tensor(a: Any, name: str) -> torch.Tensor:
    if isinstance(a, torch.Tensor):
        t = a.detach().cpu()
    else:
        arr = np.asarray(a)
        if arr.dtype == object or not (np.issubdtype(arr.dtype, np.number) or arr.dtype == bool):
            raise TypeError(f"{name} has dtype {arr.dtype}, but must be numeric")
        t = torch.from_numpy(np.ascontiguousarray(arr))
    # float64 features become torch's default float32, the dtype models are built in.
    return t.float() if t.dtype == torch.float64 else t


def _split_valid(x: torch.Tensor, y: torch.Tensor, fraction: float) -> PartitionData:
    """Hold out the last ``fraction`` of a shard's rows for validation."""
    n_valid = int(round(len(x) * fraction))
    cut = len(x) - n_valid
    return PartitionData((x[:cut], y[:cut]), (x[cut:], y[cut:]))


def _make_partition(x: Any, y: Any, valid: tuple[Any, Any] | None,
                    valid_fraction: float | None) -> PartitionData:
    xt, yt = _as_tensor(x, "X"), _as_tensor(y, "y")
    if valid_fraction:
        return _split_valid(xt, yt, valid_fraction)
    if valid is None:
        return PartitionData((xt, yt), None)
    return PartitionData((xt, yt), (_as_tensor(valid[0], "X_valid"), _as_tensor(valid[1], "y_valid")))


# ------------------------------------------------------------------ sources
@dataclass(frozen=True)
class ArraysSource:
    """A shard the driver already holds; the executor sends it to its worker."""
    x: Any
    y: Any
    valid: tuple[Any, Any] | None
    valid_fraction: float | None

    in_memory = True

    def load(self) -> PartitionData:
        return _make_partition(self.x, self.y, self.valid, self.valid_fraction)


@dataclass(frozen=True)
class LoaderSource:
    """``fn(i) -> (X, y)`` or ``(X, y, X_valid, y_valid)``, run on the worker."""
    fn: Callable[[int], tuple]
    index: int
    valid_fraction: float | None

    in_memory = False

    def load(self) -> PartitionData:
        out = self.fn(self.index)
        if not isinstance(out, tuple) or len(out) not in (2, 4):
            raise TypeError(f"loader fn({self.index}) returned {type(out).__name__}, but must return "
                            "(X, y) or (X, y, X_valid, y_valid)")
        valid = (out[2], out[3]) if len(out) == 4 else None
        _check_lengths(out[0], out[1], f"loader fn({self.index})")
        return _make_partition(out[0], out[1], valid, self.valid_fraction)


@dataclass(frozen=True)
class ParquetSource:
    """Row ranges of Parquet files, read on the worker."""
    pieces: tuple[tuple[str, int, int], ...]  # (path, first row, end row)
    valid_pieces: tuple[tuple[str, int, int], ...] | None
    features: tuple[str, ...]
    label: str
    valid_fraction: float | None

    in_memory = False

    def load(self) -> PartitionData:
        x, y = _read_rows(self.pieces, self.features, self.label)
        valid = _read_rows(self.valid_pieces, self.features, self.label) if self.valid_pieces else None
        return _make_partition(x, y, valid, self.valid_fraction)


@dataclass(frozen=True)
class DaskSource:
    """A dask graph that yields one partition, computed on the worker itself."""
    delayed: Any
    valid_fraction: float | None

    in_memory = False

    def external_keys(self) -> list:
        """Keys the graph reads but does not define: blocks of a collection that was
        persisted on a cluster. The cluster must provide their values to ``load``."""
        return _external_keys(dict(self.delayed.__dask_graph__()))

    def load(self, *external: Any) -> PartitionData:
        """Compute the partition in this process; ``external`` are the values of
        :meth:`external_keys`, in that order."""
        from dask.local import get_sync

        graph = dict(self.delayed.__dask_graph__())
        graph.update(zip(_external_keys(graph), external))
        x, y, valid = get_sync(graph, self.delayed.key)
        return _make_partition(x, y, valid, self.valid_fraction)


def _external_keys(graph: dict) -> list:
    needed = {dep for task in graph.values() for dep in getattr(task, "dependencies", ())}
    return sorted(needed - set(graph), key=str)


def _read_rows(pieces, features, label) -> tuple[np.ndarray, np.ndarray]:
    import pyarrow.parquet as pq

    xs, ys = [], []
    for path, start, stop in pieces:
        pf = pq.ParquetFile(path)
        first = 0
        for g in range(pf.num_row_groups):
            n = pf.metadata.row_group(g).num_rows
            lo, hi = max(start, first), min(stop, first + n)
            if lo < hi:  # read only the row groups that overlap the range
                table = pf.read_row_group(g, columns=[*features, label]).slice(lo - first, hi - lo)
                xs.append(np.stack([table.column(f).to_numpy() for f in features], axis=1))
                ys.append(table.column(label).to_numpy())
            first += n
    width = len(features)
    x = np.concatenate(xs) if xs else np.empty((0, width), np.float32)
    y = np.concatenate(ys) if ys else np.empty((0,))
    return x.astype(np.float32, copy=False), y


def _check_lengths(x: Any, y: Any, where: str) -> None:
    if len(x) != len(y):
        raise ValueError(f"{where}: X has {len(x)} rows but y has {len(y)}; they must match")


def _check_partitions(num_partitions: Any, rows: int | None) -> None:
    if num_partitions is None:
        return
    if isinstance(num_partitions, bool) or not isinstance(num_partitions, int):
        raise TypeError(f"num_partitions is {num_partitions!r}, but must be an int")
    if num_partitions < 1:
        raise ValueError(f"num_partitions is {num_partitions}, but must be >= 1")
    if rows is not None and num_partitions > rows:
        raise ValueError(f"num_partitions is {num_partitions}, but must be <= the {rows} training rows")


def _check_fraction(valid: Any, valid_fraction: float | None) -> None:
    if valid is not None and valid_fraction is not None:
        raise ValueError("give valid or valid_fraction, not both")
    if valid_fraction is not None and not (0.0 < valid_fraction < 1.0):
        raise ValueError(f"valid_fraction is {valid_fraction!r}, but must be in (0, 1)")


def _row_ranges(rows: int, parts: int) -> list[tuple[int, int]]:
    bounds = np.linspace(0, rows, parts + 1).round().astype(int)
    return [(int(bounds[i]), int(bounds[i + 1])) for i in range(parts)]


def _pieces(files: list[tuple[str, int]], start: int, stop: int) -> tuple[tuple[str, int, int], ...]:
    """The (path, first, end) pieces of the global row range [start, stop)."""
    out, first = [], 0
    for path, n in files:
        lo, hi = max(start, first), min(stop, first + n)
        if lo < hi:
            out.append((path, lo - first, hi - first))
        first += n
    return tuple(out)


# ------------------------------------------------------------------ dataset
@dataclass(frozen=True)
class PartitionedDataset:
    """P partitions of training data (and validation data), each loaded on one worker.

    Build one with ``from_arrays``, ``from_parquet``, ``from_dask`` or ``from_loader``.
    """

    make_sources: Callable[[int], list]  # num_partitions -> one source per partition
    num_partitions: int | None
    num_rows: int | None
    has_validation: bool
    sources: tuple | None = None

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
                    valid: tuple[Any, Any] | None = None,
                    valid_fraction: float | None = None) -> "PartitionedDataset":
        """Split in-memory arrays (numpy or torch) into contiguous row ranges.

        ``valid=(X_valid, y_valid)`` is split into as many shards; with
        ``valid_fraction`` each shard holds out its last rows instead.
        Float64 features become float32.
        """
        _check_fraction(valid, valid_fraction)
        _check_lengths(X, y, "from_arrays")
        if len(X) == 0:
            raise ValueError("from_arrays: X has 0 rows; the dataset must not be empty")
        _check_partitions(num_partitions, len(X))
        _as_tensor(X[:1], "X"), _as_tensor(y[:1], "y")  # dtype checks, before any work
        if valid is not None:
            if not (isinstance(valid, (tuple, list)) and len(valid) == 2):
                raise TypeError(f"valid is {type(valid).__name__}, but must be a tuple (X_valid, y_valid)")
            _check_lengths(valid[0], valid[1], "from_arrays valid")
            if len(valid[0]) == 0:
                raise ValueError("from_arrays: X_valid has 0 rows; give validation data or none")
            if tuple(np.shape(valid[0])[1:]) != tuple(np.shape(X)[1:]):
                raise ValueError(f"X_valid rows have shape {tuple(np.shape(valid[0])[1:])}, but X rows "
                                 f"have {tuple(np.shape(X)[1:])}; they must match")

        def make(parts: int) -> list[ArraysSource]:
            train = _row_ranges(len(X), parts)
            vranges = _row_ranges(len(valid[0]), parts) if valid is not None else None
            return [ArraysSource(X[a:b], y[a:b],
                                 (valid[0][vranges[i][0]:vranges[i][1]], valid[1][vranges[i][0]:vranges[i][1]])
                                 if vranges else None, valid_fraction)
                    for i, (a, b) in enumerate(train)]

        return cls(make, num_partitions, len(X), valid is not None or valid_fraction is not None)

    @classmethod
    def from_loader(cls, fn: Callable[[int], tuple], num_partitions: int, *,
                    valid_fraction: float | None = None,
                    has_validation: bool | None = None) -> "PartitionedDataset":
        """``fn(i)`` runs on the worker holding partition ``i`` and returns
        ``(X, y)`` or ``(X, y, X_valid, y_valid)``.

        Say ``has_validation=True`` when ``fn`` returns validation data (the
        driver never calls ``fn``, so it cannot look).
        """
        if not callable(fn):
            raise TypeError(f"fn is {fn!r}, but must be callable as fn(partition_index)")
        if num_partitions is None:
            raise ValueError("from_loader needs num_partitions: fn(i) defines partition i")
        _check_partitions(num_partitions, None)
        _check_fraction(None, valid_fraction)
        has_valid = bool(valid_fraction) or bool(has_validation)
        return cls(lambda parts: [LoaderSource(fn, i, valid_fraction) for i in range(parts)],
                   num_partitions, None, has_valid)

    @classmethod
    def from_parquet(cls, paths: str | Sequence[str], *, features: Sequence[str], label: str,
                     num_partitions: int | None = None, valid: str | Sequence[str] | None = None,
                     valid_fraction: float | None = None) -> "PartitionedDataset":
        """Parquet files (a path, a glob or a list) cut into contiguous row ranges.

        The driver reads only the files' metadata; each worker reads its own
        rows. ``features`` are numeric scalar columns, stacked into float32 rows.
        """
        _check_fraction(valid, valid_fraction)
        features = tuple(features) if not isinstance(features, str) else (features,)
        if not features:
            raise ValueError("features is empty, but must name at least one column")
        files = _parquet_files(paths, features, label, "paths")
        rows = sum(n for _, n in files)
        if rows == 0:
            raise ValueError(f"the Parquet files {[p for p, _ in files]} hold 0 rows; the dataset must not be empty")
        _check_partitions(num_partitions, rows)
        vfiles = _parquet_files(valid, features, label, "valid") if valid is not None else None

        def make(parts: int) -> list[ParquetSource]:
            vrows = sum(n for _, n in vfiles) if vfiles else 0
            vranges = _row_ranges(vrows, parts) if vfiles else None
            return [ParquetSource(_pieces(files, a, b),
                                  _pieces(vfiles, *vranges[i]) if vranges else None,
                                  features, label, valid_fraction)
                    for i, (a, b) in enumerate(_row_ranges(rows, parts))]

        return cls(make, num_partitions, rows, valid is not None or valid_fraction is not None)

    @classmethod
    def from_dask(cls, X: Any, y: Any = None, num_partitions: int | None = None, *,
                  features: Sequence[str] | None = None, label: str | None = None,
                  valid: tuple[Any, Any] | None = None,
                  valid_fraction: float | None = None) -> "PartitionedDataset":
        """Dask arrays ``X, y``, or a dask DataFrame ``X`` with ``features`` and ``label``.

        Each partition's piece of the graph is computed on the worker that holds
        the partition, so the data goes straight to it.
        """
        import dask
        import dask.array as da
        import dask.dataframe as dd

        _check_fraction(valid, valid_fraction)
        if isinstance(X, dd.DataFrame):
            if y is not None or not features or label is None:
                raise ValueError("from_dask with a DataFrame takes features=[...] and label=..., not y")
            missing = [c for c in (*features, label) if c not in X.columns]
            if missing:
                raise ValueError(f"columns {missing} are not in the DataFrame's columns {list(X.columns)}")
            X, y = X[list(features)].to_dask_array(lengths=True), X[label].to_dask_array(lengths=True)
        if not isinstance(X, da.Array) or not isinstance(y, da.Array):
            raise TypeError(f"from_dask takes dask arrays X and y (or a dask DataFrame); got "
                            f"{type(X).__name__} and {type(y).__name__}")
        if X.shape[0] != y.shape[0]:
            raise ValueError(f"from_dask: X has {X.shape[0]} rows but y has {y.shape[0]}; they must match")
        rows = int(X.shape[0])
        if rows == 0:
            raise ValueError("from_dask: X has 0 rows; the dataset must not be empty")
        _check_partitions(num_partitions, rows)

        def blocks(a: Any, parts: int) -> list:
            a = a if isinstance(a, da.Array) else da.from_array(np.asarray(a))
            sizes = tuple(b - s for s, b in _row_ranges(int(a.shape[0]), parts))
            a = a.rechunk((sizes,) + tuple((n,) for n in a.shape[1:]))
            return list(a.to_delayed().ravel())

        def make(parts: int) -> list[DaskSource]:
            xs, ys = blocks(X, parts), blocks(y, parts)
            vs = ([*zip(blocks(valid[0], parts), blocks(valid[1], parts))] if valid is not None
                  else [None] * parts)
            return [DaskSource(dask.delayed(tuple)([xs[i], ys[i], vs[i]]), valid_fraction)
                    for i in range(parts)]

        return cls(make, num_partitions, rows, valid is not None or valid_fraction is not None)


def _parquet_files(paths: str | Sequence[str], features: tuple[str, ...], label: str,
                   what: str) -> list[tuple[str, int]]:
    import pyarrow.parquet as pq
    import pyarrow.types as pat

    if isinstance(paths, (str, os.PathLike)):
        paths = sorted(globlib.glob(os.fspath(paths))) if any(c in os.fspath(paths) for c in "*?[") \
            else [os.fspath(paths)]
    paths = [os.fspath(p) for p in paths]
    if not paths:
        raise ValueError(f"{what} matches no Parquet files")
    out = []
    for path in paths:
        if not os.path.exists(path):
            raise ValueError(f"{what}: Parquet file {path!r} does not exist")
        schema = pq.read_schema(path)
        for column in (*features, label):
            if column not in schema.names:
                raise ValueError(f"column {column!r} is not in {path!r}, whose columns are {schema.names}")
            kind = schema.field(column).type
            if not (pat.is_integer(kind) or pat.is_floating(kind) or pat.is_boolean(kind)):
                raise TypeError(f"column {column!r} of {path!r} has type {kind}, but must be numeric")
        out.append((path, pq.ParquetFile(path).metadata.num_rows))
    return out

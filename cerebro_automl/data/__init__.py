"""PartitionedDataset: a data source cut into P partitions, each loaded on one worker.

Each partition is a train shard and (optionally) a validation shard that live
together on the worker holding the partition. A source describes how to load
partition ``i``; the loading runs on the worker (``from_parquet``,
``from_loader``, ``from_dask``, ``from_torch``, ``from_datamodule``,
``from_image_folder`` and ``from_tar_shards`` never
bring the data to the driver; with ``from_arrays`` the driver has the data
already and sends each worker its shard).

Batches are structured (:mod:`cerebro_automl.data.structure`): ``X`` is an array, a
tuple of arrays or a dict of name -> array; ``y`` the same or None (unlabeled).
Every leaf keeps its dtype; float64 becomes float32.

Options every source takes:

* ``num_partitions``: a property of the data; give it explicitly for results
  that are reproducible across cluster sizes. Left as None, it becomes the
  number of workers when the session starts.
* ``shuffle`` and ``shuffle_seed``: by default rows are assigned to partitions
  by a seeded permutation (its seed ``shuffle_seed``, or the session's seed when
  None), in the units the source reads cheaply (rows for arrays, torch Datasets,
  image folders and tar shards' samples, row groups for Parquet, blocks for
  Dask), and ``valid_fraction`` holds out a seeded random part of each
  partition. ``shuffle=False`` keeps the given order: contiguous ranges, the
  last rows of each held out.
* ``cache``: ``"memory"`` (default) keeps a partition in its worker's memory;
  ``"disk"`` writes it, while it loads, to files in the worker's scratch folder
  (the Dask worker's ``local_directory``, or ``cache_dir``) that batches read
  row by row, so a partition may be larger than the worker's memory.
  ``from_torch``, ``from_datamodule``, ``from_image_folder`` and
  ``from_tar_shards`` also take ``None`` (their default): items are read (and
  decoded) on every batch.

The modules: :mod:`~cerebro_automl.data.dataset` (PartitionedDataset),
one per source kind (:mod:`~cerebro_automl.data.arrays`,
:mod:`~cerebro_automl.data.loader`, :mod:`~cerebro_automl.data.parquet`,
:mod:`~cerebro_automl.data.dask_collections`,
:mod:`~cerebro_automl.data.torch_datasets` with :mod:`~cerebro_automl.data.streams`,
:mod:`~cerebro_automl.data.files`) on top of
:mod:`~cerebro_automl.data.source`, :mod:`~cerebro_automl.data.options`,
:mod:`~cerebro_automl.data.assign` and :mod:`~cerebro_automl.data.columns`;
what a worker holds in :mod:`~cerebro_automl.data.partition`,
:mod:`~cerebro_automl.data.shards` and :mod:`~cerebro_automl.data.disk_cache`;
structured batches in :mod:`~cerebro_automl.data.structure`.

Example:
    >>> import numpy as np
    >>> X, y = np.zeros((100, 4), "float32"), np.zeros(100, "int64")
    >>> data = PartitionedDataset.from_arrays(X, y, num_partitions=4, valid_fraction=0.2)
    >>> data.resolve(2).num_partitions
    4
"""

from .dataset import PartitionedDataset
from .disk_cache import DiskShard
from .errors import DataError
from .options import LoadOptions
from .partition import CACHES, PartitionData, build_partition, split_rows
from .shards import DatasetShard, Shard, TensorShard
from .structure import (
    Batch,
    as_structure,
    call_model,
    check_structure,
    concat,
    count_rows,
    leaves,
    map_structure,
    rows_of,
    take,
    to_device,
)

__all__ = [
    # datasets
    "PartitionedDataset",
    "LoadOptions",
    "DataError",
    # what a worker holds
    "PartitionData",
    "Shard",
    "TensorShard",
    "DiskShard",
    "DatasetShard",
    "build_partition",
    "split_rows",
    "CACHES",
    # structured batches
    "Batch",
    "as_structure",
    "check_structure",
    "leaves",
    "map_structure",
    "count_rows",
    "take",
    "to_device",
    "concat",
    "call_model",
    "rows_of",
]

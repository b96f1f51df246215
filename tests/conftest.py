"""Shared fixtures: a tiny classification problem and its TrainingSpec.

The functions the spec uses live in ``tests/models.py``, which is sent to Dask
workers by value (cloudpickle), so tests run on any cluster.
"""

from __future__ import annotations

import numpy as np
import pytest

from cerebro_automl import PartitionedDataset

from models import make_spec  # noqa: E402  (tests/ is on sys.path under pytest)


def make_arrays(rows: int = 600, valid_rows: int = 200, features: int = 8, seed: int = 0):
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(features, 3))
    X = rng.normal(size=(rows, features)).astype(np.float32)
    Xv = rng.normal(size=(valid_rows, features)).astype(np.float32)
    return X, (X @ w).argmax(1).astype(np.int64), Xv, (Xv @ w).argmax(1).astype(np.int64)


@pytest.fixture
def arrays():
    return make_arrays()


@pytest.fixture
def data(arrays):
    X, y, Xv, yv = arrays
    return PartitionedDataset.from_arrays(X, y, num_partitions=3, valid=(Xv, yv))


@pytest.fixture
def spec():
    return make_spec()


@pytest.fixture(scope="session")
def cluster():
    """One LocalCluster of two single-threaded worker processes for the module's tests."""
    from distributed import Client

    from cerebro_automl.executors.dask import start_local_cluster

    with start_local_cluster(2) as local, Client(local) as client:
        yield client

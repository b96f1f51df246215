"""Shared fixtures: a tiny classification problem and its TrainingSpec.

The functions the spec uses live in ``tests/models.py``, which is sent to Dask
workers by value (cloudpickle), so tests run on any cluster.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from cerebro_automl import PartitionedDataset

from models import make_spec  # noqa: E402  (tests/ is on sys.path under pytest)


def same_states(a: list[dict], b: list[dict]) -> bool:
    """Whether two lists of model state dicts are bitwise equal."""
    import torch

    return len(a) == len(b) and all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
                                    for x, y in zip(a, b))


def local_reference(spec, data, configs, epochs: int, seed: int = 3) -> list[dict]:
    """The final weights of ``configs`` trained on the local executor: the reference bits."""
    from cerebro_automl import Session

    with Session(spec, data, executor="local", seed=seed) as s:
        ids = [s.add(c, epochs=epochs) for c in configs]
        s.run()
        return [s.model(i).state()["model"] for i in ids]


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


@pytest.fixture(scope="module")
def four():
    """A client of a LocalCluster of 4 single-threaded worker processes (gang units of
    up to 4 ranks), for the module's tests."""
    from distributed import Client

    from cerebro_automl.executors.dask import start_local_cluster

    with start_local_cluster(4) as local, Client(local) as client:
        client.wait_for_workers(4)
        yield client


@pytest.fixture(scope="module")
def data4():
    """The tiny problem in 4 partitions, one per worker of ``four``."""
    X, y, Xv, yv = make_arrays(rows=640, valid_rows=160)
    return PartitionedDataset.from_arrays(X, y, num_partitions=4, valid=(Xv, yv))


@contextlib.contextmanager
def cli_cluster(folder: Path, worker_envs: list[dict], worker_args: tuple[str, ...] = (),
                nthreads: int = 1, scheduler_cmd: list | None = None):
    """`dask scheduler` and one `dask worker` per environment, on loopback, as real
    processes; yields the scheduler address and kills them all at the end.
    ``scheduler_cmd``: another command that starts the scheduler (default `dask scheduler`)."""
    bin_dir = Path(sys.executable).parent
    scheduler_file = folder / "scheduler.json"
    quiet = dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    procs = [subprocess.Popen([*(scheduler_cmd or [bin_dir / "dask", "scheduler"]), "--host", "127.0.0.1", "--port", "0",
                               "--no-dashboard", "--scheduler-file", scheduler_file],
                              env=worker_envs[0] if worker_envs else cli_env(), **quiet)]
    try:
        address = _address_in(scheduler_file, procs[0], timeout=60)
        for env in worker_envs:
            procs.append(subprocess.Popen([bin_dir / "dask", "worker", address, "--nthreads", str(nthreads),
                                           "--no-dashboard", "--host", "127.0.0.1", *worker_args],
                                          env=env, **quiet))
        yield address
    finally:
        for p in procs[::-1]:
            p.kill()
        for p in procs:
            p.wait(timeout=30)


def _address_in(scheduler_file: Path, scheduler: subprocess.Popen, timeout: float) -> str:
    """The address in the scheduler file once it is whole: the scheduler creates the file
    before it writes it, so an empty or half-written file is read again."""
    deadline = time.time() + timeout
    while True:
        try:
            return json.loads(scheduler_file.read_text())["address"]
        except (FileNotFoundError, json.JSONDecodeError, KeyError):
            if scheduler.poll() is not None:
                raise RuntimeError(f"the scheduler exited with {scheduler.returncode} before it wrote {scheduler_file}")
            if time.time() > deadline:
                raise TimeoutError(f"the scheduler wrote no address to {scheduler_file} in {timeout} s") from None
            time.sleep(0.2)


def cli_env() -> dict:
    """The environment for CLI processes: tests/ importable, no inherited malloc setting."""
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parent))
    env.pop("MALLOC_TRIM_THRESHOLD_", None)  # a default LocalCluster in this process may have left it
    return env

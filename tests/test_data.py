"""PartitionedDataset: every source yields the same rows; shards stay on their worker.

The partition contents are checked by loading each source where the worker
would (``source.load()``); where the data lives is checked on a real cluster,
by reading each worker's own memory with ``client.run``.
"""

from __future__ import annotations

import gc
import os
import threading
import time

import numpy as np
import pytest
import torch

from cerebro_automl import PartitionedDataset, Session

from conftest import make_arrays
from models import make_spec


def _loaded(data: PartitionedDataset, parts: int | None = None):
    data = data.resolve(parts or data.num_partitions)
    return [source.load() for source in data.sources]


def _concat(partitions, which: str):
    shards = [getattr(p, which) for p in partitions]
    return (torch.cat([s.x for s in shards]).numpy(), torch.cat([s.y for s in shards]).numpy())


def _write_parquet(path, X, y, files: int = 1, row_group_size: int | None = None) -> list[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    paths = []
    for i, (xs, ys) in enumerate(zip(np.array_split(X, files), np.array_split(y, files))):
        table = pa.table({**{f"f{j}": xs[:, j] for j in range(X.shape[1])}, "label": ys})
        p = os.path.join(path, f"part-{i:02d}.parquet")
        pq.write_table(table, p, row_group_size=row_group_size)
        paths.append(p)
    return paths


# ------------------------------------------------------------ partition contents
def test_from_arrays_covers_every_row_once_in_order(arrays):
    X, y, Xv, yv = arrays
    parts = _loaded(PartitionedDataset.from_arrays(X, y, num_partitions=4, shuffle=False, valid=(Xv, yv)))
    assert len(parts) == 4
    assert [len(p.train) for p in parts] == [150] * 4
    np.testing.assert_array_equal(_concat(parts, "train")[0], X)
    np.testing.assert_array_equal(_concat(parts, "train")[1], y)
    np.testing.assert_array_equal(_concat(parts, "valid")[0], Xv)  # validation is sharded too
    np.testing.assert_array_equal(_concat(parts, "valid")[1], yv)


def test_from_arrays_accepts_torch_and_makes_float64_float32(arrays):
    X, y, _, _ = arrays
    parts = _loaded(PartitionedDataset.from_arrays(torch.from_numpy(X).double(), torch.from_numpy(y),
                                                   num_partitions=2, shuffle=False))
    assert parts[0].train.x.dtype == torch.float32
    assert parts[0].valid is None
    np.testing.assert_allclose(_concat(parts, "train")[0], X)


def test_valid_fraction_holds_out_the_end_of_each_shard(arrays):
    X, y, _, _ = arrays
    parts = _loaded(PartitionedDataset.from_arrays(X, y, num_partitions=3, shuffle=False, valid_fraction=0.25))
    for i, p in enumerate(parts):
        rows = X[i * 200:(i + 1) * 200]
        np.testing.assert_array_equal(p.train.x.numpy(), rows[:150])
        np.testing.assert_array_equal(p.valid.x.numpy(), rows[150:])


def test_unset_partitions_follow_the_worker_count(arrays):
    X, y, _, _ = arrays
    data = PartitionedDataset.from_arrays(X, y)
    assert data.resolve(3).num_partitions == 3
    assert PartitionedDataset.from_arrays(X[:2], y[:2]).resolve(5).num_partitions == 2


def test_from_parquet_reads_row_ranges_across_files_and_row_groups(tmp_path, arrays):
    X, y, Xv, yv = arrays
    train = _write_parquet(tmp_path, X, y, files=3, row_group_size=70)
    (tmp_path / "valid").mkdir()
    valid = _write_parquet(tmp_path / "valid", Xv, yv)
    features = [f"f{j}" for j in range(X.shape[1])]
    data = PartitionedDataset.from_parquet(str(tmp_path / "part-*.parquet"), features=features,
                                           label="label", num_partitions=4, shuffle=False, valid=valid)
    assert data.num_rows == len(X)
    parts = _loaded(data)
    for source, p in zip(data.resolve(4).sources, parts):
        assert len(source.pieces) >= 1
    np.testing.assert_array_equal(_concat(parts, "train")[0], X)
    np.testing.assert_array_equal(_concat(parts, "train")[1], y)
    np.testing.assert_array_equal(_concat(parts, "valid")[0], Xv)
    assert len(train) == 3


def test_a_class_sorted_parquet_table_in_few_row_groups_gives_the_partitions_from_arrays_would(tmp_path):
    """pandas writes a row group per file: whole row groups would give each partition a
    few classes of a sorted table, so its rows are drawn as from_arrays draws them."""
    rng = np.random.default_rng(0)
    y = np.repeat(np.arange(4), 30)  # sorted by class
    X = rng.normal(size=(len(y), 3)).astype(np.float32)
    _write_parquet(tmp_path, X, y, files=2)
    sorted_table = PartitionedDataset.from_parquet(str(tmp_path / "part-*.parquet"), features=["f0", "f1", "f2"],
                                                   label="label", num_partitions=2, shuffle_seed=5)
    parts, same = _loaded(sorted_table), _loaded(PartitionedDataset.from_arrays(X, y, num_partitions=2,
                                                                                 shuffle_seed=5))
    for part, expected in zip(parts, same, strict=True):
        assert set(part.train.y.tolist()) == {0, 1, 2, 3}
        assert torch.equal(part.train.x, expected.train.x) and torch.equal(part.train.y, expected.train.y)


@pytest.mark.parametrize("form", ["arrays", "dataframe"])
def test_a_class_sorted_dask_collection_in_few_blocks_gives_the_partitions_from_arrays_would(form):
    import dask.array as da
    import dask.dataframe as dd
    import pandas as pd

    rng = np.random.default_rng(0)
    y = np.repeat(np.arange(4), 30)  # sorted by class, in 2 blocks
    X = rng.normal(size=(len(y), 3)).astype(np.float32)
    if form == "arrays":
        data = PartitionedDataset.from_dask(da.from_array(X, chunks=60), da.from_array(y, chunks=60),
                                            num_partitions=2, shuffle_seed=5)
    else:
        frame = dd.from_pandas(pd.DataFrame({"f0": X[:, 0], "f1": X[:, 1], "f2": X[:, 2], "label": y}),
                               npartitions=2)
        data = PartitionedDataset.from_dask(frame, features=["f0", "f1", "f2"], label="label", num_partitions=2,
                                            shuffle_seed=5)
    same = _loaded(PartitionedDataset.from_arrays(X, y, num_partitions=2, shuffle_seed=5))
    for part, expected in zip(_loaded(data), same, strict=True):
        assert set(part.train.y.tolist()) == {0, 1, 2, 3}
        assert torch.equal(part.train.x, expected.train.x) and torch.equal(part.train.y, expected.train.y)


def test_parquet_with_many_row_groups_per_partition_moves_whole_row_groups(tmp_path, arrays):
    X, y, _, _ = arrays
    _write_parquet(tmp_path, X, y, files=2, row_group_size=-(-len(X) // 64))  # 64 row groups, 32 a partition
    data = PartitionedDataset.from_parquet(str(tmp_path / "part-*.parquet"), features=[f"f{j}" for j in
                                           range(X.shape[1])], label="label", num_partitions=2, shuffle_seed=5)
    assert all(len(piece) == 3 for source in data.resolve(2).sources for piece in source.pieces)  # (unit, lo, hi)
    rows = np.concatenate([p.train.x.numpy() for p in _loaded(data)])
    assert sorted(map(tuple, rows.tolist())) == sorted(map(tuple, X.tolist()))


def test_from_dask_arrays_and_dataframe_give_the_same_partitions(arrays):
    import dask.array as da
    import dask.dataframe as dd
    import pandas as pd

    X, y, Xv, yv = arrays
    expected = _loaded(PartitionedDataset.from_arrays(X, y, num_partitions=3, shuffle=False, valid=(Xv, yv)))
    from_arrays = _loaded(PartitionedDataset.from_dask(
        da.from_array(X, chunks=(128, 8)), da.from_array(y, chunks=128), num_partitions=3, shuffle=False,
        valid=(da.from_array(Xv, chunks=64), da.from_array(yv, chunks=64))))
    frame = pd.DataFrame({**{f"f{j}": X[:, j] for j in range(8)}, "label": y})
    from_frame = _loaded(PartitionedDataset.from_dask(
        dd.from_pandas(frame, npartitions=5), features=[f"f{j}" for j in range(8)], label="label",
        num_partitions=3, shuffle=False))
    for a, b, c in zip(expected, from_arrays, from_frame):
        for got in (b, c):
            assert torch.equal(a.train.x, got.train.x) and torch.equal(a.train.y, got.train.y)
        assert torch.equal(a.valid.x, b.valid.x)


def test_from_loader_calls_fn_with_the_partition_index():
    def load(i):
        return np.full((10, 8), i, np.float32), np.full(10, i, np.int64)

    parts = _loaded(PartitionedDataset.from_loader(load, num_partitions=3))
    assert [int(p.train.y[0]) for p in parts] == [0, 1, 2]


# ------------------------------------------------------------- on a real cluster
def _placed_bytes_per_worker(client) -> dict[str, int]:
    """Bytes of partition data each worker holds, read inside the worker."""
    def held(dask_worker=None):
        return sum(value.nbytes for key, value in dask_worker.data.items()
                   if str(key).startswith("cerebro-place-"))

    return client.run(held)


@pytest.mark.cluster
def test_each_worker_holds_only_its_own_shards(cluster):
    X, y, Xv, yv = make_arrays(rows=20_000, valid_rows=4_000)
    data = PartitionedDataset.from_arrays(X, y, num_partitions=2, valid=(Xv, yv))
    total = X.nbytes + y.nbytes + Xv.nbytes + yv.nbytes
    with Session(make_spec(batch_size=512), data, client=cluster) as s:
        s.add({"lr": 1e-2, "width": 8}, epochs=1)
        s.run()
        held = _placed_bytes_per_worker(cluster)
    assert sorted(held.values()) == [total // 2, total // 2], (held, total)
    # Closing the session frees the shards.
    deadline = time.time() + 10
    while any(_placed_bytes_per_worker(cluster).values()) and time.time() < deadline:
        time.sleep(0.1)
    assert not any(_placed_bytes_per_worker(cluster).values())


@pytest.mark.cluster
@pytest.mark.parametrize("has_validation", [True, None])
def test_from_loader_runs_on_the_workers(cluster, tmp_path, has_validation):
    marks = str(tmp_path)

    def load(i):  # self-contained: cloudpickle sends it to the workers by value
        rng = np.random.default_rng(i)
        X, Xv = rng.normal(size=(300, 8)).astype(np.float32), rng.normal(size=(60, 8)).astype(np.float32)
        y, yv = (X[:, 0] > 0).astype(np.int64), (Xv[:, 0] > 0).astype(np.int64)
        with open(os.path.join(marks, f"loaded-{i}-pid-{os.getpid()}"), "w"):
            pass
        return X, y, Xv, yv

    data = PartitionedDataset.from_loader(load, num_partitions=2, has_validation=has_validation)
    with Session(make_spec(), data, client=cluster) as s:
        s.add({"lr": 1e-2, "width": 8}, epochs=1)
        history = s.run()
    assert history["val_accuracy"].notna().all()
    pids = {int(name.split("-")[-1]) for name in os.listdir(marks)}
    assert len(os.listdir(marks)) == 2  # each partition loaded once
    assert os.getpid() not in pids
    assert pids <= set(cluster.run(os.getpid).values())


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


@pytest.mark.cluster
def test_driver_memory_does_not_grow_with_a_parquet_source(cluster, tmp_path):
    """About 80 MB of Parquet trains on the workers; the driver's RSS grows by a
    small fraction of it, sampled every 20 ms through the whole run."""
    rows, features = 1_000_000, 16
    rng = np.random.default_rng(0)
    X = rng.normal(size=(rows, features)).astype(np.float32)
    y = (X[:, 0] > 0).astype(np.int64)
    _write_parquet(tmp_path, X, y, files=4, row_group_size=100_000)
    data_bytes = X.nbytes + y.nbytes
    del X, y
    gc.collect()

    def model_fn(config):
        return torch.nn.Linear(features, 2)

    spec = make_spec(model_fn=model_fn, batch_size=8192)

    def train(folder):
        data = PartitionedDataset.from_parquet(str(folder / "*.parquet"), features=[f"f{j}" for j in range(features)],
                                               label="label", num_partitions=2, valid_fraction=0.1)
        with Session(spec, data, client=cluster) as s:
            s.add({"lr": 1e-2}, epochs=1)
            return s.run(), _placed_bytes_per_worker(cluster)

    # A small run first: what a first session imports and keeps (tens of MB, whatever the
    # data) is not the data's. Run alone, this test measured 71 MB of it without the warm-up.
    (tmp_path / "warm").mkdir()
    _write_parquet(tmp_path / "warm", rng.normal(size=(2000, features)).astype(np.float32), np.arange(2000) % 2)
    train(tmp_path / "warm")
    gc.collect()
    baseline, peak, done = _rss(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        history, held = train(tmp_path)
    finally:
        done.set()
        sampler.join()
    assert history["val_accuracy"].iloc[0] > 0.9
    assert sum(held.values()) == pytest.approx(data_bytes, rel=0.01)  # all of it is on the workers
    growth = max(peak[0], _rss()) - baseline
    print(f"driver RSS growth {growth / 2**20:.1f} MB for {data_bytes / 2**20:.0f} MB of data")
    assert growth < 0.25 * data_bytes, f"driver RSS grew {growth / 2**20:.1f} MB for {data_bytes / 2**20:.0f} MB of data"


def _loader_with_validation(i):  # returns validation rows: refused with has_validation=False
    X, y, Xv, yv = make_arrays(rows=60, valid_rows=20, seed=i)
    return X, y, Xv, yv


def test_from_loader_refuses_validation_data_it_was_told_there_is_none(cluster):
    from cerebro_automl import DataLoadError

    data = PartitionedDataset.from_loader(_loader_with_validation, num_partitions=2, has_validation=False)
    with Session(make_spec(), data, client=cluster) as s:
        s.add({"lr": 1e-2, "width": 8}, epochs=1)
        with pytest.raises(DataLoadError, match=r"failed to load, and would on every try: .* returned validation "
                                                r"data .* has_validation=False"):
            s.run()


def _loader_of_two_widths(i):  # partition 1 has 6 features where partition 0 has 8
    X, y, _, _ = make_arrays(rows=60, valid_rows=20, seed=i)
    return (X if i == 0 else X[:, :6]), y


def test_a_model_that_fails_on_partitions_of_different_layouts_is_told_so(cluster, caplog):
    """torch's error names only two shapes ("mat1 and mat2 shapes cannot be multiplied");
    the failure adds which partitions hold which layout."""
    from cerebro_automl import ModelFailed

    data = PartitionedDataset.from_loader(_loader_of_two_widths, num_partitions=2, valid_fraction=0.25)
    with Session(make_spec(), data, client=cluster) as s:
        s.add({"lr": 1e-2, "width": 8}, epochs=1)
        [failed] = [r for r in s.reports() if isinstance(r, ModelFailed)]
    said = ("the partitions hold data of different layouts, but every partition must have the same: "
            "partitions [0]: X float32 (8,), y int64 (); partitions [1]: X float32 (6,), y int64 ()")
    assert failed.error.endswith(said) and said in caplog.text, failed.error


def test_non_finite_validation_rows_fail_the_load_on_the_worker_naming_them(cluster):
    """from_arrays holds out its validation rows on the workers: NaN there fails the
    partition's load, before any model trains on it, instead of every val_loss being NaN."""
    from cerebro_automl import DataLoadError

    X, y, _, _ = make_arrays()
    X[599, 2] = np.nan  # the last row of partition 1: held out by valid_fraction
    data = PartitionedDataset.from_arrays(X, y, num_partitions=2, shuffle=False, valid_fraction=0.1)
    with Session(make_spec(), data, client=cluster) as s:
        s.add({"lr": 1e-2, "width": 8}, epochs=1)
        with pytest.raises(DataLoadError, match=r"partition 1 failed to load, and would on every try: .* DataError: "
                                                r"partition 1 validation: X is nan in row 29; validation inputs and "
                                                r"labels must be finite"):
            s.run()  # not tried 4 times with back-off: the data is the same on every worker
        assert s.history.empty


def test_without_validation_data_each_epoch_is_evaluated_in_one_task_with_the_same_figures(cluster):
    """P evaluation tasks per model-epoch read empty shards for the training figures that
    one task reads from the state: one task, the same numbers as the local executor."""
    from distributed import get_task_stream

    X, y, _, _ = make_arrays()
    data = PartitionedDataset.from_arrays(X, y, num_partitions=3)
    configs = [{"lr": 1e-2, "width": 8}, {"lr": 3e-2, "width": 4}]
    histories = []
    for kwargs in ({"client": cluster}, {"executor": "local", "n_workers": 2}):
        with Session(make_spec(), data, seed=4, **kwargs) as s:
            for config in configs:
                s.add(config, epochs=2)
            with get_task_stream(cluster) as stream:
                histories.append(s.run())
        evaluations = [t for t in stream.data if "cerebro-evaluate" in str(t["key"])]
        if "client" in kwargs:
            assert len(evaluations) == 2 * 2, [t["key"] for t in evaluations]
    dask, local = (h.sort_values(["model_id", "epoch"]).reset_index(drop=True) for h in histories)
    assert list(dask["train_loss"]) == list(local["train_loss"])
    assert not [c for c in dask.columns if c.startswith("val_") and c != "val_seconds"]


SCRIPT_WITH_ITS_OWN_LOADER = '''
import sys
import numpy as np
import torch
from distributed import Client
from cerebro_automl import PartitionedDataset, Session, TrainingSpec


def load(index):  # defined in the user's script: __main__.load on the driver only
    rng = np.random.default_rng(index)
    return rng.normal(size=(64, 8)).astype(np.float32), rng.integers(0, 3, 64)


def model_fn(config):
    return torch.nn.Linear(8, 3)


def optimizer_fn(config, params):
    return torch.optim.SGD(params, lr=config["lr"])


data = PartitionedDataset.from_loader(load, num_partitions=2, has_validation=False)
with Client(sys.argv[1]) as client, Session(TrainingSpec(model_fn=model_fn, optimizer_fn=optimizer_fn,
                                                         batch_size=16), data, client=client) as s:
    s.add({"lr": 0.1}, epochs=1)
    history = s.run()
print("trained", len(history))
'''


@pytest.mark.cluster
@pytest.mark.timeout(180)
def test_a_loader_defined_in_the_users_script_reaches_cli_workers(tmp_path):
    """A script's own functions are __main__.<name> on the driver, which a `dask
    worker` process cannot import: they travel by value."""
    import subprocess
    import sys

    from conftest import cli_cluster, cli_env

    script = tmp_path / "search.py"
    script.write_text(SCRIPT_WITH_ITS_OWN_LOADER)
    with cli_cluster(tmp_path, [cli_env()], ("--no-nanny",)) as address:
        done = subprocess.run([sys.executable, str(script), address], env=cli_env(), capture_output=True,
                              text=True, timeout=150)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "trained 1" in done.stdout


def test_an_evaluation_without_validation_data_reads_the_state_where_it_is_whatever_partitions_that_worker_holds(
        cluster):
    """The one evaluation task goes to the worker holding the state, which need not hold
    partition 0: no shard is read, so none may be reported lost (and placed again)."""
    from distributed import get_task_stream

    X, y, _, _ = make_arrays()
    data = PartitionedDataset.from_arrays(X, y, num_partitions=2)
    with Session(make_spec(), data, seed=4, client=cluster) as s, get_task_stream(cluster) as stream:
        for offset in (0, 1):  # their last units of an epoch end on either worker
            s.add({"lr": 1e-2, "width": 8}, epochs=2, offset=offset)
        history = s.run()
    assert len(history) == 4 and set(s.status(i) for i in (0, 1)) == {"paused"}
    places = [t["key"] for t in stream.data if "cerebro-place" in str(t["key"])]
    assert len(places) <= 2, places  # each partition placed once, never again

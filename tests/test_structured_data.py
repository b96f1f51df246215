"""Real training data: structured batches (tuple and dict inputs, int64 ids, no
labels), augmentation, torch Datasets, LightningDataModules, seeded shuffles,
fsspec URLs and the disk cache.

Each workload trains end to end on a LocalCluster of 1 and of 2 workers and
must give bitwise-identical weights (fixed order)."""

from __future__ import annotations

import os
import sys
from functools import partial
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from cerebro_automl import PartitionedDataset, Session
from cerebro_automl.adapters.lightning import LightningSpec
from cerebro_automl.data import DiskShard, TensorShard

from structured_models import (BIG_ID, FileDataModule, ItemDataset, LitClassifier8, autoencoder_spec,
                               criteo_arrays, criteo_spec, noise_augment, scale_eval)
from models import make_spec

sys.path.insert(0, str(Path(__file__).parent.parent / "examples"))
import image_folder_augment as images  # noqa: E402


@pytest.fixture(scope="module")
def cluster1():
    from distributed import Client

    from cerebro_automl.executors.dask import start_local_cluster

    with start_local_cluster(1) as local, Client(local) as client:
        yield client


def _train(spec, data, configs, client=None, epochs=2, executor="dask"):
    kwargs = dict(client=client) if executor == "dask" else dict(executor="local")
    with Session(spec, data, seed=5, **kwargs) as s:
        ids = [s.add(c, epochs=epochs) for c in configs]
        history = s.run()
        assert [s.model(i).error for i in ids] == [None] * len(ids)
        return history, [s.model(i).state()["model"] for i in ids]


def _same_bits(a, b) -> None:
    (ha, wa), (hb, wb) = a, b
    for x, y in zip(wa, wb):
        assert x.keys() == y.keys()
        for k in x:
            assert torch.equal(x[k], y[k]), k
    metrics = [c for c in ha.columns if c.startswith(("train_loss", "val_")) and c != "val_seconds"]
    ha, hb = (h.sort_values(["model_id", "epoch"]).reset_index(drop=True) for h in (ha, hb))
    pd.testing.assert_frame_equal(ha[metrics], hb[metrics])


def _on_1_and_2_workers(spec, data, configs, cluster1, cluster, epochs=2):
    one = _train(spec, data, configs, cluster1, epochs)
    two = _train(spec, data, configs, cluster, epochs)
    _same_bits(one, two)
    return one


def _load_all(data: PartitionedDataset, parts: int | None = None, scratch: str | None = None):
    data = data.resolve(parts or data.num_partitions)
    return [source.load(scratch=scratch) for source in data.sources]


def _rows(shard, which: str = "x"):
    """Every row of a shard, through its batch interface."""
    x, y = shard.batch(torch.arange(len(shard)))
    return x if which == "x" else y


# ----------------------------------------------------------- structured batches
def test_dict_inputs_keep_int64_ids_and_make_float64_float32():
    X, y = criteo_arrays(400)
    parts = _load_all(PartitionedDataset.from_arrays(X, y, num_partitions=2, shuffle=False))
    cat = torch.cat([_rows(p.train)["cat"] for p in parts])
    dense = torch.cat([_rows(p.train)["dense"] for p in parts])
    assert cat.dtype == torch.int64 and dense.dtype == torch.float32
    assert torch.equal(cat, torch.from_numpy(X["cat"]))  # every id >= 2**24 unchanged
    assert int(cat.min()) >= BIG_ID
    np.testing.assert_array_equal(dense.numpy(), X["dense"].astype(np.float32))


def test_a_batch_takes_the_same_rows_of_every_leaf():
    rows = 50
    X = (np.arange(rows, dtype=np.int64), np.arange(rows, dtype=np.float32)[:, None] * 2)
    y = {"a": np.arange(rows) * 3, "b": np.arange(rows, dtype=np.int16)}
    [part] = _load_all(PartitionedDataset.from_arrays(X, y, num_partitions=1))
    (x0, x1), labels = part.train.batch(torch.tensor([7, 3, 41]))
    assert x0.tolist() == [7, 3, 41] and x1[:, 0].tolist() == [14.0, 6.0, 82.0]
    assert labels["a"].tolist() == [21, 9, 123] and labels["b"].dtype == torch.int16


def test_unlabeled_data_has_no_y():
    X = np.random.default_rng(0).normal(size=(60, 8)).astype(np.float32)
    [part] = _load_all(PartitionedDataset.from_arrays(X, None, num_partitions=1, valid_fraction=0.25))
    x, y = part.train.batch(torch.arange(3))
    assert y is None and x.shape == (3, 8)
    assert len(part.train) == 45 and len(part.valid) == 15


def test_criteo_style_two_input_model_is_bitwise_equal_on_1_and_2_workers(cluster1, cluster):
    X, y = criteo_arrays(1200)
    Xv, yv = criteo_arrays(300, seed=1)
    data = PartitionedDataset.from_arrays(X, y, num_partitions=3, valid=(Xv, yv), shuffle_seed=4)
    history, _ = _on_1_and_2_workers(criteo_spec(), data, [{"lr": 1e-2, "width": 16},
                                                           {"lr": 3e-3, "width": 8}], cluster1, cluster)
    assert history.val_accuracy.notna().all()


def test_criteo_style_parquet_with_int64_ids_is_bitwise_equal_on_1_and_2_workers(tmp_path, cluster1, cluster):
    X, y = criteo_arrays(1500)
    frame = pd.DataFrame({**{f"i{j}": X["dense"][:, j] for j in range(13)},
                          **{f"c{j}": X["cat"][:, j] for j in range(4)}, "label": y})
    for i in range(3):
        frame.iloc[i * 500:(i + 1) * 500].to_parquet(tmp_path / f"day-{i}.parquet", row_group_size=200)
    features = {"dense": [f"i{j}" for j in range(13)], "cat": [f"c{j}" for j in range(4)]}
    data = PartitionedDataset.from_parquet(f"file://{tmp_path}/day-*.parquet", features=features,
                                           label="label", num_partitions=3, valid_fraction=0.2,
                                           shuffle_seed=1)
    parts = _load_all(data)
    cat = torch.cat([_rows(p.train)["cat"] for p in parts] + [_rows(p.valid)["cat"] for p in parts])
    assert cat.dtype == torch.int64
    assert sorted(cat[:, 0].tolist()) == sorted(X["cat"][:, 0].tolist())  # read as integers, exactly
    history, _ = _on_1_and_2_workers(criteo_spec(), data, [{"lr": 1e-2, "width": 16}], cluster1, cluster)
    assert history.val_accuracy.iloc[-1] > 0.5


def test_an_autoencoder_trains_on_unlabeled_data_on_1_and_2_workers(cluster1, cluster):
    X = np.random.default_rng(0).normal(size=(900, 8))
    data = PartitionedDataset.from_arrays(X, None, num_partitions=3, valid_fraction=0.2)
    history, _ = _on_1_and_2_workers(autoencoder_spec(), data, [{"lr": 1e-2, "width": 4}], cluster1, cluster)
    assert history.val_loss.iloc[-1] < history.val_loss.iloc[0]
    assert "val_mae" in history


def test_lightning_boring_model_trains_on_bare_inputs_without_collate(cluster1, cluster):
    from lightning.pytorch.demos.boring_classes import BoringModel

    X = np.random.default_rng(0).normal(size=(128, 32)).astype(np.float32)
    data = PartitionedDataset.from_arrays(X, None, num_partitions=2)
    spec = LightningSpec(lambda config: BoringModel(), batch_size=16)
    history, states = _on_1_and_2_workers(spec, data, [{}], cluster1, cluster)
    before = BoringModel().state_dict()
    assert any(not torch.equal(before[k], states[0][k]) for k in before)
    assert history.train_loss.notna().all()


# ------------------------------------------------------------------ augmentation
def test_augmentation_is_seeded_per_unit_and_changes_the_result():
    X, y = np.random.default_rng(0).normal(size=(300, 8)).astype(np.float32), np.arange(300) % 3
    data = PartitionedDataset.from_arrays(X, y, num_partitions=3, valid_fraction=0.2)
    config = [{"lr": 1e-2, "width": 8}]
    plain = _train(make_spec(), data, config, executor="local")
    augmented = _train(make_spec(train_transform=noise_augment, eval_transform=scale_eval), data, config,
                       executor="local")
    again = _train(make_spec(train_transform=noise_augment, eval_transform=scale_eval), data, config,
                   executor="local")
    _same_bits(augmented, again)
    assert not torch.equal(plain[1][0]["0.weight"], augmented[1][0]["0.weight"])


def test_transforms_must_return_x_and_y():
    X, y = np.zeros((30, 8), np.float32), np.zeros(30, np.int64)
    data = PartitionedDataset.from_arrays(X, y, num_partitions=1)
    spec = make_spec(train_transform=lambda x, y, g: x)
    with Session(spec, data, executor="local") as s:
        mid = s.add({"lr": 1e-2, "width": 8}, epochs=1)
        s.run()
        assert "train_transform returned Tensor, but must return (x, y)" in s.model(mid).error


def test_image_folder_example_with_augmentation_is_bitwise_equal_on_1_and_2_workers(tmp_path, cluster1, cluster):
    images.make_image_folder(str(tmp_path / "train"), 120, seed=0)
    images.make_image_folder(str(tmp_path / "valid"), 30, seed=1)
    data = images.make_data(str(tmp_path), num_partitions=2)
    history, _ = _on_1_and_2_workers(images.make_spec(), data,
                                     [{"lr": 3e-3, "width": 8, "batch_size": 16}], cluster1, cluster)
    assert history.val_accuracy.notna().all()


def test_image_crops_and_flips_come_from_the_generator():
    x = torch.arange(2 * 3 * 32 * 32, dtype=torch.uint8).reshape(2, 3, 32, 32)
    a, _ = images.augment(x, None, torch.Generator().manual_seed(1))
    b, _ = images.augment(x, None, torch.Generator().manual_seed(1))
    c, _ = images.augment(x, None, torch.Generator().manual_seed(2))
    assert a.shape == (2, 3, 32, 32) and torch.equal(a, b) and not torch.equal(a, c)


# ------------------------------------------------------- torch Datasets, DataModules
def test_from_torch_builds_the_dataset_on_the_workers_and_covers_every_item(tmp_path, cluster):
    marks = tmp_path / "marks"
    marks.mkdir()
    data = PartitionedDataset.from_torch(partial(ItemDataset, 300, str(marks)), 3,
                                         valid_fn=partial(ItemDataset, 90, None, True, 10_000),
                                         shuffle_seed=2)
    parts = _load_all(data)
    seen = np.sort(np.concatenate([p.train.indices for p in parts]))
    np.testing.assert_array_equal(seen, np.arange(300))
    x, y = parts[0].train.batch(torch.arange(4))
    assert x.dtype == torch.float32 and y.dtype == torch.int64  # default_collate, float64 -> float32
    for f in marks.iterdir():
        f.unlink()
    with Session(make_spec(), data, client=cluster, seed=1) as s:
        s.add({"lr": 1e-2, "width": 8}, epochs=1)
        history = s.run()
    assert history.val_accuracy.notna().all()
    pids = {int(name.name.split("-")[1]) for name in marks.iterdir()}
    assert os.getpid() not in pids and pids <= set(cluster.run(os.getpid).values())


@pytest.mark.parametrize("cache", ["memory", "disk"])
def test_from_torch_cached_gives_the_bits_of_reading_through_the_dataset(cache):
    def data(cache):
        return PartitionedDataset.from_torch(partial(ItemDataset, 240), 2, valid_fraction=0.25,
                                             shuffle_seed=3, cache=cache)

    config = [{"lr": 1e-2, "width": 8}]
    _same_bits(_train(make_spec(), data(None), config, executor="local"),
               _train(make_spec(), data(cache), config, executor="local"))


def test_from_torch_items_without_labels():
    data = PartitionedDataset.from_torch(partial(ItemDataset, 90, None, False), 1)
    [part] = _load_all(data)
    x, y = part.train.batch(torch.arange(5))
    assert y is None and x.shape == (5, 8)


def test_a_lightning_datamodule_is_set_up_where_the_data_lives(tmp_path, cluster1, cluster):
    folder = tmp_path / "dm"
    folder.mkdir()
    data = PartitionedDataset.from_datamodule(FileDataModule(str(folder)), 2)
    assert data.has_validation
    spec = LightningSpec(lambda c: LitClassifier8(c["lr"]), batch_size=16)
    history, _ = _on_1_and_2_workers(spec, data, [{"lr": 1e-2}], cluster1, cluster)
    assert (folder / "data.npz").exists()  # prepare_data ran on a worker
    assert history.val_acc.iloc[-1] > 0.5


def test_lightning_boring_datamodule():
    from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel

    data = PartitionedDataset.from_datamodule(BoringDataModule(), 2)
    spec = LightningSpec(lambda config: BoringModel(), batch_size=8)
    history, _ = _train(spec, data, [{}], executor="local")
    assert history.train_loss.notna().all()


# ----------------------------------------------------------------- partitioning
def test_shuffle_seed_mixes_sorted_input_and_is_reproducible():
    X = np.arange(400, dtype=np.float32)[:, None]
    y = (np.arange(400) >= 200).astype(np.int64)  # sorted by label
    contiguous = _load_all(PartitionedDataset.from_arrays(X, y, num_partitions=2, shuffle=False))
    assert [set(_rows(p.train, "y").tolist()) for p in contiguous] == [{0}, {1}]
    # the default: a permutation seeded by the session's seed (0 unless the session says)
    default = _load_all(PartitionedDataset.from_arrays(X, y, num_partitions=2))
    seeded = _load_all(PartitionedDataset.from_arrays(X, y, num_partitions=2, shuffle_seed=0))
    assert all(torch.equal(_rows(p.train), _rows(q.train)) for p, q in zip(default, seeded))
    assert all(0.3 < _rows(p.train, "y").float().mean() < 0.7 for p in default)
    shuffled = _load_all(PartitionedDataset.from_arrays(X, y, num_partitions=2, shuffle_seed=7,
                                                        valid_fraction=0.25))
    again = _load_all(PartitionedDataset.from_arrays(X, y, num_partitions=2, shuffle_seed=7,
                                                     valid_fraction=0.25))
    for p, q in zip(shuffled, again):
        assert torch.equal(_rows(p.train), _rows(q.train)) and torch.equal(_rows(p.valid), _rows(q.valid))
        assert 0.3 < _rows(p.train, "y").float().mean() < 0.7
        assert 0.2 < _rows(p.valid, "y").float().mean() < 0.8  # not the tail of a sorted shard
    every = torch.cat([_rows(p.train) for p in shuffled] + [_rows(p.valid) for p in shuffled])
    assert sorted(every[:, 0].tolist()) == list(range(400))


def test_parquet_and_dask_shuffle_whole_row_groups_and_blocks(tmp_path):
    """Parquet and dask move whole row groups and blocks where each partition gets at least
    MIXED_UNITS (16) of them; fewer are drawn row by row (test_data)."""
    import dask.array as da

    X = np.arange(600, dtype=np.float32)[:, None]
    y = np.arange(600)
    pd.DataFrame({"f": X[:, 0], "label": y}).to_parquet(tmp_path / "a.parquet", row_group_size=10)
    parquet = _load_all(PartitionedDataset.from_parquet(tmp_path / "a.parquet", features=["f"], label="label",
                                                        num_partitions=3, shuffle_seed=1))
    dask = _load_all(PartitionedDataset.from_dask(da.from_array(X, chunks=10), da.from_array(y, chunks=10),
                                                  num_partitions=3, shuffle_seed=1))
    for parts, unit in ((parquet, 10), (dask, 10)):
        labels = [_rows(p.train, "y") for p in parts]
        assert sorted(torch.cat(labels).tolist()) == list(range(600))
        for rows in labels:
            starts = {int(v) // unit for v in rows}
            assert len(rows) == 200 and len(starts) == 200 // unit  # whole units
            assert starts != set(range(min(starts), min(starts) + 200 // unit))  # not contiguous


def test_from_dask_takes_structured_arrays():
    import dask.array as da

    X, y = criteo_arrays(200)
    Xd = {k: da.from_array(v, chunks=64) for k, v in X.items()}
    parts = _load_all(PartitionedDataset.from_dask(Xd, da.from_array(y, chunks=64), num_partitions=2, shuffle=False))
    cat = torch.cat([_rows(p.train)["cat"] for p in parts])
    assert torch.equal(cat, torch.from_numpy(X["cat"]))


def test_from_dask_reads_every_row_of_a_read_parquet_with_columns(tmp_path):
    """dask fuses such a frame's partitions when it counts them (map_partitions(len) gave
    [2000] for 2 files of 1000 rows), and get_partition reads them unfused: half the
    rows were never trained on, without a word."""
    import dask.dataframe as dd

    for part in range(2):
        rows = np.arange(1000 * part, 1000 * (part + 1))
        wide = {f"other{i}": np.zeros(1000) for i in range(12)}  # not read: what makes dask fuse the files
        pd.DataFrame({"a": rows.astype(np.float32), "y": rows % 3, **wide}).to_parquet(tmp_path / f"part{part}.parquet")
    frame = dd.read_parquet(str(tmp_path / "*.parquet"), columns=["a", "y"])
    assert frame.npartitions == 2
    data = PartitionedDataset.from_dask(frame, features=["a"], label="y", num_partitions=2, shuffle=False)
    parts = _load_all(data)
    seen = torch.cat([_rows(p.train) for p in parts]).reshape(-1)
    assert data.num_rows == 2000 and sorted(seen.tolist()) == list(range(2000))


def test_a_dask_frame_with_nulls_fails_its_load_naming_the_column():
    """The DataLoadError's description of the source asked a Delayed for its shape and
    raised dask's TypeError instead, hiding the null."""
    import dask.dataframe as dd

    from cerebro_automl import DataLoadError

    table = pd.DataFrame({"a": np.arange(40, dtype=np.float32), "y": np.arange(40) % 2})
    table.loc[7, "a"] = np.nan
    data = PartitionedDataset.from_dask(dd.from_pandas(table, npartitions=2), features=["a"], label="y",
                                        num_partitions=1)
    with Session(make_spec(model_fn=lambda c: torch.nn.Linear(1, 2)), data, executor="local") as s:
        s.add({"lr": 0.1, "width": 8}, epochs=1)
        with pytest.raises(DataLoadError, match=r"column 'a' holds 1 nulls; fill or drop them before training"):
            s.run()


def test_from_parquet_reads_file_urls_and_unlabeled_groups(tmp_path):
    frame = pd.DataFrame({"a": np.arange(40, dtype=np.int32), "b": np.linspace(0, 1, 40), "flag": np.arange(40) % 2 == 0})
    frame.to_parquet(tmp_path / "x.parquet")
    data = PartitionedDataset.from_parquet([f"file://{tmp_path}/x.parquet"],
                                           features={"ids": "a", "rest": ["b", "flag"]}, label=None,
                                           num_partitions=2)
    x, y = _load_all(data)[0].train.batch(torch.arange(3))
    assert y is None and x["ids"].dtype == torch.int32 and x["ids"].shape == (3,)
    assert x["rest"].dtype == torch.float32 and x["rest"][:, 1].tolist() == [1.0, 0.0, 1.0]


# ------------------------------------------------------------------- disk cache
def test_disk_cache_reads_the_partition_from_files(tmp_path):
    X, y = criteo_arrays(500)
    data = PartitionedDataset.from_arrays(X, y, num_partitions=2, valid_fraction=0.2, shuffle_seed=0,
                                          cache="disk")
    memory = _load_all(PartitionedDataset.from_arrays(X, y, num_partitions=2, valid_fraction=0.2,
                                                      shuffle_seed=0))
    disk = _load_all(data, scratch=str(tmp_path))
    for m, d in zip(memory, disk):
        assert isinstance(d.train, DiskShard) and isinstance(m.train, TensorShard)
        assert torch.equal(_rows(m.train)["cat"], _rows(d.train)["cat"])
        assert torch.equal(_rows(m.valid, "y"), _rows(d.valid, "y"))
        assert d.nbytes < 0.1 * m.nbytes
    assert len(list(tmp_path.iterdir())) == 2
    del disk, d
    import gc
    gc.collect()
    assert not list(tmp_path.iterdir())  # released partitions delete their files


def test_disk_cache_gives_the_bits_of_memory_on_a_cluster(cluster):
    X, y = criteo_arrays(900)
    config = [{"lr": 1e-2, "width": 8}]
    memory = _train(criteo_spec(), PartitionedDataset.from_arrays(X, y, num_partitions=2, valid_fraction=0.2),
                    config, cluster)

    def cache_folders(dask_worker):
        return [name for name in os.listdir(dask_worker.local_directory) if name.startswith("cerebro-cache-")]

    data = PartitionedDataset.from_arrays(X, y, num_partitions=2, valid_fraction=0.2, cache="disk")
    with Session(criteo_spec(), data, seed=5, client=cluster) as s:
        mid = s.add(config[0], epochs=2)
        disk = (s.run(), [s.model(mid).state()["model"]])
        assert all(len(folders) == 1 for folders in cluster.run(cache_folders).values())
    _same_bits(memory, disk)
    assert not any(cluster.run(cache_folders).values())  # closing the session removes the files


def test_a_streaming_loader_fills_the_disk_cache_chunk_by_chunk(tmp_path):
    def load(i):
        for c in range(5):
            rng = np.random.default_rng([i, c])
            yield rng.normal(size=(100, 8)).astype(np.float32), rng.integers(0, 3, 100)

    data = PartitionedDataset.from_loader(load, num_partitions=2, valid_fraction=0.1, cache="disk",
                                          cache_dir=str(tmp_path))
    history, _ = _train(make_spec(), data, [{"lr": 1e-2, "width": 8}], executor="local")
    assert history.val_accuracy.notna().all()
    assert not list(tmp_path.iterdir())  # the session's folder went with it


def test_a_worker_training_from_its_disk_cache_stays_far_below_the_partition_in_memory(cluster1):
    """A 384 MiB partition streams into the disk cache and trains; the worker's RSS,
    sampled every 20 ms, grows by a small fraction of it."""
    sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
    from bench_disk_cache import ROW_BYTES, RssSampler, make_spec as bench_spec, streaming_loader

    warm = PartitionedDataset.from_loader(streaming_loader(2048, chunk_bytes=2**20), 1, cache="disk")
    _train(bench_spec(), warm, [{"lr": 1e-3}], cluster1, epochs=1)  # imports and first builds
    pids = cluster1.run(os.getpid)
    rows = 384 * 2**20 // ROW_BYTES
    data = PartitionedDataset.from_loader(streaming_loader(rows, chunk_bytes=16 * 2**20), 1,
                                          valid_fraction=0.05, cache="disk")
    baseline = max(__import__("psutil").Process(pid).memory_info().rss for pid in pids.values())
    with RssSampler(pids, interval=0.02) as sampler:
        history, _ = _train(bench_spec(), data, [{"lr": 1e-2}], cluster1, epochs=1)
    assert history.val_accuracy.iloc[0] > 0.9
    growth = max(sampler.peak.values()) - baseline
    print(f"worker RSS grew {growth / 2**20:.0f} MiB for a {rows * ROW_BYTES / 2**20:.0f} MiB partition")
    assert growth < 0.25 * rows * ROW_BYTES


@pytest.mark.timeout(240)
def test_a_disk_cached_partition_is_written_again_on_a_survivor_after_a_worker_loss(tmp_path):
    import signal

    from distributed import Client

    from conftest import cli_cluster, cli_env

    X, y = criteo_arrays(1800)
    config = {"lr": 1e-2, "width": 8}

    def data():
        return PartitionedDataset.from_arrays(X, y, num_partitions=2, valid_fraction=0.2, cache="disk")

    reference = _train(criteo_spec(), data(), [config], epochs=3, executor="local")

    def cache_folders(dask_worker):
        root = dask_worker.local_directory
        return sorted(name.split("-")[0] for entry in os.listdir(root) if entry.startswith("cerebro-cache-")
                      for name in os.listdir(os.path.join(root, entry)))

    env = cli_env()
    with cli_cluster(tmp_path, [env, env], ("--no-nanny",)) as address, Client(address) as client:
        client.wait_for_workers(2, timeout=60)
        pids = client.run(os.getpid)
        assert sorted(sum(client.run(cache_folders).values(), [])) == []
        with Session(criteo_spec(), data(), seed=5, client=client) as s:
            mid = s.add(config, epochs=3)
            for report in s.reports():
                if getattr(report, "epoch", 0) == 1 and len(client.scheduler_info()["workers"]) == 2:
                    os.kill(pids[sorted(pids)[1]], signal.SIGKILL)
            survivor = sorted(pids)[0]
            assert list(client.scheduler_info()["workers"]) == [survivor]
            assert client.run(cache_folders)[survivor] == ["p0", "p1"]  # its own and the dead one's
            result = (s.history, [s.model(mid).state()["model"]])
        assert client.run(cache_folders)[survivor] == []
    _same_bits(reference, result)


def test_lightning_modules_take_train_and_eval_transforms():
    X = np.random.default_rng(0).normal(size=(240, 8)).astype(np.float32)
    y = (X[:, 0] > 0).astype(np.int64) + (X[:, 1] > 0).astype(np.int64)
    data = PartitionedDataset.from_arrays(X, y, num_partitions=2, valid_fraction=0.25)
    seen = []

    def eval_transform(x, y):
        seen.append(len(x))
        return x, y

    def spec(**transforms):
        return LightningSpec(lambda c: LitClassifier8(c["lr"]), batch_size=16, **transforms)

    plain = _train(spec(), data, [{"lr": 1e-2}], executor="local")
    augmented = _train(spec(train_transform=noise_augment, eval_transform=eval_transform), data,
                       [{"lr": 1e-2}], executor="local")
    again = _train(spec(train_transform=noise_augment), data, [{"lr": 1e-2}], executor="local")
    assert sum(seen) == 2 * 60  # every validation row, each epoch
    assert not torch.equal(plain[1][0]["net.0.weight"], augmented[1][0]["net.0.weight"])
    assert torch.equal(augmented[1][0]["net.0.weight"], again[1][0]["net.0.weight"])


def test_from_parquet_reads_columns_of_lists_as_hugging_face_writes_token_ids(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    ids = np.arange(40 * 6, dtype=np.int64).reshape(40, 6)
    table = pa.table({"input_ids": pa.array(list(ids)), "attention_mask": pa.array([[1] * 6] * 40, pa.list_(pa.int8())),
                      "special": pa.array([[True, False]] * 40), "label": np.arange(40) % 3})
    pq.write_table(table, tmp_path / "tokens.parquet", row_group_size=10)
    data = PartitionedDataset.from_parquet(tmp_path / "tokens.parquet", label="label", num_partitions=2,
                                           features={"input_ids": "input_ids", "attention_mask": "attention_mask"})
    parts = _load_all(data)
    x = [_rows(p.train) for p in parts]
    assert x[0]["input_ids"].dtype == torch.int64 and x[0]["input_ids"].shape[1:] == (6,)
    assert x[0]["attention_mask"].dtype == torch.int8 and x[0]["attention_mask"].shape[1:] == (6,)
    got = torch.cat([b["input_ids"] for b in x])
    assert sorted(map(tuple, got.tolist())) == sorted(map(tuple, ids.tolist()))  # every row, once, whole
    flags = PartitionedDataset.from_parquet(tmp_path / "tokens.parquet", features={"special": "special"},
                                            label="label", num_partitions=1)
    assert _rows(_load_all(flags)[0].train)["special"].dtype == torch.bool  # lists of booleans too
    bare = PartitionedDataset.from_parquet(tmp_path / "tokens.parquet", features="input_ids", label="label",
                                           num_partitions=1)
    assert _rows(_load_all(bare)[0].train).shape == (40, 6)  # a bare list column is the 2-D leaf itself
    with pytest.raises(TypeError, match=r"column 'input_ids' of .* holds lists .* not with other columns"):
        PartitionedDataset.from_parquet(tmp_path / "tokens.parquet", features=["input_ids", "label"], label="label")
    ragged = pa.table({"input_ids": pa.array([[1, 2], [3]]), "label": [0, 1]})
    pq.write_table(ragged, tmp_path / "ragged.parquet")
    data = PartitionedDataset.from_parquet(tmp_path / "ragged.parquet", features={"input_ids": "input_ids"},
                                           label="label", num_partitions=1)
    with pytest.raises(ValueError, match=r"column 'input_ids' holds lists of 1 to 2 values, but the rows of a "
                                         r"batch must stack: pad them"):
        _load_all(data)


def test_from_parquet_refuses_files_that_give_a_column_two_types(tmp_path):
    """Token ids written as int32 in one file and int64 in another: refused on the driver,
    whichever files the seed puts together."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    for name, kind in (("a", pa.int32()), ("b", pa.int64())):
        table = pa.table({"input_ids": pa.array([[1, 2, 3]] * 8, pa.list_(kind)), "label": np.arange(8) % 2})
        pq.write_table(table, tmp_path / f"{name}.parquet")
    with pytest.raises(TypeError, match=r"column 'input_ids' is list<element: int64> in '.*b.parquet', but "
                                        r"list<element: int32> in '.*a.parquet': every file must give a column one"):
        PartitionedDataset.from_parquet(str(tmp_path / "*.parquet"), features={"input_ids": "input_ids"},
                                        label="label", num_partitions=2)
    # elements that may not be null, as Spark writes them, and a large list: the same int64 ids
    (tmp_path / "a.parquet").unlink()
    strict = pa.list_(pa.field("element", pa.int64(), nullable=False))
    for name, kind in (("c", strict), ("d", pa.large_list(pa.int64()))):
        table = pa.table({"input_ids": pa.array([[1, 2, 3]] * 8, kind), "label": np.arange(8) % 2})
        pq.write_table(table, tmp_path / f"{name}.parquet")
    PartitionedDataset.from_parquet(str(tmp_path / "*.parquet"), features={"input_ids": "input_ids"},
                                    label="label", num_partitions=2)

"""A torch IterableDataset (a stream) in ``from_torch`` and ``from_datamodule``.

Each partition's worker reads the whole stream and keeps the items dealt to it:
blocks of P items, one per partition, in a seeded order, so a class-sorted stream
gives every partition every class; the kept items then go through the map-style
machinery (collate_fn, the three caches, valid_fraction), so a search over a
stream trains to the bits of the same rows given as a map-style Dataset, on 1 and
on 2 Dask workers."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
import torch

from cerebro_automl import PartitionedDataset, Session
from cerebro_automl.data import split_rows

from stream_models import (CONFIGS, Items, Rows, SizedStream, Stream, StreamDataModule, Tracked, Unread, mlp_spec,
                           sorted_rows)


def _sources(data, seed=0):
    return data.resolve(data.num_partitions, seed).sources


def _loads(data, seed=0, scratch=None):
    return [s.load(scratch=scratch) for s in _sources(data, seed)]


def _all(shard):
    return shard.batch(torch.arange(len(shard)))


def _positions(data, seed=0, which="train"):
    """The stream positions each partition holds (cache=None: a DatasetShard read by position)."""
    return [getattr(p, which).indices for p in _loads(data, seed)]


@pytest.fixture(scope="module")
def cluster1():
    from distributed import Client

    from cerebro_automl.executors.dask import start_local_cluster

    with start_local_cluster(1) as local, Client(local) as client:
        yield client


def _train(data, client=None, epochs=2, configs=CONFIGS):
    where = {"client": client} if client is not None else {"executor": "local"}
    with Session(mlp_spec(), data, seed=3, progress=False, **where) as s:
        ids = [s.add(dict(c), epochs=epochs) for c in configs]
        history = s.run()
        assert [s.model(i).error for i in ids] == [None] * len(ids)
        return history, [s.model(i).state()["model"] for i in ids]


def _assert_same_bits(a, b):
    (ha, wa), (hb, wb) = a, b
    for x, y in zip(wa, wb, strict=True):
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
    cols = ["train_loss", "val_loss", "val_accuracy"]
    ha, hb = (h.sort_values(["model_id", "epoch"]).reset_index(drop=True) for h in (ha, hb))
    assert ha[cols].equals(hb[cols])


# ------------------------------------------------------------------- the deal
def test_a_class_sorted_stream_is_dealt_so_every_partition_samples_every_class():
    x, y = sorted_rows(402)
    data = PartitionedDataset.from_torch(partial(Stream, 402), 4)
    parts = _loads(data)
    positions = [p.train.indices for p in parts]
    np.testing.assert_array_equal(np.sort(np.concatenate(positions)), np.arange(402))  # every row once
    sizes = [len(p) for p in positions]
    assert sum(sizes) == 402 and max(sizes) - min(sizes) <= 1
    for part, rows in zip(parts, positions, strict=True):
        assert set(y[rows].tolist()) == {0, 1, 2, 3}
        px, py = _all(part.train)
        assert torch.equal(px, x[rows]) and torch.equal(py, y[rows])  # the stream's own items, in its order
        assert np.array_equal(np.sort(rows[rows < 400] // 4), np.arange(100))  # one item of each full block
    assert not any(np.array_equal(rows, np.arange(i, 402, 4)) for i, rows in enumerate(positions))  # not in turn


def test_the_deal_is_seeded_by_the_data_seed():
    data = PartitionedDataset.from_torch(partial(Stream, 200), 4)
    first = _positions(data, seed=0)
    assert all(np.array_equal(a, b) for a, b in zip(first, _positions(data, seed=0), strict=True))
    assert not all(np.array_equal(a, b) for a, b in zip(first, _positions(data, seed=1), strict=True))
    fixed = PartitionedDataset.from_torch(partial(Stream, 200), 4, shuffle_seed=0)
    assert all(np.array_equal(a, b) for a, b in zip(first, _positions(fixed, seed=7), strict=True))


@pytest.mark.parametrize("cache", [None, "memory", "disk"])
def test_a_partition_collates_only_its_own_items(cache, tmp_path):
    collated = []

    def counting(items):
        collated.append(len(items))
        return torch.utils.data.default_collate(items)

    data = PartitionedDataset.from_torch(partial(Stream, 400), 4, collate_fn=counting, cache=cache)
    part = _sources(data)[1].load(scratch=str(tmp_path))
    _all(part.train)  # read once more: cache=None collates here
    assert sum(collated) == 100  # a quarter of the stream: the other items were skipped as read


@pytest.mark.parametrize("cache", ["memory", "disk"])
def test_a_cache_takes_the_stream_as_it_comes_without_holding_the_share(cache, tmp_path):
    Tracked.alive_at_end.clear()
    data = PartitionedDataset.from_torch(partial(Tracked, 4000), 1, cache=cache)
    part = _sources(data)[0].load(scratch=str(tmp_path))
    assert len(part.train) == 4000 and Tracked.alive_at_end[0] <= 2 * 256  # at most two chunks of items
    Tracked.alive_at_end.clear()
    held = _sources(PartitionedDataset.from_torch(partial(Tracked, 4000), 1))[0].load()
    assert len(held.train) == 4000 and Tracked.alive_at_end == [4000]  # cache=None holds the items


# ------------------------------------------------------------------- training
def test_the_three_caches_hold_and_train_on_the_same_bits(tmp_path):
    def data(cache):
        return PartitionedDataset.from_torch(partial(Stream, 400), 4, valid_fn=partial(Stream, 80, 1), cache=cache,
                                             cache_dir=str(tmp_path))

    rows = {cache: [(_all(p.train), _all(p.valid)) for p in _loads(data(cache), scratch=str(tmp_path))]
            for cache in (None, "memory", "disk")}
    for cache in ("memory", "disk"):
        for (t, v), (t0, v0) in zip(rows[cache], rows[None], strict=True):
            assert all(torch.equal(a, b) for a, b in zip(t + v, t0 + v0, strict=True))
    runs = [_train(data(cache), epochs=1, configs=CONFIGS[:1]) for cache in (None, "memory", "disk")]
    _assert_same_bits(runs[0], runs[1])
    _assert_same_bits(runs[0], runs[2])


def _as_map_style(stream_data, seed):
    """The rows of ``stream_data``'s partitions as a map-style Dataset cut into the same
    partitions (in order, shuffle=False), and its validation shares the same way."""
    train = [_all(p.train) for p in _loads(stream_data, seed)]
    valid = [_all(p.valid) for p in _loads(stream_data, seed)]
    items = [(x[i], int(y[i])) for x, y in train for i in range(len(x))]
    valid_items = [(x[i], int(y[i])) for x, y in valid for i in range(len(x))]
    return PartitionedDataset.from_torch(partial(Rows, items), 4, valid_fn=partial(Rows, valid_items), shuffle=False)


@pytest.mark.cluster
def test_a_search_over_a_stream_is_bitwise_the_map_style_search_on_1_and_2_workers(cluster1, cluster):
    data = PartitionedDataset.from_torch(partial(Stream, 400), 4, valid_fn=partial(Stream, 80, 1))
    two = _train(data, cluster)
    _assert_same_bits(two, _train(data, cluster1))
    _assert_same_bits(two, _train(_as_map_style(data, seed=3), cluster))  # the session's seed deals the rows
    assert two[0].val_accuracy.iloc[-1] > 0.4


def test_a_datamodule_of_streams_is_read_as_from_torch_reads_them():
    data = PartitionedDataset.from_datamodule(StreamDataModule(400, 80), 4)
    assert data.has_validation
    same = PartitionedDataset.from_torch(partial(Stream, 400), 4, valid_fn=partial(Stream, 80, 1))
    for a, b in zip(_loads(data), _loads(same), strict=True):
        assert np.array_equal(a.train.indices, b.train.indices) and np.array_equal(a.valid.indices, b.valid.indices)
    history, _ = _train(data, epochs=1, configs=CONFIGS[:1])
    assert history.val_accuracy.notna().all()


# ------------------------------------------------------------- shuffle=False
def test_shuffle_false_cuts_a_stream_with_len_into_the_map_style_ranges():
    x, y = sorted_rows(400)
    stream = PartitionedDataset.from_torch(partial(SizedStream, 400), 3, shuffle=False, valid_fraction=0.2)
    mapped = PartitionedDataset.from_torch(partial(Rows, list(zip(x, y.tolist(), strict=True))), 3, shuffle=False,
                                           valid_fraction=0.2)
    for a, b in zip(_loads(stream), _loads(mapped), strict=True):
        for shard in ("train", "valid"):
            assert np.array_equal(getattr(a, shard).indices, getattr(b, shard).indices)
            assert all(torch.equal(u, v) for u, v in zip(_all(getattr(a, shard)), _all(getattr(b, shard)), strict=True))
    # partition 0 holds rows 0..132 and holds out round(133 x 0.2) = 27 of them: the last
    assert _loads(stream)[0].valid.indices.tolist() == list(range(106, 133))


def test_shuffle_false_reads_a_stream_up_to_its_range_and_checks_its_len():
    short = _sources(PartitionedDataset.from_torch(partial(SizedStream, 400, length=200), 2, shuffle=False))
    assert short[0].load().train.indices.tolist() == list(range(100))  # read up to 100 only: it cannot tell
    with pytest.raises(ValueError, match=r"partition 1: the SizedStream's len\(\) is 200, but it yielded more than "
                                         r"200 items; shuffle=False cuts the stream into ranges by its len\(\)"):
        short[1].load()
    long = _sources(PartitionedDataset.from_torch(partial(SizedStream, 400, length=500), 4, shuffle=False))
    with pytest.raises(ValueError, match=r"partition 3: the SizedStream's len\(\) is 500, but it yielded only 400"):
        long[3].load()


def test_shuffle_false_refuses_a_stream_without_len_before_reading_it():
    data = PartitionedDataset.from_torch(Unread, 2, shuffle=False)
    with pytest.raises(TypeError, match=r"partition 0: shuffle is False, but the Unread is an IterableDataset "
                                        r"without len\(\): shuffle=False cuts the items into contiguous ranges"):
        _sources(data)[0].load()


# ------------------------------------------------------------------ validation
@pytest.mark.parametrize("train", ["stream", "map-style"])
def test_a_validation_stream_is_dealt_in_turn(train):
    x, y = sorted_rows(400)
    make = partial(Stream, 400) if train == "stream" else partial(Rows, list(zip(x, y.tolist(), strict=True)))
    data = PartitionedDataset.from_torch(make, 4, valid_fn=partial(Stream, 82, 1))
    vx, vy = sorted_rows(82, seed=1)
    for i, part in enumerate(_loads(data)):
        assert part.valid.indices.tolist() == list(range(i, 82, 4))
        got_x, got_y = _all(part.valid)
        assert torch.equal(got_x, vx[i::4]) and torch.equal(got_y, vy[i::4])


@pytest.mark.parametrize("cache", [None, "memory", "disk"])
def test_valid_fraction_holds_out_the_seeded_rows_of_each_share(cache, tmp_path):
    def data(cache):
        return PartitionedDataset.from_torch(partial(Stream, 400), 4, valid_fraction=0.25, cache=cache)

    plain = _loads(PartitionedDataset.from_torch(partial(Stream, 400), 4))
    loaded = _loads(data(cache), scratch=str(tmp_path))
    for i, (part, whole) in enumerate(zip(loaded, plain, strict=True)):
        train_rows, valid_rows = split_rows(100, 0.25, 0, i)  # as a map-style partition of 100 rows
        assert len(part.valid) == 25 and len(part.train) == 75
        assert all(torch.equal(a, b[valid_rows]) for a, b in zip(_all(part.valid), _all(whole.train), strict=True))
        assert all(torch.equal(a, b[train_rows]) for a, b in zip(_all(part.train), _all(whole.train), strict=True))
    again = _loads(data(cache), scratch=str(tmp_path))
    assert all(torch.equal(_all(a.valid)[0], _all(b.valid)[0]) for a, b in zip(loaded, again, strict=True))


def test_a_search_with_valid_fraction_trains():
    data = PartitionedDataset.from_torch(partial(Stream, 400), 4, valid_fraction=0.2, cache="memory")
    history, _ = _train(data, epochs=1, configs=CONFIGS[:1])
    assert history.val_accuracy.notna().all()


# ------------------------------------------------------------------ bad input
def test_a_stream_of_fewer_items_than_partitions_is_refused_in_every_partition():
    data = PartitionedDataset.from_torch(partial(Stream, 3), 4)
    for i, source in enumerate(_sources(data)):  # partitions that got an item refuse too
        with pytest.raises(ValueError, match=rf"partition {i}: the Stream yielded 3 items for 4 partitions, but "
                                             r"each partition needs at least one item: pass num_partitions <= 3, "
                                             r"or a longer stream"):
            source.load()
    with pytest.raises(ValueError, match=r"the Items yielded 0 items for 1 partitions, but each partition needs at "
                                         r"least one item: the stream is empty"):
        _sources(PartitionedDataset.from_torch(partial(Items, []), 1, cache="disk"))[0].load()
    with pytest.raises(ValueError, match=r"num_partitions is 4, but must be <= the 3 items of the stream"):
        _sources(PartitionedDataset.from_torch(partial(SizedStream, 3), 4, shuffle=False))[0].load()


@pytest.mark.parametrize("cache", [None, "memory"])
def test_items_collate_fn_cannot_take_fail_as_map_style_items_do(cache):
    items = [("a", 1)] * 8

    def error(make):
        with pytest.raises(TypeError) as info:
            part = _sources(PartitionedDataset.from_torch(partial(make, items), 1, cache=cache))[0].load()
            _all(part.train)
        return str(info.value)

    assert error(Items) == error(Rows) == "partition 0 x[0] is a str, but must be an array"


def test_what_is_neither_a_dataset_nor_a_stream_is_refused():
    with pytest.raises(TypeError, match=r"dataset_fn\(\) is a list_iterator, but must be a map-style torch Dataset "
                                        r"\(with __len__ and __getitem__\) or a torch IterableDataset"):
        _sources(PartitionedDataset.from_torch(lambda: iter([1, 2]), 1))[0].load()


def test_the_doctests_hold():
    import doctest

    from cerebro_automl.data import streams

    assert doctest.testmod(streams).failed == 0

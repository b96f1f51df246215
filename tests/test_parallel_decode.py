"""Decoding file sources in threads, a few batches ahead (``decode_threads``): a pass's
batches are the bytes of decoding one by one, whatever the number of threads; an error
raised while decoding is the user's error, raised in the pass; no decode thread
outlives its pass; a search on a Dask cluster trains to the same weights with 1 and 4
decode threads."""

from __future__ import annotations

import logging
import random
import threading
import time
from typing import ClassVar

import numpy as np
import pytest
import torch
from file_models import assert_same_runs, cnn_spec, png, train_files, write_folder, write_shards

from cerebro_automl import PartitionedDataset, Session
from cerebro_automl.data.decode import THREAD_NAME, draws_global_rng
from cerebro_automl.data.shards import DatasetShard


def _decode_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(THREAD_NAME)]


def _row_batches(rows: int, batch: int = 7, seed: int = 0) -> list[torch.Tensor]:
    order = torch.randperm(rows, generator=torch.Generator().manual_seed(seed))
    return [order[i : i + batch] for i in range(0, rows, batch)]


def _pass_bytes(shard) -> list[tuple[bytes, bytes]]:
    """A shuffled pass over ``shard``, each batch as the bytes of its x and y."""
    return [(x.numpy().tobytes(), y.numpy().tobytes()) for x, y in shard.read(_row_batches(len(shard)))]


def _partitions(data, parts: int = 2, scratch=None):
    return [s.load(scratch=scratch) for s in data.resolve(parts, 0).sources]


def _folder(tmp_path, per_class=14):
    return write_folder(tmp_path / "train", per_class=per_class, ext="jpg")  # real JPEGs, lossy


class _Recording:
    """A transform that resizes, and notes the threads it ran in (the local executor's
    units run in this process)."""

    threads: ClassVar[list[str]] = []

    def __call__(self, image):
        _Recording.threads.append(threading.current_thread().name.split("_")[0])
        return torch.from_numpy(np.array(image.resize((8, 8)))).permute(2, 0, 1).contiguous()


# ------------------------------------------------------------------------ the bytes
@pytest.mark.parametrize("source", ["folder", "shards"])
def test_a_pass_is_the_same_bytes_for_0_1_and_4_decode_threads(tmp_path, source):
    if source == "folder":
        root = _folder(tmp_path)

        def make(threads):
            return PartitionedDataset.from_image_folder(root, 2, valid_fraction=0.25, decode_threads=threads)
    else:
        paths = write_shards(tmp_path / "shards", shards=4, per_shard=12)

        def make(threads):
            return PartitionedDataset.from_tar_shards(paths, 2, valid_fraction=0.25, decode_threads=threads)

    passes = {}
    for threads in (0, 1, 4):
        passes[threads] = [(_pass_bytes(p.train), _pass_bytes(p.valid)) for p in _partitions(make(threads))]
    assert passes[1] == passes[0] and passes[4] == passes[0]
    assert len(passes[0][0][0]) == 3  # 3 batches of 7 in a partition's 21 training rows
    assert _decode_threads() == []


def test_decode_threads_decode_the_items_and_the_bytes_match(tmp_path):
    root = _folder(tmp_path)
    record = _Recording()
    by_threads = {}
    for threads in (0, 4):
        [part] = _partitions(PartitionedDataset.from_image_folder(root, 1, transform=record, decode_threads=threads), 1)
        _Recording.threads = []
        by_threads[threads] = _pass_bytes(part.train)
        here = threading.current_thread().name
        if threads:  # every item in a decode thread, and the first twice here, to check it draws no global RNG
            assert sorted(set(_Recording.threads)) == sorted({THREAD_NAME, here})
            assert _Recording.threads.count(here) == 2 and _Recording.threads.count(THREAD_NAME) == len(part.train)
        else:
            assert _Recording.threads == [here] * len(part.train)
    assert by_threads[4] == by_threads[0]


@pytest.mark.parametrize("cache", ["memory", "disk"])
def test_a_cache_decoded_in_threads_holds_the_bytes_of_one_by_one(tmp_path, cache):
    root = _folder(tmp_path)
    (tmp_path / "scratch").mkdir()

    def cached(threads):
        data = PartitionedDataset.from_image_folder(root, 2, cache=cache, decode_threads=threads)
        return [_pass_bytes(p.train) for p in _partitions(data, scratch=str(tmp_path / "scratch"))]

    assert cached(4) == cached(0)


def test_a_search_trains_to_the_same_bits_with_0_and_4_decode_threads(tmp_path):
    root = _folder(tmp_path, per_class=10)
    runs = [
        train_files(PartitionedDataset.from_image_folder(root, 2, valid_fraction=0.2, decode_threads=t))
        for t in (0, 4)
    ]
    assert_same_runs(*runs)
    assert _decode_threads() == []


class _SlowItems:
    """A Dataset whose every item takes 2 ms away from Python's lock, as PIL's decode does."""

    def __len__(self):
        return 96

    def __getitem__(self, i):
        time.sleep(0.002)
        return torch.full((3,), i), i


def _timed_pass(threads: int, compute_s: float) -> float:
    from torch.utils.data import default_collate

    shard = DatasetShard(_SlowItems(), np.arange(96), default_collate, "slow items", threads)
    start = time.perf_counter()
    for _batch in shard.read([torch.arange(i, i + 8) for i in range(0, 96, 8)]):
        time.sleep(compute_s)  # the model's step on the batch
    return time.perf_counter() - start


def test_decoding_overlaps_training_and_threads_decode_at_once():
    """12 batches of 8 items: one by one, 192 ms decoding + 192 ms training. One thread
    decoding ahead hides decoding behind training (~200 ms: no read-ahead would take
    ~384 ms); 4 threads decode a pass in about a quarter of the time of one by one."""
    serial, ahead = _timed_pass(0, 0.016), _timed_pass(1, 0.016)
    assert ahead < 0.7 * serial, (serial, ahead)
    one_by_one, four = _timed_pass(0, 0.0), _timed_pass(4, 0.0)
    assert four < 0.6 * one_by_one, (one_by_one, four)


# ------------------------------------------------------- global random number generators
def _noisy(image):
    """A transform that draws from torch's global generator: threads would race for it."""
    x = torch.from_numpy(np.array(image)).permute(2, 0, 1).float()
    return (x + torch.rand(x.shape) * 8).to(torch.uint8)


def test_an_item_drawing_from_a_global_rng_is_decoded_one_by_one_with_the_same_bytes(tmp_path, caplog):
    root = _folder(tmp_path)
    passes = []
    for threads in (0, 4):
        [part] = _partitions(PartitionedDataset.from_image_folder(root, 1, transform=_noisy, decode_threads=threads), 1)
        torch.manual_seed(3)
        with caplog.at_level(logging.WARNING, logger="cerebro_automl"):
            passes.append(_pass_bytes(part.train))
        assert torch.initial_seed() == 3
    assert passes[1] == passes[0]
    assert "draws from a global random number generator" in caplog.text and "decode_threads=4" in caplog.text


@pytest.mark.parametrize(
    "draw, draws",
    [
        (lambda: torch.rand(2), True),
        (lambda: np.random.rand(2), True),
        (random.random, True),
        (lambda: torch.rand(2, generator=torch.Generator().manual_seed(0)), False),
        (lambda: np.random.default_rng(0).random(2), False),
        (lambda: torch.ones(2) * 3, False),
    ],
)
def test_draws_global_rng_finds_each_global_generator_and_puts_its_state_back(draw, draws):
    before = torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate()
    assert draws_global_rng(draw) is draws
    assert torch.equal(torch.get_rng_state(), before[0])
    assert np.array_equal(np.random.get_state()[1], before[1]) and random.getstate() == before[2]


def test_another_thread_drawing_from_python_random_is_not_the_items_draw():
    """Dask's own threads draw from Python's random at any time: an item that does not
    use it is not flagged while another thread draws (it was, now and then)."""
    import threading

    stop = threading.Event()

    def dask_like():
        while not stop.is_set():
            random.random()

    other = threading.Thread(target=dask_like)
    other.start()
    try:
        assert not any(draws_global_rng(lambda: torch.ones(64) * 3) for _ in range(200))
        assert draws_global_rng(lambda: torch.tensor([random.random() < 0.5 for _ in range(64)]))
    finally:
        stop.set()
        other.join()


# ---------------------------------------------------------------- errors and threads
class UnreadableItem(ValueError):
    pass


def _refuse_small(image):
    """A user's transform that fails on one image (the 5x5 one)."""
    if image.size == (5, 5):
        raise UnreadableItem(f"image of size {image.size} refused")
    return torch.from_numpy(np.array(image.resize((12, 12)))).permute(2, 0, 1).contiguous()


def _with_small_image(tmp_path):
    root = write_folder(tmp_path / "train", per_class=10)
    small = np.full((5, 5, 3), 200, np.uint8)
    (root / "moose" / "999.png").write_bytes(png(small))
    return root


@pytest.mark.timeout(60)
def test_an_error_in_a_decode_thread_is_the_users_error_raised_in_the_pass(tmp_path):
    root = _with_small_image(tmp_path)
    data = PartitionedDataset.from_image_folder(root, 1, transform=_refuse_small, decode_threads=4)
    [part] = _partitions(data, 1)
    with pytest.raises(UnreadableItem, match=r"image of size \(5, 5\) refused"):
        list(part.train.read(_row_batches(len(part.train))))
    assert _decode_threads() == []


@pytest.mark.timeout(60)
def test_a_corrupt_jpeg_fails_the_pass_naming_the_file(tmp_path):
    root = _folder(tmp_path)
    (root / "ant" / "005.jpg").write_bytes(b"\xff\xd8 not a jpeg")
    [part] = _partitions(PartitionedDataset.from_image_folder(root, 1, decode_threads=4), 1)
    with pytest.raises(OSError, match=r"cannot decode .*005\.jpg"):
        list(part.train.read(_row_batches(len(part.train))))
    assert _decode_threads() == []


@pytest.mark.timeout(120)
def test_a_model_whose_item_fails_to_decode_fails_with_the_users_error_and_leaves_no_thread(tmp_path):
    root = _with_small_image(tmp_path)
    data = PartitionedDataset.from_image_folder(root, 2, valid_fraction=0.2, transform=_refuse_small,
                                                decode_threads=4)
    with Session(cnn_spec(), data, seed=0, executor="local", progress=False) as s:
        i = s.add({"lr": 1e-2, "width": 4}, epochs=1)
        s.run()
        assert "UnreadableItem" in s.model(i).error and "(5, 5) refused" in s.model(i).error
    assert _decode_threads() == []


def _loss_failing_on_third_call(kept: list):
    """A loss that fails on its third batch, and keeps its error (as an error tracker
    would): the error's traceback holds the training loop's frames."""
    calls = []

    def loss(out, y):
        calls.append(1)
        if len(calls) == 3:
            err = RuntimeError("the loss failed on purpose")
            kept.append(err)
            raise err
        return torch.nn.functional.cross_entropy(out, y)

    return loss


@pytest.mark.timeout(120)
def test_a_pass_left_by_an_error_in_training_stops_its_decode_threads_at_once(tmp_path):
    import dataclasses

    root = _folder(tmp_path, per_class=20)
    data = PartitionedDataset.from_image_folder(root, 1, valid_fraction=0.2, decode_threads=4)
    kept: list = []
    spec = dataclasses.replace(cnn_spec(), loss_fn=_loss_failing_on_third_call(kept))
    with Session(spec, data, seed=0, executor="local", progress=False) as s:
        i = s.add({"lr": 1e-2, "width": 4}, epochs=1)
        s.run()
        assert "the loss failed on purpose" in s.model(i).error
        assert kept and _decode_threads() == []  # the pass closed its reader; its frames still live


def test_a_pass_closed_early_stops_its_decode_threads(tmp_path):
    [part] = _partitions(PartitionedDataset.from_image_folder(_folder(tmp_path), 1, decode_threads=3), 1)
    read = part.train.read(_row_batches(len(part.train), batch=4))
    next(read)
    assert len(_decode_threads()) == 3
    read.close()
    assert _decode_threads() == []


# ------------------------------------------------------------------------ the option
@pytest.mark.parametrize(
    "value, error, message",
    [
        (-1, ValueError, r"decode_threads is -1, but must be an int in \[0, 256\]"),
        (257, ValueError, r"decode_threads is 257, but must be an int in \[0, 256\]"),
        (1.5, TypeError, r"decode_threads is 1.5, but must be an int"),
        (True, TypeError, r"decode_threads is True, but must be an int"),
        ("4", TypeError, r"decode_threads is '4', but must be an int"),
    ],
)
def test_a_bad_decode_threads_is_refused_naming_the_value_and_the_rule(tmp_path, value, error, message):
    root = write_folder(tmp_path / "train", per_class=2)
    paths = write_shards(tmp_path / "shards", shards=2, per_shard=2)
    with pytest.raises(error, match=message):
        PartitionedDataset.from_image_folder(root, 2, decode_threads=value)
    with pytest.raises(error, match=message):
        PartitionedDataset.from_tar_shards(paths, 2, decode_threads=value)


# ----------------------------------------------------------------------------- Dask
@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_a_search_on_a_dask_cluster_trains_to_the_same_weights_with_1_and_4_decode_threads(tmp_path, cluster):
    root = _folder(tmp_path, per_class=12)
    configs = ({"lr": 1e-2, "width": 4}, {"lr": 3e-3, "width": 6}, {"lr": 1e-3, "width": 4})
    runs = [
        train_files(PartitionedDataset.from_image_folder(root, 2, valid_fraction=0.25, decode_threads=t),
               client=cluster, configs=configs)
        for t in (1, 4)
    ]  # fmt: skip
    assert_same_runs(*runs)
    left = cluster.run(_decode_threads)  # each worker ran many units, each pass with its own threads
    assert left and all(names == [] for names in left.values())


def test_the_doctests_hold():
    import doctest

    import cerebro_automl.data.decode as decode
    import cerebro_automl.data.options as options
    import cerebro_automl.data.shards as shards

    for module in (decode, options, shards):
        assert doctest.testmod(module).failed == 0, module.__name__

"""Seeded per-item random transforms of file sources (``random_transform=``): a random
crop of each original JPEG, drawn from a generator seeded from (model seed, epoch,
item), so crops change every epoch and from item to item, the bytes do not depend on
decode threads, caches or executors, a run repeats bit for bit, and validation items
are never randomly transformed."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch
from file_models import (assert_same_runs, center_crop, cnn_spec, normalise, random_crop, train_files,
                         write_originals, write_shards)

from cerebro_automl import PartitionedDataset, Session
from cerebro_automl.data.decode import draws_global_rng
from cerebro_automl.data.shards import item_generator
from cerebro_automl.training.seeding import item_seed


def _folder(root, **kwargs):
    kwargs = {"transform": center_crop, "random_transform": random_crop, **kwargs}
    return PartitionedDataset.from_image_folder(root, 2, **kwargs)


def _parts(data, scratch=None):
    resolved = data.resolve(data.num_partitions, 0)
    return [s.load(scratch=scratch) for s in resolved.sources]


def _read(shard, seed, batch=5):
    """Every row of a training pass's shard (seeded with ``seed``), in shuffled batches."""
    order = torch.randperm(len(shard), generator=torch.Generator().manual_seed(1))
    rows = [order[i : i + batch] for i in range(0, len(shard), batch)]
    batches = list(shard.with_item_seed(seed).read(rows))
    x = torch.cat([x for x, _ in batches])
    return x[torch.argsort(torch.cat(rows))]  # back in row order


def _opened(root, path):
    from PIL import Image

    with Image.open(os.path.join(root, path)) as im:
        return im.convert("RGB")


def test_each_item_is_cropped_from_its_own_generator_anew_every_epoch(tmp_path):
    root = write_originals(tmp_path / "train", per_class=6, same=True)  # one image: only the crops differ
    part = _parts(_folder(root, decode_threads=0))[0]
    seeds = [item_seed(11, epoch) for epoch in (0, 1)]
    first, again, second = _read(part.train, seeds[0]), _read(part.train, seeds[0]), _read(part.train, seeds[1])
    assert torch.equal(first, again)  # the same pass: the same bits
    assert not torch.equal(first, second)  # the next epoch: new crops
    assert len({x.numpy().tobytes() for x in first}) == len(first)  # every item its own crop
    files = part.train.dataset
    for row, gid in enumerate(part.train.indices.tolist()):  # drawn from (model seed, epoch, item)
        expected = random_crop(_opened(root, files.paths[row]), item_generator(seeds[0], gid))
        assert torch.equal(first[row], expected)


def _deterministic(shard):
    """Each row of ``shard`` as the centre crop of its file."""
    files = shard.dataset
    return torch.stack([center_crop(_opened(files.root, files.paths[files._place(g)])) for g in shard.indices])


def test_validation_items_and_unseeded_reads_take_the_deterministic_transform(tmp_path):
    root = write_originals(tmp_path / "train", per_class=6)
    valid = write_originals(tmp_path / "valid", per_class=2, seed=1)
    for data in (_folder(root, valid_fraction=0.25), _folder(root, valid=valid)):
        for part in _parts(data):
            assert part.valid.with_item_seed(5) is part.valid  # a validation shard never draws
            assert torch.equal(_read(part.valid, item_seed(3, 0)), _deterministic(part.valid))
            x, _ = part.train.batch(torch.arange(len(part.train)))  # no pass seed: the deterministic form
            assert torch.equal(x, _deterministic(part.train))
            assert not torch.equal(_read(part.train, item_seed(3, 0)), x)


def _by_item(shard, seed):
    return dict(zip(shard.indices.tolist(), _read(shard, seed), strict=True))


@pytest.mark.parametrize("cache", [None, "memory", "disk"])
def test_crops_are_the_same_bytes_for_any_decode_threads_and_cache(tmp_path, cache):
    root = write_originals(tmp_path / "train", per_class=10)
    (tmp_path / "scratch").mkdir()
    seed = item_seed(2, 1)
    reference = {g: x for p in _parts(_folder(root, decode_threads=0)) for g, x in _by_item(p.train, seed).items()}
    for threads in (0, 1, 4):
        data = _folder(root, decode_threads=threads, cache=cache, valid_fraction=0.2)
        for part in _parts(data, scratch=str(tmp_path / "scratch")):
            got = _by_item(part.train, seed)
            assert len(got) == len(part.train) and all(torch.equal(x, reference[g]) for g, x in got.items())
            assert not draws_global_rng(lambda p=part: p.train.with_item_seed(9).batch(torch.arange(3)))


@pytest.mark.parametrize("cache", ["memory", "disk"])
def test_a_cache_keeps_the_files_bytes_not_decoded_pixels(tmp_path, cache):
    root = write_originals(tmp_path / "train", per_class=6)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    parts = _parts(_folder(root, cache=cache), scratch=str(scratch))
    sizes = [sum(os.path.getsize(root / p) for p in part.train.dataset.paths) for part in parts]
    if cache == "memory":
        assert [part.nbytes for part in parts] == sizes
    else:
        stored = sorted(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(scratch) for f in fs)
        assert stored == sorted(sizes) and [part.nbytes for part in parts] == [0, 0]
    os.rename(root, tmp_path / "moved")  # read from the cache, not the files
    assert len(_read(parts[0].train, 7)) == len(parts[0].train)


WIDTHS = [{"lr": 1e-2, "width": 3}, {"lr": 1e-2, "width": 4}]
# One structure, fusable: 2 groups of 2 (a group per partition at least).
LRS = [{"lr": lr, "width": 4} for lr in (1e-2, 2e-2, 3e-2, 4e-2)]


def _train(data, client=None, epochs=2, fuse=None, configs=WIDTHS):
    return train_files(data, client, epochs, configs, **({} if fuse is None else {"fuse": fuse}))


def _weights_differ(a, b):
    return any(not torch.equal(x[k], y[k]) for x, y in zip(a[1], b[1], strict=True) for k in x)


def test_a_session_with_random_crops_repeats_bit_for_bit(tmp_path):
    root = write_originals(tmp_path / "train", per_class=8)
    data = _folder(root, valid_fraction=0.25, decode_threads=2)
    first = _train(data)
    assert_same_runs(first, _train(_folder(root, valid_fraction=0.25, decode_threads=0)))
    # The crops reach training: the same run with the centre crop trains to other weights.
    plain = PartitionedDataset.from_image_folder(root, 2, valid_fraction=0.25, transform=center_crop)
    assert _weights_differ(first, _train(plain))


def test_fused_models_draw_the_crops_of_their_group(tmp_path):
    """A fused group reads one stream of batches, seeded from the group's seed: its crops too."""
    root = write_originals(tmp_path / "train", per_class=8)
    first = _train(_folder(root, valid_fraction=0.25), fuse=2, configs=LRS)
    assert_same_runs(first, _train(_folder(root, valid_fraction=0.25, decode_threads=3), fuse=2, configs=LRS))
    plain = PartitionedDataset.from_image_folder(root, 2, valid_fraction=0.25, transform=center_crop)
    assert _weights_differ(first, _train(plain, fuse=2, configs=LRS))


def test_every_epoch_of_a_session_trains_on_new_crops(tmp_path):
    """What the model sees: the rows its train_transform is given, one partition, two epochs."""
    seen: list[bytes] = []

    def recording(x, y, generator):
        seen.extend(row.numpy().tobytes() for row in x)
        return normalise(x, y)

    root = write_originals(tmp_path / "train", per_class=4)
    data = PartitionedDataset.from_image_folder(root, 1, transform=center_crop, random_transform=random_crop,
                                                valid_fraction=0.25)
    with Session(replace(cnn_spec(), train_transform=recording), data, seed=4, executor="local") as s:
        s.add({"lr": 1e-2, "width": 3}, epochs=2)
        s.run()
    assert len(seen) == 18  # 9 training rows a pass
    assert sorted(seen[:9]) != sorted(seen[9:])  # the same rows, cropped anew


def test_tar_shards_take_a_random_transform_too(tmp_path):
    paths = write_shards(tmp_path / "shards", shards=4, per_shard=6)
    data = PartitionedDataset.from_tar_shards(paths, 2, transform=center_crop, random_transform=random_crop,
                                              valid_fraction=0.2, cache="memory")
    part = _parts(data)[0]
    a, b = _read(part.train, item_seed(1, 0)), _read(part.train, item_seed(1, 1))
    assert a.shape[1:] == (3, 8, 8) and not torch.equal(a, b)
    x, _ = part.valid.with_item_seed(item_seed(1, 0)).batch(torch.arange(len(part.valid)))
    y, _ = part.valid.batch(torch.arange(len(part.valid)))
    assert torch.equal(x, y)


def _one_argument(image):
    return center_crop(image)


BAD = {
    "not callable": (lambda root: _folder(root, random_transform=3), TypeError,
                     r"random_transform is 3, but it must take \(PIL image, torch.Generator\) and draw its "
                     r"randomness from that generator"),
    "one argument": (lambda root: _folder(root, random_transform=_one_argument), TypeError,
                     r"random_transform is <function _one_argument .*>, which cannot be called with two arguments "
                     r".*: it must take \(PIL image, torch.Generator\)"),
    "with decode": (lambda root: PartitionedDataset.from_tar_shards("x.tar", 1, decode=bytes,
                                                                     random_transform=random_crop),
                    ValueError, r"give decode or random_transform, not both"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_random_transform_is_refused_naming_the_value_and_the_rule(tmp_path, case):
    make, error, message = BAD[case]
    root = write_originals(tmp_path / "train", per_class=2)
    with pytest.raises(error, match=message):
        make(root)


@pytest.mark.cluster
def test_random_crops_train_to_the_same_bits_on_local_and_dask(tmp_path, cluster):
    root = write_originals(tmp_path / "train", per_class=8)
    data = _folder(root, valid_fraction=0.25)
    assert_same_runs(_train(data), _train(data, client=cluster))


def test_the_doctests_hold():
    import doctest

    import cerebro_automl.data.encoded as encoded
    import cerebro_automl.data.file_items as file_items
    import cerebro_automl.data.files as files
    import cerebro_automl.data.shards as shards

    for module in (encoded, file_items, files, shards):
        assert doctest.testmod(module).failed == 0, module.__name__

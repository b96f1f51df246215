"""Data from files: image folders (``from_image_folder``) and WebDataset-style tar shards
(``from_tar_shards``), written here with PIL and tarfile.

Labels follow torchvision's class_to_idx; every file or sample lands in exactly one
partition; the seeded partitioning is stable for a seed; bad input is refused on the
driver; a tiny CNN trains on the local and the Dask executor to the same bits."""

from __future__ import annotations

import gzip
import os
import pickle
import shutil

import numpy as np
import pytest
import torch
from file_models import assert_same_runs, image, png, train_files, write_folder, write_shards

from cerebro_automl import PartitionedDataset
from cerebro_automl.data.errors import DataError


def _loads(data, parts=None, seed=0, scratch=None):
    data = data.resolve(parts or data.num_partitions or 2, seed)
    return data, [s.load(scratch=scratch) for s in data.sources]


def _all(shard):
    return shard.batch(torch.arange(len(shard)))


# ------------------------------------------------------------------ image folder
def test_image_folder_labels_follow_class_to_idx_and_every_file_is_in_one_partition(tmp_path):
    from PIL import Image

    root = write_folder(tmp_path / "train", per_class=7)
    (root / "moose" / "nested").mkdir()
    Image.fromarray(image(1, np.random.default_rng(9))).save(root / "moose" / "nested" / "deep.PNG")
    (root / "ant" / "notes.txt").write_text("not an image")
    data = PartitionedDataset.from_image_folder(root, 3)
    assert data.classes == ("ant", "moose", "zebra") and data.class_to_idx == {"ant": 0, "moose": 1, "zebra": 2}
    assert data.num_rows == 22
    resolved, parts = _loads(data, seed=1)
    seen = []
    for source, part in zip(resolved.sources, parts, strict=True):
        x, y = _all(part.train)
        assert x.dtype == torch.uint8 and x.shape[1:] == (3, 12, 12) and y.dtype == torch.int64
        files = source.train
        for row, gid in enumerate(part.train.indices.tolist()):
            path = files.paths[files._place(gid)]
            assert data.class_to_idx[path.split(os.sep)[0]] == int(y[row])
            with Image.open(root / path) as im:  # the decoded pixels are the file's
                assert torch.equal(x[row], torch.from_numpy(np.array(im.convert("RGB"))).permute(2, 0, 1))
            seen.append(path)
        assert set(y.tolist()) == {0, 1, 2}  # a seeded sample of a class-sorted folder mixes the classes
    assert sorted(seen) == sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root)
                                  for f in fs if not f.endswith(".txt"))
    assert len(seen) == len(set(seen))


def _partition_paths(data, seed):
    resolved = data.resolve(3, seed)
    return [list(s.train.paths) for s in resolved.sources]


def test_image_folder_partitioning_is_seeded(tmp_path):
    root = write_folder(tmp_path / "train", per_class=10)
    data = PartitionedDataset.from_image_folder(root, 3)
    assert _partition_paths(data, 0) == _partition_paths(data, 0)
    assert _partition_paths(data, 0) != _partition_paths(data, 1)
    fixed = PartitionedDataset.from_image_folder(root, 3, shuffle_seed=5)
    assert _partition_paths(fixed, 0) == _partition_paths(fixed, 1)
    ordered = _partition_paths(PartitionedDataset.from_image_folder(root, 3, shuffle=False), 0)
    assert [{p.split(os.sep)[0] for p in paths} for paths in ordered] == [{"ant"}, {"moose"}, {"zebra"}]


def test_image_folder_validation_folder_and_transform(tmp_path):
    root = write_folder(tmp_path / "train", per_class=6)
    valid = write_folder(tmp_path / "valid", per_class=2, classes=("zebra", "ant"), seed=1)
    data = PartitionedDataset.from_image_folder(root, 2, valid=valid,
                                                transform=lambda im: torch.tensor(np.array(im.resize((4, 4)))))
    _, parts = _loads(data)
    assert sum(len(p.valid) for p in parts) == 4
    xv, yv = _all(parts[0].valid)
    assert xv.shape[1:] == (4, 4, 3) and set(yv.tolist()) <= {0, 2}  # the training folder's indices


@pytest.mark.parametrize("cache", ["memory", "disk"])
def test_image_folder_cached_gives_the_bits_of_decoding_every_batch(tmp_path, cache):
    root = write_folder(tmp_path / "train", per_class=16)

    def data(cache):
        return PartitionedDataset.from_image_folder(root, 2, valid_fraction=0.25, cache=cache,
                                                    cache_dir=str(tmp_path / "scratch"))

    (tmp_path / "scratch").mkdir()
    assert_same_runs(train_files(data(None)), train_files(data(cache)))


def test_a_transform_that_returns_the_pil_image_is_named(tmp_path):
    root = write_folder(tmp_path / "train", per_class=2)
    _, parts = _loads(PartitionedDataset.from_image_folder(root, 1, transform=lambda im: im.resize((4, 4))))
    with pytest.raises(TypeError, match=r"transform= or random_transform=\) returned a PIL image, but must return"):
        parts[0].train.batch(torch.arange(2))


def test_images_of_different_sizes_are_refused_at_the_batch_naming_the_shapes(tmp_path):
    from PIL import Image

    root = write_folder(tmp_path / "train", per_class=3)
    Image.fromarray(image(0, np.random.default_rng(0), size=20)).save(root / "ant" / "big.png")
    _, parts = _loads(PartitionedDataset.from_image_folder(root, 1))
    with pytest.raises(ValueError, match=r"different shapes, \[3, 12, 12\] and \[3, 20, 20\].*pass transform="):
        _all(parts[0].train)


# -------------------------------------------------------------------- tar shards
@pytest.mark.parametrize("label", ["cls", "txt", "json"])
def test_tar_shards_group_members_by_key_and_read_the_label(tmp_path, label):
    paths = write_shards(tmp_path / "shards", shards=5, per_shard=6, label=label)
    data = PartitionedDataset.from_tar_shards(str(tmp_path / "shards" / "train-*.tar"), 2, label=label)
    resolved, parts = _loads(data, seed=3)
    keys = []
    for source, part in zip(resolved.sources, parts, strict=True):
        x, y = _all(part.train)
        assert x.shape[1:] == (3, 12, 12)
        # the labels are those written: the brighter channel
        assert torch.equal(y, x.float().mean((2, 3)).argmax(1))
        keys += list(source.train.keys)
        assert set(source.train.shards) <= set(paths)  # a source carries only its own shards
    assert sorted(keys) == [f"{k:03d}{n:04d}" for k in range(5) for n in range(6)]  # every sample, once


def test_tar_shard_samples_are_assigned_by_a_seeded_permutation(tmp_path):
    write_shards(tmp_path / "shards", shards=8, per_shard=2)
    data = PartitionedDataset.from_tar_shards(str(tmp_path / "shards" / "*.tar"), 4)

    def keys(seed):
        return [sorted(s.train.keys) for s in data.resolve(4, seed).sources]

    assert keys(0) == keys(0) and keys(0) != keys(1)
    assert [len(k) for k in keys(0)] == [4, 4, 4, 4]
    ordered = PartitionedDataset.from_tar_shards(str(tmp_path / "shards" / "*.tar"), 4, shuffle=False)
    first = ordered.resolve(4).sources[0]  # a contiguous range, in shard order
    assert list(first.train.keys) == ["0000000", "0000001", "0010000", "0010001"]
    assert sorted(os.path.basename(p) for p in first.train.shards) == ["train-000.tar", "train-001.tar"]


def test_shards_written_class_by_class_give_every_partition_every_class(tmp_path):
    write_shards(tmp_path / "shards", shards=6, per_shard=8, by_class=True)  # shard k: class k % 3 only
    data = PartitionedDataset.from_tar_shards(str(tmp_path / "shards" / "*.tar"), 3)
    _, parts = _loads(data, seed=0)
    assert all(set(_all(part.train)[1].tolist()) == {0, 1, 2} for part in parts)
    ordered = PartitionedDataset.from_tar_shards(str(tmp_path / "shards" / "*.tar"), 3, shuffle=False)
    _, parts = _loads(ordered, seed=0)
    assert [len(set(_all(part.train)[1].tolist())) for part in parts] == [2, 2, 2]  # as given: two shards each


@pytest.mark.parametrize("source", ["folder", "tar"])
def test_files_read_on_every_batch_that_changed_since_a_checkpoint_are_told_apart(tmp_path, source):
    """Without a cache a partition's fingerprint cannot digest decoded items (a transform may
    draw at random); it digests the bytes of a sample of its files instead."""
    from cerebro_automl.data.fingerprint import differences, partition_fingerprint

    def fingerprints(seed, copy):
        root = tmp_path / f"data-{seed}-{copy}"
        if source == "folder":
            write_folder(root / "train", per_class=6, seed=seed)
            data = PartitionedDataset.from_image_folder(str(root / "train"), 2, valid_fraction=0.25)
        else:
            write_shards(root / "shards", shards=2, per_shard=12, seed=seed)
            data = PartitionedDataset.from_tar_shards(str(root / "shards" / "*.tar"), 2, valid_fraction=0.25)
        _, parts = _loads(data, seed=0)
        return [partition_fingerprint(p.train, p.valid) for p in parts]

    same, again, changed = fingerprints(0, 0), fingerprints(0, 1), fingerprints(1, 0)  # changed: other pixels
    assert differences(same, again) == []
    found = differences(same, changed)
    assert found and all("files differ (a digest of the bytes of" in f for f in found), found


def test_a_folder_under_home_is_found_as_torchvision_finds_it(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    write_folder(tmp_path / "train", per_class=2)
    assert PartitionedDataset.from_image_folder("~/train", 1).num_rows == 2 * 3


def test_tar_sources_are_cheap_to_send(tmp_path):
    write_shards(tmp_path / "shards", shards=4, per_shard=50)
    data = PartitionedDataset.from_tar_shards(str(tmp_path / "shards" / "*.tar"), 4).resolve(4)
    sent = pickle.dumps(data.sources[0])
    assert len(sent) < 8000  # offsets of its 50 samples, no image bytes, no open file
    assert pickle.loads(sent).load().train.batch(torch.arange(2))[0].shape == (2, 3, 12, 12)


def test_tar_shards_train_and_cache_to_the_same_bits(tmp_path):
    write_shards(tmp_path / "shards", shards=4, per_shard=16)
    write_shards(tmp_path / "shards", shards=2, per_shard=8, seed=1, prefix="valid")

    def data(cache):
        return PartitionedDataset.from_tar_shards(str(tmp_path / "shards" / "train-*.tar"), 2, cache=cache,
                                                  valid=str(tmp_path / "shards" / "valid-*.tar"))

    plain = train_files(data(None))
    assert plain[0].val_accuracy.notna().all()
    assert_same_runs(plain, train_files(data("memory")))


# --------------------------------------------------------------------- bad input
def _empty_class(tmp):
    root = write_folder(tmp / "train", per_class=2)
    (root / "yak").mkdir()
    return PartitionedDataset.from_image_folder(root, 2)


def _no_images(tmp):
    (tmp / "flat").mkdir()
    (tmp / "flat" / "a.png").write_bytes(png(image(0, np.random.default_rng(0))))
    return PartitionedDataset.from_image_folder(tmp / "flat", 1)


def _unknown_valid_class(tmp):
    root = write_folder(tmp / "train", per_class=2)
    return PartitionedDataset.from_image_folder(root, 1, valid=write_folder(tmp / "v", 1, ("ant", "yak")))


def _few_samples(tmp):
    write_shards(tmp / "s", shards=3, per_shard=2)
    return PartitionedDataset.from_tar_shards(str(tmp / "s" / "*.tar"), 7)


def _missing_label(tmp):
    write_shards(tmp / "s", shards=2, per_shard=3, drop_label=(1, 2))
    return PartitionedDataset.from_tar_shards(str(tmp / "s" / "*.tar"), 2)


def _gzipped(tmp):
    [path] = write_shards(tmp / "s", shards=1, per_shard=2)
    with open(path, "rb") as f, gzip.open(path + ".gz", "wb") as g:
        shutil.copyfileobj(f, g)
    return PartitionedDataset.from_tar_shards(path + ".gz", 1)


def _word_label(tmp, label=b"cat"):
    import io
    import tarfile

    (tmp / "s").mkdir()
    with tarfile.open(tmp / "s" / "a.tar", "w") as tar:
        for name, data in (("x1.png", png(image(0, np.random.default_rng(0)))), ("x1.cls", label)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return _loads(PartitionedDataset.from_tar_shards(str(tmp / "s" / "a.tar"), 1))


BAD = {
    "missing root": (lambda tmp: PartitionedDataset.from_image_folder(tmp / "nope", 2),
                     ValueError, r"root is '.*nope', which is not a folder"),
    "empty class folder": (_empty_class, ValueError,
                           r"class folder '.*yak' holds no image file .*every class folder needs at least one"),
    "no class folders": (_no_images, ValueError, r"root '.*flat' has no subfolders, but an image folder holds one"),
    "validation class unknown": (_unknown_valid_class, ValueError,
                                 r"valid '.*v' has class folders \['yak'\] that the training folder does not"),
    "more partitions than images": (
        lambda tmp: PartitionedDataset.from_image_folder(write_folder(tmp / "t", 1), 4),
        ValueError, r"num_partitions is 4, but must be <= the 3 training rows"),
    "more partitions than samples": (_few_samples, ValueError, r"num_partitions is 7, but must be <= the 6 training rows"),
    "sample without its label": (_missing_label, ValueError,
                                 r"sample '0010002' of '.*train-001.tar' has members \['png'\], but no .cls member; "
                                 r"label='cls' reads"),
    "no shard matches": (lambda tmp: PartitionedDataset.from_tar_shards(str(tmp / "*.tar"), 1),
                         ValueError, r"paths '.*\*.tar' matches no file"),
    "compressed shard": (_gzipped, ValueError, r"is not an uncompressed tar file .* not .tar.gz"),
    "label not an integer": (_word_label, DataError,  # the same on every try: the load is not tried again
                             r"sample 'x1' of '.*a.tar': its .cls member holds 'cat', but a label must be a class "
                             r"index, an integer >= 0"),
    "label negative": (lambda tmp: _word_label(tmp, b"-1"), DataError, r"its .cls member holds '-1', but a label"),
    "a URL as the folder": (lambda tmp: PartitionedDataset.from_image_folder("file:///data/train", 1), ValueError,
                            r"root is 'file:///data/train', a URL, but image folders and tar shards are read from"),
    "a URL as a shard": (lambda tmp: PartitionedDataset.from_tar_shards(["s3://bucket/a.tar"], 1), ValueError,
                         r"is 's3://bucket/a.tar', a URL"),
    "unknown label member": (lambda tmp: PartitionedDataset.from_tar_shards("x.tar", 1, label="npy"),
                             ValueError, r"label is 'npy', but must be one of \('cls', 'txt', 'json'\)"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_file_input_is_refused_naming_the_value_and_the_rule(tmp_path, case):
    make, error, message = BAD[case]
    with pytest.raises(error, match=message):
        make(tmp_path)


# --------------------------------------------------------------------------- Dask
@pytest.mark.cluster
def test_file_sources_train_to_the_same_bits_on_local_and_dask(tmp_path, cluster):
    """Each Dask worker decodes its own partitions' files (the sources are pickled to it)."""
    root = write_folder(tmp_path / "train", per_class=12, ext="jpg")
    write_shards(tmp_path / "shards", shards=4, per_shard=10)
    for data in (PartitionedDataset.from_image_folder(root, 2, valid_fraction=0.25),
                 PartitionedDataset.from_tar_shards(str(tmp_path / "shards" / "*.tar"), 2, valid_fraction=0.2)):
        local = train_files(data, epochs=1)
        assert_same_runs(local, train_files(data, client=cluster, epochs=1))




def test_the_doctests_hold():
    import doctest

    import cerebro_automl.data.files as files

    assert doctest.testmod(files).failed == 0

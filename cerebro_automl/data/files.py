"""Image files and tar shards, listed on the driver and decoded on the workers:
``from_image_folder`` and ``from_tar_shards``.

The driver lists the files (an image folder's class subfolders, a tar shard's
member headers) and checks them, but reads no pixel; each partition's source
holds only its own files (paths relative to a root, or a shard's byte offsets),
so it is cheap to pickle, and holds no open file. The worker that holds a
partition decodes its images with PIL, the items of each batch
(:class:`~cerebro_automl.data.shards.DatasetShard`) with ``cache=None``, or
once when the partition loads with ``cache="memory"`` or ``"disk"``; in
``decode_threads`` threads, a few batches ahead (:mod:`~cerebro_automl.data.decode`).
Items are read by index with no shared file handle (a path opened per item, or
one ``pread``), so threads may read them at once.

An item is ``(image, label)``: the image a ``uint8`` tensor ``[3, H, W]`` (RGB),
or what ``transform(PIL image)`` returns; the label an ``int64`` class index.
With ``random_transform``, a training item is ``random_transform(PIL image,
generator)`` instead, the generator seeded from the pass (model seed, epoch) and
the item's index (:func:`~cerebro_automl.data.shards.item_generator`); validation
items never are. The worker-side Datasets are in :mod:`~cerebro_automl.data.file_items`.

Example:
    >>> import os, tempfile
    >>> from PIL import Image
    >>> root = tempfile.mkdtemp()
    >>> for c in ("dog", "cat"):
    ...     os.makedirs(os.path.join(root, c))
    ...     for n in range(2):
    ...         Image.new("RGB", (8, 6)).save(os.path.join(root, c, f"{n}.png"))
    >>> listing = list_image_folder(root, IMAGE_EXTENSIONS, "root")
    >>> listing.classes, listing.paths[:2], listing.labels.tolist()
    (('cat', 'dog'), ('cat/0.png', 'cat/1.png'), [0, 0, 1, 1])
"""

from __future__ import annotations

import glob
import inspect
import os
import re
import tarfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from .assign import assign_rows
from .disk_cache import partition_folder
from .file_items import FileItems, ImageFiles, TarSamples, collate_items, decode_image
from .options import LoadOptions, check_options, check_partitions, check_picklable
from .partition import CACHES, PartitionData, dataset_partition, held_out_rows
from .shards import DatasetShard
from .source import Source, SourcePlan

__all__ = [
    "DECODE_THREADS",
    "IMAGE_EXTENSIONS",
    "TAR_INPUTS",
    "TAR_LABELS",
    "FileSource",
    "check_random_transform",
    "decode_image",
    "image_folder_plan",
    "list_image_folder",
    "list_tar_shards",
    "tar_shards_plan",
]

# Threads that decode a file source's batches by default: one overlaps decoding with the
# training thread's compute at no more CPU per image; more pay only on free cores, and
# cost CPU to Python's lock where cores are short (the guide says how many to set).
DECODE_THREADS = 1
# torchvision's ImageFolder takes these (its IMG_EXTENSIONS), in any case.
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
# A tar sample's input member, the first of these it has (WebDataset's image extensions).
TAR_INPUTS = ("jpg", "jpeg", "png", "webp", "ppm", "bmp")
# The members a tar sample's label may come from.
TAR_LABELS = ("cls", "txt", "json")
# WebDataset's split of a member name into key and extension: at the first dot of the
# last path component ("a/000123.seg.png" -> "a/000123", "seg.png").
_KEY_EXT = re.compile(r"^((?:.*/|)[^./]+)[.]([^/]*)$")


# ----------------------------------------------------------------- image folder
@dataclass(frozen=True)
class FolderListing:
    """An image folder listed: class names (sorted) and each file's path (relative to the
    root) and class index, class by class, files sorted within each."""

    root: str
    classes: tuple[str, ...]
    paths: tuple[str, ...]
    labels: np.ndarray


def list_image_folder(
    root: Any, extensions: Sequence[str], what: str, classes: Sequence[str] | None = None
) -> FolderListing:
    """``root/<class>/**/<file>`` as torchvision's ImageFolder lists it: subfolders sorted
    by name are classes 0..C-1, files with one of ``extensions`` (any case) found
    recursively, sorted. ``classes`` (a training folder's) fixes the class indices: a
    validation folder's subfolders must be among them. A missing root, a root without
    class subfolders and a class folder without images are refused, naming them."""
    if not isinstance(root, (str, os.PathLike)):
        raise TypeError(f"{what} is {root!r}, but must be a folder path")
    _check_local(os.fspath(root), what)
    root = os.path.abspath(os.path.expanduser(os.fspath(root)))
    if not os.path.isdir(root):
        raise ValueError(f"{what} is {root!r}, which is not a folder")
    found = sorted(e.name for e in os.scandir(root) if e.is_dir())
    if not found:
        raise ValueError(
            f"{what} {root!r} has no subfolders, but an image folder holds one subfolder per class "
            "(root/<class>/<image>), as torchvision's ImageFolder reads"
        )
    if classes is None:
        classes = found
    else:
        unknown = sorted(set(found) - set(classes))
        if unknown:
            raise ValueError(
                f"{what} {root!r} has class folders {unknown} that the training folder does not have "
                f"(its classes are {list(classes)}); validation images must belong to the training classes"
            )
    index = {c: i for i, c in enumerate(classes)}
    suffixes = tuple(e.lower() for e in extensions)
    paths: list[str] = []
    labels: list[int] = []
    for name in found:
        folder = os.path.join(root, name)
        files = [
            os.path.relpath(os.path.join(here, f), root)
            for here, _, names in sorted(os.walk(folder, followlinks=True))
            for f in sorted(names)
            if f.lower().endswith(suffixes)
        ]
        if not files:
            raise ValueError(
                f"{what}: class folder {folder!r} holds no image file (extensions {list(suffixes)}); "
                "every class folder needs at least one image: remove the folder, or pass extensions=..."
            )
        paths.extend(files)
        labels.extend([index[name]] * len(files))
    return FolderListing(root, tuple(classes), tuple(paths), np.asarray(labels, np.int64))


def _pick(
    listing: FolderListing, rows: np.ndarray | slice, transform: Callable | None, random_transform: Callable | None
) -> ImageFiles:
    ids = np.arange(len(listing.paths))[rows]
    paths = tuple(listing.paths[i] for i in ids.tolist())
    return ImageFiles(listing.root, paths, listing.labels[ids], ids, transform, random_transform)


# ------------------------------------------------------------------- tar shards
@dataclass(frozen=True)
class TarListing:
    """Tar shards listed: for every sample (shards in the given order, samples in tar
    order), its shard, key, and the byte offset and size of its input and label members."""

    shards: tuple[str, ...]
    shard: np.ndarray  # int32: the sample's shard, an index into shards
    keys: tuple[str, ...]
    input: np.ndarray  # int64 [samples, 2]: offset and size of the input member's data
    label: np.ndarray | None  # int64 [samples, 2], or None (unlabeled)
    label_ext: str | None


def _check_local(path: str, what: str) -> None:
    """Image folders and tar shards are read through the workers' own file system."""
    if "://" in path:
        raise ValueError(
            f"{what} is {path!r}, a URL, but image folders and tar shards are read from the workers' file system: "
            "give a local (or mounted) path; from_parquet reads fsspec URLs (see Remote storage)"
        )


def _shard_paths(paths: Any, what: str) -> list[str]:
    if isinstance(paths, (str, os.PathLike)):
        text = os.path.expanduser(os.fspath(paths))
        _check_local(text, what)
        found = sorted(glob.glob(text)) if glob.has_magic(text) else [text]
        if not found:
            raise ValueError(f"{what} {text!r} matches no file")
    elif isinstance(paths, Sequence) and all(isinstance(p, (str, os.PathLike)) for p in paths):
        found = [os.path.expanduser(os.fspath(p)) for p in paths]
        for path in found:
            _check_local(path, what)
        if not found:
            raise ValueError(f"{what} is an empty list, but must name at least one tar shard")
    else:
        raise TypeError(f"{what} is {paths!r}, but must be a path, a glob or a list of paths")
    for path in found:
        if not os.path.isfile(path):
            raise ValueError(f"{what}: tar shard {path!r} does not exist")
    return [os.path.abspath(p) for p in found]


def list_tar_shards(paths: Any, inputs: Sequence[str], label: str | None, what: str) -> TarListing:
    """Read the member headers of every shard (no member's data), group the members into
    samples by key as WebDataset does, and check that each sample has an input member
    (the first of ``inputs`` it has) and a ``label`` member. Compressed tars are refused:
    samples are read at their offsets."""
    shards = _shard_paths(paths, what)
    shard_of: list[int] = []
    keys: list[str] = []
    input_at: list[tuple[int, int]] = []
    label_at: list[tuple[int, int]] = []
    for s, path in enumerate(shards):
        samples: dict[str, dict[str, tuple[int, int]]] = {}
        try:
            with tarfile.open(path, mode="r:") as tar:
                for member in tar:
                    if not member.isfile():
                        continue
                    match = _KEY_EXT.match(member.name)
                    if match is None:
                        continue
                    key, ext = match.group(1), match.group(2).lower()
                    members = samples.setdefault(key, {})
                    if ext in members:
                        raise ValueError(
                            f"{what}: tar shard {path!r} holds two .{ext} members for sample {key!r}; "
                            "a sample's members must have distinct extensions"
                        )
                    members[ext] = (member.offset_data, member.size)
        except tarfile.ReadError as err:
            raise ValueError(
                f"{what}: {path!r} is not an uncompressed tar file ({err}); samples are read at their "
                "offsets in the shard, so shards must be plain .tar (WebDataset's default), not .tar.gz"
            ) from None
        if not samples:
            raise ValueError(f"{what}: tar shard {path!r} holds no sample (no member named <key>.<ext>)")
        for key, members in samples.items():
            found = next((e for e in inputs if e in members), None)
            if found is None:
                raise ValueError(
                    f"{what}: sample {key!r} of {path!r} has members {sorted(members)}, but no input "
                    f"member (one of {list(inputs)}); pass input=(...) naming its extension"
                )
            if label is not None and label not in members:
                raise ValueError(
                    f"{what}: sample {key!r} of {path!r} has members {sorted(members)}, but no .{label} "
                    f"member; label={label!r} reads every sample's class from its .{label} member, so each "
                    "sample needs one (or pass label=None for unlabeled data)"
                )
            shard_of.append(s)
            keys.append(key)
            input_at.append(members[found])
            if label is not None:
                label_at.append(members[label])
    return TarListing(
        tuple(shards),
        np.asarray(shard_of, np.int32),
        tuple(keys),
        np.asarray(input_at, np.int64).reshape(-1, 2),
        np.asarray(label_at, np.int64).reshape(-1, 2) if label is not None else None,
        label,
    )


def _take_samples(
    listing: TarListing,
    ids: np.ndarray,
    decode: Callable | None,
    transform: Callable | None,
    random_transform: Callable | None,
) -> TarSamples:
    ids = np.sort(ids)
    used = np.unique(listing.shard[ids])  # only this partition's shards travel with it
    remap = np.full(len(listing.shards), -1, np.int32)
    remap[used] = np.arange(len(used), dtype=np.int32)
    return TarSamples(
        tuple(listing.shards[i] for i in used.tolist()),
        remap[listing.shard[ids]],
        tuple(listing.keys[i] for i in ids.tolist()),
        listing.input[ids],
        listing.label[ids] if listing.label is not None else None,
        listing.label_ext,
        ids,
        decode,
        transform,
        random_transform,
    )


# ----------------------------------------------------------------------- source
class FileSource(Source):
    """One partition of image files or tar samples: a Dataset of its own items (paths or
    offsets, no open file), decoded on the worker."""

    def __init__(self, train: FileItems, valid: FileItems | None, index: int, options: LoadOptions) -> None:
        self.train, self.valid, self.index, self.options = train, valid, index, options

    def load(self, *external: Any, scratch: str | None = None) -> PartitionData:
        train, valid, options = self.train.ready(), self.valid.ready() if self.valid is not None else None, self.options
        if train.random_transform is not None and options.cache is not None:
            # Crops are drawn again every epoch, so the cache keeps the files' bytes, not pixels.
            folder = partition_folder(scratch, self.index) if options.cache == "disk" else None
            train = train.with_bytes(folder, "train")
            valid = valid.with_bytes(folder, "valid") if valid is not None else None
            options = replace(options, cache=None)
        threads = options.decode_threads
        draw = train.drawn if train.random_transform is not None else None
        shard = DatasetShard(train, train.ids, collate_items, self.where, threads, draw)
        held = None
        if valid is not None:  # validation reads the deterministic form only (no draw)
            held = DatasetShard(valid, valid.ids, collate_items, f"{self.where} validation", threads)
        return dataset_partition(shard, held, options, where=self.where, partition=self.index, scratch=scratch)


def _check_callable(value: Any, name: str, form: str) -> None:
    if value is not None and not callable(value):
        raise TypeError(f"{name} is {value!r}, but must be callable as {form} or None")


def check_random_transform(random_transform: Any) -> None:
    """``random_transform`` is None or callable as ``random_transform(image, generator)``,
    or a TypeError names the value and the rule.

    >>> check_random_transform(lambda image: image)  # doctest: +NORMALIZE_WHITESPACE +ELLIPSIS
    Traceback (most recent call last):
    TypeError: random_transform is <function <lambda> at ...>, which cannot be called with two arguments
    (...): it must take (PIL image, torch.Generator) and draw its randomness from that generator ...
    """
    if random_transform is None:
        return
    rule = (
        "it must take (PIL image, torch.Generator) and draw its randomness from that generator (seeded per "
        "item and epoch, so runs are reproducible), e.g. def crop(image, generator): ... torch.randint(..., "
        "generator=generator)"
    )
    if not callable(random_transform):
        raise TypeError(f"random_transform is {random_transform!r}, but {rule}")
    try:
        signature = inspect.signature(random_transform)
    except (TypeError, ValueError):
        return  # a builtin without a signature: its first call will tell
    try:
        signature.bind(None, None)
    except TypeError as err:
        raise TypeError(
            f"random_transform is {random_transform!r}, which cannot be called with two arguments ({err}): {rule}"
        ) from None


def _check_held_out(sizes: Sequence[int], fraction: float | None, what: str) -> None:
    if fraction:
        for i, size in enumerate(sizes):
            held_out_rows(int(size), fraction, f"partition {i} ({size} {what})")


def image_folder_plan(
    root: Any,
    num_partitions: int | None,
    *,
    valid: Any,
    valid_fraction: float | None,
    transform: Callable | None,
    extensions: Sequence[str],
    shuffle: bool,
    shuffle_seed: int | None,
    cache: str | None,
    cache_dir: str | None,
    decode_threads: int = DECODE_THREADS,
    random_transform: Callable | None = None,
) -> tuple[SourcePlan, tuple[str, ...]]:
    """Check ``from_image_folder``'s arguments, list the folders, and plan one
    :class:`FileSource` per partition; also returns the class names (index order)."""
    _check_callable(transform, "transform", "transform(PIL image)")
    check_random_transform(random_transform)
    if isinstance(extensions, str) or not all(isinstance(e, str) and e.startswith(".") for e in extensions):
        raise TypeError(f"extensions is {extensions!r}, but must be a tuple of suffixes such as ('.jpg', '.png')")
    options = check_options(
        valid, valid_fraction, shuffle_seed, cache, cache_dir, caches=(None, *CACHES), shuffle=shuffle,
        decode_threads=decode_threads,
    )  # fmt: skip
    listing = list_image_folder(root, extensions, "root")
    rows = len(listing.paths)
    check_partitions(num_partitions, rows)
    vlisting = list_image_folder(valid, extensions, "valid", listing.classes) if valid is not None else None
    check_picklable((transform, random_transform), "transform or random_transform")

    def make(parts: int, resolved: LoadOptions) -> list[FileSource]:
        train = assign_rows(rows, parts, resolved.seed)
        vrows: list[Any] = [None] * parts
        if vlisting is not None:
            if len(vlisting.paths) < parts:
                raise ValueError(
                    f"valid {vlisting.root!r} holds {len(vlisting.paths)} images, but there are {parts} "
                    "partitions; each partition's validation shard needs at least one image"
                )
            vrows = assign_rows(len(vlisting.paths), parts, resolved.seed)
        return [
            FileSource(
                _pick(listing, train[i], transform, random_transform),
                # Validation items have no random transform: a metric must not depend on draws.
                _pick(vlisting, vrows[i], transform, None) if vlisting is not None else None,
                i,
                resolved,
            )
            for i in range(parts)
        ]

    plan = SourcePlan(make, num_partitions, rows, valid is not None or valid_fraction is not None, options)
    return plan, listing.classes


def tar_shards_plan(
    paths: Any,
    num_partitions: int | None,
    *,
    valid: Any,
    valid_fraction: float | None,
    input: Sequence[str],
    label: str | None,
    decode: Callable[[bytes], Any] | None,
    transform: Callable | None,
    shuffle: bool,
    shuffle_seed: int | None,
    cache: str | None,
    cache_dir: str | None,
    decode_threads: int = DECODE_THREADS,
    random_transform: Callable | None = None,
) -> SourcePlan:
    """Check ``from_tar_shards``'s arguments, list the shards' members, and plan one
    :class:`FileSource` per partition: a seeded sample of all the shards' samples (the
    listing holds each one's offsets, so a worker reads its own from any shard), or with
    ``shuffle=False`` a contiguous range of them in shard order."""
    _check_callable(decode, "decode", "decode(bytes)")
    _check_callable(transform, "transform", "transform(PIL image)")
    check_random_transform(random_transform)
    for given, name in ((transform, "transform"), (random_transform, "random_transform")):
        if decode is not None and given is not None:
            raise ValueError(f"give decode or {name}, not both: {name} applies to the image PIL decodes")
    if label is not None and label not in TAR_LABELS:
        raise ValueError(f"label is {label!r}, but must be one of {TAR_LABELS} (a member's extension) or None")
    inputs = (input,) if isinstance(input, str) else tuple(input)
    if not inputs or not all(isinstance(e, str) and e and not e.startswith(".") for e in inputs):
        raise TypeError(f"input is {input!r}, but must be an extension or a tuple of them, e.g. ('jpg', 'png')")
    options = check_options(
        valid, valid_fraction, shuffle_seed, cache, cache_dir, caches=(None, *CACHES), shuffle=shuffle,
        decode_threads=decode_threads,
    )  # fmt: skip
    listing = list_tar_shards(paths, [e.lower() for e in inputs], label, "paths")
    samples = len(listing.keys)
    check_partitions(num_partitions, samples)
    vlisting = list_tar_shards(valid, [e.lower() for e in inputs], label, "valid") if valid is not None else None
    check_picklable((decode, transform, random_transform), "decode, transform or random_transform")

    def make(parts: int, resolved: LoadOptions) -> list[FileSource]:
        # Samples, not whole shards: shards written class by class would give each
        # partition a few classes.
        parted = [np.arange(samples)[rows] for rows in assign_rows(samples, parts, resolved.seed)]
        _check_held_out([len(ids) for ids in parted], resolved.valid_fraction, "samples")
        vrows: list[Any] = [None] * parts
        if vlisting is not None:
            vtotal = len(vlisting.keys)
            if vtotal < parts:
                raise ValueError(
                    f"valid holds {vtotal} samples, but there are {parts} partitions; each partition's "
                    "validation shard needs at least one sample"
                )
            vrows = assign_rows(vtotal, parts, resolved.seed)
        sources = []
        for i, ids in enumerate(parted):
            vpart = None
            if vlisting is not None:
                vids = np.arange(len(vlisting.keys))[vrows[i]]
                vpart = _take_samples(vlisting, vids, decode, transform, None)  # validation: no random transform
            train = _take_samples(listing, ids, decode, transform, random_transform)
            sources.append(FileSource(train, vpart, i, resolved))
        return sources

    return SourcePlan(make, num_partitions, samples, valid is not None or valid_fraction is not None, options)


def class_index(classes: Sequence[str]) -> Mapping[str, int]:
    """torchvision's ``class_to_idx``: class name -> index."""
    return {c: i for i, c in enumerate(classes)}

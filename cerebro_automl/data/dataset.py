"""PartitionedDataset: a data source cut into P partitions, each loaded on one worker.

Each constructor checks its arguments on the driver and builds the sources of
its kind (see the modules :mod:`~cerebro_automl.data.arrays`,
:mod:`~cerebro_automl.data.loader`, :mod:`~cerebro_automl.data.parquet`,
:mod:`~cerebro_automl.data.dask_collections` and
:mod:`~cerebro_automl.data.torch_datasets`); the options they share are
described in :mod:`cerebro_automl.data`.

Example:
    >>> import numpy as np
    >>> X, y = np.zeros((100, 4), "float32"), np.zeros(100, "int64")
    >>> data = PartitionedDataset.from_arrays(X, y, num_partitions=4, valid_fraction=0.2)
    >>> data.resolve(2).num_partitions
    4
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from .arrays import arrays_plan
from .dask_collections import dask_plan
from .files import DECODE_THREADS, IMAGE_EXTENSIONS, TAR_INPUTS, image_folder_plan, tar_shards_plan
from .hf_datasets import hf_arrays
from .loader import loader_plan
from .options import LoadOptions, check_held_out, check_partitions
from .parquet import parquet_plan
from .source import SourcePlan
from .torch_datasets import datamodule_plan, torch_plan

if TYPE_CHECKING:
    import torch

__all__ = ["PartitionedDataset"]


@dataclass(frozen=True)
class PartitionedDataset:
    """P partitions of training data (and validation data), each loaded on one worker.

    Build one with ``from_arrays``, ``from_parquet``, ``from_dask``, ``from_loader``,
    ``from_torch``, ``from_datamodule``, ``from_image_folder`` or ``from_tar_shards``.
    """

    make_sources: Callable[[int, LoadOptions], list]  # (num_partitions, seeded options) -> a source per partition
    num_partitions: int | None
    num_rows: int | None
    # Whether the partitions hold validation rows; None: only the worker-side loader
    # knows (from_loader without has_validation), so every shard is evaluated.
    has_validation: bool | None
    sources: tuple | None = None
    options: LoadOptions = LoadOptions()
    # How this constructor is given validation data, for errors that find none: the
    # argument names differ between sources (from_datamodule takes no valid=).
    how_to_validate: str = "pass valid=... or valid_fraction=..."
    # An image folder's class names, in label order (None: the source does not say).
    classes: tuple[str, ...] | None = None

    @property
    def class_to_idx(self) -> dict[str, int] | None:
        """An image folder's class name -> label, as torchvision's ``ImageFolder.class_to_idx``."""
        return None if self.classes is None else {c: i for i, c in enumerate(self.classes)}

    def resolve(self, default_partitions: int, seed: int = 0) -> PartitionedDataset:
        """Fix the number of partitions (``default_partitions`` when none was given) and
        the seed of the rows' permutation (the session's ``seed`` when none was given); a
        ``valid_fraction`` that holds out no row of some partition is refused here."""
        parts = self.num_partitions if self.num_partitions is not None else default_partitions
        if self.num_rows is not None:
            parts = min(parts, self.num_rows) if self.num_partitions is None else parts
        check_partitions(parts, self.num_rows)
        check_held_out(self.options.valid_fraction, self.num_rows, parts)
        options = self.options.seeded(seed)
        return replace(self, num_partitions=parts, options=options, sources=tuple(self.make_sources(parts, options)))

    @classmethod
    def _of(cls, plan: SourcePlan, how_to_validate: str | None = None) -> PartitionedDataset:
        return cls(
            plan.make_sources,
            plan.num_partitions,
            plan.num_rows,
            plan.has_validation,
            options=plan.options,
            how_to_validate=how_to_validate or cls.how_to_validate,
        )

    @classmethod
    def from_arrays(
        cls,
        X: Any,
        y: Any,
        num_partitions: int | None = None,
        *,
        valid: tuple[Any, Any] | None = None,
        valid_fraction: float | None = None,
        shuffle: bool = True,
        shuffle_seed: int | None = None,
        cache: str = "memory",
        cache_dir: str | None = None,
    ) -> PartitionedDataset:
        """In-memory arrays (numpy or torch) cut into ``num_partitions`` partitions.

        ``X`` is an array, a tuple of arrays or a dict of name -> array; ``y`` an
        array, a tuple, a dict or None (unlabeled data). ``valid=(X_valid, y_valid)``,
        of the same structure, is cut into as many shards; with ``valid_fraction``
        each partition holds out some of its rows instead. Leaves keep their
        dtype, except float64, which becomes float32.

        Example:
            >>> import numpy as np
            >>> dense, ids = np.zeros((100, 13), "float32"), np.arange(200).reshape(100, 2)
            >>> data = PartitionedDataset.from_arrays({"dense": dense, "ids": ids}, np.zeros(100),
            ...                                       num_partitions=2, shuffle_seed=0)
        """
        return cls._of(
            arrays_plan(
                X,
                y,
                num_partitions,
                valid=valid,
                valid_fraction=valid_fraction,
                shuffle=shuffle,
                shuffle_seed=shuffle_seed,
                cache=cache,
                cache_dir=cache_dir,
            )
        )

    @classmethod
    def from_hf(
        cls,
        dataset: Any,
        num_partitions: int | None = None,
        *,
        label: str | None = "label",
        columns: Sequence[str] | None = None,
        valid: Any = None,
        valid_fraction: float | None = None,
        shuffle: bool = True,
        shuffle_seed: int | None = None,
        cache: str = "memory",
        cache_dir: str | None = None,
    ) -> PartitionedDataset:
        """A tokenized HuggingFace ``datasets.Dataset``: its numeric columns (or
        ``columns``) are the model's inputs, as a dict (``model(**x)``), ``label`` the
        targets; ``valid`` is the validation split, a Dataset of the same columns. The
        columns are read on the driver, then as :meth:`from_arrays`.

        Example:
            >>> data = PartitionedDataset.from_hf(tokenized["train"], 4,
            ...                                   valid=tokenized["validation"])  # doctest: +SKIP
        """
        X, y = hf_arrays(dataset, label, columns, "dataset")
        if valid is not None:
            valid = hf_arrays(valid, label, list(X), "valid")
        return cls.from_arrays(
            X,
            y,
            num_partitions,
            valid=valid,
            valid_fraction=valid_fraction,
            shuffle=shuffle,
            shuffle_seed=shuffle_seed,
            cache=cache,
            cache_dir=cache_dir,
        )

    @classmethod
    def from_loader(
        cls,
        fn: Callable[[int], Any],
        num_partitions: int,
        *,
        valid_fraction: float | None = None,
        has_validation: bool | None = None,
        shuffle: bool = True,
        shuffle_seed: int | None = None,
        cache: str = "memory",
        cache_dir: str | None = None,
    ) -> PartitionedDataset:
        """``fn(i)`` runs on the worker holding partition ``i`` and returns ``(X, y)``,
        ``(X, y, X_valid, y_valid)``, or an iterator of ``(X, y)`` chunks, so that a
        partition larger than memory can stream into ``cache="disk"``.

        ``fn(i)`` defines partition ``i``, so ``shuffle_seed`` only picks the rows
        ``valid_fraction`` holds out. The driver never calls ``fn``, so it cannot
        look: say ``has_validation=True`` when ``fn`` returns validation data (the
        tuners then offer ``val_*`` metrics), and ``has_validation=False`` when it
        never does (each epoch's evaluation then reads only the training figures, in
        one task instead of one per partition; validation data returned anyway is
        refused). Left None, every partition is evaluated, and ``fn`` decides.
        """
        return cls._of(
            loader_plan(
                fn,
                num_partitions,
                valid_fraction=valid_fraction,
                has_validation=has_validation,
                shuffle=shuffle,
                shuffle_seed=shuffle_seed,
                cache=cache,
                cache_dir=cache_dir,
            ),
            "return (X, y, X_valid, y_valid) from fn and pass has_validation=True, or pass valid_fraction=...",
        )

    @classmethod
    def from_parquet(
        cls,
        paths: str | Sequence[str],
        *,
        features: Any,
        label: Any,
        num_partitions: int | None = None,
        valid: str | Sequence[str] | None = None,
        valid_fraction: float | None = None,
        shuffle: bool = True,
        shuffle_seed: int | None = None,
        cache: str = "memory",
        cache_dir: str | None = None,
        storage_options: Mapping[str, Any] | None = None,
    ) -> PartitionedDataset:
        """Parquet files (a path, a glob, a list, or fsspec URLs such as ``s3://bucket/x/*.parquet``).

        The driver reads only the files' metadata; each worker reads its own row
        groups. ``features`` is a list of columns (one 2-D input) or a dict of input
        name -> columns, e.g. ``{"dense": ["i1", ...], "cat": ["c1", ...]}``;
        ``label`` a column, a list, a dict or None. Integer columns stay integers.
        ``storage_options`` go to fsspec (credentials, endpoints).
        """
        return cls._of(
            parquet_plan(
                paths,
                features=features,
                label=label,
                num_partitions=num_partitions,
                valid=valid,
                valid_fraction=valid_fraction,
                shuffle=shuffle,
                shuffle_seed=shuffle_seed,
                cache=cache,
                cache_dir=cache_dir,
                storage_options=storage_options,
            )
        )

    @classmethod
    def from_dask(
        cls,
        X: Any,
        y: Any = None,
        num_partitions: int | None = None,
        *,
        features: Any = None,
        label: Any = None,
        valid: tuple[Any, Any] | None = None,
        valid_fraction: float | None = None,
        shuffle: bool = True,
        shuffle_seed: int | None = None,
        cache: str = "memory",
        cache_dir: str | None = None,
    ) -> PartitionedDataset:
        """Dask arrays (``X`` an array, a tuple or a dict of arrays; ``y`` the same or
        None), or a dask DataFrame ``X`` with ``features`` and ``label`` as in
        :meth:`from_parquet`.

        Each partition's slices of the collection's blocks are computed on the
        worker that holds the partition, one after the other, so the data goes
        straight to it. ``shuffle_seed`` assigns whole blocks to partitions.
        """
        return cls._of(
            dask_plan(
                X,
                y,
                num_partitions,
                features=features,
                label=label,
                valid=valid,
                valid_fraction=valid_fraction,
                shuffle=shuffle,
                shuffle_seed=shuffle_seed,
                cache=cache,
                cache_dir=cache_dir,
            )
        )

    @classmethod
    def from_torch(
        cls,
        dataset_fn: Callable[[], Any],
        num_partitions: int | None = None,
        *,
        valid_fn: Callable[[], Any] | None = None,
        valid_fraction: float | None = None,
        shuffle: bool = True,
        shuffle_seed: int | None = None,
        collate_fn: Callable[[list], Any] | None = None,
        cache: str | None = None,
        cache_dir: str | None = None,
    ) -> PartitionedDataset:
        """A map-style ``torch.utils.data.Dataset`` that ``dataset_fn()`` builds on each
        worker (an image folder decoded per item, say); partition ``i`` is a subset of
        its indices, batches come from a seeded sampler over that subset.

        An item is ``(x, y)`` (a 2-tuple or 2-list) or ``x`` alone; items are
        collated with ``collate_fn`` (default: torch's ``default_collate``).
        ``valid_fn()`` builds the validation Dataset, cut into as many shards.
        ``cache=None`` (default) reads items through the Dataset on every batch;
        ``"memory"`` or ``"disk"`` collate them once, when the partition loads.

        ``dataset_fn()`` (and ``valid_fn()``) may build an ``IterableDataset`` of
        single items: each partition's worker reads the whole stream once, at load,
        and keeps the items dealt to it in a seeded order (see the PyTorch data
        guide); for large sharded data, :meth:`from_tar_shards` or
        :meth:`from_loader` read only each worker's own samples.

        Example:
            >>> data = PartitionedDataset.from_torch(lambda: ImageFolder("imgs/"), 4,
            ...                                      valid_fraction=0.1, shuffle_seed=0)  # doctest: +SKIP
        """
        plan = torch_plan(
            dataset_fn, num_partitions, valid_fn=valid_fn, valid_fraction=valid_fraction, shuffle=shuffle,
            shuffle_seed=shuffle_seed, collate_fn=collate_fn, cache=cache, cache_dir=cache_dir,
        )  # fmt: skip
        return cls._of(plan, "pass valid_fn=... or valid_fraction=...")

    @classmethod
    def from_image_folder(
        cls,
        root: Any,
        num_partitions: int | None = None,
        *,
        valid: Any = None,
        valid_fraction: float | None = None,
        transform: Callable[[Any], Any] | None = None,
        random_transform: Callable[[Any, torch.Generator], Any] | None = None,
        extensions: Sequence[str] = IMAGE_EXTENSIONS,
        shuffle: bool = True,
        shuffle_seed: int | None = None,
        cache: str | None = None,
        cache_dir: str | None = None,
        decode_threads: int = DECODE_THREADS,
    ) -> PartitionedDataset:
        """A folder of images, one subfolder per class (torchvision ``ImageFolder``'s layout:
        ``root/<class>/**/<image>``); the sorted subfolder names are the labels 0..C-1
        (:attr:`class_to_idx`). ``valid`` is a second such folder, whose classes must be
        among ``root``'s.

        The driver lists the files and reads none; each partition's worker decodes its
        own files with PIL, as a ``uint8`` tensor ``[3, H, W]`` (RGB), or as what
        ``transform(PIL image)`` returns (a deterministic resize or crop: batches stack
        the images, so they must share one shape; seeded random augmentation of the
        batch is the TrainingSpec's ``train_transform``). ``random_transform(PIL image,
        generator)``, when given, makes the training items instead (a random crop of the
        original, ImageNet-style): its ``torch.Generator`` is seeded from the model's
        seed, the epoch and the item, so every epoch draws anew and a run repeats
        bit for bit; validation items always take ``transform``. Partitions are a seeded
        sample of the files (``shuffle``), so a folder sorted by class trains well.
        ``cache=None`` (default) decodes on every batch; ``"memory"`` or ``"disk"``
        decode once, when the partition loads (with a ``random_transform`` they keep
        the files' bytes instead, decoded on every batch). ``decode_threads`` threads of
        the worker decode, a few batches ahead of training (0: one by one, in the training
        thread); the batches are the same bytes for any number.

        Example:
            >>> data = PartitionedDataset.from_image_folder("imgs/train", 4,
            ...                                             valid="imgs/valid")  # doctest: +SKIP
        """
        plan, classes = image_folder_plan(
            root, num_partitions, valid=valid, valid_fraction=valid_fraction, transform=transform,
            extensions=extensions, shuffle=shuffle, shuffle_seed=shuffle_seed, cache=cache, cache_dir=cache_dir,
            decode_threads=decode_threads, random_transform=random_transform,
        )  # fmt: skip
        return replace(cls._of(plan), classes=classes)

    @classmethod
    def from_tar_shards(
        cls,
        paths: Any,
        num_partitions: int | None = None,
        *,
        valid: Any = None,
        valid_fraction: float | None = None,
        input: str | Sequence[str] = TAR_INPUTS,
        label: str | None = "cls",
        decode: Callable[[bytes], Any] | None = None,
        transform: Callable[[Any], Any] | None = None,
        random_transform: Callable[[Any, torch.Generator], Any] | None = None,
        shuffle: bool = True,
        shuffle_seed: int | None = None,
        cache: str | None = None,
        cache_dir: str | None = None,
        decode_threads: int = DECODE_THREADS,
    ) -> PartitionedDataset:
        """WebDataset-style tar shards (a path, a glob or a list of plain ``.tar`` files): the
        members ``<key>.<ext>`` of one tar with the same key are one sample
        (``000123.jpg`` and ``000123.cls``). ``valid`` is more such shards.

        A partition is a seeded sample of the shards' samples (``shuffle``; shards
        written class by class still give every partition every class): each worker
        reads its own samples at their offsets. The input is the sample's
        first member among ``input``, decoded with PIL as in :meth:`from_image_folder`
        (``transform`` and ``random_transform`` as there), or by ``decode(bytes)``; the
        label is the integer in its ``label`` member: ``"cls"`` or ``"txt"`` (text),
        ``"json"`` (an integer, or an object with an integer ``"label"``), or None for
        unlabeled samples. The driver
        reads the shards' member headers only (to check every sample and find its
        bytes); the worker reads each sample at its offset, so a batch may draw samples
        from anywhere in the partition's shards. ``decode_threads`` as in
        :meth:`from_image_folder` (``decode`` runs in those threads too).

        Example:
            >>> data = PartitionedDataset.from_tar_shards("shards/train-*.tar", 4,
            ...                                           valid="shards/valid-*.tar")  # doctest: +SKIP
        """
        return cls._of(
            tar_shards_plan(
                paths, num_partitions, valid=valid, valid_fraction=valid_fraction, input=input, label=label,
                decode=decode, transform=transform, shuffle=shuffle, shuffle_seed=shuffle_seed, cache=cache,
                cache_dir=cache_dir, decode_threads=decode_threads, random_transform=random_transform,
            )
        )  # fmt: skip

    @classmethod
    def from_datamodule(
        cls,
        datamodule: Any,
        num_partitions: int | None = None,
        *,
        valid_fraction: float | None = None,
        shuffle: bool = True,
        shuffle_seed: int | None = None,
        cache: str | None = None,
        cache_dir: str | None = None,
    ) -> PartitionedDataset:
        """A ``LightningDataModule``: on each worker, ``prepare_data()`` and
        ``setup("fit")`` run where the data lives; the Dataset behind
        ``train_dataloader()`` is partitioned as in :meth:`from_torch`, with that
        loader's ``collate_fn``, and ``val_dataloader()``'s Dataset is the validation
        set (when the DataModule defines one). Either may be an ``IterableDataset``,
        read as :meth:`from_torch` reads one. The loaders' batch sizes, samplers and
        workers are not used: the TrainingSpec's batch size and MOP's seeded sampler are.
        """
        return cls._of(
            datamodule_plan(
                datamodule,
                num_partitions,
                valid_fraction=valid_fraction,
                shuffle=shuffle,
                shuffle_seed=shuffle_seed,
                cache=cache,
                cache_dir=cache_dir,
            ),
            "define val_dataloader() on the DataModule, or pass valid_fraction=...",
        )

"""A file source's items on the worker: one partition's image files or tar samples,
map-style Datasets indexed by the items' global ids (their places in the listing),
decoded with PIL on access.

``dataset[id]`` is ``(image, label)``: ``transform(image)``, or a ``uint8`` tensor
``[3, H, W]`` without one. ``dataset.drawn(id, generator)`` is the training form
with a ``random_transform``: ``random_transform(image, generator)``, the generator
seeded for that item and pass (:func:`~cerebro_automl.data.shards.item_generator`).
With a cache, :meth:`FileItems.with_bytes` keeps the items' encoded bytes (see
:mod:`~cerebro_automl.data.encoded`) so that every epoch crops the original again.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from .disk_cache import ScratchFolder
from .encoded import EncodedBytes
from .errors import DataError

__all__ = ["FileItems", "ImageFiles", "TarSamples", "collate_items", "decode_image"]


def decode_image(source: Any, transform: Callable[[Any], Any] | None = None) -> Any:
    """An image file (a path or a binary file object) decoded with PIL: ``transform(image)``
    of the RGB image, or without a transform a ``uint8`` tensor ``[3, H, W]``."""
    from PIL import Image

    with Image.open(source) as opened:
        image = opened.convert("RGB")
    if transform is not None:
        out = transform(image)
        if isinstance(out, Image.Image):
            raise TypeError(
                "the image's transform (transform= or random_transform=) returned a PIL image, but must return a "
                "tensor or an array [C, H, W] that batches stack: end it with torchvision's PILToTensor() or "
                "ToTensor(), or torch.from_numpy(np.asarray(image).transpose(2, 0, 1))"
            )
        return out
    # numpy's copy, not torch's: torch ops in decode threads would start intra-op threads of their own.
    return torch.from_numpy(np.ascontiguousarray(np.asarray(image).transpose(2, 0, 1)))


def collate_items(items: list) -> tuple[Any, Any]:
    """A batch of ``(x, y)`` items: images stacked (they must have one size), labels as int64."""
    xs = [x for x, _ in items]
    labels = [y for _, y in items]
    y = None if labels and labels[0] is None else torch.tensor(labels, dtype=torch.int64)
    if all(isinstance(x, torch.Tensor) for x in xs):
        shapes = {tuple(x.shape) for x in xs}
        if len(shapes) > 1:
            a, b = sorted(shapes)[:2]
            raise ValueError(
                f"a batch holds decoded images of different shapes, {list(a)} and {list(b)}, but a batch "
                "stacks them, so every image must decode to one shape: pass transform= that resizes or "
                "crops the PIL image to one size (e.g. lambda im: pil_to_tensor(im.resize((64, 64)))), "
                "and make random_transform= return that size too"
            )
        return torch.stack(xs), y
    from torch.utils.data import default_collate

    return default_collate(xs), y


class FileItems:
    """One partition's items, by global id (``ids``, sorted). A subclass says where an
    item's bytes are (:meth:`_input`, :meth:`_raw`), its label and how to name it."""

    ids: np.ndarray
    transform: Callable | None
    random_transform: Callable | None
    encoded: EncodedBytes | None = None  # the items' bytes, when a cache keeps them (random_transform)

    def __len__(self) -> int:
        return len(self.ids)

    def _place(self, gid: int) -> int:
        i = int(np.searchsorted(self.ids, gid))
        if i >= len(self.ids) or self.ids[i] != gid:
            raise IndexError(f"item {gid} is not in this partition")
        return i

    def _input(self, i: int) -> Any:
        """What PIL opens for item ``i`` when no cache holds its bytes: a path or a file object."""
        raise NotImplementedError

    def _raw(self, i: int) -> bytes:
        """Item ``i``'s encoded bytes, read from its file."""
        raise NotImplementedError

    def _label(self, i: int) -> int | None:
        raise NotImplementedError

    def _where(self, i: int) -> str:
        raise NotImplementedError

    def _decoded(self, i: int, transform: Callable[[Any], Any] | None) -> Any:
        source = io.BytesIO(self.encoded[i]) if self.encoded is not None else self._input(i)
        try:
            return decode_image(source, transform)
        except OSError as err:
            raise OSError(f"cannot decode {self._where(i)} as an image with PIL: {err}") from err

    def __getitem__(self, gid: int) -> tuple[Any, int | None]:
        i = self._place(gid)
        return self._decoded(i, self.transform), self._label(i)

    def drawn(self, gid: int, generator: torch.Generator) -> tuple[Any, int | None]:
        """The item's training form: ``random_transform(image, generator)``."""
        i = self._place(gid)
        random_transform = self.random_transform
        assert random_transform is not None, "drawn() reads a source with a random_transform"
        return self._decoded(i, lambda image: random_transform(image, generator)), self._label(i)

    def ready(self) -> FileItems:
        """The items ready to read on the worker (a subclass reads what it needs once)."""
        return self

    def with_bytes(self, folder: ScratchFolder | None, name: str) -> FileItems:
        """A copy reading the items' bytes from a cache: in memory, or in ``folder``."""
        stored = EncodedBytes.store((self._raw(i) for i in range(len(self))), folder, name)
        out = object.__new__(type(self))
        out.__dict__.update(self.__dict__, encoded=stored)
        return out

    def raw_digest(self, gids: np.ndarray) -> str:
        """A SHA-256 digest of items ``gids``' encoded bytes (as stored: no transform runs,
        so no random one can change it), for a resume to tell that the files are the same."""
        digest = hashlib.sha256()
        for gid in gids:
            i = self._place(int(gid))
            digest.update(self.encoded[i] if self.encoded is not None else self._raw(i))
        return digest.hexdigest()[:32]

    def held_bytes(self, gids: np.ndarray) -> int:
        """Bytes of memory the cached bytes of items ``gids`` take (0 without a cache in memory)."""
        if self.encoded is None:
            return 0
        return self.encoded.held_bytes(np.searchsorted(self.ids, gids))


class ImageFiles(FileItems):
    """One partition's image files (paths relative to ``root``) and class indices."""

    def __init__(
        self,
        root: str,
        paths: tuple[str, ...],
        labels: np.ndarray,
        ids: np.ndarray,
        transform: Callable | None,
        random_transform: Callable | None = None,
    ) -> None:
        self.root, self.paths, self.labels, self.ids = root, paths, labels, ids
        self.transform, self.random_transform = transform, random_transform

    def _path(self, i: int) -> str:
        return os.path.join(self.root, self.paths[i])

    def _input(self, i: int) -> Any:
        return self._path(i)

    def _raw(self, i: int) -> bytes:
        with open(self._path(i), "rb") as f:
            return f.read()

    def _label(self, i: int) -> int:
        return int(self.labels[i])

    def _where(self, i: int) -> str:
        return repr(self._path(i))

    def __repr__(self) -> str:  # an error that names the source names the folder
        return f"ImageFiles(root={self.root!r}, {len(self.paths)} files)"


def read_span(path: str, offset: int, size: int) -> bytes:
    """``size`` bytes of ``path`` at ``offset``, with one ``pread`` (no shared file position)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, size, offset)
    finally:
        os.close(fd)


def parse_label(data: bytes, ext: str, where: str) -> int:
    """The integer class index in a tar sample's ``.cls``/``.txt``/``.json`` member."""
    text = data.decode("utf-8", errors="replace").strip()
    value: Any = text
    if ext == "json":
        try:
            value = json.loads(text)
        except ValueError:
            value = text
        if isinstance(value, dict):
            value = value.get("label", value)
    if isinstance(value, bool):
        value = str(value)
    try:
        label = int(value) if isinstance(value, int) else int(str(value), 10)
    except ValueError:
        label = -1
    if label < 0:  # read where the partition loads: the same on every try, so not tried again
        raise DataError(
            f"{where}: its .{ext} member holds {text[:60]!r}, but a label must be a class index, an integer >= 0"
            + (" (a JSON integer, or an object with an integer 'label')" if ext == "json" else "")
        )
    return label


class TarSamples(FileItems):
    """One partition's tar samples: the input read at its offset (one ``pread``) and
    decoded with PIL, or by ``decode(bytes)``. The labels are read once, when the
    partition loads (:meth:`ready`)."""

    def __init__(
        self,
        shards: tuple[str, ...],
        shard: np.ndarray,
        keys: tuple[str, ...],
        input_at: np.ndarray,
        label_at: np.ndarray | None,
        label_ext: str | None,
        ids: np.ndarray,
        decode: Callable[[bytes], Any] | None,
        transform: Callable | None,
        random_transform: Callable | None = None,
    ) -> None:
        self.shards, self.shard, self.keys, self.input_at = shards, shard, keys, input_at
        self.label_at, self.label_ext, self.ids = label_at, label_ext, ids
        self.decode, self.transform, self.random_transform = decode, transform, random_transform
        self.labels: np.ndarray | None = None

    def _where(self, i: int) -> str:
        return f"sample {self.keys[i]!r} of {self.shards[int(self.shard[i])]!r}"

    def __repr__(self) -> str:  # an error that names the source names the shards
        first = self.shards[0] if self.shards else ""
        return f"TarSamples({len(self.ids)} samples of {len(self.shards)} shards, the first {first!r})"

    def ready(self) -> TarSamples:
        """A copy with the labels read (on the worker, when the partition loads)."""
        out = object.__new__(TarSamples)
        out.__dict__.update(self.__dict__)
        if self.label_at is not None and self.label_ext is not None:
            out.labels = np.asarray(
                [
                    parse_label(read_span(self.shards[int(s)], int(o), int(n)), self.label_ext, self._where(i))
                    for i, (s, (o, n)) in enumerate(zip(self.shard, self.label_at, strict=True))
                ],
                np.int64,
            )
        return out

    def _raw(self, i: int) -> bytes:
        offset, size = self.input_at[i]
        return read_span(self.shards[int(self.shard[i])], int(offset), int(size))

    def _input(self, i: int) -> Any:
        return io.BytesIO(self._raw(i))

    def _label(self, i: int) -> int | None:
        return int(self.labels[i]) if self.labels is not None else None

    def __getitem__(self, gid: int) -> tuple[Any, int | None]:
        if self.decode is None:
            return super().__getitem__(gid)
        i = self._place(gid)
        return self.decode(self.encoded[i] if self.encoded is not None else self._raw(i)), self._label(i)

"""The files' bytes, as read and not yet decoded, kept by a file source's cache when
it has a ``random_transform``: a random crop of the original must be drawn again
every epoch, so the cache cannot hold decoded pixels; it holds the encoded images
(a JPEG is also ~10x smaller than its pixels), decoded on every batch.

``cache="memory"`` keeps them in one buffer in the worker's memory;
``cache="disk"`` in one file of the partition's scratch folder, read with ``pread``
(no shared file position, so decode threads may read at once).

Example:
    >>> store = EncodedBytes.store([b"ab", b"", b"cde"], None, "train")
    >>> store[2], store[1], store.held_bytes([0, 2])
    (b'cde', b'', 5)
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from .disk_cache import ScratchFolder

__all__ = ["EncodedBytes"]


class EncodedBytes:
    """Items' bytes, item ``i`` at ``offsets[i]:offsets[i + 1]`` of one buffer (memory)
    or one file (disk)."""

    def __init__(
        self, offsets: np.ndarray, buffer: bytes | None, path: str | None, folder: ScratchFolder | None
    ) -> None:
        self.offsets, self.buffer, self.path = offsets, buffer, path
        self.folder = folder  # held, so the folder lives as long as a shard reads from it

    @classmethod
    def store(cls, items: Iterable[bytes], folder: ScratchFolder | None, name: str) -> EncodedBytes:
        """``items`` stored as they come: in memory, or in ``folder`` when one is given."""
        sizes = [0]
        if folder is None:
            parts = []
            for data in items:
                parts.append(data)
                sizes.append(len(data))
            return cls(np.cumsum(sizes, dtype=np.int64), b"".join(parts), None, None)
        path = os.path.join(folder.path, f"{name}-encoded.bin")
        with open(path, "wb") as out:
            for data in items:
                out.write(data)
                sizes.append(len(data))
        return cls(np.cumsum(sizes, dtype=np.int64), None, path, folder)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> bytes:
        start, end = int(self.offsets[i]), int(self.offsets[i + 1])
        if self.buffer is not None:
            return self.buffer[start:end]
        fd = os.open(str(self.path), os.O_RDONLY)
        try:
            return os.pread(fd, end - start, start)
        finally:
            os.close(fd)

    def held_bytes(self, items: Sequence[int] | np.ndarray) -> int:
        """Bytes of memory the given items take (none on disk)."""
        if self.buffer is None:
            return 0
        rows = np.asarray(items, np.int64)
        return int((self.offsets[rows + 1] - self.offsets[rows]).sum())

    def __getstate__(self) -> Any:
        if self.path is not None:
            raise TypeError(
                "a disk-cached partition lives in its worker's scratch folder and cannot be sent to another process"
            )
        return self.__dict__

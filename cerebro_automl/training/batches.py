"""The batches of a pass over a shard, on the unit's device: shuffled from the
unit's generator, sliced from a device copy of the shard when it fits, or
gathered in pinned host memory and copied while the GPU computes. A shard may
read ahead (file sources decode in threads): close the pass's iterator when
leaving it early, so that its readers stop then."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Generator
from typing import TYPE_CHECKING, Any

import torch

from ..data import Shard, TensorShard
from ..data.structure import map_structure, to_device

if TYPE_CHECKING:
    from .contract import RunSpec

__all__ = ["batches", "shard_on_device"]

# Worker process: the GPU copy of each in-memory shard that fit, keyed by the shard's
# id (dropped with the shard, so an id is never reused while its entry lives).
_DEVICE_SHARDS: dict[tuple[int, str], TensorShard] = {}


def batches(
    spec: RunSpec,
    shard: Shard,
    batch_size: int,
    device: torch.device,
    shuffle: torch.Generator | None,
    augment: torch.Generator | None,
    item_seed: int | None = None,
) -> Generator[tuple[Any, Any, int], None, None]:
    """``(x, y, rows)`` for each batch of a pass over ``shard``, on ``device``, transformed:
    shuffled and through ``train_transform`` with generators, in order and through
    ``eval_transform`` without. ``item_seed`` (a training pass's) seeds the per-item
    draws of a shard that makes them (:meth:`~cerebro_automl.data.Shard.with_item_seed`).

    On a GPU, batches are sliced from the shard's device copy when it has one (see
    :func:`shard_on_device`); otherwise gathered on the host into pinned memory and
    copied asynchronously, so the copy of one batch overlaps the compute of the last.
    """
    if item_seed is not None:
        shard = shard.with_item_seed(item_seed)
    source = shard_on_device(shard, device, spec.device_data_fraction)
    on_device = source is not shard
    rows = list(_index_batches(len(source), batch_size, shuffle, device if on_device else torch.device("cpu")))
    with contextlib.closing(source.read(rows)) as read:  # closed with this pass: a shard may read ahead
        for idx, batch in zip(rows, read, strict=True):
            x, y = batch
            if not on_device:
                if device.type == "cuda":
                    x, y = _pinned(x), _pinned(y)
                x, y = to_device(x, device, non_blocking=True), to_device(y, device, non_blocking=True)
            x, y = spec.transform(x, y, augment)
            yield x, y, len(idx)


def shard_on_device(shard: Shard, device: torch.device, fraction: float) -> Shard:
    """The shard batches come from: on a GPU, a copy of an in-memory shard made there
    once, when it takes at most ``fraction`` of the device's free memory; else ``shard``.

    Disk-cached and Dataset shards stay on the host: they exist because the data
    does not fit in memory."""
    if device.type != "cuda" or not isinstance(shard, TensorShard):
        return shard
    key = (id(shard), str(device))
    copy = _DEVICE_SHARDS.get(key)
    if copy is None:
        free, _ = torch.cuda.mem_get_info(device)
        if shard.nbytes > fraction * free:
            return shard
        copy = _DEVICE_SHARDS[key] = TensorShard(to_device(shard.x, device), to_device(shard.y, device))
        weakref.finalize(shard, _DEVICE_SHARDS.pop, key, None)
    return copy


def _index_batches(
    n: int, batch_size: int, generator: torch.Generator | None, device: torch.device
) -> Generator[torch.Tensor, None, None]:
    # The order is drawn on the CPU whatever the device, so shuffles match across devices.
    order = torch.randperm(n, generator=generator) if generator is not None else torch.arange(n)
    if device.type != "cpu":
        order = order.to(device)
    for start in range(0, n, batch_size):
        yield order[start : start + batch_size]


def _pinned(value: Any) -> Any:
    return map_structure(lambda t: t.pin_memory(), value)

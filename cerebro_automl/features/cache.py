"""The features a worker keeps: the backbone built once per worker and device, and
each partition's layers computed in one staged pass, in memory or on disk.

Entries are keyed by the :class:`FrozenFeatures`' key and the shard's id, and
dropped with the shard: a partition placed again (a replica, a lost worker's
partition) gets its features computed again where it lands.
"""

from __future__ import annotations

import os
import tempfile
import uuid
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from ..data.disk_cache import DiskWriter, ScratchFolder
from ..data.shards import Shard, TensorShard
from ..data.structure import concat, leaves, map_structure, to_device
from .spec import FrozenFeatures
from .staged import prepare, staged_outputs

__all__ = ["feature_shard", "backbone", "predicted_bytes", "FeatureShard"]

_BACKBONES: dict[tuple[str, str], torch.nn.Module] = {}
_FEATURES: dict[tuple[str, int], dict[str, Shard]] = {}


def feature_shard(features: FrozenFeatures, shard: Shard, config: Mapping[str, Any], device: torch.device) -> Shard:
    """The rows of ``shard`` as the layer ``config`` picks sees them (its labels kept),
    computed the first time any unit of this worker asks for this shard."""
    layer = features.layer_of(config)
    key = (features.key, id(shard))
    kept = _FEATURES.get(key)
    if kept is None:
        kept = _FEATURES[key] = _compute(features, shard, device)
        weakref.finalize(shard, _FEATURES.pop, key, None)
    return kept[layer]


def backbone(features: FrozenFeatures, device: torch.device) -> torch.nn.Module:
    """The backbone on ``device``, built once per process under a fixed seed, checked
    and in eval mode for good."""
    key = (features.key, str(device))
    module = _BACKBONES.get(key)
    if module is None:
        # A worker serves one session's backbone at a time: an earlier session's goes.
        for other in [k for k in _BACKBONES if k[0] != features.key]:
            del _BACKBONES[other]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            module = features.backbone_fn()
        features.check_backbone(module)
        module = _BACKBONES[key] = module.to(device).eval()
    return module


def predicted_bytes(features: FrozenFeatures, shard: Shard, device: torch.device) -> dict[str, int]:
    """Each layer's bytes for the whole shard, from a pass over its first row."""
    x, _ = shard.batch(torch.arange(min(1, len(shard))))
    with torch.no_grad():
        out = staged_outputs(backbone(features, device), to_device(x, device), features.layers)
    sizes = {}
    for name, value in out.items():
        kept = prepare(value, features.pool, features.dtype)
        sizes[name] = len(shard) * sum(t[0].numel() * t.element_size() for _, t in leaves(kept, name))
    return sizes


def _memory_budget(features: FrozenFeatures) -> int:
    if features.max_memory is not None:
        return features.max_memory
    import psutil

    return psutil.virtual_memory().available // 2


def _place(features: FrozenFeatures, sizes: dict[str, int]) -> str:
    """Where the shard's features go: memory or disk; refuses before the pass when
    they must stay in memory and do not fit."""
    if features.cache == "disk":
        return "disk"
    budget, total = _memory_budget(features), sum(sizes.values())
    if total <= budget:
        return "memory"
    if features.cache == "auto":
        return "disk"
    largest = max(sizes, key=sizes.__getitem__)
    raise MemoryError(
        f"the features of one partition take {_size(total)} ({largest!r} alone {_size(sizes[largest])}), "
        f"but max_memory is {_size(budget)} and cache='memory' keeps them in memory only; "
        f"{_remedies(features)} or raise max_memory"
    )


def _remedies(features: FrozenFeatures) -> str:
    """The ways to make the features fit that ``features`` does not use yet."""
    ways = ["allow the disk (cache='auto' or 'disk')"]
    if features.pool is None:
        ways.append("pool them (pool='avg')")
    halved = (torch.float16, torch.bfloat16)
    if features.dtype not in halved:
        ways.append("store them as float16 (dtype=torch.float16)")
    return ", ".join(ways)


def _size(n: int) -> str:
    """``n`` bytes, readably.

    >>> _size(1000), _size(3 * 2**20)
    ('1000 B', '3.0 MiB')
    """
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _batches(shard: Shard, size: int) -> Iterator[tuple[Any, Any]]:
    for start in range(0, len(shard), size):
        yield shard.batch(torch.arange(start, min(start + size, len(shard))))


def _compute(features: FrozenFeatures, shard: Shard, device: torch.device) -> dict[str, Shard]:
    """Every layer of ``shard`` from one staged pass, in eval mode and without gradients."""
    if len(shard) == 0:
        raise ValueError("a shard without rows has no features")
    place = _place(features, predicted_bytes(features, shard, device))
    module = backbone(features, device)
    writers = _writers(features) if place == "disk" else None
    parts: dict[str, list[Any]] = {name: [] for name in features.layers}
    labels: list[Any] = []
    firsts: dict[str, Any] = {}
    with torch.no_grad():
        for x, y in _batches(shard, features.batch_size):
            out = staged_outputs(module, to_device(x, device), features.layers)
            for name, value in out.items():
                kept = prepare(value, features.pool, features.dtype)
                if writers is not None:
                    firsts.setdefault(name, (kept, y))
                    writers[name].append(kept, y)
                else:
                    parts[name].append(kept)
            if writers is None:
                labels.append(y)
    if writers is not None:
        shards: dict[str, Shard] = {name: w.finish(*firsts[name]) for name, w in writers.items()}
    else:
        y_all = concat(labels)
        shards = {name: TensorShard(concat(chunks), y_all) for name, chunks in parts.items()}
    return {name: _as_read(s, features) for name, s in shards.items()}


def _writers(features: FrozenFeatures) -> dict[str, DiskWriter]:
    root = features.scratch or tempfile.gettempdir()
    folder = ScratchFolder(os.path.join(root, f"features-{uuid.uuid4().hex[:12]}"))
    return {name: DiskWriter(folder, f"feature{i}") for i, name in enumerate(features.layers)}


def _as_read(shard: Shard, features: FrozenFeatures) -> Shard:
    """A shard stored in half precision hands out float32, which the trainable part computes in."""
    if features.dtype in (torch.float16, torch.bfloat16):
        return FeatureShard(shard)
    return shard


class FeatureShard(Shard):
    """Features stored in a half-precision dtype, read as float32."""

    def __init__(self, stored: Shard) -> None:
        self.stored = stored

    def __len__(self) -> int:
        return len(self.stored)

    def batch(self, rows: torch.Tensor) -> tuple[Any, Any]:
        x, y = self.stored.batch(rows)
        return map_structure(_float32, x), y

    @property
    def nbytes(self) -> int:
        return self.stored.nbytes


def _float32(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.is_floating_point() else t

"""Seeds: a model's from the session seed and its config, a unit's from (model
seed, epoch, partition), so that the order in which units run never changes
their results.

>>> model_seed(0, {"lr": 0.1}) == model_seed(0, {"lr": 0.1})
True
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

import torch

__all__ = [
    "canonical_config",
    "model_seed",
    "unit_seed",
    "item_seed",
    "hash_seed",
    "seed_torch",
    "unit_generators",
]


def canonical_config(config: Mapping[str, Any]) -> str:
    """The config as canonical JSON; raises TypeError naming a key whose value is not JSON."""
    if not isinstance(config, Mapping):
        raise TypeError(f"config is {config!r}, but must be a dict")
    for key in config:
        if not isinstance(key, str):
            raise TypeError(f"config key {key!r} is a {type(key).__name__}, but keys must be str")
    try:
        return json.dumps(config, sort_keys=True, allow_nan=False, default=_json_default)
    except (TypeError, ValueError) as err:
        raise TypeError(f"config {config!r} is not JSON-serialisable: {err}") from None


def _json_default(value: Any) -> Any:
    item = getattr(value, "item", None)  # numpy and torch scalars
    if callable(item) and getattr(value, "ndim", 1) == 0:
        return item()
    raise TypeError(f"value {value!r} of type {type(value).__name__} is not a number, str, bool, None, list or dict")


def hash_seed(*parts: Any) -> int:
    """A 63-bit seed from JSON-able ``parts`` (the first 8 bytes of their SHA-256)."""
    digest = hashlib.sha256(json.dumps(parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def model_seed(session_seed: int, config: Mapping[str, Any]) -> int:
    """A model's seed: from the session seed and the canonical form of its config."""
    return hash_seed("model", session_seed, canonical_config(config))


def unit_seed(seed: int, epoch: int, partition: int) -> int:
    """The seed of one unit (shuffling, dropout): from (model seed, epoch, partition)."""
    return hash_seed("unit", seed, epoch, partition)


def item_seed(seed: int, epoch: int) -> int:
    """The seed of a training pass's per-item draws (a file source's ``random_transform``):
    from (model seed, epoch) only, so an item's draw is the same in whichever partition,
    unit or process it is read; each item's generator adds its index
    (:func:`~cerebro_automl.data.shards.item_generator`)."""
    return hash_seed("items", seed, epoch)


def seed_torch(seed: int) -> None:
    """Seed torch's global RNGs, the CPU's and CUDA's, as ``torch.manual_seed`` does.

    ``torch.manual_seed`` also queues a seed for each accelerator not yet in use
    (XPU, MPS), recording a stack trace every time: 0.6 ms per call on our 2-core
    machine (2.6 µs for the CPU seed alone), more under a worker's deeper stack,
    paid by every unit.
    """
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def unit_generators(useed: int, device: torch.device) -> tuple[torch.Generator, torch.Generator]:
    """The unit's shuffling generator (CPU) and its augmentation generator (on ``device``),
    both from the unit seed."""
    shuffle = torch.Generator().manual_seed(useed)
    augment = torch.Generator(device=device).manual_seed(hash_seed("transform", useed))
    return shuffle, augment

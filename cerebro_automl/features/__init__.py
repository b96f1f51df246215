"""Frozen features: the layers of a frozen backbone computed once per partition, on
the worker that holds it, and read by the trainable part of every configuration.

* :mod:`.spec`: :class:`FrozenFeatures`, its options and checks.
* :mod:`.staged`: one forward pass yields every requested layer.
* :mod:`.cache`: the worker's backbone and features, in memory or on disk.
"""

from .cache import FeatureShard, backbone, feature_shard, predicted_bytes
from .spec import CACHES, POOLS, STORAGE_DTYPES, FrozenFeatures
from .staged import prepare, staged_outputs

__all__ = [
    "FrozenFeatures",
    "CACHES",
    "POOLS",
    "STORAGE_DTYPES",
    "feature_shard",
    "backbone",
    "predicted_bytes",
    "FeatureShard",
    "staged_outputs",
    "prepare",
]

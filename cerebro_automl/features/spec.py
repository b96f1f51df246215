"""FrozenFeatures: a frozen backbone whose layer outputs the trained models read.

Example:
    >>> import torch
    >>> def backbone():
    ...     torch.manual_seed(0)
    ...     net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    ...     return net.requires_grad_(False)
    >>> features = FrozenFeatures(backbone, layers={"low": "1", "high": "2"}, layer_key="layer")
    >>> features.layer_of({"layer": "high", "lr": 0.1})
    'high'
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["FrozenFeatures", "POOLS", "CACHES", "STORAGE_DTYPES"]

POOLS = (None, "avg", "max")
CACHES = ("auto", "memory", "disk")
STORAGE_DTYPES = (None, torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class FrozenFeatures:
    """Frozen layers computed once per partition, on the worker that holds it.

    The trainable part of each configuration, ``model_fn(config)``, reads the output
    of one layer of a frozen backbone: ``config[layer_key]`` names it. Each worker
    builds the backbone once, in eval mode, and, the first time a unit needs a
    partition's features, computes every layer in ``layers`` in one staged pass
    over the partition's training and validation rows, without gradients. The
    features stay on the worker for the session; only the trainable part's state
    hops and is checkpointed.

    Args:
        backbone_fn: ``() -> nn.Module`` whose parameters all have
            ``requires_grad=False``. It runs under a fixed torch seed, so a randomly
            initialized backbone is the same on every worker.
        layers: feature name -> submodule path, as ``nn.Module.get_submodule`` takes
            it (``"blocks.2"``); the feature is that submodule's output (a tensor,
            or the tuple or dict it returns).
        layer_key: the config key that picks a feature name.
        pool: ``"avg"`` or ``"max"`` reduces a tensor of shape ``(rows, C, ...)``
            over its spatial dimensions to ``(rows, C)``; None keeps it whole.
        dtype: storage dtype, ``torch.float16`` or ``torch.bfloat16`` to halve the
            memory; the trainable part receives float32. None keeps the backbone's.
        cache: ``"auto"`` keeps a partition's features in memory when they fit in
            ``max_memory`` and on the worker's disk when they do not; ``"memory"``
            refuses features that do not fit, naming the layer, the size and the
            budget; ``"disk"`` always writes them to the worker's disk.
        max_memory: bytes of features one partition may keep in memory; None: half
            of the worker's available memory when the features are computed.
        batch_size: rows per batch of the staged pass.
        scratch: folder for features on disk; None: the system's temporary folder.
    """

    backbone_fn: Callable[[], torch.nn.Module]
    layers: Mapping[str, str]
    layer_key: str = "layer"
    pool: str | None = None
    dtype: torch.dtype | None = None
    cache: str = "auto"
    max_memory: int | None = None
    batch_size: int = 256
    scratch: str | None = None
    # Pickled with the object, so every worker's copy finds the same cached features.
    key: str = field(default_factory=lambda: uuid.uuid4().hex, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not callable(self.backbone_fn) or isinstance(self.backbone_fn, torch.nn.Module):
            raise TypeError(
                f"backbone_fn is {self.backbone_fn!r}, but must be a function that builds the backbone: "
                "() -> nn.Module (e.g. lambda: resnet18(weights=...)), so that each worker builds its own"
            )
        if not isinstance(self.layers, Mapping) or not self.layers:
            raise ValueError(
                f"layers is {self.layers!r}, but must be a non-empty dict of feature name -> submodule path"
            )
        for name, path in self.layers.items():
            if not isinstance(name, str) or not isinstance(path, str):
                raise TypeError(
                    f"layers[{name!r}] is {path!r}, but layers maps str feature names to str submodule "
                    "paths such as 'blocks.2'"
                )
        object.__setattr__(self, "layers", dict(self.layers))
        if not isinstance(self.layer_key, str):
            raise TypeError(f"layer_key is {self.layer_key!r}, but must be a str config key")
        self._check_options()

    def _check_options(self) -> None:
        if self.pool not in POOLS:
            raise ValueError(f"pool is {self.pool!r}, but must be one of {POOLS}")
        if self.dtype not in STORAGE_DTYPES:
            raise ValueError(f"dtype is {self.dtype!r}, but must be one of {STORAGE_DTYPES}")
        if self.cache not in CACHES:
            raise ValueError(f"cache is {self.cache!r}, but must be one of {CACHES}")
        budget = self.max_memory
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 0):
            raise ValueError(f"max_memory is {budget!r}, but must be a number of bytes >= 0, or None")
        size = self.batch_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"batch_size is {size!r}, but must be a positive int")

    def layer_of(self, config: Mapping[str, Any]) -> str:
        """The feature name ``config`` picks; a ValueError names a missing key or an unknown name."""
        if self.layer_key not in config:
            raise ValueError(
                f"config {dict(config)} lacks key {self.layer_key!r}, which picks the frozen layer "
                f"its model reads: one of {sorted(self.layers)}"
            )
        name = config[self.layer_key]
        if not isinstance(name, str) or name not in self.layers:
            raise ValueError(
                f"config[{self.layer_key!r}] is {name!r}, but must name one of the frozen layers "
                f"{sorted(self.layers)} (FrozenFeatures(layers=...))"
            )
        return name

    def check_backbone(self, backbone: torch.nn.Module) -> None:
        """A ValueError when ``backbone`` is not a module, has a trainable parameter, or
        lacks a submodule that ``layers`` names."""
        if not isinstance(backbone, torch.nn.Module):
            raise TypeError(f"backbone_fn returned {type(backbone).__name__}, but must return a torch.nn.Module")
        trainable = [name for name, p in backbone.named_parameters() if p.requires_grad]
        if trainable:
            raise ValueError(
                f"the backbone's parameters {trainable[:5]}{' ...' if len(trainable) > 5 else ''} require "
                "gradients, but a frozen backbone is never trained: return "
                "module.requires_grad_(False) from backbone_fn, and build the layers to train in model_fn"
            )
        for name, path in self.layers.items():
            try:
                backbone.get_submodule(path)
            except AttributeError:
                children = [n for n, _ in backbone.named_modules() if n][:12]
                raise ValueError(
                    f"layers[{name!r}] is {path!r}, but the backbone has no such submodule; "
                    f"its submodules include {children}"
                ) from None

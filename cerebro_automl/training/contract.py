"""What the training loop reads of the spec it runs: :class:`RunSpec`.

The loop's modules (the loop, the plain hooks, batches, devices, precision, the
frozen base and the restore) name this protocol rather than
:class:`~cerebro_automl.training.TrainingSpec`, which names them (its default
hooks, its checks): so they depend on what they read, and the spec on them, and
not both ways. ``TrainingSpec`` and the Lightning adapter's spec satisfy it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch

from .schedulers import WarmupDecay

__all__ = ["RunSpec"]


class RunSpec(Protocol):
    """The fields and methods of a spec that a unit's training and validation read."""

    @property
    def model_fn(self) -> Callable[[Mapping[str, Any]], torch.nn.Module]: ...

    @property
    def optimizer_fn(self) -> Callable[[Mapping[str, Any], Any], torch.optim.Optimizer] | None: ...

    @property
    def loss_fn(self) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None: ...

    @property
    def metrics(self) -> Mapping[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]: ...

    @property
    def scheduler_fn(self) -> Callable[[Mapping[str, Any], torch.optim.Optimizer], Any] | None: ...

    @property
    def eval_batch_size(self) -> int: ...

    @property
    def device(self) -> str: ...

    @property
    def precision(self) -> str: ...

    @property
    def device_data_fraction(self) -> float: ...

    @property
    def lr_schedule(self) -> WarmupDecay | None: ...

    @property
    def gradient_clip_val(self) -> float | None: ...

    @property
    def accumulate_grad_batches(self) -> int: ...

    @property
    def frozen_base(self) -> bool: ...

    def forward(self, model: torch.nn.Module, x: Any, y: Any) -> tuple[Any, Any]: ...

    def transform(self, x: Any, y: Any, generator: torch.Generator | None) -> tuple[Any, Any]: ...

    def resolve_batch_size(self, config: Mapping[str, Any]) -> int: ...

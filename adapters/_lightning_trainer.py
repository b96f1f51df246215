"""What a Trainer would give a LightningModule, for one MOP unit without a Trainer:
the ``self.trainer`` stand-in, ``self.log`` as weighted sums, and the return
forms of ``configure_optimizers`` as one optimizer and its scheduler configs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from cerebro_automl.training.schedulers import SchedulerConfig, scheduler_config
from cerebro_automl.training.transfer import to_floats

__all__ = ["UnitTrainer", "LogCapture", "attached", "optimizer_and_schedulers"]


class UnitTrainer:
    """What a module may read from ``self.trainer`` inside a MOP unit."""

    def __init__(self, *, current_epoch: int, global_step: int, training: bool) -> None:
        self.current_epoch, self.global_step = current_epoch, global_step
        self.training, self.validating = training, not training
        self.sanity_checking = self.testing = self.predicting = False
        self.global_rank = self.local_rank = self.node_rank = 0
        self.world_size = self.num_devices = self.num_nodes = 1
        self.is_global_zero = True
        self.logger: Any = None
        self.loggers: list[Any] = []

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(
            f"trainer.{name} is not available: cerebro_automl drives this module without a Trainer "
            "(available: current_epoch, global_step, training, validating, global_rank, world_size, ...)"
        )


class LogCapture:
    """Stands in for ``LightningModule.log``: weighted sums per name for the epoch report.

    Logged tensors stay on their device until :meth:`flush` reads them all at once
    (reading one waits for the GPU) and adds them up in the order they were logged.
    """

    def __init__(self, sums: dict[str, list[float]]) -> None:
        self.sums, self.batch_size = sums, 1
        self.latest: dict[str, Any] = {}
        self._pending: list[tuple[str, Any, int]] = []

    def __call__(
        self, name: str, value: Any, *args: Any, reduce_fx: Any = "mean", batch_size: int | None = None, **kwargs: Any
    ) -> None:
        if reduce_fx not in ("mean", torch.mean):
            raise ValueError(
                f"self.log({name!r}, reduce_fx={reduce_fx!r}): only 'mean' is supported, "
                "since values are combined across partitions as weighted means"
            )
        if not isinstance(value, (torch.Tensor, int, float)):
            raise TypeError(
                f"self.log({name!r}, {type(value).__name__}): log a number or a tensor "
                "(for a torchmetrics Metric, log metric(preds, target))"
            )
        value = value.detach() if isinstance(value, torch.Tensor) else float(value)
        self._pending.append((name, value, batch_size if batch_size is not None else self.batch_size))
        self.latest[name] = value  # read (a wait) only by a scheduler that monitors it

    def flush(self) -> None:
        """Add the values logged since the last flush to ``sums``."""
        numbers = to_floats([value for _, value, _ in self._pending])
        for (name, _, weight), number in zip(self._pending, numbers, strict=True):
            acc = self.sums.setdefault(name, [0.0, 0.0])
            acc[0] += number * weight
            acc[1] += weight
        self._pending = []


class attached:
    """Attach the trainer stand-in and the log capture to a module for one pass; on
    leaving without an error, add up what was logged."""

    def __init__(self, module: Any, trainer: UnitTrainer, capture: LogCapture) -> None:
        self.module, self.trainer, self.capture = module, trainer, capture

    def __enter__(self) -> None:
        self.module.trainer = self.trainer  # the setter reaches nested LightningModules too
        self.module.log = self.capture  # an instance attribute: the class is not touched

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        self.module.trainer = None
        del self.module.log
        if exc_type is None:
            self.capture.flush()


def optimizer_and_schedulers(configured: Any) -> tuple[torch.optim.Optimizer, list[SchedulerConfig]]:
    """Normalize every ``configure_optimizers`` return form to one optimizer and scheduler configs."""
    # (What configure_optimizers returned, checked below: not yet known to be optimizers.)
    optimizers: list[Any] = []
    schedulers: list[Any] = []
    if isinstance(configured, torch.optim.Optimizer):
        optimizers = [configured]
    elif isinstance(configured, Mapping):
        optimizers = [configured.get("optimizer")]
        if configured.get("lr_scheduler") is not None:
            schedulers = [configured["lr_scheduler"]]
        if "monitor" in configured and schedulers and not isinstance(schedulers[0], Mapping):
            schedulers = [{"scheduler": schedulers[0], "monitor": configured["monitor"]}]
    elif isinstance(configured, (list, tuple)) and len(configured) == 2 and isinstance(configured[0], (list, tuple)):
        optimizers, schedulers = list(configured[0]), list(configured[1])
    elif isinstance(configured, (list, tuple)):
        optimizers = [c["optimizer"] if isinstance(c, Mapping) else c for c in configured]
        schedulers = [c["lr_scheduler"] for c in configured if isinstance(c, Mapping) and c.get("lr_scheduler")]
    if len(optimizers) != 1:
        raise ValueError(
            f"configure_optimizers returned {len(optimizers)} optimizers, but automatic "
            "optimization trains with exactly one (Lightning 2 needs manual optimization "
            "for several, which cerebro_automl does not drive)"
        )
    if not isinstance(optimizers[0], torch.optim.Optimizer):
        raise TypeError(
            f"configure_optimizers gave {optimizers[0]!r} as the optimizer, but it must be a torch.optim.Optimizer"
        )
    return optimizers[0], [scheduler_config(s) for s in schedulers]

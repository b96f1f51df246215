"""Learning-rate schedulers in a pass: when each steps, and the one form their
state takes in a model state, whichever spec trained it; and :class:`WarmupDecay`,
the per-step schedule of fine-tuning recipes (HF Trainer's ``warmup_ratio`` and
``lr_scheduler_type``) over a model's budget.

A :class:`WarmupDecay` is a function of the model's progress through its budget,
which every unit computes from what it already knows: the epoch, the unit's place
in it, its batch and the budget. Nothing about it hops, no total step count is
needed in advance, and the learning rate of a step is the same whichever worker
runs it.

    >>> schedule = WarmupDecay(warmup=0.1, decay="linear")
    >>> [round(schedule.multiplier(p), 2) for p in (0.05, 0.1, 0.55, 1.0)]
    [0.5, 1.0, 0.5, 0.0]

``state["scheduler"]`` is None when the model has no LR scheduler, the
scheduler's ``state_dict()`` when it has one, and a list of them (in the order
the spec configured them) when it has several.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "SchedulerConfig",
    "scheduler_config",
    "step_schedulers",
    "scheduler_state",
    "saved_scheduler_states",
    "WarmupDecay",
    "UnitProgress",
    "unit_progress",
    "mark_initial_lr",
    "keep_initial_lr",
    "apply_schedule",
]

INTERVALS = ("epoch", "step")


@dataclass(frozen=True)
class SchedulerConfig:
    """One LR scheduler and when it steps, as Lightning's ``lr_scheduler`` dict says it.

    Args:
        scheduler: a ``torch.optim.lr_scheduler`` object (anything with ``step``,
            ``state_dict`` and ``load_state_dict``).
        interval: ``"epoch"`` (once per model-epoch, at its end) or ``"step"``
            (after optimizer steps).
        frequency: steps when the epoch or step count is a multiple of it.
        monitor: the name of the value passed to ``scheduler.step`` (ReduceLROnPlateau).
    """

    scheduler: Any
    interval: str = "epoch"
    frequency: int = 1
    monitor: str | None = None

    def __post_init__(self) -> None:
        if self.interval not in INTERVALS:
            raise ValueError(f"lr_scheduler interval is {self.interval!r}, but must be 'epoch' or 'step'")
        if isinstance(self.frequency, bool) or not isinstance(self.frequency, int) or self.frequency < 1:
            raise ValueError(f"lr_scheduler frequency is {self.frequency!r}, but must be a positive int")


def scheduler_config(scheduler: Any) -> SchedulerConfig:
    """A scheduler, or Lightning's dict form of one (``{"scheduler": s, "interval": "step"}``),
    as a :class:`SchedulerConfig`."""
    given = scheduler if isinstance(scheduler, Mapping) else {"scheduler": scheduler}
    config = SchedulerConfig(
        given["scheduler"],
        interval=given.get("interval", "epoch"),
        frequency=given.get("frequency", 1),
        monitor=given.get("monitor"),
    )
    if isinstance(config.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau) and not config.monitor:
        raise ValueError(
            "lr_scheduler is a ReduceLROnPlateau without a 'monitor'; return "
            "{'scheduler': ..., 'monitor': 'train_loss'} (a value logged in training_step)"
        )
    return config


def step_schedulers(
    schedulers: Sequence[SchedulerConfig], interval: str, count: int, values: Mapping[str, float]
) -> None:
    """Step the schedulers of ``interval`` whose ``frequency`` divides ``count`` (Lightning's
    rule); a scheduler with a ``monitor`` steps on ``values[monitor]``."""
    for config in schedulers:
        if config.interval != interval or count % config.frequency:
            continue
        if config.monitor is None:
            config.scheduler.step()
            continue
        if config.monitor not in values:
            raise ValueError(
                f"lr_scheduler monitors {config.monitor!r}, but at the end of a training "
                f"{interval} only these values are known: {sorted(values)}; under MOP an epoch's "
                "validation runs after its training on other workers, so monitor a value logged "
                "in training_step"
            )
        config.scheduler.step(values[config.monitor])


def scheduler_state(schedulers: Sequence[SchedulerConfig]) -> dict[str, Any] | list[dict[str, Any]] | None:
    """What ``state["scheduler"]`` holds after a pass (see the module's docstring)."""
    if not schedulers:
        return None
    if len(schedulers) == 1:
        return schedulers[0].scheduler.state_dict()
    return [config.scheduler.state_dict() for config in schedulers]


def saved_scheduler_states(saved: Any) -> list[Any]:
    """The per-scheduler states in ``state["scheduler"]``, in order (none for None).

    >>> saved_scheduler_states(None), saved_scheduler_states({"last_epoch": 2})
    ([], [{'last_epoch': 2}])
    """
    if saved is None:
        return []
    return list(saved) if isinstance(saved, list) else [saved]


DECAYS = ("linear", "cosine", "constant")


@dataclass(frozen=True)
class WarmupDecay:
    """The learning rate of every optimizer step: the config's, times a multiplier
    that rises linearly from 0 over the first ``warmup`` fraction of the budget, then
    falls to ``final`` by its end (``"linear"`` or ``"cosine"``) or stays (``"constant"``).

    Args:
        warmup: the fraction of the budget spent warming up, in [0, 1).
        decay: ``"linear"``, ``"cosine"`` or ``"constant"``.
        final: the multiplier at the budget's end, in [0, 1].
        epochs: the budget the schedule spans: None (default) takes the model's
            epoch budget as the unit runs; an int, or the name of a config key,
            fixes it. A tuner that extends models (ASHA, Hyperband, PBT) should fix
            it to the largest budget, so that a promoted model continues its decay
            instead of starting a new one; past ``epochs`` the multiplier stays at
            ``final``.
    """

    warmup: float = 0.0
    decay: str = "linear"
    final: float = 0.0
    epochs: int | str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, (int, float)) or not 0 <= self.warmup < 1:
            raise ValueError(f"warmup is {self.warmup!r}, but must be a fraction of the budget in [0, 1)")
        if self.decay not in DECAYS:
            raise ValueError(f"decay is {self.decay!r}, but must be one of {DECAYS}")
        if isinstance(self.final, bool) or not isinstance(self.final, (int, float)) or not 0 <= self.final <= 1:
            raise ValueError(f"final is {self.final!r}, but must be a multiplier in [0, 1]")
        e = self.epochs
        if e is not None and not isinstance(e, str) and (isinstance(e, bool) or not isinstance(e, int) or e < 1):
            raise ValueError(f"epochs is {e!r}, but must be None, a positive int or a config key")

    def multiplier(self, progress: float) -> float:
        """The learning rate's multiplier at ``progress`` (the fraction of the budget done, >= 0)."""
        if not progress >= 0:
            raise ValueError(f"progress is {progress!r}, but must be a fraction of the budget >= 0")
        if progress >= 1:
            return float(self.final)
        if self.warmup and progress < self.warmup:
            return progress / self.warmup
        if self.decay == "constant":
            return 1.0
        rest = (progress - self.warmup) / (1 - self.warmup)
        shape = 1 - rest if self.decay == "linear" else 0.5 * (1 + math.cos(math.pi * rest))
        return float(self.final + (1 - self.final) * shape)

    def horizon(self, config: Mapping[str, Any], budget: int) -> int:
        """The budget, in epochs, that the schedule spans for ``config``."""
        if self.epochs is None:
            return budget
        if isinstance(self.epochs, str):
            if self.epochs not in config:
                raise ValueError(
                    f"WarmupDecay(epochs={self.epochs!r}) names config key {self.epochs!r}, which config "
                    f"{dict(config)} lacks"
                )
            value = config[self.epochs]
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"WarmupDecay(epochs={self.epochs!r}) names config key {self.epochs!r}, which is "
                    f"{value!r} in config {dict(config)}, but must be a positive int"
                )
            return value
        return self.epochs


@dataclass(frozen=True)
class UnitProgress:
    """Where a unit stands in its model's budget: epoch ``epoch`` (0-based), unit
    ``step`` of the epoch's ``partitions``, over a budget of ``epochs`` epochs."""

    epoch: int
    step: int
    partitions: int
    epochs: int

    def at(self, batch: int, batches: int) -> float:
        """The fraction of the budget done once batch ``batch`` (0-based) of the unit's
        ``batches`` has trained."""
        within = (self.step + (batch + 1) / max(batches, 1)) / self.partitions
        return (self.epoch + within) / self.epochs


def unit_progress(
    schedule: WarmupDecay | None,
    config: Mapping[str, Any],
    epoch: int,
    step: int,
    budget: int | None,
    partitions: int | None,
) -> UnitProgress | None:
    """Where a unit of ``config``'s model stands in the span of ``schedule`` (None: no schedule)."""
    if schedule is None:
        return None
    if budget is None or partitions is None:
        raise ValueError("the spec has an lr_schedule, but the unit was not told its model's budget and partitions")
    return UnitProgress(epoch, step, partitions, schedule.horizon(config, budget))


def mark_initial_lr(optimizer: torch.optim.Optimizer) -> list[float]:
    """Record each group's learning rate as ``initial_lr`` (the schedule's base), where
    a group has none: it is saved in the optimizer's state, so it hops with it. Returns
    each group's ``initial_lr``, for :func:`keep_initial_lr` after a restore."""
    for group in optimizer.param_groups:
        group.setdefault("initial_lr", group["lr"])
    return [group["initial_lr"] for group in optimizer.param_groups]


def keep_initial_lr(optimizer: torch.optim.Optimizer, initial: Sequence[float]) -> None:
    """After a restore, which replaces the groups with the saved ones: a group saved
    without an ``initial_lr`` (by a run without the schedule) gets the config's."""
    for group, value in zip(optimizer.param_groups, initial, strict=False):
        group.setdefault("initial_lr", value)


def apply_schedule(optimizer: torch.optim.Optimizer, multiplier: float) -> None:
    """Set every group's learning rate to its ``initial_lr`` times ``multiplier``."""
    for group in optimizer.param_groups:
        group["lr"] = group["initial_lr"] * multiplier

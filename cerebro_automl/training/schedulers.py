"""Learning-rate schedulers in a pass: when each steps, and the one form their
state takes in a model state, whichever spec trained it.

``state["scheduler"]`` is None when the model has no LR scheduler, the
scheduler's ``state_dict()`` when it has one, and a list of them (in the order
the spec configured them) when it has several.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["SchedulerConfig", "step_schedulers", "scheduler_state", "saved_scheduler_states"]

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

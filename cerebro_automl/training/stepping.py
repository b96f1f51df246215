"""How a pass's batches become optimizer steps: gradient accumulation, clipping by
norm, and the learning rate a :class:`~cerebro_automl.training.schedulers.WarmupDecay`
gives each step. The one training loop asks it before and after every backward."""

from __future__ import annotations

import torch

from .schedulers import UnitProgress, WarmupDecay, apply_schedule

__all__ = ["Stepping"]


class Stepping:
    """How batches become optimizer steps: ``accumulate`` batches a step, the
    gradients' norm clipped to ``clip`` (None: not clipped), and the learning rate
    of each step set by ``schedule`` at the unit's ``progress`` (None: as it is)."""

    def __init__(
        self,
        accumulate: int = 1,
        clip: float | None = None,
        schedule: WarmupDecay | None = None,
        progress: UnitProgress | None = None,
    ) -> None:
        self.accumulate, self.clip = accumulate, clip
        self.schedule, self.progress = schedule, progress
        self.held = 0  # batches whose gradients wait for the next step
        self.batches = 0  # the unit's batches, for the schedule

    def set_lr(self, optimizer: torch.optim.Optimizer, batch: int) -> None:
        """The learning rate of the step after batch ``batch`` of the unit (0-based)."""
        if self.schedule is not None and self.progress is not None:
            apply_schedule(optimizer, self.schedule.multiplier(self.progress.at(batch, self.batches)))

    def starts_group(self) -> bool:
        return self.held == 0

    def step_now(self) -> bool:
        """After a batch's backward: whether its group is complete."""
        self.held += 1
        if self.held < self.accumulate:
            return False
        self.held = 0
        return True

    def take_remainder(self) -> bool:
        """At the pass's end: whether its last batches wait for their step (a step's
        gradients never hop to the next unit); the count starts over."""
        if self.held == 0:
            return False
        self.held = 0
        return True

    def clip_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        if self.clip is not None:
            params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
            torch.nn.utils.clip_grad_norm_(params, self.clip)

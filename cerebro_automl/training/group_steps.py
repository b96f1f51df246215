"""How a fused group's batches become optimizer steps: the rules of
:class:`~cerebro_automl.training.stepping.Stepping` (gradient accumulation, clipping
by norm, the spec's ``lr_schedule``) and the members' per-step LR schedulers, for
every member at once, so that a member steps as its own unit would step it.

The members' own optimizers hold their learning rates: a schedule or scheduler
sets them there, as in the member's own pass, and the fused optimizer reads them
again before its next step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..fusion import FusedOptimizer
from .schedulers import SchedulerConfig, UnitProgress, WarmupDecay, apply_schedule, step_schedulers
from .stepping import Stepping

__all__ = ["GroupStepping"]


class GroupStepping:
    """The steps of a fused pass of ``batches`` batches: ``accumulate`` batches a step,
    each member's gradients clipped to a norm of ``clip``, each member's learning rate
    set by ``schedule`` at its own ``progress`` before the step, and its ``step``
    interval ``schedulers`` stepped after it."""

    def __init__(
        self,
        fused: FusedOptimizer,
        optimizers: Sequence[torch.optim.Optimizer],
        schedulers: Sequence[Sequence[SchedulerConfig]],
        *,
        accumulate: int = 1,
        clip: float | None = None,
        schedule: WarmupDecay | None = None,
        progress: Sequence[UnitProgress | None] = (),
        batches: int = 0,
    ) -> None:
        self.fused, self.optimizers = fused, list(optimizers)
        self.groups = Stepping(accumulate)  # counts the batches of each step
        self.accumulate, self.clip, self.batches = accumulate, clip, batches
        self.schedule = schedule
        self.progress = [p for p in progress if p is not None]
        self.by_step = [[c for c in member if c.interval == "step"] for member in schedulers]
        self._any_by_step = any(self.by_step)

    def starts_group(self) -> bool:
        """Whether the next batch starts a step's batches (its gradients start from zero)."""
        return self.groups.starts_group()

    def step_now(self) -> bool:
        """After a batch's backward: whether its step's batches are complete."""
        return self.groups.step_now()

    def pending(self) -> bool:
        """Whether the pass ended within a step's batches (their step is still to take)."""
        if self.groups.starts_group():
            return False
        self.groups.held = 0
        return True

    def step(self, batch: int, active: torch.Tensor | None = None) -> None:
        """The optimizer step after batch ``batch`` of the pass (0-based); ``active``: see
        :meth:`FusedOptimizer.step`."""
        if self.schedule is not None and self.progress:
            for optimizer, progress in zip(self.optimizers, self.progress, strict=True):
                apply_schedule(optimizer, self.schedule.multiplier(progress.at(batch, self.batches)))
            self.fused.set_lrs()
        if self.clip is not None:
            self.fused.clip_grad_norms(self.clip)
        self.fused.step(active)
        if self._any_by_step:
            for optimizer, schedulers in zip(self.optimizers, self.by_step, strict=True):
                optimizer.__dict__["_opt_called"] = True  # the fused step stepped it
                step_schedulers(schedulers, "step", batch + 1, {})
            self.fused.set_lrs()

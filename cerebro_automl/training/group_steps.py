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
from .schedulers import SchedulerConfig, UnitProgress, WarmupDecay, step_schedulers
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
        batches: int,
        accumulate: int = 1,
        clip: float | None = None,
        schedule: WarmupDecay | None = None,
        progress: Sequence[UnitProgress | None] = (),
    ) -> None:
        self.fused, self.optimizers = fused, list(optimizers)
        self.counting = Stepping(accumulate)  # the batches of each step
        self.accumulate, self.clip = accumulate, clip
        # Each member's learning rate, as its own pass's Stepping sets it.
        self.rates = [] if schedule is None else [Stepping(schedule=schedule, progress=p) for p in progress]
        if schedule is not None and (len(self.rates) != len(self.optimizers) or None in progress):
            raise ValueError("an lr_schedule needs every member's progress in its budget")
        for rate in self.rates:
            rate.batches = batches
        self.by_step = [[c for c in member if c.interval == "step"] for member in schedulers]
        self._any_by_step = any(self.by_step)

    def zero_grad(self) -> None:
        """Before a batch: the gradients start from zero where it starts a step's batches."""
        if self.counting.starts_group():
            self.fused.zero_grad()

    def step_now(self) -> bool:
        """After a batch's backward: whether its step's batches are complete."""
        return self.counting.step_now()

    def take_remainder(self) -> bool:
        """At the pass's end: whether its last batches wait for their step."""
        return self.counting.take_remainder()

    def step(self, batch: int, active: torch.Tensor | None = None) -> None:
        """The optimizer step after batch ``batch`` of the pass (0-based); ``active``: see
        :meth:`FusedOptimizer.step`."""
        if self.rates:
            for rate, optimizer in zip(self.rates, self.optimizers, strict=True):
                rate.set_lr(optimizer, batch)
            self.fused.set_lrs()
        if self.clip is not None:
            self.fused.clip_grad_norms(self.clip)
        self.fused.step(active)
        if self._any_by_step:
            for optimizer, schedulers in zip(self.optimizers, self.by_step, strict=True):
                optimizer.__dict__["_opt_called"] = True  # the fused step stepped it
                step_schedulers(schedulers, "step", batch + 1, {})
            self.fused.set_lrs()

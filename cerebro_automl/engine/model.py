"""A model's record: where it stands in its budget, its epoch and its faults. Its
status changes only through :mod:`.lifecycle`; its unit runs live in :mod:`.runs`."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..protocol import ModelStatus

__all__ = ["ModelRecord"]


@dataclass
class ModelRecord:
    """Where one model stands. Its unit runs live in the engine's ``Runs``."""

    model_id: int
    ordinal: int
    offset: int
    budget: int
    status: ModelStatus = ModelStatus.TRAINING
    epochs_done: int = 0
    visited: list[int] = field(default_factory=list)  # this epoch, in order
    eval_workers: tuple[str, ...] = ()  # the workers of its latest Evaluate, by partition
    state_worker: str | None = None  # holds the newest state; None: initial
    epoch_start_worker: str | None = None  # holds the state this epoch started from
    epoch_start_lost: bool = False  # ... which died with its worker: replay further back
    epoch_start: int = 0  # epochs done when this epoch started
    last_order: tuple[int, ...] = ()
    reported: int = 0  # highest epoch reported
    reported_unit: tuple[int, int] = (0, 0)  # highest (epoch, unit) reported inside an epoch
    finished_at: int = 0  # budget at the last Pause
    eval_pending: bool = False  # EVALUATING, its Evaluate wanted but not yet issued
    reported_orders: dict[int, tuple[int, ...]] = field(default_factory=dict)  # epoch -> order (reported so far)
    durable_epoch: int = 0  # the driver keeps the state after these epochs
    durable: bool = False  # ... it keeps one (else: replay from the seed)
    retries: list[str] = field(default_factory=list)  # why its work was lost, in a row
    restarted: tuple[int, int] | None = None  # (epoch, step) of its unit last restarted
    widths: dict[int, tuple[int, int]] = field(default_factory=dict)  # epoch (1-based) -> (gang width, lane)

    @property
    def finished(self) -> bool:
        """Stopped or failed: final."""
        return self.status in (ModelStatus.STOPPED, ModelStatus.FAILED)

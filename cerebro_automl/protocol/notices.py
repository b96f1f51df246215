"""Notices: what the engine tells the session (a model's epoch is reported, it
paused or failed, its state is due for a checkpoint, the session cannot go on).
Only the session handles them; executors never see one."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Notice", "NOTICES", "Checkpoint", "Report", "Pause", "Fail", "Abort"]


@dataclass(frozen=True)
class Checkpoint:
    """The model's state after ``epoch`` epochs is due to be written to disk."""

    model_id: int
    epoch: int


@dataclass(frozen=True)
class Report:
    """Epoch ``epoch`` (1-based) of the model is trained and evaluated; with ``unit``,
    only that many of its units are (a report inside the epoch)."""

    model_id: int
    epoch: int
    order: tuple[int, ...]  # the partitions in the order the epoch visited them
    unit: int | None = None


@dataclass(frozen=True)
class Pause:
    """The model spent its budget of ``epochs`` and is paused, its state kept
    (``extend`` resumes it)."""

    model_id: int
    epochs: int


@dataclass(frozen=True)
class Fail:
    """The model failed with ``error`` (its code raised, or its work was lost too often)."""

    model_id: int
    error: str


@dataclass(frozen=True)
class Abort:
    """The session cannot go on (a partition keeps failing to load): stop with ``error``."""

    partition: int
    error: str


Notice = Checkpoint | Report | Pause | Fail | Abort
NOTICES = (Checkpoint, Report, Pause, Fail, Abort)

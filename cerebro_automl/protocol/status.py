"""A model's status, as the engine keeps it and the session shows it."""

from __future__ import annotations

from enum import Enum

__all__ = ["ModelStatus"]


class ModelStatus(str, Enum):
    TRAINING = "training"  # budget left, trains its next unit when one is free
    EVALUATING = "evaluating"  # epoch trained, waiting for its validation metrics
    PAUSED = "paused"  # budget spent, state kept: extend() resumes it
    STOPPED = "stopped"
    FAILED = "failed"

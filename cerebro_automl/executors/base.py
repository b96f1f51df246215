"""What every executor does: carry out the scheduler's instructions, report events.

An executor holds the model states (or references to them) and the loaded
partitions. It never decides anything: the scheduler does. ``execute`` takes
instructions; ``poll`` returns :class:`Completion` objects, each an event for
the scheduler plus, for an evaluation, the epoch's metrics.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..data import PartitionedDataset
from ..scheduler import Event, Instruction
from ..training import TrainingSpec

__all__ = ["Completion", "Executor", "ModelRecord"]


@dataclass(frozen=True)
class Completion:
    event: Event
    metrics: dict[str, float] | None = None  # with an EvaluationDone


@dataclass
class ModelRecord:
    """What an executor keeps of one model.

    ``current`` is the newest state (None: initial weights); ``ends`` maps
    epochs to the state after them, the newest two, for evaluation and rollback.
    """
    config: Mapping[str, Any]
    seed: int
    current: Any = None
    ends: dict[int, Any] = field(default_factory=dict)

    def keep_end(self, epoch: int, state: Any) -> None:
        self.ends[epoch] = state
        for old in [e for e in self.ends if e < epoch - 1]:
            del self.ends[old]

    def rollback(self, epoch: int) -> None:
        self.current = None if epoch == 0 else self.ends[epoch]
        for later in [e for e in self.ends if e > epoch]:
            del self.ends[later]


class Executor(ABC):
    """Runs units somewhere. Subclasses: LocalExecutor, DaskExecutor."""

    spec: TrainingSpec
    data: PartitionedDataset
    threads: int
    unit_timeout: float | None = None  # seconds; a train unit running longer fails its model

    @abstractmethod
    def workers(self) -> list[str]:
        """The names of the workers now alive, sorted."""

    @abstractmethod
    def bind(self, spec: TrainingSpec, data: PartitionedDataset, threads: int) -> None:
        """Take the session's spec, its resolved dataset and the torch thread count."""

    @abstractmethod
    def add_model(self, model_id: int, config: Mapping[str, Any], seed: int,
                  state: dict | None = None, epoch: int = 0) -> None:
        """Register a model before the scheduler learns of it; ``state`` (the state
        after ``epoch`` epochs, from a checkpoint) resumes it."""

    @abstractmethod
    def execute(self, instruction: Instruction) -> None:
        """Start carrying out one instruction (it may finish later, seen through poll)."""

    @abstractmethod
    def poll(self, timeout: float) -> list[Completion]:
        """Wait up to ``timeout`` seconds for work to finish; return what finished."""

    @abstractmethod
    def fetch_state(self, model_id: int, epoch: int | None = None) -> dict:
        """Bring a model's state to the driver: the newest, or the one after ``epoch``."""

    @abstractmethod
    def close(self) -> None:
        """Free everything the executor holds or started."""

    def busy(self) -> bool:
        """True while work is in flight."""
        return False

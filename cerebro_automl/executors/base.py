"""What every executor does: carry out the engine's commands, report events.

An executor holds the model states (or references to them) and the loaded
partitions. It never decides anything: the scheduler does. ``execute`` takes
instructions; ``poll`` returns :class:`Completion` objects, each an event for
the scheduler plus, for an evaluation, the epoch's metrics.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..data import PartitionedDataset
from ..protocol import Command, Event
from ..training import TrainingSpec, describe_device

__all__ = [
    "Completion",
    "Executor",
    "ModelRecord",
    "StateUnavailable",
    "FETCH_TIMEOUT",
    "partition_count",
    "partition_sources",
]

FETCH_TIMEOUT = 120.0  # seconds a state may take to reach the driver before fetch_state gives up


def partition_count(data: PartitionedDataset) -> int:
    """How many partitions ``data`` has, once resolved (see ``PartitionedDataset.resolve``)."""
    if data.num_partitions is None:
        raise ValueError("the dataset's number of partitions is None, but it must be resolved first")
    return data.num_partitions


def partition_sources(data: PartitionedDataset) -> tuple:
    """The source of each partition of ``data``, once resolved (see ``PartitionedDataset.resolve``)."""
    if data.sources is None:
        raise ValueError("the dataset's sources are None, but it must be resolved first")
    return data.sources


class StateUnavailable(RuntimeError):
    """A model state could not be brought to the driver: ``lost`` when it died with
    its worker (the scheduler rolls the model back and recomputes it), otherwise
    it did not arrive in time."""

    def __init__(self, message: str, *, lost: bool) -> None:
        super().__init__(message)
        self.lost = lost


@dataclass(frozen=True)
class Completion:
    event: Event
    metrics: dict[str, float] | None = None  # with an EvaluationDone


@dataclass
class ModelRecord:
    """What an executor keeps of one model.

    ``current`` is the newest state (None: initial weights); ``ends`` maps
    epochs to the state after them, the newest two, for evaluation and rollback;
    ``durable`` is ``(epoch, state)`` of a model that started from a given state
    (a checkpoint, a fork, a warm start), a copy on the driver that no worker can
    lose. ``fresh_at``: the epoch whose first unit starts from another config's
    state, so the config's optimizer hyperparameters must win over the state's.
    """

    config: Mapping[str, Any]
    seed: int
    current: Any = None
    ends: dict[int, Any] = field(default_factory=dict)
    durable: tuple[int, Any] | None = None
    fresh_at: int | None = None

    def fresh_hyperparameters(self, epoch: int, step: int) -> bool:
        """Whether the unit at (``epoch``, ``step``) starts from another config's state."""
        return step == 0 and epoch == self.fresh_at

    def evaluated(self, epoch: int, unit: int) -> Any:
        """The state an ``Evaluate(epoch, unit=unit)`` reads: the one after ``epoch``
        epochs, or, inside the next epoch (``unit`` > 0), the newest."""
        return self.current if unit else self.ends[epoch]

    def keep_end(self, epoch: int, state: Any) -> None:
        self.ends[epoch] = state
        for old in [e for e in self.ends if e < epoch - 1]:
            del self.ends[old]

    def rollback(self, epoch: int, durable: bool = False) -> None:
        if durable:
            if self.durable is None or self.durable[0] != epoch:
                raise RuntimeError(
                    f"rollback to the driver's copy after epoch {epoch}, but the "
                    f"driver keeps {None if self.durable is None else self.durable[0]}"
                )
            self.current = self.ends[epoch] = self.durable[1]
        else:
            self.current = None if epoch == 0 else self.ends[epoch]
        for later in [e for e in self.ends if e > epoch]:
            del self.ends[later]


class Executor(ABC):
    """Runs units somewhere. Subclasses: LocalExecutor, DaskExecutor."""

    spec: TrainingSpec
    data: PartitionedDataset
    threads: int
    # The executor's models; a subclass that keeps them elsewhere overrides held_epochs.
    _models: dict[int, ModelRecord]
    unit_timeout: float | None = None  # seconds; a train unit running longer fails its model
    gang_units: bool = False  # it runs a TrainGang (one model on several workers at once)

    @abstractmethod
    def workers(self) -> list[str]:
        """The names of the workers now alive, sorted."""

    deterministic: bool = True

    @abstractmethod
    def bind(self, spec: TrainingSpec, data: PartitionedDataset, threads: int, deterministic: bool = True) -> None:
        """Take the session's spec, its resolved dataset, the torch thread count and
        whether CUDA units must use deterministic kernels."""

    def devices(self, workers: Sequence[str] | None = None) -> dict[str, str]:
        """What each worker (or each of ``workers``) runs units on, as
        :func:`~cerebro_automl.training.describe_device` says."""
        return {w: describe_device(self.spec) for w in (workers or self.workers())}

    def gpus(self, workers: Sequence[str] | None = None) -> dict[str, str | None]:
        """The UUID of the GPU each worker (or each of ``workers``) runs units on;
        None for a worker on the CPU. Here none: this process runs one unit at a time."""
        return {}

    def wait_for_workers(self, n: int, timeout: float | None) -> None:
        """Wait until at least ``n`` workers are alive; raise TimeoutError after ``timeout`` s."""
        if len(self.workers()) < n:
            raise ValueError(f"min_workers is {n}, but this executor has {len(self.workers())} workers")

    def missing_workers(self) -> str:
        """What the cluster's manager says of workers asked for that have not joined
        (a batch queue's refusal, say); empty when it says nothing."""
        return ""

    @abstractmethod
    def add_model(
        self,
        model_id: int,
        config: Mapping[str, Any],
        seed: int,
        state: dict | None = None,
        epoch: int = 0,
        *,
        fresh_hyperparameters: bool = False,
        worker: str | None = None,
    ) -> str | None:
        """Register a model before the scheduler learns of it; ``state`` (the state
        after ``epoch`` epochs: a checkpoint, a warm start) starts it, with the
        config's optimizer hyperparameters in force when ``fresh_hyperparameters``.
        Executors that hold states on workers send it to ``worker`` (the engine's
        ``Scheduler.state_home``). Returns the worker holding it, so the scheduler
        knows where it lives (None: none, or the send failed)."""

    def set_config(self, model_id: int, config: Mapping[str, Any]) -> None:
        """The model's units sent from now on take ``config`` (a fusion group whose
        members left: the next unit drops their slices)."""
        self._models[model_id].config = config

    def held_epochs(self, model_id: int) -> set[int]:
        """The epochs after which the executor still holds the model's state (its
        newest two epoch ends; executors keep their ModelRecords in ``_models``)."""
        return set(self._models[model_id].ends)

    def add_fork(
        self,
        model_id: int,
        config: Mapping[str, Any],
        seed: int,
        parent_id: int,
        epoch: int,
        state: dict,
        *,
        worker: str | None = None,
    ) -> str | None:
        """Register a model that starts from model ``parent_id``'s state after ``epoch``
        epochs, of which ``state`` is the driver's copy (kept against worker losses).
        Executors that hold states on workers start it from the parent's copy there
        (from the driver's copy, sent to ``worker``, where none is held). Returns the
        worker holding the start state (None: none)."""
        return self.add_model(model_id, config, seed, state, epoch, fresh_hyperparameters=True, worker=worker)

    def partition_fingerprints(self, partitions: Iterable[int]) -> dict[int, dict]:
        """The fingerprints (see :mod:`cerebro_automl.data.fingerprint`) of those of
        ``partitions`` loaded now, as their workers took them when they loaded them.
        An executor that cannot tell returns none."""
        return {}

    @abstractmethod
    def execute(self, instruction: Command) -> None:
        """Start carrying out one command (it may finish later, seen through poll)."""

    @abstractmethod
    def poll(self, timeout: float) -> list[Completion]:
        """Wait up to ``timeout`` seconds for work to finish; return what finished."""

    def fetch_state(self, model_id: int, epoch: int | None = None, timeout: float = FETCH_TIMEOUT) -> dict:
        """Bring a model's state to the driver: the newest, or the one after ``epoch``.
        Raises :class:`StateUnavailable` when it was lost or took over ``timeout`` s."""
        return self.state_fetcher(model_id, epoch)(timeout)

    @abstractmethod
    def state_fetcher(self, model_id: int, epoch: int | None = None) -> Callable[[float], dict]:
        """A function ``fetch(timeout)`` that brings the state named now to the driver.
        Picking the state must happen on the driver's thread; the function may then
        run on another (the checkpoint writer)."""

    @abstractmethod
    def close(self) -> None:
        """Free everything the executor holds or started."""

    def busy(self) -> bool:
        """True while work is in flight."""
        return False


def idle_wait(delay: float, timeout: float) -> float:
    """Sleep ``min(delay, timeout)`` when there is nothing to wait on, so a driver with
    no work in flight does not spin; returns the next delay (doubling up to ``timeout``)."""
    time.sleep(max(0.0, min(delay, timeout)))
    return min(delay * 2, max(timeout, 0.01))

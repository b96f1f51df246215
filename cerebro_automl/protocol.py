"""The protocol between the MOP scheduler and the executors: what happened
(events, which executors and the session report) and what to do (instructions,
which the scheduler returns). Plain frozen dataclasses: an executor imports
this module, not the scheduler.

An executor reports every event once, in the order it learns of them, and
carries out the instructions in the order given; work it cannot start (its
worker already gone) it reports back as cancelled or failed, for the scheduler
to judge. See :mod:`cerebro_automl.scheduler` for what the scheduler does with
each event.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Union

__all__ = [
    "ModelStatus", "Event", "Instruction", "NewModel", "ModelsAdded", "BudgetExtended",
    "ModelStopped", "UnitDone", "UnitFailed", "EvaluationDone", "WorkerAdded", "Tick", "UnitProgress",
    "Executing", "WorkerLost", "PartitionPlaced", "PlaceFailed", "PartitionLost",
    "UnitCancelled", "EvaluationCancelled", "StatesLost", "Place", "Train", "Evaluate", "Drop",
    "Discard", "AskProgress", "Checkpoint", "Report", "Pause", "Finish", "Fail", "Rollback", "Release",
    "Abort",
]


class ModelStatus(str, Enum):
    TRAINING = "training"      # budget left, trains its next unit when one is free
    EVALUATING = "evaluating"  # epoch trained, waiting for its validation metrics
    PAUSED = "paused"          # budget spent, state kept: extend() resumes it
    STOPPED = "stopped"
    FAILED = "failed"


# ----------------------------------------------------------------------- events
@dataclass(frozen=True)
class NewModel:
    model_id: int
    epochs: int
    offset: int | None = None  # Latin-order offset; None: the model's ordinal
    start_epoch: int = 0       # epochs already trained: a model resumed from a checkpoint
    # The worker the resumed state was sent to (None: no worker holds it). The driver
    # keeps its own copy of a resumed state, so losing that worker costs no epochs.
    state_worker: str | None = None
    # A model with start_epoch > 0 starts from a given state (a checkpoint, a fork);
    # from_state says that one with start_epoch 0 does too (a warm start).
    from_state: bool = False


@dataclass(frozen=True)
class ModelsAdded:
    models: tuple[NewModel, ...]


@dataclass(frozen=True)
class BudgetExtended:
    model_id: int
    epochs: int  # epochs added to the budget


@dataclass(frozen=True)
class ModelStopped:
    model_id: int


@dataclass(frozen=True)
class UnitDone:
    model_id: int
    partition: int
    worker: str


@dataclass(frozen=True)
class UnitFailed:
    model_id: int
    partition: int
    worker: str
    error: str


@dataclass(frozen=True)
class EvaluationDone:
    model_id: int
    epoch: int
    error: str | None = None


@dataclass(frozen=True)
class WorkerAdded:
    worker: str


@dataclass(frozen=True)
class Tick:
    """The executor's clock reads ``now`` seconds (monotonic; any origin)."""
    now: float


@dataclass(frozen=True)
class UnitProgress:
    """How far the run of the model's unit on ``partition`` on ``worker`` has come, as
    asked by :class:`AskProgress`: ``fraction`` of its rows trained (0 to 1) in the
    ``seconds`` since its first batch began (a run still queued there, or still
    building its model, is not reported)."""
    model_id: int
    partition: int
    worker: str
    fraction: float
    seconds: float


@dataclass(frozen=True)
class Executing:
    """What a lost worker was executing when it died, as far as the executor knows:
    a train unit or an evaluation of ``model_id``, the load of ``partition``, or
    nothing (both None)."""
    model_id: int | None = None
    partition: int | None = None


@dataclass(frozen=True)
class WorkerLost:
    """The worker died. ``executing`` says what it was running then; None: unknown
    (the scheduler then blames the train unit it had sent there, if any)."""
    worker: str
    executing: Executing | None = None


@dataclass(frozen=True)
class PartitionPlaced:
    partition: int
    worker: str


@dataclass(frozen=True)
class PlaceFailed:
    """Loading ``partition`` on ``worker`` failed (the loader raised, or it was cancelled)."""
    partition: int
    worker: str
    error: str


@dataclass(frozen=True)
class PartitionLost:
    """The partition's data on ``worker`` is gone: its future was cancelled (a client
    reconnect, say), or an evaluation needed it after its worker was lost (stale
    then: the WorkerLost came first)."""
    partition: int
    worker: str


@dataclass(frozen=True)
class UnitCancelled:
    """The train unit ended without a result, neither by an error in user code nor
    with its worker (a cancellation: a client reconnect, say). The worker is free."""
    model_id: int
    partition: int
    worker: str
    reason: str


@dataclass(frozen=True)
class EvaluationCancelled:
    """The evaluation of the model after ``epoch`` epochs ended without a result."""
    model_id: int
    epoch: int
    reason: str


@dataclass(frozen=True)
class StatesLost:
    """States of the model are gone from workers that still live (cancelled):
    ``newest`` is the state of its last finished unit, ``epochs`` the end-of-epoch
    states lost (by the number of epochs they follow)."""
    model_id: int
    newest: bool
    epochs: tuple[int, ...] = ()


Event = Union[ModelsAdded, BudgetExtended, ModelStopped, UnitDone, UnitFailed,
              EvaluationDone, WorkerAdded, WorkerLost, PartitionPlaced, PlaceFailed,
              PartitionLost, UnitCancelled, EvaluationCancelled, StatesLost, Tick, UnitProgress]


# ----------------------------------------------------------------- instructions
@dataclass(frozen=True)
class Place:
    """Load ``partition`` (train and validation shard) onto ``worker``; ``attempt``
    counts the loads of it that failed in a row before (executors back off by it)."""
    partition: int
    worker: str
    attempt: int = 0


@dataclass(frozen=True)
class Train:
    """Train ``model_id`` one pass over ``partition`` on ``worker``.

    ``epoch`` is 0-based; ``step`` is the unit's index within the epoch and
    ``epoch_end`` is true for the epoch's last unit (the LR scheduler steps then).
    ``copy``: a speculative copy of the model's unit already running on another
    worker; it starts from the same state, and computes the same bits.
    """
    model_id: int
    partition: int
    worker: str
    epoch: int
    step: int
    epoch_end: bool
    copy: bool = False


@dataclass(frozen=True)
class Evaluate:
    """Evaluate the model's state after ``epoch`` epochs on every validation shard;
    shard ``p`` on ``workers[p]`` (a holder of partition ``p``)."""
    model_id: int
    epoch: int
    workers: tuple[str, ...] = ()


@dataclass(frozen=True)
class Drop:
    """``worker`` no longer holds ``partition`` (it moved to a new worker): free it."""
    partition: int
    worker: str


@dataclass(frozen=True)
class Discard:
    """The run of the model's unit on ``partition`` on ``worker`` no longer counts.
    Cancel it if it still runs (its completion only frees its worker).

    In a speculative race the other run finished first, or this one was lost: the
    other run's state is the model's. With ``restart`` the straggler had no race:
    the model's state is again the one the unit started from, and a new
    :class:`Train` runs the unit again."""
    model_id: int
    partition: int
    worker: str
    restart: bool = False


@dataclass(frozen=True)
class AskProgress:
    """Report a :class:`UnitProgress` for each run ``(model_id, partition, worker)``
    that has started on its worker (at a later poll; none where the executor cannot
    see into a running unit). The scheduler asks for the progress of the units it
    may speculate on, a few times per unit, to spot a straggler early."""
    runs: tuple[tuple[int, int, str], ...]


@dataclass(frozen=True)
class Checkpoint:
    model_id: int
    epoch: int


@dataclass(frozen=True)
class Report:
    """Epoch ``epoch`` (1-based) of the model is trained and evaluated."""
    model_id: int
    epoch: int
    order: tuple[int, ...]  # the partitions in the order the epoch visited them


@dataclass(frozen=True)
class Pause:
    """The model spent its budget of ``epochs`` and is paused, its state kept
    (``extend`` resumes it)."""
    model_id: int
    epochs: int


Finish = Pause  # the earlier name, kept for code written against it


@dataclass(frozen=True)
class Fail:
    model_id: int
    error: str


@dataclass(frozen=True)
class Rollback:
    """The model's newest state was lost: resume from its state after ``epoch``
    epochs (0: the initial weights, rebuilt from the model's seed). ``durable``:
    from the copy the driver keeps of a state resumed from a checkpoint."""
    model_id: int
    epoch: int
    durable: bool = False


@dataclass(frozen=True)
class Release:
    """The model is stopped or failed: its state may be freed."""
    model_id: int


@dataclass(frozen=True)
class Abort:
    """The session cannot go on (a partition keeps failing to load): stop with ``error``."""
    partition: int
    error: str


Instruction = Union[Place, Train, Evaluate, Checkpoint, Report, Pause, Fail,
                    Rollback, Release, Abort, Drop, Discard, AskProgress]

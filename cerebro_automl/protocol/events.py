"""Events: what happened, as executors (and the session, for the tuner's calls)
report it to the engine. Each is a small frozen dataclass; the engine's
``Scheduler.handle`` takes one at a time."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "Event",
    "NewModel",
    "ModelsAdded",
    "BudgetExtended",
    "ModelStopped",
    "GangWidth",
    "UnitDone",
    "UnitFailed",
    "EvaluationDone",
    "WorkerAdded",
    "Tick",
    "UnitProgress",
    "Executing",
    "WorkerLost",
    "PartitionPlaced",
    "PlaceFailed",
    "PartitionLost",
    "UnitCancelled",
    "EvaluationCancelled",
    "StatesLost",
]


@dataclass(frozen=True)
class NewModel:
    model_id: int
    epochs: int
    offset: int | None = None  # Latin-order offset; None: the model's ordinal
    start_epoch: int = 0  # epochs already trained: a model resumed from a checkpoint (epochs: it starts paused)
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
    # A paused model that a resume continues from a checkpoint within its new budget:
    # the epochs that state is after (None: from its own state), and the worker it
    # was sent to (None: none; the driver keeps a copy either way).
    resumed_epoch: int | None = None
    state_worker: str | None = None


@dataclass(frozen=True)
class ModelStopped:
    model_id: int


@dataclass(frozen=True)
class GangWidth:
    """The model's epoch ``epoch`` (1-based) trains in gang units of ``width``
    partitions at once (1: one partition at a time, plain MOP). With gang units on,
    an epoch starts only once its width is given: the session decides it at a point
    of the search that timing does not move (see :mod:`cerebro_automl.engine.gangs`)."""

    model_id: int
    epoch: int
    width: int
    lane: int = 0  # with fixed or cyclic order: the block of partitions the epoch starts at


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
    """The evaluation of the model's state after ``epoch`` epochs and ``unit`` units of
    the next (0: the epoch's end) finished; ``error``: the user code's failure."""

    model_id: int
    epoch: int
    error: str | None = None
    unit: int = 0


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
    """Loading ``partition`` on ``worker`` failed (the loader raised, or it was cancelled);
    ``lasting``: the data breaks a rule, which another try would find again."""

    partition: int
    worker: str
    error: str
    lasting: bool = False


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
    """The evaluation of the model after ``epoch`` epochs (and ``unit`` units) ended
    without a result."""

    model_id: int
    epoch: int
    reason: str
    unit: int = 0


@dataclass(frozen=True)
class StatesLost:
    """States of the model are gone from workers that still live (cancelled):
    ``newest`` is the state of its last finished unit, ``epochs`` the end-of-epoch
    states lost (by the number of epochs they follow)."""

    model_id: int
    newest: bool
    epochs: tuple[int, ...] = ()


Event = (
    ModelsAdded
    | BudgetExtended
    | ModelStopped
    | GangWidth
    | UnitDone
    | UnitFailed
    | EvaluationDone
    | WorkerAdded
    | WorkerLost
    | PartitionPlaced
    | PlaceFailed
    | PartitionLost
    | UnitCancelled
    | EvaluationCancelled
    | StatesLost
    | Tick
    | UnitProgress
)

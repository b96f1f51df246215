"""Commands: what the engine tells an executor to do. An executor carries out
every command in the order given and reports what came of it as events; work it
cannot start (its worker already gone) it reports back as cancelled or failed,
for the engine to judge. It never receives a :mod:`~.notices` type."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "Command",
    "COMMANDS",
    "Place",
    "Train",
    "TrainGang",
    "Evaluate",
    "Drop",
    "Discard",
    "AskProgress",
    "Rollback",
    "Release",
]


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
    ``budget``: the model's epoch budget as the unit was decided (a per-step
    learning-rate schedule spans it).
    """

    model_id: int
    partition: int
    worker: str
    epoch: int
    step: int
    epoch_end: bool
    copy: bool = False
    budget: int = 1


@dataclass(frozen=True)
class TrainGang:
    """Train ``model_id`` data-parallel over ``partitions`` at once: rank ``r`` reads
    ``partitions[r]`` on ``workers[r]``, with ``1/k`` of the batch, and the ranks
    all-reduce gradients every step (a *gang unit*, ``k = len(partitions)``).

    Rank 0 (``partitions[0]`` on ``workers[0]``) returns the state; the executor
    reports the unit's end as for a :class:`Train` on that pair, and a
    :class:`Discard` of that pair cancels every rank. ``step`` counts the epoch's
    partitions trained before it; ``epoch_end``: the gang ends the epoch.
    """

    model_id: int
    partitions: tuple[int, ...]
    workers: tuple[str, ...]
    epoch: int
    step: int
    epoch_end: bool
    budget: int = 1


@dataclass(frozen=True)
class Evaluate:
    """Evaluate the model's state after ``epoch`` epochs on every validation shard;
    shard ``p`` on ``workers[p]`` (a holder of partition ``p``, the engine's choice).
    ``unit`` > 0: the state after that many units of the next epoch (its newest), for
    a report inside the epoch."""

    model_id: int
    epoch: int
    workers: tuple[str, ...]
    unit: int = 0


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
    other run's state is the model's. With ``restart`` the straggler had no race, or
    the gang unit lost a rank: the model's state is again the one the unit started
    from, and a new :class:`Train` (or :class:`TrainGang`) runs the unit again."""

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


Command = Place | Train | TrainGang | Evaluate | Drop | Discard | AskProgress | Rollback | Release
COMMANDS = (Place, Train, TrainGang, Evaluate, Drop, Discard, AskProgress, Rollback, Release)

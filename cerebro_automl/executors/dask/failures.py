"""Dask's facts about a task that did not finish, turned into protocol events.

The one place that tells whether a failure came from the cluster (a worker died,
Dask cancelled a future, gave up on a task whose workers died) or from user code
(the task raised). Pure functions of Dask's facts: a future's status and
exception, whether its worker lives, and what the task was (its :class:`Task`).
What runs again is the engine's decision, not these.

>>> origin = error_origin(ZeroDivisionError("x"), worker_alive=True)  # doctest: +SKIP
>>> failed(task, text_of(error), discarded=False)  # doctest: +SKIP
[UnitFailed(model_id=0, partition=1, worker='tcp://...', error='ZeroDivisionError: x')]
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import importlib.util
from concurrent.futures import CancelledError
from dataclasses import dataclass
from typing import Any

from ...protocol import (
    Command,
    Evaluate,
    EvaluationCancelled,
    EvaluationDone,
    Event,
    PartitionLost,
    Place,
    PlaceFailed,
    Train,
    TrainGang,
    UnitCancelled,
    UnitDone,
    UnitFailed,
)
from ...training import UnitAbandoned, UnitError
from ...training.gang import GangError

# distributed raises asyncio.TimeoutError and concurrent.futures' waits their own
# TimeoutError, which are not the builtin TimeoutError before Python 3.11.
TIMEOUTS = (TimeoutError, asyncio.TimeoutError, concurrent.futures.TimeoutError)

__all__ = [
    "TIMEOUTS",
    "TaskCommand",
    "kind_of",
    "Task",
    "Origin",
    "error_origin",
    "text_of",
    "gone",
    "cancel_reason",
    "failed",
    "cancelled",
    "killed",
    "discarded_done",
    "unreachable",
]


# The commands a task in flight carries out (the others need no task).
TaskCommand = Place | Train | Evaluate
_KINDS: dict[type, str] = {Train: "train", Place: "place", Evaluate: "evaluate"}


def kind_of(command: TaskCommand) -> str:
    """The kind of task that carries out ``command``: ``"train"``, ``"place"`` or ``"evaluate"``."""
    return _KINDS[type(command)]


@dataclass(frozen=True)
class Task:
    """What a Dask future in flight is: its command (a :class:`Train`, a
    :class:`Place` or an :class:`Evaluate`, the task's kind), the worker it is pinned
    to (None: any), its submission order (completions are handled in it) and, for a
    unit, the state it started from (a retry starts there again)."""

    command: TaskCommand
    worker: str | None
    sequence: int
    prior: Any = None

    @property
    def kind(self) -> str:
        """``"train"``, ``"place"`` or ``"evaluate"``, after the command."""
        return kind_of(self.command)


class Origin(enum.Enum):
    """Where a task's error came from."""

    LOST_WORKER = "the cluster lost the task's worker"
    KILLED = "Dask gave up on a task whose workers died"
    USER = "the task's own code raised"


def error_origin(error: BaseException, worker_alive: bool) -> Origin:
    """Whether the error of a task came from the cluster or from user code.

    ``worker_alive``: whether the worker the task was pinned to still lives (True for
    a task pinned to none)."""
    if not worker_alive:
        return Origin.LOST_WORKER
    if type(error).__name__ == "KilledWorker" or isinstance(error, GangError):  # a gang's peer died or hung
        return Origin.KILLED
    if isinstance(error, UnitAbandoned):  # Dask released its task while it ran, and wants it again
        return Origin.KILLED
    return Origin.USER


def text_of(error: BaseException) -> str:
    """How an event states a task's error: a unit's own message, or type and message,
    and for a module the worker lacks (a task that failed to unpickle), the remedies.

    >>> text_of(ModuleNotFoundError("No module named 'h5py'", name="h5py")).split("; ")[1]
    "install it in the workers' environment, as on the driver"
    """
    if isinstance(error, UnitError):
        return str(error)
    if isinstance(error, ModuleNotFoundError):  # a task that could not be unpickled, or a loader's import
        return f"ModuleNotFoundError: {error} on the worker; {_remedy(error.name)}"
    return f"{type(error).__name__}: {error}"


def _remedy(name: str | None) -> str:
    """How to get module ``name`` to the workers: the user's own code (found on the
    driver outside site-packages) can travel with the tasks; a package is installed."""
    top = (name or "").split(".")[0]
    try:
        found = importlib.util.find_spec(top) if top else None
    except (ImportError, ValueError):
        found = None
    origin = getattr(found, "origin", None) or ""
    if found is not None and not any(part in origin for part in ("site-packages", "dist-packages")):
        return (
            "the task refers to your module, which the worker cannot import: start the workers where it is "
            f"on sys.path, or call cloudpickle.register_pickle_by_value({top}) on the driver to send its code "
            "with the tasks"
        )
    return "install it in the workers' environment, as on the driver"


def gone(future: Any) -> bool:
    """A future whose data no worker holds any more: cancelled, or lost. Dask reports a
    key "lost" when its last copy died with a worker; that copy need not be on the
    worker that computed it (the Active Memory Manager drops the extra copies a
    transfer makes, such as a state copied to an evaluation shard's worker)."""
    return future.cancelled() or future.status == "lost"


def cancel_reason(future: Any) -> str:
    """Why Dask cancelled ``future``, as its exception says (e.g. a lost connection)."""
    try:
        future.result(timeout=0)
    except CancelledError as err:
        return str(getattr(err, "reason", None) or err) or "cancelled"
    except BaseException as err:  # not cancelled after all
        return f"{type(err).__name__}: {err}"
    return "cancelled"


def discarded_done(ins: Train) -> Event:
    """A discarded unit ended (finished, failed or cancelled): this frees its worker."""
    return UnitDone(ins.model_id, ins.partition, ins.worker)


def failed(task: Task, text: str, discarded: bool, lasting: bool = False) -> Event:
    """The event for a task whose own code raised ``text``; ``lasting``: a load that
    found the data breaking a rule (:class:`~cerebro_automl.data.DataError`)."""
    ins = task.command
    if isinstance(ins, Train):
        return discarded_done(ins) if discarded else UnitFailed(ins.model_id, ins.partition, ins.worker, text)
    if isinstance(ins, Evaluate):
        return EvaluationDone(ins.model_id, ins.epoch, text, ins.unit)
    return PlaceFailed(ins.partition, ins.worker, text, lasting)


def cancelled(task: Task, reason: str) -> Event:
    """The event for a task whose future Dask cancelled while its worker lives."""
    ins = task.command
    if isinstance(ins, Train):
        return UnitCancelled(ins.model_id, ins.partition, ins.worker, reason)
    if isinstance(ins, Evaluate):
        return EvaluationCancelled(ins.model_id, ins.epoch, reason, ins.unit)
    return PlaceFailed(ins.partition, ins.worker, f"cancelled ({reason})")


def killed(task: Task, text: str, discarded: bool) -> Event:
    """The event for a task Dask stopped retrying because workers died running it:
    not an error of user code."""
    ins = task.command
    if isinstance(ins, Train):
        return discarded_done(ins) if discarded else UnitCancelled(ins.model_id, ins.partition, ins.worker, text)
    if isinstance(ins, Evaluate):
        return EvaluationCancelled(ins.model_id, ins.epoch, text, ins.unit)
    return PlaceFailed(ins.partition, ins.worker, text)


def unreachable(
    ins: Command, lost_workers: set[str], placed: set[tuple[int, str]], shards: list[tuple[int, str]]
) -> list[Event]:
    """How ``ins`` ends when it needs a worker already seen lost (``lost_workers``):
    a Place fails, a Train is cancelled, an Evaluate reading a shard not ``placed``
    (its ``shards``, as ``(partition, worker)``) reports that shard lost. Empty: it
    can be sent."""
    lost = f"its worker {getattr(ins, 'worker', '')} was lost"
    if isinstance(ins, Place) and ins.worker in lost_workers:
        return [PlaceFailed(ins.partition, ins.worker, lost)]
    if isinstance(ins, Train) and ins.worker in lost_workers:
        return [UnitCancelled(ins.model_id, ins.partition, ins.worker, lost)]
    if isinstance(ins, TrainGang) and not lost_workers.isdisjoint(ins.workers):
        gone = sorted(lost_workers.intersection(ins.workers))
        return [UnitCancelled(ins.model_id, ins.partitions[0], ins.workers[0], f"its ranks' workers {gone} were lost")]
    if isinstance(ins, Evaluate):
        return [PartitionLost(p, w) for p, w in shards if (p, w) not in placed]
    return []

"""What a session tells the code around it: reports, and a read-only view.

A tuner reads :class:`EpochReport`, :class:`ModelPaused` and :class:`ModelFailed`
from ``Session.reports()`` (and :class:`UnitReport` with ``report_every="unit"``).
Callbacks get the same reports, and with them a :class:`SessionView`: the
session's settings, models and history, read-only, so that a hook observes and a
tuner's loop decides.

Example:
    >>> from cerebro_automl.callbacks import Callback
    >>> class Log(Callback):
    ...     def on_epoch_end(self, view, report):
    ...         print(view.model(report.model_id).name, report.epoch, report.metrics["val_loss"])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["EpochReport", "UnitReport", "ModelPaused", "ModelFailed", "Outcome", "ModelView", "SessionView"]


@dataclass(frozen=True)
class EpochReport:
    """Model ``model_id`` finished epoch ``epoch`` (1-based); ``metrics`` holds
    ``train_loss``, ``val_loss`` and ``val_<metric>`` for each named metric."""

    model_id: int
    epoch: int
    metrics: dict[str, float]
    config: dict[str, Any]


@dataclass(frozen=True)
class UnitReport:
    """Model ``model_id`` trained ``unit`` of the ``units`` units (one per partition)
    of epoch ``epoch`` (1-based), and was evaluated: a report inside an epoch, made
    with ``Session(report_every="unit")`` so that a pruner can stop a model before
    its first epoch ends. ``metrics`` holds ``val_loss`` and ``val_<metric>`` of the
    state after that unit, and ``train_loss`` of the epoch's units so far.

    Example:
        >>> r = UnitReport(0, epoch=2, unit=1, units=4, metrics={}, config={})
        >>> r.step  # units trained since the model started
        5
    """

    model_id: int
    epoch: int
    unit: int
    units: int
    metrics: dict[str, float]
    config: dict[str, Any]

    @property
    def step(self) -> int:
        """The units the model has trained, the epoch's unit included."""
        return (self.epoch - 1) * self.units + self.unit


@dataclass(frozen=True)
class ModelPaused:
    """The model spent its budget and is paused, its state kept (``extend`` resumes it)."""

    model_id: int
    epochs: int


@dataclass(frozen=True)
class ModelFailed:
    """User code failed for this model (an exception, a non-finite loss); the others go on."""

    model_id: int
    error: str


Outcome = EpochReport | UnitReport | ModelPaused | ModelFailed


@dataclass(frozen=True)
class ModelView:
    """One model as a hook sees it: a snapshot taken when asked.

    ``status`` is ``training``, ``evaluating``, ``paused``, ``stopped`` or
    ``failed``; ``epochs`` counts the epochs reported; ``error`` is the failure's
    traceback, or None.
    """

    model_id: int
    config: dict[str, Any]
    name: str
    seed: int
    offset: int
    epochs: int
    metrics: dict[str, float]
    error: str | None
    status: str


class _Handle(Protocol):
    """What the view reads of a model handle."""

    model_id: int
    config: dict[str, Any]
    name: str
    seed: int
    offset: int
    epochs: int
    metrics: dict[str, float]
    error: str | None

    @property
    def status(self) -> str: ...


class _Viewed(Protocol):
    """What the view reads of a session."""

    seed: int
    order: str
    threads: int
    checkpoint_dir: str | None
    data: Any  # its num_partitions
    executor: Any  # its kind

    @property
    def closed(self) -> bool: ...
    @property
    def history(self) -> pd.DataFrame: ...
    def workers(self) -> list[str]: ...
    def status(self, model_id: int) -> str: ...
    def statuses(self) -> dict[int, str]: ...
    def model(self, model_id: int) -> _Handle: ...
    def best(self, metric: str, mode: str) -> _Handle: ...


def _view_of(handle: _Handle) -> ModelView:
    return ModelView(
        handle.model_id,
        handle.config,
        handle.name,
        handle.seed,
        handle.offset,
        handle.epochs,
        handle.metrics,
        handle.error,
        handle.status,
    )


class SessionView:
    """A session, read-only: what callbacks and hooks receive.

    It reads the session live (each property is its value now) and offers no
    way to add, extend, stop or fork a model, nor to fetch a state: tuning
    decisions belong in the loop over ``session.reports()``.

    Example:
        >>> # in a hook: view.seed, view.num_partitions, view.num_workers,
        >>> # view.model(model_id).config, view.status(model_id), view.history,
        >>> # view.best("val_loss").name
    """

    __slots__ = ("_session",)
    _session: _Viewed

    def __init__(self, session: _Viewed) -> None:
        object.__setattr__(self, "_session", session)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"a SessionView is read-only: it cannot set {name!r}")

    @property
    def seed(self) -> int:
        """The session seed."""
        return self._session.seed

    @property
    def order(self) -> str:
        """The visit order: ``"fixed"``, ``"cyclic"`` or ``"dynamic"``."""
        return self._session.order

    @property
    def threads(self) -> int:
        """Torch intra-op threads inside every unit."""
        return self._session.threads

    @property
    def num_partitions(self) -> int:
        """How many partitions the data has."""
        return self._session.data.num_partitions

    @property
    def checkpoint_dir(self) -> str | None:
        """Where the models' checkpoints go, or None."""
        return self._session.checkpoint_dir

    @property
    def executor_kind(self) -> str:
        """The executor's class name, e.g. ``"DaskExecutor"`` or ``"LocalExecutor"``."""
        return type(self._session.executor).__name__

    @property
    def closed(self) -> bool:
        """Whether the session is closed."""
        return self._session.closed

    def workers(self) -> list[str]:
        """The names of the workers alive now."""
        return self._session.workers()

    @property
    def num_workers(self) -> int:
        """How many workers are alive now."""
        return len(self._session.workers())

    @property
    def history(self) -> pd.DataFrame:
        """One row per model-epoch (see ``Session.history``)."""
        return self._session.history

    def model(self, model_id: int) -> ModelView:
        """Model ``model_id``: its config, name, seed, offset, epochs, metrics, error, status."""
        return _view_of(self._session.model(model_id))

    def status(self, model_id: int) -> str:
        """``training``, ``evaluating``, ``paused``, ``stopped`` or ``failed``."""
        return self._session.status(model_id)

    def statuses(self) -> dict[int, str]:
        """Every model's status, by id, in the order the models were added."""
        return self._session.statuses()

    def best(self, metric: str = "val_loss", mode: str = "min") -> ModelView:
        """The model whose latest reported ``metric`` is best (see ``Session.best``)."""
        return _view_of(self._session.best(metric, mode))

    def __repr__(self) -> str:
        return f"SessionView(seed={self.seed}, num_partitions={self.num_partitions}, executor={self.executor_kind})"

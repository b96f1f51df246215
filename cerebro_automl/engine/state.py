"""The engine's state: its settings, the models, the unit runs, the placement of
partitions and what the clock taught it. The engine's modules (assignment,
speculation, faults, handlers) are functions of this state; the
:class:`~cerebro_automl.engine.scheduler.Scheduler` owns one and is its only door.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from dataclasses import dataclass

from ..protocol import ModelStatus
from .model import ModelRecord
from .orders import ORDERS, LatinOrders
from .placement import Placement
from .runs import Runs, UnitRun
from .timing import UnitTimes

__all__ = ["Settings", "EngineState", "ModelIndex"]


@dataclass
class Settings:
    """What a session fixes for its engine (see :class:`Scheduler` for each)."""

    num_partitions: int
    seed: int = 0
    order: str = "fixed"
    checkpoint: bool = False
    max_unit_retries: int = 3
    max_place_retries: int = 3
    replicas: int = 1
    speculate: bool = False
    prefetch: bool = False
    has_validation: bool | None = None
    unit_reports: bool = False
    gang: bool = False

    def check(self) -> None:
        """Raise naming the value and the rule for a setting out of range."""
        n = self.num_partitions
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"num_partitions is {n!r}, but must be an int >= 1")
        if self.order not in ORDERS:
            raise ValueError(f"order is {self.order!r}, but must be one of {ORDERS}")
        for name in ("max_unit_retries", "max_place_retries"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} is {value!r}, but must be an int >= 0")
        if self.has_validation not in (True, False, None):
            raise TypeError(f"has_validation is {self.has_validation!r}, but must be True, False or None")
        for name in ("speculate", "prefetch", "unit_reports", "gang"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} is {getattr(self, name)!r}, but must be True or False")
        if self.gang and self.unit_reports:
            raise ValueError(
                "gang is True with unit_reports (report_every='unit'), but a gang unit trains several "
                "partitions at once, so an epoch no longer has one report per partition: give one of them"
            )
        Placement.check_replicas(self.replicas)
        if self.speculate and self.replicas < 2:
            raise ValueError(
                f"speculate is True with replicas={self.replicas}, but a speculative copy "
                "runs on another holder of the partition: it needs replicas >= 2"
            )


class ModelIndex:
    """Indexes over the models, so that an event neither scans nor sorts every model
    (p=128, n=512: 150-270 us per event with scans, 20-60 us with them). They are
    refreshed after every event for the models it touched; ``validate`` checks them
    against a scan."""

    def __init__(self) -> None:
        self.ready: list[tuple[int, int, int]] = []  # (-remaining units, ordinal, id): TRAINING
        self._entries: dict[int, tuple[int, int, int]] = {}  # id -> its entry in ready
        self.live: set[int] = set()  # TRAINING or EVALUATING
        self.eval_pending: set[int] = set()  # EVALUATING with its Evaluate wanted

    def refresh(self, m: ModelRecord, remaining_units: int) -> None:
        old = self._entries.pop(m.model_id, None)
        if old is not None:
            del self.ready[bisect_left(self.ready, old)]
        if m.status is ModelStatus.TRAINING:
            entry = (-remaining_units, m.ordinal, m.model_id)
            self._entries[m.model_id] = entry
            insort(self.ready, entry)
        if m.status in (ModelStatus.TRAINING, ModelStatus.EVALUATING):
            self.live.add(m.model_id)
        else:
            self.live.discard(m.model_id)
        if m.eval_pending:
            self.eval_pending.add(m.model_id)
        else:
            self.eval_pending.discard(m.model_id)

    def validate(self, state: EngineState) -> None:
        """The indexes agree with a scan of the models."""
        models = state.models
        training = sorted(
            (-state.remaining_units(m), m.ordinal, i) for i, m in models.items() if m.status is ModelStatus.TRAINING
        )
        if self.ready != training or sorted(self._entries.values()) != training:
            raise AssertionError(f"the ready queue {self.ready} differs from the models {training}")
        live = {i for i, m in models.items() if m.status in (ModelStatus.TRAINING, ModelStatus.EVALUATING)}
        if self.live != live:
            raise AssertionError(f"live models {sorted(self.live)} differ from the models {sorted(live)}")
        pending = {i for i, m in models.items() if m.eval_pending}
        if self.eval_pending != pending:
            raise AssertionError(
                f"models waiting to evaluate {sorted(self.eval_pending)} differ from the models {sorted(pending)}"
            )


class EngineState:
    """Everything the engine knows. Changed only by the engine's modules, within
    ``Scheduler.handle``."""

    def __init__(self, settings: Settings, workers: list[str]) -> None:
        self.settings = settings
        self.num_partitions = settings.num_partitions
        self.order = settings.order
        self.checkpoint = settings.checkpoint
        self.placement = Placement(settings.num_partitions, settings.replicas)
        self.orders = LatinOrders(settings.seed, settings.num_partitions, cyclic=settings.order == "cyclic")
        self.models: dict[int, ModelRecord] = {}
        self.runs = Runs()
        self.index = ModelIndex()
        self.times = UnitTimes()  # models' unit durations and workers' paces
        self.now: float | None = None  # the latest Tick; None: no clock, no timing
        self.place_failures: dict[int, list[str]] = {}  # partition -> why its loads failed, in a row
        self.aborted: str | None = None  # the error of the Abort emitted, if any
        self.initial_workers = sorted(set(workers))
        self.started = False
        self.copies_started = 0  # speculative copies of straggling units, so far
        self.restarts = 0  # straggling units restarted (no holder idle to race them)
        # Units the models' current states hold, trained since they were added: the
        # progress bar's count (a race's loser, a discarded run and the units a
        # rollback throws away are not in it).
        self.units_trained = 0
        # Workers a gang unit waits for (it holds them): assign's prefetch leaves them alone.
        self.held: set[str] = set()

    @property
    def workers(self) -> dict[str, UnitRun | None]:
        """The live workers (the keys), each mapped to the run it executes or None."""
        return self.runs.ahead

    def model(self, model_id: int) -> ModelRecord:
        if model_id not in self.models:
            raise ValueError(f"model id {model_id!r} is unknown")
        return self.models[model_id]

    def model_order(self, m: ModelRecord, epoch: int) -> tuple[int, ...]:
        """The fixed order of ``m``'s epoch ``epoch`` (0-based): its Latin order, or in
        gang units of width > 1, its lane's blocks (see ``orders``)."""
        width, lane = m.widths.get(epoch + 1, (1, 0))
        return self.orders.of(m.offset, epoch) if width == 1 else self.orders.of_gang(epoch, width, lane)

    def remaining_units(self, m: ModelRecord) -> int:
        return (m.budget - m.epochs_done) * self.num_partitions - len(m.visited)

    def pace(self, worker: str) -> float:
        return self.times.pace(worker)

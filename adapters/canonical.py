"""Reports in canonical order: what makes a parallel search reproducible.

Every unit's result is deterministic; only the order in which reports arrive
depends on timing. :class:`CanonicalOrder` gives each report a *logical time*, one
tick per epoch: a model started (or extended) at logical time ``t`` after epoch
``e0`` reports epoch ``e`` at ``t + (e - e0)``. It releases the reports of one
logical time together, in model-id order, once every model due then has
reported (or failed); a report that arrives early is held. Tuners decide (ask,
tell, report, prune, promote) only on released batches, and start models at the
time of the batch they handle, so their decisions depend on the seed, the
configurations and the metric values, never on wall-clock time, the number of
workers, the executor or faults.

Models keep training while their reports wait: only the tuner's decisions are
held back. A model the tuner stops has its held and later reports dropped.

A tuner resuming a search that a dead driver left half done starts each model it
continues at its original anchor (``started(..., anchor=(time, epoch))``), after the
epochs whose logical times were fully handled: reports of those epochs, trained
again from an older checkpoint, are dropped, so the search goes on at the same
logical times.

:class:`CanonicalOrder` is pure: it sees report objects and model ids, never a
session, Dask or torch. :class:`ReportStream` puts it between a session and a tuner.

Example, with plain tuples standing in for the session's reports::

    >>> order = CanonicalOrder(epoch_of=lambda r: r[1], failed=lambda r: r[1] is None)
    >>> order.started(0, budget=2); order.started(1, budget=2)
    >>> order.arrived(0, (0, 1)); order.arrived(0, (0, 2))   # model 0 ran ahead
    >>> order.release()                                       # model 1's epoch 1 is due first
    >>> order.arrived(1, (1, 1)); order.release()
    (1, [(0, 1), (1, 1)])
    >>> order.arrived(1, (1, None))                           # model 1 failed in epoch 2
    >>> order.release()                                       # model 0's epoch 2 needs its pause
    >>> order.arrived(0, "paused 0", closing=True); order.release()
    (2, [(0, 2), 'paused 0', (1, None)])
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

__all__ = ["CanonicalOrder", "ReportStream"]


@dataclass
class _Clock:
    """Where one live model is in logical time."""

    anchor_time: int  # the logical time it started or was last extended
    anchor_epoch: int  # its released epochs then
    budget: int  # the epoch it trains to
    released: int  # epochs whose reports were released
    held: dict[int, Any] = field(default_factory=dict)  # epoch -> report, arrived early
    failure: Any = None  # a failure report, released at the epoch it failed in
    closing: list[Any] = field(default_factory=list)  # reports released with its last epoch

    def due(self) -> int | None:
        """The logical time of its next report, or None when it expects none (paused)."""
        if self.released >= self.budget:
            return None
        return self.anchor_time + (self.released + 1 - self.anchor_epoch)

    def ready(self) -> bool:
        """Whether its next report is here: the epoch's (with the pause that follows the
        last epoch), or its failure."""
        epoch = self.released + 1
        if epoch in self.held:
            return epoch < self.budget or bool(self.closing)
        return self.failure is not None


class CanonicalOrder:
    """Logical time for a tuner's reports (see the module docstring).

    Args:
        epoch_of: the epoch an epoch report is for.
        failed: whether a report says the model failed (it is released at the logical
            time of the epoch the model was training).
    """

    def __init__(self, epoch_of: Callable[[Any], int], failed: Callable[[Any], bool]) -> None:
        self.epoch_of, self.failed = epoch_of, failed
        self.now = 0
        self._clocks: dict[int, _Clock] = {}

    # ----------------------------------------------------------- the tuner's calls
    def started(self, model: int, *, budget: int, epoch: int = 0, anchor: tuple[int, int] | None = None) -> None:
        """``model`` starts now after ``epoch`` epochs (0, or a resumed checkpoint's) and trains to ``budget``.

        ``anchor``: ``(time, epoch)`` where the model was started before a resume; its
        epochs up to ``epoch`` were released then, and their reports are dropped now."""
        if model in self._clocks:
            raise ValueError(f"model {model!r} was started already")
        anchor_time, anchor_epoch = (self.now, epoch) if anchor is None else anchor
        if epoch < anchor_epoch:
            raise ValueError(f"epoch is {epoch}, but a model released no epoch before its anchor {anchor}")
        self._clocks[model] = _Clock(anchor_time, anchor_epoch, budget, epoch)

    def extended(self, model: int, *, budget: int) -> None:
        """``model``, paused at its budget, trains on now to ``budget``."""
        clock = self._clock(model)
        if clock.due() is not None:
            raise ValueError(f"model {model!r} is still training (epoch {clock.released} of {clock.budget})")
        clock.anchor_time, clock.anchor_epoch, clock.budget = self.now, clock.released, budget

    def ended(self, model: int) -> None:
        """The tuner stopped ``model`` (or is done with it): its reports are no longer expected."""
        self._clocks.pop(model, None)

    # ----------------------------------------------------------- the session's reports
    def arrived(self, model: int, report: Any, *, closing: bool = False) -> None:
        """Hold a report of ``model``; reports of models not live (stopped) are dropped.
        ``closing``: a report that follows the model's last epoch (its pause), released with it."""
        clock = self._clocks.get(model)
        if clock is None:
            return
        if closing:
            clock.closing.append(report)
        elif self.failed(report):
            clock.failure = report
        elif self.epoch_of(report) > clock.released:  # an earlier one was handled before a resume
            clock.held[self.epoch_of(report)] = report

    def release(self) -> tuple[int, list[Any]] | None:
        """``(time, reports)``: the next logical time's reports, in model order, once every
        model due then has reported; None while one has not. Advances ``now``."""
        due = {m: c.due() for m, c in self._clocks.items()}
        times = [t for t in due.values() if t is not None]
        if not times:
            return None
        now = min(times)
        at_now = sorted(m for m, t in due.items() if t == now)  # model ids: the order models were added
        if not all(self._clocks[m].ready() for m in at_now):
            return None
        self.now = now
        out: list[Any] = []
        for m in at_now:
            out += self._release(m)
        return now, out

    def live(self) -> list[int]:
        """The models that still owe a report, by id."""
        return sorted(m for m, c in self._clocks.items() if c.due() is not None)

    def budget_of(self, model: int) -> int | None:
        """The epoch ``model`` trains to; None once it ended."""
        clock = self._clocks.get(model)
        return None if clock is None else clock.budget

    def released_of(self, model: int) -> int | None:
        """The epochs of ``model`` released so far; None once it ended."""
        clock = self._clocks.get(model)
        return None if clock is None else clock.released

    def next_time(self) -> int | None:
        """The logical time of the next report due, or None when none is."""
        return min((t for t in (c.due() for c in self._clocks.values()) if t is not None), default=None)

    def waiting(self) -> bool:
        """Whether a live model still owes a report."""
        return any(c.due() is not None for c in self._clocks.values())

    def _release(self, model: int) -> list[Any]:
        clock = self._clocks[model]
        epoch = clock.released + 1
        if epoch not in clock.held:  # failed while training this epoch
            report, clock.failure = clock.failure, None
            del self._clocks[model]
            return [report]
        clock.released = epoch
        out = [clock.held.pop(epoch)]
        if epoch == clock.budget:
            out += clock.closing
            clock.closing = []
        return out

    def _clock(self, model: int) -> _Clock:
        if model not in self._clocks:
            raise ValueError(f"model {model!r} is not live in the canonical order")
        return self._clocks[model]


@contextmanager
def widths_from_tuner(session: Any, reproducible: bool) -> Iterator[Any]:
    """With ``reproducible`` and the session's gang units, the session's
    :class:`~cerebro_automl.engine.WidthDecisions`, whose widths the tuner decides
    while the block runs (the session gives none of its own meanwhile); else None.
    However the block ends, the session decides as before after it, so a session
    passed to one search serves the next."""
    gang = getattr(session, "gang", None) if reproducible else None
    if gang is None:
        yield None
        return
    was, gang.automatic = gang.automatic, False
    try:
        yield gang
    finally:
        gang.automatic = was


def give_rung_widths(
    session: Any, gang: Any, models: Sequence[int], after: int, budget: int, *, sharing: int = 1, place: int = 0
) -> None:
    """With ``gang`` (from :func:`widths_from_tuner`): the widths of a rung's epochs,
    decided as it starts, from the plan alone, and given to the session at once (see
    :meth:`~cerebro_automl.engine.WidthDecisions.rung`). Without, nothing."""
    if gang is not None and models:
        gang.rung(models, after, budget, sharing=sharing, place=place)
        session.give_widths([])


class ReportStream:
    """The reports a tuner decides on: as the session delivers them, or, with
    ``reproducible``, in canonical order (see :class:`CanonicalOrder`). A context
    manager: while it is open, a reproducible stream decides the session's gang
    widths (:func:`widths_from_tuner`).

    A tuner tells the stream of every model it starts, extends and ends, in epochs;
    without ``reproducible`` those calls do nothing and :meth:`next` is the session's
    ``next_reports``. With ``reproducible`` and a session's gang units, the stream
    decides the widths of the epochs due at each logical time, once the tuner has
    handled the time before (see :class:`~cerebro_automl.engine.WidthDecisions`), and
    hands them to ``on_widths`` if set: a tuner that resumes in the middle of the
    canonical order journals them, and gives them back to :meth:`started`.
    With ``Session(report_every="unit")`` a model reports ``steps_per_epoch`` times
    an epoch (once per partition), and one tick of logical time is one such step
    (:meth:`step_of`).
    """

    def __init__(self, session: Any, reproducible: bool) -> None:
        from cerebro_automl.reports import ModelFailed, ModelPaused

        self.session, self.reproducible = session, reproducible
        self._paused = ModelPaused
        self.steps_per_epoch: int = session.reports_per_epoch
        self.order = CanonicalOrder(epoch_of=self.step_of, failed=lambda r: isinstance(r, ModelFailed))
        self._gang = getattr(session, "gang", None) if reproducible else None
        self._open = ExitStack()
        self._released: list[Any] = []  # the batch the tuner handles
        self.on_widths: Callable[[list[Any]], None] | None = None  # the GangWidths given, at each logical time

    def step_of(self, report: Any) -> int:
        """The report's step: its epoch, or with reports inside epochs, the units its
        model has trained (a :class:`~cerebro_automl.reports.UnitReport`'s ``step``)."""
        step = getattr(report, "step", None)
        return step if step is not None else report.epoch * self.steps_per_epoch

    def started(
        self,
        model: int,
        *,
        budget: int,
        epoch: int = 0,
        anchor: tuple[int, int] | None = None,
        released: int | None = None,
        widths: Mapping[int, tuple[int, int]] | None = None,
    ) -> None:
        """``model`` starts after ``epoch`` epochs with a budget of ``budget``;
        ``anchor``: ``(time, epoch)`` of its first start; ``released``: the steps whose
        reports were handled before (default: ``epoch``'s), dropped now; ``widths``:
        epoch -> ``(width, lane)`` of the epochs whose gang widths were decided before
        (a resume's: they keep them)."""
        if self._gang is not None:
            self._gang.starting(model, epoch, budget, released, widths)
        if self.reproducible:
            k = self.steps_per_epoch
            self.order.started(
                model,
                budget=budget * k,
                epoch=epoch * k if released is None else released,
                anchor=None if anchor is None else (anchor[0], anchor[1] * k),
            )

    def extended(self, model: int, *, budget: int) -> None:
        if self.reproducible:
            released = self.order.released_of(model)
            self.order.extended(model, budget=budget * self.steps_per_epoch)
            if self._gang is not None and released is not None:
                self._gang.starting(model, released, budget)

    def ended(self, model: int) -> None:
        if self.reproducible:
            self.order.ended(model)

    def next(self) -> list[Any]:
        """The next batch of reports; [] once nothing is left to come."""
        if not self.reproducible:
            return self.session.next_reports()
        # The models started between two batches form their fusion groups here, at a
        # point of the canonical order, whenever the session's reports came.
        form_groups = getattr(self.session, "form_groups", None)
        if form_groups is not None:
            form_groups()
        self._decide_widths()
        while True:
            released = self.order.release()
            if released is not None:
                self._released = released[1]
                return released[1]
            if not self.order.waiting():
                return []
            batch = self.session.next_reports()
            if not batch:
                raise RuntimeError(
                    "the session has no model left training, but the canonical order still waits "
                    "for a report: a model was started without telling the report stream"
                )
            for r in batch:
                self.order.arrived(r.model_id, r, closing=isinstance(r, self._paused))

    def __enter__(self) -> ReportStream:
        self._open.enter_context(widths_from_tuner(self.session, self.reproducible))
        return self

    def __exit__(self, *exc: object) -> None:
        self._open.close()

    def _decide_widths(self) -> None:
        """At this logical time: the epochs after those the tuner just handled (and of
        the models it started or extended) get their widths, from the models live now."""
        if self._gang is None:
            return
        if self._gang.automatic:
            raise RuntimeError("a reproducible ReportStream decides gang widths only inside its `with` block")
        from cerebro_automl.reports import EpochReport

        for r in self._released:
            budget = self.order.budget_of(r.model_id)
            if isinstance(r, EpochReport) and budget is not None:
                self._gang.reported(r.model_id, r.epoch, budget)
        self._released = []
        given = self.session.give_widths(self.order.live())
        if given and self.on_widths is not None:
            self.on_widths(given)


def default_parallelism(session: Any, parallelism: int | None, reproducible: bool) -> int:
    """Trials in training at once: ``parallelism``, or twice the workers; with
    ``reproducible``, twice the partitions, which the reproducibility key fixes
    (the workers may change)."""
    if parallelism is not None:
        return parallelism
    return 2 * (session.data.num_partitions if reproducible else len(session.workers()))


def check_reproducible(reproducible: bool, timeout: float | None) -> None:
    """``reproducible`` must be a bool, and excludes a wall-clock ``timeout``."""
    if not isinstance(reproducible, bool):
        raise TypeError(f"reproducible is {reproducible!r}, but must be True or False")
    if reproducible and timeout is not None:
        raise ValueError(
            f"timeout is {timeout!r} with reproducible=True, but a wall-clock timeout decides which "
            "trials start by timing, so the search could not come out the same; give n_trials alone"
        )


def seed_sampler(sampler: Any, seed: int, number: int) -> None:
    """Seed every random state of an Optuna sampler (and of the samplers inside it) from
    the search's ``seed`` and the number of the trial about to be asked, so that the
    ask depends on the study's history alone, also after a resume."""
    import numpy as np

    state = np.random.RandomState(np.random.SeedSequence([seed, number]).generate_state(1)[0])
    seen: set[int] = set()

    def visit(obj: Any) -> None:
        if id(obj) in seen or not hasattr(obj, "__dict__"):
            return
        seen.add(id(obj))
        for value in vars(obj).values():
            if isinstance(value, np.random.RandomState):
                value.seed(state.randint(2**31))
            elif type(value).__name__ == "LazyRandomState":
                value.rng.seed(state.randint(2**31))
            elif type(value).__module__.startswith("optuna.samplers"):
                visit(value)

    visit(sampler)

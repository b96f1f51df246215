"""Optuna drives MOP: the study chooses configurations, the Session trains them.

Ask and tell run on the driver. Every model in the hopper is one RUNNING
trial; after each epoch the trial gets ``trial.report(value, epoch)`` (with
``report_every="unit"``, after each unit, its step counting units), and the
trials that reported together are asked ``should_prune()`` in trial-number
order (SuccessiveHalvingPruner's outcome depends on that order). A pruned,
finished or failed trial frees its slot, and a new trial is asked at once.

Example:
    >>> import optuna
    >>> from cerebro_automl.adapters.optuna import optimize
    >>> study = optuna.create_study(direction="maximize",
    ...     pruner=optuna.pruners.HyperbandPruner(min_resource=1, max_resource=9))
    >>> def space(trial):
    ...     return {"lr": trial.suggest_float("lr", 1e-4, 1e-1, log=True),
    ...             "width": trial.suggest_int("width", 16, 128, log=True)}
    >>> optimize(study, spec, data, space, n_trials=40, epochs=9,
    ...          metric="val_accuracy")                                  # doctest: +SKIP

Which pruner: MedianPruner and PercentilePruner compare only against COMPLETE
trials, and in MOP all models advance together, so they prune nothing until
``n_startup_trials`` trials have run to the end. SuccessiveHalvingPruner and
HyperbandPruner (with explicit ``min_resource``/``max_resource``) compare
against every trial that reached a rung, and prune from the first rungs on:
prefer them.

Multi-objective studies are refused: Optuna's ``report``/``should_prune`` do
not exist for them, and a MOP session tunes one metric. Use one objective.

Resuming: give ``checkpoint_dir`` and a persistent storage (RDB or Journal).
If the driver dies, call ``optimize`` again with the same study. Each trial it
left RUNNING continues from its newest end-of-epoch checkpoint among the epochs
whose values reached the study: epochs checkpointed but not reported train
again (the same bits, so the same values), since the pruner must see every
step. With no such checkpoint, the trial is told FAIL (user attr
``cerebro_interrupted``) and its params are enqueued again. A trial whose last
epoch reached the study (the driver died before the tell) is told COMPLETE
with that epoch's value. ``n_trials`` counts the study's trials across
resumes; an interrupted trial that was re-enqueued counts once.

Resuming with ``reproducible=True`` gives the study an uninterrupted search
would have given, from a journal in the study: each trial's logical start (user
attr ``cerebro_start``), each pruning decision (``cerebro_prune``, with its
logical time), with ``Session(gang=True)`` each epoch's gang width and lane as
decided (``cerebro_widths``), and the last logical time fully handled (the study's
user attr ``cerebro_canonical_done``). The resume continues every trial left
RUNNING at its logical start, from a checkpoint among the epochs of handled times
or, with none, from epoch 0 as the same trial (the same bits: nothing is failed or
enqueued, so trial numbers stay, and its epochs keep their gang widths); reports
of handled times are dropped. The half-handled next
time is redone in canonical order: values already reported are not reported
again, decided prunes are taken from the journal and the others asked, tells not
made are made (a trial whose last epoch reached the study is told COMPLETE then,
not at once), trials asked then (with or without a config) start before new ones
are asked.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd

from cerebro_automl.callbacks import Callback
from cerebro_automl.checks import check_int, check_timeout
from cerebro_automl.data import PartitionedDataset
from cerebro_automl.protocol import ModelStatus
from cerebro_automl.reports import EpochReport, ModelFailed, ModelPaused, UnitReport
from cerebro_automl.session import Session
from cerebro_automl.session.interrupts import deferred
from cerebro_automl.training import TrainingSpec

from ._optuna_resume import (
    ASKED_ATTR,
    CONFIG_ATTR,
    DONE_ATTR,
    ERROR_ATTR,
    INTERRUPTED_ATTR,
    PRUNE_ATTR,
    START_ATTR,
    WIDTHS_ATTR,
    Resuming,
)
from .canonical import ReportStream, check_reproducible, default_parallelism, seed_sampler
from .search import TunedModel, check_metric, metric_value, session_for

__all__ = ["optimize", "OptunaResult"]

logger = logging.getLogger("cerebro_automl")


def _optuna():
    try:
        import optuna
    except ImportError:  # pragma: no cover - the extra is part of `all`
        raise ImportError("the Optuna adapter needs optuna: pip install 'cerebro-automl[optuna]'") from None
    return optuna


def optimize(
    study: Any,
    spec: TrainingSpec,
    data: PartitionedDataset,
    space: Callable[[Any], Mapping[str, Any]],
    *,
    n_trials: int,
    epochs: int,
    metric: str,
    parallelism: int | None = None,
    timeout: float | None = None,
    callbacks: Iterable[Callable[[Any, Any], None]] | None = None,
    session: Session | None = None,
    checkpoint_dir: str | None = None,
    seed: int = 0,
    session_callbacks: Sequence[Callback] | None = None,
    reproducible: bool = False,
    **session_kwargs: Any,
) -> Any:
    """Run ``n_trials`` trials of ``study``, training them together with MOP.

    Args:
        study: an ``optuna.Study`` with one objective (its direction applies to ``metric``).
        space: ``space(trial) -> config``, define-by-run with ``trial.suggest_*``.
        n_trials: trials in the study when done, counted across resumes.
        epochs: the epoch budget of a trial (the pruners' ``max_resource``; with
            ``report_every="unit"``, steps count units: ``epochs`` x partitions).
        metric: the reported metric, e.g. ``"val_loss"`` or ``"val_accuracy"``.
        parallelism: trials in training at once (default: twice the workers).
        timeout: seconds after which no new trial starts; running ones finish.
            ``study.stop()`` (from a callback, or GridSampler when its grid is
            exhausted) does the same.
        callbacks: ``callback(study, frozen_trial)`` after each trial ends, as in
            ``Study.optimize``.
        session: an open Session to use; otherwise one is started with
            ``seed``, ``checkpoint_dir`` and ``session_kwargs`` and closed at the end.
        session_callbacks: the session's :class:`~cerebro_automl.callbacks.Callback`
            objects (``TensorBoard``, ``MLflow``, ...): named so in every tuner,
            because ``callbacks`` here keeps Optuna's meaning.
        reproducible: the same study every time, whatever the number of workers,
            the executor, timing or faults: reports, prunes, tells and asks happen
            in canonical order (see :mod:`cerebro_automl.adapters.canonical`), and
            the sampler's random state is seeded from ``seed`` and the trial number
            before each ask. ``parallelism`` then defaults to twice the partitions,
            and ``timeout`` is refused. A resume (see the module docstring) then
            gives the study the uninterrupted search would have given.
        **session_kwargs: go to the Session it starts: ``client`` (a scheduler
            address such as ``"tcp://10.0.0.5:8786"`` or a ``distributed.Client``:
            the study then trains on that cluster), ``n_workers``, ``replicas``,
            ``min_workers``, ``order``, ``threads``, ...

    Returns:
        An :class:`OptunaResult`: the study, the session's history, and the best
        trial's model (``best_model()``, the whole model, ready for ``save_pretrained``
        when it is a HuggingFace one). Each trial's per-epoch metrics are also in its
        user attrs (``cerebro_history``).
    """
    optuna = _optuna()
    _check_arguments(optuna, study, spec, data, n_trials, epochs, metric, parallelism, timeout)
    check_reproducible(reproducible, timeout)
    if reproducible:
        _check_named_for_hyperband(optuna, study)
    with (
        session_for(
            spec,
            data,
            seed,
            session,
            dict(session_kwargs, checkpoint_dir=checkpoint_dir),
            session_callbacks,
            best=(metric, "max" if study.direction == optuna.study.StudyDirection.MAXIMIZE else "min"),
            unit_reports=True,
            reproducible=reproducible,
        ) as session,
        ReportStream(session, reproducible) as reports,
    ):
        run = _OptunaRun(
            optuna,
            study,
            session,
            space,
            n_trials,
            epochs,
            metric,
            default_parallelism(session, parallelism, reproducible),
            timeout,
            list(callbacks or []),
            checkpoint_dir or session.checkpoint_dir,
            reports,
            seed,
        )
        with _optimize_loop(study):
            run.resume_interrupted()
            if run.counted >= n_trials and not run.trials:
                logger.warning(
                    "study %r already holds %d trials and n_trials is %d: n_trials counts the study's "
                    "trials, those of earlier calls included (so that a call run again resumes), and no "
                    "trial is added; pass a larger n_trials to add more",
                    study.study_name,
                    run.counted,
                    n_trials,
                )
            run.loop()
        return _result(run, spec)


@dataclass
class OptunaResult(TunedModel):
    """What :func:`optimize` leaves: the study, the history of the models this call
    trained, and the best trial's model (``best_model()``), fetched before the session
    closed.

    ``best_trial`` is the study's best COMPLETE trial. When an earlier call trained it
    (a resume finds it in the study, not in this session), its model is read from its
    final checkpoint in ``checkpoint_dir``. The model fields are None when no trial
    completed, or when that checkpoint is missing (``why_none`` says which).
    """

    study: Any = None
    history: pd.DataFrame | None = None
    best_trial: Any = None


def _result(run: _OptunaRun, spec: TrainingSpec) -> OptunaResult:
    """The result of ``run``, read while its session is open."""
    complete = run.optuna.trial.TrialState.COMPLETE
    best = run.study.best_trial if any(t.state == complete for t in run.study.trials) else None
    fields = dict(study=run.study, history=run.session.history, best_trial=best)
    if best is None:
        return OptunaResult.of(run.session, spec, None, "no trial completed", **fields)
    if best.number in run.models:
        return OptunaResult.of(run.session, spec, run.models[best.number], "", **fields)
    # an earlier call trained it (a resume): its final checkpoint holds the model
    trained = best.user_attrs.get("cerebro_history") or [{"epoch": run.epochs}]
    why = f"its best trial {best.number} was trained by an earlier call, not this session"
    return OptunaResult.from_checkpoint(
        run.session,
        spec,
        f"trial-{best.number}",
        trained[-1]["epoch"],
        best.user_attrs.get(CONFIG_ATTR, {}),
        why,
        **fields,
    )


@contextlib.contextmanager
def _optimize_loop(study: Any):
    """Act as Study.optimize does, so that ``study.stop()`` works: GridSampler calls it
    when the grid is exhausted, and callbacks may call it. Optuna offers no public
    hook for an ask-and-tell loop, so this sets the same two fields optimize sets."""
    if study._thread_local.in_optimize_loop:
        raise RuntimeError("optimize cannot run inside another optimize or Study.optimize")
    study._stop_flag = False
    study._thread_local.in_optimize_loop = True
    try:
        yield
    finally:
        study._thread_local.in_optimize_loop = False


def describe_step(step: int, steps_per_epoch: int) -> str:
    """A trial's step in words: ``epoch 3``, or ``unit 2 of epoch 3`` (reports inside epochs)."""
    epoch, unit = divmod(step, steps_per_epoch)
    return f"epoch {epoch}" if unit == 0 else f"unit {unit} of epoch {epoch + 1}"


def _check_arguments(optuna, study, spec, data, n_trials, epochs, metric, parallelism, timeout) -> None:
    if not isinstance(study, optuna.Study):
        raise TypeError(f"study is {type(study).__name__}, but must be an optuna.Study")
    if len(study.directions) != 1:
        raise ValueError(
            f"study has {len(study.directions)} objectives, but optimize supports "
            "single-objective studies only (pruning needs one reported value)"
        )
    check_metric(spec, data, metric, "min")
    check_int("n_trials", n_trials)
    check_int("epochs", epochs)
    check_int("parallelism", parallelism, optional=True)
    check_timeout(timeout)
    pruner = study.pruner
    if isinstance(pruner, optuna.pruners.HyperbandPruner) and "auto" in (
        getattr(pruner, "_min_resource", None),
        getattr(pruner, "_max_resource", None),
    ):
        raise ValueError(
            "HyperbandPruner needs explicit min_resource and max_resource (e.g. "
            f"min_resource=1, max_resource={epochs}, or epochs x partitions with report_every='unit', "
            "whose steps count units) with optimize"
        )


def _check_named_for_hyperband(optuna, study) -> None:
    """HyperbandPruner puts a trial in a bracket by hashing the study's name with the
    trial number: an unnamed study gets a random name, so its brackets would differ."""
    if isinstance(study.pruner, optuna.pruners.HyperbandPruner) and study.study_name.startswith("no-name-"):
        raise ValueError(
            f"study_name is {study.study_name!r} (a random name Optuna gave an unnamed study), but "
            "HyperbandPruner assigns trials to brackets by hashing the study's name, so reproducible=True "
            "needs a named study: optuna.create_study(study_name=..., pruner=HyperbandPruner(...))"
        )


class _OptunaRun(Resuming):
    """The state of one optimize call: which trial each model is."""

    def __init__(
        self,
        optuna,
        study,
        session: Session,
        space,
        n_trials: int,
        epochs: int,
        metric: str,
        parallelism: int,
        timeout: float | None,
        callbacks: list,
        checkpoint_dir: str | None,
        reports: ReportStream,
        seed: int,
    ) -> None:
        self.optuna, self.study, self.session, self.space = optuna, study, session, space
        self.reports, self.seed = reports, seed
        self.n_trials, self.epochs, self.metric = n_trials, epochs, metric
        self.parallelism, self.callbacks, self.checkpoint_dir = parallelism, callbacks, checkpoint_dir
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.trials: dict[int, Any] = {}  # model id -> optuna Trial, while it trains
        self.models: dict[int, int] = {}  # trial number -> model id, every trial this call started
        self.history: dict[int, list[dict[str, float]]] = {}
        self.reported: dict[int, set[int]] = {}  # model id -> steps the trial already has
        # With reproducible: the logical time a resume redoes (None: a fresh search, whose
        # first fill is at time 0), the prunes the dead driver decided then (trial
        # number -> answer), and the Latin offset of the next trial to start (None: the
        # session's default, the model id, for a study's first trial).
        self.redo: int | None = None
        self.decided: dict[int, bool] = {}
        self.next_offset: int | None = None
        # With reproducible and gang units: model id -> epoch -> (width, lane), journaled.
        self.widths: dict[int, dict[int, tuple[int, int]]] = {}
        self.space_seen = SpaceSeen(study)
        if reports.reproducible:
            reports.on_widths = self.journal_widths
        TS = optuna.trial.TrialState
        self.counted = sum(
            1
            for t in study.get_trials(deepcopy=False)
            if t.state in (TS.COMPLETE, TS.PRUNED, TS.RUNNING)
            or (t.state == TS.FAIL and not t.user_attrs.get(INTERRUPTED_ATTR))
        )

    # ------------------------------------------------------------ the loop
    def loop(self) -> None:
        if self.redo is None:
            self.fill()
            self.mark_done()
        elif self.reports.order.next_time() != self.redo:
            # The dead driver told every trial due at the time to redo: only its fill is left.
            self.reports.order.now = self.redo
            self.fill()
            self.mark_done()
        for batch in iter(self.reports.next, []):  # [] once nothing is left to train
            # A Ctrl-C or SIGTERM acts after the whole batch (its reports, prunes, tells and
            # the user's Optuna callbacks), so no trial is left half told in the storage.
            with deferred():
                self.handle(batch)
            self.decided.clear()  # the journal's decisions were for the time just redone
            self.fill()
            self.mark_done()

    def mark_done(self) -> None:
        """With reproducible: journal that the current logical time is handled and filled."""
        if self.reports.reproducible:
            self.study.set_user_attr(DONE_ATTR, self.reports.order.now)

    def handle(self, batch: list) -> None:
        reports = sorted(
            (r for r in batch if isinstance(r, (EpochReport, UnitReport))), key=lambda r: self.trials[r.model_id].number
        )
        for r in reports:
            trial = self.trials[r.model_id]
            if isinstance(r, EpochReport):
                self.history[r.model_id].append({"epoch": r.epoch, **r.metrics})
                trial.set_user_attr("cerebro_history", self.history[r.model_id])
            step = self.reports.step_of(r)
            if step not in self.reported[r.model_id]:  # a resumed trial may have it
                trial.report(metric_value(r.metrics, self.metric), step=step)
        last = self.epochs * self.reports.steps_per_epoch
        for r in reports:  # all reports first, then the pruning calls, in trial order
            if self._may_prune(r.model_id) and self.reports.step_of(r) < last and self._should_prune(r.model_id):
                self.session.stop(r.model_id)
                self.finish(r.model_id, state=self.optuna.trial.TrialState.PRUNED)
        for r in batch:
            if isinstance(r, ModelPaused) and r.model_id in self.trials:
                value = self.history[r.model_id][-1][self.metric]
                self.finish(r.model_id, value=value)
            elif isinstance(r, ModelFailed) and r.model_id in self.trials:
                self.trials[r.model_id].set_user_attr(ERROR_ATTR, r.error[-4000:])
                self.finish(r.model_id, state=self.optuna.trial.TrialState.FAIL)

    def _should_prune(self, model_id: int) -> bool:
        """The pruner's answer for the trial; with reproducible, journaled, and taken from
        the journal when a resume redoes a time the dead driver had decided it at: the
        pruner must not be asked twice (it reads storage that later tells changed, and
        SuccessiveHalvingPruner writes the rungs it was asked at)."""
        trial = self.trials[model_id]
        if not self.reports.reproducible:
            return bool(trial.should_prune())
        if trial.number in self.decided:
            return self.decided.pop(trial.number)
        decision = bool(trial.should_prune())
        trial.set_user_attr(PRUNE_ATTR, [self.reports.order.now, decision])
        return decision

    def journal_widths(self, given: list) -> None:
        """With reproducible and gang units: journal in each trial the widths just decided
        for its epochs (user attr ``cerebro_widths``: ``[epoch, width, lane]`` each), which
        a resume gives back (deciding them again from the trials live then could differ)."""
        changed = set()
        for g in given:
            if g.model_id in self.trials:  # not one pruned at the time they were decided
                self.widths.setdefault(g.model_id, {})[g.epoch] = (g.width, g.lane)
                changed.add(g.model_id)
        for model_id in sorted(changed):
            journal = [[e, width, lane] for e, (width, lane) in sorted(self.widths[model_id].items())]
            self.trials[model_id].set_user_attr(WIDTHS_ATTR, journal)

    def _may_prune(self, model_id: int) -> bool:
        """Whether the trial is live. In canonical order the session's status is not
        asked: a model that ran ahead may have failed since, which must not count yet."""
        if self.reports.reproducible:
            return model_id in self.trials
        return self.session.status(model_id) not in (ModelStatus.STOPPED, ModelStatus.FAILED)

    def finish(self, model_id: int, value: float | None = None, state: Any = None) -> None:
        self.reports.ended(model_id)
        trial = self.trials.pop(model_id)
        frozen = self.study.tell(trial, value, state=state)
        self.log(frozen, self.history[model_id])
        for callback in self.callbacks:
            callback(self.study, frozen)

    def log(self, frozen: Any, history: list[dict[str, float]]) -> None:
        """One line per trial, as Study.optimize prints (ask and tell prints none)."""
        TS = self.optuna.trial.TrialState
        epochs = history[-1]["epoch"] if history else 0
        if frozen.state == TS.COMPLETE:
            best = self.study.best_trial
            logger.info(
                "trial %d finished: %s=%.4g after %d epochs; params %s. Best is trial %d with %.4g",
                frozen.number,
                self.metric,
                frozen.value,
                epochs,
                frozen.params,
                best.number,
                best.value,
            )
        elif frozen.state == TS.PRUNED:
            step = max(frozen.intermediate_values)
            logger.info(
                "trial %d pruned after %s: %s=%.4g; params %s",
                frozen.number,
                describe_step(step, self.reports.steps_per_epoch),
                self.metric,
                frozen.intermediate_values[step],
                frozen.params,
            )
        else:  # failed: the session has logged the error with the config
            logger.debug("trial %d: %s", frozen.number, frozen.state.name)

    def fill(self) -> None:
        """Ask new trials until the hopper holds ``parallelism`` or the budget is spent."""
        while (
            len(self.trials) < self.parallelism
            and self.counted < self.n_trials
            and not self.study._stop_flag
            and (self.deadline is None or time.monotonic() < self.deadline)
        ):
            # A trial in storage is marked ours and started before a Ctrl-C or SIGTERM
            # acts, so a resume can claim every RUNNING trial this call asked.
            with deferred():
                self._ask_one()

    def _ask_one(self) -> None:
        if self.reports.reproducible:
            seed_sampler(self.study.sampler, self.seed, len(self.study.get_trials(deepcopy=False)))
        trial = self.study.ask()
        trial.set_user_attr(ASKED_ATTR, True)
        self.counted += 1
        try:
            config = self.space(trial)
            if not isinstance(config, Mapping):
                raise TypeError(f"space returned {config!r}, but must return a config dict")
            config = dict(config)
            self.space_seen.check(trial)
        except self.optuna.TrialPruned:
            self.study.tell(trial, state=self.optuna.trial.TrialState.PRUNED)
            return
        except Exception as err:  # the search space itself is broken: stop
            trial.set_user_attr(ERROR_ATTR, f"{type(err).__name__}: {err}")
            self.study.tell(trial, state=self.optuna.trial.TrialState.FAIL)
            raise
        self._start_or_fail(trial, config)

    def _start_or_fail(self, trial: Any, config: dict[str, Any], **start: Any) -> None:
        """Start a new trial; if the session refuses its config, it fails."""
        try:
            self.start(trial, config, **start)
        except (ValueError, TypeError) as err:
            # Session.add refused this config (a key model_fn needs is missing, a
            # value is not JSON, ...): that trial fails, as an error in its first
            # unit would fail it, and the trials in training go on.
            logger.warning("trial %d failed: its config %s was refused: %s", trial.number, config, err)
            trial.set_user_attr(ERROR_ATTR, f"{type(err).__name__}: {err}"[-4000:])
            frozen = self.study.tell(trial, state=self.optuna.trial.TrialState.FAIL)
            for callback in self.callbacks:
                callback(self.study, frozen)

    def start(
        self,
        trial: Any,
        config: dict[str, Any],
        resume: tuple[int, dict] | None = None,
        offset: int | None = None,
        reported: Iterable[int] = (),
        *,
        history: list[dict[str, float]] | None = None,
        released: int | None = None,
        anchor: tuple[int, int] | None = None,
        widths: dict[int, tuple[int, int]] | None = None,
    ) -> None:
        """Add the trial's model and follow it.

        Args:
            resume: ``(epoch, state)`` of a checkpoint to continue from.
            offset: its Latin offset (a resumed trial's); with reproducible, a new trial
                takes the one after the previous trial's, as in one uninterrupted session.
            reported: steps whose values the trial has already.
            history: its per-epoch metrics so far (default: the stored ones if resumed).
            released: with reproducible, the steps whose logical times were handled
                (default: those of the epochs before it starts); their reports are dropped.
            anchor: with reproducible, the logical ``(time, epoch)`` it started at
                (default: now, after the epoch it starts from), journaled in the trial.
            widths: with reproducible, epoch -> ``(width, lane)`` of the gang widths the
                run before decided (journaled in the trial), which those epochs keep.
        """
        fresh = resume is None and offset is None
        if fresh and self.reports.reproducible:
            offset = self.next_offset
        model_id = self.session.add(
            config, epochs=self.epochs, name=f"trial-{trial.number}", resume=resume, offset=offset
        )
        epoch = resume[0] if resume else 0
        if anchor is None:
            anchor = (self.reports.order.now, epoch)
        self.reports.started(model_id, budget=self.epochs, epoch=epoch, anchor=anchor, released=released, widths=widths)
        if widths:
            self.widths[model_id] = dict(widths)
        handle = self.session.model(model_id)
        if self.reports.reproducible:
            if fresh:
                self.next_offset = handle.offset + 1
            if trial.user_attrs.get(START_ATTR) != list(anchor):
                trial.set_user_attr(START_ATTR, list(anchor))
        trial.set_user_attr(CONFIG_ATTR, config)
        trial.set_user_attr("cerebro_seed", handle.seed)
        trial.set_user_attr("cerebro_offset", handle.offset)
        self.trials[model_id] = trial
        self.models[trial.number] = model_id
        if history is None:
            history = list(trial.user_attrs.get("cerebro_history", [])) if resume else []
        self.history[model_id] = history
        self.reported[model_id] = set(reported)


class SpaceSeen:
    """The distribution each parameter had in the trials of earlier calls on the
    study, where it had one: a trial of this call that asks it from another (a space
    changed between calls, which Optuna allows) is named in a warning, once per
    parameter. A parameter whose earlier trials asked it from several (a range that
    depends on another parameter, define-by-run), or that one trial alone asked, is
    not compared."""

    def __init__(self, study: Any) -> None:
        self._study = study
        self._earlier: dict[str, tuple[Any, int]] | None = None  # read from storage at the first check
        self._warned: set[str] = set()

    def check(self, trial: Any) -> None:
        if self._earlier is None:
            self._earlier = self._fixed_distributions(trial.number)
        for name, dist in trial.distributions.items():
            earlier = self._earlier.get(name)
            if earlier is not None and earlier[0] != dist and name not in self._warned:
                self._warned.add(name)
                logger.warning(
                    "the search space changed: trial %d asks %r from %s, but trial %d of this study asked it from "
                    "%s; the study's sampler learns from both (start a new study to search the new space alone)",
                    trial.number, name, dist, earlier[1], earlier[0],
                )  # fmt: skip

    def _fixed_distributions(self, before: int) -> dict[str, tuple[Any, int]]:
        """Each parameter that at least two of the trials numbered below ``before`` asked,
        all from one distribution: that distribution and the first such trial (one trial
        cannot tell a fixed range from one that follows another parameter)."""
        seen: dict[str, tuple[Any, int]] = {}
        count: dict[str, int] = {}
        varied: set[str] = set()
        for t in self._study.get_trials(deepcopy=False):
            if t.number >= before:
                continue
            for name, dist in t.distributions.items():
                count[name] = count.get(name, 0) + 1
                if seen.setdefault(name, (dist, t.number))[0] != dist:
                    varied.add(name)
        return {name: seen[name] for name in seen if name not in varied and count[name] >= 2}

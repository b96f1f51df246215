"""Hyperopt drives MOP: its suggestion algorithms choose, the Session trains.

:func:`fmin` runs hyperopt's own asynchronous loop on the driver: it asks
``algo(new_ids, domain, trials, seed)`` for one new configuration whenever a
slot in the hopper is free, inserts the document into the caller's
``hyperopt.Trials``, and moves it NEW -> RUNNING -> DONE or ERROR as the model
trains, with ``book_time``, ``refresh_time`` and a result hyperopt's tools read.

Example:
    >>> from hyperopt import Trials, hp, tpe, space_eval
    >>> from cerebro_automl.adapters.hyperopt import fmin, MedianStoppingRule
    >>> space = {"lr": hp.loguniform("lr", -9, -2), "width": hp.choice("width", [16, 32, 64])}
    >>> trials = Trials()
    >>> best = fmin(spec, data, space, algo=tpe.suggest, max_evals=40, epochs=6,
    ...             trials=trials, rstate=np.random.default_rng(0),
    ...             prune=MedianStoppingRule())                    # doctest: +SKIP
    >>> space_eval(space, best), trials.best_trial["result"]       # doctest: +SKIP

Results. A trial that trained all ``epochs`` is DONE with
``result = {"loss", "status": "ok", "history": [per-epoch metrics], "epochs",
"config", "model_id"}``; ``loss`` is the last epoch's value of ``loss``.

Pruning. Hyperopt has no intermediate values, so the optional ``prune`` rule
runs here, after every epoch. A pruned trial is DONE with ``status: "fail"``,
``pruned: True`` and the loss of its last epoch: TPE still learns from that
loss (it reads ``result["loss"]`` whatever the status), while
``trials.best_trial``, ``argmin`` and ``average_best_error`` consider only
``"ok"`` trials, so the best is always a configuration trained to the end.

Failures. An exception in user code or a non-finite loss makes the trial an
ERROR document: ``misc["error"] = (type name, message)`` and
``result["error"]`` holds the traceback. The search goes on. As in hyperopt,
``trials.trials`` omits ERROR documents (``trials.count_by_state_unsynced(
hyperopt.JOB_STATE_ERROR)`` counts them); they count toward ``max_evals`` of
the call that ran them.

Parallelism and search quality. TPE reads NEW and RUNNING documents as loss
+inf and counts them toward ``n_startup_jobs`` (20): with ``parallelism``
trials in flight, fewer finished trials inform each suggestion, and pending
points look bad, which pushes new suggestions away from them. Keep
``parallelism`` well under ``max_evals`` (the default, twice the workers, is a
good start); ``parallelism=1`` is hyperopt's sequential search exactly.

Reproducibility. The same ``rstate`` seed with ``parallelism=1`` gives the same
configurations and the same losses (each model's training is seeded from its
config). With ``parallelism > 1``, which trial finishes first decides what the
next suggestion sees, so the sequence of configurations can differ between
runs; each configuration's training, given the config, is still reproducible.
With ``reproducible=True`` the suggestions are made in canonical order, so the
same ``Trials`` comes out on any workers, with any executor and timing.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from cerebro_automl.callbacks import Callback
from cerebro_automl.checks import check_int, check_timeout
from cerebro_automl.data import PartitionedDataset
from cerebro_automl.protocol import ModelStatus
from cerebro_automl.reports import EpochReport, ModelFailed, ModelPaused
from cerebro_automl.session import Session
from cerebro_automl.training import TrainingSpec
from cerebro_automl.values import plain

from .canonical import ReportStream, check_reproducible, default_parallelism
from .search import TunedModel, check_metric, metric_value, session_for

__all__ = ["fmin", "HyperoptResult", "MedianStoppingRule", "PruningRule"]

logger = logging.getLogger("cerebro_automl")

#: ``rule(epoch, loss, others) -> prune?``; ``others`` holds the losses at
#: ``epoch`` of every other trial of this search that reached it.
PruningRule = Callable[[int, float, list[float]], bool]


@dataclass(frozen=True)
class MedianStoppingRule:
    """Prune a trial whose loss at an epoch is worse than the median of the
    other trials' losses at the same epoch (Golovin et al., Google Vizier).

    Unlike Optuna's MedianPruner it compares against every trial that reached
    the epoch, running ones included, so in lock-step MOP it prunes from the
    first epochs on.

    Args:
        warmup_epochs: never prune at or before this epoch.
        min_trials: prune only once this many other trials reached the epoch.
    """

    warmup_epochs: int = 0
    min_trials: int = 3

    def __post_init__(self) -> None:
        check_int("warmup_epochs", self.warmup_epochs, 0)
        check_int("min_trials", self.min_trials, 0)

    def __call__(self, epoch: int, loss: float, others: list[float]) -> bool:
        if epoch <= self.warmup_epochs or len(others) < max(self.min_trials, 1):
            return False
        return not loss <= statistics.median(others)  # `not <=` also prunes a NaN loss


def _hyperopt():
    try:
        import hyperopt
    except ImportError:  # pragma: no cover - the extra is part of `all`
        raise ImportError("the hyperopt adapter needs hyperopt: pip install 'cerebro-automl[hyperopt]'") from None
    return hyperopt


def fmin(
    spec: TrainingSpec,
    data: PartitionedDataset,
    space: Any,
    *,
    algo: Callable | None = None,
    max_evals: int,
    epochs: int,
    loss: str = "val_loss",
    trials: Any = None,
    rstate: np.random.Generator | None = None,
    parallelism: int | None = None,
    early_stop_fn: Callable | None = None,
    prune: PruningRule | None = None,
    timeout: float | None = None,
    session: Session | None = None,
    seed: int = 0,
    session_callbacks: Sequence[Callback] | None = None,
    reproducible: bool = False,
    return_argmin: bool = True,
    **session_kwargs: Any,
) -> Any:
    """Minimize ``loss`` over ``space`` with hyperopt's ``algo``, training with MOP.

    Args:
        space: a hyperopt space (``hp.choice``, ``hp.loguniform``, nesting, ...)
            that evaluates to a config dict.
        algo: ``tpe.suggest`` (the default), ``rand.suggest``, ``atpe.suggest``, ...
        max_evals: trials in ``trials`` when done, as in ``hyperopt.fmin``.
        epochs: the epoch budget of every trial.
        loss: the metric to minimize, e.g. ``"val_loss"``; the last epoch's
            value is the trial's loss.
        trials: a ``hyperopt.Trials`` to fill (and to continue from).
        rstate: ``numpy.random.Generator`` for the suggestions (hyperopt's meaning).
        parallelism: trials in training at once (default: twice the workers).
        early_stop_fn: ``fn(trials, *args) -> (stop, args)``, e.g.
            ``hyperopt.early_stop.no_progress_loss(10)``, checked after every
            finished trial; running trials then finish, as in hyperopt.
        prune: a per-epoch rule such as :class:`MedianStoppingRule`.
        timeout: seconds after which no new trial starts; running ones finish.
        session: an open Session to use, as for :func:`cerebro_automl.adapters.optuna.optimize`.
        seed: the session's seed, when one is started.
        session_callbacks: the session's callbacks, as for ``optimize``.
        reproducible: the same ``Trials`` every time, whatever the workers, the
            executor or timing: reports, prunes, finished trials and ``algo``'s
            suggestions happen in canonical order (see
            :mod:`cerebro_automl.adapters.canonical`); ``rstate`` defaults to one
            seeded from ``seed``, ``parallelism`` to twice the partitions, and
            ``timeout`` is refused.
        return_argmin: as in ``hyperopt.fmin``: True returns ``trials.argmin``; False
            returns a :class:`HyperoptResult`, which also hands back the best trial's
            model.
        **session_kwargs: go to the Session it starts: ``client`` (a scheduler
            address or a ``distributed.Client``), ``n_workers``, ``replicas``, ...

    Returns:
        ``trials.argmin``, what ``hyperopt.fmin`` returns: the best trial's
        point (``hp.choice`` as an index; use ``hyperopt.space_eval``); with
        ``return_argmin=False``, a :class:`HyperoptResult`.
    """
    hyperopt = _hyperopt()
    algo = hyperopt.tpe.suggest if algo is None else algo
    trials = hyperopt.Trials() if trials is None else trials
    _check_arguments(
        hyperopt, spec, data, algo, max_evals, epochs, loss, trials, rstate, parallelism, early_stop_fn, prune, timeout
    )
    check_reproducible(reproducible, timeout)
    if rstate is None:
        rstate = np.random.default_rng(seed) if reproducible else np.random.default_rng()
    domain = hyperopt.base.Domain(_trained_by_mop, space)
    with (
        session_for(
            spec, data, seed, session, session_kwargs, session_callbacks, best=(loss, "min"), reproducible=reproducible
        ) as session,
        ReportStream(session, reproducible) as reports,
    ):
        run = _HyperoptRun(
            hyperopt,
            session,
            domain,
            space,
            algo,
            trials,
            rstate,
            epochs,
            loss,
            prune,
            early_stop_fn,
            timeout,
            default_parallelism(session, parallelism, reproducible),
            reports,
            to_run=max_evals - len(trials.trials),
        )
        try:
            run.loop()
        finally:
            run.abandon_running()
        if not return_argmin:
            return _result(run, spec)
    return trials.argmin


@dataclass
class HyperoptResult(TunedModel):
    """What :func:`fmin` leaves with ``return_argmin=False``: the ``Trials``, the best
    point, the history of the models this call trained, and the best trial's model
    (``best_model()``), fetched before the session closed, or read from its final
    checkpoint in ``checkpoint_dir`` when an earlier call trained it (None fields when
    no trial succeeded, or that checkpoint is missing: ``why_none`` says which)."""

    trials: Any = None
    argmin: dict[str, Any] | None = None
    history: pd.DataFrame | None = None


def _result(run: _HyperoptRun, spec: TrainingSpec) -> HyperoptResult:
    ok = [t for t in run.trials.trials if t["result"].get("status") == "ok"]
    best = min(ok, key=lambda t: t["result"]["loss"]) if ok else None
    fields = dict(trials=run.trials, argmin=run.trials.argmin if ok else None, history=run.session.history)
    if best is None:
        return HyperoptResult.of(run.session, spec, None, "no trial succeeded", **fields)
    if best["tid"] in run.models:
        return HyperoptResult.of(run.session, spec, run.models[best["tid"]], "", **fields)
    # an earlier call trained it (Trials passed in again): its final checkpoint holds the model
    why = f"its best trial {best['tid']} was trained by an earlier call"
    result = best["result"]
    if "epochs" not in result or "config" not in result:  # not by this adapter (hyperopt's own fmin, say)
        return HyperoptResult.of(run.session, spec, None, f"{why}, not by this adapter", **fields)
    return HyperoptResult.from_checkpoint(
        run.session, spec, f"hyperopt-{best['tid']}", result["epochs"], result["config"], why, **fields
    )


def _trained_by_mop(*args: Any) -> None:  # the Domain's fn: never called
    raise RuntimeError("cerebro_automl trains the trials; hyperopt does not evaluate them")


def _check_arguments(
    hyperopt, spec, data, algo, max_evals, epochs, loss, trials, rstate, parallelism, early_stop_fn, prune, timeout
) -> None:
    check_metric(spec, data, loss, "min")
    check_int("max_evals", max_evals)
    check_int("epochs", epochs)
    check_int("parallelism", parallelism, optional=True)
    check_timeout(timeout)
    if not isinstance(trials, hyperopt.Trials):
        raise TypeError(f"trials is {type(trials).__name__}, but must be a hyperopt.Trials")
    if rstate is not None and not isinstance(rstate, np.random.Generator):
        raise TypeError(
            f"rstate is {rstate!r}, but must be a numpy.random.Generator "
            "(np.random.default_rng(seed)), as hyperopt.fmin requires"
        )
    for name, fn in (("algo", algo), ("early_stop_fn", early_stop_fn), ("prune", prune)):
        if fn is not None and not callable(fn):
            raise TypeError(f"{name} is {fn!r}, but must be callable")


class _HyperoptRun:
    """The state of one fmin call: which trial document each model is."""

    def __init__(
        self,
        hyperopt,
        session: Session,
        domain,
        space,
        algo,
        trials,
        rstate,
        epochs: int,
        loss: str,
        prune: PruningRule | None,
        early_stop_fn,
        timeout: float | None,
        parallelism: int,
        reports: ReportStream,
        to_run: int,
    ) -> None:
        self.reports = reports
        self.hyperopt, self.session, self.domain, self.space = hyperopt, session, domain, space
        self.algo, self.trials, self.rstate = algo, trials, rstate
        self.epochs, self.loss, self.prune, self.early_stop_fn = epochs, loss, prune, early_stop_fn
        self.parallelism, self.to_run = parallelism, to_run
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.docs: dict[int, dict] = {}  # model id -> its running document
        self.models: dict[int, int] = {}  # tid -> model id, every trial this call started
        self.history: dict[int, list[dict[str, float]]] = {}
        self.losses_at: dict[int, dict[int, float]] = {}  # epoch -> tid -> loss, for prune
        self.early_stop_args: list = []
        self.stopped = False  # algo ran dry, or early_stop_fn said so

    # ------------------------------------------------------------ the loop
    def loop(self) -> None:
        self.fill()
        for batch in iter(self.reports.next, []):  # [] once nothing is left to train
            self.handle(batch)
            self.fill()

    def fill(self) -> None:
        """Ask ``algo`` for one trial at a time until the hopper is full or the budget spent."""
        while (
            len(self.docs) < self.parallelism
            and self.to_run > 0
            and not self.stopped
            and (self.deadline is None or time.monotonic() < self.deadline)
        ):
            new_ids = self.trials.new_trial_ids(1)
            self.trials.refresh()
            docs = self.algo(new_ids, self.domain, self.trials, int(self.rstate.integers(2**31 - 1)))
            if not docs:
                self.stopped = True  # e.g. a grid that is exhausted
                break
            self.trials.insert_trial_docs(docs)
            self.trials.refresh()
            self.to_run -= 1
            doc = self._live(docs[0]["tid"])
            self.start(doc)

    def start(self, doc: dict) -> None:
        hyperopt = self.hyperopt
        point = hyperopt.base.spec_from_misc(doc["misc"])
        config = plain(hyperopt.space_eval(self.space, point))
        if not isinstance(config, dict):
            raise TypeError(f"space evaluates to {config!r}, but must evaluate to a config dict")
        model_id = self.session.add(config, epochs=self.epochs, name=f"hyperopt-{doc['tid']}")
        self.models[doc["tid"]] = model_id
        self.reports.started(model_id, budget=self.epochs)
        now = hyperopt.utils.coarse_utcnow()
        doc["state"], doc["book_time"], doc["refresh_time"] = hyperopt.JOB_STATE_RUNNING, now, now
        doc["result"] = {"status": hyperopt.STATUS_RUNNING}
        self.docs[model_id] = doc
        self.history[model_id] = []
        logger.debug("hyperopt trial %d is model %d: %s", doc["tid"], model_id, config)

    def handle(self, batch: list) -> None:
        epoch_reports = sorted(
            (r for r in batch if isinstance(r, EpochReport)), key=lambda r: self.docs[r.model_id]["tid"]
        )
        for r in epoch_reports:  # record all first, then decide, in trial order
            doc = self.docs[r.model_id]
            self.history[r.model_id].append({"epoch": r.epoch, **r.metrics})
            self.losses_at.setdefault(r.epoch, {})[doc["tid"]] = metric_value(r.metrics, self.loss)
            doc["refresh_time"] = self.hyperopt.utils.coarse_utcnow()
        if self.prune is not None:
            for r in epoch_reports:
                if r.epoch < self.epochs and self._live_model(r.model_id):
                    tid = self.docs[r.model_id]["tid"]
                    others = [v for t, v in self.losses_at[r.epoch].items() if t != tid]
                    if self.prune(r.epoch, self.losses_at[r.epoch][tid], others):
                        self.session.stop(r.model_id)
                        self.finish(r.model_id, pruned=True)
        for r in batch:
            if r.model_id not in self.docs:
                continue  # pruned above
            if isinstance(r, ModelPaused):
                self.finish(r.model_id)
            elif isinstance(r, ModelFailed):
                self.fail(r.model_id, r.error)

    def _live_model(self, model_id: int) -> bool:
        """Whether the trial may be pruned. In canonical order the session's status is not
        asked: a model that ran ahead may have failed since, which must not count yet."""
        if self.reports.reproducible:
            return model_id in self.docs
        return self.session.status(model_id) not in (ModelStatus.STOPPED, ModelStatus.FAILED)

    def finish(self, model_id: int, pruned: bool = False) -> None:
        self.reports.ended(model_id)
        hyperopt, doc = self.hyperopt, self.docs.pop(model_id)
        history = self.history.pop(model_id)
        value = float(history[-1][self.loss])
        ok = not pruned and math.isfinite(value)
        doc["result"] = {
            "loss": value,
            "status": hyperopt.STATUS_OK if ok else hyperopt.STATUS_FAIL,
            "history": history,
            "epochs": history[-1]["epoch"],
            "pruned": pruned,
            "config": self.session.model(model_id).config,
            "model_id": model_id,
        }
        self._end(doc, hyperopt.JOB_STATE_DONE)
        logger.info(
            "hyperopt trial %d %s: %s=%.4g after %d epochs; config %s",
            doc["tid"],
            "pruned" if pruned else "finished",
            self.loss,
            value,
            history[-1]["epoch"],
            doc["result"]["config"],
        )

    def fail(self, model_id: int, error: str) -> None:
        self.reports.ended(model_id)
        hyperopt, doc = self.hyperopt, self.docs.pop(model_id)
        first_line = error.splitlines()[0] if error else ""
        kind, _, message = first_line.partition(": ")
        doc["misc"]["error"] = (kind, message)
        doc["result"] = {
            "status": hyperopt.STATUS_FAIL,
            "error": error,
            "history": self.history.pop(model_id),
            "config": self.session.model(model_id).config,
            "model_id": model_id,
        }
        self._end(doc, hyperopt.JOB_STATE_ERROR)
        logger.debug("hyperopt trial %d failed: %s", doc["tid"], first_line)  # the session warned

    def _end(self, doc: dict, state: int) -> None:
        doc["state"], doc["refresh_time"] = state, self.hyperopt.utils.coarse_utcnow()
        self.trials.refresh()
        if self.early_stop_fn is not None and not self.stopped:
            stop, self.early_stop_args = self.early_stop_fn(self.trials, *self.early_stop_args)
            if stop:
                logger.info("early_stop_fn stopped the search; running trials finish")
                self.stopped = True

    def abandon_running(self) -> None:
        """On an exception or Ctrl-C, end the documents still RUNNING as ERROR
        ("interrupted"), so that the Trials stays consistent: a later fmin
        with the same Trials runs those evaluations again."""
        for model_id in list(self.docs):
            doc = self.docs.pop(model_id)
            doc["misc"]["error"] = ("interrupted", "fmin ended before the trial finished")
            doc["result"] = {
                "status": self.hyperopt.STATUS_FAIL,
                "error": "interrupted",
                "history": self.history.pop(model_id, []),
            }
            doc["state"], doc["refresh_time"] = self.hyperopt.JOB_STATE_ERROR, self.hyperopt.utils.coarse_utcnow()
        self.trials.refresh()

    def _live(self, tid: int) -> dict:
        """The Trials' own document for ``tid`` (insert_trial_docs stores a copy)."""
        for doc in reversed(self.trials._dynamic_trials):
            if doc["tid"] == tid:
                return doc
        raise RuntimeError(f"trial {tid} is not in the Trials after insert_trial_docs")

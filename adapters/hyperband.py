"""Successive halving, Hyperband and ASHA on MOP, with pause and promote.

A model that reaches the end of its rung pauses with its weights and optimizer
state kept; promoting it extends its budget and it resumes where it stopped,
so a promotion costs only the new rung's epochs (no retraining).

The decisions are pure functions (:func:`hyperband_plan`, :func:`rung_epochs`,
:func:`top_k`, :func:`asha_promotable`): no Dask, no torch. The tuners below
drive a :class:`~cerebro_automl.Session` with them.

Example:
    >>> from cerebro_automl.adapters.hyperband import hyperband
    >>> def sampler(rng):
    ...     return {"lr": float(10 ** rng.uniform(-4, -2)), "width": int(rng.choice([16, 32, 64]))}
    >>> result = hyperband(spec, data, sampler, max_epochs=27, eta=3,
    ...                    metric="val_accuracy", mode="max")          # doctest: +SKIP
    >>> result.best_config, result.epochs_trained, result.decisions[0]  # doctest: +SKIP

Reproducibility: with ``order="fixed"`` (the default) or ``"cyclic"`` successive halving and
Hyperband are reproducible end to end: a rung's decision waits for the whole
rung of its bracket and depends only on its metrics, so the same seed gives the
same decisions and bitwise-identical weights on any number of workers; without
gang units their ``reproducible`` flag changes nothing. ASHA
promotes as soon as a model is in the top 1/eta of the models *that have
reached* its rung; which models those are depends on timing, so without
``reproducible=True`` its decisions can differ between runs (each model's
training, given its config and its epochs, is still reproducible). With
``reproducible=True`` it decides in canonical order (see
:mod:`cerebro_automl.adapters.canonical`): the same promotions whatever the
workers, the executor or timing. With ``gang=True`` a tuner stays so only with
``reproducible=True``: successive halving and Hyperband then decide a rung's gang
widths as it starts, from the plan alone (the rung's models, beside a rung of as
many in each bracket); without, from the models training when each report is
handled, which timing moves but which widens the slowest models of a rung as the
others end.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cerebro_automl.callbacks import Callback
from cerebro_automl.checks import check_int
from cerebro_automl.data import PartitionedDataset
from cerebro_automl.engine import WidthDecisions
from cerebro_automl.protocol import ModelStatus
from cerebro_automl.reports import EpochReport, ModelFailed, ModelPaused
from cerebro_automl.session import Session
from cerebro_automl.training import TrainingSpec
from cerebro_automl.values import rank_key

from .canonical import ReportStream, check_reproducible, default_parallelism, give_rung_widths, widths_from_tuner
from .search import SearchFailed, SearchResult, check_metric, metric_value, sampled, session_for

__all__ = [
    "successive_halving",
    "hyperband",
    "asha",
    "hyperband_plan",
    "rung_epochs",
    "top_k",
    "asha_promotable",
    "Rung",
    "RungDecision",
    "MultiFidelityResult",
]

logger = logging.getLogger("cerebro_automl")

Sampler = Callable[[np.random.Generator], Mapping[str, Any]]


# ------------------------------------------------------------------ policies
@dataclass(frozen=True)
class Rung:
    """``n`` configurations trained to ``epochs`` epochs in all."""

    n: int
    epochs: int


def hyperband_plan(max_epochs: int, eta: int = 3) -> list[list[Rung]]:
    """The brackets of Hyperband (Li et al. 2017, Algorithm 1), most exploratory first.

    With ``R = max_epochs``, ``s_max = floor(log_eta R)``: bracket ``s`` starts
    ``n = ceil((s_max + 1) / (s + 1) * eta**s)`` configurations at
    ``r = R * eta**-s`` epochs, and rung ``i`` keeps ``floor(n * eta**-i)`` of
    them for ``r * eta**i`` epochs (rounded to whole epochs, at least 1).

    Example:
        >>> [[(r.n, r.epochs) for r in b] for b in hyperband_plan(9, 3)]
        [[(9, 1), (3, 3), (1, 9)], [(5, 3), (1, 9)], [(3, 9)]]
    """
    check_int("max_epochs", max_epochs, 1)
    check_int("eta", eta, 2)
    s_max = 0
    while eta ** (s_max + 1) <= max_epochs:  # integer log, free of float error
        s_max += 1
    plan = []
    for s in range(s_max, -1, -1):
        n = -(-(s_max + 1) * eta**s // (s + 1))  # exact ceil
        plan.append([Rung(n // eta**i, max(1, round(max_epochs * eta ** (i - s)))) for i in range(s + 1)])
    return plan


def rung_epochs(min_epochs: int, max_epochs: int, eta: int) -> list[int]:
    """Successive halving's rungs: ``min_epochs * eta**i`` up to ``max_epochs`` (the last).

    >>> rung_epochs(1, 27, 3), rung_epochs(2, 20, 3)
    ([1, 3, 9, 27], [2, 6, 18, 20])
    """
    check_int("min_epochs", min_epochs, 1)
    check_int("max_epochs", max_epochs, 1)
    check_int("eta", eta, 2)
    if min_epochs > max_epochs:
        raise ValueError(f"min_epochs is {min_epochs}, but must be <= max_epochs ({max_epochs})")
    rungs = [min_epochs]
    while rungs[-1] * eta < max_epochs:
        rungs.append(rungs[-1] * eta)
    if rungs[-1] != max_epochs:
        rungs.append(max_epochs)
    return rungs


def top_k(values: Mapping[int, float], k: int, mode: str) -> tuple[list[int], list[int]]:
    """Split ``values`` (model id -> metric) into the best ``k`` and the rest.

    Ties go to the smaller id, so the split is deterministic; NaN is worst.

    >>> top_k({0: 0.5, 1: 0.2, 2: float("nan"), 3: 0.2}, 2, "min")
    ([1, 3], [0, 2])
    """
    ranked = sorted(values, key=lambda i: (rank_key(values[i], mode), i))
    return ranked[:k], ranked[k:]


def asha_promotable(rung_values: Mapping[int, float], promoted: set[int], eta: int, mode: str) -> list[int]:
    """ASHA (Li et al. 2020): the models of a rung in its top ``floor(n / eta)``
    that have not been promoted yet, best first.

    >>> asha_promotable({0: 0.9, 1: 0.1, 2: 0.5}, set(), 3, "min")
    [1]
    >>> asha_promotable({0: 0.9, 1: 0.1, 2: 0.5}, {1}, 3, "min")
    []
    """
    best, _ = top_k(rung_values, len(rung_values) // eta, mode)
    return [i for i in best if i not in promoted and not math.isinf(rank_key(rung_values[i], mode))]


def check_asha_trials(max_trials: int, epochs: Sequence[int], eta: int) -> None:
    """Refuse an ASHA budget too small for any model to reach the last rung: a rung
    promotes at most ``floor(n / eta)`` of the ``n`` models that reached it, so the
    last of ``r`` rungs needs ``eta ** (r - 1)`` trials started.

    >>> check_asha_trials(9, [1, 3, 9], 3)  # 9 -> 3 -> 1 reach the rungs at best
    >>> check_asha_trials(8, [1, 3, 9], 3)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: max_trials is 8, but must be >= eta ** 2 = 9: ...
    """
    need = eta ** (len(epochs) - 1)
    if max_trials < need:
        raise ValueError(
            f"max_trials is {max_trials}, but must be >= eta ** {len(epochs) - 1} = {need}: ASHA promotes at most "
            f"1/eta of the models that reach a rung, so with eta={eta} and rungs at {list(epochs)} epochs no model "
            f"would reach max_epochs={epochs[-1]}; start more trials, or have fewer rungs (a larger min_epochs "
            "or a smaller max_epochs)"
        )


# ------------------------------------------------------------------ results
@dataclass(frozen=True)
class RungDecision:
    """What happened at the end of one rung of one bracket: of the models in
    ``values``, the ``promoted`` go on and the ``stopped`` are stopped; a model that
    failed is in neither."""

    bracket: int
    rung: int
    epochs: int
    values: dict[int, float]  # model id -> metric at ``epochs``
    promoted: list[int]
    stopped: list[int]


@dataclass
class MultiFidelityResult(SearchResult):
    """A :class:`SearchResult` plus the rung decisions and the epochs consumed."""

    decisions: list[RungDecision] = field(default_factory=list)
    plan: list[list[Rung]] = field(default_factory=list)
    epochs_trained: int = 0
    brackets: dict[int, int] = field(default_factory=dict)  # model id -> bracket


# ------------------------------------------------------------------ tuners
def successive_halving(
    spec: TrainingSpec,
    data: PartitionedDataset,
    configs_or_sampler: Sequence[Mapping[str, Any]] | Sampler,
    *,
    min_epochs: int,
    max_epochs: int,
    eta: int = 3,
    n_configs: int | None = None,
    metric: str = "val_loss",
    mode: str = "min",
    seed: int = 0,
    session: Session | None = None,
    session_callbacks: Sequence[Callback] | None = None,
    reproducible: bool = False,
    **session_kwargs: Any,
) -> MultiFidelityResult:
    """Successive halving: train ``n_configs`` to ``min_epochs``, keep the best
    1/eta for ``eta`` times the epochs, and so on up to ``max_epochs``.

    ``configs_or_sampler`` is a list of configs (``n_configs`` defaults to its
    length) or ``sampler(rng) -> config`` (``n_configs`` defaults to
    ``eta ** (rungs - 1)``, so that one configuration reaches the top).
    ``session_callbacks`` are the session's :class:`~cerebro_automl.callbacks.Callback`
    objects; ``session_kwargs`` go to the :class:`Session` (as in every tuner here).
    """
    check_reproducible(reproducible, None)  # synchronous rungs: canonical already, gang widths aside
    epochs = rung_epochs(min_epochs, max_epochs, eta)
    configs = _draw(configs_or_sampler, n_configs, eta ** (len(epochs) - 1), seed)
    rungs = [Rung(max(1, len(configs) // eta**i), e) for i, e in enumerate(epochs)]
    return _run_brackets(spec, data, [rungs], [configs], metric, mode, seed, session, session_kwargs, session_callbacks,
                         reproducible=reproducible)  # fmt: skip


def hyperband(
    spec: TrainingSpec,
    data: PartitionedDataset,
    sampler: Sampler,
    *,
    max_epochs: int,
    eta: int = 3,
    metric: str = "val_loss",
    mode: str = "min",
    seed: int = 0,
    session: Session | None = None,
    session_callbacks: Sequence[Callback] | None = None,
    reproducible: bool = False,
    **session_kwargs: Any,
) -> MultiFidelityResult:
    """Hyperband (Li et al. 2017, Algorithm 1): every bracket of
    :func:`hyperband_plan` at once in one session, so the hopper stays full."""
    check_reproducible(reproducible, None)  # synchronous rungs: canonical already, gang widths aside
    plan = hyperband_plan(max_epochs, eta)
    if max_epochs < eta:
        raise ValueError(
            f"max_epochs is {max_epochs}, but must be >= eta ({eta}) for hyperband to stop any configuration "
            f"early: its plan is then one configuration trained for {max_epochs} epochs; lower eta, or train "
            "configurations in full with random_search"
        )
    if not callable(sampler):
        raise TypeError(f"sampler is {sampler!r}, but must be callable as sampler(rng) -> config")
    rng = np.random.default_rng(seed)
    configs = [[sampled(sampler, rng) for _ in range(bracket[0].n)] for bracket in plan]
    return _run_brackets(spec, data, plan, configs, metric, mode, seed, session, session_kwargs, session_callbacks,
                         reproducible=reproducible)  # fmt: skip


def asha(
    spec: TrainingSpec,
    data: PartitionedDataset,
    sampler: Sampler,
    *,
    min_epochs: int,
    max_epochs: int,
    eta: int = 3,
    max_trials: int,
    parallelism: int | None = None,
    metric: str = "val_loss",
    mode: str = "min",
    seed: int = 0,
    session: Session | None = None,
    session_callbacks: Sequence[Callback] | None = None,
    reproducible: bool = False,
    **session_kwargs: Any,
) -> MultiFidelityResult:
    """Asynchronous successive halving (Li et al. 2020).

    Whenever fewer than ``parallelism`` models train (default: twice the
    workers), promote a paused model in the top 1/eta of its rung (from the
    highest rung down), or else start the next of ``max_trials`` configurations
    from ``sampler``. Models never promoted are stopped at the end. ``max_trials``
    must be at least ``eta ** (rungs - 1)``, so that a model can reach
    ``max_epochs`` (:func:`check_asha_trials`). The configurations are drawn and
    checked before any training (as if drawn one by one: the same ones). The
    result's ``decisions`` list each promotion, with the rung's values then (their
    ``stopped`` is empty: a model is stopped only at the end, by the statuses), and
    ``plan`` and ``brackets`` are empty (one bracket, its rungs ``rung_epochs``).
    """
    check_reproducible(reproducible, None)
    epochs = rung_epochs(min_epochs, max_epochs, eta)
    check_int("max_trials", max_trials, 1)
    check_asha_trials(max_trials, epochs, eta)
    check_int("parallelism", parallelism, optional=True)
    if not callable(sampler):
        raise TypeError(f"sampler is {sampler!r}, but must be callable as sampler(rng) -> config")
    check_metric(spec, data, metric, mode)
    rng = np.random.default_rng(seed)
    configs = [sampled(sampler, rng) for _ in range(max_trials)]
    for config in configs:
        spec.validate_config(config)  # all checked before any training
    with (
        session_for(
            spec, data, seed, session, session_kwargs, session_callbacks, best=(metric, mode), reproducible=reproducible
        ) as s,
        ReportStream(s, reproducible) as reports,
    ):
        run = _AshaRun(
            s,
            configs,
            epochs,
            eta,
            default_parallelism(s, parallelism, reproducible),
            metric,
            mode,
            reports,
        )
        run.loop()
        return _result(s, spec, metric, mode, max_epochs, run.decisions, [], {})


# ------------------------------------------------------------------ drivers
def _draw(configs_or_sampler: Any, n_configs: int | None, default_n: int, seed: int) -> list[dict]:
    if callable(configs_or_sampler):
        if n_configs is not None:
            check_int("n_configs", n_configs, 1)
        rng = np.random.default_rng(seed)
        return [sampled(configs_or_sampler, rng) for _ in range(n_configs or default_n)]
    if isinstance(configs_or_sampler, (Mapping, str)) or not isinstance(configs_or_sampler, Sequence):
        raise TypeError(
            f"configs_or_sampler is {configs_or_sampler!r}, but must be a list of configs or a sampler(rng) -> config"
        )
    configs = list(configs_or_sampler)
    if not configs:
        raise ValueError(
            "configs_or_sampler is an empty list, but must hold at least one config (or be a sampler(rng) -> config)"
        )
    if n_configs is not None:
        check_int("n_configs", n_configs, 1)
        if n_configs > len(configs):
            raise ValueError(f"n_configs is {n_configs}, but only {len(configs)} configs were given")
        configs = configs[:n_configs]
    return [dict(c) for c in configs]


def _run_brackets(spec, data, plan, configs, metric, mode, seed, session, session_kwargs, session_callbacks=None,
                  reproducible=False):  # fmt: skip
    """Run every bracket at once: add all first-rung models, then decide each
    bracket's rung when all of its models have reported the rung's last epoch. With
    gang units and ``reproducible``, each rung's widths come from the plan (see
    :func:`~.canonical.give_rung_widths`); without, from the models training as reports come."""
    check_metric(spec, data, metric, mode)
    for bracket in configs:
        for config in bracket:
            spec.validate_config(config)  # all checked before any training
    decisions: list[RungDecision] = []
    with (
        session_for(
            spec, data, seed, session, session_kwargs, session_callbacks, best=(metric, mode), reproducible=reproducible
        ) as s,
        widths_from_tuner(s, reproducible) as gang,  # each rung's widths from the plan, as the rung starts
    ):
        brackets: dict[int, int] = {}
        waiting: dict[int, set[int]] = {}  # bracket -> models still training its rung
        rung_of = dict.fromkeys(range(len(plan)), 0)
        alive: dict[int, list[int]] = {}
        for b, (rungs, bracket) in enumerate(zip(plan, configs, strict=True)):
            alive[b] = [s.add(c, epochs=rungs[0].epochs) for c in bracket]
            brackets.update(dict.fromkeys(alive[b], b))
            waiting[b] = set(alive[b])
            give_rung_widths(s, gang, alive[b], 0, rungs[0].epochs, sharing=len(plan), place=b)
        values: dict[int, float] = {}
        for batch in iter(s.next_reports, []):
            for r in batch:
                if isinstance(r, EpochReport):
                    values[r.model_id] = metric_value(r.metrics, metric)
                elif isinstance(r, (ModelPaused, ModelFailed)):
                    if isinstance(r, ModelFailed):
                        values[r.model_id] = math.nan
                    b = brackets[r.model_id]
                    waiting[b].discard(r.model_id)
                    if not waiting[b]:
                        waiting[b] = _decide(s, gang, plan[b], b, rung_of, alive, values, mode, decisions)
        # brackets finish rungs in an order that depends on timing; the decisions do not
        decisions.sort(key=lambda d: (d.bracket, d.rung))
        return _result(s, spec, metric, mode, plan[0][-1].epochs, decisions, plan, brackets)


def _decide(
    s: Session,
    gang: WidthDecisions | None,
    rungs: list[Rung],
    b: int,
    rung_of: dict[int, int],
    alive: dict[int, list[int]],
    values: dict[int, float],
    mode: str,
    decisions: list[RungDecision],
) -> set[int]:
    """Close bracket ``b``'s current rung; return the models now training its next."""
    i = rung_of[b]
    at_rung = {m: values.get(m, math.nan) for m in alive[b]}
    if i + 1 == len(rungs):
        decisions.append(RungDecision(b, i, rungs[i].epochs, at_rung, [], []))
        logger.info("bracket %d done at %d epochs: best %.4g (model %d)", b, rungs[i].epochs, *_best(at_rung, mode))
        return set()
    promoted, stopped = top_k(at_rung, rungs[i + 1].n, mode)
    promoted = [m for m in promoted if not math.isnan(at_rung[m])]
    stopped = [m for m in at_rung if m not in promoted and s.status(m) != ModelStatus.FAILED]  # failed: not ours
    for m in stopped:
        s.stop(m)
    for m in promoted:
        s.extend(m, rungs[i + 1].epochs - rungs[i].epochs)
    give_rung_widths(s, gang, promoted, rungs[i].epochs, rungs[i + 1].epochs, sharing=len(rung_of), place=b)
    decisions.append(RungDecision(b, i, rungs[i].epochs, at_rung, promoted, stopped))
    logger.info(
        "bracket %d rung %d at %d epochs: %d of %d models go on to %d epochs %s, %d stopped, %d failed; "
        "best %.4g (model %d)",
        b,
        i,
        rungs[i].epochs,
        len(promoted),
        len(at_rung),
        rungs[i + 1].epochs,
        promoted,
        len(stopped),
        len(at_rung) - len(promoted) - len(stopped),
        *_best(at_rung, mode),
    )
    rung_of[b], alive[b] = i + 1, promoted
    return set(promoted)


class _AshaRun:
    def __init__(
        self,
        s: Session,
        configs: list[dict[str, Any]],
        epochs: list[int],
        eta: int,
        parallelism: int,
        metric: str,
        mode: str,
        reports: ReportStream,
    ) -> None:
        self.s, self.configs, self.epochs, self.eta = s, configs, epochs, eta
        self.reports = reports
        self.parallelism, self.metric, self.mode = parallelism, metric, mode
        self.rungs: list[dict[int, float]] = [{} for _ in epochs]  # rung -> model id -> value
        self.promoted: list[set[int]] = [set() for _ in epochs]
        self.rung_of: dict[int, int] = {}
        self.training: set[int] = set()
        self.started = 0
        self.last: dict[int, float] = {}
        self.decisions: list[RungDecision] = []

    def loop(self) -> None:
        self.fill()
        for batch in iter(self.reports.next, []):
            for r in batch:
                if isinstance(r, EpochReport):
                    self.last[r.model_id] = metric_value(r.metrics, self.metric)
                elif isinstance(r, (ModelPaused, ModelFailed)):
                    self.training.discard(r.model_id)
                    k = self.rung_of[r.model_id]
                    failed = isinstance(r, ModelFailed)
                    self.rungs[k][r.model_id] = math.nan if failed else self.last[r.model_id]
            self.fill()
        for k, rung in enumerate(self.rungs[:-1]):  # never promoted: done
            for m in rung:
                if m not in self.promoted[k] and self.s.status(m) == ModelStatus.PAUSED:
                    self.s.stop(m)
                    self.reports.ended(m)

    def fill(self) -> None:
        while len(self.training) < self.parallelism:
            promotion = self._next_promotion()
            if promotion is not None:
                k, m = promotion
                self.promoted[k].add(m)
                self.s.extend(m, self.epochs[k + 1] - self.epochs[k])
                self.reports.extended(m, budget=self.epochs[k + 1])
                logger.info(
                    "asha: model %d promoted from rung %d (%.4g at %d epochs, top %d of %d) to %d epochs",
                    m,
                    k,
                    self.rungs[k][m],
                    self.epochs[k],
                    len(self.rungs[k]) // self.eta,
                    len(self.rungs[k]),
                    self.epochs[k + 1],
                )
                self.rung_of[m] = k + 1
                self.decisions.append(RungDecision(0, k, self.epochs[k], dict(self.rungs[k]), [m], []))
            elif self.started < len(self.configs):
                m = self.s.add(self.configs[self.started], epochs=self.epochs[0])
                self.reports.started(m, budget=self.epochs[0])
                self.rung_of[m] = 0
                self.started += 1
            else:
                return
            self.training.add(m)

    def _next_promotion(self) -> tuple[int, int] | None:
        for k in range(len(self.epochs) - 2, -1, -1):  # highest rung first
            for m in asha_promotable(self.rungs[k], self.promoted[k], self.eta, self.mode):
                return k, m
        return None


def _best(values: Mapping[int, float], mode: str) -> tuple[float, int]:
    """The best value of a rung and its model (NaN, -1 when every model failed)."""
    ranked, _ = top_k(values, 1, mode)
    return (values[ranked[0]], ranked[0]) if ranked else (math.nan, -1)


def _result(
    s: Session,
    spec: TrainingSpec,
    metric: str,
    mode: str,
    max_epochs: int,
    decisions: list[RungDecision],
    plan: list[list[Rung]],
    brackets: dict[int, int],
) -> MultiFidelityResult:
    history = s.history
    if brackets:
        history = history.assign(bracket=history["model_id"].map(brackets))
    top = history[history["epoch"] == max_epochs]
    top = top[top[metric].notna()] if metric in top else top.iloc[:0]  # no column: no model reported
    if top.empty:
        raise SearchFailed.of(f"no model reached max_epochs={max_epochs} with a finite {metric}", history)
    ranked = top.assign(key=[rank_key(v, mode) for v in top[metric]]).sort_values(["key", "model_id"])
    best = s.model(int(ranked["model_id"].iloc[0]))
    return MultiFidelityResult(
        history,
        metric,
        mode,
        best.model_id,
        best.config,
        float(ranked[metric].iloc[0]),
        dict(best.metrics),
        best.state(),
        spec,
        best.seed,
        decisions=decisions,
        plan=plan,
        epochs_trained=int(history["error"].isna().sum()) if "error" in history else len(history),
        brackets=brackets,
    )

"""Grid and random search on MOP: every configuration trains at once.

Example:
    >>> from cerebro_automl.adapters.search import grid_search
    >>> result = grid_search(spec, data, {"lr": [1e-3, 1e-2], "width": [32, 64]},
    ...                      epochs=5, metric="val_accuracy", mode="max")   # doctest: +SKIP
    >>> result.best_config, result.best_value                              # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import torch

from cerebro_automl.callbacks import Callback
from cerebro_automl.checkpoint import load_checkpoint
from cerebro_automl.checks import check_int
from cerebro_automl.data import PartitionedDataset
from cerebro_automl.reports import EpochReport, ModelFailed, ModelPaused
from cerebro_automl.session import Session
from cerebro_automl.training import TrainingSpec, whole_model
from cerebro_automl.training.seeding import canonical_config
from cerebro_automl.values import plain

from .canonical import check_reproducible, give_rung_widths, widths_from_tuner

__all__ = [
    "SearchResult",
    "SearchFailed",
    "result_of",
    "TunedModel",
    "grid_search",
    "random_search",
    "grid_configs",
    "random_configs",
    "check_metric",
    "metric_value",
    "session_for",
]

logger = logging.getLogger("cerebro_automl")


@dataclass
class SearchResult:
    """What a search leaves: the history, the best model and its weights.

    ``best_model()`` is the whole model (a peft model's base included), so a HuggingFace
    model can ``save_pretrained``; ``best_state`` is what trained (see the fine-tuning guide).
    """

    history: pd.DataFrame
    metric: str
    mode: str
    best_model_id: int
    best_config: dict[str, Any]
    best_value: float
    best_metrics: dict[str, float]
    best_state: dict
    spec: TrainingSpec
    best_seed: int

    def best_model(self) -> torch.nn.Module:
        """The best configuration's model with its trained weights, on the CPU."""
        return whole_model(self.spec, self.best_config, self.best_state, self.best_seed)


class SearchFailed(RuntimeError, ValueError):
    """No model of a search finished with a finite metric, so it has no best model.
    ``history`` holds every epoch that trained, and a row per failed model with its
    error (the ``error`` column): nothing trained is lost with the result. It is a
    ``ValueError`` too, so ``except ValueError`` catches it."""

    def __init__(self, message: str, history: pd.DataFrame) -> None:
        super().__init__(message)
        self.history = history

    @classmethod
    def of(cls, what: str, history: pd.DataFrame) -> SearchFailed:
        """``what`` went wrong, with the number of failures and the first error."""
        errors = history["error"].dropna() if "error" in history else pd.Series(dtype=object)
        failed = f"{len(errors)} models failed, the first with {errors.iloc[0]!r}" if len(errors) else "no model failed"
        return cls(f"{what}; {failed}; this exception's history holds the epochs trained and the failures", history)

    def __reduce__(self) -> tuple:
        return type(self), (str(self), self.history)


def sampled(sampler: Callable[[np.random.Generator], Any], rng: np.random.Generator) -> dict[str, Any]:
    """One config from ``sampler(rng)``, a copy; a sampler that returns no mapping is
    refused, naming what it returned.

    >>> sampled(lambda rng: {"lr": 0.1}, np.random.default_rng(0))
    {'lr': 0.1}
    """
    config = sampler(rng)
    if not isinstance(config, Mapping):
        raise TypeError(f"sampler returned {config!r}, but must return a config dict (name -> value)")
    return dict(config)


def check_metric(spec: TrainingSpec, data: PartitionedDataset, metric: str, mode: str) -> None:
    """Fail before training when ``metric`` is not one the spec produces."""
    if mode not in ("min", "max"):
        raise ValueError(f"mode is {mode!r}, but must be 'min' or 'max'")
    names = spec.metric_names if data.has_validation else ["train_loss"]
    if names is None:
        return  # the spec learns its names while training (Lightning's self.log): see metric_value
    if metric not in names:
        hint = (
            ""
            if data.has_validation or not metric.startswith("val_")
            else f" (the dataset has no validation data: {data.how_to_validate})"
        )
        raise ValueError(f"metric is {metric!r}, but the spec produces only {names}{hint}")


def metric_value(metrics: Mapping[str, float], metric: str) -> float:
    """``metrics[metric]`` as a float, or a ValueError naming the metrics the epoch did report."""
    if metric not in metrics:
        raise ValueError(f"metric is {metric!r}, but the epoch reported only {sorted(metrics)}")
    return float(metrics[metric])


def grid_configs(space: Mapping[str, Sequence[Any]]) -> list[dict[str, Any]]:
    """Every combination of the values in ``space``, in the order the keys are given.

    >>> grid_configs({"lr": [0.1, 0.01], "width": [8]})
    [{'lr': 0.1, 'width': 8}, {'lr': 0.01, 'width': 8}]
    """
    _check_space(space)
    for key, values in space.items():
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or len(values) == 0:
            raise ValueError(f"space[{key!r}] is {values!r}, but must be a non-empty list of values")
    keys = list(space)
    return [dict(zip(keys, combo, strict=True)) for combo in itertools.product(*(space[k] for k in keys))]


def random_configs(
    space: Mapping[str, Sequence[Any] | Callable[[np.random.Generator], Any]], n_configs: int, seed: int = 0
) -> list[dict[str, Any]]:
    """``n_configs`` draws: a list gives a uniform choice, a callable ``f(rng)`` a sample.

    >>> random_configs({"lr": lambda rng: float(10 ** rng.uniform(-4, -1)), "width": [8, 16]}, 2)[0].keys()
    dict_keys(['lr', 'width'])
    """
    _check_space(space)
    check_int("n_configs", n_configs)
    for key, values in space.items():
        if not callable(values) and (
            isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or len(values) == 0
        ):
            raise ValueError(f"space[{key!r}] is {values!r}, but must be a non-empty list or a callable rng -> value")
    rng = np.random.default_rng(seed)
    configs = []
    for _ in range(n_configs):
        config = {}
        for key, values in space.items():
            config[key] = values(rng) if callable(values) else plain(values[int(rng.integers(len(values)))])
        configs.append(config)
    return configs


def grid_search(
    spec: TrainingSpec,
    data: PartitionedDataset,
    space: Mapping[str, Sequence[Any]],
    *,
    epochs: int,
    metric: str = "val_loss",
    mode: str = "min",
    seed: int = 0,
    session: Session | None = None,
    session_callbacks: Sequence[Callback] | None = None,
    reproducible: bool = False,
    **session_kwargs: Any,
) -> SearchResult:
    """Train every combination in ``space`` for ``epochs`` epochs with MOP.

    ``session_kwargs`` go to :class:`Session` (``client``, ``n_workers``,
    ``order``, ``threads``, ...); or pass an open ``session`` to reuse.
    ``session_callbacks`` are the session's :class:`~cerebro_automl.callbacks.Callback`
    objects (``TensorBoard``, ``MLflow``, ...), under the name every tuner uses.
    A grid makes no decision while it trains, so it comes out the same on any workers
    with or without ``reproducible``; with gang units (``Session(gang=True)``) it
    takes ``reproducible=True`` to give every epoch the width of the configs' count,
    where without, the widths follow the models still training, which timing moves.
    """
    check_reproducible(reproducible, None)
    return run_configs(
        spec,
        data,
        grid_configs(space),
        epochs=epochs,
        metric=metric,
        mode=mode,
        seed=seed,
        session=session,
        session_callbacks=session_callbacks,
        reproducible=reproducible,
        **session_kwargs,
    )


def random_search(
    spec: TrainingSpec,
    data: PartitionedDataset,
    space: Mapping[str, Sequence[Any] | Callable[[np.random.Generator], Any]],
    *,
    n_configs: int,
    epochs: int,
    metric: str = "val_loss",
    mode: str = "min",
    seed: int = 0,
    session: Session | None = None,
    session_callbacks: Sequence[Callback] | None = None,
    reproducible: bool = False,
    **session_kwargs: Any,
) -> SearchResult:
    """Train ``n_configs`` random draws from ``space`` (see :func:`random_configs`);
    the other arguments as for :func:`grid_search`."""
    check_reproducible(reproducible, None)
    return run_configs(
        spec,
        data,
        random_configs(space, n_configs, seed),
        epochs=epochs,
        metric=metric,
        mode=mode,
        seed=seed,
        session=session,
        session_callbacks=session_callbacks,
        reproducible=reproducible,
        **session_kwargs,
    )


def run_configs(
    spec: TrainingSpec,
    data: PartitionedDataset,
    configs: list[dict[str, Any]],
    *,
    epochs: int,
    metric: str,
    mode: str,
    seed: int,
    session: Session | None = None,
    session_callbacks: Sequence[Callback] | None = None,
    reproducible: bool = False,
    **session_kwargs: Any,
) -> SearchResult:
    """Train ``configs`` together, all for ``epochs`` epochs; return the best. With
    ``reproducible`` and gang units, every epoch's width comes from the configs' count,
    as one rung's (see :meth:`~cerebro_automl.engine.WidthDecisions.rung`)."""
    check_metric(spec, data, metric, mode)
    check_int("epochs", epochs)
    for config in configs:  # every config is checked before any training starts
        spec.validate_config(config)
    with (
        session_for(
            spec, data, seed, session, session_kwargs, session_callbacks, best=(metric, mode), reproducible=reproducible
        ) as s,
        widths_from_tuner(s, reproducible) as gang,
    ):
        added = [s.add(config, epochs=epochs) for config in configs]
        give_rung_widths(s, gang, added, 0, epochs)
        ids = set(added)
        done = 0
        for r in s.reports():  # one line per model, as Optuna prints one per trial
            if isinstance(r, EpochReport) and metric not in r.metrics:  # names learnt while training (Lightning)
                raise SearchFailed.of(
                    f"metric is {metric!r}, but model {r.model_id}'s epoch {r.epoch} reported only {sorted(r.metrics)}",
                    s.history,
                )
            if isinstance(r, (ModelPaused, ModelFailed)) and r.model_id in ids:
                done += 1
            if isinstance(r, ModelPaused) and r.model_id in ids:
                m = s.model(r.model_id)
                logger.info(
                    "model %d finished (%d of %d): %s=%.4g after %d epochs; config %s",
                    r.model_id,
                    done,
                    len(ids),
                    metric,
                    m.metrics.get(metric, float("nan")),
                    r.epochs,
                    m.config,
                )
        try:
            best = s.best(metric, mode)
        except ValueError as err:
            raise SearchFailed.of(f"no model finished with a finite {metric} ({err})", s.history) from None
        logger.info("best: model %d, %s=%.4g; config %s", best.model_id, metric, best.metrics[metric], best.config)
        return result_of(s, spec, metric, mode, best.model_id, best.metrics[metric], SearchResult)


@dataclass
class TunedModel:
    """The best model of a tuner's call, fetched before its session closed: None
    fields when this call trained none that is best (``why_none`` says why)."""

    spec: TrainingSpec
    best_model_id: int | None
    best_config: dict[str, Any] | None
    best_state: dict | None
    best_seed: int | None
    why_none: str

    @classmethod
    def of(cls, s: Session, spec: TrainingSpec, model_id: int | None, why_none: str, **fields: Any) -> Any:
        """``cls`` with ``model_id``'s config, state and seed read from ``s`` (open)."""
        if model_id is None:
            return cls(spec, None, None, None, None, why_none, **fields)
        best = s.model(model_id)
        return cls(spec, model_id, best.config, best.state(), best.seed, why_none, **fields)

    @classmethod
    def from_checkpoint(
        cls,
        s: Session,
        spec: TrainingSpec,
        name: str,
        epoch: int,
        config: Mapping[str, Any],
        why_none: str,
        **fields: Any,
    ) -> Any:
        """``cls`` with the model an earlier call trained (a resumed study's best trial):
        model ``name``'s checkpoint after ``epoch`` in ``s``'s checkpoint_dir, checked to
        be ``config``'s with this session's seed (the model it holds is built again from
        them; what else the run had, its threads or workers, does not change that). Without
        one, the model fields are None and ``why_none`` says what is missing."""
        if s.checkpoint_dir is None:
            return cls.of(s, spec, None, f"{why_none}, and this session has no checkpoint_dir to read it from",
                          **fields)  # fmt: skip
        try:
            state, meta = load_checkpoint(s.checkpoint_dir, name, epoch)
        except (ValueError, OSError, RuntimeError) as err:
            return cls.of(s, spec, None, f"{why_none}, and its checkpoint cannot be read: {err}", **fields)
        written = (canonical_config(meta.get("config", {})), meta.get("session_seed"))
        if written != (canonical_config(config), s.seed):
            return cls.of(s, spec, None, f"{why_none}, and its checkpoint {name!r} after epoch {epoch} was "
                          f"written for config {meta.get('config')} and seed {meta.get('session_seed')}, "
                          f"not {dict(config)} and {s.seed}", **fields)  # fmt: skip
        return cls(spec, None, dict(meta["config"]), state, int(meta["seed"]), "", **fields)

    def best_model(self) -> torch.nn.Module:
        """The best model with its trained weights, on the CPU: the whole model (a peft
        model's base included), ready for ``save_pretrained`` when it is a HuggingFace one."""
        if self.best_state is None or self.best_config is None or self.best_seed is None:
            raise ValueError(f"this {type(self).__name__} holds no model: {self.why_none}")
        return whole_model(self.spec, self.best_config, self.best_state, self.best_seed)


def result_of(
    s: Session, spec: TrainingSpec, metric: str, mode: str, model_id: int, value: float, cls: type, **extra: Any
) -> Any:
    """A :class:`SearchResult` (or ``cls``, a subclass) whose best model is ``model_id``,
    with its newest state fetched while the session is open."""
    best = s.model(model_id)
    return cls(
        s.history, metric, mode, model_id, best.config, value, best.metrics, best.state(), spec, best.seed, **extra
    )


@contextlib.contextmanager
def session_for(
    spec: TrainingSpec,
    data: PartitionedDataset,
    seed: int,
    session: Session | None,
    session_kwargs: Mapping[str, Any],
    session_callbacks: Sequence[Callback] | None = None,
    *,
    best: tuple[str, str] | None = None,
    unit_reports: bool = False,
    reproducible: bool = False,
) -> Iterator[Session]:
    """The tuner's session: the caller's open ``session``, or one started with
    ``session_kwargs`` and ``session_callbacks`` and closed when the tuner ends,
    whatever happens. ``best``: the tuner's ``(metric, mode)``; with
    ``keep_checkpoints`` and no ``keep_best``, each model's best epoch by it is kept.
    ``unit_reports``: whether the tuner acts on reports inside epochs; one that does
    not refuses ``report_every="unit"``, which would cost evaluations for nothing.
    ``reproducible``: the tuner's; it refuses ``order="dynamic"``, whose units take
    whichever partition's worker is free first.

    Every tuner takes the session's callbacks as ``session_callbacks``, never as
    ``callbacks``: in ``optimize`` that name is Optuna's ``callback(study, trial)``,
    and one name that meant two things across tuners would be a trap.
    """
    if "callbacks" in session_kwargs:
        raise TypeError(
            "callbacks is given, but tuners take the session's callbacks as "
            "session_callbacks=[...] (the same name in every tuner; optimize's "
            "callbacks= are Optuna's callback(study, trial))"
        )
    every = session.report_every if session is not None else session_kwargs.get("report_every", "epoch")
    if every == "unit" and not unit_reports:
        raise ValueError(
            "report_every is 'unit', but this tuner decides only when epochs end (asha, hyperband, "
            "successive_halving, pbt, grid_search, random_search and fmin count epochs), so reports "
            "inside epochs would cost evaluations and change nothing: pass report_every='epoch', or "
            "prune inside epochs with optimize and an Optuna pruner"
        )
    order = session.order if session is not None else session_kwargs.get("order", "fixed")
    if reproducible and order == "dynamic":
        raise ValueError(
            "order is 'dynamic' with reproducible=True, but dynamic order gives each unit whichever partition's "
            "worker is free first, so the search depends on timing: pass order='fixed' or 'cyclic'"
        )
    if session is not None:
        if session_callbacks:
            raise ValueError(
                "session_callbacks is given with an open session, but an open "
                "session's callbacks were set when it started: pass "
                "Session(..., callbacks=[...])"
            )
        yield session
        return
    kwargs = dict(session_kwargs)
    if best is not None and kwargs.get("keep_checkpoints") is not None and kwargs.get("keep_best") is None:
        kwargs["keep_best"] = best
    with Session(spec, data, seed=seed, callbacks=session_callbacks, **kwargs) as own:
        yield own


def _check_space(space: Any) -> None:
    if not isinstance(space, Mapping) or not space:
        raise ValueError(f"space is {space!r}, but must be a non-empty dict of name -> values")

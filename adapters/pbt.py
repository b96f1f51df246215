"""Population-based training (Jaderberg et al. 2017) on MOP, in synchronous generations.

A population trains together. Every ``interval`` epochs the whole population
has reported; the members in the bottom ``quantile`` are replaced by forks of
members drawn from the top ``quantile``: a fork starts from its parent's
weights and optimizer state at that epoch (``Session.add(..., init_from=...)``,
no checkpoint round trip) with a perturbed config ("exploit" and "explore").
The result is a hyperparameter *schedule* per member.

The decisions are pure functions (:func:`rank_population`, :func:`exploit`,
:func:`perturb`, :func:`next_generation`) of the reported metrics and a seeded
generator, so a PBT run gives the same decisions, and with ``order="fixed"`` (or ``"cyclic"``)
bitwise-identical weights, on any number of workers.

Example:
    >>> from cerebro_automl.adapters.pbt import pbt
    >>> def sampler(rng):
    ...     return {"lr": float(10 ** rng.uniform(-4, -2)), "dropout": float(rng.choice([0.0, 0.1, 0.3]))}
    >>> result = pbt(spec, data, sampler, population=8, epochs=12, interval=2,
    ...              metric="val_accuracy", mode="max",
    ...              mutations={"lr": (1e-5, 1e-1), "dropout": [0.0, 0.1, 0.3]})   # doctest: +SKIP
    >>> result.best_config, result.schedules[result.best_model_id]                   # doctest: +SKIP
"""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from cerebro_automl.protocol import ModelStatus
from cerebro_automl.values import rank_key

__all__ = [
    "pbt",
    "plot_pbt",
    "Mutation",
    "Fork",
    "Generation",
    "PBTResult",
    "check_mutations",
    "check_mutated_keys",
    "check_mutations_keep_weights",
    "rank_population",
    "exploit",
    "perturb",
    "next_generation",
]

logger = logging.getLogger("cerebro_automl")

# How one hyperparameter is perturbed:
# "continuous": multiplied by 0.8 or 1.2; (low, high): the same, kept within the bounds;
# a list: moved to a neighbouring value; a callable: mutation(value, rng) -> new value.
Mutation = str | tuple | Sequence[Any] | Callable[[Any, np.random.Generator], Any]
Sampler = Callable[[np.random.Generator], Mapping[str, Any]]


# ------------------------------------------------------------------ policies
def check_mutations(mutations: Mapping[str, Mutation]) -> None:
    """Raise naming the first mutation that is none of the accepted forms."""
    if not isinstance(mutations, Mapping) or not mutations:
        raise ValueError(f"mutations is {mutations!r}, but must be a non-empty dict of hyperparameter -> mutation")
    for key, m in mutations.items():
        if m == "continuous" or callable(m):
            continue
        if isinstance(m, tuple) and len(m) == 2 and all(isinstance(b, (int, float)) for b in m):
            if not m[0] < m[1]:
                raise ValueError(f"mutations[{key!r}] is {m!r}, but bounds must be (low, high) with low < high")
            continue
        if isinstance(m, list) and m:
            continue
        raise ValueError(
            f"mutations[{key!r}] is {m!r}, but must be 'continuous', (low, high), "
            "a non-empty list of values, or a callable(value, rng)"
        )


def check_mutated_keys(mutations: Mapping[str, Mutation], config: Mapping[str, Any]) -> None:
    """Every key ``mutations`` names is in ``config``, a list's key holds one of its values
    and a tuple's key a value within its bounds (a list is a set of choices and a tuple
    bounds: a value outside them would be snapped to one, silently)."""
    missing = [k for k in mutations if k not in config]
    if missing:
        raise ValueError(f"mutations name {missing}, which sampler's config {dict(config)} lacks")
    for key, m in mutations.items():
        if isinstance(m, list) and config[key] not in m:
            raise ValueError(
                f"mutations[{key!r}] is the list {m!r}, but the sampler gave {key}={config[key]!r}, which is "
                "not one of its values: a list is the choices a value moves between; give bounds as a "
                "tuple (low, high)"
            )
        value = config[key]
        if isinstance(m, tuple) and (isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real)):
            raise ValueError(
                f"mutations[{key!r}] is the bounds {m!r}, but the sampler gave {key}={value!r}, which is not a "
                "number: bounds scale a number; give a list of its values instead"
            )
        if isinstance(m, tuple) and not m[0] <= value <= m[1]:
            raise ValueError(
                f"mutations[{key!r}] is the bounds {m!r}, but the sampler gave {key}={config[key]!r}, which is "
                "outside them: a fork's value is kept within (low, high), so it would jump to a bound"
            )


def check_mutations_keep_weights(
    spec: Any, mutations: Mapping[str, Mutation], configs: Sequence[Mapping[str, Any]]
) -> None:
    """Raise when a value ``mutations`` can give one of ``configs`` (one step of a
    list, a tuple or ``"continuous"``) changes the shapes of its model's weights (a
    width, a depth) or makes ``model_fn`` fail: a fork continues from its parent's
    weights, so it would fail after training. One config per set of non-float values
    is checked, built on the meta device where the model builds there; a callable
    mutation is not called (it may draw from the search's generator), and a config
    whose own build fails is not checked (it fails alone)."""
    from cerebro_automl.training import canonical_config, weights_layout

    shapes: dict[str, Any] = {}

    def layout(config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
        key = canonical_config(config)
        if key not in shapes:
            try:
                shapes[key] = {name: shape for name, (shape, _) in weights_layout(spec, config).items()}
            except Exception as err:
                shapes[key] = err
        if isinstance(shapes[key], Exception):
            raise shapes[key]
        return shapes[key]

    checked: set[str] = set()
    for config in configs:
        # One config per set of non-float values: floats (rates) rarely shape a model,
        # and a population that differs only in them would cost a build per member.
        kind = canonical_config({k: v for k, v in config.items() if not isinstance(v, float)})
        if kind in checked:
            continue
        checked.add(kind)
        try:
            own = layout(config)
        except Exception:
            continue
        for key, mutation in mutations.items():
            for value in _mutated_values(config[key], mutation):
                try:
                    differs = _layout_difference(own, layout({**config, key: value}))
                except Exception as err:
                    raise ValueError(
                        f"mutations[{key!r}] can give {key}={value!r} (from {config[key]!r}), for which model_fn "
                        f"fails: {type(err).__name__}: {err}; give bounds (low, high) or a list of values it takes"
                    ) from None
                if differs:
                    raise ValueError(
                        f"mutations[{key!r}] can give {key}={value!r} (from {config[key]!r}), which changes the "
                        f"shapes of the model's weights ({differs}): a fork continues from its parent's weights, so "
                        "mutate only what keeps them (rates, regularisation, dropout, schedules), not layer widths "
                        "or depths"
                    )


def _mutated_values(value: Any, mutation: Mutation) -> list[Any]:
    """The values other than ``value`` that ``mutation`` can give: a list's others, or
    one step of :func:`perturb`'s scaling either way; none for a callable."""
    if isinstance(mutation, list):
        return [v for v in mutation if v != value]
    if callable(mutation) or isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        return []
    return [
        moved for moved in (_scaled(value, mutation, up=False), _scaled(value, mutation, up=True)) if moved != value
    ]


def _layout_difference(layout: Mapping[str, Any], other: Mapping[str, Any]) -> str:
    changed = sorted(k for k in set(layout) | set(other) if layout.get(k) != other.get(k))
    shown = [f"{k}: {layout.get(k, 'absent')} -> {other.get(k, 'absent')}" for k in changed[:3]]
    return "; ".join(shown) + (f"; and {len(changed) - 3} more" if len(changed) > 3 else "")


def _scaled(value: Any, mutation: Mutation, up: bool) -> Any:
    """``value`` times 1.2 (``up``) or 0.8, kept within a tuple's bounds; an int stays one."""
    scaled = value * (1.2 if up else 0.8)
    if isinstance(mutation, tuple):
        scaled = min(max(scaled, mutation[0]), mutation[1])
    return int(round(scaled)) if _is_int(value) else round(float(scaled), 12)


def _is_int(value: Any) -> bool:
    """An int of Python or numpy (a sampler's ``rng.integers``), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def rank_population(values: Mapping[int, float], mode: str) -> list[int]:
    """Member ids best first; ties go to the smaller id; NaN last.

    >>> rank_population({3: 0.5, 1: float("nan"), 2: 0.9}, "max")
    [2, 3, 1]
    """
    return sorted(values, key=lambda m: (rank_key(values[m], mode), m))


def exploit(values: Mapping[int, float], quantile: float, mode: str, rng: np.random.Generator) -> list[tuple[int, int]]:
    """``(loser, parent)`` pairs: each member of the bottom ``quantile`` (and every
    failed member) copies a member drawn uniformly from the top ``quantile``.

    The quantile holds ``ceil(n * quantile)`` members, at most half of them; a
    failed member (NaN) is never a parent. Losers come worst first.

    >>> exploit({0: 0.1, 1: 0.9, 2: 0.5, 3: 0.7}, 0.25, "max", np.random.default_rng(0))
    [(0, 1)]
    """
    ranked = rank_population(values, mode)
    k = min(math.ceil(len(ranked) * quantile), len(ranked) // 2)
    failed = {m for m in ranked if math.isinf(rank_key(values[m], mode))}
    top = [m for m in ranked[:k] if m not in failed]
    bottom = set(ranked[len(ranked) - k :]) if k else set()
    if not top:
        return []
    losers = [m for m in reversed(ranked) if m in bottom or m in failed]
    return [(loser, top[int(rng.integers(len(top)))]) for loser in losers]


def perturb(
    config: Mapping[str, Any],
    mutations: Mapping[str, Mutation],
    rng: np.random.Generator,
    sampler: Sampler | None = None,
    resample_probability: float = 0.0,
) -> tuple[dict[str, Any], dict[str, tuple[Any, Any]]]:
    """A perturbed copy of ``config`` and the changes ``{key: (old, new)}``.

    Keys are perturbed in the order ``mutations`` gives them; with probability
    ``resample_probability`` a key is drawn again from ``sampler(rng)`` instead.
    Keys not in ``mutations`` are copied unchanged.

    Example:
        >>> perturb({"lr": 0.01, "opt": "adam"}, {"lr": "continuous"}, np.random.default_rng(1))[1]
        {'lr': (0.01, 0.012)}
    """
    new = dict(config)
    for key, mutation in mutations.items():
        if key not in config:
            raise ValueError(f"mutations names {key!r}, which config {dict(config)} lacks")
        old = config[key]
        if sampler is not None and resample_probability > 0 and rng.random() < resample_probability:
            drawn = sampler(rng)
            if key not in drawn:
                raise ValueError(f"sampler(rng) returned {dict(drawn)}, which lacks {key!r} to resample")
            value = drawn[key]
        elif isinstance(mutation, list):
            index = mutation.index(old) if old in mutation else int(rng.integers(len(mutation)))
            value = mutation[int(np.clip(index + (1 if rng.random() < 0.5 else -1), 0, len(mutation) - 1))]
        elif callable(mutation):
            value = mutation(old, rng)
        else:
            value = _scaled(old, mutation, up=not rng.random() < 0.5)
        new[key] = value.item() if isinstance(value, np.generic) else value
    return new, {k: (config[k], new[k]) for k in mutations if new[k] != config[k]}


@dataclass(frozen=True)
class Fork:
    """One replacement: ``loser`` is stopped, ``child`` starts from ``parent`` at ``epoch``."""

    loser: int
    parent: int
    config: dict[str, Any]
    changes: dict[str, tuple[Any, Any]]
    child: int | None = None  # the new model's id, once added


@dataclass(frozen=True)
class Generation:
    """The decision at the end of one interval."""

    number: int
    epoch: int
    values: dict[int, float]  # member id -> metric at ``epoch``
    forks: list[Fork]


def next_generation(
    values: Mapping[int, float],
    configs: Mapping[int, Mapping[str, Any]],
    *,
    quantile: float,
    mode: str,
    mutations: Mapping[str, Mutation],
    rng: np.random.Generator,
    sampler: Sampler | None = None,
    resample_probability: float = 0.0,
) -> list[Fork]:
    """The forks that replace the bottom of the population (see :func:`exploit`,
    :func:`perturb`); draws from ``rng`` in a fixed order.

    >>> forks = next_generation({0: 0.1, 1: 0.9}, {0: {"lr": 0.1}, 1: {"lr": 0.2}}, quantile=0.5,
    ...                         mode="max", mutations={"lr": "continuous"}, rng=np.random.default_rng(0))
    >>> [(f.loser, f.parent) for f in forks]
    [(0, 1)]
    """
    forks = []
    for loser, parent in exploit(values, quantile, mode, rng):
        config, changes = perturb(configs[parent], mutations, rng, sampler, resample_probability)
        forks.append(Fork(loser, parent, config, changes))
    return forks


# ------------------------------------------------------------------ results
@dataclass
class PBTResult:
    """The best member, every member's schedule and every decision (filled by :func:`pbt`)."""

    history: Any
    metric: str
    mode: str
    best_model_id: int
    best_config: dict[str, Any]
    best_value: float
    best_state: dict
    generations: list[Generation] = field(default_factory=list)
    # model id -> [(first epoch, last epoch, config)] along its lineage, parents first
    schedules: dict[int, list[tuple[int, int, dict[str, Any]]]] = field(default_factory=dict)
    epochs_trained: int = 0
    spec: Any = None
    best_seed: int = 0

    def best_model(self) -> Any:
        """The best member's model with its trained weights, on the CPU (the whole model)."""
        from cerebro_automl.training import whole_model

        if self.spec is None:
            raise ValueError("this PBTResult holds no TrainingSpec to build its best model with")
        return whole_model(self.spec, self.best_config, self.best_state, self.best_seed)


# ------------------------------------------------------------------ driver
def pbt(
    spec: Any,
    data: Any,
    sampler: Sampler,
    *,
    population: int,
    epochs: int,
    interval: int,
    mutations: Mapping[str, Mutation],
    metric: str = "val_loss",
    mode: str = "min",
    quantile: float = 0.25,
    resample_probability: float = 0.25,
    seed: int = 0,
    session: Any = None,
    session_callbacks: Sequence[Any] | None = None,
    reproducible: bool = False,
    **session_kwargs: Any,
) -> PBTResult:
    """Population-based training in synchronous generations.

    ``population`` configurations from ``sampler(rng)`` train together. Every
    ``interval`` epochs, when the whole population has reported, the bottom
    ``quantile`` (and every failed member) is replaced by forks of members drawn
    from the top ``quantile``, whose configs are perturbed by ``mutations``
    (see :func:`perturb`; with ``resample_probability`` a value is drawn from
    ``sampler`` again); the others train on. Runs to ``epochs`` epochs in all.
    ``session_kwargs`` go to the :class:`~cerebro_automl.Session`, and
    ``session_callbacks`` are its callbacks (as in every tuner).

    Keys not in ``mutations`` never change, so every member builds the same
    architecture and a fork's weights fit: mutate optimizer and regularization
    hyperparameters (lr, weight decay, dropout), not layer widths.

    ``reproducible`` is accepted as every tuner takes it: a generation is decided
    when the whole population has reported, so the search is the same on any
    workers. Gang units (``gang=True``) take their widths from the models training as
    reports come, which depends on timing, so ``reproducible=True`` refuses them.
    """
    from cerebro_automl.checks import check_int

    from .canonical import check_reproducible
    from .search import check_metric, sampled, session_for

    check_reproducible(reproducible, None)  # synchronous generations: canonical already
    if reproducible and (session_kwargs.get("gang") or getattr(session, "gang", None) is not None):
        raise ValueError(
            "reproducible is True with gang units, but pbt gives gang units the widths of the models training "
            "as reports come, which depends on timing; leave gang off for a reproducible pbt"
        )
    check_int("population", population, 2)
    check_int("epochs", epochs)
    check_int("interval", interval)
    if isinstance(quantile, bool) or not isinstance(quantile, (int, float)) or not 0 < quantile <= 0.5:
        raise ValueError(f"quantile is {quantile!r}, but must be in (0, 0.5]")
    if (
        isinstance(resample_probability, bool)
        or not isinstance(resample_probability, (int, float))
        or not 0 <= resample_probability <= 1
    ):
        raise ValueError(f"resample_probability is {resample_probability!r}, but must be in [0, 1]")
    if not callable(sampler):
        raise TypeError(f"sampler is {sampler!r}, but must be callable as sampler(rng) -> config")
    check_mutations(mutations)
    check_metric(spec, data, metric, mode)
    rng = np.random.default_rng(seed)
    configs = [sampled(sampler, rng) for _ in range(population)]
    for config in configs:
        spec.validate_config(config)  # all checked before any training
        check_mutated_keys(mutations, config)
    check_mutations_keep_weights(spec, mutations, configs)
    with session_for(
        spec, data, seed, session, session_kwargs, session_callbacks, best=(metric, mode), reproducible=reproducible
    ) as s:
        run = _PBTRun(s, sampler, rng, mutations, metric, mode, quantile, resample_probability)
        run.loop(configs, epochs, interval)
        return run.result(epochs)


class _PBTRun:
    def __init__(
        self,
        s: Any,
        sampler: Sampler,
        rng: np.random.Generator,
        mutations: Mapping[str, Mutation],
        metric: str,
        mode: str,
        quantile: float,
        resample_probability: float,
    ) -> None:
        self.s, self.sampler, self.rng, self.mutations = s, sampler, rng, mutations
        self.metric, self.mode, self.quantile, self.resample = metric, mode, quantile, resample_probability
        self.parents: dict[int, tuple[int, int]] = {}  # model id -> (parent id, epoch it forked at)
        self.generations: list[Generation] = []

    def loop(self, configs: list[dict], epochs: int, interval: int) -> None:
        from cerebro_automl.reports import EpochReport, ModelFailed, ModelPaused

        from .search import metric_value

        t = min(interval, epochs)
        members = [self.s.add(c, epochs=t) for c in configs]
        while True:
            values: dict[int, float] = {}
            waiting = set(members)
            for batch in iter(self.s.next_reports, []):
                for r in batch:
                    if isinstance(r, EpochReport) and r.model_id in waiting and r.epoch == t:
                        values[r.model_id] = metric_value(r.metrics, self.metric)
                    elif isinstance(r, (ModelPaused, ModelFailed)):
                        waiting.discard(r.model_id)
                if not waiting:
                    break
            values = {
                m: values.get(m, math.nan) if self.s.status(m) != ModelStatus.FAILED else math.nan for m in members
            }
            if t >= epochs:
                self.generations.append(Generation(len(self.generations), t, values, []))
                return
            members = self._next(members, values, t, min(t + interval, epochs))
            if not members:
                return
            t = min(t + interval, epochs)

    def _next(self, members: list[int], values: dict[int, float], t: int, t_next: int) -> list[int]:
        """Replace the bottom of the population by forks, train every member on to ``t_next``."""
        configs = {m: self.s.model(m).config for m in members}
        forks = next_generation(
            values,
            configs,
            quantile=self.quantile,
            mode=self.mode,
            mutations=self.mutations,
            rng=self.rng,
            sampler=self.sampler,
            resample_probability=self.resample,
        )
        added, children = [], []
        for fork in forks:
            child = self.s.add(fork.config, epochs=t_next, init_from=(fork.parent, t))
            self.parents[child] = (fork.parent, t)
            added.append(replace(fork, child=child))
            children.append(child)
        losers = {f.loser for f in forks}
        survivors = [m for m in members if m not in losers and self.s.status(m) == ModelStatus.PAUSED]
        for m in sorted(losers):
            if self.s.status(m) == ModelStatus.PAUSED:
                self.s.stop(m)
        for m in survivors:
            self.s.extend(m, t_next - t)
        self.generations.append(Generation(len(self.generations), t, values, added))
        logger.info(
            "pbt generation %d after epoch %d: %s",
            len(self.generations) - 1,
            t,
            ", ".join(f"{f.loser} <- fork of {f.parent} as {f.child} {f.changes}" for f in added) or "no change",
        )
        return survivors + children

    def schedule(self, model_id: int) -> list[tuple[int, int, dict[str, Any]]]:
        """``[(first epoch, last epoch, config)]`` along the model's lineage, oldest first."""
        segments = []
        end = None
        m = model_id
        while True:
            info = self.s.model(m)
            start = self.parents[m][1] + 1 if m in self.parents else 1
            last = info.epochs if end is None else end
            segments.append((start, last, info.config))
            if m not in self.parents:
                return segments[::-1]
            m, end = self.parents[m][0], self.parents[m][1]

    def result(self, epochs: int) -> PBTResult:
        history = self.s.history
        final = self.generations[-1].values if self.generations else {}
        alive = {m: v for m, v in final.items() if not math.isnan(v)}
        if not alive:
            from .search import SearchFailed

            raise SearchFailed.of(f"no member of the population reached epoch {epochs} with a finite {self.metric}",
                               history)  # fmt: skip
        best = rank_population(alive, self.mode)[0]
        handle = self.s.model(best)
        trained = int(history["error"].isna().sum()) if "error" in history else len(history)
        return PBTResult(
            history,
            self.metric,
            self.mode,
            best,
            handle.config,
            alive[best],
            handle.state(),
            generations=self.generations,
            schedules={m: self.schedule(m) for m in sorted(set(history["model_id"]))},
            epochs_trained=trained,
            spec=self.s.spec,
            best_seed=handle.seed,
        )


def plot_pbt(
    result: PBTResult, keys: Sequence[str] | None = None, *, path: str | Path | None = None, title: str | None = None
) -> Any:
    """Draw each final member's hyperparameter schedule (one panel per key, the best
    member thick) and its metric along its lineage; return the figure, saved to ``path``.

    ``keys``: the hyperparameters to draw (default: those that changed).
    """
    try:
        import matplotlib

        if path is not None:
            matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover - part of the examples extra
        raise ImportError("plot_pbt needs matplotlib: pip install 'cerebro-automl[examples]'") from None
    final = list(result.generations[-1].values) if result.generations else [result.best_model_id]
    if keys is None:
        keys = sorted({k for g in result.generations for f in g.forks for k in f.changes}) or sorted(result.best_config)
    fig, axes = plt.subplots(len(keys) + 1, 1, figsize=(7, 2.2 * (len(keys) + 1)), sharex=True)
    history = result.history.set_index(["model_id", "epoch"])
    for ax, key in zip(axes, keys, strict=False):  # log scale for positive values spread over a decade or more
        values = [c.get(key) for m in final for _, _, c in result.schedules[m]]
        numbers = [v for v in values if isinstance(v, (int, float))]
        if len(numbers) == len(values) and all(v > 0 for v in numbers) and max(numbers) >= 10 * min(numbers):
            ax.set_yscale("log")
        ax.set_ylabel(key)
    for m in final:
        best = m == result.best_model_id
        style = dict(
            lw=2.5 if best else 1,
            alpha=1.0 if best else 0.45,
            color="C3" if best else None,
            label=f"model {m}" + (" (best)" if best else ""),
            zorder=3 if best else 2,
        )
        segments = result.schedules[m]
        # a segment's values are in force while it trains epochs start..last: from x = start - 1 to last
        xs = [start - 1 for start, _, _ in segments] + [segments[-1][1]]
        for ax, key in zip(axes, keys, strict=False):
            ax.step(xs, [c.get(key) for _, _, c in segments] + [segments[-1][2].get(key)], where="post", **style)
        owners = _owners(result, m)
        epochs = range(1, segments[-1][1] + 1)
        metric = [history.loc[(next(o for o in owners if (o, e) in history.index), e), result.metric] for e in epochs]
        axes[-1].plot(list(epochs), metric, **style)
    axes[-1].set_ylabel(result.metric)
    axes[-1].set_xlabel("epoch")
    axes[-1].xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    axes[0].legend(fontsize=7, ncol=2)
    axes[0].set_title(title or f"PBT schedules of the final population (best: model {result.best_model_id})")
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=110)
    return fig


def _owners(result: PBTResult, model_id: int) -> list[int]:
    """The model and its ancestors, newest first: who trained each epoch of its lineage."""
    out, m = [model_id], model_id
    parents = {f.child: f.parent for g in result.generations for f in g.forks}
    while m in parents:
        m = parents[m]
        out.append(m)
    return out

"""Population-based training (Jaderberg et al. 2017) on MOP, in synchronous generations.

A population trains together. Every ``interval`` epochs the whole population
has reported; the members in the bottom ``quantile`` are replaced by forks of
members drawn from the top ``quantile``: a fork starts from its parent's
weights and optimizer state at that epoch (``Session.add(..., init_from=...)``,
no checkpoint round trip) with a perturbed config ("exploit" and "explore").
The result is a hyperparameter *schedule* per member.

The decisions are pure functions (:func:`rank_population`, :func:`exploit`,
:func:`perturb`, :func:`next_generation`) of the reported metrics and a seeded
generator, so a PBT run gives the same decisions, and with ``order="fixed"``
bitwise-identical weights, on any number of workers.

Example:
    >>> from cerebro_automl.adapters.pbt import pbt  # doctest: +SKIP
    >>> def sampler(rng):
    ...     return {"lr": float(10 ** rng.uniform(-4, -2)), "dropout": float(rng.choice([0.0, 0.1, 0.3]))}
    >>> result = pbt(spec, data, sampler, population=8, epochs=12, interval=2,
    ...              metric="val_accuracy", mode="max",
    ...              mutations={"lr": (1e-5, 1e-1), "dropout": [0.0, 0.1, 0.3]})   # doctest: +SKIP
    >>> result.best_config, result.schedules[result.best_model_id]                   # doctest: +SKIP
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence, Union

import numpy as np

__all__ = ["Mutation", "Fork", "Generation", "PBTResult", "check_mutations",
           "rank_population", "exploit", "perturb", "next_generation"]

# How one hyperparameter is perturbed:
# "continuous": multiplied by 0.8 or 1.2; (low, high): the same, kept within the bounds;
# a list: moved to a neighbouring value; a callable: mutation(value, rng) -> new value.
Mutation = Union[str, tuple, Sequence[Any], Callable[[Any, np.random.Generator], Any]]
Sampler = Callable[[np.random.Generator], Mapping[str, Any]]


# ------------------------------------------------------------------ policies
def check_mutations(mutations: Mapping[str, Mutation]) -> None:
    """Raise naming the first mutation that is none of the accepted forms."""
    if not isinstance(mutations, Mapping) or not mutations:
        raise ValueError(f"mutations is {mutations!r}, but must be a non-empty dict of "
                         "hyperparameter -> mutation")
    for key, m in mutations.items():
        if m == "continuous" or callable(m):
            continue
        if isinstance(m, tuple) and len(m) == 2 and all(isinstance(b, (int, float)) for b in m):
            if not m[0] < m[1]:
                raise ValueError(f"mutations[{key!r}] is {m!r}, but bounds must be (low, high) with low < high")
            continue
        if isinstance(m, list) and m:
            continue
        raise ValueError(f"mutations[{key!r}] is {m!r}, but must be 'continuous', (low, high), "
                         "a non-empty list of values, or a callable(value, rng)")


def _key(value: float, mode: str) -> float:
    """Smaller is better; NaN (a failed or diverged member) is worst."""
    if value is None or math.isnan(value):
        return math.inf
    return value if mode == "min" else -value


def rank_population(values: Mapping[int, float], mode: str) -> list[int]:
    """Member ids best first; ties go to the smaller id; NaN last.

    >>> rank_population({3: 0.5, 1: float("nan"), 2: 0.9}, "max")
    [2, 3, 1]
    """
    return sorted(values, key=lambda m: (_key(values[m], mode), m))


def exploit(values: Mapping[int, float], quantile: float, mode: str,
            rng: np.random.Generator) -> list[tuple[int, int]]:
    """``(loser, parent)`` pairs: each member of the bottom ``quantile`` (and every
    failed member) copies a member drawn uniformly from the top ``quantile``.

    The quantile holds ``ceil(n * quantile)`` members, at most half of them; a
    failed member (NaN) is never a parent. Losers come worst first.

    >>> exploit({0: 0.1, 1: 0.9, 2: 0.5, 3: 0.7}, 0.25, "max", np.random.default_rng(0))
    [(0, 1)]
    """
    ranked = rank_population(values, mode)
    k = min(math.ceil(len(ranked) * quantile), len(ranked) // 2)
    failed = {m for m in ranked if math.isinf(_key(values[m], mode))}
    top = [m for m in ranked[:k] if m not in failed]
    bottom = set(ranked[len(ranked) - k:]) if k else set()
    if not top:
        return []
    losers = [m for m in reversed(ranked) if m in bottom or m in failed]
    return [(loser, top[int(rng.integers(len(top)))]) for loser in losers]


def perturb(config: Mapping[str, Any], mutations: Mapping[str, Mutation], rng: np.random.Generator,
            sampler: Sampler | None = None, resample_probability: float = 0.0
            ) -> tuple[dict[str, Any], dict[str, tuple[Any, Any]]]:
    """A perturbed copy of ``config`` and the changes ``{key: (old, new)}``.

    Keys are perturbed in the order ``mutations`` gives them; with probability
    ``resample_probability`` a key is drawn again from ``sampler(rng)`` instead.
    Keys not in ``mutations`` are copied unchanged.

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
            value = old * (0.8 if rng.random() < 0.5 else 1.2)
            if isinstance(mutation, tuple):
                value = min(max(value, mutation[0]), mutation[1])
            value = int(round(value)) if isinstance(old, int) and not isinstance(old, bool) else round(value, 12)
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
    values: dict[int, float]   # member id -> metric at ``epoch``
    forks: list[Fork]


def next_generation(values: Mapping[int, float], configs: Mapping[int, Mapping[str, Any]], *,
                    quantile: float, mode: str, mutations: Mapping[str, Mutation],
                    rng: np.random.Generator, sampler: Sampler | None = None,
                    resample_probability: float = 0.0) -> list[Fork]:
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


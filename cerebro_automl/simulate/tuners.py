"""Tuners in virtual time: the real tuner adapters drive a :class:`SimulatedSession`.

A ``SimulatedSession`` has the surface of a :class:`~cerebro_automl.Session` that
tuners use (``add``, ``stop``, ``extend``, ``next_reports``, ``status``, ``model``,
``history``, ``workers``), backed by the real :class:`~cerebro_automl.engine.Scheduler`
in virtual time (see :mod:`.virtual_time`). A model's unit cost and its learning
curve are modelled from its configuration, so an Optuna study with its pruner,
ASHA, Hyperband or successive halving runs at p = 128 workers in seconds, and
the session reports makespan and utilization over time.

Example:
    >>> from cerebro_automl.adapters.hyperband import asha
    >>> sim = SimulatedSession(workers=8, seed=0)
    >>> def sampler(rng):
    ...     return {"lr": float(rng.uniform(0, 1))}
    >>> result = asha(sim.spec, sim.data, sampler, min_epochs=1, max_epochs=9, eta=3,
    ...               max_trials=27, session=sim)
    >>> timeline = sim.timeline(bins=4)
    >>> len(timeline.utilization), 0 < timeline.utilization_total <= 1
    (4, True)
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..checks import check_int
from ..engine import WidthDecisions
from ..protocol import BudgetExtended, GangWidth, ModelsAdded, ModelStatus, ModelStopped, NewModel, Pause, Report
from ..reports import EpochReport, ModelPaused, Outcome
from .virtual_time import GangCost, Stragglers, _Simulation

__all__ = ["SimulatedSession", "Timeline", "modelled_curve", "modelled_cost"]

Curve = Callable[[Mapping[str, Any], int], dict[str, float]]


def _config_key(config: Mapping[str, Any], seed: int) -> list[int]:
    digest = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).digest()
    return [seed, int.from_bytes(digest[:8], "little")]


def modelled_curve(config: Mapping[str, Any], epoch: int, *, seed: int = 0) -> dict[str, float]:
    """A learning curve drawn from the configuration: ``val_loss`` falls as a power
    law from 2.3 towards a floor, both drawn per configuration (the same config,
    the same curve); ``val_accuracy`` mirrors it.

    >>> a, b = modelled_curve({"lr": 0.1}, 1), modelled_curve({"lr": 0.1}, 9)
    >>> a["val_loss"] > b["val_loss"] and a == modelled_curve({"lr": 0.1}, 1)
    True
    """
    rng = np.random.default_rng(_config_key(config, seed))
    floor, speed = rng.uniform(0.05, 1.2), rng.uniform(0.3, 1.5)
    val_loss = floor + (2.3 - floor) * epoch ** (-speed)
    return {"train_loss": 0.9 * val_loss, "val_loss": val_loss, "val_accuracy": 1.0 - val_loss / 2.5}


def modelled_cost(config: Mapping[str, Any], *, seed: int = 0, spread: float = 4.0) -> float:
    """Seconds of one unit, drawn per configuration between 1 and ``spread``
    (wider or deeper models cost more).

    >>> 1.0 <= modelled_cost({"lr": 0.1}) <= 4.0
    True
    """
    rng = np.random.default_rng([*_config_key(config, seed), 1])
    return float(rng.uniform(1.0, spread))


@dataclass(frozen=True)
class Timeline:
    """Utilization over a simulated search: ``utilization[i]`` is the busy share of
    the workers in the i-th of equal slices of the makespan. ``tail_start`` is the
    virtual time after which the workers were never again more than half busy
    (averaged over a slice); ``tail_share`` that tail's share of the makespan, and
    ``tail_idle_share`` the share of all idle worker-seconds that fell in it."""

    makespan: float
    utilization_total: float
    utilization: tuple[float, ...]
    tail_start: float
    tail_share: float
    tail_idle_share: float


class _TunerSimulation(_Simulation):
    """The virtual-time executor, with reports kept for a tuner and busy intervals recorded."""

    def __init__(self, session: SimulatedSession, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.session = session
        self.intervals: list[tuple[float, float]] = []

    def dispatch(self, instructions: list) -> None:
        for ins in instructions:
            if isinstance(ins, Report):
                self.session._reported(ins.model_id, ins.epoch, self.now)
            elif isinstance(ins, Pause):
                self.session._outbox.append(ModelPaused(ins.model_id, ins.epochs))
        super().dispatch(instructions)

    def record_busy(self, start: float, seconds: float) -> None:
        self.intervals.append((start, start + seconds))


class SimulatedSession:
    """A Session in virtual time for tuners (see the module docstring).

    Args:
        workers: p.
        partitions: P (default ``workers``).
        unit_cost: seconds of one unit of a config (default :func:`modelled_cost`).
        eval_cost: seconds of one model's evaluation over all validation shards.
        curve: ``(config, epoch) -> metrics`` (default :func:`modelled_curve`).
        hop: seconds to move a model's state between workers.
        seed: the session seed (Latin order) and the curves' and costs' draws.
        order: the scheduler's visit order.
        stragglers: slow workers or units (:class:`~cerebro_automl.simulate.Stragglers`).
        gang: gang units at this cost (:class:`~cerebro_automl.simulate.GangCost`):
            the widths are decided as a ``Session(gang=True)`` decides them.
    """

    def __init__(
        self,
        workers: int,
        *,
        partitions: int | None = None,
        unit_cost: Callable[[Mapping[str, Any]], float] | None = None,
        eval_cost: float = 0.0,
        curve: Curve | None = None,
        hop: float = 0.0,
        seed: int = 0,
        order: str = "fixed",
        stragglers: Stragglers | None = None,
        gang: GangCost | None = None,
    ) -> None:
        check_int("workers", workers)
        check_int("partitions", partitions, optional=True)
        self.seed, self.checkpoint_dir, self.order = seed, None, order
        self.report_every, self.reports_per_epoch = "epoch", 1  # its curves give epochs only
        self.partitions = partitions or workers
        self._cost = unit_cost or (lambda c: modelled_cost(c, seed=seed))
        self._curve = curve or (lambda c, e: modelled_curve(c, e, seed=seed))
        self._eval, self._hop = eval_cost, hop
        self._configs: list[dict[str, Any]] = []
        self._names: list[str] = []
        self._metrics: list[dict[str, float]] = []
        self._rows: list[dict[str, Any]] = []
        self._outbox: list[Outcome] = []
        self._sim = _TunerSimulation(
            self,
            costs=[],
            workers=workers,
            P=self.partitions,
            order=order,
            seed=seed,
            hops=[],
            evals=[],
            load_seconds=0.0,
            stragglers=stragglers or Stragglers(),
            validate=False,
            record=False,
            replicas=1,
            speculate=False,
            joins=(),
            prefetch=False,
            gang=gang,
        )
        self._sim.widths_automatic = False  # decided at the tuner's decision points
        self.gang = None if gang is None else WidthDecisions(self.partitions, gang.max_width)
        self._sim.dispatch(self._sim.s.start())
        self.spec, self.data = _spec_and_data(self.partitions)

    # ------------------------------------------------------------ what tuners call
    def __enter__(self) -> SimulatedSession:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def add(
        self,
        config: Mapping[str, Any],
        epochs: int,
        *,
        name: str | None = None,
        offset: int | None = None,
        **starts: Any,
    ) -> int:
        """Add a fresh model; resumes, forks and warm starts are not simulated."""
        given = {k: v for k, v in starts.items() if v is not None}
        if given:
            raise ValueError(f"{sorted(given)} given, but a simulated session starts every model fresh")
        model_id = len(self._configs)
        config = dict(config)
        self._configs.append(config)
        self._names.append(name or f"model-{model_id}")
        self._metrics.append({})
        self._sim.costs.append(self._cost(config))
        self._sim.hop_cost.append(self._hop)
        self._sim.evals.append(self._eval)
        self._sim.handle(ModelsAdded((NewModel(model_id, epochs, offset),)))
        return model_id

    def stop(self, model_id: int) -> None:
        if self.status(model_id) not in (ModelStatus.STOPPED, ModelStatus.FAILED):
            self._sim.handle(ModelStopped(model_id))

    def extend(self, model_id: int, epochs: int) -> None:
        self._sim.handle(BudgetExtended(model_id, epochs))

    def give_widths(self, live: list[int] | None = None) -> list[GangWidth]:
        """Decide the widths of the epochs due (see ``WidthDecisions``), ``live`` the
        models left (default: those training now); those given."""
        if self.gang is None:
            return []
        engine = self._sim.s
        wanted = engine.widths_wanted() if live is None else None
        given = self.gang.decide(engine.live_models() if live is None else live, lambda m: None, wanted)
        for event in given:
            self._sim.handle(event)
        return given

    def status(self, model_id: int) -> ModelStatus:
        return self._sim.s.status(model_id)

    def workers(self) -> list[str]:
        return list(self._sim.names)

    def next_reports(self, poll_interval: float | None = None) -> list[Outcome]:
        """The reports of the next virtual instant that has any; [] once no model trains."""
        while not self._outbox:
            if self.gang is not None and self.gang.automatic:
                self.give_widths()  # every report so far was handed out
            if not (self._sim.heap and self._sim.s.active()):
                break
            self._sim.step()
        out, self._outbox = self._outbox, []
        return out

    def reports(self, poll_interval: float | None = None) -> Iterator[Outcome]:
        for batch in iter(self.next_reports, []):
            yield from batch

    def model(self, model_id: int) -> _SimulatedModel:
        return _SimulatedModel(self, model_id)

    def best(self, metric: str = "val_loss", mode: str = "min") -> _SimulatedModel:
        ranked = [
            (m[metric] if mode == "min" else -m[metric], i)
            for i, m in enumerate(self._metrics)
            if metric in m and self.status(i) is not ModelStatus.STOPPED
        ]
        if not ranked:
            raise ValueError(f"no model has reported {metric!r}")
        return self.model(min(ranked)[1])

    @property
    def history(self) -> Any:
        import pandas as pd

        return pd.DataFrame(self._rows)

    # ------------------------------------------------------------ what it measured
    @property
    def now(self) -> float:
        """The virtual time: the makespan once the tuner is done."""
        return self._sim.now

    def timeline(self, bins: int = 10) -> Timeline:
        """Utilization in ``bins`` equal slices of the makespan, and the tail."""
        check_int("bins", bins)
        makespan, p = self._sim.now, len(self._sim.names)
        if makespan <= 0:
            return Timeline(0.0, 1.0, (1.0,) * bins, 0.0, 0.0, 0.0)
        edges = np.linspace(0.0, makespan, bins + 1)
        busy = np.zeros(bins)
        for start, end in self._sim.intervals:
            for i in range(bins):
                busy[i] += max(0.0, min(end, edges[i + 1]) - max(start, edges[i]))
        width = makespan / bins
        share = busy / (p * width)
        above = [i for i in range(bins) if share[i] > 0.5]
        tail_bin = above[-1] + 1 if above else 0
        tail_start = float(edges[tail_bin])
        idle = p * makespan - busy.sum()
        tail_idle = p * (makespan - tail_start) - busy[tail_bin:].sum()
        return Timeline(
            makespan,
            float(busy.sum() / (p * makespan)),
            tuple(float(x) for x in share),
            tail_start,
            (makespan - tail_start) / makespan,
            float(tail_idle / idle) if idle > 0 else 0.0,
        )

    # ------------------------------------------------------------ from the simulation
    def _reported(self, model_id: int, epoch: int, now: float) -> None:
        config = self._configs[model_id]
        metrics = self._curve(config, epoch)
        self._metrics[model_id] = metrics
        self._rows.append(
            {
                "model_id": model_id,
                "epoch": epoch,
                **metrics,
                "session_seconds": now,
                "name": self._names[model_id],
                "config": config,
            }
        )
        self._outbox.append(EpochReport(model_id, epoch, dict(metrics), config))


class _SimulatedModel:
    """A handle on one simulated model, as ``Session.model`` gives."""

    def __init__(self, session: SimulatedSession, model_id: int) -> None:
        self.model_id, self._s = model_id, session
        self.config = session._configs[model_id]
        self.name = session._names[model_id]
        self.seed, self.offset = session.seed, model_id

    @property
    def metrics(self) -> dict[str, float]:
        return dict(self._s._metrics[self.model_id])

    @property
    def error(self) -> None:
        return None

    def state(self) -> dict[str, Any]:
        """A simulated model trains nothing: its state holds no weights."""
        return {"model": {}}


def _spec_and_data(partitions: int) -> tuple[Any, Any]:
    """A spec that names the modelled metrics, and a dataset of ``partitions`` partitions
    with validation data: what the tuners check their arguments against."""
    from ..data import PartitionedDataset
    from ..training import TrainingSpec, accuracy

    spec = TrainingSpec(model_fn=_one_weight, optimizer_fn=_sgd, metrics={"accuracy": accuracy})
    rows = np.zeros((2 * partitions, 1), dtype=np.float32)
    data = PartitionedDataset.from_arrays(
        rows, np.zeros(2 * partitions, dtype=np.int64), num_partitions=partitions, valid_fraction=0.5
    )
    return spec, data


def _one_weight(config: Mapping[str, Any]) -> Any:
    import torch

    return torch.nn.Linear(1, 1)


def _sgd(config: Mapping[str, Any], params: Any) -> Any:
    import torch

    return torch.optim.SGD(params, lr=0.1)

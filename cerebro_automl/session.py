"""The narrow waist: a Session trains many configurations with MOP.

Tuners add configurations, read per-epoch reports, and stop, extend or add
more between epochs::

    with Session(spec, data, seed=0) as s:
        a = s.add({"lr": 1e-3, "width": 64}, epochs=10)
        for r in s.reports():               # EpochReport / ModelPaused / ModelFailed
            if isinstance(r, EpochReport) and r.metrics["val_loss"] > 2.0:
                s.stop(r.model_id)          # prune
        s.history                           # one row per model-epoch
        s.best("val_accuracy", mode="max").build()

A model trains until its budget of epochs is spent, then pauses with its
state kept; ``extend`` resumes it.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Sequence

import pandas as pd
import torch

from .callbacks._base import Callback, CallbackList
from .checkpoint import CheckpointError, CheckpointWriter, latest_checkpoint, save_checkpoint
from .checks import check_int, check_timeout
from .data import PartitionedDataset
from .executors.base import FETCH_TIMEOUT, Executor, StateUnavailable
from .progress import dashboard_link, describe_counts, make_bar, model_counts, show_counts
from .protocol import (NOTICES, Abort, BudgetExtended, Checkpoint, Discard, Fail, Instruction, ModelsAdded,
                       ModelStatus, ModelStopped, NewModel, Pause, Report, Tick, Train, WorkerAdded, WorkerLost)
from .engine import ORDERS, Scheduler
from .training import (TrainingSpec, build_model, canonical_config, layout_mismatch, model_seed,
                       weights_layout)

__all__ = ["Session", "EpochReport", "ModelPaused", "ModelFailed", "ModelHandle",
           "StalledError", "DataLoadError", "CheckpointError"]


class StalledError(RuntimeError):
    """Models wait, but nothing has run for ``no_worker_timeout`` seconds (no worker
    is alive, say); the message names the cause."""


class DataLoadError(RuntimeError):
    """A partition kept failing to load (``max_place_retries`` times in a row); the
    message names the partition and its source."""

logger = logging.getLogger("cerebro_automl")


@dataclass(frozen=True)
class EpochReport:
    """Model ``model_id`` finished epoch ``epoch`` (1-based); ``metrics`` holds
    ``train_loss``, ``val_loss`` and ``val_<metric>`` for each named metric."""
    model_id: int
    epoch: int
    metrics: dict[str, float]
    config: dict[str, Any]


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


@dataclass
class _ModelInfo:
    config: dict[str, Any]
    seed: int
    offset: int
    name: str
    epochs: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    lineage: dict[str, Any] = field(default_factory=dict)  # history columns of a fork or warm start


class Session:
    """Train many configurations of one model on one partitioned dataset with MOP.

    Args:
        spec: what to train (:class:`TrainingSpec`).
        data: the :class:`PartitionedDataset`.
        seed: the session seed; with the same configs in the same order and the
            same ``num_partitions`` and ``threads``, results are bitwise identical.
        client: a ``distributed.Client`` or scheduler address; None starts a
            LocalCluster of single-threaded workers: one per core, or with GPUs
            (and ``device`` not ``"cpu"``) ``workers_per_gpu`` per GPU.
        executor: ``"dask"`` (default), ``"local"`` (in-process, serial) or an
            :class:`Executor` instance.
        order: ``"fixed"`` (Latin order: reproducible) or ``"dynamic"``.
        threads: torch intra-op threads inside every unit (part of the
            reproducibility key: 1 and 2 threads give different bits).
        n_workers: workers of the LocalCluster (or virtual workers of "local").
        checkpoint_dir: write every model's state at every epoch end there.
        progress: show a tqdm bar (None: when stderr is a terminal).
        unit_timeout: seconds after which a train unit fails its model; checked
            after every batch, so a batch that never returns is not interrupted.
        resume: with ``checkpoint_dir``, a model added under a name that has a
            checkpoint there (by default ``model-<id>``: the same configs added in
            the same order) continues after its newest valid checkpoint, the way
            a killed driver picks up again; the history then starts there.
        max_unit_retries: how many times in a row a model's unit or evaluation may
            be lost with its worker (or cancelled) and run again; past it the model
            fails alone, with the reason (a config whose units get their worker
            killed for memory fails instead of killing worker after worker).
        no_worker_timeout: seconds that models may wait with nothing running (no
            worker alive, say) before :class:`StalledError` names the cause; it is
            also how long ``min_workers`` are waited for. None: wait forever.
        min_workers: wait (up to ``no_worker_timeout`` s) until the cluster has this
            many workers before starting: for clusters that start workers after the
            scheduler (dask-jobqueue, Kubernetes, adaptive). Give ``num_partitions``
            explicitly there: by default it is the number of workers at start.
        callbacks: :class:`~cerebro_automl.callbacks.Callback` objects (such as
            ``TensorBoard`` and ``MLflow``) whose hooks run at the session's start
            and end, at every epoch, and when a model is added, paused, stopped
            or fails. One that raises is logged and disabled; training goes on.
            Tuners take them as ``session_callbacks=``, since Optuna's
            ``optimize(callbacks=...)`` already means ``callback(study, trial)``.
        replicas: how many workers hold each partition (1 to the number of
            workers). A unit runs on any idle holder of its partition, so a slow
            worker no longer gates every model, a lost worker's partitions are
            still served, and a worker that joins takes units once a copy has
            loaded there. Each worker holds about ``replicas`` times D/p of the
            data. With fixed order the weights are those of ``replicas=1``.
        speculate: with ``replicas >= 2``, act on a unit that runs well past its
            model's usual unit time: start a copy on an idle holder of its
            partition, the first to finish counting (both compute the same
            bits), or, with none idle, restart it once on the first holder to
            free up.
        deterministic: on CUDA, units use deterministic kernels only (and cuBLAS's
            fixed workspace), so that results are bitwise reproducible on the same
            GPU model; an operation without one fails its model, naming it. False
            allows them (faster for some models; the history records the choice).
        workers_per_gpu: with no client on a machine with GPUs, the LocalCluster
            runs this many worker processes per GPU, each seeing only its GPU
            (several small models training at once keep a GPU busy). The history's
            ``device`` column records what the workers ran on.
        prefetch: send each busy worker the unit it runs next, so that it starts
            as soon as the one before ends instead of after the driver's round trip
            (1.6x the units per second for tiny models on 2 workers). None: on with
            one replica; off with more, where a reserved unit would forgo the first
            holder to free up (2-6% lower efficiency in the simulator). Which worker
            runs a unit, and when, never changes what it computes.
    """

    def __init__(self, spec: TrainingSpec, data: PartitionedDataset, *, seed: int = 0,
                 client: Any = None, executor: str | Executor = "dask", order: str = "fixed",
                 threads: int = 1, n_workers: int | None = None,
                 checkpoint_dir: str | None = None, progress: bool | None = None,
                 unit_timeout: float | None = None, resume: bool = False,
                 max_unit_retries: int = 3, no_worker_timeout: float | None = 300.0,
                 min_workers: int | None = None, callbacks: Sequence[Callback] | None = None,
                 replicas: int = 1, speculate: bool = False, deterministic: bool = True,
                 workers_per_gpu: int = 1, prefetch: bool | None = None) -> None:
        if not isinstance(spec, TrainingSpec):
            raise TypeError(f"spec is {type(spec).__name__}, but must be a TrainingSpec")
        if not isinstance(data, PartitionedDataset):
            raise TypeError(f"data is {type(data).__name__}, but must be a PartitionedDataset")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed is {seed!r}, but must be an int")
        check_int("seed", seed, 0)  # it seeds numpy, which refuses negative seeds
        check_int("threads", threads)
        check_timeout(unit_timeout, "unit_timeout")
        check_int("max_unit_retries", max_unit_retries, 0)
        check_timeout(no_worker_timeout, "no_worker_timeout")
        check_int("min_workers", min_workers, optional=True)
        check_int("replicas", replicas)
        for flag, value in (("speculate", speculate), ("deterministic", deterministic)):
            if not isinstance(value, bool):
                raise TypeError(f"{flag} is {value!r}, but must be True or False")
        check_int("workers_per_gpu", workers_per_gpu)
        if prefetch is not None and not isinstance(prefetch, bool):
            raise TypeError(f"prefetch is {prefetch!r}, but must be True, False or None")
        if speculate and replicas < 2:
            raise ValueError(f"speculate is True with replicas={replicas}, but a speculative copy runs on "
                             "another holder of the unit's partition: pass replicas >= 2")
        if resume and checkpoint_dir is None:
            raise ValueError("resume is True, but there is no checkpoint_dir to resume from")
        if order not in ORDERS:
            raise ValueError(f"order is {order!r}, but must be one of {ORDERS}")
        self._callbacks = CallbackList(callbacks)
        self.spec, self.seed, self.order, self.threads = spec, seed, order, threads
        self.checkpoint_dir, self.resume = checkpoint_dir, bool(resume)
        self.no_worker_timeout = no_worker_timeout
        self.deterministic = deterministic
        gpus = None if spec.device == "cpu" else "auto"
        self.executor = self._make_executor(executor, client, n_workers, gpus, workers_per_gpu)
        self.executor.unit_timeout = unit_timeout
        try:
            if min_workers is not None:
                self.executor.wait_for_workers(min_workers, no_worker_timeout)
            workers = self.executor.workers()
            if not workers:
                raise ValueError("the cluster has no workers; start at least one, or pass "
                                 "min_workers= to wait for them")
            if replicas > len(workers):
                raise ValueError(f"replicas is {replicas}, but the cluster has {len(workers)} workers: each "
                                 "partition is held by that many different workers (pass min_workers= "
                                 "to wait for more)")
            self.data = data.resolve(len(workers))
            self.executor.bind(spec, self.data, threads, deterministic)
            self.devices = self._check_devices(self.executor.devices(), spec, order)
            self._refused_workers: set[str] = set()  # joined with a device the key does not allow
        except BaseException:
            self.executor.close()
            raise
        self.scheduler = Scheduler(self.data.num_partitions, workers, seed=seed, order=order,
                                   checkpoint=checkpoint_dir is not None,
                                   max_unit_retries=max_unit_retries, replicas=replicas,
                                   speculate=speculate,
                                   prefetch=replicas == 1 if prefetch is None else prefetch)
        self._models: dict[int, _ModelInfo] = {}
        self._rows: list[dict[str, Any]] = []
        self._metrics: dict[tuple[int, int], dict[str, float]] = {}
        self._outcomes: deque = deque()
        self._closed = False
        self._failure: Exception | None = None  # raised by every later next_reports
        self._idle_since: float | None = None    # since when models wait with nothing running
        self._writer = CheckpointWriter()
        self._bar = make_bar(progress)
        self._started = time.monotonic()
        self._dispatch(self.scheduler.start())
        link = dashboard_link(self.executor)
        logger.info("session started: %d partitions on %d workers (%s), order=%s, seed=%d, "
                    "threads=%d%s", self.data.num_partitions, len(workers),
                    type(self.executor).__name__, order, seed, threads,
                    f"; Dask dashboard: {link}" if link else "")
        self._callbacks.call("on_session_start", self)

    @staticmethod
    def _check_devices(devices: dict[str, str], spec: TrainingSpec, order: str) -> dict[str, str]:
        """The workers' devices, refused when fixed order would give worker-dependent
        bits: CPU and GPU workers mixed with ``device="auto"``."""
        kinds = {d.split(":")[0] for d in devices.values()}
        if order == "fixed" and spec.device == "auto" and len(kinds) > 1:
            listed = ", ".join(f"{w}: {d}" for w, d in sorted(devices.items()))
            raise ValueError(f"the cluster mixes CPU and GPU workers ({listed}), so a unit's bits would depend "
                             "on the worker it runs on; pass device='cpu' or device='cuda' in the "
                             "TrainingSpec to choose (the history records each session's devices)")
        return devices

    def _admit(self, worker: str) -> bool:
        """Whether a worker that joined may take units: with fixed order and
        ``device="auto"``, not one whose device type differs from the session's (its
        units would give other bits); it is logged and left idle."""
        device = self.executor.devices([worker]).get(worker)
        kinds = {d.split(":")[0] for d in self.devices.values()}
        if device is None or self.order != "fixed" or self.spec.device != "auto" or \
                not kinds or device.split(":")[0] in kinds:
            if device is not None:
                self.devices[worker] = device
            return True
        self._refused_workers.add(worker)
        logger.warning("worker %s joined with device %s, but this session's units run on %s: it takes no "
                       "units, since its bits would differ (pass device= in the TrainingSpec to mix them)",
                       worker, device, ", ".join(sorted(set(self.devices.values()))))
        return False

    @staticmethod
    def _make_executor(executor: Any, client: Any, n_workers: int | None, gpus: str | None,
                       workers_per_gpu: int) -> Executor:
        if isinstance(executor, Executor):
            return executor
        if executor == "dask":
            from .executors.dask import DaskExecutor
            return DaskExecutor(client, n_workers=n_workers, gpus=gpus, workers_per_gpu=workers_per_gpu)
        if executor == "local":
            from .executors.local import LocalExecutor
            return LocalExecutor(n_workers or 1)
        raise ValueError(f"executor is {executor!r}, but must be 'dask', 'local' or an Executor")

    # ------------------------------------------------------------ tuner API
    def add(self, config: Mapping[str, Any], epochs: int, *, offset: int | None = None,
            name: str | None = None, resume: tuple[int, dict] | None = None,
            init_from: tuple[int, int] | None = None, init_state: dict | None = None) -> int:
        """Add a configuration to train for ``epochs`` epochs; return its model id.

        Args:
            offset: replays a model's Latin order (the history records it); by
                default the model's ordinal in this session.
            name: the model's checkpoint folder (default ``model-<id>``).
            resume: ``(epoch, state)`` from a checkpoint of this same model: it
                continues after ``epoch`` epochs and trains until ``epochs`` in all.
            init_from: ``(model_id, epoch)``: fork that model. The new model starts
                from its state after ``epoch`` epochs (weights, optimizer and
                LR-scheduler state, counters), continues after ``epoch`` epochs and
                trains until ``epochs`` in all. Population-based training is built
                on it.
            init_state: a state dict (``{"model": weights, "optimizer": ...}``, e.g. a
                checkpoint of an earlier session) to warm-start from at epoch 0.

        With ``init_from`` and ``init_state`` the new config's optimizer
        hyperparameters (learning rate, weight decay, ...) are in force, not the
        state's; the per-parameter optimizer state and the schedulers' progress are
        the state's. A state whose weights do not fit the model ``config`` builds
        is refused here, naming the keys and shapes that differ.

        Example:
            >>> child = s.add({**s.model(3).config, "lr": 0.02}, epochs=8,
            ...               init_from=(3, 4))          # doctest: +SKIP
        """
        self._check_open()
        check_int("epochs", epochs)
        check_int("offset", offset, 0, optional=True)
        given = [k for k, v in (("resume", resume), ("init_from", init_from), ("init_state", init_state))
                 if v is not None]
        if len(given) > 1:
            raise ValueError(f"{' and '.join(given)} are given, but a model starts from one state at most")
        start_epoch, state = resume if resume is not None else (0, None)
        if resume is not None and not (isinstance(start_epoch, int) and 0 < start_epoch < epochs
                                       and isinstance(state, dict) and "model" in state):
            raise ValueError(f"resume is ({start_epoch!r}, ...), but must be (epoch, state) with "
                             f"0 < epoch < epochs={epochs} and a state from a checkpoint")
        canonical_config(config)  # TypeError naming a value that is not JSON
        # Frozen here: a caller mutating its dict later must not change what trains.
        config = copy.deepcopy(dict(config))
        self.spec.validate_config(config)
        lineage: dict[str, Any] = {}
        if init_from is not None:
            parent, start_epoch = self._check_init_from(init_from, epochs)
            state = self.fetch_state(parent, start_epoch)  # the fork's fallback, kept on the driver
            lineage = {"parent": parent, "parent_epoch": start_epoch}
        elif init_state is not None:
            if not (isinstance(init_state, Mapping) and isinstance(init_state.get("model"), Mapping)):
                raise TypeError(f"init_state is a {type(init_state).__name__}, but must be a state dict "
                                "with a 'model' entry (a checkpoint's state, or {'model': state_dict})")
            state = {k: v for k, v in init_state.items() if k != "progress"}
            lineage = {"warm_start": True}
        if init_from is not None or init_state is not None:
            mismatch = layout_mismatch(weights_layout(self.spec, config), state["model"])
            if mismatch:
                source = f"model {init_from[0]} after epoch {init_from[1]}" if init_from else "init_state"
                raise ValueError(f"the state of {source} does not fit the model config {config} builds: "
                                 f"{mismatch}")
        model_id = len(self._models)
        name = f"model-{model_id}" if name is None else str(name)
        if any(info.name == name for info in self._models.values()):
            raise ValueError(f"name is {name!r}, but a model of this session already has it")
        if resume is None and init_from is None and init_state is None and self.resume:
            found = self._checkpoint_to_resume(name, config, epochs, model_id if offset is None else offset)
            if found is not None:
                start_epoch, state = found
        seed = model_seed(self.seed, config)
        self._models[model_id] = _ModelInfo(config, seed, model_id if offset is None else offset, name,
                                            epochs=start_epoch, lineage=lineage)
        if init_from is not None:
            worker = self.executor.add_fork(model_id, copy.deepcopy(config), seed, init_from[0],
                                            start_epoch, state)
        else:
            worker = self.executor.add_model(model_id, copy.deepcopy(config), seed, state, start_epoch,
                                             fresh_hyperparameters=init_state is not None)
        self._dispatch(self.scheduler.handle(ModelsAdded((NewModel(
            model_id, epochs, offset, start_epoch, worker, from_state=init_state is not None),))))
        self._grow_bar(epochs - start_epoch)
        if init_from is not None:
            changes = {k: (self._models[init_from[0]].config.get(k), v) for k, v in config.items()
                       if self._models[init_from[0]].config.get(k) != v}
            logger.debug("model %d (%s) forked from model %d after epoch %d for %d epochs, changes %s",
                         model_id, name, init_from[0], start_epoch, epochs, changes)
        else:
            logger.debug("model %d (%s) added for %d epochs: %s", model_id, name, epochs, config)
        self._callbacks.call("on_model_added", self, model_id)
        return model_id

    def _check_init_from(self, init_from: Any, epochs: int) -> tuple[int, int]:
        """``(parent id, epoch)``, checked: a known model that reported ``epoch`` and
        still holds its state after it, and ``epoch < epochs``."""
        if not (isinstance(init_from, tuple) and len(init_from) == 2
                and all(isinstance(v, int) and not isinstance(v, bool) for v in init_from)):
            raise TypeError(f"init_from is {init_from!r}, but must be a tuple (model_id, epoch)")
        parent, epoch = init_from
        self._check_id(parent)
        reported = self._models[parent].epochs
        if not 1 <= epoch <= reported:
            raise ValueError(f"init_from is {init_from}, but model {parent} has reported epochs 1..{reported}"
                             if reported else f"init_from is {init_from}, but model {parent} has not "
                             "reported an epoch yet")
        if epoch >= epochs:
            raise ValueError(f"init_from epoch is {epoch}, but must be < epochs={epochs}: the new model "
                             "continues after that epoch")
        status = self.scheduler.models[parent].status
        if status in (ModelStatus.STOPPED, ModelStatus.FAILED):
            raise ValueError(f"init_from is {init_from}, but model {parent} is {status.value} and its "
                             "state is freed; fork it before stopping it")
        held = self.executor.held_epochs(parent)
        if epoch not in held:
            raise ValueError(f"init_from is {init_from}, but model {parent} holds its state only after "
                             f"epochs {sorted(held)} (it keeps its newest two)")
        return parent, epoch

    def check_checkpoint(self, name: str, meta: Mapping[str, Any], config: Mapping[str, Any],
                         offset: int) -> None:
        """Raise ValueError unless checkpoint ``meta`` of model ``name`` was written by
        this model in a run like this one: the same config, session seed, offset,
        partitions and threads, so that continuing from it gives the bits of a run
        never interrupted. (A tuner that resumes its trials from their checkpoints
        calls it, as ``add(resume=...)`` cannot tell whose state it is given.)"""
        expected = {"config": json.loads(canonical_config(config)), "session_seed": self.seed,
                    "offset": offset, "num_partitions": self.data.num_partitions, "threads": self.threads}
        differ = {k: (meta.get(k), v) for k, v in expected.items() if meta.get(k) != v}
        if differ:
            raise ValueError(f"checkpoint {name!r} in {self.checkpoint_dir} (after epoch {meta.get('epoch')}) "
                             f"was written by another run (checkpoint, now): {differ}; use another "
                             "checkpoint_dir or name")

    def _checkpoint_to_resume(self, name: str, config: Mapping[str, Any], epochs: int,
                              offset: int) -> tuple[int, dict] | None:
        """The newest valid checkpoint of ``name`` to continue from, checked against
        this model (:meth:`check_checkpoint`)."""
        found = latest_checkpoint(self.checkpoint_dir, name)
        if found is None:
            return None
        self.check_checkpoint(name, found[1], config, offset)
        if found[1]["epoch"] >= epochs:  # finished: train the last epoch again, from a checkpoint before it
            found = latest_checkpoint(self.checkpoint_dir, name, before=epochs)
            if found is None:
                return None
            self.check_checkpoint(name, found[1], config, offset)
        state, meta = found
        logger.info("model %r resumes after epoch %d from %s", name, meta["epoch"], self.checkpoint_dir)
        return meta["epoch"], state

    def extend(self, model_id: int, epochs: int) -> None:
        """Give a model ``epochs`` more epochs; a paused model resumes from its state."""
        self._check_open()
        self._check_id(model_id)
        check_int("epochs", epochs)
        self._dispatch(self.scheduler.handle(BudgetExtended(model_id, epochs)))
        self._grow_bar(epochs)

    def stop(self, model_id: int) -> None:
        """Stop a model for good and free its state (pruning)."""
        self._check_open()
        self._check_id(model_id)
        m = self.scheduler.models[model_id]
        self._bar.total -= self.scheduler.remaining_units(model_id) if m.status in (
            ModelStatus.TRAINING, ModelStatus.EVALUATING) else 0
        was = m.status
        self._dispatch(self.scheduler.handle(ModelStopped(model_id)))
        if was not in (ModelStatus.STOPPED, ModelStatus.FAILED):  # stopping those changes nothing
            self._callbacks.call("on_model_stopped", self, model_id)

    def reports(self, poll_interval: float = 0.5) -> Iterator[EpochReport | ModelPaused | ModelFailed]:
        """Yield reports as models finish epochs, until no model trains.

        Adding, extending or stopping models inside the loop is the way to tune.
        """
        while True:
            batch = self.next_reports(poll_interval)
            if not batch:
                return
            yield from batch

    def next_reports(self, poll_interval: float = 0.5) -> list[EpochReport | ModelPaused | ModelFailed]:
        """Wait for reports; return all that are ready (an empty list: no model trains).

        Tuners that must decide in a fixed order (Optuna's ``should_prune`` in
        trial-number order) take the reports that arrived together as one batch.
        Raises :class:`StalledError`, :class:`DataLoadError` or
        :class:`CheckpointError` when the session cannot go on.
        """
        while not self._outcomes:
            self._raise_failure()
            if self._closed or not (self.scheduler.active() or self.executor.busy()):
                self._writer.flush()  # the checkpoints of what was reported are on disk
                self._writer.check()
                return []
            self._step(poll_interval)
            show_counts(self._bar, (m.status for m in self.scheduler.models.values()))
        batch = list(self._outcomes)
        self._outcomes.clear()
        return batch

    def _step(self, poll_interval: float) -> None:
        """One poll of the executor, its events handed to the scheduler. With replicas
        the scheduler also reads the clock (worker paces, stragglers to copy), and the
        poll waits no longer than until the next unit becomes a straggler."""
        if self.scheduler.replicas > 1:
            self._dispatch(self.scheduler.handle(Tick(time.monotonic())))
            wakeup = self.scheduler.next_wakeup()
            if wakeup is not None:
                poll_interval = max(0.001, min(poll_interval, wakeup - time.monotonic()))
        completions = self.executor.poll(poll_interval)
        self._watch_progress(bool(completions))
        for completion in completions:
            e = completion.event
            if isinstance(e, WorkerAdded) and not self._admit(e.worker) or \
                    isinstance(e, WorkerLost) and e.worker in self._refused_workers:
                continue
            if completion.metrics is not None:
                self._metrics[(e.model_id, e.epoch)] = completion.metrics
            self._dispatch(self.scheduler.handle(e))
            if self.scheduler.units_trained != self._bar.n:  # down after a rollback
                self._bar.update(self.scheduler.units_trained - self._bar.n)
            if completion.metrics is not None:  # not reported (stale, or an epoch reported before)
                self._metrics.pop((e.model_id, e.epoch), None)
            self._raise_failure()  # an Abort: the events after it are not handled
        self._writer.check()

    def _watch_progress(self, progressed: bool) -> None:
        """Raise StalledError once models have waited ``no_worker_timeout`` s with nothing running."""
        if progressed or self.executor.busy() or not self.scheduler.active():
            self._idle_since = None
            return
        now = time.monotonic()
        if self._idle_since is None:
            self._idle_since = now
            logger.warning("models wait and nothing runs: %s",
                           self.scheduler.waiting_for() or "nothing can be started")
        elif self.no_worker_timeout is not None and now - self._idle_since > self.no_worker_timeout:
            cause = self.scheduler.waiting_for() or "nothing runs and nothing can be started"
            self._failure = StalledError(
                f"no model could run for {now - self._idle_since:.0f} s (no_worker_timeout="
                f"{self.no_worker_timeout}): {cause}. Models wait: "
                f"{sorted(i for i, m in self.scheduler.models.items() if m.status in (ModelStatus.TRAINING, ModelStatus.EVALUATING))[:20]}")
            self._raise_failure()

    def _raise_failure(self) -> None:
        if self._failure is not None:
            self._writer.flush()  # the checkpoints queued so far are on disk when it raises
            raise self._failure

    def run(self) -> pd.DataFrame:
        """Train until no model trains (draining the reports); return the history."""
        for _ in self.reports():
            pass
        return self.history

    # --------------------------------------------------------------- results
    @property
    def history(self) -> pd.DataFrame:
        """One row per model-epoch: metrics, config, seed, Latin offset, visit order and
        ``session_seconds``. A failed model has one more row, at the epoch that failed,
        with no metrics and the reason in ``error`` (a column only when a model failed)."""
        return pd.DataFrame(self._rows, columns=_columns(self._rows))

    def status(self, model_id: int) -> str:
        """``training``, ``evaluating``, ``paused``, ``stopped`` or ``failed``."""
        self._check_id(model_id)
        return self.scheduler.models[model_id].status.value

    def model(self, model_id: int) -> "ModelHandle":
        """A handle on one model: its config, metrics, state and ``build()``."""
        self._check_id(model_id)
        return ModelHandle(self, model_id)

    def best(self, metric: str = "val_loss", mode: str = "min") -> "ModelHandle":
        """The model whose latest reported ``metric`` is best (``mode`` "min" or "max")."""
        if mode not in ("min", "max"):
            raise ValueError(f"mode is {mode!r}, but must be 'min' or 'max'")
        scored = [(info.metrics[metric], mid) for mid, info in self._models.items()
                  if metric in info.metrics and info.error is None
                  and not math.isnan(info.metrics[metric])  # NaN would corrupt the order
                  and self.scheduler.models[mid].status is not ModelStatus.STOPPED]
        if not scored:
            known = sorted({k for info in self._models.values() for k in info.metrics})
            raise ValueError(f"no model has reported metric {metric!r}; reported metrics: {known}")
        scored.sort(key=lambda t: (t[0] if mode == "min" else -t[0], t[1]))  # ties: lowest id
        return self.model(scored[0][1])

    # ------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Write the checkpoints still queued, free the states and partitions, and stop
        the LocalCluster if the session started it. Raises :class:`CheckpointError`
        if a checkpoint could not be written."""
        self._close(raise_errors=True)

    def _close(self, raise_errors: bool) -> None:
        if self._closed:
            return
        self._closed = True
        statuses = [m.status for m in self.scheduler.models.values()]
        show_counts(self._bar, statuses)
        if not self._bar.disable:
            self._bar.refresh()  # the final counts, drawn even when the last update fell inside tqdm's interval
        self._bar.close()
        counts = model_counts(statuses)
        logger.info("session ended after %.1f s: %d models (%s)", time.monotonic() - self._started,
                    len(self._models), describe_counts(counts))
        try:
            self._callbacks.call("on_session_end", self)
        finally:
            try:
                self._writer.close()
            finally:
                self.executor.close()
        if raise_errors:
            self._writer.check()

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if exc is not None and not self._closed:
            self._callbacks.call("on_exception", self, exc)
        # An exception on its way out is the one to see, not a checkpoint error after it.
        self._close(raise_errors=exc_type is None)

    # --------------------------------------------------------------- internals
    def _dispatch(self, instructions: list[Instruction]) -> None:
        for ins in instructions:
            if not isinstance(ins, NOTICES):
                self.executor.execute(ins)
            if isinstance(ins, Train) and ins.copy:
                logger.info("model %d's unit on partition %d straggles: a speculative copy runs on %s",
                            ins.model_id, ins.partition, ins.worker)
            elif isinstance(ins, Discard) and ins.restart:
                logger.info("model %d's unit on partition %d straggles on %s with no holder idle to "
                            "race it: restarted", ins.model_id, ins.partition, ins.worker)
            if isinstance(ins, Report):
                self._on_report(ins)
            elif isinstance(ins, Pause):
                self._outcomes.append(ModelPaused(ins.model_id, ins.epochs))
                logger.debug("model %d paused after %d epochs", ins.model_id, ins.epochs)
                self._callbacks.defer("on_model_paused", self, self._outcomes[-1])
            elif isinstance(ins, Fail):
                self._bar.total -= self.scheduler.remaining_units(ins.model_id)  # never trained
                info = self._models[ins.model_id]
                info.error = ins.error
                # the history keeps the reason: one row at the epoch that failed, no metrics
                self._rows.append({"model_id": ins.model_id, "epoch": info.epochs + 1,
                                   "error": ins.error.splitlines()[0], **self._row_keys(info)})
                self._outcomes.append(ModelFailed(ins.model_id, ins.error))
                logger.warning("model %d (%s) failed: %s; config %s", ins.model_id, info.name,
                               ins.error.splitlines()[0], info.config)
                self._callbacks.defer("on_model_failed", self, self._outcomes[-1])
            elif isinstance(ins, Checkpoint):
                self._checkpoint(ins.model_id, ins.epoch)
            elif isinstance(ins, Abort):
                source = self.data.sources[ins.partition].describe()
                self._failure = DataLoadError(f"{ins.error}. Its source: {source}. Every model's "
                                              "checkpoints written so far are kept")
                logger.error("%s", self._failure)
        self._callbacks.flush()  # the hooks run once the session is consistent again

    def _on_report(self, ins: Report) -> None:
        info = self._models[ins.model_id]
        metrics = self._metrics.pop((ins.model_id, ins.epoch))
        info.epochs, info.metrics = ins.epoch, metrics
        self._rows.append({"model_id": ins.model_id, "epoch": ins.epoch, **metrics,
                           "order": ins.order, **self._row_keys(info)})
        self._outcomes.append(EpochReport(ins.model_id, ins.epoch, metrics, copy.deepcopy(info.config)))
        logger.debug("model %d epoch %d: %s", ins.model_id, ins.epoch, metrics)
        self._callbacks.defer("on_epoch_end", self, self._outcomes[-1])

    def _row_keys(self, info: "_ModelInfo") -> dict[str, Any]:
        """What a history row needs to replay its model, and when it was written."""
        return {"config": info.config, "name": info.name, "seed": info.seed, "offset": info.offset,
                **info.lineage, "num_partitions": self.data.num_partitions, "threads": self.threads,
                "device": ", ".join(sorted(set(self.devices.values()))), "deterministic": self.deterministic,
                "session_seed": self.seed, "session_seconds": time.monotonic() - self._started}

    def _checkpoint(self, model_id: int, epoch: int) -> None:
        """Queue the state after ``epoch`` for the background writer (picked now, on
        this thread; fetched and written there)."""
        info = self._models[model_id]
        fetch = self.executor.state_fetcher(model_id, epoch)
        meta = {"config": info.config, "seed": info.seed, "offset": info.offset,
                "session_seed": self.seed, "num_partitions": self.data.num_partitions,
                "threads": self.threads}
        directory, name = self.checkpoint_dir, info.name

        def job() -> None:
            try:
                state = fetch(FETCH_TIMEOUT)
            except StateUnavailable as err:
                if not err.lost:
                    raise
                # The scheduler learns of the loss and trains that epoch again, which
                # checkpoints it again; a state lost after the model moved on is skipped.
                logger.warning("checkpoint of %s after epoch %d skipped: %s", name, epoch, err)
                return
            save_checkpoint(directory, name, epoch, state, meta)
        self._writer.submit(f"{name} after epoch {epoch}", job)

    def fetch_state(self, model_id: int, epoch: int | None = None,
                    timeout: float = FETCH_TIMEOUT) -> dict:
        """A model's state on the driver. If its worker died, the events are handled
        until the scheduler has recomputed it (at most ``timeout`` s in all)."""
        deadline = time.monotonic() + timeout
        paused = self.scheduler.models[model_id].status is ModelStatus.PAUSED
        while True:
            try:
                return self.executor.fetch_state(model_id, epoch,
                                                 timeout=max(0.1, deadline - time.monotonic()))
            except StateUnavailable as err:
                if not err.lost or time.monotonic() > deadline or self._closed:
                    raise
                logger.warning("%s; handling events until it is recomputed", err)
            # A paused model is trained again up to where it paused; a training one
            # needs only the rollback, after which its newest state is another.
            while time.monotonic() < deadline:
                self._raise_failure()
                self._step(0.5)
                status = self.scheduler.models[model_id].status
                if not paused or status is not ModelStatus.TRAINING and status is not ModelStatus.EVALUATING:
                    break

    def _grow_bar(self, epochs: int) -> None:
        self._bar.total += epochs * self.data.num_partitions
        self._bar.refresh()

    def _check_id(self, model_id: Any) -> None:
        if model_id not in self._models:
            known = f"0..{len(self._models) - 1}" if self._models else "none yet"
            raise ValueError(f"model id {model_id!r} is unknown; known ids are {known}")

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the session is closed")


def _columns(rows: list[dict[str, Any]]) -> list[str]:
    first = ["model_id", "epoch"]
    tail = ["error", "config", "name", "seed", "offset", "parent", "parent_epoch", "warm_start", "order",
            "num_partitions", "threads", "device", "deterministic", "session_seed"]
    optional = {"error", "parent", "parent_epoch", "warm_start"}  # columns only when a row has them
    present = {k for row in rows for k in row}
    metrics = sorted(present - set(first) - set(tail))
    return first + metrics + [k for k in tail if k not in optional or k in present]


class ModelHandle:
    """One model of a session: ``config``, ``metrics``, ``state()`` and ``build()``."""

    def __init__(self, session: Session, model_id: int) -> None:
        self._session, self.model_id = session, model_id
        info = session._models[model_id]
        self.config: dict[str, Any] = copy.deepcopy(info.config)
        self.seed: int = info.seed
        self.offset: int = info.offset
        self.name: str = info.name
        self.epochs: int = info.epochs
        self.metrics: dict[str, float] = dict(info.metrics)
        self.error: str | None = info.error

    @property
    def status(self) -> str:
        return self._session.status(self.model_id)

    @property
    def history(self) -> pd.DataFrame:
        h = self._session.history
        return h[h["model_id"] == self.model_id].reset_index(drop=True)

    def state(self) -> dict:
        """The model's newest state (model, optimizer and LR-scheduler state dicts); if
        its worker died, it is recomputed first."""
        self._session._check_open()
        return self._session.fetch_state(self.model_id)

    def build(self) -> torch.nn.Module:
        """``model_fn(config)`` with the model's newest weights, on the CPU."""
        state = self.state()
        return build_model(self._session.spec, self.config, state["model"], self.seed)

    def __repr__(self) -> str:
        return f"ModelHandle(model_id={self.model_id}, epochs={self.epochs}, config={self.config})"

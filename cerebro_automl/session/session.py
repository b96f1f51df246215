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
import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pandas as pd

from ..callbacks import Callback, CallbackList
from ..checkpoint_dir import CheckpointDirectory
from ..checks import check_int
from ..data import PartitionedDataset
from ..engine import Scheduler, WidthDecisions
from ..executors.base import FETCH_TIMEOUT, Executor, partition_count
from ..fusion import FUSED_KEY
from ..progress import close_bar, describe_statuses, show_counts
from ..protocol import GangWidth, ModelStatus
from ..reports import Outcome, SessionView
from ..retention import Retention
from ..training import TrainingSpec, canonical_config
from .checks import EngineOptions, check_engine, check_gang, check_prefetch, check_session, unit_reports
from .cluster import describe_start, start_cluster
from .history import ModelHandle
from .interrupts import interrupted, terminate_as_interrupt
from .starts import Starts
from .wiring import Settings, wire

__all__ = ["Session"]

logger = logging.getLogger("cerebro_automl")


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
        order: ``"fixed"`` or ``"cyclic"`` (Latin orders: reproducible), or ``"dynamic"``.
        threads: torch intra-op threads inside every unit (part of the
            reproducibility key: 1 and 2 threads give different bits).
        n_workers: workers of the LocalCluster (or virtual workers of "local").
        checkpoint_dir: write every model's state at every epoch end there. It must
            be a directory this process can write (created if missing), and one live
            session at a time holds it (its lock, ``<dir>/.lock``, names the run):
            a second is refused; a later one may resume from it.
        keep_checkpoints: keep only each model's ``k`` newest checkpoints (stopped and
            failed models' too), removing older ones as it goes; None keeps all.
        keep_best: ``(metric, mode)``, such as ``("val_accuracy", "max")``: with
            ``keep_checkpoints``, also keep each model's best epoch by that metric.
        progress: show a tqdm bar (None: when stderr is a terminal).
        unit_timeout: seconds after which a unit fails its model (checked per batch).
        resume: with ``checkpoint_dir``, a model added under a name that has a
            checkpoint there (by default ``model-<id>``: the same configs added in
            the same order) continues the way a killed driver picks up again: after
            the furthest epoch within its budget that its checkpoints and journaled
            reports reach (handed out again); in a directory without journals, after
            its newest valid checkpoint. See the Faults and resume guide.
        max_unit_retries: how many times in a row a model's unit or evaluation may
            be lost with its worker (or cancelled) and run again; past it the model
            fails alone, with the reason.
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
        speculate: with ``replicas >= 2``, a unit that runs well past its model's
            usual time gets a copy on an idle holder of its partition (the first to
            finish counts), or, with none idle, is restarted once.
        deterministic: on CUDA, units use deterministic kernels only (and cuBLAS's
            fixed workspace), so that results are bitwise reproducible on the same
            GPU model; an operation without one fails its model, naming it. False
            allows them (faster for some models; the history records the choice).
        workers_per_gpu: how many workers share each GPU. With no client on a
            machine with GPUs, the LocalCluster runs this many worker processes per
            GPU, each seeing only its GPU; on any cluster, more are reported.
            A worker that sees several GPUs takes the one its node's other workers
            took least. The history's ``device`` column records what the workers ran on.
        prefetch: send each busy worker the unit it runs next, so that it starts when
            the one before ends, not after the driver's round trip. None: on with one
            replica, off with more. It never changes what a unit computes.
        fuse: train up to this many configurations of one architecture together as
            one batched model (``torch.func.vmap`` over their stacked weights): one
            read of each batch and one kernel launch per layer for all of them. Fresh
            models added together (a grid, a batch of asks, a bracket) are grouped
            in the order added; see the Fused models guide for who may share a
            group. 1 (the default): every model trains alone. A group's members
            see the group's data order (its first member's shuffling, its own
            partition order), so their results differ from unfused training (the
            history's ``fuse`` column records it).
        report_every: ``"epoch"`` or ``"unit"``: also evaluate each model after each
            unit inside an epoch (1/p of its data), a :class:`UnitReport`, so that a
            pruner can stop it in its first epoch. Each costs a validation pass, which
            the model waits for; the weights are those of ``"epoch"``.
        gang: when fewer models train than there are partitions, each trains
            data-parallel on several workers at once (gang units: see the Gang units
            guide), its width decided from the models left at each epoch's start.
    """

    def __init__(
        self,
        spec: TrainingSpec,
        data: PartitionedDataset,
        *,
        seed: int = 0,
        client: Any = None,
        executor: str | Executor = "dask",
        order: str = "fixed",
        threads: int = 1,
        n_workers: int | None = None,
        checkpoint_dir: str | None = None,
        progress: bool | None = None,
        unit_timeout: float | None = None,
        resume: bool = False,
        max_unit_retries: int = 3,
        no_worker_timeout: float | None = 300.0,
        min_workers: int | None = None,
        callbacks: Sequence[Callback] | None = None,
        replicas: int = 1,
        speculate: bool = False,
        deterministic: bool = True,
        workers_per_gpu: int = 1,
        prefetch: bool | None = None,
        fuse: int = 1,
        keep_checkpoints: int | None = None,
        keep_best: tuple[str, str] | None = None,
        report_every: str = "epoch",
        gang: bool = False,
    ) -> None:
        check_int("fuse", fuse)
        check_gang(gang, fuse, executor)
        check_session(
            spec, data, seed=seed, threads=threads, unit_timeout=unit_timeout, no_worker_timeout=no_worker_timeout,
            min_workers=min_workers, deterministic=deterministic, workers_per_gpu=workers_per_gpu, resume=resume,
            checkpoint_dir=checkpoint_dir, n_workers=n_workers, executor=executor, client=client, progress=progress,
        )  # fmt: skip
        engine = EngineOptions(
            seed=seed, order=order, checkpoint=checkpoint_dir is not None, max_unit_retries=max_unit_retries,
            replicas=replicas, speculate=speculate, prefetch=check_prefetch(prefetch, replicas),
            unit_reports=unit_reports(report_every), gang=gang,
        )  # fmt: skip
        check_engine(engine)
        self._retention = Retention.of(keep_checkpoints, keep_best, checkpoint_dir, spec, data)
        self._callbacks = CallbackList(callbacks)
        self._fuse = fuse
        self.spec, self.seed, self.order, self.threads = spec, seed, order, threads
        self.report_every = report_every
        self.checkpoint_dir, self.resume = checkpoint_dir, bool(resume)
        self.no_worker_timeout = no_worker_timeout
        self.deterministic, self._workers_per_gpu = deterministic, workers_per_gpu
        # Before any work: a second live session on the directory fails here.
        self._directory = CheckpointDirectory(checkpoint_dir, resume=resume) if checkpoint_dir is not None else None
        self._restore_sigterm = terminate_as_interrupt()
        try:
            cluster = start_cluster(
                executor, client, n_workers, spec, data, seed=seed, order=order, threads=threads,
                deterministic=deterministic, replicas=replicas, unit_timeout=unit_timeout,
                min_workers=min_workers, no_worker_timeout=no_worker_timeout, workers_per_gpu=workers_per_gpu,
            )  # fmt: skip
            self.executor, self.data, self.devices = cluster.executor, cluster.data, cluster.devices
            self.scheduler = Scheduler(
                partition_count(self.data), cluster.workers, has_validation=self.data.has_validation, **engine
            )
            self._start(progress)
        except BaseException:
            self._release_directory()
            raise
        run = "" if self._directory is None else f"; checkpoints in {checkpoint_dir} (run {self._directory.run.run_id})"
        logger.info("session started: %s%s", describe_start(self.executor, self.data, order, seed, threads), run)
        self._callbacks.call("on_session_start", self._view)

    def _start(self, progress: bool | None) -> None:
        """Make the session's parts (see :mod:`.wiring`) and place the partitions."""
        self._closed, self._started = False, time.monotonic()
        self._view = SessionView(self)
        settings = Settings(
            self.spec, self.seed, self.order, self.threads, self.deterministic, self._fuse, self._workers_per_gpu,
            self.checkpoint_dir, self.resume, self.no_worker_timeout, self._retention,
        )  # fmt: skip
        p = wire(
            settings, self.executor, self.scheduler, self.data, self.devices, self._callbacks, self._view,
            progress=progress, started=self._started, checkpoint_meta=self._checkpoint_meta,
            fetch_state=self.fetch_state,
        )  # fmt: skip
        self._history, self._admission, self._fusion, self._writer, self._bar = (
            p.history, p.admission, p.fusion, p.writer, p.bar
        )  # fmt: skip
        self._fingerprint, self._outcomes, self._loop, self._starts, self._models = (
            p.fingerprint, p.outcomes, p.loop, p.starts, p.models
        )  # fmt: skip
        self._loop.dispatch(self.scheduler.start())
        self.gang: WidthDecisions | None = self._models.gang  # when widths are decided

    def give_widths(self, live: list[int] | None = None) -> list[GangWidth]:
        """Decide the widths of the epochs waiting for one (see ``WidthDecisions``); those given."""
        return self._models.give_widths(live)

    @property
    def reports_per_epoch(self) -> int:
        """Reports a model makes each epoch: 1, or one per partition with ``report_every="unit"``."""
        return self.scheduler.settings.num_partitions if self.report_every == "unit" else 1

    # ------------------------------------------------------------ tuner API
    def add(
        self,
        config: Mapping[str, Any],
        epochs: int,
        *,
        offset: int | None = None,
        name: str | None = None,
        resume: tuple[int, dict] | None = None,
        init_from: tuple[int, int] | None = None,
        init_state: dict | None = None,
    ) -> int:
        """Add a configuration to train for ``epochs`` epochs; return its model id.

        Args:
            offset: replays a model's Latin order (the history records it); by
                default the model's ordinal in this session.
            name: the model's checkpoint folder (default ``model-<id>``), unique, not ``.``-led, no slashes.
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
        Starts.check_choice(epochs, resume, init_from, init_state)
        canonical_config(config)  # TypeError naming a value that is not JSON
        if FUSED_KEY in config:
            raise ValueError(f"config key {FUSED_KEY!r} is reserved for fusion groups; name it otherwise")
        # Frozen here: a caller mutating its dict later must not change what trains.
        frozen: dict[str, Any] = copy.deepcopy(dict(config))
        self.spec.validate_config(frozen)
        return self._models.add(frozen, epochs, offset, name, resume, init_from, init_state)

    def check_checkpoint(self, name: str, meta: Mapping[str, Any], config: Mapping[str, Any], offset: int) -> None:
        """Raise ValueError unless checkpoint ``meta`` of model ``name`` was written by
        this model in a run like this one: the same config, session seed, offset,
        Latin order (``"cyclic"`` or not), partitions and threads, and the same data (each partition's rows, leaves,
        dtypes, row shapes and a digest of sampled rows, once every partition has
        loaded), so that continuing from it gives the bits of a run never
        interrupted. (A tuner that resumes trials from their checkpoints calls it:
        ``add(resume=...)`` cannot tell whose state it is given.)"""
        self._starts.check_checkpoint(name, meta, config, offset)

    def extend(self, model_id: int, epochs: int) -> None:
        """Give a model ``epochs`` more epochs; a paused model resumes from its state."""
        self._check_open()
        self._history.check_id(model_id)
        check_int("epochs", epochs)
        self._models.extend(model_id, epochs)

    def stop(self, model_id: int) -> None:
        """Stop a model for good and free its state (pruning)."""
        self._check_open()
        self._history.check_id(model_id)
        self._models.stop(model_id)

    def form_groups(self) -> None:
        """With ``fuse`` > 1: group the models added since the last call and start them
        (waiting for reports does it first; the canonical order of ``reproducible=True``
        calls it at its logical times)."""
        self._models.form_groups()

    def reports(self, poll_interval: float = 0.5) -> Iterator[Outcome]:
        """Yield reports as models finish epochs, until no model trains.

        Adding, extending or stopping models inside the loop is the way to tune.
        Raises ``RuntimeError`` on a closed session; closing it inside the loop ends it.
        """
        self._check_open()
        return self._iterate_reports(poll_interval)

    def _iterate_reports(self, poll_interval: float) -> Iterator[Outcome]:
        while not self._closed:
            batch = self.next_reports(poll_interval)
            if not batch:
                return
            yield from batch

    def next_reports(self, poll_interval: float = 0.5) -> list[Outcome]:
        """Wait for reports; return all that are ready (an empty list: no model trains).

        Tuners that must decide in a fixed order (Optuna's ``should_prune`` in
        trial-number order) take the reports that arrived together as one batch.
        Raises :class:`StalledError`, :class:`DataLoadError` or
        :class:`CheckpointError` when the session cannot go on, and ``RuntimeError``
        on a closed session.
        """
        self._check_open()
        while not self._outcomes.queue:
            if self.gang is not None and self.gang.automatic:
                self._models.give_widths()  # every report so far was handed out
            self._models.form_groups()
            self._models.apply_fusion(self._fusion.take_changed())
            self._loop.raise_failure()
            if self._closed or not self._loop.busy():
                self._writer.flush()  # the checkpoints of what was reported are on disk
                self._writer.check()
                return []
            self._loop.step(poll_interval)
            self._models.apply_fusion(self._fusion.take_changed())
            # A generator: without a bar, show_counts returns before asking any model's status.
            show_counts(self._bar, (self._models.status(i) for i in self._history.models))
        return self._outcomes.take()

    def run(self) -> pd.DataFrame:
        """Train until no model trains (draining the reports); return the history.
        Raises ``RuntimeError`` on a closed session."""
        for _ in self.reports():
            pass
        return self.history

    # --------------------------------------------------------------- results
    @property
    def history(self) -> pd.DataFrame:
        """One row per model-epoch: metrics, config, seed, Latin offset, visit order and
        ``session_seconds``. A failed model has one more row, at the epoch that failed,
        with no metrics and the reason in ``error`` (a column only when a model failed)."""
        return self._history.frame()

    def status(self, model_id: int) -> str:
        """``training``, ``evaluating``, ``paused``, ``stopped`` or ``failed``."""
        self._history.check_id(model_id)
        return self._models.status(model_id).value

    def statuses(self) -> dict[int, str]:
        """Every model's status (see :meth:`status`), by id, in the order added."""
        return {i: s.value for i, s in self._models.statuses().items()}

    def workers(self) -> list[str]:
        """The names of the workers alive now."""
        return self.executor.workers()

    def model(self, model_id: int) -> ModelHandle:
        """A handle on one model: its config, metrics, state and ``build()``."""
        self._history.check_id(model_id)
        return ModelHandle(self, model_id, self._history.models[model_id])

    def best(self, metric: str = "val_loss", mode: str = "min") -> ModelHandle:
        """The model whose latest reported ``metric`` is best (``mode`` "min" or "max");
        failed and stopped models do not count, and ties go to the lowest id."""
        stopped = lambda i: self._models.status(i) is ModelStatus.STOPPED  # noqa: E731
        return self.model(self._history.best_id(metric, mode, stopped))

    def fetch_state(self, model_id: int, epoch: int | None = None, timeout: float = FETCH_TIMEOUT) -> dict:
        """A model's state on the driver. If its worker died, the events are handled
        until the scheduler has recomputed it (at most ``timeout`` s in all). Raises
        ``RuntimeError`` on a closed session."""
        self._check_open()
        return self._models.fetch_state(model_id, epoch, timeout, lambda: self._closed)

    # ------------------------------------------------------------ lifecycle
    @property
    def closed(self) -> bool:
        """Whether the session is closed (:meth:`close`, or the end of a ``with`` block)."""
        return self._closed

    def close(self) -> None:
        """Write the checkpoints still queued, free the states and partitions, and stop
        the LocalCluster if the session started it. Raises :class:`CheckpointError`
        if a checkpoint could not be written."""
        self._close(raise_errors=True)

    def _close(self, raise_errors: bool) -> None:
        if self._closed:
            return
        self._closed = True
        statuses = list(self._models.statuses().values())
        close_bar(self._bar, statuses)
        seconds = time.monotonic() - self._started
        logger.info("session ended after %.1f s: %d models (%s)", seconds, len(statuses), describe_statuses(statuses))
        try:
            self._callbacks.call("on_session_end", self._view)
        finally:
            try:
                self._writer.close()
            finally:
                try:
                    self.executor.close()
                finally:
                    self._release_directory()
        if raise_errors:
            self._writer.check()

    def __enter__(self) -> Session:
        self._check_open()
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if exc is not None and not self._closed:
            self._callbacks.call("on_exception", self._view, exc)
            if isinstance(exc, KeyboardInterrupt):
                logger.warning("%s", interrupted(exc, self.checkpoint_dir))
        # An exception on its way out is the one to see, not a checkpoint error after it.
        self._close(raise_errors=exc_type is None)

    # --------------------------------------------------------------- helpers
    def _checkpoint_meta(self) -> dict[str, Any]:
        """What every checkpoint records of this run: its id and the data's fingerprint."""
        return {
            "run_id": self._directory.run.run_id if self._directory is not None else None,
            "data": self._fingerprint.known(),
        }

    def _release_directory(self) -> None:
        """Let go of what the driver holds while open: the directory's lock, SIGTERM."""
        self._restore_sigterm()
        if self._directory is not None:
            self._directory.release()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the session is closed")

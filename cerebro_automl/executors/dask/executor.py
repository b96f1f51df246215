"""DaskExecutor: carries out the engine's commands on a Dask cluster and reports events.

Every unit is a task pinned to the worker holding its partition
(``workers=[addr], allow_other_workers=False``) that takes the model's previous
state as a future, so Dask moves the state straight from worker to worker. The
driver learns only that a unit finished (a status message, no data); training
metrics travel inside the state and come back with the evaluation. The driver
fetches a state only for a checkpoint or when the user asks for a model.

It makes no choice of worker: units, evaluations and resumed states go where the
engine's commands and queries name.
"""

from __future__ import annotations

import gc
import logging
import pickle
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from ...data import PartitionedDataset
from ...protocol import (
    AskProgress,
    Command,
    Discard,
    Drop,
    Evaluate,
    Place,
    Release,
    Rollback,
    Train,
    TrainGang,
    UnitCancelled,
    WorkerLost,
)
from ...training import TrainingSpec, describe_device, gpu_of
from ...training.devices import NoGpu
from ..base import FETCH_TIMEOUT, Completion, Executor, partition_count, partition_sources
from . import batch_jobs, failures, gang, tasks
from .cluster import connect, scheduler_workers, warm_up_workers, warn_about_malloc_trim
from .evaluations import Evaluations
from .inflight import InFlight, release
from .partitions import SCATTER_TIMEOUT, Partitions
from .progress import ProgressAsks
from .reporter import Reporter
from .states import StateVersions, fetch
from .watch import WorkerWatch
from .wire import Pickled, is_future, with_spec

__all__ = ["DaskExecutor"]

logger = logging.getLogger("cerebro_automl")


class DaskExecutor(Executor):
    """Runs units on a Dask cluster.

    Args:
        client: a ``distributed.Client``, a scheduler address, or None to start
            a LocalCluster (closed with the executor).
        n_workers: workers of the LocalCluster started when ``client`` is None.
        gpus, workers_per_gpu: that LocalCluster's GPUs (see :func:`start_local_cluster`).

    >>> executor = DaskExecutor(n_workers=2)  # doctest: +SKIP
    """

    gang_units = True

    def __init__(
        self,
        client: Any = None,
        *,
        n_workers: int | None = None,
        gpus: Sequence[str] | str | None = None,
        workers_per_gpu: int = 1,
    ) -> None:
        self.client, self._cluster = connect(client, n_workers, gpus, workers_per_gpu)
        self._own_client = client is None or isinstance(client, str)  # closed with the executor
        if self._cluster is None:
            warn_about_malloc_trim(self.client)
        warm_up_workers(self.client)
        self.states = StateVersions()
        self._session = uuid.uuid4().hex[:8]
        # The tasks announce what runs on their worker (see tasks._exclusive) in the
        # scheduler's event log under this topic; the driver reads it only when a worker is lost.
        self._watch = WorkerWatch(self.client, f"cerebro-executing-{self._session}", self.workers())
        self._pending = InFlight(self.client, self._session)
        self._partitions = Partitions(self.client, self._pending, self._session, self._watch.topic)
        self._evaluations = Evaluations(self._pending)
        self._configs: dict[int, Pickled] = {}  # model -> its config, pickled once
        self._progress = ProgressAsks(self.client)
        self._gangs = gang.GangRanks(self._pending.cancel)  # the ranks but 0 of the gang units in flight
        self._reporter = Reporter(
            self.client,
            self.workers,
            self._pending,
            self.states,
            self._partitions,
            self._evaluations,
            self._watch,
            self._progress,
            self._gangs,
        )

    # ------------------------------------------------------------- set-up
    def workers(self) -> list[str]:
        return scheduler_workers(self.client)

    def wait_for_workers(self, n: int, timeout: float | None) -> None:
        batch_jobs.wait_for_workers(self.client, n, timeout)
        self._watch.known = set(self.workers())

    def missing_workers(self) -> str:
        return batch_jobs.jobs_report(self.client)

    def bind(self, spec: TrainingSpec, data: PartitionedDataset, threads: int, deterministic: bool = True) -> None:
        import cloudpickle

        try:
            cloudpickle.dumps(spec)
        except Exception as err:
            raise TypeError(
                f"the TrainingSpec cannot be pickled for the Dask workers ({err}); "
                "define model_fn, optimizer_fn and loss_fn so that cloudpickle can "
                "send them (no open files, locks or live connections)"
            ) from None
        self.spec, self.data, self.threads, self.deterministic = spec, data, threads, deterministic
        self._spec = Pickled(spec, cached=True)

    def devices(self, workers: Sequence[str] | None = None) -> dict[str, str]:
        """What each worker (or each of ``workers``) runs units on (``"cpu"`` or
        ``"cuda:<GPU model>"``); a worker that fails to answer (it is leaving) is left out."""
        answers = _ask_with_spec(self.client, describe_device, self._spec, workers)
        return {w: d for w, d in answers.items() if isinstance(d, str)}

    def gpus(self, workers: Sequence[str] | None = None) -> dict[str, str | None]:
        answers = _ask_with_spec(self.client, gpu_of, self._spec, workers)
        return {w: g for w, g in answers.items() if g is None or isinstance(g, str)}

    def partition_fingerprints(self, partitions: Iterable[int]) -> dict[int, dict]:
        return self._partitions.fingerprints(set(partitions))

    def held_epochs(self, model_id: int) -> set[int]:
        return set(self.states.record(model_id).ends)

    def add_model(
        self,
        model_id: int,
        config: Mapping[str, Any],
        seed: int,
        state: dict | None = None,
        epoch: int = 0,
        *,
        fresh_hyperparameters: bool = False,
        worker: str | None = None,
    ) -> str | None:
        self.states.add(model_id, config, seed, fresh_at=epoch if fresh_hyperparameters else None)
        self._configs[model_id] = Pickled(dict(config))
        if state is None:
            return None
        # Resumed from a checkpoint: the state goes to the worker the engine named, once,
        # and the driver keeps its copy, which a rollback uses if that worker dies.
        try:
            if worker is None or worker in self._watch.lost:
                raise OSError(f"no live worker to send it to (named: {worker})")
            [sent] = self.client.scatter([state], workers=[worker], hash=False, timeout=SCATTER_TIMEOUT)
        except Exception as err:  # the first unit then carries the driver's copy
            logger.warning(
                "sending model %d's resumed state to a worker failed (%r); its first unit takes it from the driver",
                model_id,
                err,
            )
            sent, worker = state, None
        self.states.start_from(model_id, epoch, sent, state, worker)
        return worker

    def set_config(self, model_id: int, config: Mapping[str, Any]) -> None:
        self.states.record(model_id).config = config
        self._configs[model_id] = Pickled(dict(config))

    def add_fork(
        self,
        model_id: int,
        config: Mapping[str, Any],
        seed: int,
        parent_id: int,
        epoch: int,
        state: dict,
        *,
        worker: str | None = None,
    ) -> str | None:
        """The fork starts from the parent's state where it lies (no data moves now);
        the driver's copy ``state`` is its fallback if that worker dies."""
        start = self.states.end_state(parent_id, epoch)
        if not is_future(start):
            return self.add_model(model_id, config, seed, state, epoch, fresh_hyperparameters=True, worker=worker)
        self.states.add(model_id, config, seed, fresh_at=epoch)
        self._configs[model_id] = Pickled(dict(config))
        self.states.start_from(model_id, epoch, start, state, None)
        return self.states.holder(start)

    # ------------------------------------------------------------- commands
    def execute(self, ins: Command) -> None:
        unreachable = failures.unreachable(
            ins,
            self._watch.lost,
            set(self._partitions),
            self._shards_read(ins),
        )
        if unreachable:  # reported at the next poll, after the WorkerLost the engine may not have seen
            logger.info("not sent: %r needs a worker that was lost", ins)
            self._reporter.ready.extend(Completion(e) for e in unreachable)
            return
        if isinstance(ins, Place):
            failed: Any = self._partitions.place(ins, partition_sources(self.data)[ins.partition])
            if failed is not None and ins.worker not in self.workers():
                # It left while its shard was sent (a job at its time limit): a departure,
                # which the engine handles as one, not a failure of the data to load.
                failed = WorkerLost(ins.worker)
            self._reporter.ready.extend([Completion(failed)] if failed else [])
        elif isinstance(ins, Train):
            self._train(ins)
        elif isinstance(ins, TrainGang):
            self._train_gang(ins)
        elif isinstance(ins, Evaluate):
            self._evaluate(ins)
        elif isinstance(ins, Discard):
            self._discard_run(ins)
        elif isinstance(ins, AskProgress):
            self._ask_progress(ins)
        elif isinstance(ins, Drop):
            self._partitions.drop(ins.partition, ins.worker)
        elif isinstance(ins, Rollback):
            self._discard_in_flight(ins.model_id)
            self.states.rollback(ins.model_id, ins.epoch, ins.durable)
        elif isinstance(ins, Release):
            self._discard_in_flight(ins.model_id)
            self.states.release(ins.model_id)
        else:
            raise TypeError(f"{ins!r} is not a command an executor carries out")

    def _train(self, ins: Train) -> None:
        record = self.states.record(ins.model_id)
        prior = self.states.begin_unit(ins)
        future = self._pending.submit(
            ins,
            ins.worker,
            tasks.train_task,
            self._spec,
            self._configs[ins.model_id],
            prior,
            self._partitions[(ins.partition, ins.worker)],
            record.seed,
            ins.epoch,
            ins.partition,
            ins.step,
            ins.epoch_end,
            self.threads,
            self.unit_timeout,
            self._watch.topic,
            ins.model_id,
            record.fresh_hyperparameters(ins.epoch, ins.step),
            self.deterministic,
            ins.budget,
            partition_count(self.data),
            key=f"m{ins.model_id}-e{ins.epoch}-p{ins.partition}",
            prior=prior,
        )
        self.states.unit_sent(ins, future)

    def _train_gang(self, ins: TrainGang) -> None:
        """One task per rank, pinned to the worker holding its partition (see
        :mod:`.gang`); rank 0's carries the unit in the books, as a Train's would."""
        self._gangs.prune(self._pending)
        lead = Train(
            ins.model_id, ins.partitions[0], ins.workers[0], ins.epoch, ins.step, ins.epoch_end, budget=ins.budget
        )
        record = self.states.record(ins.model_id)
        prior = self.states.begin_unit(lead)
        ranks = list(zip(ins.partitions, ins.workers, strict=True))
        unit = gang.GangUnit(
            record.seed, ins.epoch, ins.step, ins.epoch_end, ins.budget, partition_count(self.data), self.threads,
            self.unit_timeout, record.fresh_hyperparameters(ins.epoch, ins.step), self.deterministic,
        )  # fmt: skip
        try:
            calls = gang.gang_calls(
                self.client, self._spec, self._configs[ins.model_id], prior, ranks,
                [self._partitions[r] for r in ranks], unit, topic=self._watch.topic, model_id=ins.model_id,
            )  # fmt: skip
        except Exception as err:  # a rank's worker or shard went away meanwhile: the unit runs again
            logger.info("gang unit %r not sent: %r", ins, err)
            cancelled = UnitCancelled(ins.model_id, lead.partition, lead.worker, f"its ranks could not start: {err!r}")
            self._reporter.ready.append(Completion(cancelled))
            return
        key = f"m{ins.model_id}-e{ins.epoch}-p{ins.partitions[0]}"
        future = self._pending.submit(lead, lead.worker, gang.gang_rank_task, *calls[0].args, key=key, prior=prior)
        others = [
            (self._pending.submit_untracked(c.worker, gang.gang_rank_task, *c.args, key=f"{key}-r{c.rank}"), c.worker)
            for c in calls[1:]
        ]
        self._gangs.add(future, others)
        self.states.unit_sent(lead, future)

    def _discard_run(self, ins: Discard) -> None:
        """One run of a unit no longer counts: in a race the other one's state is the
        model's; a restarted unit runs again from the state it started from."""
        task = self._pending.get(self.states.run(ins.model_id, ins.worker))
        loser = self.states.discard_run(ins.model_id, ins.worker, ins.restart, *([] if task is None else [task.prior]))
        if loser in self._pending:  # still running: stopped; its completion frees its worker
            self.states.discard(loser)
            self._pending.stop([loser])
            self._gangs.stop([loser])

    def _ask_progress(self, ins: AskProgress) -> None:
        """Ask the workers how far the runs have come (see :mod:`.progress`)."""
        asked: dict[str, dict[str, tuple[int, int]]] = {}
        for model_id, partition, worker in ins.runs:
            future = self.states.run(model_id, worker)
            if future is not None and future in self._pending and worker not in self._watch.lost:
                asked.setdefault(worker, {})[future.key] = (model_id, partition)
        self._progress.ask(asked)

    def _shards_read(self, ins: Command) -> list[tuple[int, str]]:
        """The ``(partition, worker)`` shards a command reads: an Evaluate's validation
        shards; none for one over data without validation rows, which reads the state."""
        if not isinstance(ins, Evaluate) or self.data.has_validation is False:
            return []
        return list(enumerate(ins.workers))

    def _evaluate(self, ins: Evaluate) -> None:
        """One task per validation shard, on the worker holding it; the driver gathers
        the shards' results together (see :class:`.Evaluations`) and combines them."""
        self._evaluations.drop(ins.model_id)  # a re-issued evaluation replaces the old one
        record = self.states.record(ins.model_id)
        state = record.evaluated(ins.epoch, ins.unit)
        name = f"m{ins.model_id}-e{ins.epoch}" + (f"-u{ins.unit}" if ins.unit else "")
        holders = list(enumerate(ins.workers))
        if self.data.has_validation is False:
            # No validation rows anywhere: the evaluation is the epoch's training figures,
            # read from the state on the worker the engine named, in one task.
            worker = ins.workers[0]
            shard = self._pending.submit(ins, worker, tasks.training_figures, state, key=f"{name}-progress")
            self._evaluations.start(ins.model_id, [shard], {worker})
            return
        shards = [
            self._pending.submit(
                ins,
                w,
                tasks.evaluate_task,
                self._spec,
                self._configs[ins.model_id],
                state,
                self._partitions[(p, w)],
                record.seed,
                self.threads,
                self._watch.topic,
                ins.model_id,
                self.deterministic,
                key=f"{name}-p{p}",
            )
            for p, w in holders
        ]
        self._evaluations.start(ins.model_id, shards, {w for _, w in holders})

    def _discard_in_flight(self, model_id: int) -> None:
        """Results of this model's in-flight units no longer count (rollback, stop).
        They are cancelled: a unit waiting for an input that died with its worker would
        otherwise wait forever, and its worker with it. One already running stops after
        its batch (Dask cannot interrupt a task; see :meth:`.InFlight.stop`); its result
        is dropped."""
        units = self._pending.units_of(model_id)
        for future in units:
            self.states.discard(future)
        self._pending.stop(units)
        self._gangs.stop(units)
        self.states.end_runs(model_id)
        self._evaluations.drop(model_id)

    # ----------------------------------------------------------- completions
    def busy(self) -> bool:
        return self._reporter.busy()

    def poll(self, timeout: float) -> list[Completion]:
        return self._reporter.poll(timeout)

    # --------------------------------------------------------------- states
    def state_fetcher(self, model_id: int, epoch: int | None = None) -> Callable[[float], dict]:
        state = self.states.state(model_id, epoch)
        if not is_future(state):  # the driver's own copy

            def own(timeout: float = FETCH_TIMEOUT) -> dict:
                return state

            return own
        holder = self.states.holder(state)
        what = f"model {model_id}'s state" + ("" if epoch is None else f" after epoch {epoch}")

        def fetch_held(timeout: float = FETCH_TIMEOUT) -> dict:
            return fetch(state, holder, what, timeout, self.workers)

        return fetch_held

    def close(self) -> None:
        self._stop_units()
        # Release every key this session made, at once: dropping the futures alone
        # leaves the ones caught in reference cycles until the garbage collector runs.
        release(
            [*self._pending.held(), *self._partitions.futures(), *self.states.futures(), *self._evaluations.clear()]
        )
        self._pending.cancel_again(everything=True)
        self._progress.cancel()
        self._pending.clear()
        self.states.clear()
        self._partitions.clear()
        # A Future caught in a reference cycle (an exception's traceback, say) keeps its
        # key wanted until the garbage collector runs: collect now, so none outlives us.
        gc.collect()
        self._remove_disk_caches()
        self._forget_models()
        if self._own_client:
            self.client.close()
        if self._cluster is not None:
            self._cluster.close()

    def _stop_units(self) -> None:
        """Stop the units still running (after their batch), so that a cluster that
        outlives the session is free at once: a gang unit's ranks waiting for a peer
        that will never come would otherwise hold their workers until the rendezvous
        timeout. The cancels go to the scheduler, none to a worker."""
        units = [f for f, t in self._pending.items() if isinstance(t.command, Train)]
        try:
            self._pending.stop(units)
            self._gangs.stop_all()  # a unit whose rank 0 ended may have ranks still waiting
        except Exception as err:  # a cluster going away: its units go with it
            logger.debug("stopping the units in flight failed: %r", err)

    def _forget_models(self) -> None:
        """Drop the modules the workers keep for this session's spec (their frozen bases
        with them): a cluster that outlives the session serves others next."""
        spec = getattr(self, "_spec", None)
        if spec is None or self._cluster is not None:  # our own cluster's workers end with it
            return
        try:
            self.client.run(tasks.forget_models, spec.digest)
        except Exception as err:  # a cluster going away: its memory goes with it
            logger.debug("dropping the kept modules failed: %r", err)

    def _remove_disk_caches(self) -> None:
        """Delete this session's disk-cached partitions on every worker. Each folder also
        goes when its partition is released; this catches what a release left behind."""
        options = getattr(getattr(self, "data", None), "options", None)
        if options is None or options.cache != "disk":
            return
        try:
            self.client.run(tasks.remove_scratch, self._session, options.cache_dir)
        except Exception as err:  # a cluster going away: its folders go with it
            logger.debug("removing the disk caches failed: %r", err)

    def __getstate__(self) -> None:  # an executor lives on the driver only
        raise pickle.PicklingError("a DaskExecutor cannot be pickled")


def _ask_with_spec(client: Any, fn: Any, spec: Pickled, workers: Sequence[str] | None) -> dict[str, Any]:
    """``fn(spec)`` on each worker. The spec goes as the units' does, cloudpickled
    (``client.run`` pickles its arguments plainly, which sends a module registered
    with ``register_pickle_by_value`` by name). A worker that raises is named in a
    warning; one that is leaving (its comm closed) is left out quietly."""
    answers = client.run(with_spec, fn, spec, workers=list(workers) if workers else None, on_error="return")
    for worker, answer in answers.items():
        if isinstance(answer, NoGpu):  # every unit there would fail: refused before any work
            raise NoGpu(f"worker {worker}: {answer}") from None
        if isinstance(answer, Exception) and not isinstance(answer, OSError):
            logger.warning(
                "worker %s could not say what it trains on (%s: %s); the device checks leave it out",
                worker,
                type(answer).__name__,
                answer,
            )
    return answers

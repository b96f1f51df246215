"""The dask.distributed executor: partitions pinned to workers, model states hop.

Every unit is a task pinned to the worker holding its partition
(``workers=[addr], allow_other_workers=False``) that takes the model's previous
state as a future, so Dask moves the state straight from worker to worker. The
driver learns only that a unit finished (a status message, no data); training
metrics travel inside the state and come back with the evaluation. The driver
fetches a state only for a checkpoint or when the user asks for a model.

With no client, a LocalCluster of single-threaded worker processes (one per
core) is started and closed with the session.
"""

from __future__ import annotations

import itertools
import logging
import os
import pickle
import shutil
import uuid
from concurrent.futures import CancelledError
from dataclasses import dataclass
from typing import Any, Mapping

from ..data import PartitionedDataset
from ..scheduler import (Checkpoint, EvaluationDone, Evaluate, Fail, Finish, Instruction,
                         PartitionPlaced, Place, Release, Report, Rollback, Train, UnitDone,
                         UnitFailed, WorkerAdded, WorkerLost)
from ..training import TrainingSpec, UnitError, epoch_metrics, evaluate_unit, train_unit
from .base import Completion, Executor, ModelRecord

__all__ = ["DaskExecutor", "start_local_cluster"]

logger = logging.getLogger("cerebro_automl")

# Dask's nanny sets MALLOC_TRIM_THRESHOLD_=65536 in its workers, which can slow torch
# training on CPU (benchmarks/bench_engine.py measures it). None unsets it.
WORKER_ENVIRON = {"distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_": None}
DASK_MALLOC_TRIM = "65536"


def start_local_cluster(n_workers: int | None = None, **kwargs: Any):
    """A LocalCluster of ``n_workers`` single-threaded worker processes (default:
    one per core), with the nanny's malloc-trim setting removed."""
    import dask
    from distributed import LocalCluster

    n_workers = n_workers or os.cpu_count() or 1
    # A LocalCluster started earlier in this process with Dask's defaults leaves
    # the variable in os.environ, and spawned workers inherit it: drop Dask's value
    # (only child processes read it; a value the user chose is kept).
    if os.environ.get("MALLOC_TRIM_THRESHOLD_") == DASK_MALLOC_TRIM:
        del os.environ["MALLOC_TRIM_THRESHOLD_"]
    with dask.config.set(WORKER_ENVIRON):
        return LocalCluster(n_workers=n_workers, threads_per_worker=1, processes=True,
                            dashboard_address=kwargs.pop("dashboard_address", ":0"), **kwargs)


# ----------------------------------------------------------- worker-side tasks
def _unknown_keys(keys: list, dask_scheduler: Any = None) -> list:
    return [k for k in keys if k not in dask_scheduler.tasks]


def _scratch(tag: str, cache_dir: str | None, dask_worker: Any = None) -> str:
    """This session's folder for disk-cached partitions on this worker: under
    ``cache_dir``, or the Dask worker's own ``local_directory``."""
    if dask_worker is None:
        from distributed import get_worker
        dask_worker = get_worker()
    return os.path.join(cache_dir or dask_worker.local_directory, f"cerebro-cache-{tag}")


def _load(source: Any, tag: str, *external: Any) -> Any:
    options = getattr(source, "options", None)
    scratch = None
    if options is not None and options.cache == "disk":
        scratch = _scratch(tag, options.cache_dir)
        os.makedirs(scratch, exist_ok=True)
    return source.load(*external, scratch=scratch)


def _remove_scratch(tag: str, cache_dir: str | None, dask_worker: Any = None) -> None:
    shutil.rmtree(_scratch(tag, cache_dir, dask_worker), ignore_errors=True)


def _train_task(spec, config, state, partition, seed, epoch, index, step, epoch_end, threads,
                unit_timeout):
    return train_unit(spec, config, state, partition.train, seed=seed, epoch=epoch,
                      partition=index, step=step, epoch_end=epoch_end, threads=threads,
                      unit_timeout=unit_timeout)


def _evaluate_task(spec, config, state, partition, seed, threads):
    return evaluate_unit(spec, config, state, partition.valid, seed=seed, threads=threads)


def _combine(*results):
    return epoch_metrics(list(results))


@dataclass(frozen=True)
class _Pending:
    kind: str           # "train", "place", "evaluate"
    instruction: Instruction
    worker: str | None  # the worker the task is pinned to (None: any)
    order: int          # submission order: completions are handled in it
    prior: Any = None   # train: the state the unit started from (a retry starts there again)


def _warn_about_malloc_trim(client: Any) -> None:
    """Say so when the user's workers run with Dask's MALLOC_TRIM_THRESHOLD_=65536:
    `make bench` measured training about 2x slower with it."""
    try:
        values = client.run(lambda: os.environ.get("MALLOC_TRIM_THRESHOLD_"))
    except Exception:  # an old or restricted cluster: not worth failing over
        return
    slow = sorted(w for w, v in values.items() if v == DASK_MALLOC_TRIM)
    if slow:
        logger.warning(
            "%d of %d workers run with Dask's MALLOC_TRIM_THRESHOLD_=%s, which slowed torch "
            "training about 2x in our benchmark; start them with --no-nanny, or with a Dask config "
            "that sets distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_ to null "
            "(see the README)",
            len(slow), len(values), DASK_MALLOC_TRIM)


class DaskExecutor(Executor):
    """Runs units on a Dask cluster.

    Args:
        client: a ``distributed.Client``, a scheduler address, or None to start
            a LocalCluster (closed with the executor).
        n_workers: workers of the LocalCluster started when ``client`` is None.
    """

    def __init__(self, client: Any = None, *, n_workers: int | None = None) -> None:
        from distributed import Client

        self._cluster = None
        self._own_client = False
        if client is None:
            self._cluster = start_local_cluster(n_workers)
            client, self._own_client = Client(self._cluster), True
        elif isinstance(client, str):
            client, self._own_client = Client(client), True
        elif not isinstance(client, Client):
            raise TypeError(f"client is {client!r}, but must be a distributed.Client, "
                            "a scheduler address or None")
        if client.status in ("closed", "closing"):
            raise ValueError(f"client {client!r} is {client.status}; pass an open client")
        self.client = client
        if self._cluster is None:
            _warn_about_malloc_trim(client)
        self._models: dict[int, ModelRecord] = {}
        self._partitions: dict[int, Any] = {}        # partition -> future of PartitionData
        self._partition_holder: dict[int, str] = {}  # partition -> worker holding it
        self._pending: dict[Any, _Pending] = {}      # future -> what it is
        self._evaluations: dict[int, list] = {}       # model -> its evaluation futures
        self._stale: set[Any] = set()                 # train futures whose result is discarded
        self._known_workers = set(self.workers())
        self._lost_workers: set[str] = set()  # seen lost and not seen again since
        self._counter = itertools.count()
        self._session = uuid.uuid4().hex[:8]

    # ------------------------------------------------------------- set-up
    def workers(self) -> list[str]:
        return sorted(self.client.scheduler_info(n_workers=-1)["workers"])

    def bind(self, spec: TrainingSpec, data: PartitionedDataset, threads: int) -> None:
        import cloudpickle

        try:
            cloudpickle.dumps(spec)
        except Exception as err:
            raise TypeError(f"the TrainingSpec cannot be pickled for the Dask workers ({err}); "
                            "define model_fn, optimizer_fn and loss_fn so that cloudpickle can "
                            "send them (no open files, locks or live connections)") from None
        self.spec, self.data, self.threads = spec, data, threads

    def add_model(self, model_id: int, config: Mapping[str, Any], seed: int,
                  state: dict | None = None, epoch: int = 0) -> None:
        record = self._models[model_id] = ModelRecord(dict(config), seed)
        if state is not None:  # resumed from a checkpoint: the state goes to a worker once
            [record.current] = self.client.scatter([state], hash=False)
            record.keep_end(epoch, record.current)

    # ---------------------------------------------------------- instructions
    def execute(self, ins: Instruction) -> None:
        if self._after_loss(ins):
            return
        if isinstance(ins, Place):
            self._place(ins)
        elif isinstance(ins, Train):
            self._train(ins)
        elif isinstance(ins, Evaluate):
            self._evaluate(ins)
        elif isinstance(ins, Rollback):
            self._discard_in_flight(ins.model_id)
            self._models[ins.model_id].rollback(ins.epoch)
        elif isinstance(ins, Release):
            self._discard_in_flight(ins.model_id)
            record = self._models[ins.model_id]
            record.current, record.ends = None, {}
        elif not isinstance(ins, (Report, Finish, Fail, Checkpoint)):
            raise TypeError(f"unknown instruction {ins!r}")

    def _after_loss(self, ins: Instruction) -> bool:
        """True for work the scheduler sent before it learnt of a worker loss that
        this executor has already seen: a poll can return completions and then the
        WorkerLost, and a completion handled first may send work to the lost worker
        or read its partitions. The WorkerLost that follows re-places the partitions,
        frees the unit and evaluates again, so the instruction is dropped."""
        if isinstance(ins, (Place, Train)):
            dropped = ins.worker in self._lost_workers
        elif isinstance(ins, Evaluate):
            dropped = len(self._partitions) < self.data.num_partitions  # a shard's worker is gone
        else:
            dropped = False
        if dropped:
            logger.info("dropped %r: it needs a worker that was lost", ins)
        return dropped

    def _submit(self, kind: str, ins: Instruction, worker: str | None, fn, *args, key: str,
                prior: Any = None):
        pin = dict(workers=[worker], allow_other_workers=False) if worker else {}
        future = self.client.submit(fn, *args, key=f"cerebro-{kind}-{key}-{self._session}-"
                                    f"{next(self._counter)}", pure=False, **pin)
        self._pending[future] = _Pending(kind, ins, worker, next(self._counter), prior)
        return future

    def _place(self, ins: Place) -> None:
        source = self.data.sources[ins.partition]
        if getattr(source, "in_memory", False):
            # The driver holds this shard: send it to its worker directly.
            try:
                [source] = self.client.scatter([source], workers=[ins.worker], hash=False)
            except (KeyError, OSError) as err:  # the worker left meanwhile: WorkerLost follows
                logger.warning("placing partition %d on %s failed (%r); it is placed again "
                               "when the loss is seen", ins.partition, ins.worker, err)
                return
        self._submit("place", ins, ins.worker, _load, source, self._session,
                     *self._persisted_inputs(source), key=f"p{ins.partition}")

    def _persisted_inputs(self, source: Any) -> list:
        """Futures for the persisted blocks a dask source reads; they must live on
        this client's scheduler (a collection persisted on another cluster cannot)."""
        keys = source.external_keys() if hasattr(source, "external_keys") else []
        if not keys:
            return []
        from distributed import Future

        # Known to the scheduler in any state: a collection persisted a moment ago may
        # still be computing (who_has would not list it yet).
        missing = self.client.run_on_scheduler(_unknown_keys, keys)
        if missing:
            raise ValueError(
                f"the data reads {len(missing)} persisted blocks (e.g. {missing[0]!r}) that the scheduler "
                f"at {self.client.scheduler.address} does not hold: the dask collection was persisted "
                "on another cluster. Persist it with this session's client, or pass it unpersisted")
        return [Future(k, self.client) for k in keys]

    def _train(self, ins: Train) -> None:
        record = self._models[ins.model_id]
        if ins.step == 0:
            record.ends = {e: s for e, s in record.ends.items() if e == ins.epoch}
        prior = record.current
        future = self._submit(
            "train", ins, ins.worker, _train_task, self.spec, record.config, record.current,
            self._partitions[ins.partition], record.seed, ins.epoch, ins.partition, ins.step,
            ins.epoch_end, self.threads, self.unit_timeout,
            key=f"m{ins.model_id}-e{ins.epoch}-p{ins.partition}",
            prior=prior)
        record.current = future
        if ins.epoch_end:
            record.keep_end(ins.epoch + 1, future)

    def _evaluate(self, ins: Evaluate) -> None:
        for old in self._evaluations.pop(ins.model_id, []):  # a re-issued evaluation
            self._pending.pop(old, None)
        record = self._models[ins.model_id]
        state = record.ends[ins.epoch]
        workers = self._partition_holder
        shards = [self.client.submit(_evaluate_task, self.spec, record.config, state,
                                     self._partitions[p], record.seed, self.threads,
                                     workers=[workers[p]], allow_other_workers=False, pure=False,
                                     key=f"cerebro-eval-m{ins.model_id}-e{ins.epoch}-p{p}-"
                                         f"{self._session}-{next(self._counter)}")
                  for p in range(self.data.num_partitions)]
        combined = self._submit("evaluate", ins, None, _combine, *shards,
                                key=f"m{ins.model_id}-e{ins.epoch}")
        self._evaluations[ins.model_id] = [combined, *shards]

    def _discard_in_flight(self, model_id: int) -> None:
        """Results of this model's in-flight units no longer count (rollback, stop)."""
        for future, pending in self._pending.items():
            if pending.kind == "train" and pending.instruction.model_id == model_id:
                self._stale.add(future)
        for future in self._evaluations.pop(model_id, []):
            self._pending.pop(future, None)

    # ----------------------------------------------------------- completions
    def busy(self) -> bool:
        return bool(self._pending)

    def poll(self, timeout: float) -> list[Completion]:
        from distributed import wait
        from distributed.client import FuturesCancelledError

        out: list[Completion] = []
        if self._pending:
            try:
                done, _ = wait(list(self._pending), timeout=timeout, return_when="FIRST_COMPLETED")
            except TimeoutError:  # distributed raises rather than returning nothing
                done = set()
            except FuturesCancelledError:
                # Dask cancelled tasks whose inputs died with a worker. Report the loss
                # first, so that the scheduler rolls back; the cancelled futures are
                # handled at the next poll, when they are known to be stale.
                lost = self._check_workers()
                if lost:
                    return lost
                done = {f for f in self._pending if f.cancelled()}
            for future in sorted(done, key=lambda f: self._pending[f].order):
                pending = self._pending.pop(future, None)
                if pending is not None:  # a worker loss seen meanwhile may have dropped it
                    out.extend(self._complete(future, pending))
        if not out:  # nothing finished in time: has a worker come or gone?
            out.extend(self._check_workers())
        return out

    def _complete(self, future, pending: _Pending) -> list[Completion]:
        ins = pending.instruction
        if future.status == "finished":
            if pending.kind == "place":
                self._partitions[ins.partition] = future
                self._partition_holder[ins.partition] = ins.worker
                return [Completion(PartitionPlaced(ins.partition, ins.worker))]
            if pending.kind == "train":
                self._stale.discard(future)
                return [Completion(UnitDone(ins.model_id, ins.partition, ins.worker))]
            shards = self._evaluations.pop(ins.model_id, [])
            try:
                metrics = future.result()
                for done in shards:  # the metrics are here: free their keys now, not at GC
                    done.release()
            except CancelledError:  # its result died with a worker between "finished" and now
                lost = self._check_workers()
                if not lost and ins.epoch in self._models[ins.model_id].ends:
                    self._evaluate(ins)  # the state is still held: evaluate it again
                return lost
            return [Completion(EvaluationDone(ins.model_id, ins.epoch), metrics)]
        if future.status == "cancelled":  # by Dask: an input was lost with a worker
            if pending.kind == "train":
                if future in self._stale:  # its model was rolled back: this frees the worker
                    self._stale.discard(future)
                    return [Completion(UnitDone(ins.model_id, ins.partition, ins.worker))]
                return [Completion(UnitFailed(ins.model_id, ins.partition, ins.worker,
                                              "the unit was cancelled: an input was lost with a worker"))]
            if pending.kind == "evaluate":
                self._evaluations.pop(ins.model_id, None)  # the scheduler evaluates again
            return []
        if future.status != "error":
            return []
        error = future.exception()
        if pending.worker is not None and pending.worker not in self.workers():
            return self._check_workers()  # the cluster lost the worker, not user code
        text = str(error) if isinstance(error, UnitError) else f"{type(error).__name__}: {error}"
        if pending.kind == "train":
            stale = future in self._stale
            self._stale.discard(future)
            return [] if stale else [Completion(UnitFailed(ins.model_id, ins.partition,
                                                           ins.worker, text))]
        if pending.kind == "evaluate":
            self._evaluations.pop(ins.model_id, None)
            return [Completion(EvaluationDone(ins.model_id, ins.epoch, text))]
        raise RuntimeError(f"loading partition {ins.partition} on worker {ins.worker} failed: "
                           f"{text}") from error

    def _check_workers(self) -> list[Completion]:
        now = set(self.workers())
        out: list[Completion] = []
        for w in sorted(self._known_workers - now):
            out.extend(self._lose(w))
        for w in sorted(now - self._known_workers):
            self._known_workers.add(w)
            self._lost_workers.discard(w)
            out.append(Completion(WorkerAdded(w)))
        return out

    def _lose(self, worker: str) -> list[Completion]:
        """Forget everything pinned to a lost worker; the scheduler re-places and rolls back."""
        logger.warning("worker %s was lost", worker)
        self._known_workers.discard(worker)
        self._lost_workers.add(worker)
        for future, pending in list(self._pending.items()):
            if pending.worker == worker:
                del self._pending[future]
                self._stale.discard(future)
                future.cancel()
                record = self._models.get(pending.instruction.model_id) if pending.kind == "train" else None
                if record is not None and record.current is future:
                    # the scheduler retries the unit from the state it started from
                    record.current = pending.prior
                    record.ends = {e: s for e, s in record.ends.items() if s is not future}
        for p, holder in list(self._partition_holder.items()):
            if holder == worker:
                del self._partition_holder[p]
                self._partitions.pop(p, None)
        return [Completion(WorkerLost(worker))]

    # --------------------------------------------------------------- states
    def fetch_state(self, model_id: int, epoch: int | None = None) -> dict:
        record = self._models[model_id]
        future = record.current if epoch is None else record.ends.get(epoch)
        if future is None:
            raise ValueError(f"model {model_id} holds no trained state"
                             + ("" if epoch is None else f" after epoch {epoch}"))
        return future.result()

    def close(self) -> None:
        # Release every key this session made, at once: dropping the futures alone
        # leaves the ones caught in reference cycles until the garbage collector runs.
        held = [*self._pending, *self._partitions.values(), *self._stale,
                *(f for futures in self._evaluations.values() for f in futures),
                *(f for r in self._models.values() for f in (r.current, *r.ends.values())
                  if f is not None and not isinstance(f, dict))]
        for future in held:
            try:
                future.release()  # our reference only; idempotent
            except Exception as err:  # a cluster going away: nothing left to release
                logger.debug("releasing %s failed: %r", future.key, err)
        self._pending.clear()
        self._evaluations.clear()
        self._stale.clear()
        self._partitions.clear()
        self._models.clear()
        self._remove_disk_caches()
        if self._own_client:
            self.client.close()
        if self._cluster is not None:
            self._cluster.close()

    def _remove_disk_caches(self) -> None:
        """Delete this session's disk-cached partitions on every worker. Each folder also
        goes when its partition is released; this catches what a release left behind."""
        options = getattr(getattr(self, "data", None), "options", None)
        if options is None or options.cache != "disk":
            return
        try:
            self.client.run(_remove_scratch, self._session, options.cache_dir)
        except Exception as err:  # a cluster going away: its folders go with it
            logger.debug("removing the disk caches failed: %r", err)

    def __getstate__(self):  # an executor lives on the driver only
        raise pickle.PicklingError("a DaskExecutor cannot be pickled")

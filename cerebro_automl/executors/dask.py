"""The dask.distributed executor: partitions pinned to workers, model states hop.

Every unit is a task pinned to the worker holding its partition
(``workers=[addr], allow_other_workers=False``) that takes the model's previous
state as a future, so Dask moves the state straight from worker to worker. The
driver learns only that a unit finished (a status message, no data); training
metrics travel inside the state and come back with the evaluation. The driver
fetches a state only for a checkpoint or when the user asks for a model.

With no client, a LocalCluster of single-threaded worker processes (one per
core) is started and closed with the session.

Faults: a worker process runs one of our tasks at a time whatever its thread
count (torch's seeds and thread settings are process-wide), and records what
it runs (a Dask event the driver reads when the worker dies), so that the work
it was running, not the work queued behind it, counts against its model's retries.
Futures cancelled while their workers live (a client that reconnects to the
scheduler loses them all) are reported as lost partitions, states, units and
evaluations; the scheduler decides what runs again.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import gc
import itertools
import logging
import os
import pickle
import shutil
import threading
import time
import uuid
from concurrent.futures import CancelledError
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

from ..data import PartitionedDataset
from ..protocol import (AskProgress, Command, Discard, Drop, Evaluate, EvaluationCancelled, EvaluationDone,
                        Event, Executing, PartitionLost, PartitionPlaced, Place, PlaceFailed, Release, Rollback,
                        StatesLost, Train, UnitCancelled, UnitDone, UnitFailed, UnitProgress, WorkerAdded,
                        WorkerLost)
from ..checks import check_int
from ..training import (CUBLAS_WORKSPACE, EvalResult, TrainingSpec, UnitError, abandon_when, describe_device,
                        epoch_metrics, evaluate_unit, progress_to, train_unit)
from .base import FETCH_TIMEOUT, Completion, Executor, ModelRecord, StateUnavailable, idle_wait

__all__ = ["DaskExecutor", "start_local_cluster", "visible_gpus", "TIMEOUTS"]

# distributed raises asyncio.TimeoutError and concurrent.futures' waits their own
# TimeoutError, which are not the builtin TimeoutError before Python 3.11.
TIMEOUTS = (TimeoutError, asyncio.TimeoutError, concurrent.futures.TimeoutError)
SCATTER_TIMEOUT = 60  # seconds to send a shard or a resumed state to its worker
GATHER_TRY = 2.0  # seconds of the first try to read evaluation results (then 4, 8, ...)
PROGRESS_TIMEOUT = 1.0  # seconds the workers have to answer an AskProgress
PROGRESS_POLL = 0.005  # seconds a poll waits at most while an answer is due (it is reported then)
WORKER_CHECK_INTERVAL = 1.0  # seconds between checks for workers that joined or left while busy
QUIET_CHECK_INTERVAL = 0.25  # ... and at least between those of polls that found nothing finished
RECANCEL_AFTER = 1.0  # seconds after a cancel to send it once more (see DaskExecutor._cancel)

logger = logging.getLogger("cerebro_automl")

# Dask's nanny sets MALLOC_TRIM_THRESHOLD_=65536 in its workers, which can slow torch
# training on CPU (benchmarks/bench_engine.py measures it). None unsets it.
WORKER_ENVIRON = {"distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_": None}
DASK_MALLOC_TRIM = "65536"


def start_local_cluster(n_workers: int | None = None, *, gpus: Sequence[str] | str | None = None,
                        workers_per_gpu: int = 1, **kwargs: Any):
    """A LocalCluster of single-threaded worker processes, with the nanny's malloc-trim
    setting removed: ``n_workers`` of them (default: one per core), or, given GPUs,
    ``workers_per_gpu`` per GPU, each seeing only its own GPU through
    ``CUDA_VISIBLE_DEVICES`` (as dask-cuda's LocalCUDACluster does).

    ``gpus``: GPU ids (as ``CUDA_VISIBLE_DEVICES`` lists them), ``"auto"`` for those
    this process sees (none on a machine without CUDA), or None for CPU workers.
    With GPUs and ``n_workers``, the workers take the GPUs in turn.

    >>> cluster = start_local_cluster(gpus="auto", workers_per_gpu=2)  # doctest: +SKIP
    """
    import dask
    from distributed import LocalCluster

    check_int("workers_per_gpu", workers_per_gpu)
    gpu_ids = visible_gpus() if gpus == "auto" else [str(g) for g in gpus or []]
    known = visible_gpus() if gpu_ids else []
    unknown = [g for g in gpu_ids if known and g not in known and not g.startswith(("GPU-", "MIG-"))]
    if unknown:  # a worker told to see a GPU that is not there fails to start (its NVML monitor)
        raise ValueError(f"gpus lists {unknown}, but the GPUs this process sees are {known}")
    # A LocalCluster started earlier in this process with Dask's defaults leaves
    # the variable in os.environ, and spawned workers inherit it: drop Dask's value
    # (only child processes read it; a value the user chose is kept).
    if os.environ.get("MALLOC_TRIM_THRESHOLD_") == DASK_MALLOC_TRIM:
        del os.environ["MALLOC_TRIM_THRESHOLD_"]
    options = dict(threads_per_worker=1, processes=True,
                   dashboard_address=kwargs.pop("dashboard_address", ":0"), **kwargs)
    with dask.config.set(WORKER_ENVIRON):
        if not gpu_ids:
            return LocalCluster(n_workers=n_workers or os.cpu_count() or 1, **options)
        slots = [str(gpu_ids[i % len(gpu_ids)]) for i in range(n_workers or len(gpu_ids) * workers_per_gpu)]
        return _gpu_cluster_class()(slots, **options)


def visible_gpus() -> list[str]:
    """The ids of the GPUs this process may use: ``CUDA_VISIBLE_DEVICES`` when set,
    else every GPU torch counts (none without CUDA)."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [g.strip() for g in listed.split(",") if g.strip() and not g.strip().startswith("-")]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


@functools.lru_cache(maxsize=None)
def _gpu_cluster_class() -> type:
    from distributed import LocalCluster

    class GPULocalCluster(LocalCluster):
        """A LocalCluster whose worker ``i`` sees only GPU ``slots[i]``. A nanny keeps
        its worker's environment, so a restarted worker sees the same GPU."""

        def __init__(self, slots: list[str], **kwargs: Any) -> None:
            self._slots = slots
            super().__init__(n_workers=0, **kwargs)
            self.scale(len(slots))
            self.sync(self._correct_state)  # wait for them, as LocalCluster(n_workers=...) does

        def new_worker_spec(self) -> dict:
            free = sorted(set(range(len(self._slots))) - set(self.worker_spec))
            if not free:
                raise ValueError(f"this cluster has one worker per GPU slot, {len(self._slots)} in all "
                                 f"(GPUs {sorted(set(self._slots))}); it cannot scale beyond them")
            spec = {"cls": self.new_spec["cls"], "options": dict(self.new_spec["options"])}
            spec["options"]["env"] = {"CUDA_VISIBLE_DEVICES": self._slots[free[0]],
                                      "CUBLAS_WORKSPACE_CONFIG": CUBLAS_WORKSPACE}
            return {free[0]: spec}

    return GPULocalCluster


# ----------------------------------------------------------- worker-side tasks
# A lambda, so that it reaches a scheduler without this package by value (see _RUNNER).
_unknown_keys = (lambda keys, dask_scheduler=None: [k for k in keys if k not in dask_scheduler.tasks])


# One of our tasks at a time per worker process, whatever its thread count: a unit
# seeds torch's global RNG and sets its thread count, and an evaluation beside it
# (fork_rng restores the RNG when it ends) would change the unit's bits.
_TASK_LOCK = threading.Lock()


@contextlib.contextmanager
def _exclusive(topic: str | None, model_id: int | None = None,
               partition: int | None = None) -> Iterator[None]:
    """Hold the worker's task lock; tell the driver (on ``topic``) what runs meanwhile."""
    with _TASK_LOCK:
        _announce(topic, model_id, partition, True)
        try:
            yield
        finally:
            _announce(topic, model_id, partition, False)


def _announce(topic: str | None, model_id: int | None, partition: int | None, running: bool) -> None:
    if topic is None:
        return
    try:
        from distributed import get_worker
        worker = get_worker()
    except ValueError:  # not inside a worker (a client-side test of the task)
        return
    worker.log_event(topic, {"worker": worker.address, "model": model_id,
                             "partition": partition, "running": running})


def _scratch(tag: str, cache_dir: str | None, dask_worker: Any = None) -> str:
    """This session's folder for disk-cached partitions on this worker: under
    ``cache_dir``, or the Dask worker's own ``local_directory``."""
    if dask_worker is None:
        from distributed import get_worker
        dask_worker = get_worker()
    return os.path.join(cache_dir or dask_worker.local_directory, f"cerebro-cache-{tag}")


def _remove_scratch(tag: str, cache_dir: str | None, dask_worker: Any = None) -> None:
    shutil.rmtree(_scratch(tag, cache_dir, dask_worker), ignore_errors=True)


def _load(source: Any, tag: str, *external: Any, topic: str | None = None, partition: int | None = None,
          delay: float = 0.0) -> Any:
    time.sleep(delay)  # a retried load backs off, without holding the lock
    options = getattr(source, "options", None)
    scratch = None
    if options is not None and options.cache == "disk":
        scratch = _scratch(tag, options.cache_dir)
        os.makedirs(scratch, exist_ok=True)
    with _exclusive(topic, partition=partition):
        return source.load(*external, scratch=scratch)


def _warm_up() -> None:
    """Import what torch imports lazily in a unit's first optimizer step (torch._dynamo:
    1.5 s here) before the unit's clock starts: a fresh worker's first unit would
    otherwise count it against unit_timeout (a nanny's restarted worker, under load)."""
    import torch._dynamo  # noqa: F401


# Worker process: keys of our units whose results the driver has discarded. A unit
# checks after every batch and stops (the driver sends them with _abandon_units).
_ABANDONED: set[str] = set()


async def _abandon_units(keys: list[str]) -> None:
    """Runs on the worker's event loop (``Client.run``; a coroutine, as ``wait=False``
    requires): the units ``keys`` stop after their batch."""
    _ABANDONED.update(keys)


# Worker process: how far each of our running units has come, by key: [fraction of its
# rows trained, time.perf_counter() when its first batch began]. Units update it
# after every batch.
_UNIT_PROGRESS: dict[str, list[float]] = {}


def _units_progress(keys: list[str]) -> dict[str, tuple[float, float]]:
    """Runs on the worker's event loop (``Client.run``): ``key -> (fraction, seconds
    training)`` for those of ``keys`` that train there now."""
    now = time.perf_counter()
    found = {k: _UNIT_PROGRESS.get(k) for k in keys}  # a unit may end meanwhile, on its thread
    return {k: (p[0], now - p[1]) for k, p in found.items() if p is not None}


def _train_task(spec, config, state, partition, seed, epoch, index, step, epoch_end, threads,
                unit_timeout, topic=None, model_id=None, fresh_hyperparameters=False, deterministic=True):
    from distributed import get_worker

    _warm_up()
    key = get_worker().get_current_task()

    def report(fraction: float) -> None:
        progress = _UNIT_PROGRESS.get(key)
        if progress is None:
            _UNIT_PROGRESS[key] = [fraction, time.perf_counter()]
        else:
            progress[0] = fraction

    with _exclusive(topic, model_id), abandon_when(lambda: key in _ABANDONED):
        try:
            with progress_to(report):
                return train_unit(spec, config, state, partition.train, seed=seed, epoch=epoch,
                                  partition=index, step=step, epoch_end=epoch_end, threads=threads,
                                  unit_timeout=unit_timeout, fresh_hyperparameters=fresh_hyperparameters,
                                  deterministic=deterministic)
        finally:
            _ABANDONED.discard(key)
            _UNIT_PROGRESS.pop(key, None)


def _evaluate_task(spec, config, state, partition, seed, threads, topic=None, model_id=None,
                   deterministic=True):
    with _exclusive(topic, model_id):
        return evaluate_unit(spec, config, state, partition.valid, seed=seed, threads=threads,
                             deterministic=deterministic)


def _training_figures(state: dict) -> EvalResult:
    """An evaluation without validation data: the epoch's training figures alone."""
    return EvalResult(None, {}, 0, 0.0, state["progress"])


async def _gather(client: Any, futures: list) -> list:
    """Runs on the client's event loop (``Client.sync``, which can time it out)."""
    return await client.gather(futures, asynchronous=True)


# The Dask scheduler unpickles every task it is sent. Ours name this package and
# carry torch objects, so a scheduler without torch (or without this package)
# could not read them. A task therefore travels as a runner that the scheduler can
# unpickle with cloudpickle alone (a lambda, pickled by value) and a payload of
# bytes that only the worker unpickles; the futures it reads stay plain arguments,
# so that Dask still moves their data worker to worker.
_RUN = (lambda payload, *inputs, _loads=__import__("pickle").loads: _loads(payload)(*inputs))


class _Runner:
    """``_RUN``, pickled by value once: Dask pickles every task it submits, and the
    standard pickler, which it tries first, takes this object as the call that
    rebuilds the lambda from its bytes (cloudpickle would pickle the lambda anew
    for every task)."""

    def __init__(self) -> None:
        import cloudpickle

        self._pickled = cloudpickle.dumps(_RUN)

    def __reduce__(self):
        return pickle.loads, (self._pickled,)

    def __call__(self, payload: bytes, *inputs: Any) -> Any:
        return _RUN(payload, *inputs)


_RUNNER = _Runner()


class _Input:
    """Where the ``index``-th input future goes among a task's arguments."""

    def __init__(self, index: int) -> None:
        self.index = index


class _Pickled:
    """An argument pickled once on the driver (the spec, a config), not per task.

    ``cached``: a worker keeps the unpickled value for the next task that carries
    the same bytes, so the spec (its model code) is unpickled once per worker, not
    once per task. Configs are not cached: each unit gets its own copy, and user
    code that changes its config changes nothing beyond its unit.
    """

    def __init__(self, value: Any, cached: bool = False) -> None:
        import hashlib

        import cloudpickle

        self.data = cloudpickle.dumps(value)
        self.digest = hashlib.sha1(self.data).hexdigest() if cached else None

    def value(self) -> Any:
        """Run on the worker: the value, from this worker's cache when it has it."""
        if self.digest in _UNPICKLED:
            return _UNPICKLED[self.digest]
        value = pickle.loads(self.data)  # task data, as Dask's own
        if self.digest is not None:
            if len(_UNPICKLED) >= 8:  # the specs of a few sessions at most
                _UNPICKLED.pop(next(iter(_UNPICKLED)))
            _UNPICKLED[self.digest] = value
        return value


# Worker process: the specs of recent tasks, unpickled, by the digest of their bytes.
_UNPICKLED: dict[str, Any] = {}


def _call(fn: Callable, args: tuple, kwargs: dict, *inputs: Any) -> Any:
    """Run on the worker: ``fn`` with the inputs' values in their places."""
    args = tuple(inputs[a.index] if isinstance(a, _Input) else
                 a.value() if isinstance(a, _Pickled) else a  # task data, as Dask's own
                 for a in args)
    return fn(*args, **kwargs)


def _portable(fn: Callable, args: tuple, kwargs: dict) -> tuple:
    """``(payload, *input futures)``, the arguments of ``_RUNNER`` that runs ``fn``."""
    inputs = [a for a in args if _is_future(a)]
    template = tuple(_Input(inputs.index(a)) if _is_future(a) else a for a in args)
    task = functools.partial(_call, fn, template, kwargs)
    try:  # our task functions and their arguments are plain data: the fast pickler takes them
        payload = pickle.dumps(task, protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, TypeError, AttributeError):
        payload = None
    # pickle names functions (a loader, a transform) by module: one defined in the
    # driver's script is __main__.<name>, which a worker's own __main__ lacks. cloudpickle
    # sends those by value.
    if payload is None or b"__main__" in payload:
        import cloudpickle

        payload = cloudpickle.dumps(task)
    return (payload, *inputs)


@dataclass(frozen=True)
class _Pending:
    kind: str           # "train", "place", "evaluate"
    instruction: Command
    worker: str | None  # the worker the task is pinned to (None: any)
    sequence: int       # submission order: completions are handled in it
    prior: Any = None   # train: the state the unit started from (a retry starts there again)


def _backoff(attempt: int) -> float:
    """Seconds a load waits after ``attempt`` failed loads in a row: 0, 1, 2, 4, ... 30."""
    return 0.0 if attempt <= 0 else min(2.0 ** (attempt - 1), 30.0)


def _is_future(value: Any) -> bool:
    return hasattr(value, "key") and hasattr(value, "status")


def _gone(future: Any) -> bool:
    """A future whose data no worker holds any more: cancelled, or lost. Dask reports a
    key "lost" when its last copy died with a worker; that copy need not be on the
    worker that computed it (the Active Memory Manager drops the extra copies a
    transfer makes, such as a state copied to an evaluation shard's worker)."""
    return future.cancelled() or future.status == "lost"


def _cancel_reason(future: Any) -> str:
    """Why Dask cancelled ``future``, as its exception says (e.g. a lost connection)."""
    try:
        future.result(timeout=0)
    except CancelledError as err:
        return str(getattr(err, "reason", None) or err) or "cancelled"
    except BaseException as err:  # not cancelled after all
        return f"{type(err).__name__}: {err}"
    return "cancelled"


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
        gpus, workers_per_gpu: that LocalCluster's GPUs (see :func:`start_local_cluster`).
    """

    def __init__(self, client: Any = None, *, n_workers: int | None = None,
                 gpus: Sequence[str] | str | None = None, workers_per_gpu: int = 1) -> None:
        from distributed import Client

        self._cluster = None
        self._own_client = False
        if client is None:
            self._cluster = start_local_cluster(n_workers, gpus=gpus, workers_per_gpu=workers_per_gpu)
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
        self._partitions: dict[tuple[int, str], Any] = {}  # (partition, worker) -> future of PartitionData
        self._pending: dict[Any, _Pending] = {}      # future -> what it is
        self._evaluations: dict[int, list] = {}       # model -> its evaluation futures
        self._eval_workers: dict[int, set[str]] = {}  # model -> the workers its evaluation uses
        self._evaluated: list[tuple[Evaluate, list]] = []  # evaluations finished, results not yet read
        self._configs: dict[int, _Pickled] = {}        # model -> its config, pickled once
        self._stale: set[Any] = set()                 # train futures whose result is discarded
        self._runs: dict[int, dict[str, Any]] = {}    # model -> worker -> future of its unit in flight
                                                      # (two while a speculative copy races it)
        self._run_prior: dict[int, Any] = {}          # model -> the state its unit in flight started from
        self._reported_lost: set[str] = set()         # keys of cancelled states already reported
        self._cancelled: list[tuple[float, Any]] = []  # (when to cancel again, future)
        self._known_workers = set(self.workers())
        self._next_worker_check = self._next_quiet_check = 0.0
        self._lost_workers: set[str] = set()  # seen lost and not seen again since
        self._counter = itertools.count()
        self._session = uuid.uuid4().hex[:8]
        self._ready: list[Completion] = []    # events found outside poll, reported by the next
        self._progress_asks: list[tuple[concurrent.futures.Future, dict]] = []  # see _ask_progress
        self._holders: dict[Any, str] = {}     # state future key -> the worker it was made on
        self._idle_delay = 0.01                # poll's sleep when nothing is in flight
        # The tasks announce what runs on their worker (see _exclusive) in the scheduler's
        # event log under this topic; the driver reads it only when a worker is lost.
        self._topic = f"cerebro-executing-{self._session}"

    # ------------------------------------------------------------- set-up
    def workers(self) -> list[str]:
        # Asked of the scheduler each time: Client.scheduler_info() returns a cache that
        # the client's periodic refresh overwrites with an identity holding no workers,
        # and a read racing that refresh saw every worker lost.
        return sorted(self.client.sync(self.client.scheduler.identity, n_workers=-1)["workers"])

    def wait_for_workers(self, n: int, timeout: float | None) -> None:
        try:
            self.client.wait_for_workers(n, timeout=timeout)
        except TIMEOUTS:
            raise TimeoutError(f"min_workers is {n}, but only {len(self.workers())} workers joined "
                               f"the cluster at {self.client.scheduler.address} within {timeout} s") from None
        self._known_workers = set(self.workers())

    def _running_on(self, worker: str) -> dict | None:
        """What ``worker`` ran when it was last heard of (``{"model", "partition"}``, or
        None: nothing, or unknown), from the announcements in the scheduler's event log.

        Read, not subscribed to: the scheduler pushes a topic's events to its
        subscribers, and one arriving in the 2 ms batch of a reconnecting client's
        stream-start breaks distributed's reconnect (``assert len(msg) == 1`` in
        ``Client._ensure_connected``), which a test that drops the connection hit."""
        try:
            events = self.client.get_events(self._topic)
        except Exception as err:  # a client or scheduler going away: unknown
            logger.debug("reading the announcements of %s failed: %r", worker, err)
            return None
        for _, msg in reversed(events):
            if msg.get("worker") == worker:
                return {"model": msg["model"], "partition": msg["partition"]} if msg["running"] else None
        return None

    def bind(self, spec: TrainingSpec, data: PartitionedDataset, threads: int,
             deterministic: bool = True) -> None:
        import cloudpickle

        try:
            cloudpickle.dumps(spec)
        except Exception as err:
            raise TypeError(f"the TrainingSpec cannot be pickled for the Dask workers ({err}); "
                            "define model_fn, optimizer_fn and loss_fn so that cloudpickle can "
                            "send them (no open files, locks or live connections)") from None
        self.spec, self.data, self.threads, self.deterministic = spec, data, threads, deterministic
        self._spec = _Pickled(spec, cached=True)

    def devices(self, workers: Sequence[str] | None = None) -> dict[str, str]:
        """What each worker (or each of ``workers``) runs units on (``"cpu"`` or
        ``"cuda:<GPU model>"``); a worker that fails to answer (it is leaving) is left out."""
        answers = self.client.run(describe_device, self.spec, workers=list(workers) if workers else None,
                                  on_error="return")
        return {w: d for w, d in answers.items() if isinstance(d, str)}

    def add_model(self, model_id: int, config: Mapping[str, Any], seed: int,
                  state: dict | None = None, epoch: int = 0, *,
                  fresh_hyperparameters: bool = False) -> str | None:
        record = self._models[model_id] = ModelRecord(config, seed)
        self._configs[model_id] = _Pickled(dict(config))
        if fresh_hyperparameters:
            record.fresh_at = epoch
        if state is None:
            return None
        # Resumed from a checkpoint: the state goes to one worker once, and the driver
        # keeps its copy, which a rollback uses if that worker dies.
        record.durable = (epoch, state)
        live = sorted(self._known_workers - self._lost_workers)
        worker = live[model_id % len(live)] if live else None
        try:
            if worker is None:
                raise OSError("no live worker")
            [record.current] = self.client.scatter([state], workers=[worker], hash=False,
                                                   timeout=SCATTER_TIMEOUT)
        except Exception as err:  # the first unit then carries the driver's copy
            logger.warning("sending model %d's resumed state to a worker failed (%r); its first "
                           "unit takes it from the driver", model_id, err)
            record.current, worker = state, None
        else:
            self._holders[record.current.key] = worker
        record.keep_end(epoch, record.current)
        return worker

    def add_fork(self, model_id: int, config: Mapping[str, Any], seed: int, parent_id: int,
                 epoch: int, state: dict) -> str | None:
        """The fork starts from the parent's state where it lies (no data moves now);
        the driver's copy ``state`` is its fallback if that worker dies."""
        start = self._models[parent_id].ends.get(epoch)
        if not _is_future(start):
            return self.add_model(model_id, config, seed, state, epoch, fresh_hyperparameters=True)
        record = self._models[model_id] = ModelRecord(config, seed, current=start, durable=(epoch, state),
                                                      fresh_at=epoch)
        self._configs[model_id] = _Pickled(dict(config))
        record.keep_end(epoch, start)
        return self._holders.get(start.key)

    # ---------------------------------------------------------- instructions
    def execute(self, ins: Command) -> None:
        unreachable = self._unreachable(ins)
        if unreachable:
            logger.info("not sent: %r needs a worker that was lost", ins)
            self._ready.extend(Completion(e) for e in unreachable)
            return
        if isinstance(ins, Place):
            self._place(ins)
        elif isinstance(ins, Train):
            self._train(ins)
        elif isinstance(ins, Evaluate):
            self._evaluate(ins)
        elif isinstance(ins, Discard):
            self._discard_run(ins)
        elif isinstance(ins, AskProgress):
            self._ask_progress(ins)
        elif isinstance(ins, Drop):
            future = self._partitions.pop((ins.partition, ins.worker), None)
            if future is not None:
                future.release()  # the worker frees it (and its disk cache)
        elif isinstance(ins, Rollback):
            self._discard_in_flight(ins.model_id)
            self._models[ins.model_id].rollback(ins.epoch, ins.durable)
        elif isinstance(ins, Release):
            self._discard_in_flight(ins.model_id)
            record = self._models[ins.model_id]
            record.current, record.ends, record.durable = None, {}, None
        else:
            raise TypeError(f"{ins!r} is not a command an executor carries out")

    def _unreachable(self, ins: Command) -> list[Event]:
        """How ``ins`` ends when it needs a worker this executor has already seen lost.
        A poll can return completions and then the WorkerLost they preceded, and a
        completion handled first may send work to that worker. Submitted, it would
        wait for the worker forever; instead what happened is reported at the next
        poll, after the WorkerLost, and the scheduler decides (a unit or load on a lost
        worker is stale to it; a shard gone from a live worker is placed again)."""
        lost = f"its worker {getattr(ins, 'worker', '')} was lost"
        if isinstance(ins, Place) and ins.worker in self._lost_workers:
            return [PlaceFailed(ins.partition, ins.worker, lost)]
        if isinstance(ins, Train) and ins.worker in self._lost_workers:
            return [UnitCancelled(ins.model_id, ins.partition, ins.worker, lost)]
        if isinstance(ins, Evaluate):
            return [PartitionLost(p, w) for p, w in self._shard_holders(ins) if (p, w) not in self._partitions]
        return []

    def _submit(self, kind: str, ins: Command, worker: str | None, fn, *args, key: str,
                prior: Any = None, **kwargs: Any):
        pin = dict(workers=[worker], allow_other_workers=False) if worker else {}
        future = self.client.submit(_RUNNER, *_portable(fn, args, kwargs),
                                    key=f"cerebro-{kind}-{key}-{self._session}-{next(self._counter)}",
                                    pure=False, **pin)
        self._pending[future] = _Pending(kind, ins, worker, next(self._counter), prior)
        return future

    def _place(self, ins: Place) -> None:
        source = self.data.sources[ins.partition]
        if getattr(source, "in_memory", False):
            # The driver holds this shard: send it to its worker directly.
            try:
                [source] = self.client.scatter([source], workers=[ins.worker], hash=False,
                                               timeout=SCATTER_TIMEOUT)
            except Exception as err:  # the worker left, or the connection failed: say so
                logger.warning("sending partition %d to %s failed (%r)", ins.partition, ins.worker, err)
                self._ready.append(Completion(PlaceFailed(
                    ins.partition, ins.worker, f"sending its shard failed: {type(err).__name__}: {err}")))
                return
        self._submit("place", ins, ins.worker, _load, source, self._session, *self._persisted_inputs(source),
                     key=f"p{ins.partition}", topic=self._topic, partition=ins.partition,
                     delay=_backoff(ins.attempt))

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
        if ins.copy:  # a speculative copy starts where the unit it races started
            prior = self._run_prior.get(ins.model_id, record.current)
        else:
            if ins.step == 0:
                record.ends = {e: s for e, s in record.ends.items() if e == ins.epoch}
            prior = self._run_prior[ins.model_id] = record.current
            self._runs[ins.model_id] = {}
        future = self._submit(
            "train", ins, ins.worker, _train_task, self._spec, self._configs[ins.model_id], prior,
            self._partitions[(ins.partition, ins.worker)], record.seed, ins.epoch, ins.partition, ins.step,
            ins.epoch_end, self.threads, self.unit_timeout, self._topic, ins.model_id,
            record.fresh_hyperparameters(ins.epoch, ins.step), self.deterministic,
            key=f"m{ins.model_id}-e{ins.epoch}-p{ins.partition}",
            prior=prior)
        self._runs.setdefault(ins.model_id, {})[ins.worker] = future
        self._hold(future, ins.worker)
        if ins.copy:
            return  # the unit it races stays the model's state until one of them is discarded
        record.current = future
        if ins.epoch_end:
            record.keep_end(ins.epoch + 1, future)

    def _discard_run(self, ins: Discard) -> None:
        """One run of a unit no longer counts: in a race the other one's state is the
        model's; a restarted unit runs again from the state it started from."""
        runs = self._runs.get(ins.model_id, {})
        loser = runs.pop(ins.worker, None)
        if loser is None:
            return
        record = self._models[ins.model_id]
        for winner in runs.values():
            self._hand_over(record, loser, winner)
        if ins.restart and not runs:
            if record.current is loser:  # None is a prior too: a model's initial weights
                pending = self._pending.get(loser)
                record.current = pending.prior if pending is not None else self._run_prior[ins.model_id]
            record.ends = {e: s for e, s in record.ends.items() if s is not loser}
        if loser in self._pending:  # still running: stopped; its completion frees its worker
            self._stale.add(loser)
            self._cancel(loser)
            self._abandon({ins.worker: [loser.key]})

    def _ask_progress(self, ins: AskProgress) -> None:
        """Ask the workers how far the runs have come, in one round trip to all of them
        that the driver does not wait for: the answers are reported by the first poll
        after they arrive. A run not yet started there, or a worker that does not
        answer within PROGRESS_TIMEOUT, is not reported: the scheduler falls back on
        the clock."""
        asked: dict[str, dict[str, tuple[int, int]]] = {}  # worker -> unit key -> (model, partition)
        for model_id, partition, worker in ins.runs:
            future = self._runs.get(model_id, {}).get(worker)
            if future is not None and future in self._pending and worker not in self._lost_workers:
                asked.setdefault(worker, {})[future.key] = (model_id, partition)
        if not asked:
            return
        keys = [key for units in asked.values() for key in units]
        # Client.run with a time limit (what Client.run does, which takes none)
        answer = asyncio.wait_for(self.client._run(_units_progress, keys, workers=list(asked), on_error="return"),
                                  PROGRESS_TIMEOUT)
        self._progress_asks.append((asyncio.run_coroutine_threadsafe(answer, self.client.loop.asyncio_loop), asked))

    def _progress_answers(self) -> list[Completion]:
        """UnitProgress for every answer to an AskProgress that has arrived."""
        out: list[Completion] = []
        done = [a.done() for a, _ in self._progress_asks]  # once: an answer may arrive meanwhile
        arrived = [ask for ask, d in zip(self._progress_asks, done) if d]
        self._progress_asks = [ask for ask, d in zip(self._progress_asks, done) if not d]
        for answer, asked in arrived:
            try:
                answers = answer.result()
            except Exception as err:  # slow or leaving workers: no answer this time
                logger.debug("asking %s for their units' progress failed: %r", sorted(asked), err)
                continue
            for worker, found in answers.items():
                if not isinstance(found, dict) or worker not in asked:
                    continue  # the worker's error, returned
                for key, (fraction, seconds) in found.items():
                    model_id, partition = asked[worker][key]
                    out.append(Completion(UnitProgress(model_id, partition, worker, fraction, seconds)))
        return out

    def _hold(self, future: Any, worker: str) -> None:
        """Remember which worker makes a state; forget the states no model refers to."""
        self._holders[future.key] = worker
        if len(self._holders) > 4 * len(self._models) + 1000:
            used = {s.key for r in self._models.values() for s in (r.current, *r.ends.values())
                    if _is_future(s)}
            self._holders = {k: w for k, w in self._holders.items() if k in used}

    def _evaluate(self, ins: Evaluate) -> None:
        """One task per validation shard, on the worker holding it; the driver gathers
        the shards' results together (see ``_read_evaluations``) and combines them."""
        self._drop_evaluation(ins.model_id)  # a re-issued evaluation replaces the old one
        record = self._models[ins.model_id]
        state = record.ends[ins.epoch]
        holders = self._shard_holders(ins)
        if self.data.has_validation is False:
            # No validation rows anywhere: the evaluation is the epoch's training figures,
            # read from the state where it lies, in one task rather than one per partition.
            worker = self._holders.get(getattr(state, "key", None)) or holders[0][1]
            self._evaluations[ins.model_id] = [
                self._submit("evaluate", ins, worker, _training_figures, state,
                             key=f"m{ins.model_id}-e{ins.epoch}-progress")]
            self._eval_workers[ins.model_id] = {worker}
            return
        self._evaluations[ins.model_id] = [
            self._submit("evaluate", ins, w, _evaluate_task, self._spec, self._configs[ins.model_id], state,
                         self._partitions[(p, w)], record.seed, self.threads, self._topic, ins.model_id,
                         self.deterministic, key=f"m{ins.model_id}-e{ins.epoch}-p{p}")
            for p, w in holders]
        self._eval_workers[ins.model_id] = {w for _, w in holders}

    def _shard_holders(self, ins: Evaluate) -> list[tuple[int, str]]:
        """``(partition, worker)`` of each validation shard an evaluation reads: the
        holders it names, or (an instruction naming none) the first holder of each."""
        if ins.workers:
            return list(enumerate(ins.workers))
        first: dict[int, str] = {}
        for p, w in sorted(self._partitions):
            first.setdefault(p, w)
        return [(p, first.get(p, "")) for p in range(self.data.num_partitions)]

    def _discard_in_flight(self, model_id: int) -> None:
        """Results of this model's in-flight units no longer count (rollback, stop).
        They are cancelled: a unit waiting for an input that died with its worker would
        otherwise wait forever, and its worker with it. One already running is told to
        stop after its batch (Dask cannot interrupt a task); its result is dropped."""
        running: dict[str, list[str]] = {}
        for future, pending in self._pending.items():
            if pending.kind == "train" and pending.instruction.model_id == model_id:
                self._stale.add(future)
                self._cancel(future)
                running.setdefault(pending.worker, []).append(future.key)
        self._abandon(running)
        self._runs.pop(model_id, None)
        self._run_prior.pop(model_id, None)
        self._drop_evaluation(model_id)

    def _drop_evaluation(self, model_id: int) -> None:
        self._eval_workers.pop(model_id, None)
        for future in self._evaluations.pop(model_id, []):
            self._pending.pop(future, None)
            self._cancel(future)

    def _abandon(self, keys_by_worker: dict[str, list[str]]) -> None:
        """Stop discarded units that already run (Dask cannot interrupt a task; our
        units check after every batch), so their workers free up at once."""
        for worker, keys in keys_by_worker.items():
            if worker is None or worker in self._lost_workers:
                continue
            try:
                self.client.run(_abandon_units, keys, workers=[worker], wait=False)
            except Exception as err:  # the worker is going away: so is the unit
                logger.debug("stopping %s on %s failed: %r", keys, worker, err)

    def _forget_priors(self) -> None:
        """Let go of the start states of units that finished (a speculative copy could
        only start while the scheduler had not yet seen them end: not past this poll),
        so that a paused model holds one state on the cluster, not two."""
        if self._run_prior:
            running = {p.instruction.model_id for p in self._pending.values() if p.kind == "train"}
            for model_id in [m for m in self._run_prior if m not in running]:
                del self._run_prior[model_id]

    def _cancel(self, future: Any) -> None:
        """Cancel a future, and again a moment later: the scheduler builds a submitted
        task off its event loop, so a cancel that overtakes it finds no task and is
        dropped, and the task then runs and stays wanted by this client for good."""
        future.cancel()
        self._cancelled.append((time.monotonic() + RECANCEL_AFTER, future))

    def _cancel_again(self, everything: bool = False) -> None:
        now = time.monotonic()
        due = [f for when, f in self._cancelled if everything or when <= now]
        if not due:
            return
        self._cancelled = [(when, f) for when, f in self._cancelled if not (everything or when <= now)]
        try:
            self.client.cancel(due)
        except Exception as err:  # a cluster going away: nothing left to cancel
            logger.debug("cancelling %d futures again failed: %r", len(due), err)

    # ----------------------------------------------------------- completions
    def busy(self) -> bool:
        return bool(self._pending) or bool(self._ready) or bool(self._evaluated)

    def poll(self, timeout: float) -> list[Completion]:
        from distributed import wait
        from distributed.client import FuturesCancelledError

        self._cancel_again()
        self._forget_priors()
        out, self._ready = self._ready, []
        out.extend(self._progress_answers())
        out.extend(self._read_evaluations())
        if out:
            return out
        if not self._pending:
            # Nothing to wait on (every worker gone, say): sleep, backing off, rather
            # than return at once to a caller that would call again at once.
            self._idle_delay = idle_wait(self._idle_delay, timeout)
            return self._check_workers() or self._audit("the partition's future was cancelled")
        self._idle_delay = 0.01
        if self._progress_asks:  # answered within milliseconds, usually: report it then
            timeout = min(timeout, PROGRESS_POLL)
        try:
            done, _ = wait(list(self._pending), timeout=timeout, return_when="FIRST_COMPLETED")
        except TIMEOUTS:  # distributed raises rather than returning nothing
            done = set()
        except FuturesCancelledError:
            done = {f for f in self._pending if f.cancelled()}
        cancelled = [f for f in done if f.cancelled()]
        if cancelled:
            # A worker loss explains most cancellations (Dask cancels tasks whose inputs
            # died with a worker): report it first, so that the scheduler rolls back;
            # the cancelled futures are handled at the next poll, known to be stale.
            lost = self._check_workers()
            if lost:
                return lost
            out.extend(self._recover(cancelled))
        # A cancelled evaluation shard drops its siblings: they are no longer pending.
        finished = sorted((f for f in done if f in self._pending and not f.cancelled()),
                          key=lambda f: self._pending[f].sequence)
        for future in finished:
            pending = self._pending.pop(future, None)
            if pending is not None:  # a worker loss seen meanwhile may have dropped it
                out.extend(self._complete(future, pending))
        out.extend(self._progress_answers())
        if not out:
            out.extend(self._read_evaluations())
        if not out:  # nothing finished in time: has a worker come or gone, or data gone?
            if time.monotonic() >= self._next_quiet_check:  # polls can be short (speculation wake-ups)
                self._next_quiet_check = time.monotonic() + QUIET_CHECK_INTERVAL
                out.extend(self._check_workers() or self._audit("the partition's future was cancelled"))
        elif time.monotonic() >= self._next_worker_check:  # a busy cluster grows and shrinks too
            out.extend(self._check_workers() or self._audit("its only copy was on a lost worker"))
        return out

    def _recover(self, cancelled: list) -> list[Completion]:
        """Completions for futures cancelled while their workers live: our own
        cancellations of discarded units free their workers; any other (a client that
        reconnected loses every future; a user may cancel one) is reported, after the
        partitions and states it took with it."""
        out: list[Completion] = []
        foreign: list[tuple[Any, _Pending]] = []
        for future in sorted(cancelled, key=lambda f: self._pending[f].sequence):
            pending = self._pending.get(future)
            if pending.kind == "train" and future in self._stale:
                del self._pending[future]
                self._stale.discard(future)
                ins = pending.instruction  # a discarded unit: this frees its worker
                out.append(Completion(UnitDone(ins.model_id, ins.partition, ins.worker)))
            else:
                foreign.append((future, pending))
        if not foreign:
            return out
        reason = _cancel_reason(foreign[0][0])
        logger.warning("%d futures were cancelled although their workers live (%s); the lost "
                       "work runs again", len(foreign), reason)
        out.extend(self._audit(reason, cancelled_units={f for f, _ in foreign}))
        for future, pending in foreign:
            if self._pending.pop(future, None) is None:  # a shard of an evaluation dropped just now
                continue
            ins = pending.instruction
            if pending.kind == "train":
                self._undo_unit(future, pending)
                out.append(Completion(UnitCancelled(ins.model_id, ins.partition, ins.worker, reason)))
            elif pending.kind == "evaluate":
                self._drop_evaluation(ins.model_id)
                out.append(Completion(EvaluationCancelled(ins.model_id, ins.epoch, reason)))
            else:
                out.append(Completion(PlaceFailed(ins.partition, ins.worker, f"cancelled ({reason})")))
        return out

    def _undo_unit(self, future: Any, pending: _Pending) -> None:
        """Forget a train unit's output: the scheduler runs it again from the state it started from."""
        if pending.kind != "train":
            return
        record = self._models.get(pending.instruction.model_id)
        if record is None:
            return
        runs = self._runs.get(pending.instruction.model_id, {})
        for w in [w for w, f in runs.items() if f is future]:
            del runs[w]
        if runs:  # a speculative copy races it: that run becomes the unit
            self._hand_over(record, future, next(iter(runs.values())))
            return
        if record.current is future:
            record.current = pending.prior
        record.ends = {e: s for e, s in record.ends.items() if s is not future}

    @staticmethod
    def _hand_over(record: ModelRecord, loser: Any, winner: Any) -> None:
        """The state ``winner`` computes (the same bits) stands wherever ``loser``'s did."""
        if record.current is loser:
            record.current = winner
        record.ends = {e: winner if s is loser else s for e, s in record.ends.items()}

    def _recover_killed(self, future: Any, pending: _Pending, text: str) -> list[Completion]:
        """A task Dask stopped retrying because workers died running it: not an error
        of user code; the scheduler decides whether it runs again."""
        ins = pending.instruction
        if pending.kind == "train":
            stale = future in self._stale
            self._stale.discard(future)
            self._undo_unit(future, pending)
            event = UnitDone(ins.model_id, ins.partition, ins.worker) if stale else \
                UnitCancelled(ins.model_id, ins.partition, ins.worker, text)
            return [Completion(event)]
        if pending.kind == "evaluate":
            self._drop_evaluation(ins.model_id)
            return [Completion(EvaluationCancelled(ins.model_id, ins.epoch, text))]
        return [Completion(PlaceFailed(ins.partition, ins.worker, text))]

    def _audit(self, reason: str, cancelled_units: set | frozenset = frozenset()) -> list[Completion]:
        """PartitionLost and StatesLost for the data we hold whose futures were cancelled
        or lost, checked at every quiet poll and every second while busy: a client
        reconnect cancels them all, a state Dask cancels on its own (one it cannot
        recompute) comes with no change in the set of workers, and a state whose only
        copy was on a lost worker other than the one that computed it is lost without
        the scheduler knowing (Dask would recompute it on the dead worker: never).
        Each lost state is reported once."""
        out: list[Completion] = []
        for (p, w), future in sorted(self._partitions.items()):
            if _gone(future):
                del self._partitions[(p, w)]
                out.append(Completion(PartitionLost(p, w)))
        in_flight = {p.instruction.model_id: (f, p.prior) for f, p in self._pending.items()
                     if p.kind == "train" and f not in self._stale}
        for model_id, record in self._models.items():
            unit, prior = in_flight.get(model_id, (None, record.current))
            newest = _is_future(prior) and _gone(prior) and prior.key not in self._reported_lost
            lost_ends = {e: s for e, s in record.ends.items() if _is_future(s) and s is not unit
                         and _gone(s) and s.key not in self._reported_lost}
            if newest or lost_ends:
                self._reported_lost.update([s.key for s in lost_ends.values()] + ([prior.key] if newest else []))
                out.append(Completion(StatesLost(model_id, newest, tuple(sorted(lost_ends)))))
        if out:
            logger.warning("data the models need was lost (%s): %s", reason,
                           ", ".join(repr(c.event) for c in out[:5]) + (" ..." if len(out) > 5 else ""))
        return out

    def _read_evaluations(self) -> list[Completion]:
        """EvaluationDone, with its metrics, for every evaluation whose shards all
        finished: their results are read from the workers in one request and
        combined here. Called at the start of the poll after the one that saw them
        finish (whose completions have sent the workers new units meanwhile), or at
        its end when that poll had nothing else to report."""
        finished = [(ins, shards) for ins, shards in self._evaluated
                    if self._evaluations.get(ins.model_id) is shards]  # not dropped since
        self._evaluated = []
        out: list[Completion] = []
        for ins, shards in [(i, s) for i, s in finished if any(map(_gone, s))]:  # Dask would wait for it
            finished.remove((ins, shards))
            self._drop_evaluation(ins.model_id)
            out.append(Completion(EvaluationCancelled(ins.model_id, ins.epoch, "its result was lost")))
        if not finished:
            return out
        futures = [s for _, shards in finished for s in shards]
        give_up, attempt = time.monotonic() + FETCH_TIMEOUT, GATHER_TRY
        # One gather, waited for in short tries, each twice as long: a result whose
        # worker died meanwhile is rescheduled by Dask onto that worker (the task is
        # pinned to it), and the gather would wait for it until FETCH_TIMEOUT; between
        # tries, a lost worker ends the wait. The gather is left to end on its own
        # (once its futures are released): cancelling it orphans Dask's own waits,
        # which then print "Task exception was never retrieved ... AllExit".
        reading = asyncio.run_coroutine_threadsafe(_gather(self.client, futures), self.client.loop.asyncio_loop)
        while True:
            try:
                results = reading.result(timeout=max(0.0, min(attempt, give_up - time.monotonic())))
                break
            except (CancelledError, *TIMEOUTS) as err:  # a result died between "finished" and now
                lost = self._check_workers()
                if lost:
                    return lost
                if isinstance(err, CancelledError) or time.monotonic() >= give_up:
                    results, error = None, f"its result could not be read: {type(err).__name__}"
                    break
                attempt *= 2
        for ins, shards in finished:
            self._evaluations.pop(ins.model_id)
            self._eval_workers.pop(ins.model_id, None)
            for shard in shards:  # the metrics are here: free the keys now, not at GC
                shard.release()
            if results is None:
                out.append(Completion(EvaluationCancelled(ins.model_id, ins.epoch, error)))
                continue
            out.append(Completion(EvaluationDone(ins.model_id, ins.epoch), epoch_metrics(results[:len(shards)])))
            results = results[len(shards):]
        return out

    def _complete(self, future, pending: _Pending) -> list[Completion]:
        ins = pending.instruction
        if future.status == "finished":
            if pending.kind == "place":
                self._partitions[(ins.partition, ins.worker)] = future
                return [Completion(PartitionPlaced(ins.partition, ins.worker))]
            if pending.kind == "train":
                self._stale.discard(future)
                return [Completion(UnitDone(ins.model_id, ins.partition, ins.worker))]
            shards = self._evaluations.get(ins.model_id, [])
            if shards and all(s.status == "finished" for s in shards):
                for shard in shards:
                    self._pending.pop(shard, None)
                self._evaluated.append((ins, shards))
            return []
        if future.status != "error":
            return []
        error = future.exception()
        if pending.worker is not None and pending.worker not in self.workers():
            self._undo_unit(future, pending)  # the cluster lost the worker, not user code
            return self._check_workers()
        text = str(error) if isinstance(error, UnitError) else f"{type(error).__name__}: {error}"
        if type(error).__name__ == "KilledWorker":  # Dask gave up on a task whose workers died
            return self._check_workers() or self._recover_killed(future, pending, text)
        if pending.kind == "train":
            stale = future in self._stale
            self._stale.discard(future)
            if stale:  # a discarded unit: this frees its worker
                return [Completion(UnitDone(ins.model_id, ins.partition, ins.worker))]
            return [Completion(UnitFailed(ins.model_id, ins.partition, ins.worker, text))]
        if pending.kind == "evaluate":
            self._drop_evaluation(ins.model_id)  # its other shards no longer count
            return [Completion(EvaluationDone(ins.model_id, ins.epoch, text))]
        logger.warning("loading partition %d on %s failed: %s", ins.partition, ins.worker, text)
        return [Completion(PlaceFailed(ins.partition, ins.worker, text))]

    def _check_workers(self) -> list[Completion]:
        self._next_worker_check = time.monotonic() + WORKER_CHECK_INTERVAL
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
        running = self._running_on(worker)
        executing = None if running is None else Executing(running.get("model"), running.get("partition"))
        logger.warning("worker %s was lost%s", worker, "" if not running else
                       f" while it ran {'model' if running['model'] is not None else 'partition'} "
                       f"{running['model'] if running['model'] is not None else running['partition']}")
        self._known_workers.discard(worker)
        self._lost_workers.add(worker)
        # An evaluation with a shard on the lost worker would wait for it forever;
        # the scheduler evaluates again every model evaluating when a worker is lost.
        for model_id in [m for m, used in self._eval_workers.items() if worker in used]:
            self._drop_evaluation(model_id)
        for future, pending in list(self._pending.items()):
            if pending.worker == worker:
                del self._pending[future]
                self._stale.discard(future)
                self._cancel(future)
                self._undo_unit(future, pending)
        for key in [key for key in self._partitions if key[1] == worker]:
            del self._partitions[key]
        return [Completion(WorkerLost(worker, executing))]

    # --------------------------------------------------------------- states
    def state_fetcher(self, model_id: int, epoch: int | None = None) -> Callable[[float], dict]:
        record = self._models[model_id]
        state = record.current if epoch is None else record.ends.get(epoch)
        if state is None:
            raise ValueError(f"model {model_id} holds no trained state"
                             + ("" if epoch is None else f" after epoch {epoch}"))
        if not _is_future(state):  # the driver's own copy
            return lambda timeout=FETCH_TIMEOUT: state
        holder = self._holders.get(state.key)
        what = f"model {model_id}'s state" + ("" if epoch is None else f" after epoch {epoch}")

        def fetch(timeout: float = FETCH_TIMEOUT) -> dict:
            return self._fetch(state, holder, what, timeout)
        return fetch

    def _fetch(self, future: Any, holder: str | None, what: str, timeout: float) -> dict:
        """``future.result()`` in slices, giving up as soon as its worker is seen gone:
        a state whose worker died is recomputed (Dask would wait for that worker forever)."""
        deadline = time.monotonic() + timeout
        while True:
            if future.status in ("cancelled", "lost"):
                raise StateUnavailable(f"{what} was lost ({future.status}) with worker {holder}", lost=True)
            try:
                return future.result(timeout=max(0.01, min(1.0, deadline - time.monotonic())))
            except TIMEOUTS:
                pass
            except CancelledError:
                raise StateUnavailable(f"{what} was lost with worker {holder}", lost=True) from None
            if holder is not None and holder not in self.workers():
                raise StateUnavailable(f"{what} was lost with worker {holder}", lost=True)
            if time.monotonic() >= deadline:
                raise StateUnavailable(f"{what} did not reach the driver within {timeout} s "
                                       f"(worker {holder})", lost=False)

    def close(self) -> None:
        # Release every key this session made, at once: dropping the futures alone
        # leaves the ones caught in reference cycles until the garbage collector runs.
        held = [*self._pending, *(p.prior for p in self._pending.values()), *self._partitions.values(),
                *self._stale, *self._run_prior.values(),
                *(f for runs in self._runs.values() for f in runs.values()),
                *(f for futures in self._evaluations.values() for f in futures),
                *(f for r in self._models.values() for f in (r.current, *r.ends.values())
                  if f is not None and not isinstance(f, dict))]
        held = [f for f in held if _is_future(f)]
        for future in held:
            try:
                future.release()  # our reference only; idempotent
            except Exception as err:  # a cluster going away: nothing left to release
                logger.debug("releasing %s failed: %r", future.key, err)
        self._cancel_again(everything=True)
        for ask, _ in self._progress_asks:  # not left pending on a loop that may close now
            ask.cancel()
        self._progress_asks.clear()
        self._pending.clear()
        self._runs.clear()
        self._run_prior.clear()
        self._evaluations.clear()
        self._stale.clear()
        self._partitions.clear()
        self._models.clear()
        # A Future caught in a reference cycle (an exception's traceback, say) keeps its
        # key wanted until the garbage collector runs: collect now, so none outlives us.
        gc.collect()
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

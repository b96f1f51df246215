"""What runs on the workers: loading a partition, training and evaluating a unit,
the progress of running units, scratch folders, and the workers' warm-up.

A worker process runs one of these tasks at a time whatever its thread count
(torch's seeds and thread settings are process-wide), and announces what it runs
in the Dask scheduler's event log (the driver reads it when the worker dies), so
that the work it was running, not the work queued behind it, counts against its
model's retries.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import threading
import time
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, cast

from distributed.diagnostics.plugin import WorkerPlugin

from ...training import (
    EvalResult,
    abandon_when,
    clear_models,
    evaluate_unit,
    group_figures,
    progress_to,
    train_unit,
)
from ...training.base import set_worker_name

if TYPE_CHECKING:
    from ...data.partition import PartitionData
    from ...training import TrainingSpec
    from ...training.transfer import State

__all__ = [
    "load",
    "train_task",
    "running_unit",
    "evaluate_task",
    "training_figures",
    "units_progress",
    "remove_scratch",
    "read_fingerprints",
    "warm_up",
    "forget_models",
    "WarmUp",
]

# One of our tasks at a time per worker process, whatever its thread count: a unit
# seeds torch's global RNG and sets its thread count, and an evaluation beside it
# (fork_rng restores the RNG when it ends) would change the unit's bits.
_TASK_LOCK = threading.Lock()

# Worker process: how far each of our running units has come, by key: [fraction of its
# rows trained, time.perf_counter() when its first batch began]. Units update it
# after every batch.
_UNIT_PROGRESS: dict[str, list[float]] = {}


@contextlib.contextmanager
def _exclusive(topic: str | None, model_id: int | None = None, partition: int | None = None) -> Iterator[None]:
    """Hold the worker's task lock; tell the driver (on ``topic``) what runs meanwhile."""
    with _TASK_LOCK:
        _name_this_worker()
        _announce(topic, model_id, partition, True)
        try:
            yield
        finally:
            _announce(topic, model_id, partition, False)


def _name_this_worker() -> None:
    """Give errors raised here (a frozen base that differs) this worker's address."""
    try:
        from distributed import get_worker

        set_worker_name(get_worker().address)
    except ValueError:  # not inside a worker (a client-side test of the task)
        pass


def _announce(topic: str | None, model_id: int | None, partition: int | None, running: bool) -> None:
    if topic is None:
        return
    try:
        from distributed import get_worker

        worker = get_worker()
    except ValueError:  # not inside a worker (a client-side test of the task)
        return
    worker.log_event(topic, {"worker": worker.address, "model": model_id, "partition": partition, "running": running})


def _scratch(tag: str, cache_dir: str | None, dask_worker: Any = None) -> str:
    """This session's folder for disk-cached partitions on this worker: under
    ``cache_dir``, or the Dask worker's own ``local_directory``."""
    if dask_worker is None:
        from distributed import get_worker

        dask_worker = get_worker()
    return os.path.join(cache_dir or dask_worker.local_directory, f"cerebro-cache-{tag}")


def remove_scratch(tag: str, cache_dir: str | None, dask_worker: Any = None) -> None:
    """Runs on a worker (``Client.run``): delete session ``tag``'s disk-cached partitions."""
    shutil.rmtree(_scratch(tag, cache_dir, dask_worker), ignore_errors=True)


def load(
    source: Any, tag: str, *external: Any, topic: str | None = None, partition: int | None = None, delay: float = 0.0
) -> Any:
    """Load one partition from ``source`` (its disk cache under session ``tag``'s folder)."""
    time.sleep(delay)  # a retried load backs off, without holding the lock
    options = getattr(source, "options", None)
    scratch = None
    if options is not None and options.cache == "disk":
        scratch = _scratch(tag, options.cache_dir)
        os.makedirs(scratch, exist_ok=True)
    with _exclusive(topic, partition=partition):
        return source.load(*external, scratch=scratch)


def read_fingerprints(keys: list[str], dask_worker: Any = None) -> dict[str, dict]:
    """Runs on a worker (``Client.run``): the fingerprint of each partition of ``keys``
    it holds, taken when the partition loaded."""
    return {k: dask_worker.data[k].fingerprint for k in keys if k in dask_worker.data}


def warm_up() -> None:
    """Import what torch imports lazily in a unit's first optimizer step (torch._dynamo:
    1.5 s here). :class:`WarmUp` does it when a worker joins a session; a unit calls it
    again (at no cost then) before its clock starts, so that a worker that missed the
    plugin does not count the imports against unit_timeout."""
    import torch._dynamo  # noqa: F401


class WarmUp(WorkerPlugin):
    """A worker plugin that warms each worker up (see :func:`warm_up`) when the session
    starts and whenever a worker joins, off the event loop, so that no unit pays it.

    >>> client.register_plugin(WarmUp(), name=WarmUp.name)  # doctest: +SKIP
    """

    name = "cerebro-automl-warm-up"
    idempotent = True  # registered once per cluster: later sessions find their workers warm

    async def setup(self, worker: Any) -> None:
        await asyncio.get_running_loop().run_in_executor(None, warm_up)


def units_progress(keys: list[str]) -> dict[str, tuple[float, float]]:
    """Runs on the worker's event loop (``Client.run``): ``key -> (fraction, seconds
    training)`` for those of ``keys`` that train there now."""
    now = time.perf_counter()
    found = {k: _UNIT_PROGRESS.get(k) for k in keys}  # a unit may end meanwhile, on its thread
    return {k: (p[0], now - p[1]) for k, p in found.items() if p is not None}


def train_task(
    spec: TrainingSpec,
    config: Mapping[str, Any],
    state: State | None,
    partition: PartitionData,
    seed: int,
    epoch: int,
    index: int,
    step: int,
    epoch_end: bool,
    threads: int,
    unit_timeout: float | None,
    topic: str | None = None,
    model_id: int | None = None,
    fresh_hyperparameters: bool = False,
    deterministic: bool = True,
    budget: int | None = None,
    partitions: int | None = None,
) -> State:
    """One unit on the worker holding ``partition``: :func:`~cerebro_automl.training.train_unit`
    under the task lock, reporting its progress and stopping when abandoned."""
    with running_unit(topic, model_id):
        return train_unit(
            spec,
            config,
            state,
            partition.train,
            seed=seed,
            epoch=epoch,
            partition=index,
            step=step,
            epoch_end=epoch_end,
            threads=threads,
            unit_timeout=unit_timeout,
            fresh_hyperparameters=fresh_hyperparameters,
            deterministic=deterministic,
            budget=budget,
            partitions=partitions,
        )


@contextlib.contextmanager
def running_unit(topic: str | None, model_id: int | None) -> Iterator[None]:
    """Run a train unit (or a gang unit's rank) as this task: under the worker's task
    lock, announced, its progress reported after every batch, and stopped after its
    batch once the driver cancels it."""
    from distributed import get_worker

    warm_up()
    worker = get_worker()
    key = cast(str, worker.get_current_task())  # we submit it under a string key

    def report(fraction: float) -> None:
        progress = _UNIT_PROGRESS.get(key)
        if progress is None:
            _UNIT_PROGRESS[key] = [fraction, time.perf_counter()]
        else:
            progress[0] = fraction

    with _exclusive(topic, model_id), abandon_when(lambda: _cancelled(worker, key)):
        try:
            with progress_to(report):
                yield
        finally:
            _UNIT_PROGRESS.pop(key, None)


def _cancelled(worker: Any, key: str) -> bool:
    """Whether the driver has cancelled (or released) this running task. Dask cannot
    interrupt a task, but its worker marks it cancelled at once, with no message of
    ours to a worker that may be dead and not yet known so."""
    task = worker.state.tasks.get(key)
    return task is None or task.state == "cancelled"


def evaluate_task(
    spec: TrainingSpec,
    config: Mapping[str, Any],
    state: State,
    partition: PartitionData,
    seed: int,
    threads: int,
    topic: str | None = None,
    model_id: int | None = None,
    deterministic: bool = True,
) -> EvalResult:
    """One validation shard's share of an evaluation, under the task lock."""
    with _exclusive(topic, model_id):
        return evaluate_unit(
            spec, config, state, partition.valid, seed=seed, threads=threads, deterministic=deterministic
        )


def training_figures(state: dict) -> EvalResult:
    """An evaluation without validation data: the epoch's training figures alone."""
    if "members" in state:
        return group_figures(state)
    return EvalResult(None, {}, 0, 0.0, state["progress"])


def forget_models(spec_digest: str) -> None:
    """Run on a worker: drop the modules kept for the spec whose pickled bytes have
    ``spec_digest`` (see :func:`~cerebro_automl.training.clear_models`)."""
    from .wire import cached_value

    spec = cached_value(spec_digest)
    if spec is not None:
        clear_models(spec)
